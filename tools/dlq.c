/*
 * "outbox-relay dlq": what operators do with a consumer group's dead letters.
 *
 * A consumer that gives up on a message (failed for good, out of deliveries,
 * malformed, or lost from the stream while pending) moves it to the group's
 * dead-letter stream "{<stream>}.<group>.dlq": the original fields plus the
 * dlq.* fields of consumer.h, which say why. "dlq list" and "dlq show" read
 * them; "dlq replay" puts them back on the group's own replay stream
 * "{<stream>}.<group>.replay", which only that group reads, so the other groups
 * of the stream never see a message twice; "dlq purge" deletes them. A
 * replay is one call of the consumer library's replay function per dead
 * letter, which deletes the dead letter only once it is on the replay stream.
 *
 * This is a command line tool: it uses hiredis's blocking API, with the
 * configuration's connect_timeout for the connect and statement_timeout as
 * the deadline of every command. Every field is handled with explicit
 * lengths, so payloads with NUL bytes go through unchanged.
 */
#include "common/compat.h"

#include "core/text.h"
#include "tools/dlq.h"
#include "tools/tools.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include "common/common.h"
#include "core/config.h"
#include "common/entry.h"
#include "common/redisconn.h"
#include "common/keys.h"
#include "common/functions.h"

/* ------------------------------------------------------------------------ */
/* Talking to Redis.                                                          */

static void describe_url(const struct outbox_redis_url *u, char *out, size_t outlen)
{
    int v6 = strchr(u->host, ':') != NULL;
    snprintf(out, outlen, "%s://%s%s%s%s%s%s:%d/%d", u->tls.on ? "rediss" : "redis", u->user,
             u->password[0] ? ":***" : "", (u->user[0] || u->password[0]) ? "@" : "", v6 ? "[" : "",
             u->host, v6 ? "]" : "", u->port, u->db);
}

/* Says why the connection failed; the context is unusable afterwards. */
static int io_failed(struct dlq_ctx *d)
{
    fprintf(d->errout, "outbox-relay: Redis at %s: %s\n", d->where,
            d->c->errstr[0] ? d->c->errstr : "no reply");
    return OUTBOX_EX_UNAVAILABLE;
}

