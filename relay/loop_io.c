/*
 * The batch loop's ops on a claiming connection and Redis (relay/loop.h;
 * docs/DESIGN.md, "Batches from snapshots"). PostgreSQL is asked for ticks
 * and for a batch's chunks, in autocommit: no transaction stays open while
 * Redis works. Each chunk's rows get their stream's next rank; those Redis
 * holds already are skipped; the rest go out per stream as MULTI, XADD with
 * each row's id, EXEC, one call of a stream at a time. A batch fully in its
 * streams is recorded (outbox.record_batch) with the rows it quarantined.
 */
#include "common/compat.h"

#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <libpq-fe.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/keys.h"
#include <stdint.h>
#include "core/pg.h"
#include "relay/daemon.h"
#include "relay/log.h"
#include "relay/ownership_io.h"
#include "relay/pgsrc.h"
#include "relay/sink.h"

#define COMPONENT "batch"

/* Columns of the batch statement (relay_pgsrc_batch_sql) past the claim's. */
#define COL_TXID 11
#define COL_MS 12
#define COL_HELD_BY 13
#define COL_QUARANTINED 14

static struct relay_chunk *chunk_of(struct relay_loop_io *b, uint32_t number)
{
    return &b->chunks[number % 2];
}

static void chunk_clear(struct relay_chunk *c)
{
    if (c->res != NULL)
        PQclear(c->res);
    c->res = NULL;
    c->nrows = 0;
    c->pending = 0;
    c->failed = 0;
    c->error[0] = '\0';
}

/* ---- the batch's phases -------------------------------------------------- */

static void phase_to(struct relay_loop_io *b, enum relay_batch_phase next)
{
    double now = relay_now();
    b->phase_s[b->phase] += now - b->phase_mark;
    b->phase_mark = now;
    b->phase = next;
}

static void observe_seconds(unsigned long long *hist, double *sum, double s)
{
    size_t k = 0;
    while (k < RELAY_BATCH_BUCKETS && s > relay_batch_buckets[k])
        k++;
    hist[k]++;
    *sum += s;
}

/* ---- ops ---------------------------------------------------------------- */

static int op_ready(void *arg)
{
    const struct relay *r = arg;
    return relay_pgsrc_state(r->batch.pg) == RELAY_PG_READY && relay_sink_ready(r->sink);
}

static void on_ticked(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                      void *arg);
static void on_read(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                    void *arg);
static void on_recorded(struct relay_pgsrc *pg, PGresult *res, const char *err,
                        const char *sqlstate, void *arg);

static int op_tick(void *arg, uint64_t gen)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    b->stage_at = relay_now();
    char min_ms[24];
    snprintf(min_ms, sizeof(min_ms), "%" PRIu64, b->min_ms);
    char after[24];
    snprintf(after, sizeof(after), "%" PRIu64, b->loop.lead);
    const char *params[2] = {min_ms, after};
    b->sent_gen = gen;
    /* The tick, and the bounds of the lead's next batch when the tick is
     * that batch's: its rows are read one round trip sooner. */
    return relay_pgsrc_send(b->pg,
                            "SELECT tick, lo, hi FROM outbox.tick_bounds($1::bigint, $2::bigint)",
                            2, params, 0, on_ticked, r);
}

/* The bounds in a tick's answer (columns 1 and 2): those of the batch that
 * ends at its tick, which outbox.tick_bounds gives only when that tick is
 * the one after the lead asked about; NULL otherwise. */
static void keep_bounds(struct relay_loop_io *b, const PGresult *res, uint64_t tick)
{
    if (tick < 2 || PQnfields(res) < 3 || PQgetisnull(res, 0, 1) || PQgetisnull(res, 0, 2))
        return;
    b->known_prev = tick - 1;
    b->known_lo = strtoll(PQgetvalue(res, 0, 1), NULL, 10);
    b->known_hi = strtoll(PQgetvalue(res, 0, 2), NULL, 10);
}

/* ---- where each stream stands ------------------------------------------- */

/* Brings the cursor's ownership up to date (partitions change owners). A
 * stream the relay no longer publishes forgets where it stands: another relay
 * moves it meanwhile, and taking it back reads its recorded position. */
static void stream_owner(struct relay *r, struct relay_cursor *cur)
{
    struct relay_loop_io *b = &r->batch;
    unsigned long epoch = relay_ownership_io_epoch(r->owner);
    if (cur->own_epoch == epoch)
        return;
    int owned = cur->partitioned ? relay_ownership_io_owns(r->owner, cur->topic, cur->partition)
                                 : relay_ownership_io_owns_topic(r->owner, cur->topic);
    if (cur->own_epoch == 0)
        cur->paused = relay_paused_has(&r->paused, cur->topic);
    if (!owned)
        cur->known = 0;
    else if (!cur->known)
        b->reload = 1;
    cur->owned = owned;
    cur->own_epoch = epoch;
}

/* Whether the relay publishes the stream's rows of the batch (prev, next]:
 * it owns the stream, the stream is not paused and stands at prev. Decided at
 * the stream's first row in the batch, and kept for the rest of it. */
static int stream_active(struct relay *r, struct relay_cursor *cur)
{
    struct relay_loop_io *b = &r->batch;
    if (cur->active_batch != b->batch_serial) {
        stream_owner(r, cur);
        cur->active_batch = b->batch_serial;
        cur->met = 0;
        cur->active = cur->owned && cur->known && !cur->paused &&
                      relay_cursor_position(cur, b->loop.lead) == b->loop.prev;
    }
    return cur->active;
}

static int op_prepare(void *arg)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    unsigned long epoch = relay_ownership_io_epoch(r->owner);
    if (b->pause_applied == b->pause_epoch && b->owners_applied == epoch)
        return b->reload || b->verify;
    b->pause_applied = b->pause_epoch;
    b->owners_applied = epoch;
    uint64_t lead = b->loop.lead;
    for (size_t i = 0; b->cursors.slots != NULL && i <= b->cursors.mask; i++) {
        struct relay_cursor *cur = &b->cursors.slots[i];
        if (cur->topic[0] == '\0')
            continue;
        stream_owner(r, cur);
        int paused = relay_paused_has(&r->paused, cur->topic);
        if (paused && !cur->paused && cur->known && cur->follows) {
            cur->follows = 0; /* it stays where the lead is now */
            cur->pos = lead;
        }
        cur->paused = paused;
        if (!paused && cur->known && !cur->follows && cur->pos >= lead)
            cur->follows = 1;
    }
    return b->reload || b->verify;
}

static uint64_t op_behind(void *arg, uint64_t lead)
{
    struct relay *r = arg;
    return relay_cursors_behind(&r->batch.cursors, lead);
}

static void on_loaded(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                      void *arg);
static void check_streams(struct relay *r);

static int op_load(void *arg, uint64_t gen)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    b->stage_at = relay_now();
    b->sent_gen = gen;
    b->reload = 0;
    b->verifying = b->verify;
    b->verify = 0;
    /* One row per stream: the table is as long as there are streams. */
    return relay_pgsrc_send(b->pg,
                            "SELECT topic, partition, tick, entry_id FROM outbox.stream_positions",
                            0, NULL, 0, on_loaded, r);
}

