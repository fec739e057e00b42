/*
 * The claim cycle on real connections: the ops of relay/cycle.c's machine
 * for the claiming PostgreSQL connections and the Redis sink, and the
 * callbacks that turn their answers into the machine's events.
 *
 * A batch is one PostgreSQL transaction:
 *   BEGIN; claim up to batch_size pending rows in id order FOR UPDATE SKIP LOCKED
 *   -> publish every row through the Redis function, pipelined, under one deadline
 *   -> when every reply is in: mark the published rows sent, record the failures
 *      of rows that failed for reasons of their own, COMMIT.
 * Any failure of the whole batch rolls the transaction back and retries after
 * a jittered backoff: a row is marked sent only in the transaction that
 * claimed it, and that transaction commits only after Redis acknowledged it,
 * so a committed row is published at least once whatever crashes where (P1).
 * A republish after an unknown commit outcome is absorbed by the function's
 * dedup record (P2). docs/DESIGN.md, "The claim cycle", has the states.
 */
#include "common/compat.h"

#include <ev.h>
#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"
#include "relay/daemon.h"
#include "common/keys.h"
#include "relay/log.h"
#include "relay/ownership_io.h"
#include "relay/pgsrc.h"
#include "relay/retire.h"
#include "relay/sink.h"

#define COMPONENT "relay"

const double relay_batch_buckets[RELAY_BATCH_BUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};

static void on_begun(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                     void *arg);
static void on_claimed(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                       void *arg);
static void on_finished(struct relay_pgsrc *pg, PGresult *res, const char *err,
                        const char *sqlstate, void *arg);
static void on_rolled_back(struct relay_pgsrc *pg, PGresult *res, const char *err,
                           const char *sqlstate, void *arg);

/* ---- the machine's ops ------------------------------------------------ */

static double op_now(void *arg)
{
    (void)arg;
    return relay_now();
}

static int op_lane_ready(void *arg, size_t lane)
{
    const struct relay *r = arg;
    return relay_pgsrc_state(r->lanes[lane].pg) == RELAY_PG_READY;
}

static int op_sink_ready(void *arg)
{
    const struct relay *r = arg;
    return relay_sink_ready(r->sink);
}

static int op_begin(void *arg, size_t lane)
{
    struct relay *r = arg;
    struct relay_lane *l = &r->lanes[lane];
    memset(l->phase_at, 0, sizeof(l->phase_at));
    l->phase_at[RELAY_PHASE_CLAIM] = r->cycle.lanes[lane].claimed_at;
    return relay_pgsrc_send(l->pg, relay_ownership_io_begin_sql(r->owner), 0, NULL, 0, on_begun, l);
}

static int op_claim(void *arg, size_t lane, char *why, size_t whylen)
{
    struct relay *r = arg;
    struct relay_lane *l = &r->lanes[lane];
    char limit[16];
    (void)why;
    (void)whylen;
    char after[24];
    snprintf(limit, sizeof(limit), "%u", r->cfg->batch_size);
    const char *params[6] = {limit, r->paused.param, NULL, NULL, NULL, after};
    relay_ownership_io_claim_params(r->owner, &params[2], &params[3], &params[4]);
    /* With a topic paused, the claim that walks the pending topics' index
     * instead of the paused backlog (relay/pgsrc.c). */
    if (r->paused.n > 0)
        return relay_pgsrc_send_prepared(l->pg, "claim_paused", 5, params, 1, on_claimed, l);
    struct relay_claim_lane others[RELAY_CYCLE_LANES_MAX];
    size_t n = 0;
    for (size_t i = 0; i < r->nlanes; i++) {
        if (i == lane)
            continue;
        enum relay_lane_state st = r->cycle.lanes[i].state;
        const struct relay_lane *o = &r->lanes[i];
        others[n].in_flight =
            st == RELAY_LANE_CLAIMED || st == RELAY_LANE_PUBLISH || st == RELAY_LANE_FINISH;
        others[n].nrows = o->nrows;
        others[n].last_id = o->nrows > 0 ? o->rows[o->nrows - 1].id : 0;
        n++;
    }
    int64_t floor = relay_batch_claim_floor(others, n, r->cfg->batch_size,
                                            relay_ownership_io_claimable(r->owner) > 0,
                                            &r->claims_bounded_in_row);
    snprintf(after, sizeof(after), "%lld", (long long)floor);
    return relay_pgsrc_send_prepared(l->pg, "claim", 6, params, 1, on_claimed, l);
}

static void on_publish_reply(redisAsyncContext *ac, void *reply_, void *arg);
static void publish_done(struct relay_lane *l);

static int has_partitioned_rows(const struct relay_lane *l)
{
    for (size_t i = 0; i < l->nrows; i++)
        if (l->rows[i].partitions > 1)
            return 1;
    return 0;
}

/* The published batch left rows behind the batch ahead (relay_cycle_ops). */
static int op_left_rows(void *arg, size_t lane)
{
    const struct relay *r = arg;
    return r->lanes[lane].tally.left > 0;
}

/* A claimed batch publishes behind the one still publishing, without waiting
 * for its replies, when neither holds a row of a partitioned topic: a row of
 * a key that failed there must hold back every later row of its key, also
 * those a batch behind chains to an earlier row of the stream (relay/cycle.c,
 * docs/DESIGN.md, "The claim cycle"). Not with min_replicas: the WAIT behind
 * each batch holds the connection until replicas acknowledge it, so a batch
 * sent behind it would only wait there; each batch is acknowledged by
 * replicas on its own before the next one's publishes reach Redis. */
static int op_overlap(void *arg, size_t ahead, size_t lane)
{
    const struct relay *r = arg;
    const struct relay_lane *a = &r->lanes[ahead];
    return r->cfg->min_replicas == 0 && !a->tally.failed &&
           relay_ownership_io_claimable(r->owner) == 0 && !has_partitioned_rows(a) &&
           !has_partitioned_rows(&r->lanes[lane]);
}

