/*
 * The unordered mode of the consumer library (consumer/internal.h): a
 * consumer group reader that gives handlers retries with backoff, dead
 * letters and take-over of the entries of consumers that died.
 *
 * Redis keeps everything that matters: an entry stays in the group's pending
 * list (PEL) until it is acknowledged, with its delivery count and the time
 * since its last delivery ("idle"). So a retry is simply "do not acknowledge":
 * the reclaim pass lists pending entries with XPENDING, and any entry whose
 * idle time has reached the backoff for its delivery count is taken with
 * XCLAIM (which re-checks the idle time on the server, so two consumers never
 * take the same entry, and counts one more delivery). A consumer that died
 * leaves its entries pending; the living ones take them over the same way.
 *
 * XCLAIM in Redis 7.0 drops pending entries that were deleted or trimmed from
 * the stream instead of returning them; those are recorded as "lost".
 */
#include "common/compat.h"

#include "consumer/internal.h"

#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/backoff.h"
#include "common/common.h"

#define RECLAIM_BATCH 64

/* Connects both connections, loads the functions, renames the streams of
 * before 0.2 and creates the group on the stream and its replay stream. */
static int connect_all(struct outbox_consumer *c)
{
    outbox_conn_close_all(c);
    c->wr = outbox_conn_open(c, c->stream, c->o.command_timeout_ms, "ack");
    if (c->wr != NULL)
        c->rd = outbox_conn_open(c, c->stream, c->o.block_ms + c->o.command_timeout_ms, "read");
    if (c->rd == NULL || outbox_conn_load_functions(c) < 0) {
        outbox_conn_close_all(c);
        return -1;
    }
    char default_dlq[sizeof(c->dlq)];
    if (outbox_consumer_dlq_name(c->stream, c->group, default_dlq, sizeof(default_dlq)) > 0 &&
        strcmp(default_dlq, c->dlq) == 0)
        outbox_conn_migrate_name(c, c->stream, c->dlq,
                                 0); /* a dlq of the caller's own keeps its name */
    outbox_conn_migrate_name(c, c->stream, c->replay, 1);
    if (outbox_conn_ensure_group(c, c->stream) < 0 || outbox_conn_ensure_group(c, c->replay) < 0) {
        outbox_conn_close_all(c);
        return -1;
    }
    if (c->last_error[0] != '\0')
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_INFO,
                           "%s: connected again, reading %s and %s as group %s", c->consumer,
                           c->stream, c->replay, c->group);
    else
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_INFO,
                           "%s: reading %s and %s as group %s, dead letters to %s", c->consumer,
                           c->stream, c->replay, c->group, c->dlq);
    c->last_error[0] = '\0';
    outbox_report_clear_error(c);
    outbox_backoff_reset(&c->reconnect);
    return 0;
}

/* A dead letter of the unordered mode: outbox_msg_dead_letter, no lease. */
static int dead_letter(struct outbox_consumer *c, const char *stream, const char *entry_id,
                       const redisReply *fields, const char *reason, const char *error,
                       uint32_t deliveries)
{
    return outbox_msg_dead_letter(c, stream, NULL, entry_id, fields, reason, error, deliveries);
}

static int ack(struct outbox_consumer *c, const char *stream, const char *entry_id)
{
    const char *argv[4] = {"XACK", stream, c->group, entry_id};
    size_t lens[4] = {4, strlen(stream), strlen(c->group), strlen(entry_id)};
    redisReply *r = outbox_conn_command(c->wr, 4, argv, lens);
    if (r == NULL) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO,
                              "Redis connection lost while acknowledging: %s", c->wr->errstr);
        outbox_conn_close_all(c);
        return -1;
    }
    int ok = r->type == REDIS_REPLY_INTEGER;
    if (ok) {
        outbox_report_clear_error(c);
    } else {
        char text[512];
        snprintf(text, sizeof(text), "acknowledging %s %s failed: %s", stream, entry_id,
                 r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        outbox_report_set_error(c, OUTBOX_CONSUMER_ERR_REDIS, text);
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_ERROR, "%s; the entry stays pending", text);
    }
    freeReplyObject(r);
    return ok ? 0 : -1;
}

