/*
 * The ordered mode of the consumer library (docs/CONSUMERS.md, "Ordered consumers"): each
 * partition's entries in hand, read from its pending list and its streams,
 * and handled one key at a time in id order (consumer/order.c picks the
 * next); the connections to the primaries the partitions are on; the loop.
 */
#include "common/compat.h"

#include "consumer/leases.h"
#include "consumer/part.h"

#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/backoff.h"
#include "common/common.h"
#include "common/functions.h"
#include "common/keys.h"
#include "consumer/order.h"

/* How long an entry waits after Redis refused its acknowledgement or its
 * dead letter (OOM, READONLY, a key of the wrong type) before it is tried
 * again. */
#define RETRY_AFTER_REFUSAL_MS 1000

/* The key of an entry in hand, for outbox_order_next. */
OUTBOX_STATIC void order_item(const struct held *h, struct outbox_order_item *it);
OUTBOX_STATIC void order_item(const struct held *h, struct outbox_order_item *it)
{
    memset(it, 0, sizeof(*it));
    it->retry_at = h->retry_at;
    it->done = h->done;
    const redisReply *fields = h->entry->element[1];
    if (fields->type == REDIS_REPLY_ARRAY) {
        size_t len = 0;
        const redisReply *k = outbox_msg_field(fields, "key", &len);
        if (k != NULL) {
            it->key = k->str;
            it->key_len = len;
            it->has_key = 1;
        }
    }
}

/* Appends a read's entries to a partition's hand; returns how many. */
OUTBOX_STATIC size_t keep_entries(struct part *pt, redisReply *r, int replay,
                                  const redisReply *counts, char *last, size_t lastlen);
OUTBOX_STATIC size_t keep_entries(struct part *pt, redisReply *r, int replay,
                                  const redisReply *counts, char *last, size_t lastlen)
{
    size_t n = 0;
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 1)
        return 0;
    redisReply *sr = r->element[0];
    if (sr->type != REDIS_REPLY_ARRAY || sr->elements != 2 ||
        sr->element[1]->type != REDIS_REPLY_ARRAY)
        return 0;
    redisReply *entries = sr->element[1];
    for (size_t i = 0; i < entries->elements && pt->nq < ORDER_QUEUE_MAX; i++) {
        redisReply *e = entries->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements != 2 ||
            e->element[0]->type != REDIS_REPLY_STRING)
            continue;
        /* Read again after an unpark: what is in hand stays as it is. */
        int in_hand = 0;
        for (size_t k = 0; k < pt->nq && !in_hand; k++)
            in_hand = pt->q[k].replayed == replay &&
                      strcmp(pt->q[k].entry->element[0]->str, e->element[0]->str) == 0;
        size_t key_len = 0;
        const char *key = outbox_msg_key(e, &key_len);
        snprintf(last, lastlen, "%s", e->element[0]->str);
        n++;
        if (in_hand || outbox_lease_is_parked(pt, key, key_len))
            continue; /* a parked key's messages stay pending, out of hand */
        uint32_t deliveries = 1;
        for (size_t k = 0; counts != NULL && k < counts->elements; k++) {
            const redisReply *pe = counts->element[k];
            /* [id, consumer, idle ms, deliveries]: skip an entry of any
             * other shape, as reclaim_stream does. */
            if (pe->type == REDIS_REPLY_ARRAY && pe->elements == 4 &&
                pe->element[0]->type == REDIS_REPLY_STRING &&
                pe->element[3]->type == REDIS_REPLY_INTEGER &&
                strcmp(pe->element[0]->str, e->element[0]->str) == 0)
                deliveries = (uint32_t)pe->element[3]->integer;
        }
        struct held *h = &pt->q[pt->nq++];
        h->entry = e;
        h->replayed = replay;
        h->deliveries = deliveries;
        h->retry_at = 0;
        h->done = 0;
        h->dropped = 0;
        h->dl_reason = h->dl_why = NULL;
        entries->element[i] = NULL; /* ours now: freeReplyObject skips NULL */
    }
    return n;
}