static void on_loaded(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                      void *arg)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    (void)pg;
    (void)sqlstate;
    if (r->stopping)
        return;
    if (err != NULL || res == NULL) {
        char why[600];
        snprintf(why, sizeof(why), "reading the streams' positions failed: %s",
                 err != NULL ? err : "no answer");
        relay_loop_failed(&b->loop, b->sent_gen, RELAY_FAIL_POSTGRES, why);
        return;
    }
    uint64_t lead = b->loop.lead, recorded_lead = 0;
    int n = PQntuples(res);
    for (int i = 0; i < n; i++)
        if (PQgetvalue(res, i, 0)[0] == '\0')
            recorded_lead = strtoull(PQgetvalue(res, i, 2), NULL, 10);
    if (!b->loop.loaded) {
        lead = recorded_lead;
        relay_info(COMPONENT, "publishing from the batch after tick %" PRIu64, lead);
    }
    size_t behind = 0;
    for (int i = 0; i < n; i++) {
        const char *topic = PQgetvalue(res, i, 0);
        if (topic[0] == '\0')
            continue;
        size_t before = b->cursors.n;
        struct relay_cursor *cur = relay_cursors_find(
            &b->cursors, topic, (int32_t)strtol(PQgetvalue(res, i, 1), NULL, 10));
        if (cur == NULL)
            continue; /* a name no row can have, or no memory: read again at the next load */
        int made = b->cursors.n != before;
        uint64_t ems = 0, eseq = 0;
        const char *eid = PQgetvalue(res, i, 3);
        if (relay_batch_parse_entry_id(eid, strlen(eid), &ems, &eseq) == 0)
            relay_cursor_expect(cur, ems, eseq);
        stream_owner(r, cur);
        if (!cur->owned || (cur->known && !made))
            continue; /* not ours, or ours all along: the relay knows better */
        uint64_t tick = strtoull(PQgetvalue(res, i, 2), NULL, 10);
        cur->known = 1;
        cur->pos = tick;
        cur->follows = tick >= lead;
        if (!cur->follows)
            behind++;
    }
    /* A stream the relay publishes now with no position has no row at or
     * below the lead: it follows it. */
    for (size_t i = 0; b->cursors.slots != NULL && i <= b->cursors.mask; i++) {
        struct relay_cursor *cur = &b->cursors.slots[i];
        if (cur->topic[0] != '\0' && cur->owned && !cur->known) {
            cur->known = 1;
            cur->follows = 1;
        }
    }
    b->reload = 0;
    if (behind > 0)
        relay_info(COMPONENT,
                   "%zu streams stand behind the lead (tick %" PRIu64
                   "): their batches are read again from where each stands",
                   behind, lead);
    b->loaded_lead = recorded_lead;
    if (b->verifying)
        check_streams(r);
    else
        relay_loop_loaded(&b->loop, b->sent_gen, recorded_lead);
}

/* ---- a Redis that lost entries ------------------------------------------- */

static void on_check_reply(redisAsyncContext *ac, void *reply_, void *arg);
static void on_lost_ticks(struct relay_pgsrc *pg, PGresult *res, const char *err,
                          const char *sqlstate, void *arg);

/* After Redis (re)connected: the last id of every stream the relay publishes
 * that should hold entries, read from Redis (XREVRANGE ... COUNT 1). A stream
 * that holds less than it should lost entries (a failover without
 * min_replicas, a restart from an older snapshot, appendfsync everysec): it
 * goes back to the batch of its last entry, and what it lost is published
 * again from PostgreSQL, whose rows stay until every stream is past them. A
 * stream that is gone while it should hold entries goes back to the oldest
 * tick kept: its rows are published again as far back as the outbox keeps
 * them. */
#define STREAM_KEY_MAX 1024 /* a prefix longer than any in use, the topic and ":ppp" */

/* The stream's key; its length, or -1 when it does not fit. */
static int stream_key(const struct relay *r, const struct relay_cursor *cur,
                      char key[STREAM_KEY_MAX])
{
    return outbox_key_partition_stream(r->cfg->stream_prefix, cur->topic, strlen(cur->topic),
                                       cur->partition, cur->partitioned ? 2 : 1, key,
                                       STREAM_KEY_MAX);
}

static void check_streams(struct relay *r)
{
    struct relay_loop_io *b = &r->batch;
    b->checks_pending = 0;
    b->checks_gen = b->sent_gen;
    b->nlost = 0;
    for (size_t i = 0; b->cursors.slots != NULL && i <= b->cursors.mask; i++) {
        struct relay_cursor *cur = &b->cursors.slots[i];
        cur->checking = 0;
        if (cur->topic[0] == '\0' || !cur->owned || !cur->known)
            continue;
        char key[STREAM_KEY_MAX];
        if (stream_key(r, cur, key) < 0)
            continue;
        outbox_buf_reset(&r->out);
        outbox_buf_printf(&r->out,
                          "*6\r\n$9\r\nXREVRANGE\r\n$%zu\r\n%s\r\n$1\r\n+\r\n$1\r\n-\r\n"
                          "$5\r\nCOUNT\r\n$1\r\n1\r\n",
                          strlen(key), key);
        if (r->out.failed || relay_sink_formatted(r->sink, r->out.data, r->out.len, on_check_reply,
                                                  (void *)(uintptr_t)i) != 0) {
            relay_loop_failed(&b->loop, b->sent_gen, RELAY_FAIL_REDIS_CONNECTION,
                              "Redis connection lost while reading the streams' last ids");
            return;
        }
        cur->checking = 1;
        b->checks_pending++;
    }
    if (b->checks_pending == 0)
        relay_loop_loaded(&b->loop, b->sent_gen, b->loaded_lead);
}

/* Every check answered: the streams that lost entries learn which tick
 * their last entry belongs to. */
static void checks_done(struct relay *r)
{
    struct relay_loop_io *b = &r->batch;
    if (b->nlost == 0) {
        relay_loop_loaded(&b->loop, b->checks_gen, b->loaded_lead);
        return;
    }
    outbox_buf_reset(&b->sql);
    outbox_buf_puts(&b->sql, "{");
    for (size_t i = 0; i < b->cursors.mask + 1; i++) {
        const struct relay_cursor *cur = &b->cursors.slots[i];
        if (cur->topic[0] != '\0' && cur->checking == 2)
            outbox_buf_printf(&b->sql, "%s%" PRIu64, b->sql.len > 1 ? "," : "",
                              cur->top_known ? cur->top_ms : 0);
    }
    outbox_buf_puts(&b->sql, "}");
    const char *params[1] = {b->sql.data};
    if (b->sql.failed ||
        relay_pgsrc_send(b->pg,
                         "SELECT m.ms, coalesce((SELECT max(t.tick_id) FROM outbox.ticks AS t"
                         " WHERE t.ms <= m.ms), (SELECT min(t.tick_id) FROM outbox.ticks AS t))"
                         " FROM unnest($1::bigint[]) AS m(ms)",
                         1, params, 0, on_lost_ticks, r) != 0)
        relay_loop_failed(&b->loop, b->checks_gen, RELAY_FAIL_POSTGRES,
                          "PostgreSQL connection lost while finding what Redis lost");
}