/* A row of a partitioned topic with a key: one whose failure holds back the
 * later rows of its key (docs/PARTITIONS.md). */
static int keeps_key_order(const struct relay_row *row)
{
    return row->partitions > 1 && row->key != NULL;
}

/* Whether an earlier row of the batch, of the same topic and key, failed or
 * was held back itself: then this row waits for it (it stays claimed, so it
 * is neither published nor marked, and the next claims skip it while the
 * failed row is quarantined or waits to retry). */
static int held_back(const struct relay_row *rows, size_t i)
{
    const struct relay_row *row = &rows[i];
    for (size_t j = 0; j < i; j++) {
        const struct relay_row *e = &rows[j];
        if ((e->state == RELAY_ROW_FAILED || e->state == RELAY_ROW_CLAIMED) && keeps_key_order(e) &&
            e->topic_len == row->topic_len && e->key_len == row->key_len &&
            memcmp(e->topic, row->topic, row->topic_len) == 0 &&
            memcmp(e->key, row->key, row->key_len) == 0)
            return 1;
    }
    return 0;
}

static int op_holds_keys(void *arg, size_t lane)
{
    const struct relay *r = arg;
    const struct relay_lane *l = &r->lanes[lane];
    for (size_t i = 0; i < l->nrows; i++)
        if (l->rows[i].state != RELAY_ROW_PUBLISHED && keeps_key_order(&l->rows[i]))
            return 1;
    return 0;
}

static void on_wait_reply(redisAsyncContext *ac, void *reply_, void *arg);

/*
 * With min_replicas, the batch's publishes are followed by a WAIT on each
 * connection they went to (each primary of a cluster that got a part): its
 * answer comes after theirs and counts the replicas that hold all of them.
 * The batch is marked sent only when enough do on every one; otherwise it is
 * rolled back and published again (docs/DESIGN.md, "Replica acknowledgement").
 */
static void send_wait(struct relay *r, struct relay_lane *l)
{
    int sent = relay_sink_wait(r->sink, r->cfg->min_replicas, r->cfg->replica_timeout_ms,
                               on_wait_reply, l);
    if (sent < 0) {
        l->tally.failed = 1;
        l->tally.kind = RELAY_FAIL_REDIS_CONNECTION;
        snprintf(l->tally.error, sizeof(l->tally.error), "Redis connection not ready");
        return;
    }
    l->tally.pending += (size_t)sent;
}

/* The publish deadline of the oldest batch publishing: a batch that follows
 * it was claimed later, so its own deadline is armed once that one ends. */
static void arm_deadline(struct relay *r)
{
    ev_timer_stop(r->loop, &r->deadline);
    if (r->stopping || r->cycle.publishing < 0)
        return;
    double since = r->cycle.lanes[r->cycle.publishing].claimed_at;
    double left = since + r->cfg->publish_timeout_ms / 1000.0 - relay_now();
    ev_timer_set(&r->deadline, left > 0.001 ? left : 0.001, 0.0);
    ev_timer_start(r->loop, &r->deadline);
}

/* Sends one call of rows of a stream, after the row sent before call[0]:
 * 0, or -1 with the batch failed. */
static int send_call(struct relay *r, struct relay_lane *l, struct relay_row **call, size_t n,
                     const struct relay_row *after, uint64_t not_after)
{
    outbox_buf_reset(&r->out);
    if (relay_batch_append_publish_call((const struct relay_row *const *)call, n, after,
                                        r->cfg->stream_prefix, r->cfg->max_payload_bytes,
                                        r->cfg->dedup_ttl_ms, not_after, &r->out) != 0) {
        /* Rows checked by op_publish always fit a call. */
        l->tally.failed = 1;
        l->tally.kind = RELAY_FAIL_REDIS_REPLY;
        snprintf(l->tally.error, sizeof(l->tally.error),
                 "cannot build the publish call of %zu rows", n);
        return -1;
    }
    if (relay_sink_formatted(r->sink, r->out.data, r->out.len, on_publish_reply, call[0]) < 0) {
        l->tally.failed = 1;
        l->tally.kind = RELAY_FAIL_REDIS_CONNECTION;
        snprintf(l->tally.error, sizeof(l->tally.error), "Redis connection not ready");
        return -1;
    }
    call[0]->call_rows = (uint32_t)n;
    l->tally.pending += n;
    return 0;
}

/* Sends the rows of head's stream in the batch, head first, in calls of up
 * to RELAY_CALL_ROWS rows and RELAY_CALL_BYTES. Once the batch has failed,
 * the rows left stay claimed, as it rolls back. */
static void send_stream(struct relay *r, struct relay_lane *l, struct relay_row *head,
                        uint64_t not_after)
{
    /* The batch ahead's row is named by the call, and read no more. */
    const struct relay_row *after = head->after;
    if (head->after_ahead)
        head->after = NULL;
    for (struct relay_row *row = head; row != NULL;) {
        struct relay_row *call[RELAY_CALL_ROWS];
        size_t n = 0, bytes = 0;
        while (row != NULL && n < RELAY_CALL_ROWS &&
               (n == 0 || bytes + row->call_bytes <= RELAY_CALL_BYTES)) {
            call[n++] = row;
            bytes += row->call_bytes;
            row = row->next >= 0 ? &l->rows[row->next] : NULL;
        }
        if (l->tally.failed || send_call(r, l, call, n, after, not_after) != 0) {
            for (size_t k = 0; k < n; k++)
                call[k]->state = RELAY_ROW_CLAIMED;
            continue;
        }
        after = call[n - 1];
    }
}