/* Whether any entry in a partition's hand may be handled now. */
OUTBOX_STATIC int any_ready(const struct part *pt, long long now);
OUTBOX_STATIC int any_ready(const struct part *pt, long long now)
{
    struct outbox_order_item items[ORDER_QUEUE_MAX];
    for (size_t i = 0; i < pt->nq; i++)
        order_item(&pt->q[i], &items[i]);
    return outbox_order_next(items, pt->nq, now, NULL) >= 0;
}

/* The group's last delivered id on a stream, for XREAD to wait after. */
static void last_delivered(struct outbox_consumer *c, const char *stream, char *out, size_t outlen)
{
    redisReply *r = outbox_conn_call(c, (const char *[]){"XINFO", "GROUPS", stream, NULL});
    if (r == NULL)
        return;
    for (size_t i = 0; r->type == REDIS_REPLY_ARRAY && i < r->elements; i++) {
        const redisReply *g = r->element[i];
        const char *name = NULL, *last = NULL;
        for (size_t k = 0; g->type == REDIS_REPLY_ARRAY && k + 1 < g->elements; k += 2) {
            if (g->element[k]->type != REDIS_REPLY_STRING ||
                g->element[k + 1]->type != REDIS_REPLY_STRING)
                continue;
            if (strcmp(g->element[k]->str, "name") == 0)
                name = g->element[k + 1]->str;
            else if (strcmp(g->element[k]->str, "last-delivered-id") == 0)
                last = g->element[k + 1]->str;
        }
        if (name != NULL && last != NULL && strcmp(name, c->group) == 0)
            snprintf(out, outlen, "%s", last);
    }
    freeReplyObject(r);
}

/* Reads into the partitions' hands: each partition's own pending entries
 * first (after a take-over or a restart), then new ones. Returns how many
 * entries came. */
static size_t fill(struct outbox_consumer *c, struct ordered *od)
{
    size_t got = 0;
    for (uint32_t i = 0; i < od->n && c->wr != NULL && !c->stop; i++) {
        struct part *pt = &od->parts[i];
        use_part(c, pt);
        /* count entries in hand; more, up to ORDER_QUEUE_MAX, while all of
         * them wait behind retries, so that the other keys go on. */
        size_t limit = any_ready(pt, now_ms()) ? c->o.count : ORDER_QUEUE_MAX;
        for (int s = 0; s < 2 && pt->token != 0 && pt->ready && c->wr != NULL; s++) {
            if (pt->nq >= limit)
                break;
            const char *stream = s ? pt->replay : pt->stream;
            char count[24];
            size_t room = limit - pt->nq;
            snprintf(count, sizeof(count), "%zu", room > c->o.count ? (size_t)c->o.count : room);
            const char *from = pt->pel_done[s] ? ">" : pt->pel_cursor[s];
            redisReply *counts = NULL;
            if (!pt->pel_done[s]) {
                /* The delivery counts of our own pending entries. */
                const char *start = strcmp(from, "0") == 0 ? "-" : from;
                char excl[80];
                if (strcmp(start, "-") != 0) {
                    snprintf(excl, sizeof(excl), "(%s", start);
                    start = excl;
                }
                counts = outbox_conn_call(c, (const char *[]){"XPENDING", stream, c->group, start,
                                                              "+", count, c->consumer, NULL});
                if (counts == NULL)
                    return got;
            }
            redisReply *r = outbox_conn_call(
                c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_READ, "2", stream, pt->lease,
                                    c->group, c->consumer, pt->token_s, count, from, NULL});
            if (r == NULL) {
                freeReplyObject(counts);
                return got;
            }
            if (outbox_msg_lease_lost(r)) {
                outbox_lease_lost(c, pt, "another consumer holds it");
            } else if (r->type == REDIS_REPLY_ERROR) {
                outbox_report_problem(c, OUTBOX_CONSUMER_ERR_REDIS, "reading %s failed: %s", stream,
                                      r->str);
                outbox_conn_reconnect_if_needed(c, r);
            } else {
                size_t want = (size_t)atoi(count);
                /* XREAD waits after the last entry delivered to the group:
                 * the last new one read, never one of our pending ones. */
                int pel = !pt->pel_done[s];
                size_t n = keep_entries(pt, r, s, counts, pel ? pt->pel_cursor[s] : pt->last_id[s],
                                        sizeof(pt->last_id[s]));
                got += n;
                if (pel) {
                    if (n < want)
                        pt->pel_done[s] = 1;
                } else if (n == 0 && pt->last_id[s][0] == '\0') {
                    last_delivered(c, stream, pt->last_id[s], sizeof(pt->last_id[s]));
                }
            }
            freeReplyObject(r);
            freeReplyObject(counts);
        }
    }
    return got;
}