static void on_check_reply(redisAsyncContext *ac, void *reply_, void *arg)
{
    const redisReply *reply = reply_;
    struct relay *r = relay_sink_owner(ac);
    if (r == NULL || r->stopping)
        return;
    struct relay_loop_io *b = &r->batch;
    size_t i = (size_t)(uintptr_t)arg;
    if (b->checks_gen != b->loop.gen || b->checks_pending == 0 || b->cursors.slots == NULL ||
        i > b->cursors.mask || b->cursors.slots[i].checking != 1)
        return; /* a check of a load abandoned */
    struct relay_cursor *cur = &b->cursors.slots[i];
    b->checks_pending--;
    cur->checking = 0;
    uint64_t ms = 0, seq = 0;
    int have = 0;
    if (reply != NULL && reply->type == REDIS_REPLY_ERROR && reply->len >= 9 &&
        memcmp(reply->str, "WRONGTYPE", 9) == 0) {
        /* The stream's key holds another type: its rows are quarantined when
         * they are published, with what to do; nothing to compare here. */
        if (b->checks_pending == 0)
            checks_done(r);
        return;
    }
    if (reply == NULL || reply->type == REDIS_REPLY_ERROR || reply->type != REDIS_REPLY_ARRAY) {
        char why[300];
        snprintf(why, sizeof(why), "reading a stream's last id failed: %.*s",
                 reply != NULL && reply->type == REDIS_REPLY_ERROR ? (int)reply->len : 0,
                 reply != NULL && reply->type == REDIS_REPLY_ERROR ? reply->str : "");
        b->checks_pending = 0;
        relay_loop_failed(
            &b->loop, b->checks_gen,
            reply == NULL ? RELAY_FAIL_REDIS_CONNECTION : RELAY_FAIL_REDIS_ERROR,
            reply == NULL ? "Redis connection lost while reading the streams' last ids" : why);
        return;
    }
    if (reply->elements > 0) {
        const redisReply *e = reply->element[0];
        if (e->type == REDIS_REPLY_ARRAY && e->elements >= 1 &&
            e->element[0]->type == REDIS_REPLY_STRING &&
            relay_batch_parse_entry_id(e->element[0]->str, e->element[0]->len, &ms, &seq) == 0)
            have = 1;
    }
    if (have) {
        relay_cursor_set_top(cur, ms, seq);
        /* The next tick's entry ids lie above whatever the stream holds,
         * also entries written by relays before entry ids were the ticks'
         * (the Redis clock, which may run ahead of PostgreSQL's). */
        if (ms >= b->min_ms)
            b->min_ms = ms + 1;
    }
    if (cur->expect_ms == 0 && cur->expect_seq == 0) {
        /* Nothing written by this design yet: nothing it could have lost. */
    } else if (!have || ms < cur->expect_ms || (ms == cur->expect_ms && seq < cur->expect_seq)) {
        cur->checking = 2; /* lost entries */
        b->nlost++;
        char held[RELAY_ENTRY_ID_MAX], want[RELAY_ENTRY_ID_MAX], key[STREAM_KEY_MAX];
        relay_batch_entry_id(ms, seq, held);
        relay_batch_entry_id(cur->expect_ms, cur->expect_seq, want);
        if (stream_key(r, cur, key) < 0)
            snprintf(key, sizeof(key), "%s", cur->topic);
        relay_warn(COMPONENT,
                   "stream %s holds less than was published (last entry %s, where %s was "
                   "written): Redis lost entries; they are published again from the outbox",
                   key, have ? held : "none", want);
    }
    if (b->checks_pending == 0)
        checks_done(r);
}

static void on_lost_ticks(struct relay_pgsrc *pg, PGresult *res, const char *err,
                          const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    (void)pg;
    (void)sqlstate;
    if (r->stopping)
        return;
    if (err != NULL || res == NULL || (size_t)PQntuples(res) != b->nlost) {
        char why[600];
        snprintf(why, sizeof(why), "finding what Redis lost failed: %s",
                 err != NULL ? err : "no answer");
        relay_loop_failed(&b->loop, b->checks_gen, RELAY_FAIL_POSTGRES, why);
        return;
    }
    int k = 0;
    for (size_t i = 0; i < b->cursors.mask + 1; i++) {
        struct relay_cursor *cur = &b->cursors.slots[i];
        if (cur->topic[0] == '\0' || cur->checking != 2)
            continue;
        cur->checking = 0;
        uint64_t tick = PQgetisnull(res, k, 1) ? 1 : strtoull(PQgetvalue(res, k, 1), NULL, 10);
        k++;
        /* The batch of its last entry is read again (what it holds of it
         * is skipped); without an entry, from the oldest tick kept. */
        uint64_t pos = cur->top_known && tick > 0 ? tick - 1 : (tick > 0 ? tick - 1 : 0);
        uint64_t now = relay_cursor_position(cur, b->loop.lead);
        if (pos < now) {
            cur->follows = 0;
            cur->pos = pos;
        }
        cur->expect_ms = cur->top_known ? cur->top_ms : 0;
        cur->expect_seq = cur->top_known ? cur->top_seq : 0;
    }
    relay_loop_loaded(&b->loop, b->checks_gen, b->loaded_lead);
}

static void put_text_array(struct outbox_buf *out, const char *const *items, size_t n);
static void put_text_array_ids(struct outbox_buf *out, const int64_t *ids, size_t n);

static void on_bounds(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                      void *arg);

/* Sends the statement of chunk number `chunk` of the batch (read_prev,
 * read_next]: its rows with an id above after_id and at most upto_id. */
static int send_chunk(struct relay *r, uint64_t gen, uint32_t chunk)
{
    struct relay_loop_io *b = &r->batch;
    char p1[24], p2[24], p3[24], p4[24], p5[16];
    snprintf(p1, sizeof(p1), "%" PRIu64, b->read_prev);
    snprintf(p2, sizeof(p2), "%" PRIu64, b->read_next);
    snprintf(p3, sizeof(p3), "%" PRId64, b->after_id);
    snprintf(p4, sizeof(p4), "%" PRId64, b->upto_id);
    snprintf(p5, sizeof(p5), "%u", r->cfg->batch_size);
    /* The rows quarantined since the last statement sent go with this one. */
    outbox_buf_reset(&b->sql);
    size_t at = b->sql.len;
    put_text_array_ids(&b->sql, b->quarantined + b->nflushed, b->nquarantined - b->nflushed);
    size_t at_errors = b->sql.len;
    const char *errors[RELAY_QUARANTINE_MAX];
    for (size_t i = b->nflushed; i < b->nquarantined; i++)
        errors[i - b->nflushed] = b->quarantine_errors[i];
    put_text_array(&b->sql, errors, b->nquarantined - b->nflushed);
    if (b->sql.failed)
        return -1;
    const char *params[7] = {p1, p2, p3, p4, p5, b->sql.data + at, b->sql.data + at_errors};
    b->sent_gen = gen;
    b->read_number = chunk;
    int rc = relay_pgsrc_send_prepared(b->pg, "batch", 7, params, 1, on_read, r);
    if (rc == 0)
        b->nflushed = b->nquarantined; /* recorded with the read, or the batch fails */
    return rc;
}

static int op_read(void *arg, uint64_t gen, uint64_t prev, uint64_t next, uint32_t chunk)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    b->stage_at = relay_now();
    if (chunk > 0)
        return send_chunk(r, gen, chunk);
    b->batch_serial++; /* which streams it publishes is decided anew */
    b->started_at = b->phase_mark = relay_now();
    b->batch_read = 0;
    b->phase = RELAY_PHASE_READ;
    memset(b->phase_s, 0, sizeof(b->phase_s));
    b->read_prev = prev;
    b->read_next = next;
    /* The batch goes out in id order: its lowest and highest id first. */
    b->sent_gen = gen;
    b->read_number = 0;
    if (b->known_prev != 0 && b->known_prev == prev && next == prev + 1) {
        b->after_id = b->known_lo - 1;
        b->upto_id = b->known_hi;
        return send_chunk(r, gen, 0);
    }
    char p1[24], p2[24];
    snprintf(p1, sizeof(p1), "%" PRIu64, prev);
    snprintf(p2, sizeof(p2), "%" PRIu64, next);
    const char *params[2] = {p1, p2};
    return relay_pgsrc_send_prepared(b->pg, RELAY_PGSRC_BOUNDS, 2, params, 0, on_bounds, r);
}

static void on_bounds(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                      void *arg)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    (void)pg;
    (void)sqlstate;
    if (r->stopping)
        return;
    uint64_t gen = b->sent_gen;
    if (gen != b->loop.gen)
        return; /* an abandoned batch's */
    if (err != NULL || res == NULL || PQntuples(res) != 1) {
        char why[600];
        snprintf(why, sizeof(why), "reading the batch's bounds failed: %s",
                 err != NULL ? err : "no answer");
        relay_loop_failed(&b->loop, gen, RELAY_FAIL_POSTGRES, why);
        return;
    }
    if (PQgetisnull(res, 0, 0)) {
        relay_loop_chunk(&b->loop, gen, 0, 0); /* an empty batch */
        return;
    }
    b->after_id = strtoll(PQgetvalue(res, 0, 0), NULL, 10) - 1;
    b->upto_id = strtoll(PQgetvalue(res, 0, 1), NULL, 10);
    if (send_chunk(r, gen, 0) < 0)
        relay_loop_failed(&b->loop, gen, RELAY_FAIL_POSTGRES,
                          "PostgreSQL connection lost before the batch was read");
}