/* Sends every row of the lane's batch to Redis under one deadline. */
static void op_publish(void *arg, size_t lane)
{
    struct relay *r = arg;
    struct relay_lane *l = &r->lanes[lane];
    memset(&l->tally, 0, sizeof(l->tally));
    l->phase_at[RELAY_PHASE_PUBLISH] = relay_now();
    /* The deadline counts from the claim's BEGIN, not from now: the claim
     * transaction may have ended meanwhile (its connection cut, or the
     * server's idle limit while this process was frozen) and another relay
     * taken the rows over; a publish sent now must not outlive the dedup
     * records that relay retires (docs/DESIGN.md, "The publish deadline"). */
    double since = r->cycle.lanes[lane].claimed_at;
    uint64_t not_after = relay_sink_deadline_ms(r->sink, since, r->cfg->publish_timeout_ms);
    /* Measure Redis's clock again ahead of this batch's publishes, for the
     * next batch's deadline: a clock step on either host costs at most one
     * batch (docs/DESIGN.md, "The publish deadline"). */
    relay_sink_sync_clock(r->sink);
    relay_sink_written_reset(r->sink);
    relay_batch_streams_clear(&l->streams);
    /* A batch that follows the one still publishing (relay_cycle_ops.overlap)
     * chains each stream's first row to that batch's last row of the stream. */
    int ahead = r->cycle.publishing != (int)lane ? r->cycle.publishing : -1;
    const struct relay_lane *a = ahead >= 0 ? &r->lanes[ahead] : NULL;
    int failed_in_order = 0;
    /* First each row is checked and chained to the row before it in its
     * stream; then each stream's rows go out in calls of several rows. */
    for (size_t i = 0; i < l->nrows; i++) {
        struct relay_row *row = &l->rows[i];
        row->after = NULL;
        row->after_ahead = 0;
        row->next = -1;
        row->call_rows = 0;
        if (failed_in_order && keeps_key_order(row) && held_back(l->rows, i)) {
            l->tally.held++;
            continue;
        }
        if (relay_batch_check_publish(row, r->cfg->stream_prefix, r->cfg->max_payload_bytes,
                                      row->error, sizeof(row->error), &row->fault) != 0) {
            row->state = RELAY_ROW_FAILED;
            failed_in_order |= keeps_key_order(row);
            continue;
        }
        /* Chained to the row sent before it to its stream (relay_row.after). */
        int32_t *last = relay_batch_streams_slot(&l->streams, l->rows, i);
        int32_t before;
        if (*last >= 0) {
            row->after = &l->rows[*last];
            l->rows[*last].next = (int32_t)i;
        } else if (a != NULL &&
                   (before = relay_batch_streams_find(&a->streams, a->rows, row)) >= 0) {
            /* The batch ahead may end before this row's reply comes in: the
             * reply is read without it (relay_batch_apply_reply), once the
             * call has named it. */
            row->after = &a->rows[before];
            row->after_ahead = 1;
        }
        row->state = RELAY_ROW_PUBLISHING;
        *last = (int32_t)i;
    }
    for (size_t i = 0; i < l->nrows; i++) {
        struct relay_row *head = &l->rows[i];
        if (head->state == RELAY_ROW_PUBLISHING && (head->after == NULL || head->after_ahead))
            send_stream(r, l, head, not_after);
    }
    if (l->tally.pending == 0) {
        publish_done(l);
        return;
    }
    if (!l->tally.failed && r->cfg->min_replicas > 0)
        send_wait(r, l);
    arm_deadline(r);
}

static char *quote_literal(void *ctx, const char *s, size_t len)
{
    return relay_pgsrc_escape_literal(ctx, s, len);
}

static int op_finish(void *arg, size_t lane, char *why, size_t whylen)
{
    struct relay *r = arg;
    struct relay_lane *l = &r->lanes[lane];
    struct relay_sql_quoter q = {quote_literal, relay_pgsrc_freemem, l->pg};
    if (relay_batch_finish_sql(l->rows, l->nrows, r->cfg->max_attempts,
                               r->cfg->sent_retention_ms == 0, &q, &l->sql) < 0) {
        snprintf(why, whylen, "cannot build the statement that marks the batch sent");
        return -1;
    }
    return relay_pgsrc_send(l->pg, l->sql.data, 0, NULL, 0, on_finished, l);
}

static int op_rollback(void *arg, size_t lane, int empty)
{
    struct relay *r = arg;
    struct relay_lane *l = &r->lanes[lane];
    if (r->stopping || relay_pgsrc_state(l->pg) != RELAY_PG_READY)
        return -1;
    return relay_pgsrc_send(l->pg, empty ? "COMMIT" : "ROLLBACK", 0, NULL, 0, on_rolled_back, l);
}

static void op_release(void *arg, size_t lane)
{
    struct relay *r = arg;
    struct relay_lane *l = &r->lanes[lane];
    if (l->claim_res != NULL) {
        PQclear(l->claim_res);
        l->claim_res = NULL;
    }
    l->nrows = 0;
    memset(&l->tally, 0, sizeof(l->tally));
}

/* A failure of the whole batch: nobody is blamed; logged once per reason. */
static void op_failed(void *arg, size_t lane, enum relay_fail_kind kind, const char *why)
{
    struct relay *r = arg;
    struct relay_lane *l = &r->lanes[lane];
    r->fig.errors[kind]++;
    if (strcmp(why, r->fig.last_batch_error) != 0) {
        relay_warn(COMPONENT,
                   "batch of %zu rows not published: %s; rolled back, will retry with backoff",
                   l->nrows, why);
        snprintf(r->fig.last_batch_error, sizeof(r->fig.last_batch_error), "%s", why);
    } else {
        relay_debug(COMPONENT, "batch of %zu rows not published: %s", l->nrows, why);
    }
    if (l->tally.function_missing)
        relay_sink_reload_function(r->sink);
    else if (l->tally.not_primary)
        relay_sink_abort(r->sink, "the server answered READONLY: it is a replica now (a "
                                  "failover); reconnecting, through the Sentinels when set");
    else if (l->tally.slots_moved)
        relay_sink_abort(r->sink, "a slot of the cluster moved to another primary (MOVED): "
                                  "reading the slot map again");
}