/* Handles one delivered entry. */
static void handle(struct outbox_consumer *c, const char *stream, const redisReply *entry,
                   uint32_t deliveries)
{
    if (entry->type != REDIS_REPLY_ARRAY || entry->elements != 2 ||
        entry->element[0]->type != REDIS_REPLY_STRING)
        return;
    const char *entry_id = entry->element[0]->str;
    const redisReply *fields = entry->element[1];

    if (fields->type == REDIS_REPLY_NIL) {
        /* Delivered from the PEL after it was deleted: nothing left to handle. */
        c->stats.lost++;
        dead_letter(c, stream, entry_id, NULL, "lost",
                    "the entry was deleted or trimmed from the stream while pending", deliveries);
        return;
    }
    struct outbox_message m;
    const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
    size_t vlens[OUTBOX_HEADERS_MAX];
    memset(&m, 0, sizeof(m));
    const char *bad = outbox_msg_parse(fields, &m, names, values, vlens);
    if (bad != NULL) {
        c->stats.malformed++;
        char why[300];
        snprintf(why, sizeof(why), "malformed: %s", bad);
        dead_letter(c, stream, entry_id, fields, "malformed", why, deliveries);
        return;
    }
    if (deliveries > c->o.max_deliveries) {
        char why[200];
        snprintf(why, sizeof(why),
                 "delivered %u times (max_deliveries %u): the consumer of the last delivery did "
                 "not finish it",
                 deliveries, c->o.max_deliveries);
        dead_letter(c, stream, entry_id, fields, "exhausted", why, deliveries);
        return;
    }
    m.stream = stream;
    m.entry_id = entry_id;
    m.deliveries = deliveries;

    char err[512] = "";
    c->stats.delivered++;
    enum outbox_handled result = c->handler(&m, c->arg, err, sizeof(err));
    if (err[0] == '\0')
        snprintf(err, sizeof(err), "the handler gave no reason");
    switch (result) {
    case OUTBOX_HANDLED_DONE:
        if (ack(c, stream, entry_id) == 0)
            c->stats.done++;
        break;
    case OUTBOX_HANDLED_FAIL:
        dead_letter(c, stream, entry_id, fields, "permanent", err, deliveries);
        break;
    case OUTBOX_HANDLED_RETRY:
    default:
        if (deliveries >= c->o.max_deliveries) {
            dead_letter(c, stream, entry_id, fields, "exhausted", err, deliveries);
        } else {
            c->stats.retried++;
            outbox_report_emit(
                c, OUTBOX_CONSUMER_LOG_INFO,
                "%s %s (message %s) will be retried in %u ms (delivery %u of %u): %s", stream,
                entry_id, m.id, outbox_consumer_backoff_ms(&c->o, deliveries), deliveries,
                c->o.max_deliveries, err);
        }
        break;
    }
}

/* Has the entry been deleted from the stream? 1 yes, 0 no, -1 unknown. */
static int entry_gone(struct outbox_consumer *c, const char *stream, const char *id)
{
    const char *argv[6] = {"XRANGE", stream, id, id, "COUNT", "1"};
    size_t lens[6] = {6, strlen(stream), strlen(id), strlen(id), 5, 1};
    redisReply *r = outbox_conn_command(c->wr, 6, argv, lens);
    if (r == NULL)
        return -1;
    int gone = r->type == REDIS_REPLY_ARRAY && r->elements == 0;
    freeReplyObject(r);
    return gone;
}