static void on_exec_reply(redisAsyncContext *ac, void *reply_, void *arg);

/* Sends the next call of the stream whose next row to send is rows[i]: up to
 * RELAY_CALL_ROWS rows and RELAY_CALL_BYTES of them, following row->next. */
static int send_call(struct relay *r, struct relay_chunk *c, size_t i)
{
    struct relay_loop_io *b = &r->batch;
    const struct relay_row *call[RELAY_CALL_ROWS];
    size_t n = 0, bytes = 0;
    for (int32_t k = (int32_t)i; k >= 0 && n < RELAY_CALL_ROWS;) {
        const struct relay_row *row = &c->rows[k];
        if (n > 0 && bytes + row->call_bytes > RELAY_CALL_BYTES)
            break;
        call[n++] = row;
        bytes += row->call_bytes;
        k = row->next;
    }
    size_t ends[RELAY_CALL_ROWS + 2];
    outbox_buf_reset(&r->out);
    if (relay_batch_append_xadd_call(call, n, r->cfg->stream_prefix, r->cfg->max_payload_bytes,
                                     c->ms, &r->out, ends) != 0)
        return -1;
    c->rows[i].call_rows = (uint32_t)n;
    if (relay_sink_transaction(r->sink, r->out.data, ends, n + 2, on_exec_reply, &c->rows[i]) < 0)
        return -1;
    c->pending++;
    (void)b;
    return 0;
}

static void chunk_failed(struct relay_chunk *c, enum relay_fail_kind kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void chunk_failed(struct relay_chunk *c, enum relay_fail_kind kind, const char *fmt, ...)
{
    if (c->failed)
        return;
    c->failed = 1;
    c->kind = kind;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->error, sizeof(c->error), fmt, ap);
    va_end(ap);
}

/* A chunk's calls must be answered within publish_timeout: hiredis 0.14 has
 * no command timeouts, so the deadline drops the connection, and every call
 * in flight is then answered NULL. Liveness only: what a late call appends
 * is still each row's own entry id, refused if it is there. */
static void arm_deadline(struct relay *r)
{
    ev_timer_stop(r->loop, &r->deadline);
    ev_timer_set(&r->deadline, r->cfg->publish_timeout_ms / 1000.0, 0.0);
    ev_timer_start(r->loop, &r->deadline);
}

static void on_deadline(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    char why[128];
    snprintf(why, sizeof(why), "no reply from Redis within publish_timeout (%u ms)",
             r->cfg->publish_timeout_ms);
    for (int k = 0; k < 2; k++)
        if (r->batch.chunks[k].pending > 0)
            chunk_failed(&r->batch.chunks[k], RELAY_FAIL_REDIS_TIMEOUT, "%s", why);
    relay_sink_abort(r->sink, why);
}

static void on_wait_reply(redisAsyncContext *ac, void *reply_, void *arg);

/* Every call of the chunk has been answered: published, or failed. With
 * min_replicas, each primary the chunk wrote to is then asked to WAIT for
 * its replicas, and the chunk counts as published (and its batch may be
 * recorded) only once that many acknowledged it: a failover then never takes
 * away entries whose positions are recorded. */
static void chunk_done(struct relay *r, struct relay_chunk *c)
{
    struct relay_loop_io *b = &r->batch;
    ev_timer_stop(r->loop, &r->deadline);
    if (!c->failed && r->cfg->min_replicas > 0 && !c->waited) {
        c->waited = 1;
        int n = relay_sink_wait(r->sink, r->cfg->min_replicas, r->cfg->replica_timeout_ms,
                                on_wait_reply, c);
        if (n < 0)
            chunk_failed(c, RELAY_FAIL_REDIS_CONNECTION,
                         "Redis connection lost before WAIT for min_replicas");
        else if (n > 0) {
            c->pending = (size_t)n;
            /* The server answers WAIT by replica_timeout; past that and
             * publish_timeout more, it is not answering at all. */
            ev_timer_set(&r->deadline,
                         (r->cfg->replica_timeout_ms + r->cfg->publish_timeout_ms) / 1000.0, 0.0);
            ev_timer_start(r->loop, &r->deadline);
            return;
        }
    }
    if (c->failed) {
        /* Abandoning the batch clears the chunk, and its error with it. */
        char why[sizeof(c->error)];
        memcpy(why, c->error, sizeof(why));
        relay_loop_failed(&b->loop, c->gen, c->kind, why);
    } else {
        relay_loop_published(&b->loop, c->gen, c->number);
        if (b->loop.state == RELAY_LOOP_READ)
            phase_to(b, RELAY_PHASE_READ); /* the next chunk is still on its way */
    }
}

static void on_wait_reply(redisAsyncContext *ac, void *reply_, void *arg)
{
    const redisReply *reply = reply_;
    struct relay *r = relay_sink_owner(ac);
    struct relay_chunk *c = arg;
    if (r == NULL || r->stopping || c->gen != r->batch.loop.gen || c->pending == 0)
        return; /* an abandoned chunk's */
    c->pending--;
    if (reply == NULL)
        chunk_failed(c, RELAY_FAIL_REDIS_CONNECTION, "Redis connection lost during WAIT: %s",
                     ac->errstr);
    else if (reply->type == REDIS_REPLY_ERROR)
        chunk_failed(c, RELAY_FAIL_REDIS_ERROR, "WAIT for min_replicas failed: %.*s",
                     (int)reply->len, reply->str);
    else if (reply->type != REDIS_REPLY_INTEGER)
        chunk_failed(c, RELAY_FAIL_REDIS_REPLY, "Redis answered WAIT with a reply of another type");
    else if (reply->integer < (long long)r->cfg->min_replicas)
        chunk_failed(c, RELAY_FAIL_REDIS_REPLICAS,
                     "%lld of min_replicas = %u replicas acknowledged the batch within "
                     "replica_timeout (%u ms): check the replicas with INFO replication on the "
                     "primary, or lower min_replicas",
                     reply->integer < 0 ? 0 : reply->integer, r->cfg->min_replicas,
                     r->cfg->replica_timeout_ms);
    if (c->pending == 0)
        chunk_done(r, c);
}

/* A keyed row of a partitioned topic quarantined in this batch holds its
 * key's later rows of the batch (the statement sees only the quarantine
 * recorded before it). */
static int hold_key(struct relay_loop_io *b, const struct relay_row *row)
{
    if (row->partitions <= 1 || row->key == NULL)
        return 1;
    if (b->nheld >= RELAY_QUARANTINE_MAX)
        return 0; /* never publish a key's row past one held: the batch fails */
    struct relay_held *h = &b->held[b->nheld];
    size_t len = row->key_len < sizeof(h->key) ? row->key_len : sizeof(h->key);
    if (row->topic_len > OUTBOX_TOPIC_MAX || len != row->key_len)
        return 1; /* keys are capped on insert (outbox.messages): cannot happen */
    memcpy(h->topic, row->topic, row->topic_len);
    h->topic[row->topic_len] = '\0';
    memcpy(h->key, row->key, len);
    h->key_len = len;
    h->id = row->held_by != 0 ? row->held_by : row->id;
    b->nheld++;
    return 1;
}