static void op_kick(void *arg)
{
    struct relay *r = arg;
    if (!ev_is_active(&r->kick)) {
        ev_timer_set(&r->kick, 0.0, 0.0);
        ev_timer_start(r->loop, &r->kick);
    }
}

static void op_arm_retry(void *arg, uint32_t ms)
{
    struct relay *r = arg;
    ev_timer_stop(r->loop, &r->retry_timer);
    ev_timer_set(&r->retry_timer, ms / 1000.0, 0.0);
    ev_timer_start(r->loop, &r->retry_timer);
}

static int op_self_driven(void *arg)
{
    const struct relay *r = arg;
    return relay_wake_self_driven(&r->wake);
}

static void op_went_empty(void *arg)
{
    struct relay *r = arg;
    relay_wake_empty(&r->wake);
}

static void op_drained(void *arg)
{
    relay_drain_step(arg);
}

/* ---- answers into events ----------------------------------------------- */

static void on_begun(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                     void *arg)
{
    struct relay_lane *l = arg;
    struct relay *r = l->r;
    (void)pg;
    (void)res;
    (void)sqlstate;
    if (r->stopping)
        return;
    if (err != NULL) {
        char why[600];
        snprintf(why, sizeof(why), "BEGIN failed: %s", err);
        relay_cycle_failed(&r->cycle, l->index, RELAY_FAIL_POSTGRES, why);
        return;
    }
    relay_cycle_begun(&r->cycle, l->index);
}

OUTBOX_STATIC int parse_row(PGresult *res, int i, struct relay_row *row);
OUTBOX_STATIC int parse_row(PGresult *res, int i, struct relay_row *row)
{
    if (PQgetlength(res, i, 0) != 8)
        return -1;
    memset(row, 0, offsetof(struct relay_row, error));
    row->error[0] = '\0';
    row->id = relay_batch_decode_int8(PQgetvalue(res, i, 0));
    row->message_id = PQgetvalue(res, i, 1);
    row->message_id_len = (size_t)PQgetlength(res, i, 1);
    row->topic = PQgetvalue(res, i, 2);
    row->topic_len = (size_t)PQgetlength(res, i, 2);
    if (!PQgetisnull(res, i, 3)) {
        row->key = PQgetvalue(res, i, 3);
        row->key_len = (size_t)PQgetlength(res, i, 3);
    }
    if (PQgetisnull(res, i, 4)) {
        /* Over max_payload_bytes: left in the database, only its size came. */
        if (PQgetlength(res, i, 10) != 4)
            return -1;
        row->payload_len = (size_t)(uint32_t)relay_batch_decode_int4(PQgetvalue(res, i, 10));
    } else {
        row->payload = PQgetvalue(res, i, 4);
        row->payload_len = (size_t)PQgetlength(res, i, 4);
    }
    row->created_at = PQgetvalue(res, i, 5);
    row->created_at_len = (size_t)PQgetlength(res, i, 5);
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
    if (PQgetlength(res, i, 9) != 4)
        return -1;
    row->attempts = relay_batch_decode_int4(PQgetvalue(res, i, 9));
    if (PQgetlength(res, i, 11) != 4)
        return -1;
    int32_t partitions = relay_batch_decode_int4(PQgetvalue(res, i, 11));
    row->partitions = partitions < 1 ? 1 : (uint32_t)partitions;
    row->partition = outbox_partition_of(row->key, row->key_len, row->id, row->partitions);
    row->state = RELAY_ROW_CLAIMED;
    return 0;
}

static void on_claimed(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                       void *arg)
{
    struct relay_lane *l = arg;
    struct relay *r = l->r;
    (void)sqlstate;
    if (r->stopping)
        return;
    if (err != NULL || res == NULL || PQnfields(res) != 12) {
        char why[600];
        snprintf(why, sizeof(why), "claim failed: %s",
                 err != NULL ? err : "unexpected result shape");
        relay_cycle_failed(&r->cycle, l->index, RELAY_FAIL_POSTGRES, why);
        return;
    }
    if (r->cycle.lanes[l->index].abandon) {
        relay_cycle_claimed(&r->cycle, l->index, 0, 0); /* rolled back, not published */
        return;
    }
    /* The rows point into the result: the lane keeps it until the batch ends. */
    l->claim_res = relay_pgsrc_take_result(pg);
    int n = PQntuples(res);
    l->nrows = 0;
    for (int i = 0; i < n && (size_t)i < r->cfg->batch_size; i++) {
        if (parse_row(res, i, &l->rows[l->nrows]) < 0) {
            relay_cycle_failed(&r->cycle, l->index, RELAY_FAIL_POSTGRES,
                               "claim returned a malformed row");
            return;
        }
        l->nrows++;
    }
    l->phase_at[RELAY_PHASE_WAIT] = relay_now();
    relay_cycle_claimed(&r->cycle, l->index, l->nrows, l->nrows == r->cfg->batch_size);
}

/* Every reply of the batch is in (or it never published anything). */
/* At debug level, which partitions a batch published to: several relays'
 * logs then show that each partition was published by one at a time. */