/* Says what Redis refused. */
static int refused(struct dlq_ctx *d, const char *what, const redisReply *r)
{
    fprintf(d->errout, "outbox-relay: %s: %s (Redis at %s)\n", what,
            r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply", d->where);
    return OUTBOX_EX_UNAVAILABLE;
}

/* One command; NULL after an I/O error or timeout (io_failed says which). The
 * caller frees the reply. lens may be NULL for NUL-terminated arguments. */
static redisReply *command(struct dlq_ctx *d, int argc, const char **argv, const size_t *lens)
{
    return redisCommandArgv(d->c, argc, argv, lens);
}

static int is_error(const redisReply *r)
{
    return r->type == REDIS_REPLY_ERROR;
}

/* Connects, authenticates and selects the database. Returns 0 or an exit code. */
static int dlq_connect(struct dlq_ctx *d, const struct relay_config *cfg)
{
    char err[512];
    enum outbox_redis_fault fault;
    describe_url(&cfg->redis_url, d->where, sizeof(d->where));
    /* In a cluster, the primary of the stream's slot: its dead-letter and
     * replay streams are in that slot too. */
    d->c = outbox_redis_open_for_key(&cfg->redis_url, d->stream, cfg->connect_timeout_ms,
                                     cfg->statement_timeout_ms, -1, err, sizeof(err), &fault);
    if (d->c == NULL) {
        fprintf(d->errout, "outbox-relay: %s (Redis at %s)\n", err, d->where);
        return fault == OUTBOX_REDIS_NOMEM ? OUTBOX_EX_OSERR : OUTBOX_EX_UNAVAILABLE;
    }
    return 0;
}

/* XINFO GROUPS: the stream must exist and the group must be one of its groups. */
static int check_group(struct dlq_ctx *d)
{
    const char *argv[3] = {"XINFO", "GROUPS", d->stream};
    redisReply *r = command(d, 3, argv, NULL);
    int rc = OUTBOX_EX_DATAERR;

    if (r == NULL)
        return io_failed(d);
    if (is_error(r)) {
        if (strstr(r->str, "no such key") != NULL)
            fprintf(d->errout, "outbox-relay: stream \"%s\" does not exist\n", d->shown.stream);
        else if (strncmp(r->str, "WRONGTYPE", 9) == 0)
            fprintf(d->errout, "outbox-relay: \"%s\" is not a stream\n", d->shown.stream);
        else
            rc = refused(d, "XINFO GROUPS", r);
        freeReplyObject(r);
        return rc;
    }
    if (r->type == REDIS_REPLY_ARRAY) {
        for (size_t i = 0; i < r->elements; i++) {
            const redisReply *g = r->element[i];
            if (g->type != REDIS_REPLY_ARRAY)
                continue;
            for (size_t k = 0; k + 1 < g->elements; k += 2) {
                const redisReply *name = g->element[k], *value = g->element[k + 1];
                if (name->type == REDIS_REPLY_STRING && strcmp(name->str, "name") == 0 &&
                    value->type == REDIS_REPLY_STRING && value->len == strlen(d->group) &&
                    memcmp(value->str, d->group, value->len) == 0)
                    rc = 0;
            }
        }
    }
    freeReplyObject(r);
    if (rc != 0)
        fprintf(d->errout, "outbox-relay: group \"%s\" does not exist on stream \"%s\"\n",
                d->shown.group, d->shown.stream);
    return rc;
}

/* A key that exists must be a stream: "none" and "stream" are fine. shown is
 * the key as messages show it. */
static int check_stream_key(struct dlq_ctx *d, const char *key, const char *shown)
{
    const char *argv[2] = {"TYPE", key};
    redisReply *r = command(d, 2, argv, NULL);
    int rc = 0;

    if (r == NULL)
        return io_failed(d);
    if (is_error(r) || r->type != REDIS_REPLY_STATUS) {
        rc = refused(d, "TYPE", r);
    } else if (strcmp(r->str, "none") != 0 && strcmp(r->str, "stream") != 0) {
        fprintf(d->errout, "outbox-relay: \"%s\" holds a %s, not a stream\n", shown, r->str);
        rc = OUTBOX_EX_DATAERR;
    }
    freeReplyObject(r);
    return rc;
}

/* An XRANGE entry: [id, [field, value, ...]]. */
OUTBOX_STATIC int entry_ok(const redisReply *e)
{
    if (e->type != REDIS_REPLY_ARRAY || e->elements != 2 ||
        e->element[0]->type != REDIS_REPLY_STRING)
        return 0;
    const redisReply *f = e->element[1];
    if (f->type != REDIS_REPLY_ARRAY || f->elements % 2 != 0)
        return 0;
    for (size_t i = 0; i < f->elements; i++)
        if (f->element[i]->type != REDIS_REPLY_STRING)
            return 0;
    return 1;
}

/* XRANGE key from to COUNT n: an array of valid entries, or NULL with rc set. */
static redisReply *xrange(struct dlq_ctx *d, const char *from, const char *to, long long count,
                          int *rc)
{
    char cnt[24];
    snprintf(cnt, sizeof(cnt), "%lld", count);
    const char *argv[6] = {"XRANGE", d->dlq, from, to, "COUNT", cnt};
    redisReply *r = command(d, 6, argv, NULL);

    if (r == NULL) {
        *rc = io_failed(d);
        return NULL;
    }
    if (r->type != REDIS_REPLY_ARRAY) {
        *rc = refused(d, "XRANGE", r);
        freeReplyObject(r);
        return NULL;
    }
    for (size_t i = 0; i < r->elements; i++) {
        if (!entry_ok(r->element[i])) {
            fprintf(d->errout, "outbox-relay: XRANGE %s: malformed reply from Redis at %s\n",
                    d->shown.dlq, d->where);
            freeReplyObject(r);
            *rc = OUTBOX_EX_UNAVAILABLE;
            return NULL;
        }
    }
    return r;
}

/* XLEN of the dead-letter stream, or -1 after a message. */
static long long dlq_length(struct dlq_ctx *d)
{
    const char *argv[2] = {"XLEN", d->dlq};
    redisReply *r = command(d, 2, argv, NULL);
    long long n = -1;

    if (r == NULL) {
        io_failed(d);
        return -1;
    }
    if (r->type == REDIS_REPLY_INTEGER)
        n = r->integer;
    else
        refused(d, "XLEN", r);
    freeReplyObject(r);
    return n;
}

/* ------------------------------------------------------------------------ */
/* Arguments.                                                                 */

/* "<ms>-<seq>", both decimal and in range. */
static int parse_entry_id(const char *s, size_t len, uint64_t *ms, uint64_t *seq, char *out,
                          size_t outlen)
{
    char buf[48];
    if (len == 0 || len >= sizeof(buf))
        return -1;
    memcpy(buf, s, len);
    buf[len] = '\0';
    char *dash = strchr(buf, '-');
    if (dash == NULL || dash == buf || dash[1] == '\0')
        return -1;
    *dash = '\0';
    for (const char *p = buf; *p; p++)
        if (*p < '0' || *p > '9')
            return -1;
    for (const char *p = dash + 1; *p; p++)
        if (*p < '0' || *p > '9')
            return -1;
    char *end;
    errno = 0;
    *ms = strtoull(buf, &end, 10);
    if (errno != 0)
        return -1;
    *seq = strtoull(dash + 1, &end, 10);
    if (errno != 0)
        return -1;
    snprintf(out, outlen, "%llu-%llu", (unsigned long long)*ms, (unsigned long long)*seq);
    return 0;
}

/* ID ("1718000000000-0") or FROM-TO ("1718000000000-0-1718000000500-3"). */
static int parse_selection(const char *s, int allow_range, struct dlq_sel *sel)
{
    uint64_t ms1, seq1, ms2, seq2;
    int dashes = 0;
    const char *second = NULL;

    for (const char *p = s; *p; p++)
        if (*p == '-' && ++dashes == 2)
            second = p;
    memset(sel, 0, sizeof(*sel));
    if (dashes == 1) {
        if (parse_entry_id(s, strlen(s), &ms1, &seq1, sel->from, sizeof(sel->from)) < 0)
            return -1;
        memcpy(sel->to, sel->from, sizeof(sel->to));
        return 0;
    }
    if (dashes != 3 || !allow_range)
        return -1;
    if (parse_entry_id(s, (size_t)(second - s), &ms1, &seq1, sel->from, sizeof(sel->from)) < 0 ||
        parse_entry_id(second + 1, strlen(second + 1), &ms2, &seq2, sel->to, sizeof(sel->to)) < 0)
        return -1;
    if (ms1 > ms2 || (ms1 == ms2 && seq1 > seq2))
        return -1;
    sel->is_range = 1;
    return 0;
}

static int parse_count(const char *s, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v <= 0 || v > DLQ_LIST_MAX)
        return -1;
    *out = v;
    return 0;
}