/* The quarantined row that holds row back, or 0. */
static int64_t row_held_by(const struct relay_loop_io *b, const struct relay_row *row)
{
    if (row->held_by != 0)
        return row->held_by;
    if (row->partitions <= 1 || row->key == NULL)
        return 0;
    for (size_t i = 0; i < b->nheld; i++) {
        const struct relay_held *h = &b->held[i];
        if (h->key_len == row->key_len && strlen(h->topic) == row->topic_len &&
            memcmp(h->key, row->key, row->key_len) == 0 &&
            memcmp(h->topic, row->topic, row->topic_len) == 0)
            return h->id;
    }
    return 0;
}

/* A row that cannot be published: recorded with the batch, and the stream
 * goes on past it (it keeps its rank). */
static void quarantine(struct relay_loop_io *b, struct relay_chunk *c, struct relay_row *row)
{
    row->state = RELAY_ROW_FAILED;
    if (b->nquarantined >= b->quarantine_max && b->nflushed > 0) {
        /* Those sent with a read are recorded (or the batch fails): room. */
        size_t keep = b->nquarantined - b->nflushed;
        memmove(b->quarantined, b->quarantined + b->nflushed, keep * sizeof(b->quarantined[0]));
        memmove(b->quarantine_errors, b->quarantine_errors + b->nflushed,
                keep * sizeof(b->quarantine_errors[0]));
        b->nquarantined = keep;
        b->nflushed = 0;
    }
    if (b->nquarantined >= b->quarantine_max || !hold_key(b, row)) {
        /* Never past a row that is neither published nor recorded: the batch
         * fails, and is read again. What the reads before recorded is skipped
         * then, so each attempt gets further. */
        chunk_failed(c, RELAY_FAIL_POSTGRES,
                     "more than %zu rows of one chunk to quarantine: the batch is read again, "
                     "past those recorded",
                     b->quarantine_max);
        return;
    }
    b->quarantined[b->nquarantined] = row->id;
    snprintf(b->quarantine_errors[b->nquarantined], OUTBOX_ERROR_MAX, "%s", row->error);
    b->nquarantined++;
    relay_error(COMPONENT,
                "row id=%lld quarantined: %s; 'outbox-relay failed list' lists the quarantined "
                "rows",
                (long long)row->id, row->error);
}

static void op_publish(void *arg, uint64_t gen, uint32_t number)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    struct relay_chunk *c = chunk_of(b, number);
    phase_to(b, RELAY_PHASE_PUBLISH);
    b->stage_at = relay_now();
    c->gen = gen;
    c->pending = 0;
    c->waited = 0;
    c->failed = 0;
    relay_sink_written_reset(r->sink);
    relay_batch_streams_clear(&b->streams);
    /* Rank each row in its stream, skip what Redis holds, and chain each
     * stream's rows to send (row->next). */
    for (size_t i = 0; i < c->nrows; i++) {
        struct relay_row *row = &c->rows[i];
        row->next = -1;
        row->call_rows = 0;
        struct relay_cursor *cur = relay_cursors_get(&b->cursors, row);
        if (cur != NULL) {
            row->seq = relay_cursor_rank(cur, b->batch_serial);
            if (!stream_active(r, cur)) {
                /* Paused, behind the lead, or another relay's: not here. */
                cur->met = 1;
                row->state = RELAY_ROW_SKIPPED;
                continue;
            }
            cur->touched = 1;
        }
        if (row->quarantined) {
            row->state = RELAY_ROW_SKIPPED; /* recorded by a reading before: keeps its rank */
            continue;
        }
        int64_t held_by = row_held_by(b, row);
        if (held_by != 0) {
            snprintf(row->error, sizeof(row->error),
                     "held behind row %lld of its key, which is quarantined: 'outbox-relay "
                     "failed retry %lld' publishes them again in order",
                     (long long)held_by, (long long)held_by);
            quarantine(b, c, row);
            continue;
        }
        if (relay_batch_check_publish(row, r->cfg->stream_prefix, r->cfg->max_payload_bytes,
                                      row->error, sizeof(row->error), &row->fault) != 0 ||
            cur == NULL) {
            if (cur == NULL && row->error[0] == '\0')
                snprintf(row->error, sizeof(row->error), "the row's topic has no stream");
            quarantine(b, c, row);
            continue;
        }
        if (relay_cursor_present(cur, c->ms, row->seq)) {
            row->state = RELAY_ROW_PUBLISHED;
            if (r->cfg->min_replicas > 0)
                relay_sink_written_all(r->sink); /* there, but maybe not replicated */
            continue;
        }
        row->state = RELAY_ROW_PUBLISHING;
        int32_t *last = relay_batch_streams_slot(&b->streams, c->rows, i);
        if (*last >= 0)
            c->rows[*last].next = (int32_t)i;
        else
            row->call_rows = UINT32_MAX; /* the stream's first row: its call goes now */
        *last = (int32_t)i;
    }
    for (size_t i = 0; i < c->nrows; i++) {
        if (c->rows[i].state != RELAY_ROW_PUBLISHING || c->rows[i].call_rows != UINT32_MAX)
            continue;
        if (send_call(r, c, i) < 0) {
            chunk_failed(c, RELAY_FAIL_REDIS_CONNECTION, "Redis connection not ready");
            break;
        }
    }
    if (c->pending == 0)
        chunk_done(r, c);
    else
        arm_deadline(r);
}

/* Array literal of n texts ({"a","b\"c"}), and its NUL, appended to out. */
static void put_text_array(struct outbox_buf *out, const char *const *items, size_t n)
{
    outbox_buf_append(out, "{", 1);
    for (size_t i = 0; i < n; i++)
        relay_pg_array_element(out, i == 0, items[i] != NULL ? items[i] : "");
    outbox_buf_append(out, "}", 2); /* with the NUL after it */
}

/* One stream's topic, partition and (with ids) last entry id, appended to
 * the three array literals being built. */
static void arrays_reset(struct record_arrays *a)
{
    outbox_buf_reset(&a->topics);
    outbox_buf_reset(&a->partitions);
    outbox_buf_reset(&a->ids);
    outbox_buf_puts(&a->topics, "{");
    outbox_buf_puts(&a->partitions, "{");
    outbox_buf_puts(&a->ids, "{");
    a->n = 0;
}

static void arrays_add(struct record_arrays *a, const struct relay_cursor *cur, int with_id)
{
    const char *sep = a->n > 0 ? "," : "";
    /* Topic names of streams are [A-Za-z0-9._-]: nothing to escape. */
    outbox_buf_printf(&a->topics, "%s\"%s\"", sep, cur->topic);
    outbox_buf_printf(&a->partitions, "%s%d", sep, cur->partitioned ? (int)cur->partition : -1);
    if (with_id) {
        char id[RELAY_ENTRY_ID_MAX];
        relay_batch_entry_id(cur->top_ms, cur->top_seq, id);
        outbox_buf_printf(&a->ids, "%s\"%s\"", sep, id);
    }
    a->n++;
}

static int arrays_end(struct record_arrays *a)
{
    outbox_buf_puts(&a->topics, "}");
    outbox_buf_puts(&a->partitions, "}");
    outbox_buf_puts(&a->ids, "}");
    return a->topics.failed || a->partitions.failed || a->ids.failed ? -1 : 0;
}

/* How often the streams that follow the lead have their position moved to
 * it though the batch had no row of theirs: what a relay taking them over, or
 * this one after a restart, reads again. */
#define REFRESH_S 2.0

/* Array literal of n ids ({1,2}), and its NUL, appended to out. */
static void put_text_array_ids(struct outbox_buf *out, const int64_t *ids, size_t n)
{
    outbox_buf_append(out, "{", 1);
    for (size_t i = 0; i < n; i++)
        outbox_buf_printf(out, "%s%lld", i > 0 ? "," : "", (long long)ids[i]);
    outbox_buf_append(out, "}", 2);
}

