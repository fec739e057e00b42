/*
 * Entries in and dead letters out (consumer/internal.h): the check of an
 * entry against the stream contract before its handler sees it, and the move
 * of an entry to the dead-letter stream.
 *
 * Dead letters go through a Redis function (functions/outbox_consumer.lua),
 * loaded on every connect, that adds the dead letter (XADD) and acknowledges
 * the entry (XACK) only if the add succeeded, so an entry is never both gone
 * and not recorded. MULTI/EXEC cannot promise that: Redis does not roll a
 * transaction back, so an XADD refused at EXEC (the dead-letter key holding a
 * string) still let the XACK run. A refused dead letter leaves the entry
 * pending; a later pass delivers it again and dead-letters it once the cause
 * is fixed. A lost entry is no longer pending, so a refused "lost" record is
 * not tried again.
 */
#include "common/compat.h"

#include "consumer/internal.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/common.h"
#include "common/entry.h"
#include "common/functions.h"

int outbox_msg_lease_lost(const redisReply *r)
{
    return r != NULL && r->type == REDIS_REPLY_ERROR && strncmp(r->str, "LEASELOST", 9) == 0;
}

const char *outbox_msg_parse(const redisReply *fields, struct outbox_message *m, const char **names,
                             const char **values, size_t *vlens)
{
    size_t len;
    const redisReply *v;
    if (fields == NULL || fields->type != REDIS_REPLY_ARRAY || fields->elements % 2 != 0)
        return "the entry has no field list";
    if ((v = outbox_msg_field(fields, "id", &len)) == NULL || len == 0)
        return "the entry has no \"id\" field (it was not written by outbox-relay)";
    m->id = v->str;
    if ((v = outbox_msg_field(fields, "topic", NULL)) == NULL)
        return "the entry has no \"topic\" field";
    m->topic = v->str;
    if ((v = outbox_msg_field(fields, "payload", &len)) == NULL)
        return "the entry has no \"payload\" field";
    m->payload = v->str;
    m->payload_len = len;
    if ((v = outbox_msg_field(fields, "created_at", NULL)) == NULL)
        return "the entry has no \"created_at\" field";
    m->created_at = v->str;
    if ((v = outbox_msg_field(fields, "outbox_id", NULL)) == NULL)
        return "the entry has no \"outbox_id\" field";
    char *end;
    errno = 0;
    m->outbox_id = strtoll(v->str, &end, 10);
    if (errno != 0 || *end != '\0' || end == v->str)
        return "the \"outbox_id\" field is not a number";
    if ((v = outbox_msg_field(fields, "key", &len)) != NULL) {
        m->key = v->str;
        m->key_len = len;
    }
    size_t nh = 0;
    for (size_t i = 0; i + 1 < fields->elements; i += 2) {
        const redisReply *k = fields->element[i], *val = fields->element[i + 1];
        if (k->type != REDIS_REPLY_STRING || val->type != REDIS_REPLY_STRING ||
            strncmp(k->str, "h.", 2) != 0)
            continue;
        if (nh == OUTBOX_HEADERS_MAX)
            return "the entry has more headers than the contract allows";
        names[nh] = k->str + 2;
        values[nh] = val->str;
        vlens[nh] = val->len;
        nh++;
    }
    m->nheaders = nh;
    m->header_names = names;
    m->header_values = values;
    m->header_value_lens = vlens;
    return NULL;
}

/* A field's value, and its length when len is not NULL. */
const redisReply *outbox_msg_field(const redisReply *fields, const char *name, size_t *len)
{
    const redisReply *v = outbox_entry_field(fields, name);
    if (v != NULL && len != NULL)
        *len = v->len;
    return v;
}

const char *outbox_msg_key(const redisReply *entry, size_t *len)
{
    const redisReply *fields = entry->element[1];
    if (fields->type != REDIS_REPLY_ARRAY)
        return NULL;
    const redisReply *k = outbox_msg_field(fields, "key", len);
    return k != NULL ? k->str : NULL;
}

static void rfc3339_now(char *out, size_t outlen)
{
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    char base[32];
    strftime(base, sizeof(base), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, outlen, "%.19s.%06dZ", base, (int)(ts.tv_nsec / 1000));
}

/* A command's arguments as it is built. */
struct argv_buf {
    const char **argv;
    size_t *lens;
    int argc;
};

static void arg_add(struct argv_buf *a, const char *s, size_t len)
{
    a->argv[a->argc] = s;
    a->lens[a->argc] = len;
    a->argc++;
}

static void arg_str(struct argv_buf *a, const char *s)
{
    arg_add(a, s, strlen(s));
}

/* FCALL of the dead-letter function for one entry: the entry's own fields
 * (not its "dlq." ones), then the dead-letter fields. count and when are the
 * caller's buffers, alive until the command is sent. a has room for
 * 7 + the fields + 16 arguments. */