static void log_partitions_published(const struct relay_lane *l)
{
    char text[1024];
    size_t len = 0, n = 0;
    for (size_t i = 0; i < l->nrows && len < sizeof(text) - 64; i++) {
        const struct relay_row *row = &l->rows[i];
        if (row->state != RELAY_ROW_PUBLISHED || row->partitions <= 1)
            continue;
        int seen = 0;
        for (size_t j = 0; j < i && !seen; j++) {
            const struct relay_row *e = &l->rows[j];
            seen = e->state == RELAY_ROW_PUBLISHED && e->partition == row->partition &&
                   e->topic_len == row->topic_len &&
                   memcmp(e->topic, row->topic, e->topic_len) == 0;
        }
        if (seen)
            continue;
        int w = snprintf(text + len, sizeof(text) - len, " %.*s/%u", (int)row->topic_len,
                         row->topic, (unsigned)row->partition);
        if (w > 0)
            len += (size_t)w < sizeof(text) - len ? (size_t)w : sizeof(text) - len - 1;
        n++;
    }
    if (n > 0)
        relay_debug(COMPONENT, "published a batch of %zu rows to partitions%s", l->nrows, text);
}

static void publish_done(struct relay_lane *l)
{
    struct relay *r = l->r;
    if (r->stopping)
        return;
    if (l->tally.failed) {
        relay_cycle_failed(&r->cycle, l->index, l->tally.kind, l->tally.error);
    } else {
        /* From here on the relay claims on its own until a claim comes back
         * empty, so producers may stop notifying. */
        relay_wake_busy(&r->wake);
        if (relay_log_get_level() == RELAY_LOG_DEBUG)
            log_partitions_published(l);
        l->phase_at[RELAY_PHASE_FINISH] = relay_now();
        relay_cycle_published(&r->cycle, l->index);
    }
    arm_deadline(r);
}

/* The lane publishing the batch that holds row (a reply's argument), when
 * the reply of ac still counts for it; NULL for a reply that arrives after
 * the batch ended (or while stopping). */
static struct relay_lane *publishing_lane(redisAsyncContext *ac, const struct relay_row *row)
{
    struct relay *r = relay_sink_owner(ac);
    if (r == NULL || r->stopping)
        return NULL;
    uintptr_t at = (uintptr_t)row;
    for (size_t i = 0; i < r->nlanes; i++) {
        struct relay_lane *l = &r->lanes[i];
        if (at >= (uintptr_t)l->rows && at < (uintptr_t)(l->rows + l->nrows))
            return r->cycle.lanes[i].state == RELAY_LANE_PUBLISH ? l : NULL;
    }
    return NULL;
}

/* What a reply is for relay_batch_apply_*: lost (NULL, with the
 * connection's error), an error, or `ok` when it has the type expected. */
static enum relay_reply_kind reply_kind(const redisAsyncContext *ac, const redisReply *reply,
                                        int ok, enum relay_reply_kind ok_kind, const char **str,
                                        size_t *len)
{
    *str = NULL;
    *len = 0;
    if (reply == NULL) {
        *str = ac->errstr;
        *len = strlen(ac->errstr);
        return RELAY_REPLY_LOST;
    }
    if (reply->type == REDIS_REPLY_ERROR) {
        *str = reply->str;
        *len = reply->len;
        return RELAY_REPLY_ERROR;
    }
    return ok ? ok_kind : RELAY_REPLY_OTHER;
}

/* The reply to one publish call (relay_batch_append_publish_call): one
 * reply per row, in the order of the rows, or one for them all. */
static void on_publish_reply(redisAsyncContext *ac, void *reply_, void *arg)
{
    const redisReply *reply = reply_;
    struct relay_lane *l = publishing_lane(ac, arg);
    if (l == NULL)
        return;
    struct relay_row *row = arg;
    size_t n = row->call_rows;
    int each = reply != NULL && reply->type == REDIS_REPLY_ARRAY && reply->elements == n;
    for (size_t k = 0; k < n && row != NULL; k++) {
        const redisReply *one = each ? reply->element[k] : reply;
        const char *str;
        size_t len;
        /* A call of several rows is answered with an array. */
        int entry = one != NULL && (each || n == 1) &&
                    (one->type == REDIS_REPLY_STRING || one->type == REDIS_REPLY_STATUS);
        /* An array of another length answers none of the rows. */
        enum relay_reply_kind kind = reply_kind(ac, one, entry, RELAY_REPLY_ENTRY, &str, &len);
        struct relay_row *next = row->next >= 0 ? &l->rows[row->next] : NULL;
        if (relay_batch_apply_reply(&l->tally, row, kind, str, len)) {
            publish_done(l);
            return;
        }
        row = next;
    }
}

static void on_wait_reply(redisAsyncContext *ac, void *reply_, void *arg)
{
    const redisReply *reply = reply_;
    struct relay_lane *l = arg;
    struct relay *r = relay_sink_owner(ac);
    if (r == NULL || r->stopping || r->cycle.lanes[l->index].state != RELAY_LANE_PUBLISH)
        return;
    const char *str;
    size_t len;
    int count = reply != NULL && reply->type == REDIS_REPLY_INTEGER;
    enum relay_reply_kind kind = reply_kind(ac, reply, count, RELAY_REPLY_COUNT, &str, &len);
    if (relay_batch_apply_wait(&l->tally, kind, count ? reply->integer : -1, str, len,
                               l->r->cfg->min_replicas, l->r->cfg->replica_timeout_ms))
        publish_done(l);
}