static int op_record(void *arg, uint64_t gen, uint64_t prev, uint64_t next, int lead)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    b->stage_at = relay_now();
    int refresh = 0;
    phase_to(b, RELAY_PHASE_RECORD);
    if (lead && relay_now() - b->refreshed_at >= REFRESH_S) {
        refresh = 1;
        b->refreshed_at = relay_now();
    }
    arrays_reset(&b->touched);
    arrays_reset(&b->advanced);
    arrays_reset(&b->met);
    outbox_buf_reset(&b->partitions_text);
    for (size_t i = 0; b->cursors.slots != NULL && i <= b->cursors.mask; i++) {
        const struct relay_cursor *cur = &b->cursors.slots[i];
        if (cur->topic[0] == '\0')
            continue;
        int in_batch = cur->active_batch == b->batch_serial;
        if (in_batch && cur->active && cur->touched && cur->tick == b->batch_serial &&
            cur->top_known) {
            arrays_add(&b->touched, cur, 1);
            if (cur->partitioned)
                outbox_buf_printf(&b->partitions_text, " %s/%u", cur->topic, cur->partition);
        } else if (in_batch && !cur->active && cur->met && lead) {
            arrays_add(&b->met, cur, 0);
        } else if ((in_batch && cur->active && !lead) ||
                   (refresh && cur->known && cur->follows && cur->owned && !cur->paused)) {
            /* Caught up by one batch, rows or not; or following the lead. */
            arrays_add(&b->advanced, cur, 0);
        }
    }
    if (arrays_end(&b->touched) < 0 || arrays_end(&b->advanced) < 0 || arrays_end(&b->met) < 0)
        return -1;
    outbox_buf_reset(&b->sql);
    size_t at[2];
    at[0] = b->sql.len;
    put_text_array_ids(&b->sql, b->quarantined + b->nflushed, b->nquarantined - b->nflushed);
    at[1] = b->sql.len;
    const char *errors[RELAY_QUARANTINE_MAX] = {0};
    for (size_t i = b->nflushed; i < b->nquarantined; i++)
        errors[i - b->nflushed] = b->quarantine_errors[i];
    put_text_array(&b->sql, errors, b->nquarantined - b->nflushed);
    if (b->sql.failed)
        return -1;
    char tick[24];
    snprintf(tick, sizeof(tick), "%" PRIu64, next);
    (void)prev;
    const char *params[11] = {tick,
                              lead ? "true" : "false",
                              b->touched.topics.data,
                              b->touched.partitions.data,
                              b->touched.ids.data,
                              b->advanced.topics.data,
                              b->advanced.partitions.data,
                              b->met.topics.data,
                              b->met.partitions.data,
                              b->sql.data + at[0],
                              b->sql.data + at[1]};
    b->sent_gen = gen;
    /* The record commits without waiting for its WAL to reach the disk
     * (synchronous_commit off for this one transaction): a record lost in a
     * crash of PostgreSQL leaves its streams' positions where they were, and
     * the relay reads the batch again, whose entries Redis refuses as copies
     * (their ids are the batch's), as after a crash of the relay between
     * publishing and recording. The tick a batch is read from is durable
     * before anything of it is published; its commit, and every later one,
     * also flushes the records before it. This saves a batch one flush of
     * the WAL, the longest wait of its cycle under load. */
    return relay_pgsrc_send(b->pg,
                            "SELECT outbox.record_batch($1::bigint, $2::boolean, $3::text[], "
                            "$4::integer[], $5::text[], $6::text[], $7::integer[], $8::text[], "
                            "$9::integer[], $10::bigint[], $11::text[]),"
                            " pg_catalog.set_config('synchronous_commit', 'off', true)",
                            11, params, 0, on_recorded, r);
}

static void op_abandon(void *arg)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    ev_timer_stop(r->loop, &r->deadline);
    chunk_clear(&b->chunks[0]);
    chunk_clear(&b->chunks[1]);
    b->nquarantined = 0;
    b->nflushed = 0;
    b->nheld = 0;
    b->batch_appended = 0;
    /* The batch is read again from its start: its ranks count again. */
    relay_cursors_restart(&b->cursors, b->batch_serial);
}

static void op_failed(void *arg, enum relay_fail_kind kind, const char *why)
{
    struct relay *r = arg;
    r->fig.errors[kind]++;
    if (strcmp(why, r->fig.last_batch_error) != 0) {
        relay_warn(COMPONENT, "batch not published: %s; it is read again after a backoff", why);
        snprintf(r->fig.last_batch_error, sizeof(r->fig.last_batch_error), "%s", why);
    } else {
        relay_debug(COMPONENT, "batch not published: %s", why);
    }
    if (r->batch.slots_moved) {
        r->batch.slots_moved = 0;
        relay_sink_abort(r->sink, "a slot of the cluster moved to another primary (MOVED): "
                                  "reading the slot map again");
    } else if (r->batch.not_primary) {
        r->batch.not_primary = 0;
        relay_sink_abort(r->sink, "the server answered READONLY: it is a replica now (a "
                                  "failover); reconnecting, through the Sentinels when set");
    }
}

static void op_arm_retry(void *arg, uint32_t ms)
{
    struct relay *r = arg;
    ev_timer_stop(r->loop, &r->retry_timer);
    ev_timer_set(&r->retry_timer, ms / 1000.0, 0.0);
    ev_timer_start(r->loop, &r->retry_timer);
}

static void op_idle(void *arg)
{
    struct relay *r = arg;
    relay_wake_empty(&r->wake);
}

/* A drain (SIGTERM) has nothing left in flight: the loop is left, and
 * relay_run stops every part in order. */
static void op_drained(void *arg)
{
    struct relay *r = arg;
    if (!r->batch.loop.draining)
        return;
    relay_info("relay", "nothing left in flight; shutting down");
    ev_break(r->loop, EVBREAK_ALL);
}

/* ---- answers into events ---------------------------------------------- */

static void on_ticked(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                      void *arg)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    (void)pg;
    (void)sqlstate;
    if (r->stopping)
        return;
    if (err != NULL || res == NULL || PQntuples(res) != 1 || PQgetisnull(res, 0, 0)) {
        char why[600];
        snprintf(why, sizeof(why), "taking a tick (outbox.tick_bounds) failed: %s",
                 err != NULL ? err : "no answer");
        relay_loop_failed(&b->loop, b->sent_gen, RELAY_FAIL_POSTGRES, why);
        return;
    }
    uint64_t tick = strtoull(PQgetvalue(res, 0, 0), NULL, 10);
    keep_bounds(b, res, tick);
    relay_loop_ticked(&b->loop, b->sent_gen, tick);
}