static void dlq_usage(FILE *f)
{
    fprintf(f, "Usage: outbox-relay [-c FILE] dlq list STREAM GROUP [--count N]\n"
               "       outbox-relay [-c FILE] dlq show STREAM GROUP ID\n"
               "       outbox-relay [-c FILE] dlq replay STREAM GROUP ID... | FROM-TO... | --all\n"
               "       outbox-relay [-c FILE] dlq purge STREAM GROUP ID... | FROM-TO... | --all\n"
               "       outbox-relay [-c FILE] dlq migrate STREAM GROUP\n"
               "\n"
               "STREAM is the stream's Redis key (with any stream_prefix), GROUP the consumer\n"
               "group whose dead letters ({STREAM}.GROUP.dlq) are meant. ID is a dead letter's\n"
               "entry id as 'dlq list' shows it (1718000000000-0); FROM-TO is every dead letter\n"
               "between two such ids, both included (1718000000000-0-1718000000500-3).\n"
               "replay sends the original message, with its id, to {STREAM}.GROUP.replay, which\n"
               "only GROUP reads. migrate moves the group's dead letters and replays from the\n"
               "names before 0.2 (STREAM.GROUP.dlq, STREAM.GROUP.replay) to these. Only the\n"
               "redis setting is used.\n");
}

/* ------------------------------------------------------------------------ */
/* The commands.                                                             */

OUTBOX_STATIC void list_entry(struct dlq_ctx *d, const redisReply *e)
{
    static const struct {
        const char *field;
        size_t width, max;
    } cols[] = {
        {"id", 36, 40},
        {OUTBOX_DLQ_FIELD_REASON, 10, 20},
        {OUTBOX_DLQ_FIELD_DELIVERIES, 10, 12},
        {OUTBOX_DLQ_FIELD_TIME, 27, 32},
    };
    relay_text_put_column(d->out, e->element[0]->str, e->element[0]->len, 20, 0);
    for (size_t k = 0; k < OUTBOX_ARRAY_LEN(cols); k++) {
        const redisReply *v = outbox_entry_field(e->element[1], cols[k].field);
        relay_text_put_column(d->out, v != NULL ? v->str : "-", v != NULL ? v->len : 1,
                              cols[k].width, cols[k].max);
    }
    const redisReply *err = outbox_entry_field(e->element[1], OUTBOX_DLQ_FIELD_ERROR);
    relay_text_put_escaped(d->out, err != NULL ? err->str : "-", err != NULL ? err->len : 1,
                           DLQ_ERROR_COLS, 0);
    fputc('\n', d->out);
}

/* The oldest count dead letters, read a page at a time so a large --count
 * never holds more than one page of payloads in memory. */
static int dlq_list(struct dlq_ctx *d, long long count)
{
    char start[56] = "-";
    long long shown = 0;
    int rc = check_stream_key(d, d->dlq, d->shown.dlq);
    if (rc != 0)
        return rc;
    while (shown < count) {
        long long want = count - shown < DLQ_PAGE ? count - shown : DLQ_PAGE;
        redisReply *page = xrange(d, start, "+", want, &rc);
        if (page == NULL)
            return rc;
        size_t n = page->elements;
        if (n > 0 && shown == 0)
            fprintf(d->out, "%-20s %-36s %-10s %-10s %-27s %s\n", "ENTRY", "MESSAGE_ID", "REASON",
                    "DELIVERIES", "FAILED_AT", "ERROR");
        for (size_t i = 0; i < n; i++)
            list_entry(d, page->element[i]);
        if (n > 0)
            snprintf(start, sizeof(start), "(%s", page->element[n - 1]->element[0]->str);
        shown += (long long)n;
        freeReplyObject(page);
        if ((long long)n < want)
            break;
    }
    long long total = dlq_length(d);
    if (total < 0)
        return OUTBOX_EX_UNAVAILABLE;
    if (shown == 0 && total == 0) {
        fprintf(d->out, "no dead letters in %s\n", d->shown.dlq);
        return OUTBOX_EX_OK;
    }
    fprintf(d->out, "%lld dead letter(s) in %s", total, d->shown.dlq);
    if (shown < total)
        fprintf(d->out, " (showing the oldest %lld; use --count)", shown);
    fputc('\n', d->out);
    return OUTBOX_EX_OK;
}