/* Remembers a dead letter that could not be written, to write it again
 * later without calling the handler once more. */
static void keep_dead_letter(struct held *h, const char *reason, const char *why)
{
    if (h->dl_reason == NULL) {
        h->dl_reason = strdup(reason);
        h->dl_why = strdup(why);
    }
    h->retry_at = now_ms() + RETRY_AFTER_REFUSAL_MS;
}

/* Why an entry in hand goes to the dead letters without its handler: its
 * dead letter was refused before, it was deleted from the stream (gone), it
 * breaks the contract (bad), or it was delivered too often. Writes why and
 * returns the reason, or NULL when the handler decides. */
static const char *verdict(struct outbox_consumer *c, const struct held *h, int gone,
                           const char *bad, char *why, size_t whylen)
{
    if (h->dl_reason != NULL) {
        /* Its dead letter was refused before: write it again, without
         * calling the handler once more. */
        snprintf(why, whylen, "%s", h->dl_why != NULL ? h->dl_why : "");
        return h->dl_reason;
    }
    if (gone) {
        c->stats.lost++;
        snprintf(why, whylen, "the entry was deleted or trimmed from the stream while pending");
        return "lost";
    }
    if (bad != NULL) {
        c->stats.malformed++;
        snprintf(why, whylen, "malformed: %s", bad);
        return "malformed";
    }
    if (h->deliveries > c->o.max_deliveries) {
        snprintf(why, whylen,
                 "delivered %u times (max_deliveries %u): the consumer of the last delivery did "
                 "not finish it",
                 h->deliveries, c->o.max_deliveries);
        return "exhausted";
    }
    return NULL;
}

/* Acknowledges an entry its handler finished, under the partition's lease. */
static void ack_held(struct outbox_consumer *c, struct part *pt, struct held *h, const char *stream,
                     const char *entry_id)
{
    redisReply *r =
        outbox_conn_call(c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_ACK, "2", stream,
                                             pt->lease, c->group, pt->token_s, entry_id, NULL});
    if (r == NULL)
        return;
    if (r->type == REDIS_REPLY_INTEGER) {
        c->stats.done++;
        h->done = 1;
        outbox_report_clear_error(c);
    } else if (outbox_msg_lease_lost(r)) {
        freeReplyObject(r);
        outbox_lease_lost(c, pt, "it ran out while a message was handled");
        return;
    } else {
        /* Handled again after a pause: the processed table makes the
         * second call a no-op. */
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_REDIS, "acknowledging %s %s failed: %s",
                              stream, entry_id,
                              r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        h->retry_at = now_ms() + RETRY_AFTER_REFUSAL_MS;
        outbox_conn_reconnect_if_needed(c, r);
    }
    freeReplyObject(r);
}

/* Calls the handler of an entry in hand (m parsed from it): acknowledges
 * what it finished, or schedules a retry, the later entries of its key
 * waiting meanwhile. Returns the reason to dead-letter it (why written), or
 * NULL when nothing more is to be done now. */
static const char *call_handler(struct outbox_consumer *c, struct part *pt, struct held *h,
                                struct outbox_message *m, char *why, size_t whylen)
{
    const char *stream = h->replayed ? pt->replay : pt->stream;
    const char *entry_id = h->entry->element[0]->str;
    m->stream = stream;
    m->entry_id = entry_id;
    m->deliveries = h->deliveries;
    c->stats.delivered++;
    enum outbox_handled result = c->handler(m, c->arg, why, whylen);
    if (why[0] == '\0')
        snprintf(why, whylen, "the handler gave no reason");
    if (result == OUTBOX_HANDLED_DONE) {
        ack_held(c, pt, h, stream, entry_id);
        return NULL;
    }
    if (result == OUTBOX_HANDLED_FAIL)
        return "permanent";
    if (h->deliveries >= c->o.max_deliveries)
        return "exhausted";
    uint32_t wait = outbox_consumer_backoff_ms(&c->o, h->deliveries);
    c->stats.retried++;
    outbox_report_emit(c, OUTBOX_CONSUMER_LOG_INFO,
                       "%s %s (message %s, key %.*s) will be retried in %u ms (delivery %u of %u); "
                       "later messages of its key wait: %s",
                       stream, entry_id, m->id, m->key != NULL ? (int)m->key_len : 6,
                       m->key != NULL ? m->key : "(none)", wait, h->deliveries, c->o.max_deliveries,
                       why);
    h->retry_at = now_ms() + wait;
    h->deliveries++;
    return NULL;
}