static void on_deadline(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    char why[128];
    snprintf(why, sizeof(why), "no reply to the batch within publish_timeout (%u ms) of its claim",
             r->cfg->publish_timeout_ms);
    /* The batch ahead timed out; one publishing behind it (relay_cycle_ops.
     * overlap) loses its replies with the connection, for the same reason. */
    for (size_t i = 0; i < r->nlanes; i++) {
        struct relay_tally *t = &r->lanes[i].tally;
        if (r->cycle.lanes[i].state != RELAY_LANE_PUBLISH || t->failed)
            continue;
        t->failed = 1;
        t->kind = RELAY_FAIL_REDIS_TIMEOUT;
        if ((int)i == r->cycle.publishing)
            snprintf(t->error, sizeof(t->error), "%s", why);
        else
            snprintf(t->error, sizeof(t->error),
                     "no reply to the batch ahead of it within publish_timeout (%u ms) of that "
                     "batch's claim",
                     r->cfg->publish_timeout_ms);
    }
    /* hiredis 0.14 cannot cancel a command: drop the connection, which runs
     * every pending callback with a NULL reply and ends the batch. */
    relay_sink_abort(r->sink, why);
}

/* Published messages per topic, for outbox_relay_messages_published_total,
 * and the streams published to, for the observer's list of streams (each
 * stream exists once a row of it is published). */
static void count_topics(struct relay_lane *l)
{
    struct relay_figures *f = &l->r->fig;
    size_t hint = 0;
    const struct relay_row *prev = NULL;
    for (size_t i = 0; i < l->nrows; i++) {
        const struct relay_row *row = &l->rows[i];
        if (row->state != RELAY_ROW_PUBLISHED)
            continue;
        if (prev == NULL || !relay_batch_same_stream(prev, row))
            relay_stream_seen_note(&l->r->streams_seen, l->r->cfg->stream_prefix, row);
        prev = row;
        size_t j = hint;
        int found = 0;
        for (size_t n = 0; n < f->ntopics; n++, j = (j + 1) % f->ntopics) {
            if (strlen(f->topics[j].topic) == row->topic_len &&
                memcmp(f->topics[j].topic, row->topic, row->topic_len) == 0) {
                f->topics[j].published++;
                hint = j;
                found = 1;
                break;
            }
        }
        if (found)
            continue;
        if (f->ntopics < RELAY_OBS_TOPICS_MAX && row->topic_len <= OUTBOX_TOPIC_MAX) {
            memcpy(f->topics[f->ntopics].topic, row->topic, row->topic_len);
            f->topics[f->ntopics].topic[row->topic_len] = '\0';
            f->topics[f->ntopics++].published = 1;
        } else {
            f->other_published++;
        }
    }
}

static void log_row_failures(const struct relay_lane *l)
{
    const struct relay *r = l->r;
    for (size_t i = 0; i < l->nrows; i++) {
        const struct relay_row *row = &l->rows[i];
        if (row->state != RELAY_ROW_FAILED)
            continue;
        int32_t attempts = row->attempts + 1;
        int topic_len = (int)relay_batch_utf8_prefix(row->topic, row->topic_len, 64);
        /* The error ends with what to do, as the failure's cause calls for
         * (relay_batch_check_publish, relay_batch_apply_reply). */
        if (row->fault == RELAY_FAULT_PERMANENT)
            relay_error(COMPONENT,
                        "row id=%lld message_id=%.*s topic=%.*s quarantined at attempt %d, not "
                        "retried (every attempt would fail the same way): %s; 'outbox-relay "
                        "failed list' lists the quarantined rows",
                        (long long)row->id, (int)row->message_id_len, row->message_id, topic_len,
                        row->topic, attempts, row->error);
        else if (relay_batch_row_quarantined(row, r->cfg->max_attempts))
            relay_error(COMPONENT,
                        "row id=%lld message_id=%.*s topic=%.*s quarantined after %d attempts: "
                        "%s; 'outbox-relay failed list' lists the quarantined rows",
                        (long long)row->id, (int)row->message_id_len, row->message_id, topic_len,
                        row->topic, attempts, row->error);
        else
            relay_warn(COMPONENT,
                       "row id=%lld message_id=%.*s topic=%.*s not published (attempt %d of %u): "
                       "%s",
                       (long long)row->id, (int)row->message_id_len, row->message_id, topic_len,
                       row->topic, attempts, r->cfg->max_attempts, row->error);
    }
}

static void retire_due(struct relay *r);

static void on_retired(redisAsyncContext *ac, void *reply, void *arg)
{
    struct relay *r = arg;
    (void)ac;
    (void)reply; /* an error or a lost connection leaves the records to their TTL */
    if (r->retires_pending > 0)
        r->retires_pending--;
    if (!r->stopping && r->cycle.draining && relay_cycle_all_idle(&r->cycle))
        relay_drain_step(r);
    else if (!r->stopping && r->retires_pending == 0 && r->retire_paced)
        retire_due(r); /* the slice before is answered: the next */
}

/* Hands the records of the waiting removals, from the oldest, to Redis as
 * expiries at their due time, until at most keep bytes of them wait: at
 * shutdown (keep 0), or when more wait than the relay holds. A record whose
 * removal is already due goes at once. */
static void retire_waiting(struct relay *r, size_t keep)
{
    const struct relay_retire_item *it;
    double now = relay_now();
    while ((it = relay_retire_head(&r->retiring)) != NULL && r->retiring.bytes > keep) {
        int ready;
        if (it->due <= now) {
            ready = relay_sink_formatted(r->sink, it->cmd, it->len, on_retired, r) == 0;
        } else {
            outbox_buf_reset(&r->out);
            ready = relay_batch_unlink_as_retire(
                        it->cmd, it->len, relay_retire_ms_left(it->due, now), &r->out) == 0 &&
                    relay_sink_formatted(r->sink, r->out.data, r->out.len, on_retired, r) == 0;
        }
        /* Not sent (Redis is away): the records live out their dedup_ttl. */
        if (ready)
            r->retires_pending++;
        relay_retire_pop(&r->retiring);
    }
}

/* Sends the removals that are due, RELAY_RETIRE_HANDOFF bytes of them at
 * most, and sets the timer for the next one. More than that falls due at once
 * only after Redis was away (up to the whole queue, 16 MiB): the rest follows
 * a slice at a time, each once every removal sent before it is answered, so
 * the Redis client's output buffer never holds more than a slice of them. */