static int dlq_show(struct dlq_ctx *d, const struct dlq_sel *sel)
{
    int rc = check_stream_key(d, d->dlq, d->shown.dlq);
    if (rc != 0)
        return rc;
    redisReply *r = xrange(d, sel->from, sel->to, 1, &rc);
    if (r == NULL)
        return rc;
    if (r->elements == 0) {
        fprintf(d->errout, "outbox-relay: no dead letter %s in %s\n", sel->from, d->shown.dlq);
        freeReplyObject(r);
        return OUTBOX_EX_DATAERR;
    }
    const redisReply *e = r->element[0], *f = e->element[1];
    fprintf(d->out, "dead letter %s in %s (%zu fields)\n", e->element[0]->str, d->shown.dlq,
            f->elements / 2);
    for (size_t i = 0; i + 1 < f->elements; i += 2) {
        const redisReply *name = f->element[i], *value = f->element[i + 1];
        fputs("  ", d->out);
        relay_text_put_column(d->out, name->str, name->len, 16, 0);
        fputc('"', d->out);
        relay_text_put_escaped(d->out, value->str, value->len, 0, RELAY_ESCAPE_QUOTE);
        fputc('"', d->out);
        /* Say the length where the text shown is not the bytes stored. */
        for (size_t k = 0; k < value->len; k++) {
            unsigned char c = (unsigned char)value->str[k];
            if (c < 0x20 || c >= 0x7f || c == '\\' || c == '"') {
                fprintf(d->out, " (%zu bytes)", value->len);
                break;
            }
        }
        fputc('\n', d->out);
    }
    freeReplyObject(r);
    return OUTBOX_EX_OK;
}

/* Reads n pipelined replies into rs; 0, or an exit code after freeing them. */
static int get_replies(struct dlq_ctx *d, redisReply **rs, int n)
{
    for (int i = 0; i < n; i++) {
        void *reply = NULL;
        if (redisGetReply(d->c, &reply) != REDIS_OK) {
            for (int k = 0; k < i; k++)
                freeReplyObject(rs[k]);
            return io_failed(d);
        }
        rs[i] = reply;
    }
    return 0;
}

static void free_replies(redisReply **rs, int n)
{
    for (int i = 0; i < n; i++)
        if (rs[i] != NULL)
            freeReplyObject(rs[i]);
}

enum replay_result { REPLAYED, NOT_FOUND, NOT_REPLAYABLE };

/*
 * Loads the consumer's function library, which holds the replay function, with
 * FUNCTION LOAD REPLACE of the same source the consumer library loads: the
 * tool may be the first to use the library on this Redis, and REPLACE brings
 * an older body up to date. Returns 0 or an exit code.
 */
static int load_library(struct dlq_ctx *d)
{
    const char *argv[4] = {"FUNCTION", "LOAD", "REPLACE", outbox_functions_consumer_source};
    size_t lens[4] = {8, 4, 7, strlen(outbox_functions_consumer_source)};
    redisReply *r = command(d, 4, argv, lens);
    int rc = 0;

    if (r == NULL)
        return io_failed(d);
    if (is_error(r)) {
        fprintf(d->errout,
                "outbox-relay: FUNCTION LOAD of library %s (the replay function): %s (Redis at "
                "%s)%s\n",
                OUTBOX_CONSUMER_FUNCTION_LIBRARY, r->str, d->where,
                strncmp(r->str, "NOPERM", 6) == 0
                    ? "; to replay, the Redis user needs the ACL permissions +function|load "
                      "and +fcall"
                    : "");
        rc = OUTBOX_EX_UNAVAILABLE;
    }
    freeReplyObject(r);
    return rc;
}

/*
 * Replays one dead letter with one call of the replay function (consumer.h):
 * on the server, in one step, it adds the dead letter's original fields to the
 * replay stream and deletes the dead letter only if the add succeeded. So an
 * add refused when it runs keeps the dead letter, and two operators replaying
 * the same one at once replay it once (the second finds nothing).
 * Returns 0 with *res set, or an exit code.
 */
static int replay_one(struct dlq_ctx *d, const char *id, enum replay_result *res)
{
    const char *argv[6] = {"FCALL", OUTBOX_CONSUMER_FUNCTION_REPLAY, "2", d->dlq, d->replay, id};
    redisReply *r = command(d, 6, argv, NULL);
    int rc = 0;

    if (r == NULL)
        return io_failed(d);
    if (r->type == REDIS_REPLY_STRING) {
        *res = REPLAYED;
    } else if (r->type == REDIS_REPLY_NIL) {
        *res = NOT_FOUND;
    } else if (is_error(r) && strncmp(r->str, "NOTREPLAYABLE ", 14) == 0) {
        *res = NOT_REPLAYABLE;
    } else if (is_error(r) && strncmp(r->str, "WRONGTYPE ", 10) == 0) {
        /* A key took another type since check_stream_key; nothing was written. */
        fprintf(d->errout, "outbox-relay: replay of %s: ", id);
        relay_text_put_escaped(d->errout, r->str, r->len, 0, 0);
        fputc('\n', d->errout);
        rc = OUTBOX_EX_DATAERR;
    } else {
        char what[64];
        snprintf(what, sizeof(what), "replay of %s", id);
        rc = refused(d, what, r);
    }
    freeReplyObject(r);
    return rc;
}