/* Parks the key of an entry about to be dead-lettered (park_keys), before
 * the dead letter: should the dead letter fail, the key is parked all the
 * same, and nothing of it runs ahead. 0 when the dead letter may go on; -1
 * when it waits (the connection was lost, or the key could not be parked:
 * then the dead letter is kept in h for later). */
static int park_key(struct outbox_consumer *c, struct part *pt, struct held *h, const char *key,
                    size_t key_len, const char *reason, const char *why)
{
    const char *argv[] = {"SADD", pt->parked_key, key, NULL};
    size_t lens[3] = {4, strlen(pt->parked_key), key_len};
    redisReply *r = outbox_conn_command(c->wr, 3, argv, lens);
    if (r == NULL) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s",
                              c->wr->errstr);
        outbox_conn_close_all(c);
        return -1;
    }
    int parked = r->type == REDIS_REPLY_INTEGER;
    if (!parked)
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_REDIS,
                              "parking key %.*s in %s failed: %s; its dead letter waits until it "
                              "can be parked",
                              (int)key_len, key, pt->parked_key,
                              r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
    freeReplyObject(r);
    if (!parked || outbox_lease_load_parked(c, pt) < 0 || c->wr == NULL) {
        keep_dead_letter(h, reason, why);
        return -1;
    }
    outbox_report_emit(c, OUTBOX_CONSUMER_LOG_WARNING,
                       "%s: key %.*s parked on %s: its later messages wait until an operator "
                       "removes it from %s",
                       c->consumer, (int)key_len, key, pt->stream, pt->parked_key);
    return 0;
}

/* Dead-letters an entry in hand under the partition's lease (fields NULL:
 * deleted from the stream). With park_keys, its key is parked first, and the
 * later entries of the key leave the hand, still pending. */
static void dead_letter_held(struct outbox_consumer *c, struct part *pt, struct held *h,
                             const redisReply *fields, const char *reason, const char *why)
{
    const char *stream = h->replayed ? pt->replay : pt->stream;
    const char *entry_id = h->entry->element[0]->str;
    struct lease_ref lr = {pt->lease, pt->token_s, pt->dlq};
    size_t key_len = 0;
    const char *key = outbox_msg_key(h->entry, &key_len);
    if (c->o.park_keys && key != NULL && !outbox_lease_is_parked(pt, key, key_len) &&
        park_key(c, pt, h, key, key_len, reason, why) < 0)
        return;
    int rc = outbox_msg_dead_letter(c, stream, &lr, entry_id, fields, reason, why, h->deliveries);
    if (rc == 0)
        h->done = 1;
    else if (rc == OUTBOX_LEASE_LOST)
        outbox_lease_lost(c, pt, "it ran out while a message was dead-lettered");
    else
        keep_dead_letter(h, reason, why);
    if (rc == 0 && c->o.park_keys && key != NULL)
        for (size_t i = 0; i < pt->nq; i++) {
            size_t len = 0;
            const char *k = outbox_msg_key(pt->q[i].entry, &len);
            if (&pt->q[i] != h && k != NULL && len == key_len && memcmp(k, key, len) == 0)
                pt->q[i].dropped = 1;
        }
}

/* Handles one entry of a partition; the outcome is recorded in h. */
static void handle_held(struct outbox_consumer *c, struct part *pt, struct held *h)
{
    const redisReply *fields = h->entry->element[1];
    char why[512] = "";
    struct outbox_message m;
    const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
    size_t vlens[OUTBOX_HEADERS_MAX];
    memset(&m, 0, sizeof(m));
    const char *bad =
        fields->type == REDIS_REPLY_NIL ? NULL : outbox_msg_parse(fields, &m, names, values, vlens);
    if (fields->type == REDIS_REPLY_NIL)
        fields = NULL;
    const char *reason = verdict(c, h, fields == NULL, bad, why, sizeof(why));
    if (reason == NULL)
        reason = call_handler(c, pt, h, &m, why, sizeof(why));
    if (reason != NULL)
        dead_letter_held(c, pt, h, fields, reason, why);
}