/* Takes over one pending entry whose backoff has passed. */
static void take_over(struct outbox_consumer *c, const char *stream, const char *id,
                      uint32_t deliveries, uint32_t due)
{
    char min_idle[16];
    snprintf(min_idle, sizeof(min_idle), "%u", due);
    const char *cargv[6] = {"XCLAIM", stream, c->group, c->consumer, min_idle, id};
    size_t clens[6] = {
        6, strlen(stream), strlen(c->group), strlen(c->consumer), strlen(min_idle), strlen(id)};
    redisReply *cl = outbox_conn_command(c->wr, 6, cargv, clens);
    if (cl == NULL) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s",
                              c->wr->errstr);
        outbox_conn_close_all(c);
        return;
    }
    if (cl->type == REDIS_REPLY_ARRAY && cl->elements == 1) {
        c->stats.reclaimed++;
        handle(c, stream, cl->element[0], deliveries + 1);
    } else if (cl->type == REDIS_REPLY_ARRAY && cl->elements == 0) {
        /* Either another consumer took it first, or Redis 7.0 dropped it from
         * the PEL because the entry no longer exists. */
        if (entry_gone(c, stream, id) == 1) {
            c->stats.lost++;
            dead_letter(c, stream, id, NULL, "lost",
                        "the entry was deleted or trimmed from the stream while pending",
                        deliveries);
        }
    }
    freeReplyObject(cl);
}

/*
 * Takes over pending entries whose backoff has passed, of any consumer. The
 * scan pages through the pending list (oldest first) so that entries waiting
 * out a long backoff never hide due ones behind them; one pass looks at no
 * more than RECLAIM_PAGES pages.
 */
#define RECLAIM_PAGES 16
static void reclaim_stream(struct outbox_consumer *c, const char *stream)
{
    char idle[16], cnt[16], start[64] = "-";
    snprintf(idle, sizeof(idle), "%u", c->min_backoff_ms);
    snprintf(cnt, sizeof(cnt), "%d", RECLAIM_BATCH);
    for (int page = 0; page < RECLAIM_PAGES && !c->stop && c->wr != NULL; page++) {
        const char *argv[8] = {"XPENDING", stream, c->group, "IDLE", idle, start, "+", cnt};
        size_t lens[8] = {8, strlen(stream), strlen(c->group), 4, strlen(idle), strlen(start),
                          1, strlen(cnt)};
        redisReply *p = outbox_conn_command(c->wr, 8, argv, lens);
        if (p == NULL) {
            outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s",
                                  c->wr->errstr);
            outbox_conn_close_all(c);
            return;
        }
        size_t n = p->type == REDIS_REPLY_ARRAY ? p->elements : 0;
        for (size_t i = 0; i < n && !c->stop && c->wr != NULL; i++) {
            const redisReply *e = p->element[i];
            if (e->type != REDIS_REPLY_ARRAY || e->elements != 4 ||
                e->element[0]->type != REDIS_REPLY_STRING ||
                e->element[2]->type != REDIS_REPLY_INTEGER ||
                e->element[3]->type != REDIS_REPLY_INTEGER)
                continue;
            uint32_t deliveries = (uint32_t)e->element[3]->integer;
            uint32_t due = outbox_consumer_backoff_ms(&c->o, deliveries);
            if (i + 1 == n)
                snprintf(start, sizeof(start), "(%s", e->element[0]->str);
            if (e->element[2]->integer >= (long long)due)
                take_over(c, stream, e->element[0]->str, deliveries, due);
        }
        freeReplyObject(p);
        if (n < RECLAIM_BATCH)
            return;
    }
}

/* Resets the idle time of entries[from..] (ours, not yet handled) with
 * XCLAIM ... JUSTID, which does not count a delivery. */
static void touch_entries(struct outbox_consumer *c, const char *stream, const redisReply *entries,
                          size_t from)
{
    size_t n = entries->elements - from;
    const char **argv = calloc(n + 6, sizeof(*argv));
    size_t *lens = calloc(n + 6, sizeof(*lens));
    if (argv == NULL || lens == NULL) {
        /* Not fatal: the entries may be taken over by another consumer. */
        outbox_report_set_error(c, OUTBOX_CONSUMER_ERR_OOM, "out of memory for XCLAIM JUSTID");
        goto out;
    }
    size_t argc = 0;
    argv[argc++] = "XCLAIM";
    argv[argc++] = stream;
    argv[argc++] = c->group;
    argv[argc++] = c->consumer;
    argv[argc++] = "0";
    for (size_t i = from; i < entries->elements; i++) {
        const redisReply *e = entries->element[i];
        if (e->type == REDIS_REPLY_ARRAY && e->elements == 2 &&
            e->element[0]->type == REDIS_REPLY_STRING)
            argv[argc++] = e->element[0]->str;
    }
    argv[argc++] = "JUSTID";
    for (size_t i = 0; i < argc; i++)
        lens[i] = strlen(argv[i]);
    redisReply *r = outbox_conn_command(c->wr, (int)argc, argv, lens);
    if (r == NULL) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s",
                              c->wr->errstr);
        outbox_conn_close_all(c);
    } else {
        freeReplyObject(r);
    }