/*
 * Walks the dead letters between from and to (inclusive) a page at a time,
 * calling fn on each id; fn may delete the entry, since the next page starts
 * after the last id seen. Returns 0 or an exit code.
 */
typedef int dlq_walk_fn(struct dlq_ctx *d, const redisReply *page, void *arg);

static int walk_range(struct dlq_ctx *d, const char *from, const char *to, dlq_walk_fn *fn,
                      void *arg)
{
    char start[56];
    snprintf(start, sizeof(start), "%s", from);
    for (;;) {
        int rc = 0;
        redisReply *page = xrange(d, start, to, DLQ_PAGE, &rc);
        if (page == NULL)
            return rc;
        size_t n = page->elements;
        if (n > 0)
            snprintf(start, sizeof(start), "(%s", page->element[n - 1]->element[0]->str);
        rc = n > 0 ? fn(d, page, arg) : 0;
        freeReplyObject(page);
        if (rc != 0 || n < DLQ_PAGE)
            return rc;
    }
}

struct replay_tally {
    long long replayed;
    int unreplayable;
};

static int replay_page(struct dlq_ctx *d, const redisReply *page, void *arg)
{
    struct replay_tally *t = arg;
    for (size_t i = 0; i < page->elements; i++) {
        const char *id = page->element[i]->element[0]->str;
        enum replay_result res;
        int rc = replay_one(d, id, &res);
        if (rc != 0)
            return rc;
        if (res == REPLAYED) {
            t->replayed++;
        } else if (res == NOT_REPLAYABLE) {
            fprintf(d->errout,
                    "outbox-relay: dead letter %s has no original fields (reason lost?): not "
                    "replayed; see 'dlq show', remove it with 'dlq purge'\n",
                    id);
            t->unreplayable++;
        }
    }
    return 0;
}

/*
 * The group reads its replay stream from the start: the consumer library
 * creates it so on start-up, and creating it here too means a replay is
 * pending for the group even before its consumers (of any language) first
 * ran with replay support.
 */
static int ensure_replay_group(struct dlq_ctx *d)
{
    const char *argv[6] = {"XGROUP", "CREATE", d->replay, d->group, "0", "MKSTREAM"};
    redisReply *r = command(d, 6, argv, NULL);
    int rc = 0;

    if (r == NULL)
        return io_failed(d);
    if (is_error(r) && strncmp(r->str, "BUSYGROUP", 9) != 0)
        rc = refused(d, "XGROUP CREATE", r);
    else if (!is_error(r))
        fprintf(d->out, "created group %s on %s at 0: its consumers must read that stream too\n",
                d->shown.group, d->shown.replay);
    freeReplyObject(r);
    return rc;
}

/* The id of the newest dead letter into last, or "" when there is none. */
static int newest_id(struct dlq_ctx *d, char *last, size_t lastlen)
{
    const char *argv[6] = {"XREVRANGE", d->dlq, "+", "-", "COUNT", "1"};
    redisReply *r = command(d, 6, argv, NULL);
    last[0] = '\0';
    if (r == NULL)
        return io_failed(d);
    if (r->type != REDIS_REPLY_ARRAY || (r->elements > 0 && !entry_ok(r->element[0]))) {
        int rc = refused(d, "XREVRANGE", r);
        freeReplyObject(r);
        return rc;
    }
    if (r->elements > 0)
        snprintf(last, lastlen, "%s", r->element[0]->element[0]->str);
    freeReplyObject(r);
    return 0;
}

static int dlq_replay(struct dlq_ctx *d, int all, const struct dlq_sel *sels, int nsel)
{
    struct replay_tally t = {0, 0};
    int missing = 0, rc = 0;

    if ((rc = check_stream_key(d, d->dlq, d->shown.dlq)) != 0 ||
        (rc = check_stream_key(d, d->replay, d->shown.replay)) != 0 ||
        (rc = load_library(d)) != 0 || (rc = ensure_replay_group(d)) != 0)
        return rc;
    if (all) {
        /* Only what is there now: a message that fails again at once comes
         * back as a newer dead letter, and must not be replayed in a loop. */
        char last[64];
        if ((rc = newest_id(d, last, sizeof(last))) != 0)
            return rc;
        if (last[0] != '\0')
            rc = walk_range(d, "-", last, replay_page, &t);
    } else {
        for (int i = 0; i < nsel && rc == 0; i++) {
            if (sels[i].is_range) {
                rc = walk_range(d, sels[i].from, sels[i].to, replay_page, &t);
                continue;
            }
            enum replay_result res;
            if ((rc = replay_one(d, sels[i].from, &res)) != 0)
                break;
            if (res == REPLAYED) {
                t.replayed++;
            } else if (res == NOT_FOUND) {
                fprintf(d->errout, "outbox-relay: no dead letter %s in %s\n", sels[i].from,
                        d->shown.dlq);
                missing++;
            } else {
                fprintf(d->errout,
                        "outbox-relay: dead letter %s has no original fields (reason lost?): "
                        "not replayed; see 'dlq show', remove it with 'dlq purge'\n",
                        sels[i].from);
                t.unreplayable++;
            }
        }
    }
    fprintf(d->out, "replayed %lld dead letter(s) from %s to %s\n", t.replayed, d->shown.dlq,
            d->shown.replay);
    if (rc != 0)
        return rc;
    return missing || t.unreplayable ? OUTBOX_EX_DATAERR : OUTBOX_EX_OK;
}