/* Drops the entries that are done from a partition's hand. */
static void compact(struct part *pt)
{
    size_t w = 0;
    for (size_t i = 0; i < pt->nq; i++) {
        if (pt->q[i].done || pt->q[i].dropped)
            outbox_part_held_free(&pt->q[i]);
        else
            pt->q[w++] = pt->q[i];
    }
    pt->nq = w;
}

/* Handles the next entry of the next partition that has one ready; 1 when
 * it did, 0 when none is ready (*wake_at: the earliest backoff's end, or
 * -1). */
static int handle_next(struct outbox_consumer *c, struct ordered *od, long long *wake_at)
{
    long long now = now_ms();
    *wake_at = -1;
    for (uint32_t k = 0; k < od->n; k++) {
        struct part *pt = &od->parts[(od->rr + k) % od->n];
        if (pt->token == 0 || !pt->ready || pt->nq == 0)
            continue;
        if (now >= pt->valid_until) {
            outbox_lease_lost(c, pt, "it was not renewed in time");
            continue;
        }
        struct outbox_order_item items[ORDER_QUEUE_MAX];
        for (size_t i = 0; i < pt->nq; i++)
            order_item(&pt->q[i], &items[i]);
        long long wake = -1;
        long next = outbox_order_next(items, pt->nq, now, &wake);
        if (next < 0) {
            if (wake >= 0 && (*wake_at < 0 || wake < *wake_at))
                *wake_at = wake;
            continue;
        }
        od->rr = (od->rr + k + 1) % od->n;
        use_part(c, pt);
        handle_held(c, pt, &pt->q[next]);
        compact(pt);
        return 1;
    }
    return 0;
}

/* Whether XREAD waits for new entries of a partition's stream (s 0) or
 * replay stream (s 1): held, taken over, read up to the group's last entry,
 * and room in hand (with a full hand, new entries would wake it for
 * nothing). */
static int waits_on(const struct part *pt, int s)
{
    return pt->token != 0 && pt->ready && pt->last_id[s][0] != '\0' && pt->nq < ORDER_QUEUE_MAX;
}

/* Waits for new entries on the held partitions (plain XREAD: it changes
 * nothing), a backoff's end or the next upkeep, whichever comes first. */
static void wait_for_entries(struct outbox_consumer *c, struct ordered *od, long long wake_at)
{
    long long now = now_ms();
    long long until = od->next_upkeep;
    if (wake_at >= 0 && wake_at < until)
        until = wake_at;
    long long ms = until - now;
    if (ms > (long long)c->o.block_ms)
        ms = c->o.block_ms;
    if (ms < 1)
        return;
    size_t n = 0;
    for (uint32_t i = 0; i < od->n; i++)
        for (int s = 0; s < 2; s++)
            n += waits_on(&od->parts[i], s);
    if (n == 0) {
        outbox_conn_sleep(c, (uint32_t)ms);
        return;
    }
    if (od->poll) {
        outbox_conn_sleep(c, ms > ORDER_POLL_MS ? ORDER_POLL_MS : (uint32_t)ms);
        return;
    }
    const char **argv = calloc(2 * n + 6, sizeof(*argv));
    size_t *lens = calloc(2 * n + 6, sizeof(*lens));
    if (argv == NULL || lens == NULL) {
        free(argv);
        free(lens);
        outbox_conn_sleep(c, (uint32_t)ms);
        return;
    }
    char block[16];
    snprintf(block, sizeof(block), "%lld", ms);
    size_t argc = 0;
    argv[argc++] = "XREAD";
    argv[argc++] = "COUNT";
    argv[argc++] = "1";
    argv[argc++] = "BLOCK";
    argv[argc++] = block;
    argv[argc++] = "STREAMS";
    for (uint32_t i = 0; i < od->n; i++)
        for (int s = 0; s < 2; s++)
            if (waits_on(&od->parts[i], s))
                argv[argc++] = s ? od->parts[i].replay : od->parts[i].stream;
    for (uint32_t i = 0; i < od->n; i++)
        for (int s = 0; s < 2; s++)
            if (waits_on(&od->parts[i], s))
                argv[argc++] = od->parts[i].last_id[s];
    for (size_t i = 0; i < argc; i++)
        lens[i] = strlen(argv[i]);
    redisReply *r = outbox_conn_command(c->rd, (int)argc, argv, lens);
    if (r == NULL) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost while waiting: %s",
                              c->rd->errstr);
        outbox_conn_close_all(c);
    } else {
        if (r->type == REDIS_REPLY_ERROR &&
            (strncmp(r->str, "CROSSSLOT", 9) == 0 || strncmp(r->str, "MOVED ", 6) == 0)) {
            /* A cluster, even with a single primary: its partitions are in
             * different slots. */
            od->poll = 1;
            outbox_report_emit(
                c, OUTBOX_CONSUMER_LOG_INFO,
                "%s: the partitions of %s are in different hash slots of a Redis Cluster: "
                "reading them every %d ms",
                c->consumer, c->stream, ORDER_POLL_MS);
        }
        freeReplyObject(r);
    }
    free(argv);
    free(lens);
}