static void retire_due(struct relay *r)
{
    const struct relay_retire_item *it;
    double now = relay_now();
    size_t sent = 0;
    r->retire_paced = 0;
    while ((it = relay_retire_head(&r->retiring)) != NULL && it->due <= now) {
        if (sent > 0 && sent + it->len > RELAY_RETIRE_HANDOFF) {
            r->retire_paced = 1;
            break;
        }
        if (relay_sink_formatted(r->sink, it->cmd, it->len, on_retired, r) != 0)
            break; /* Redis is away: try again shortly */
        sent += it->len;
        r->retires_pending++;
        relay_retire_pop(&r->retiring);
    }
    ev_timer_stop(r->loop, &r->retire_timer);
    /* The next slice waits for the replies, which always come: hiredis
     * answers each callback, with no reply when the connection is lost. */
    if (it == NULL || r->retire_paced)
        return;
    /* Due already: Redis is away. */
    double after = it->due > now ? it->due - now : 1.0;
    ev_timer_set(&r->retire_timer, after, 0.0);
    ev_timer_start(r->loop, &r->retire_timer);
}

static void on_retire_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    if (!r->stopping)
        retire_due(r);
}

void relay_cycle_io_retire_all(struct relay *r)
{
    ev_timer_stop(r->loop, &r->retire_timer);
    retire_waiting(r, 0);
}

/* Retires the dedup records of a committed batch: its rows are marked sent and
 * will not be claimed again, so the records are needed only until a copy
 * another relay may have sent before its claim of these rows ended has
 * passed its deadline, publish_timeout at most after that claim (docs/
 * DESIGN.md, "The publish deadline"). They are removed publish_timeout after
 * the commit, by one UNLINK per stream (each inside one hash slot), which
 * waits in r->retiring until then. This keeps dedup memory bounded by batches
 * whose outcome is unknown and the last publish_timeout's worth. */
static void retire_dedup_records(struct relay_lane *l)
{
    struct relay *r = l->r;
    double due = relay_now() + r->cfg->publish_timeout_ms / 1000.0;
    size_t pos = 0;
    for (;;) {
        outbox_buf_reset(&r->out);
        if (relay_batch_append_retire(l->rows, l->nrows, r->cfg->stream_prefix, 0, &pos, &r->out) !=
            1)
            break;
        /* Out of memory: the records live out their dedup_ttl. */
        if (relay_retire_push(&r->retiring, due, r->out.data, r->out.len) != 0)
            break;
    }
    /* Past the cap, the oldest removals go to Redis a slice at a time: a
     * hand-off is written to the Redis client's output buffer at once, and
     * half the queue (8 MiB) grew that buffer by realloc until glibc kept as
     * much again in its heap after it was freed. */
    if (r->retiring.bytes > RELAY_RETIRE_QUEUE_MAX)
        retire_waiting(r, RELAY_RETIRE_QUEUE_MAX - RELAY_RETIRE_HANDOFF);
    if (!ev_is_active(&r->retire_timer) && !r->retire_paced)
        retire_due(r);
}

/* One duration into a histogram of relay_batch_buckets and its sum. */
static void count_seconds(unsigned long long *hist, double *sum, double took)
{
    size_t b = 0;
    while (b < OUTBOX_ARRAY_LEN(relay_batch_buckets) && took > relay_batch_buckets[b])
        b++;
    hist[b]++;
    *sum += took;
}

/* The phases of the committed batch, each from its start to the next one's
 * (the last to now); a batch that skipped one (nothing to publish) counts
 * only those whose ends it has. */
static void count_phases(struct relay_lane *l, double now)
{
    struct relay_figures *f = &l->r->fig;
    for (int p = 0; p < RELAY_PHASES; p++) {
        double end = p + 1 < RELAY_PHASES ? l->phase_at[p + 1] : now;
        if (l->phase_at[p] > 0 && end >= l->phase_at[p])
            count_seconds(f->phase_hist[p], &f->phase_sum[p], end - l->phase_at[p]);
    }
}

/* The batch committed: count it, log its rows' failures, drop its records. */
static void batch_committed(struct relay_lane *l)
{
    struct relay *r = l->r;
    struct relay_figures *f = &r->fig;
    size_t published = 0, failed = 0;
    for (size_t i = 0; i < l->nrows; i++) {
        if (l->rows[i].state == RELAY_ROW_PUBLISHED)
            published++;
        else if (l->rows[i].state == RELAY_ROW_FAILED)
            failed++;
        f->quarantined_total += relay_batch_row_quarantined(&l->rows[i], r->cfg->max_attempts);
    }
    f->published_total += published;
    f->row_errors += failed;
    f->batches_total++;
    double now = relay_now();
    double took = now - r->cycle.lanes[l->index].claimed_at;
    count_seconds(f->batch_hist, &f->batch_sum, took);
    count_phases(l, now);
    count_topics(l);
    log_row_failures(l);
    if (f->last_batch_error[0] != '\0') {
        relay_info(COMPONENT, "publishing again after: %s", f->last_batch_error);
        f->last_batch_error[0] = '\0';
    }
    if (l->tally.left > 0)
        relay_debug(COMPONENT,
                    "batch committed: %zu published, %zu failed, %zu left behind the batch ahead "
                    "for the next claim, %.1f ms",
                    published, failed, l->tally.left, took * 1000.0);
    else
        relay_debug(COMPONENT, "batch committed: %zu published, %zu failed, %.1f ms", published,
                    failed, took * 1000.0);
    retire_dedup_records(l);
}