/* One row of a chunk, as the claim's columns (relay_pgsrc_batch_sql). */
OUTBOX_STATIC int parse_row(PGresult *res, int i, struct relay_row *row);
OUTBOX_STATIC int parse_row(PGresult *res, int i, struct relay_row *row)
{
    if (PQgetlength(res, i, 0) != 8)
        return -1;
    memset(row, 0, offsetof(struct relay_row, error));
    row->error[0] = '\0';
    row->id = relay_batch_decode_int8(PQgetvalue(res, i, 0));
    if (PQgetlength(res, i, 1) != 16 || PQgetlength(res, i, 5) != 8)
        return -1;
    relay_batch_format_uuid((const unsigned char *)PQgetvalue(res, i, 1), row->message_id_text);
    row->message_id = row->message_id_text;
    row->message_id_len = RELAY_UUID_LEN;
    row->topic = PQgetvalue(res, i, 2);
    row->topic_len = (size_t)PQgetlength(res, i, 2);
    if (!PQgetisnull(res, i, 3)) {
        row->key = PQgetvalue(res, i, 3);
        row->key_len = (size_t)PQgetlength(res, i, 3);
    }
    if (PQgetisnull(res, i, 4)) {
        /* Over max_payload_bytes: left in the database, only its size came. */
        if (PQgetlength(res, i, 9) != 4)
            return -1;
        row->payload_len = (size_t)(uint32_t)relay_batch_decode_int4(PQgetvalue(res, i, 9));
    } else {
        row->payload = PQgetvalue(res, i, 4);
        row->payload_len = (size_t)PQgetlength(res, i, 4);
    }
    row->created_at_len = relay_batch_format_timestamp(
        relay_batch_decode_int8(PQgetvalue(res, i, 5)), row->created_at_text);
    row->created_at = row->created_at_text;
    if (!PQgetisnull(res, i, 6))
        row->headers_type = PQgetvalue(res, i, 6);
    if (!PQgetisnull(res, i, 7)) {
        row->header_names = PQgetvalue(res, i, 7);
        row->header_names_len = (size_t)PQgetlength(res, i, 7);
    }
    if (!PQgetisnull(res, i, 8)) {
        row->header_values = PQgetvalue(res, i, 8);
        row->header_values_len = (size_t)PQgetlength(res, i, 8);
    }
    if (PQgetlength(res, i, 10) != 4)
        return -1;
    int32_t partitions = relay_batch_decode_int4(PQgetvalue(res, i, 10));
    row->partitions = partitions < 1 ? 1 : (uint32_t)partitions;
    row->partition = outbox_partition_of(row->key, row->key_len, row->id, row->partitions);
    row->state = RELAY_ROW_CLAIMED;
    return 0;
}

static uint64_t decode_u64(const char *p)
{
    return (uint64_t)relay_batch_decode_int8(p);
}

static void on_read(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                    void *arg)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    (void)sqlstate;
    if (r->stopping)
        return;
    uint64_t gen = b->sent_gen;
    if (gen != b->loop.gen)
        return; /* an abandoned batch's chunk */
    if (err != NULL || res == NULL) {
        char why[600];
        snprintf(why, sizeof(why), "reading the batch failed: %s", err != NULL ? err : "no answer");
        relay_loop_failed(&b->loop, gen, RELAY_FAIL_POSTGRES, why);
        return;
    }
    struct relay_chunk *c = chunk_of(b, b->read_number);
    chunk_clear(c);
    c->res = relay_pgsrc_take_result(pg);
    c->number = b->read_number;
    c->gen = gen;
    int n = PQntuples(c->res);
    for (int i = 0; i < n && (size_t)i < r->cfg->batch_size; i++) {
        if (PQgetlength(c->res, i, COL_TXID) != 8 || PQgetlength(c->res, i, COL_MS) != 8 ||
            parse_row(c->res, i, &c->rows[c->nrows]) < 0) {
            relay_loop_failed(&b->loop, gen, RELAY_FAIL_POSTGRES,
                              "the batch statement returned a malformed row");
            return;
        }
        c->ms = decode_u64(PQgetvalue(c->res, i, COL_MS));
        if (!PQgetisnull(c->res, i, COL_HELD_BY)) {
            if (PQgetlength(c->res, i, COL_HELD_BY) != 8) {
                relay_loop_failed(&b->loop, gen, RELAY_FAIL_POSTGRES,
                                  "the batch statement returned a malformed row");
                return;
            }
            c->rows[c->nrows].held_by = relay_batch_decode_int8(PQgetvalue(c->res, i, COL_HELD_BY));
        }
        c->rows[c->nrows].quarantined = PQgetlength(c->res, i, COL_QUARANTINED) == 1 &&
                                        PQgetvalue(c->res, i, COL_QUARANTINED)[0] != 0;
        b->after_id = c->rows[c->nrows].id;
        c->nrows++;
    }
    b->batch_read += c->nrows;
    relay_loop_chunk(&b->loop, gen, c->number, c->nrows);
}

/* Published messages per topic, for outbox_relay_messages_published_total,
 * and the stream for the observer's list of streams. */
static void count_published(struct relay *r, const struct relay_row *row)
{
    struct relay_figures *f = &r->fig;
    f->published_total++;
    r->batch.batch_appended++;
    relay_stream_seen_note(&r->streams_seen, r->cfg->stream_prefix, row);
    for (size_t j = 0; j < f->ntopics; j++) {
        if (strlen(f->topics[j].topic) == row->topic_len &&
            memcmp(f->topics[j].topic, row->topic, row->topic_len) == 0) {
            f->topics[j].published++;
            return;
        }
    }
    if (f->ntopics < RELAY_OBS_TOPICS_MAX && row->topic_len <= OUTBOX_TOPIC_MAX) {
        memcpy(f->topics[f->ntopics].topic, row->topic, row->topic_len);
        f->topics[f->ntopics].topic[row->topic_len] = '\0';
        f->topics[f->ntopics++].published = 1;
    } else {
        f->other_published++;
    }
}

/* A row's part of an EXEC reply: appended, there already, or an error. */
static void apply_one(struct relay *r, struct relay_chunk *c, struct relay_row *row,
                      const redisReply *one)
{
    struct relay_loop_io *b = &r->batch;
    struct relay_cursor *cur = relay_cursors_get(&b->cursors, row);
    if (one != NULL && (one->type == REDIS_REPLY_STRING || one->type == REDIS_REPLY_STATUS)) {
        row->state = RELAY_ROW_PUBLISHED;
        if (cur != NULL)
            relay_cursor_appended(cur, c->ms, row->seq);
        count_published(r, row);
        return;
    }
    if (one != NULL && one->type == REDIS_REPLY_ERROR &&
        relay_batch_xadd_present(one->str, one->len)) {
        row->state = RELAY_ROW_PUBLISHED; /* in the stream already */
        if (cur != NULL)
            relay_cursor_appended(cur, c->ms, row->seq);
        return;
    }
    if (one != NULL && one->type == REDIS_REPLY_ERROR && one->len >= 9 &&
        memcmp(one->str, "WRONGTYPE", 9) == 0) {
        char key[STREAM_KEY_MAX];
        if (cur == NULL || stream_key(r, cur, key) < 0)
            snprintf(key, sizeof(key), "of topic %.64s", cur != NULL ? cur->topic : "?");
        snprintf(row->error, sizeof(row->error),
                 "the stream key %.300s holds another type (WRONGTYPE): rename or delete that key, "
                 "then 'outbox-relay failed retry %lld'",
                 key, (long long)row->id);
        quarantine(b, c, row);
        return;
    }
    chunk_failed(c, RELAY_FAIL_REDIS_ERROR, "Redis refused a row: %.*s",
                 one != NULL && one->type == REDIS_REPLY_ERROR ? (int)one->len : 0,
                 one != NULL && one->type == REDIS_REPLY_ERROR ? one->str : "");
}