static int same_server(const redisContext *a, const redisContext *b)
{
    return a->tcp.host != NULL && b->tcp.host != NULL && a->tcp.port == b->tcp.port &&
           strcmp(a->tcp.host, b->tcp.host) == 0;
}

/* Finds a partition's connection: the primary of its stream's slot, shared
 * by every partition there. A primary met for the first time gets the
 * functions loaded. */
static int attach_part(struct outbox_consumer *c, struct part *pt)
{
    redisContext *ctx = outbox_conn_open(c, pt->stream, c->o.command_timeout_ms, "ack");
    if (ctx == NULL)
        return -1;
    for (int i = 0; i < c->nnodes; i++) {
        if (same_server(c->node[i], ctx)) {
            redisFree(ctx);
            pt->node = i;
            return 0;
        }
    }
    if (c->nnodes == CONSUMER_NODES_MAX) {
        redisFree(ctx);
        outbox_report_problem(
            c, OUTBOX_CONSUMER_ERR_REDIS,
            "the partitions of %s are on more than %d primaries: use fewer partitions", c->stream,
            CONSUMER_NODES_MAX);
        return -1;
    }
    pt->node = c->nnodes;
    c->node[c->nnodes++] = ctx;
    c->wr = ctx;
    return outbox_conn_load_functions(c);
}

static int connect_ordered(struct outbox_consumer *c, struct ordered *od)
{
    outbox_conn_close_all(c);
    c->wr = outbox_conn_open(c, c->stream, c->o.command_timeout_ms, "ack");
    if (c->wr == NULL)
        goto fail;
    c->node[0] = c->wr;
    c->nnodes = 1;
    if (outbox_conn_load_functions(c) < 0)
        goto fail;
    /* In a Redis Cluster the partition streams hash to different slots:
     * each partition's commands go to its own primary. A single server (its
     * CLUSTER SLOTS is an error) serves them all on this connection. */
    redisReply *slots = outbox_conn_call(c, (const char *[]){"CLUSTER", "SLOTS", NULL});
    if (slots == NULL)
        goto fail;
    int cluster = slots->type == REDIS_REPLY_ARRAY;
    freeReplyObject(slots);
    for (uint32_t i = 0; i < od->n; i++) {
        od->parts[i].node = 0;
        if (cluster && attach_part(c, &od->parts[i]) < 0)
            goto fail;
    }
    od->poll = c->nnodes > 1;
    use_base(c);
    c->rd = outbox_conn_open(c, c->stream, c->o.block_ms + c->o.command_timeout_ms, "read");
    if (c->rd == NULL)
        goto fail;
    for (uint32_t i = 0; i < od->n; i++) {
        use_part(c, &od->parts[i]);
        outbox_conn_migrate_name(c, od->parts[i].stream, od->parts[i].dlq, 0);
        outbox_conn_migrate_name(c, od->parts[i].stream, od->parts[i].replay, 1);
        if (outbox_conn_ensure_group(c, od->parts[i].stream) < 0 ||
            outbox_conn_ensure_group(c, od->parts[i].replay) < 0)
            goto fail;
    }
    use_base(c);
    /* What was in hand may have been acknowledged with the reply lost: read
     * it again from the pending list, after taking over again what others
     * left. */
    for (uint32_t i = 0; i < od->n; i++) {
        struct part *pt = &od->parts[i];
        for (size_t k = 0; k < pt->nq; k++)
            outbox_part_held_free(&pt->q[k]);
        pt->nq = 0;
        pt->ready = 0;
        for (int s = 0; s < 2; s++) {
            pt->pel_done[s] = 0;
            snprintf(pt->pel_cursor[s], sizeof(pt->pel_cursor[s]), "0");
            pt->last_id[s][0] = '\0';
        }
    }
    outbox_report_emit(
        c, OUTBOX_CONSUMER_LOG_INFO,
        "%s: %s the %u partitions of %s as group %s, in order per key (leases of %u ms)",
        c->consumer, c->last_error[0] != '\0' ? "connected again, reading" : "reading", od->n,
        c->stream, c->group, c->o.lease_ms);
    c->last_error[0] = '\0';
    outbox_report_clear_error(c);
    outbox_backoff_reset(&c->reconnect);
    od->next_upkeep = 0;
    return 0;
fail:
    outbox_conn_close_all(c);
    return -1;
}