out:
    free(argv);
    free(lens);
}

static void read_once(struct outbox_consumer *c)
{
    char count[16], block[16];
    /* Block no longer than until the next reclaim pass is due, so retries and
     * take-overs are not held back by an idle read. */
    long long until_reclaim = c->last_reclaim_ms + c->o.reclaim_interval_ms - now_ms();
    uint32_t block_ms = c->o.block_ms;
    if (until_reclaim < (long long)block_ms)
        block_ms = until_reclaim < 1 ? 1 : (uint32_t)until_reclaim;
    snprintf(count, sizeof(count), "%u", c->o.count);
    snprintf(block, sizeof(block), "%u", block_ms);
    const char *argv[11] = {"XREADGROUP", "GROUP", c->group,  c->consumer, "COUNT",  count,
                            "BLOCK",      block,   "STREAMS", c->stream,   c->replay};
    size_t lens[13];
    const char *full[13];
    memcpy(full, argv, sizeof(argv));
    full[11] = ">";
    full[12] = ">";
    for (int i = 0; i < 13; i++)
        lens[i] = strlen(full[i]);
    redisReply *r = outbox_conn_command(c->rd, 13, full, lens);
    if (r == NULL) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost while reading: %s",
                              c->rd->errstr);
        outbox_conn_close_all(c);
        return;
    }
    if (r->type == REDIS_REPLY_ERROR) {
        /* NOGROUP: the stream or group was deleted; create them again. */
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_REDIS, "XREADGROUP failed: %s", r->str);
        freeReplyObject(r);
        outbox_conn_close_all(c);
        return;
    }
    if (r->type == REDIS_REPLY_ARRAY) {
        for (size_t s = 0; s < r->elements && c->wr != NULL; s++) {
            const redisReply *sr = r->element[s];
            if (sr->type != REDIS_REPLY_ARRAY || sr->elements != 2 ||
                sr->element[0]->type != REDIS_REPLY_STRING ||
                sr->element[1]->type != REDIS_REPLY_ARRAY)
                continue;
            const char *stream = sr->element[0]->str;
            const redisReply *entries = sr->element[1];
            /* The message in hand is finished on stop; the rest stay pending
             * and are taken over after their backoff. */
            long long read_at = now_ms();
            for (size_t i = 0; i < entries->elements && !c->stop && c->wr != NULL; i++) {
                /* Entries still waiting in this batch age from the read: keep
                 * them ours before another consumer counts them as abandoned. */
                if (i > 0 && now_ms() - read_at > c->min_backoff_ms / 2) {
                    touch_entries(c, stream, entries, i);
                    read_at = now_ms();
                }
                handle(c, stream, entries->element[i], 1);
            }
        }
    }
    freeReplyObject(r);
}

int outbox_unordered_run(struct outbox_consumer *c)
{
    while (!c->stop) {
        if (c->wr == NULL || c->rd == NULL) {
            if (connect_all(c) < 0) {
                outbox_conn_sleep(c, outbox_backoff_next(&c->reconnect, outbox_backoff_random()));
                continue;
            }
        }
        long long now = now_ms();
        if (now - c->last_reclaim_ms >= (long long)c->o.reclaim_interval_ms) {
            c->last_reclaim_ms = now;
            reclaim_stream(c, c->stream);
            if (c->wr != NULL && !c->stop)
                reclaim_stream(c, c->replay);
            if (c->wr == NULL || c->stop)
                continue;
        }
        read_once(c);
    }
    return 0;
}