static int purge_page(struct dlq_ctx *d, const redisReply *page, void *arg)
{
    long long *purged = arg;
    const char **argv = calloc(page->elements + 2, sizeof(*argv));
    if (argv == NULL)
        return OUTBOX_EX_OSERR;
    argv[0] = "XDEL";
    argv[1] = d->dlq;
    for (size_t i = 0; i < page->elements; i++)
        argv[i + 2] = page->element[i]->element[0]->str;
    redisReply *r = command(d, (int)page->elements + 2, argv, NULL);
    free(argv);
    if (r == NULL)
        return io_failed(d);
    int rc = 0;
    if (r->type == REDIS_REPLY_INTEGER)
        *purged += r->integer;
    else
        rc = refused(d, "XDEL", r);
    freeReplyObject(r);
    return rc;
}

static int dlq_purge(struct dlq_ctx *d, int all, const struct dlq_sel *sels, int nsel)
{
    long long purged = 0;
    int missing = 0, rc = 0;

    if ((rc = check_stream_key(d, d->dlq, d->shown.dlq)) != 0)
        return rc;
    if (all) {
        /* The count and the delete in one transaction, so the count is exact. */
        const char *multi[1] = {"MULTI"}, *exec[1] = {"EXEC"};
        const char *xlen[2] = {"XLEN", d->dlq}, *del[2] = {"UNLINK", d->dlq};
        redisReply *rs[4] = {NULL, NULL, NULL, NULL};
        if (redisAppendCommandArgv(d->c, 1, multi, NULL) != REDIS_OK ||
            redisAppendCommandArgv(d->c, 2, xlen, NULL) != REDIS_OK ||
            redisAppendCommandArgv(d->c, 2, del, NULL) != REDIS_OK ||
            redisAppendCommandArgv(d->c, 1, exec, NULL) != REDIS_OK)
            return io_failed(d);
        if ((rc = get_replies(d, rs, 4)) != 0)
            return rc;
        const redisReply *ex = rs[3];
        if (ex->type == REDIS_REPLY_ARRAY && ex->elements == 2 &&
            ex->element[0]->type == REDIS_REPLY_INTEGER)
            purged = ex->element[0]->integer;
        else
            rc = refused(d, "purge",
                         ex->type == REDIS_REPLY_ARRAY && ex->elements > 0
                             ? ex->element[ex->elements - 1]
                             : ex);
        free_replies(rs, 4);
    } else {
        for (int i = 0; i < nsel && rc == 0; i++) {
            if (sels[i].is_range) {
                rc = walk_range(d, sels[i].from, sels[i].to, purge_page, &purged);
                continue;
            }
            const char *argv[3] = {"XDEL", d->dlq, sels[i].from};
            redisReply *r = command(d, 3, argv, NULL);
            if (r == NULL) {
                rc = io_failed(d);
                break;
            }
            if (r->type != REDIS_REPLY_INTEGER) {
                rc = refused(d, "XDEL", r);
            } else if (r->integer == 0) {
                fprintf(d->errout, "outbox-relay: no dead letter %s in %s\n", sels[i].from,
                        d->shown.dlq);
                missing++;
            } else {
                purged += r->integer;
            }
            freeReplyObject(r);
        }
    }
    fprintf(d->out, "purged %lld dead letter(s) from %s\n", purged, d->shown.dlq);
    if (rc != 0)
        return rc;
    return missing ? OUTBOX_EX_DATAERR : OUTBOX_EX_OK;
}

/* Copies the entry e of old to now (XADD, with a new id), then deletes it
 * from old (XDEL). 0 or an exit code. */
static int move_entry(struct dlq_ctx *d, const char *old, const char *now, const redisReply *e)
{
    const redisReply *f = e->element[1];
    size_t argc = 3 + f->elements;
    const char **argv = calloc(argc, sizeof(*argv));
    size_t *lens = calloc(argc, sizeof(*lens));
    if (argv == NULL || lens == NULL) {
        free(argv);
        free(lens);
        return OUTBOX_EX_OSERR;
    }
    argv[0] = "XADD";
    lens[0] = 4;
    argv[1] = now;
    lens[1] = strlen(now);
    argv[2] = "*";
    lens[2] = 1;
    for (size_t k = 0; k < f->elements; k++) {
        argv[3 + k] = f->element[k]->str;
        lens[3 + k] = f->element[k]->len;
    }
    redisReply *a = redisCommandArgv(d->c, (int)argc, argv, lens);
    free(argv);
    free(lens);
    if (a == NULL || is_error(a)) {
        int rc = a == NULL ? io_failed(d) : refused(d, "XADD", a);
        if (a != NULL)
            freeReplyObject(a);
        return rc;
    }
    freeReplyObject(a);
    const char *xd[3] = {"XDEL", old, e->element[0]->str};
    redisReply *x = command(d, 3, xd, NULL);
    if (x == NULL)
        return io_failed(d);
    freeReplyObject(x);
    return 0;
}