int outbox_ordered_run(struct outbox_consumer *c)
{
    struct ordered od;
    memset(&od, 0, sizeof(od));
    od.n = c->o.partitions;
    od.parts = calloc(od.n, sizeof(*od.parts));
    if (od.parts == NULL || outbox_key_lease(c->stream, c->group, "lease-members", od.members_key,
                                             sizeof(od.members_key)) < 0) {
        free(od.parts);
        outbox_report_set_error(c, OUTBOX_CONSUMER_ERR_OOM, "out of memory for the partitions");
        return -1;
    }
    for (uint32_t i = 0; i < od.n; i++) {
        struct part *pt = &od.parts[i];
        pt->p = i;
        /* outbox_consumer_new checked that every name fits. */
        if (outbox_key_partition_stream(NULL, c->stream, strlen(c->stream), i, od.n, pt->stream,
                                        sizeof(pt->stream)) < 0 ||
            outbox_consumer_replay_name(pt->stream, c->group, pt->replay, sizeof(pt->replay)) < 0 ||
            outbox_consumer_dlq_name(pt->stream, c->group, pt->dlq, sizeof(pt->dlq)) < 0 ||
            outbox_consumer_lease_names(pt->stream, c->group, pt->lease, pt->tokens,
                                        sizeof(pt->lease)) < 0 ||
            outbox_key_lease(pt->stream, c->group, "parked", pt->parked_key,
                             sizeof(pt->parked_key)) < 0) {
            free(od.parts);
            outbox_report_set_error(c, OUTBOX_CONSUMER_ERR_OOM,
                                    "a partition's key names do not fit");
            return -1;
        }
    }
    while (!c->stop) {
        if (c->wr == NULL || c->rd == NULL) {
            if (connect_ordered(c, &od) < 0) {
                outbox_conn_sleep(c, outbox_backoff_next(&c->reconnect, outbox_backoff_random()));
                continue;
            }
        }
        long long now = now_ms();
        if (now >= od.next_upkeep) {
            od.next_upkeep = now + c->o.lease_ms / 3;
            outbox_lease_upkeep(c, &od);
            continue;
        }
        long long wake_at = -1;
        if (handle_next(c, &od, &wake_at))
            continue;
        if (c->wr == NULL || fill(c, &od) > 0 || c->wr == NULL)
            continue;
        wait_for_entries(c, &od, wake_at);
    }
    /* A clean stop gives the partitions up at once, rather than after the
     * leases run out, and leaves the members, so that the others count it
     * out at their next beat. */
    for (uint32_t i = 0; i < od.n; i++) {
        use_part(c, &od.parts[i]);
        if (c->wr != NULL)
            outbox_lease_release(c, &od.parts[i], "stopping");
        outbox_part_drop(&od.parts[i]);
    }
    use_base(c);
    redisReply *r =
        outbox_conn_call(c, (const char *[]){"ZREM", od.members_key, c->consumer, NULL});
    freeReplyObject(r);
    free(od.parts);
    return 0;
}