static void on_exec_reply(redisAsyncContext *ac, void *reply_, void *arg)
{
    const redisReply *reply = reply_;
    struct relay *r = relay_sink_owner(ac);
    if (r == NULL || r->stopping)
        return;
    struct relay_loop_io *b = &r->batch;
    struct relay_row *head = arg;
    struct relay_chunk *c = NULL;
    for (int k = 0; k < 2; k++)
        if (head >= b->chunks[k].rows && head < b->chunks[k].rows + b->chunks[k].nrows)
            c = &b->chunks[k];
    if (c == NULL || c->gen != b->loop.gen || c->pending == 0)
        return; /* an abandoned chunk's */
    c->pending--;
    size_t n = head->call_rows;
    if (reply == NULL) {
        chunk_failed(c, RELAY_FAIL_REDIS_CONNECTION, "Redis connection lost: %s", ac->errstr);
    } else if (reply->type == REDIS_REPLY_ERROR) {
        if (reply->len >= 5 && memcmp(reply->str, "MOVED", 5) == 0)
            b->slots_moved = 1;
        else if (reply->len >= 8 && memcmp(reply->str, "READONLY", 8) == 0)
            b->not_primary = 1;
        chunk_failed(c, RELAY_FAIL_REDIS_ERROR, "Redis refused the publish: %.*s", (int)reply->len,
                     reply->str);
    } else if (reply->type != REDIS_REPLY_ARRAY || reply->elements != n) {
        chunk_failed(c, RELAY_FAIL_REDIS_REPLY, "Redis answered a publish of %zu rows with %s", n,
                     reply->type == REDIS_REPLY_ARRAY ? "an array of another length"
                                                      : "a reply of another type");
    } else {
        struct relay_row *row = head;
        for (size_t k = 0; k < n && row != NULL; k++) {
            apply_one(r, c, row, reply->element[k]);
            row = row->next >= 0 ? &c->rows[row->next] : NULL;
        }
        /* The stream's next call, now that this one is in. */
        if (!c->failed && row != NULL) {
            if (send_call(r, c, (size_t)(row - c->rows)) < 0)
                chunk_failed(c, RELAY_FAIL_REDIS_CONNECTION, "Redis connection not ready");
        }
    }
    if (c->pending == 0)
        chunk_done(r, c);
}

static void on_recorded(struct relay_pgsrc *pg, PGresult *res, const char *err,
                        const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    struct relay_loop_io *b = &r->batch;
    (void)pg;
    (void)sqlstate;
    if (r->stopping)
        return;
    if (err != NULL) {
        char why[600];
        snprintf(why, sizeof(why), "recording the batch failed: %s", err);
        relay_loop_failed(&b->loop, b->sent_gen, RELAY_FAIL_POSTGRES, why);
        return;
    }
    r->fig.batches_total++;
    phase_to(b, RELAY_PHASE_RECORD);
    for (int p = 0; p < RELAY_PHASES; p++)
        observe_seconds(r->fig.phase_hist[p], &r->fig.phase_sum[p], b->phase_s[p]);
    observe_seconds(r->fig.batch_hist, &r->fig.batch_sum, relay_now() - b->started_at);
    if (res != NULL && PQntuples(res) == 1 && !PQgetisnull(res, 0, 0))
        r->fig.quarantined_total += strtoull(PQgetvalue(res, 0, 0), NULL, 10);
    b->nquarantined = 0;
    b->nflushed = 0;
    b->nheld = 0;
    relay_debug(COMPONENT,
                "recorded the batch of tick %" PRIu64 "%s: %llu rows read, %llu appended",
                b->loop.next, b->loop.catching_up ? " for streams behind the lead" : "",
                b->batch_read, b->batch_appended);
    if (b->partitions_text.len > 0 && !b->partitions_text.failed)
        relay_debug(COMPONENT, "published a batch of %llu rows to partitions%s", b->batch_appended,
                    b->partitions_text.data);
    b->batch_read = 0;
    b->batch_appended = 0;
    if (b->loop.catching_up)
        relay_cursors_advance(&b->cursors, b->loop.prev, b->loop.lead);
    relay_cursors_untouch(&b->cursors);
    relay_cursors_trim(&b->cursors, b->batch_serial);
    /* A batch went out: the relay is busy, and holds the wake-up lock so
     * that producers need not notify (relay/wake.c). */
    relay_wake_busy(&r->wake);
    if (r->fig.last_batch_error[0] != '\0') {
        relay_info(COMPONENT, "publishing again after: %s", r->fig.last_batch_error);
        r->fig.last_batch_error[0] = '\0';
    }
    relay_loop_recorded(&b->loop, b->sent_gen);
}

/* ---- connections -------------------------------------------------------- */

const double relay_batch_buckets[RELAY_BATCH_BUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};

static void on_kick(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    relay_loop_want(&((struct relay *)w->data)->batch.loop);
}

static void on_retry(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    relay_loop_retry(&((struct relay *)w->data)->batch.loop);
}

static void pg_ready(struct relay_pgsrc *pg, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    relay_wake_busy(&r->wake);
    relay_loop_want(&r->batch.loop);
}

static void pg_down(struct relay_pgsrc *pg, void *arg)
{
    (void)pg;
    (void)arg; /* the command in flight, if any, fails with the connection */
}

static void sink_ready(struct relay_sink *s, void *arg)
{
    struct relay *r = arg;
    (void)s;
    /* Redis may hold less than before it went away: what each stream holds
     * is read again before the next batch. */
    relay_cursors_forget_all(&r->batch.cursors);
    r->batch.verify = 1;
    relay_loop_want(&r->batch.loop);
}

int relay_loop_io_start(struct relay *r)
{
    const struct relay_loop_ops ops = {
        .arg = r,
        .ready = op_ready,
        .prepare = op_prepare,
        .load = op_load,
        .behind = op_behind,
        .tick = op_tick,
        .read = op_read,
        .publish = op_publish,
        .record = op_record,
        .abandon = op_abandon,
        .failed = op_failed,
        .arm_retry = op_arm_retry,
        .idle = op_idle,
        .drained = op_drained,
    };
    const struct relay_config *cfg = r->cfg;
    struct relay_loop_io *b = &r->batch;
    relay_loop_init(&b->loop, &ops, cfg->batch_size, cfg->reconnect_min_ms, cfg->reconnect_max_ms);
    relay_cursors_init(&b->cursors);
    ev_init(&r->retry_timer, on_retry);
    r->retry_timer.data = r;
    ev_init(&r->kick, on_kick);
    r->kick.data = r;
    ev_init(&r->deadline, on_deadline);
    r->deadline.data = r;
    for (int k = 0; k < 2; k++) {
        b->chunks[k].rows = calloc(cfg->batch_size, sizeof(*b->chunks[k].rows));
        if (b->chunks[k].rows == NULL)
            return -1;
    }
    b->quarantine_max = 2 * (size_t)cfg->batch_size;
    if (b->quarantine_max > RELAY_QUARANTINE_MAX)
        b->quarantine_max = RELAY_QUARANTINE_MAX;
    if (relay_batch_streams_init(&b->streams, cfg->batch_size) != 0)
        return -1;
    struct relay_pgsrc_hooks hooks = {.arg = r, .on_ready = pg_ready, .on_down = pg_down};
    b->pg = relay_pgsrc_new(r->loop, cfg, RELAY_PGSRC_CLAIM, &hooks);
    if (b->pg == NULL)
        return -1;
    struct relay_sink_hooks sink_hooks = {.arg = r, .on_ready = sink_ready};
    r->sink = relay_sink_new(r->loop, cfg, &sink_hooks);
    return r->sink != NULL ? 0 : -1;
}

void relay_loop_io_stop(struct relay *r)
{
    struct relay_loop_io *b = &r->batch;
    relay_loop_stop(&b->loop);
    if (r->loop != NULL)
        ev_timer_stop(r->loop, &r->retry_timer);
    if (r->loop != NULL) {
        ev_timer_stop(r->loop, &r->kick);
        ev_timer_stop(r->loop, &r->deadline);
    }
    relay_sink_free(r->sink);
    r->sink = NULL;
    relay_pgsrc_free(b->pg);
    b->pg = NULL;
    for (int k = 0; k < 2; k++) {
        chunk_clear(&b->chunks[k]);
        free(b->chunks[k].rows);
        b->chunks[k].rows = NULL;
    }
    relay_batch_streams_free(&b->streams);
    relay_cursors_free(&b->cursors);
    outbox_buf_free(&b->sql);
    outbox_buf_free(&b->partitions_text);
    struct record_arrays *arrays[3] = {&b->touched, &b->advanced, &b->met};
    for (int k = 0; k < 3; k++) {
        outbox_buf_free(&arrays[k]->topics);
        outbox_buf_free(&arrays[k]->partitions);
        outbox_buf_free(&arrays[k]->ids);
    }
    outbox_buf_free(&r->out);
}