/* Moves the entries of old to now a page at a time, in order, counting them
 * in *moved. 0 or an exit code. */
static int move_entries(struct dlq_ctx *d, const char *old, const char *now, long long *moved)
{
    for (;;) {
        const char *xr[6] = {"XRANGE", old, "-", "+", "COUNT", "100"};
        redisReply *page = command(d, 6, xr, NULL);
        if (page == NULL)
            return io_failed(d);
        if (page->type != REDIS_REPLY_ARRAY) {
            int rc = refused(d, "XRANGE", page);
            freeReplyObject(page);
            return rc;
        }
        if (page->elements == 0) {
            freeReplyObject(page);
            return 0;
        }
        for (size_t i = 0; i < page->elements; i++) {
            const redisReply *e = page->element[i];
            if (!entry_ok(e))
                continue;
            int rc = move_entry(d, old, now, e);
            if (rc != 0) {
                freeReplyObject(page);
                return rc;
            }
            (*moved)++;
        }
        freeReplyObject(page);
    }
}

/*
 * Moves one stream from its name before 0.2 to its name now: RENAME when the
 * new name is free (the stream, its groups and their pending entries go as
 * they are), else entry by entry (XADD to the new name, then XDEL from the
 * old; the entries get new ids). Returns 0 or an exit code.
 */
static int migrate_one(struct dlq_ctx *d, const char *old, const char *now)
{
    char shown_old[RELAY_ESCAPED_SIZE(DLQ_NAME_MAX)], shown_now[RELAY_ESCAPED_SIZE(DLQ_NAME_MAX)];
    relay_text_escape(shown_old, sizeof(shown_old), old, strlen(old), 0, 0);
    relay_text_escape(shown_now, sizeof(shown_now), now, strlen(now), 0, 0);
    const char *type_argv[2] = {"TYPE", old};
    redisReply *r = command(d, 2, type_argv, NULL);
    if (r == NULL)
        return io_failed(d);
    int absent = r->type == REDIS_REPLY_STATUS && strcmp(r->str, "none") == 0;
    int stream = r->type == REDIS_REPLY_STATUS && strcmp(r->str, "stream") == 0;
    freeReplyObject(r);
    if (absent) {
        fprintf(d->out, "%s: nothing to move\n", shown_old);
        return 0;
    }
    if (!stream) {
        fprintf(d->errout, "outbox-relay: %s is not a stream: left as it is\n", shown_old);
        return OUTBOX_EX_DATAERR;
    }
    const char *rn[3] = {"RENAMENX", old, now};
    r = command(d, 3, rn, NULL);
    if (r == NULL)
        return io_failed(d);
    if (r->type == REDIS_REPLY_INTEGER && r->integer == 1) {
        freeReplyObject(r);
        fprintf(d->out, "renamed %s to %s\n", shown_old, shown_now);
        return 0;
    }
    /* The new name is taken (consumers of 0.2 wrote to it already), or a
     * Redis Cluster refused a rename across slots: move the entries. */
    if (r->type == REDIS_REPLY_ERROR && strstr(r->str, "CROSSSLOT") == NULL) {
        int rc = refused(d, "RENAMENX", r);
        freeReplyObject(r);
        return rc;
    }
    freeReplyObject(r);
    long long moved = 0;
    int rc = move_entries(d, old, now, &moved);
    if (rc != 0)
        return rc;
    const char *del[2] = {"UNLINK", old};
    r = command(d, 2, del, NULL);
    if (r == NULL)
        return io_failed(d);
    freeReplyObject(r);
    fprintf(d->out, "moved %lld entr%s from %s to %s, which was there already\n", moved,
            moved == 1 ? "y" : "ies", shown_old, shown_now);
    return 0;
}

static int dlq_migrate(struct dlq_ctx *d)
{
    char old_dlq[DLQ_NAME_MAX], old_replay[DLQ_NAME_MAX];
    if (outbox_key_dlq_old(d->stream, d->group, old_dlq, sizeof(old_dlq)) < 0 ||
        outbox_key_replay_old(d->stream, d->group, old_replay, sizeof(old_replay)) < 0)
        return OUTBOX_EX_USAGE;
    int rc = migrate_one(d, old_dlq, d->dlq);
    if (rc != 0)
        return rc;
    return migrate_one(d, old_replay, d->replay);
}

/* The stream, the group and the names derived from them, checked and kept
 * with their escaped forms for messages. 0, or -1 after saying why. */
OUTBOX_STATIC int dlq_names(struct dlq_ctx *d, const char *stream, const char *group)
{
    d->stream = stream;
    d->group = group;
    if (stream[0] == '\0' || group[0] == '\0' ||
        outbox_key_dlq(stream, group, d->dlq, sizeof(d->dlq)) < 0 ||
        outbox_key_replay(stream, group, d->replay, sizeof(d->replay)) < 0) {
        fprintf(d->errout, "outbox-relay: dlq: the stream and group names must be 1 to %d bytes\n",
                DLQ_NAME_MAX - 16);
        return -1;
    }
    relay_text_escape(d->shown.stream, sizeof(d->shown.stream), stream, strlen(stream), 0, 0);
    relay_text_escape(d->shown.group, sizeof(d->shown.group), group, strlen(group), 0, 0);
    relay_text_escape(d->shown.dlq, sizeof(d->shown.dlq), d->dlq, strlen(d->dlq), 0, 0);
    relay_text_escape(d->shown.replay, sizeof(d->shown.replay), d->replay, strlen(d->replay), 0, 0);
    return 0;
}