static void on_finished(struct relay_pgsrc *pg, PGresult *res, const char *err,
                        const char *sqlstate, void *arg)
{
    struct relay_lane *l = arg;
    struct relay *r = l->r;
    (void)pg;
    (void)res;
    if (r->stopping)
        return;
    if (err != NULL) {
        /* A lost connection during COMMIT leaves the outcome unknown: the rows
         * may be claimed again, and their dedup records absorb the republish. */
        char why[700];
        snprintf(why, sizeof(why), "marking the batch sent failed (%s%s)", err,
                 sqlstate != NULL && strcmp(sqlstate, "08006") == 0 ? "; commit outcome unknown"
                                                                    : "");
        relay_cycle_failed(&r->cycle, l->index, RELAY_FAIL_POSTGRES, why);
        return;
    }
    batch_committed(l);
    relay_wake_busy(&r->wake); /* takes the lock again if an earlier try timed out */
    /* Rows left behind the batch ahead wait, as after a full batch. */
    relay_cycle_committed(&r->cycle, l->index, l->nrows == r->cfg->batch_size || l->tally.left > 0);
}

static void on_rolled_back(struct relay_pgsrc *pg, PGresult *res, const char *err,
                           const char *sqlstate, void *arg)
{
    struct relay_lane *l = arg;
    (void)res;
    (void)sqlstate;
    if (l->r->stopping)
        return;
    if (err != NULL)
        relay_pgsrc_reset(pg, "ROLLBACK failed");
    relay_cycle_rolled_back(&l->r->cycle, l->index);
}

/* ---- connections ------------------------------------------------------- */

static void on_kick(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    relay_cycle_run(&((struct relay *)w->data)->cycle);
}

static void on_retry(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    relay_cycle_retry_due(&((struct relay *)w->data)->cycle);
}

/* Catch up: notifications sent while the connection was away are lost. A
 * claiming connection starts busy: it declares itself idle after the catch-up. */
static void lane_ready(struct relay_pgsrc *pg, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    relay_wake_busy(&r->wake);
    relay_cycle_want(&r->cycle);
}

/* A claiming connection broke. A lane with a command in flight hears of it
 * from that command; a lane between commands holds a batch whose locks the
 * server has just released, so the batch is void. */
static void lane_down(struct relay_pgsrc *pg, void *arg)
{
    struct relay *r = arg;
    for (size_t i = 0; i < r->nlanes; i++)
        if (r->lanes[i].pg == pg)
            relay_cycle_lane_down(&r->cycle, i);
}

static void sink_ready(struct relay_sink *s, void *arg)
{
    struct relay *r = arg;
    (void)s;
    relay_cycle_want(&r->cycle);
}

int relay_cycle_io_start(struct relay *r)
{
    const struct relay_cycle_ops ops = {
        .arg = r,
        .now = op_now,
        .lane_ready = op_lane_ready,
        .sink_ready = op_sink_ready,
        .begin = op_begin,
        .claim = op_claim,
        .publish = op_publish,
        .finish = op_finish,
        .rollback = op_rollback,
        .release = op_release,
        .failed = op_failed,
        .kick = op_kick,
        .arm_retry = op_arm_retry,
        .self_driven = op_self_driven,
        .went_empty = op_went_empty,
        .drained = op_drained,
        .holds_keys = op_holds_keys,
        .overlap = op_overlap,
        .left_rows = op_left_rows,
    };
    const struct relay_config *cfg = r->cfg;
    r->nlanes = cfg->pipeline ? 2 : 1;
    relay_cycle_init(&r->cycle, &ops, r->nlanes, cfg->reconnect_min_ms, cfg->reconnect_max_ms);
    ev_init(&r->kick, on_kick);
    r->kick.data = r;
    ev_init(&r->retire_timer, on_retire_timer);
    r->retire_timer.data = r;
    ev_init(&r->retry_timer, on_retry);
    r->retry_timer.data = r;
    ev_init(&r->deadline, on_deadline);
    r->deadline.data = r;

    struct relay_pgsrc_hooks hooks = {.arg = r, .on_ready = lane_ready, .on_down = lane_down};
    for (size_t i = 0; i < r->nlanes; i++) {
        struct relay_lane *l = &r->lanes[i];
        l->r = r;
        l->index = i;
        l->rows = calloc(cfg->batch_size, sizeof(*l->rows));
        if (l->rows == NULL || relay_batch_streams_init(&l->streams, cfg->batch_size) != 0)
            return -1;
        l->pg = relay_pgsrc_new(r->loop, cfg, RELAY_PGSRC_CLAIM, &hooks);
        if (l->pg == NULL)
            return -1;
    }
    struct relay_sink_hooks sink_hooks = {.arg = r, .on_ready = sink_ready};
    r->sink = relay_sink_new(r->loop, cfg, &sink_hooks);
    return r->sink != NULL ? 0 : -1;
}

void relay_cycle_io_stop(struct relay *r)
{
    r->cycle.stopping = 1;
    if (r->loop != NULL) {
        ev_timer_stop(r->loop, &r->kick);
        ev_timer_stop(r->loop, &r->retry_timer);
        ev_timer_stop(r->loop, &r->deadline);
        ev_timer_stop(r->loop, &r->retire_timer);
    }
    /* Removals still waiting: the records live out their dedup_ttl. */
    relay_retire_clear(&r->retiring);
    /* Redis first: its pending callbacks run now and see r->stopping. */
    relay_sink_free(r->sink);
    r->sink = NULL;
    for (size_t i = 0; i < r->nlanes; i++) {
        struct relay_lane *l = &r->lanes[i];
        relay_pgsrc_free(l->pg);
        l->pg = NULL;
        if (l->claim_res != NULL)
            PQclear(l->claim_res);
        l->claim_res = NULL;
        free(l->rows);
        l->rows = NULL;
        outbox_buf_free(&l->sql);
        relay_batch_streams_free(&l->streams);
    }
    outbox_buf_free(&r->out);
}