static void dead_letter_args(struct argv_buf *a, const struct outbox_consumer *c,
                             const char *stream, const struct lease_ref *lease,
                             const char *entry_id, const redisReply *fields, size_t nf,
                             const char *reason, const char *error, const char *count,
                             const char *when)
{
    arg_str(a, "FCALL");
    if (lease != NULL) {
        arg_str(a, OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER_LEASED);
        arg_str(a, "3");
        arg_str(a, lease->dlq);
        arg_str(a, stream);
        arg_str(a, lease->key);
        arg_str(a, c->group);
        arg_str(a, lease->token);
    } else {
        arg_str(a, OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER);
        arg_str(a, "2");
        arg_str(a, c->dlq);
        arg_str(a, stream);
        arg_str(a, c->group);
    }
    arg_str(a, entry_id);
    for (size_t i = 0; i + 1 < nf; i += 2) {
        const redisReply *k = fields->element[i], *v = fields->element[i + 1];
        if (k->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING)
            continue;
        if (strncmp(k->str, "dlq.", 4) == 0)
            continue; /* a replayed entry carries none, but never copy them twice */
        arg_add(a, k->str, k->len);
        arg_add(a, v->str, v->len);
    }
    const char *const tail[] = {
        OUTBOX_DLQ_FIELD_STREAM,     stream,      OUTBOX_DLQ_FIELD_GROUP,  c->group,
        OUTBOX_DLQ_FIELD_CONSUMER,   c->consumer, OUTBOX_DLQ_FIELD_ENTRY,  entry_id,
        OUTBOX_DLQ_FIELD_DELIVERIES, count,       OUTBOX_DLQ_FIELD_REASON, reason,
        OUTBOX_DLQ_FIELD_ERROR,      error,       OUTBOX_DLQ_FIELD_TIME,   when,
    };
    for (size_t i = 0; i < sizeof(tail) / sizeof(tail[0]); i++)
        arg_str(a, tail[i]);
}

int outbox_msg_dead_letter(struct outbox_consumer *c, const char *stream,
                           const struct lease_ref *lease, const char *entry_id,
                           const redisReply *fields, const char *reason, const char *error,
                           uint32_t deliveries)
{
    if (c->wr == NULL)
        return -1;
    size_t nf = fields != NULL && fields->type == REDIS_REPLY_ARRAY ? fields->elements : 0;
    size_t argc_max = 9 + nf + 16;
    struct argv_buf a = {calloc(argc_max, sizeof(*a.argv)), calloc(argc_max, sizeof(*a.lens)), 0};
    int rc = -1;
    if (a.argv == NULL || a.lens == NULL) {
        outbox_report_set_error(c, OUTBOX_CONSUMER_ERR_OOM, "out of memory for a dead letter");
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_ERROR,
                           "dead-lettering %s %s failed: out of memory; the entry stays pending",
                           stream, entry_id);
        goto out;
    }
    char count[16], when[40];
    snprintf(count, sizeof(count), "%u", deliveries);
    rfc3339_now(when, sizeof(when));
    dead_letter_args(&a, c, stream, lease, entry_id, fields, nf, reason, error, count, when);
    redisReply *r = outbox_conn_command(c->wr, a.argc, a.argv, a.lens);
    if (r == NULL) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO,
                              "Redis connection lost while dead-lettering %s %s: %s", stream,
                              entry_id, c->wr->errstr);
        outbox_conn_close_all(c);
        goto out;
    }
    if (r->type == REDIS_REPLY_STRING) {
        c->stats.dead_lettered++;
        outbox_report_clear_error(c);
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_WARNING,
                           "%s %s -> %s (%s after %u deliveries): %s", stream, entry_id,
                           lease != NULL ? lease->dlq : c->dlq, reason, deliveries, error);
        rc = 0;
    } else if (lease != NULL && outbox_msg_lease_lost(r)) {
        rc = OUTBOX_LEASE_LOST;
    } else {
        /* "Function not found": someone ran FUNCTION FLUSH or DELETE since
         * the connect; connecting again loads it. */
        int missing = r->type == REDIS_REPLY_ERROR && strstr(r->str, "Function not found") != NULL;
        char text[512];
        snprintf(text, sizeof(text), "dead-lettering %s %s failed: %s", stream, entry_id,
                 r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        outbox_report_set_error(c, OUTBOX_CONSUMER_ERR_REDIS, text);
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_ERROR,
                           "%s; the entry stays pending and a later pass tries again%s", text,
                           missing ? " (reconnecting to load the function)" : "");
        if (missing)
            outbox_conn_close_all(c);
    }
    freeReplyObject(r);
out:
    free(a.argv);
    free(a.lens);
    return rc;
}