/* "list [--count N]": 0, or -1 after saying why. */
OUTBOX_STATIC int parse_list_args(int argc, char **argv, FILE *errout, long long *count)
{
    for (int i = 4; i < argc; i++) {
        if (strcmp(argv[i], "--count") == 0 && i + 1 < argc &&
            parse_count(argv[i + 1], count) == 0) {
            i++;
            continue;
        }
        fprintf(errout, "outbox-relay: dlq list: unexpected \"%s\" (--count takes 1 to %d)\n",
                argv[i], DLQ_LIST_MAX);
        return -1;
    }
    return 0;
}

/* The entries "show", "replay" and "purge" act on: ids, ranges (not for
 * show) or --all, into sels (argc entries) and *all. 0, or -1 after saying
 * why. */
OUTBOX_STATIC int parse_selections(const char *verb, int argc, char **argv, FILE *errout,
                                   struct dlq_sel *sels, int *nsel, int *all)
{
    int is_show = strcmp(verb, "show") == 0;
    if (argc < 5) {
        fprintf(errout, "outbox-relay: dlq %s needs %s\n", verb,
                is_show ? "one entry id" : "entry ids, ranges FROM-TO or --all");
        return -1;
    }
    for (int i = 4; i < argc; i++) {
        if (!is_show && strcmp(argv[i], "--all") == 0) {
            *all = 1;
            continue;
        }
        if (parse_selection(argv[i], !is_show, &sels[*nsel]) < 0) {
            fprintf(errout,
                    "outbox-relay: dlq %s: \"%s\" is not an entry id (such as "
                    "1718000000000-0)%s\n",
                    verb, argv[i],
                    is_show ? ""
                            : " or a range FROM-TO of two ids, the first not after the second");
            return -1;
        }
        (*nsel)++;
    }
    if ((*all && *nsel > 0) || (is_show && *nsel != 1)) {
        fprintf(errout, "outbox-relay: dlq %s: %s\n", verb,
                is_show ? "give exactly one entry id" : "give entry ids or --all, not both");
        return -1;
    }
    return 0;
}

int relay_tool_dlq(const struct relay_config *cfg, int argc, char **argv, FILE *out, FILE *errout)
{
    struct dlq_ctx d;
    struct dlq_sel *sels = NULL;
    int nsel = 0, all = 0, rc = OUTBOX_EX_USAGE;
    long long count = 100;

    memset(&d, 0, sizeof(d));
    d.out = out;
    d.errout = errout;
    if (argc >= 2 && relay_tool_is_help(argv[1])) {
        dlq_usage(out);
        return OUTBOX_EX_OK;
    }
    if (argc < 4) {
        fprintf(errout, "outbox-relay: dlq needs a command, a stream and a group\n");
        dlq_usage(errout);
        return OUTBOX_EX_USAGE;
    }
    const char *verb = argv[1];
    if (dlq_names(&d, argv[2], argv[3]) < 0)
        return OUTBOX_EX_USAGE;

    int is_list = strcmp(verb, "list") == 0, is_show = strcmp(verb, "show") == 0;
    int is_replay = strcmp(verb, "replay") == 0, is_purge = strcmp(verb, "purge") == 0;
    int is_migrate = strcmp(verb, "migrate") == 0;
    if (is_migrate) {
        if (argc != 4) {
            fprintf(errout, "outbox-relay: dlq migrate takes a stream and a group only\n");
            goto usage;
        }
    } else if (is_list) {
        if (parse_list_args(argc, argv, errout, &count) < 0)
            goto usage;
    } else if (is_show || is_replay || is_purge) {
        sels = calloc((size_t)argc, sizeof(*sels));
        if (sels == NULL)
            return OUTBOX_EX_OSERR;
        if (parse_selections(verb, argc, argv, errout, sels, &nsel, &all) < 0)
            goto usage;
    } else {
        relay_tool_unknown(errout, "dlq", verb);
        goto usage;
    }

    if (cfg == NULL) { /* the arguments only (relay_tool_check_usage) */
        rc = OUTBOX_EX_OK;
        goto out;
    }
    if ((rc = dlq_connect(&d, cfg)) != 0)
        goto out;
    if (is_migrate) {
        rc = dlq_migrate(&d); /* the group may be gone: its dead letters still move */
        goto out;
    }
    if ((rc = check_group(&d)) != 0)
        goto out;
    if (is_list)
        rc = dlq_list(&d, count);
    else if (is_show)
        rc = dlq_show(&d, &sels[0]);
    else if (is_replay)
        rc = dlq_replay(&d, all, sels, nsel);
    else
        rc = dlq_purge(&d, all, sels, nsel);
    goto out;

usage:
    dlq_usage(errout);
    rc = OUTBOX_EX_USAGE;
out:
    if (d.c != NULL)
        redisFree(d.c);
    free(sels);
    return rc;
}
