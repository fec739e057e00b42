/*
 * The claim cycle, and when to run it.
 *
 * A batch is one PostgreSQL transaction:
 *   BEGIN; claim up to batch_size pending rows in id order FOR UPDATE SKIP LOCKED
 *   -> publish every row through the Redis function, pipelined, under one deadline
 *   -> when every reply is in: mark the published rows sent, record the failures
 *      of rows that failed for reasons of their own, COMMIT.
 * Any failure of the whole batch (Redis unreachable, an error reply about the
 * server rather than the row, the deadline, PostgreSQL going away) rolls the
 * transaction back and retries after a jittered backoff: a row is marked sent
 * only in the transaction that claimed it, and that transaction commits only
 * after Redis acknowledged it, so a committed row is published at least once
 * whatever crashes where (P1). A republish after an unknown commit outcome is
 * absorbed by the function's dedup record (P2).
 *
 * Batches run on a notification (coalesced), on the fallback poll timer, after
 * every (re)connect (notifications sent while disconnected are lost), and at
 * once again while batches come back full.
 *
 * The pipeline. Each batch runs on a lane: a claiming connection with its own
 * transaction. With pipeline on there are two lanes, so that PostgreSQL and
 * Redis work at the same time: while batch N is published, batch N+1 is
 * claimed on the other lane (SKIP LOCKED passes over N's rows), and while N is
 * marked sent and committed, N+1 is published. Three rules keep this as safe
 * and as ordered as one batch at a time:
 *   - claims run one at a time, and a lane claims ahead only while no claimed
 *     batch is waiting, so at most two batches exist (P5);
 *   - batches publish one at a time, in claim order, and a batch starts
 *     publishing only after every reply of the batch before it came back, so
 *     entries reach each stream in claim order;
 *   - when a batch fails, every batch claimed after it that has not started
 *     publishing is rolled back, so its rows cannot overtake the failed ones.
 * A batch that fails after it was published (its commit failed) leaves its
 * entries in the streams ahead of the next batch's; its republish is a no-op.
 */
#include "relay/compat.h"

#include "relay/relay.h"

#include <ev.h>
#include <hiredis/async.h>
#include <pthread.h>
#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "relay/backoff.h"
#include "relay/batch.h"
#include "relay/config.h"
#include "relay/log.h"
#include "relay/metrics.h"
#include "relay/observe.h"
#include "relay/pgsrc.h"
#include "relay/sdnotify.h"
#include "relay/sink.h"
#include "relay/tools.h"

#define COMPONENT "relay"
#define LANES_MAX 2
/* Whole-batch failures in a row that turn /readyz red: one is a blip that
 * the retry absorbs, three in a row need someone to look. */
#define FAILURES_NOT_READY 3

extern char **environ;

enum lane_state {
    LANE_IDLE = 0,
    LANE_BEGIN,    /* BEGIN sent */
    LANE_CLAIM,    /* claim sent */
    LANE_CLAIMED,  /* rows locked; waiting for the batch ahead to finish publishing */
    LANE_PUBLISH,  /* FCALLs in flight */
    LANE_FINISH,   /* mark + COMMIT sent */
    LANE_ROLLBACK, /* ROLLBACK (or the COMMIT of an empty claim) sent */
};

/* The wake-up protocol of migrations/007 (DESIGN.md 7.1): producers notify
 * only while no relay holds the wake-up lock, which a busy relay holds on its
 * LISTEN connection. */
enum wake_mode {
    WAKE_BUSY = 0, /* claiming on its own until a claim comes back empty */
    WAKE_IDLE,     /* declared idle: notifications wake it */
};

enum wake_lock {
    LOCK_FREE = 0, /* not held: producers notify */
    LOCK_TAKING,   /* requested; new producers already skip their notification */
    LOCK_HELD,     /* held: producers skip their notification */
};

/* The advisory lock key of migrations/007: "outbox" in ASCII. */
#define WAKEUP_LOCK "122550254464888"
/* How long a busy relay waits for notifying producers to commit before it
 * gives up taking the lock for this batch. */
#define WAKEUP_LOCK_TIMEOUT_MS "250"

struct relay;

/* One claiming connection and the batch it holds. Rows point into claim_res. */
struct lane {
    struct relay *r;
    struct relay_pgsrc *pg;
    enum lane_state state;
    unsigned long long seq; /* claim order */
    int abandon;            /* a batch ahead failed: roll back instead of publishing */
    PGresult *claim_res;
    struct relay_row *rows;
    size_t nrows;
    struct relay_cycle cycle;
    ev_tstamp claimed_at; /* BEGIN sent: the batch duration histogram */
    ev_tstamp stage_at;   /* the current stage began: the stuck-cycle check */
    struct relay_sqlbuf sql;
};

struct relay {
    struct ev_loop *loop;
    struct relay_config *cfg;
    struct relay_reload_source reload;

    struct lane lanes[LANES_MAX];
    size_t nlanes;
    unsigned long long next_seq;
    struct lane *publishing; /* the one lane whose FCALLs are in flight, or NULL */
    struct relay_pgsrc *listen;
    struct relay_sink *sink;

    ev_timer poll_timer;
    ev_timer kick;        /* runs a wanted claim from the loop, not from a callback */
    ev_timer retry_timer; /* backoff after a failed batch */
    ev_timer deadline;    /* publish deadline of the batch publishing */
    ev_timer drain_timer;
    ev_timer watchdog;    /* WATCHDOG=1 at half of WatchdogSec, while healthy */
    ev_timer status;      /* STATUS= line for systemctl status */
    ev_signal sigterm, sigint, sighup;
    char status_text[256];

    enum wake_mode wake;
    enum wake_lock lock;
    int idle_wanted; /* a claim came back empty while the lock was being taken */
    int settling;    /* declared idle; waiting for transactions that may not notify */
    ev_timer settle_timer;
    ev_tstamp settle_started;
    char *settle_writers; /* text[] of the outbox writers open at the release */
    int holder_check;      /* a check for a foreign wake-up lock holder is running */
    long foreign_pid;      /* who else holds the wake-up lock, 0 when nobody */
    char foreign_app[64];
    char foreign_addr[64];
    int want_claim;
    int in_backoff;
    int draining;
    unsigned unlinks_pending; /* UNLINKs of dedup records not yet answered */
    int stopping; /* the loop is being left: callbacks do nothing */
    struct relay_backoff batch_backoff;

    struct relay_respbuf out; /* one Redis command, formatted; reused, grows only */

    unsigned failures_in_row; /* whole-batch failures since the last commit */
    unsigned long long published_total;
    unsigned long long quarantined_total;
    char last_batch_error[512];

    /* Counters for /metrics. */
    struct topic_count {
        char topic[RELAY_TOPIC_MAX + 1];
        unsigned long long published;
    } topic_counts[RELAY_OBS_TOPICS_MAX];
    size_t ntopic_counts;
    unsigned long long other_published; /* topics beyond the table */
    unsigned long long batches_total;
    unsigned long long batch_hist[16]; /* cumulative at scrape; here per bucket */
    double batch_sum;
    unsigned long long errors[6];
    struct relay_metrics *metrics;

    /* Observation thread: reads queue age, lag and admission off the loop. */
    pthread_t obs_thread;
    int obs_started;
    pthread_mutex_t obs_lock;
    pthread_cond_t obs_cond;
    int obs_stop;                      /* under obs_lock */
    struct relay_observation *obs_new; /* written by the thread, under obs_lock */
    struct relay_observe_stop *obs_interrupt; /* ends the thread's waits at shutdown */
    int obs_fresh;                     /* under obs_lock */
    struct relay_observation *obs;     /* the loop's copy */
    ev_async obs_async;
    /* Streams paused for backpressure, as the claim's $2 text[] literal. */
    unsigned char paused[RELAY_OBS_TOPICS_MAX];
    char paused_topics[RELAY_OBS_TOPICS_MAX][RELAY_TOPIC_MAX + 1];
    size_t npaused;
    char paused_param[RELAY_OBS_TOPICS_MAX * (RELAY_TOPIC_MAX + 4) + 4];
};

/* Error kinds of outbox_relay_publish_errors_total. */
static const char *const error_kinds[6] = {"redis_connection", "redis_timeout", "redis_error",
                                           "redis_reply", "postgres", "row"};
/* Upper bounds of the batch duration histogram, in seconds. */
static const double batch_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                       0.25,  0.5,    1,     2.5,  5,     10};

static void maybe_claim(struct relay *r);
static void start_publish(struct lane *l);
static void take_wakeup_lock(struct relay *r);
static void on_idle_declared(struct relay_pgsrc *pg, PGresult *res, const char *err,
                             const char *sqlstate, void *arg);
static void log_row_failures(struct lane *l);
static void on_claimed(struct relay_pgsrc *pg, PGresult *res, const char *err,
                       const char *sqlstate, void *arg);

/* ---- small helpers ---------------------------------------------------- */

/* Durations are measured on the monotonic clock: libev's ev_now() follows the
 * wall clock, which steps (NTP, a VM resume), and a step must neither make a
 * healthy cycle look stuck nor hide a stuck one. */
static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int all_lanes_idle(const struct relay *r)
{
    for (size_t i = 0; i < r->nlanes; i++)
        if (r->lanes[i].state != LANE_IDLE)
            return 0;
    return 1;
}

static int all_lanes_idle_but(const struct relay *r, const struct lane *but)
{
    for (size_t i = 0; i < r->nlanes; i++)
        if (&r->lanes[i] != but && r->lanes[i].state != LANE_IDLE)
            return 0;
    return 1;
}

/* A claim may start: nothing claiming or waiting to publish, and a lane
 * free. The settle wait of going idle does not hold claims back: a row that
 * notified is claimed at once. */
static struct lane *free_lane(struct relay *r)
{
    struct lane *free = NULL;
    for (size_t i = 0; i < r->nlanes; i++) {
        struct lane *l = &r->lanes[i];
        switch (l->state) {
        case LANE_BEGIN:
        case LANE_CLAIM:
        case LANE_CLAIMED:
            return NULL;
        case LANE_IDLE:
            if (free == NULL && relay_pgsrc_state(l->pg) == RELAY_PG_READY)
                free = l;
            break;
        default:
            break;
        }
    }
    return free;
}

static void want_cycle(struct relay *r)
{
    r->want_claim = 1;
    if (!r->in_backoff && !r->draining && !ev_is_active(&r->kick) && free_lane(r) != NULL) {
        ev_timer_set(&r->kick, 0.0, 0.0);
        ev_timer_start(r->loop, &r->kick);
    }
}

static void free_batch(struct lane *l)
{
    if (l->claim_res != NULL) {
        PQclear(l->claim_res);
        l->claim_res = NULL;
    }
    l->nrows = 0;
    memset(&l->cycle, 0, sizeof(l->cycle));
}

static void set_stage(struct lane *l, enum lane_state state)
{
    l->state = state;
    l->stage_at = mono_now();
}

/* Draining is over once no batch is in flight and Redis has answered the
 * UNLINKs of the last committed batches' dedup records: leaving earlier would
 * drop them with the client's output buffer, and every record would live out
 * its dedup_ttl. */
static int drained(const struct relay *r)
{
    return all_lanes_idle(r) && r->unlinks_pending == 0;
}

static void drain_step(struct relay *r)
{
    if (r->draining && drained(r)) {
        relay_info(COMPONENT, "batch in flight finished; shutting down");
        ev_break(r->loop, EVBREAK_ALL);
    }
}

/* The lane's batch is over: leave if draining and nothing else is in flight,
 * or run what is wanted next. */
static void lane_ended(struct lane *l)
{
    struct relay *r = l->r;
    free_batch(l);
    l->state = LANE_IDLE;
    l->abandon = 0;
    if (r->draining) {
        drain_step(r);
        return;
    }
    if (r->want_claim)
        want_cycle(r);
}

static void start_backoff(struct relay *r)
{
    uint32_t delay = relay_backoff_next(&r->batch_backoff, relay_backoff_random());
    r->in_backoff = 1;
    ev_timer_stop(r->loop, &r->retry_timer);
    ev_timer_set(&r->retry_timer, delay / 1000.0, 0.0);
    ev_timer_start(r->loop, &r->retry_timer);
    r->want_claim = 1;
}

static void on_rolled_back(struct relay_pgsrc *pg, PGresult *res, const char *err,
                           const char *sqlstate, void *arg)
{
    struct lane *l = arg;
    (void)sqlstate;
    if (res != NULL)
        PQclear(res);
    if (l->r->stopping)
        return;
    if (err != NULL)
        relay_pgsrc_reset(pg, "ROLLBACK failed");
    lane_ended(l);
}

/* Ends the lane's transaction without marking anything. */
static void roll_back(struct lane *l)
{
    if (!l->r->stopping && relay_pgsrc_state(l->pg) == RELAY_PG_READY &&
        relay_pgsrc_send(l->pg, "ROLLBACK", 0, NULL, 0, on_rolled_back, l) == 0) {
        set_stage(l, LANE_ROLLBACK);
        return;
    }
    lane_ended(l);
}

static int error_kind(const char *why)
{
    if (strncmp(why, "Redis connection", 16) == 0)
        return 0;
    if (strncmp(why, "no reply to the batch", 21) == 0)
        return 1;
    if (strncmp(why, "Redis answered", 14) == 0)
        return 2;
    if (strncmp(why, "unexpected reply", 16) == 0)
        return 3;
    return 4;
}

/* A failure of the whole batch: roll back, nobody is blamed, try again later.
 * Batches claimed after it that have not published yet are rolled back too,
 * so their rows cannot reach the streams ahead of this batch's. */
static void batch_failed(struct lane *l, const char *why)
{
    struct relay *r = l->r;
    r->errors[error_kind(why)]++;
    r->failures_in_row++;
    if (strcmp(why, r->last_batch_error) != 0) {
        relay_warn(COMPONENT,
                   "batch of %zu rows not published: %s; rolled back, will retry with backoff",
                   l->nrows, why);
        snprintf(r->last_batch_error, sizeof(r->last_batch_error), "%s", why);
    } else {
        relay_debug(COMPONENT, "batch of %zu rows not published: %s", l->nrows, why);
    }
    if (l->cycle.function_missing)
        relay_sink_reload_function(r->sink);
    if (r->publishing == l)
        r->publishing = NULL;
    start_backoff(r);
    for (size_t i = 0; i < r->nlanes; i++) {
        struct lane *later = &r->lanes[i];
        if (later == l || later->seq < l->seq)
            continue;
        if (later->state == LANE_CLAIMED)
            roll_back(later);
        else if (later->state == LANE_BEGIN || later->state == LANE_CLAIM)
            later->abandon = 1;
    }
    roll_back(l);
}

/* ---- finishing ------------------------------------------------------- */

/* Removes the dedup records of a committed batch: its rows are marked sent and
 * will not be claimed again, so the records are no longer needed. This keeps
 * dedup memory bounded by batches whose outcome is unknown (DESIGN.md 7.3).
 * One UNLINK per stream keeps each command inside one hash slot. */
static void on_unlinked(redisAsyncContext *ac, void *reply, void *arg)
{
    struct relay *r = arg;
    (void)ac;
    (void)reply; /* an error or a lost connection leaves the records to their TTL */
    if (r->unlinks_pending > 0)
        r->unlinks_pending--;
    if (!r->stopping)
        drain_step(r);
}

static void drop_dedup_records(struct lane *l)
{
    struct relay *r = l->r;
    size_t pos = 0;
    for (;;) {
        relay_respbuf_reset(&r->out);
        if (relay_batch_append_unlink(l->rows, l->nrows, r->cfg->stream_prefix, &pos, &r->out) !=
            1)
            break;
        if (relay_sink_formatted(r->sink, r->out.data, r->out.len, on_unlinked, r) == 0)
            r->unlinks_pending++;
    }
}

/* Published messages per topic, for outbox_relay_messages_published_total. */
static void count_topics(struct lane *l)
{
    struct relay *r = l->r;
    size_t hint = 0;
    for (size_t i = 0; i < l->nrows; i++) {
        const struct relay_row *row = &l->rows[i];
        if (row->state != RELAY_ROW_PUBLISHED)
            continue;
        size_t j = hint;
        int found = 0;
        for (size_t n = 0; n < r->ntopic_counts; n++, j = (j + 1) % r->ntopic_counts) {
            struct topic_count *t = &r->topic_counts[j];
            if (strlen(t->topic) == row->topic_len &&
                memcmp(t->topic, row->topic, row->topic_len) == 0) {
                t->published++;
                hint = j;
                found = 1;
                break;
            }
        }
        if (found)
            continue;
        if (r->ntopic_counts < RELAY_OBS_TOPICS_MAX && row->topic_len <= RELAY_TOPIC_MAX) {
            struct topic_count *t = &r->topic_counts[r->ntopic_counts++];
            memcpy(t->topic, row->topic, row->topic_len);
            t->topic[row->topic_len] = '\0';
            t->published = 1;
        } else {
            r->other_published++;
        }
    }
}

static void on_finished(struct relay_pgsrc *pg, PGresult *res, const char *err,
                        const char *sqlstate, void *arg)
{
    struct lane *l = arg;
    struct relay *r = l->r;
    (void)pg;
    if (res != NULL)
        PQclear(res);
    if (r->stopping)
        return;
    if (err != NULL) {
        /* A lost connection during COMMIT leaves the outcome unknown: the rows
         * may be claimed again, and their dedup records absorb the republish. */
        char why[700];
        snprintf(why, sizeof(why), "marking the batch sent failed (%s%s%s)", err,
                 sqlstate && strcmp(sqlstate, "08006") == 0 ? "; commit outcome unknown" : "",
                 "");
        batch_failed(l, why);
        return;
    }
    size_t published = 0, failed = 0;
    for (size_t i = 0; i < l->nrows; i++) {
        if (l->rows[i].state == RELAY_ROW_PUBLISHED)
            published++;
        else if (l->rows[i].state == RELAY_ROW_FAILED)
            failed++;
    }
    r->published_total += published;
    r->errors[5] += failed;
    r->batches_total++;
    double took = mono_now() - l->claimed_at;
    r->batch_sum += took;
    size_t b = 0;
    while (b < RELAY_ARRAY_LEN(batch_buckets) && took > batch_buckets[b])
        b++;
    r->batch_hist[b]++;
    count_topics(l);
    log_row_failures(l);
    for (size_t i = 0; i < l->nrows; i++)
        r->quarantined_total += relay_batch_row_quarantined(&l->rows[i], r->cfg->max_attempts);
    relay_backoff_reset(&r->batch_backoff);
    r->failures_in_row = 0;
    if (r->last_batch_error[0] != '\0') {
        relay_info(COMPONENT, "publishing again after: %s", r->last_batch_error);
        r->last_batch_error[0] = '\0';
    }
    relay_debug(COMPONENT, "batch committed: %zu published, %zu failed, %.1f ms", published,
                failed, took * 1000.0);
    drop_dedup_records(l);
    /* A full batch means more may be waiting: claim again at once. A busy
     * relay gets no notifications (producers skip them), so it claims again
     * until a claim comes back empty. */
    if (r->cfg->listen) {
        r->wake = WAKE_BUSY;
        take_wakeup_lock(r); /* again, if an earlier attempt timed out */
    }
    if (l->nrows == r->cfg->batch_size || (r->cfg->listen && r->wake == WAKE_BUSY))
        r->want_claim = 1;
    lane_ended(l);
}

static char *quote_literal(void *ctx, const char *s, size_t len)
{
    return relay_pgsrc_escape_literal(ctx, s, len);
}

static void log_row_failures(struct lane *l)
{
    const struct relay *r = l->r;
    for (size_t i = 0; i < l->nrows; i++) {
        const struct relay_row *row = &l->rows[i];
        if (row->state != RELAY_ROW_FAILED)
            continue;
        int32_t attempts = row->attempts + 1;
        int topic_len = (int)relay_batch_utf8_prefix(row->topic, row->topic_len, 64);
        if (row->fault == RELAY_FAULT_PERMANENT)
            relay_error(COMPONENT,
                        "row id=%lld message_id=%.*s topic=%.*s quarantined at attempt %d, not "
                        "retried (no retry can publish it as it is): %s; list with 'outbox-relay "
                        "failed list', re-queue with 'outbox-relay failed retry %lld'",
                        (long long)row->id, (int)row->message_id_len, row->message_id, topic_len,
                        row->topic, attempts, row->error, (long long)row->id);
        else if (relay_batch_row_quarantined(row, r->cfg->max_attempts))
            relay_error(COMPONENT,
                        "row id=%lld message_id=%.*s topic=%.*s quarantined after %d attempts: "
                        "%s; list with 'outbox-relay failed list', re-queue with 'outbox-relay "
                        "failed retry %lld'",
                        (long long)row->id, (int)row->message_id_len, row->message_id, topic_len,
                        row->topic, attempts, row->error, (long long)row->id);
        else
            relay_warn(COMPONENT,
                       "row id=%lld message_id=%.*s topic=%.*s not published (attempt %d of %u): "
                       "%s",
                       (long long)row->id, (int)row->message_id_len, row->message_id, topic_len,
                       row->topic, attempts, r->cfg->max_attempts, row->error);
    }
}

/* The next batch in claim order that waits to publish, if any. */
static struct lane *next_claimed(struct relay *r)
{
    struct lane *next = NULL;
    for (size_t i = 0; i < r->nlanes; i++) {
        struct lane *l = &r->lanes[i];
        if (l->state == LANE_CLAIMED && (next == NULL || l->seq < next->seq))
            next = l;
    }
    return next;
}

static void publish_done(struct lane *l)
{
    struct relay *r = l->r;
    ev_timer_stop(r->loop, &r->deadline);
    if (r->stopping)
        return;
    if (r->publishing == l)
        r->publishing = NULL;
    if (l->cycle.failed) {
        batch_failed(l, l->cycle.error);
        return;
    }
    struct relay_sql_quoter q = {quote_literal, relay_pgsrc_freemem, l->pg};
    if (r->cfg->listen && r->wake != WAKE_BUSY) {
        /* From here on this relay claims on its own until a claim comes back
         * empty, so producers may stop notifying. */
        r->wake = WAKE_BUSY;
        take_wakeup_lock(r);
    }
    int quarantined =
        relay_batch_finish_sql(l->rows, l->nrows, r->cfg->max_attempts, &q, &l->sql);
    if (quarantined < 0) {
        batch_failed(l, "cannot build the statement that marks the batch sent");
        return;
    }
    if (relay_pgsrc_send(l->pg, l->sql.data, 0, NULL, 0, on_finished, l) < 0) {
        batch_failed(l, "PostgreSQL connection lost before the batch was marked sent");
        return;
    }
    set_stage(l, LANE_FINISH);
    /* Every reply of this batch is in: the next batch may publish now. */
    struct lane *next = next_claimed(r);
    if (next != NULL)
        start_publish(next);
}

/* ---- publishing ------------------------------------------------------ */

static void on_publish_reply(redisAsyncContext *ac, void *reply_, void *arg)
{
    struct relay *r = relay_sink_owner(ac);
    const redisReply *reply = reply_;

    if (r == NULL || r->stopping || r->publishing == NULL ||
        r->publishing->state != LANE_PUBLISH)
        return;
    struct lane *l = r->publishing;
    enum relay_reply_kind kind = RELAY_REPLY_OTHER;
    const char *str = NULL;
    size_t len = 0;
    if (reply == NULL) {
        kind = RELAY_REPLY_LOST;
        str = ac->errstr;
        len = strlen(ac->errstr);
    } else if (reply->type == REDIS_REPLY_STRING || reply->type == REDIS_REPLY_STATUS) {
        kind = RELAY_REPLY_ENTRY;
    } else if (reply->type == REDIS_REPLY_ERROR) {
        kind = RELAY_REPLY_ERROR;
        str = reply->str;
        len = reply->len;
    }
    if (relay_batch_apply_reply(&l->cycle, arg, kind, str, len))
        publish_done(l);
}

static void on_deadline(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    struct lane *l = r->publishing;
    char why[128];
    snprintf(why, sizeof(why), "no reply to the batch within publish_timeout (%u ms)",
             r->cfg->publish_timeout_ms);
    if (l != NULL && !l->cycle.failed) {
        l->cycle.failed = 1;
        snprintf(l->cycle.error, sizeof(l->cycle.error), "%s", why);
    }
    /* hiredis 0.14 cannot cancel a command: drop the connection, which runs
     * every pending callback with a NULL reply and ends the batch. */
    relay_sink_abort(r->sink, why);
}

static int parse_row(PGresult *res, int i, struct relay_row *row)
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
    row->state = RELAY_ROW_CLAIMED;
    return 0;
}

/* Sends every row of the lane's batch to Redis under one deadline. */
static void start_publish(struct lane *l)
{
    struct relay *r = l->r;
    r->publishing = l;
    set_stage(l, LANE_PUBLISH);
    memset(&l->cycle, 0, sizeof(l->cycle));
    uint64_t not_after = relay_sink_deadline_ms(r->sink, r->cfg->publish_timeout_ms);
    /* Measure Redis's clock again ahead of this batch's publishes, for the
     * next batch's deadline: a clock step on either host costs at most one
     * batch. */
    relay_sink_sync_clock(r->sink);
    for (size_t i = 0; i < l->nrows; i++) {
        struct relay_row *row = &l->rows[i];
        relay_respbuf_reset(&r->out);
        int rc = relay_batch_append_publish(row, r->cfg->stream_prefix, r->cfg->max_payload_bytes,
                                            r->cfg->dedup_ttl_ms, not_after, &r->out, row->error,
                                            sizeof(row->error), &row->fault);
        if (rc == -1) {
            row->state = RELAY_ROW_FAILED;
            continue;
        }
        if (rc != 0 ||
            relay_sink_formatted(r->sink, r->out.data, r->out.len, on_publish_reply, row) < 0) {
            l->cycle.failed = 1;
            snprintf(l->cycle.error, sizeof(l->cycle.error), "Redis connection not ready");
            break;
        }
        row->state = RELAY_ROW_PUBLISHING;
        l->cycle.pending++;
    }
    if (l->cycle.pending == 0) {
        publish_done(l);
        return;
    }
    ev_timer_set(&r->deadline, r->cfg->publish_timeout_ms / 1000.0, 0.0);
    ev_timer_start(r->loop, &r->deadline);
}

/* ---- the wake-up lock -------------------------------------------------- */

static void on_lock_taken(struct relay_pgsrc *pg, PGresult *res, const char *err,
                          const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    (void)sqlstate;
    if (res != NULL)
        PQclear(res);
    if (r->stopping)
        return;
    if (err != NULL) {
        /* Typically lock_timeout: a notifying producer has not committed yet.
         * Producers keep notifying meanwhile, which costs them, not us. */
        r->lock = LOCK_FREE;
        relay_debug(COMPONENT, "wake-up lock not taken (%s); retrying after the next batch", err);
    } else {
        r->lock = LOCK_HELD;
        relay_debug(COMPONENT, "busy: holding the wake-up lock; producers stop notifying");
    }
    if (r->idle_wanted) {
        r->idle_wanted = 0;
        want_cycle(r);
    }
}

/* A busy relay takes the lock so that producers stop notifying. Runs on the
 * LISTEN connection, which has nothing else to do while the relay is busy. */
static void take_wakeup_lock(struct relay *r)
{
    if (!r->cfg->listen || r->listen == NULL || r->lock != LOCK_FREE || r->settling ||
        relay_pgsrc_state(r->listen) != RELAY_PG_READY)
        return;
    if (relay_pgsrc_send(r->listen,
                         "SET lock_timeout = " WAKEUP_LOCK_TIMEOUT_MS ";"
                         " SELECT pg_advisory_lock(" WAKEUP_LOCK ")",
                         0, NULL, 0, on_lock_taken, r) == 0)
        r->lock = LOCK_TAKING;
}

/*
 * Closing the race of the idle declaration (docs/DESIGN.md, "The wake-up
 * protocol"): a producer transaction that checked the lock while it was still
 * held skipped its notification. Every such transaction inserted into
 * outbox.messages before the release, so it holds a RowExclusiveLock on that
 * table from before the release until it ends. The declaration lists those
 * transactions (their virtual transaction ids) right after the release; the
 * relay waits until none of them is still running (bounded by poll_interval,
 * after which the poll covers them), then claims once more before it waits
 * for notifications. Transactions that never wrote the outbox, in this
 * database or another, are not waited for, and claims go on meanwhile.
 */
static void on_settle_checked(struct relay_pgsrc *pg, PGresult *res, const char *err,
                              const char *sqlstate, void *arg);
static void check_lock_holder(struct relay *r);

/* The writers of outbox.messages in this database, other than this session. */
#define OUTBOX_WRITERS                                                                          \
    " FROM pg_locks WHERE locktype = 'relation' AND mode = 'RowExclusiveLock'"                  \
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"          \
    " AND relation = 'outbox.messages'::regclass AND pid <> pg_backend_pid()"

static void settle_ended(struct relay *r)
{
    relay_debug(COMPONENT, "idle: waited %.1f ms for outbox writers that may not have "
                           "notified; claiming once more",
                (mono_now() - r->settle_started) * 1000.0);
    r->settling = 0;
    free(r->settle_writers);
    r->settle_writers = NULL;
    /* The last claim before sleeping: anything those transactions wrote. */
    want_cycle(r);
    check_lock_holder(r);
}

static void settle_check(struct relay *r)
{
    const char *params[1] = {r->settle_writers};
    if (relay_pgsrc_send(r->listen,
                         "SELECT count(*)" OUTBOX_WRITERS " AND virtualtransaction = ANY ($1::text[])",
                         1, params, 0, on_settle_checked, r) < 0)
        settle_ended(r);
}

static void on_settle_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    if (r->settling && !r->stopping)
        settle_check(r);
}

static void on_settle_checked(struct relay_pgsrc *pg, PGresult *res, const char *err,
                              const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    (void)sqlstate;
    long running = err == NULL && res != NULL && PQntuples(res) == 1
                       ? strtol(PQgetvalue(res, 0, 0), NULL, 10)
                       : -1;
    if (res != NULL)
        PQclear(res);
    if (r->stopping)
        return;
    double waited_ms = (mono_now() - r->settle_started) * 1000.0;
    if (running > 0 && waited_ms < r->cfg->poll_interval_ms && !r->draining) {
        /* 1 ms at first (a producer's commit is that close), backing off to
         * 50 ms behind a long transaction. */
        double delay = waited_ms < 10.0 ? 0.001 : waited_ms < 100.0 ? 0.01 : 0.05;
        ev_timer_set(&r->settle_timer, delay, 0.0);
        ev_timer_start(r->loop, &r->settle_timer);
        return;
    }
    settle_ended(r);
}

static void on_idle_declared(struct relay_pgsrc *pg, PGresult *res, const char *err,
                             const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    (void)sqlstate;
    if (r->stopping) {
        if (res != NULL)
            PQclear(res);
        return;
    }
    /* Released or not, the next busy spell takes the lock afresh
     * (pg_advisory_unlock_all also drops a lock taken twice). */
    r->lock = LOCK_FREE;
    if (err != NULL || res == NULL || PQntuples(res) != 1 || PQnfields(res) != 2) {
        if (res != NULL)
            PQclear(res);
        if (err != NULL)
            relay_warn(COMPONENT, "cannot declare the relay idle (%s); the poll keeps it going",
                       err);
        r->settling = 0;
        return;
    }
    long writers = strtol(PQgetvalue(res, 0, 0), NULL, 10);
    free(r->settle_writers);
    r->settle_writers = writers > 0 ? strdup(PQgetvalue(res, 0, 1)) : NULL;
    PQclear(res);
    r->wake = WAKE_IDLE;
    r->settle_started = mono_now();
    if (r->settle_writers == NULL)
        settle_ended(r); /* no writer was open: nobody can have skipped a notification */
    else
        settle_check(r);
}

/* Who else holds the wake-up lock: while someone does, producers skip their
 * notifications and an idle relay hears of new rows only at its poll. A
 * busy relay elsewhere is expected; a stray session is not (a relay host
 * that vanished keeps its session until TCP gives up on it, or anyone with
 * access to pg_advisory_lock). Logged once per holder and exported. */
static void on_lock_holder(struct relay_pgsrc *pg, PGresult *res, const char *err,
                           const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    (void)sqlstate;
    r->holder_check = 0;
    if (r->stopping || err != NULL || res == NULL) {
        if (res != NULL)
            PQclear(res);
        return;
    }
    long pid = PQntuples(res) == 1 ? strtol(PQgetvalue(res, 0, 0), NULL, 10) : 0;
    if (pid != 0 && pid != r->foreign_pid) {
        snprintf(r->foreign_app, sizeof(r->foreign_app), "%s", PQgetvalue(res, 0, 1));
        snprintf(r->foreign_addr, sizeof(r->foreign_addr), "%s", PQgetvalue(res, 0, 2));
        char app[RELAY_ESCAPED_SIZE(sizeof(r->foreign_app))];
        relay_tools_escape(app, sizeof(app), r->foreign_app, strlen(r->foreign_app), 0, 0);
        relay_warn(COMPONENT,
                   "producers skip their notifications: the wake-up lock " WAKEUP_LOCK
                   " is held by pid %ld (application_name \"%s\", client %s); if that is "
                   "not a busy outbox-relay, end it with SELECT pg_terminate_backend(%ld); "
                   "meanwhile new rows wait for the poll (%u ms)",
                   pid, app, r->foreign_addr, pid, r->cfg->poll_interval_ms);
    } else if (pid == 0 && r->foreign_pid != 0) {
        relay_info(COMPONENT, "the wake-up lock is no longer held by pid %ld; producers notify "
                              "again",
                   r->foreign_pid);
    }
    r->foreign_pid = pid;
    PQclear(res);
}

static void check_lock_holder(struct relay *r)
{
    if (!r->cfg->listen || r->listen == NULL || r->wake != WAKE_IDLE || r->settling ||
        r->holder_check || relay_pgsrc_state(r->listen) != RELAY_PG_READY)
        return;
    /* pg_advisory_lock(bigint) keeps the key's high half in classid and its
     * low half in objid, with objsubid 1. client_addr is NULL unless the
     * relay's role may read other sessions' details (pg_read_all_stats). */
    if (relay_pgsrc_send(r->listen,
                         "SELECT l.pid, coalesce(a.application_name, ''),"
                         " coalesce(host(a.client_addr), CASE WHEN a.pid IS NULL THEN 'unknown'"
                         " WHEN a.client_port = -1 THEN 'local socket'"
                         " ELSE 'not visible (grant pg_read_all_stats)' END)"
                         " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
                         " WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock'"
                         " AND l.database = (SELECT oid FROM pg_database"
                         "  WHERE datname = current_database())"
                         " AND l.classid = (" WAKEUP_LOCK "::bigint >> 32)::oid"
                         " AND l.objid = (" WAKEUP_LOCK "::bigint & 4294967295)::oid"
                         " AND l.objsubid = 1 AND l.pid <> pg_backend_pid()"
                         " ORDER BY l.pid LIMIT 1",
                         0, NULL, 0, on_lock_holder, r) == 0)
        r->holder_check = 1;
}

/* Nothing pending and nothing in flight: release the lock, so producers
 * notify again, and take a transaction id to mark that moment.
 * 0 when it cannot be done now: the relay stays busy and claims again when
 * the lock request ends, the LISTEN connection is back, or the poll fires. */
static int declare_idle(struct relay *r)
{
    if (r->lock == LOCK_TAKING) {
        /* Producers already skip their notifications: keep claiming on a
         * short timer until the lock request ends, then declare. */
        r->idle_wanted = 1;
        r->want_claim = 1;
        if (!ev_is_active(&r->kick)) {
            ev_timer_set(&r->kick, 0.002, 0.0);
            ev_timer_start(r->loop, &r->kick);
        }
        return 0;
    }
    if (r->listen == NULL || relay_pgsrc_state(r->listen) != RELAY_PG_READY)
        return 0;
    if (relay_pgsrc_send(r->listen,
                         "SELECT pg_advisory_unlock_all();"
                         " SELECT count(*), coalesce(array_agg(virtualtransaction), '{}')::text"
                         OUTBOX_WRITERS,
                         0, NULL, 0, on_idle_declared, r) < 0)
        return 0;
    r->settling = 1;
    return 1;
}

static void on_claimed(struct relay_pgsrc *pg, PGresult *res, const char *err,
                       const char *sqlstate, void *arg)
{
    struct lane *l = arg;
    struct relay *r = l->r;
    (void)pg;
    (void)sqlstate;
    if (r->stopping) {
        if (res != NULL)
            PQclear(res);
        return;
    }
    if (err != NULL || res == NULL || PQnfields(res) != 11) {
        if (res != NULL)
            PQclear(res);
        char why[600];
        snprintf(why, sizeof(why), "claim failed: %s", err ? err : "unexpected result shape");
        batch_failed(l, why);
        return;
    }
    l->claim_res = res;
    if (l->abandon) {
        roll_back(l);
        return;
    }
    int n = PQntuples(res);
    l->nrows = 0;
    for (int i = 0; i < n && (size_t)i < r->cfg->batch_size; i++) {
        if (parse_row(res, i, &l->rows[l->nrows]) < 0) {
            batch_failed(l, "claim returned a malformed row");
            return;
        }
        l->nrows++;
    }
    if (l->nrows == 0) {
        if (r->cfg->listen && r->wake == WAKE_BUSY && !r->settling) {
            /* (While settling, the settle's end claims once more.) */
            if (all_lanes_idle_but(r, l))
                (void)declare_idle(r);
            else
                /* The other lane is still ending its batch (or its own empty
                 * claim): claim again once this lane is free, so the relay
                 * either finds rows or declares itself idle. A busy relay
                 * gets no notifications, so it must never just stop. */
                r->want_claim = 1;
        }
        /* Nothing pending: end the (empty) transaction. */
        if (relay_pgsrc_send(l->pg, "COMMIT", 0, NULL, 0, on_rolled_back, l) == 0)
            set_stage(l, LANE_ROLLBACK);
        else
            lane_ended(l);
        return;
    }
    /* A full batch: more is likely waiting, so the other lane claims it while
     * this one publishes. */
    if (l->nrows == r->cfg->batch_size && r->nlanes > 1)
        r->want_claim = 1;
    if (r->publishing == NULL)
        start_publish(l);
    else
        set_stage(l, LANE_CLAIMED);
    maybe_claim(r);
}

static void on_begun(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                     void *arg)
{
    struct lane *l = arg;
    struct relay *r = l->r;
    (void)sqlstate;
    if (res != NULL)
        PQclear(res);
    if (r->stopping)
        return;
    if (err != NULL) {
        char why[600];
        snprintf(why, sizeof(why), "BEGIN failed: %s", err);
        batch_failed(l, why);
        return;
    }
    if (l->abandon) {
        roll_back(l);
        return;
    }
    char limit[16];
    snprintf(limit, sizeof(limit), "%u", r->cfg->batch_size);
    const char *params[2] = {limit, r->paused_param};
    /* With nothing paused, the plain walk in id order (the hot path). */
    const char *claim = r->npaused > 0 ? "claim_paused" : "claim";
    if (relay_pgsrc_send_prepared(pg, claim, 2, params, 1, on_claimed, l) < 0) {
        batch_failed(l, "PostgreSQL connection lost before the claim");
        return;
    }
    set_stage(l, LANE_CLAIM);
}

static void maybe_claim(struct relay *r)
{
    if (r->in_backoff || r->draining || r->stopping || !r->want_claim)
        return;
    if (!relay_sink_ready(r->sink))
        return; /* the ready hook calls back here */
    struct lane *l = free_lane(r);
    if (l == NULL)
        return; /* a lane's end or ready hook calls back here */
    r->want_claim = 0;
    l->claimed_at = mono_now();
    l->seq = ++r->next_seq;
    l->abandon = 0;
    if (relay_pgsrc_send(l->pg, "BEGIN", 0, NULL, 0, on_begun, l) < 0) {
        r->want_claim = 1;
        return;
    }
    set_stage(l, LANE_BEGIN);
}

/* ---- triggers -------------------------------------------------------- */

static void on_kick(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    maybe_claim(w->data);
}

static void on_poll(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    want_cycle(w->data);
    check_lock_holder(w->data);
}

static void on_retry(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    r->in_backoff = 0;
    want_cycle(r);
}

static void pg_ready(struct relay_pgsrc *pg, void *arg)
{
    struct relay *r = arg;
    /* Catch up: notifications sent while we were away are lost. A claiming
     * connection starts busy: it declares itself idle after the catch-up. */
    if (pg != r->listen)
        r->wake = WAKE_BUSY;
    want_cycle(r);
}

/* A claiming connection broke. A lane with a command in flight hears of it
 * from that command; a lane between commands holds a batch whose locks the
 * server has just released, so the batch is void. */
static void pg_down(struct relay_pgsrc *pg, void *arg)
{
    struct relay *r = arg;
    for (size_t i = 0; i < r->nlanes; i++) {
        struct lane *l = &r->lanes[i];
        if (l->pg != pg || r->stopping)
            continue;
        if (l->state == LANE_CLAIMED) {
            batch_failed(l, "PostgreSQL connection lost while the batch waited to publish");
        } else if (l->state == LANE_PUBLISH && !l->cycle.failed) {
            l->cycle.failed = 1;
            snprintf(l->cycle.error, sizeof(l->cycle.error),
                     "PostgreSQL connection lost while the batch was published");
        }
    }
}

/* The LISTEN connection broke: the server released the wake-up lock with it,
 * and any settle wait or holder check on it is void. */
static void listen_down(struct relay_pgsrc *pg, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    if (r->lock == LOCK_HELD)
        r->lock = LOCK_FREE;
    r->holder_check = 0;
}

static void pg_notify(struct relay_pgsrc *pg, void *arg)
{
    (void)pg;
    want_cycle(arg);
}

static void sink_ready(struct relay_sink *s, void *arg)
{
    (void)s;
    want_cycle(arg);
}

/* ---- observation and backpressure ------------------------------------ */

/* The observation thread: blocking reads with deadlines, off the loop. */
static void *observe_main(void *arg)
{
    struct relay *r = arg;
    struct relay_observation *o = malloc(sizeof(*o));
    PGconn *pg = NULL;
    redisContext *rd = NULL;
    if (o == NULL)
        return NULL;
    pthread_mutex_lock(&r->obs_lock);
    while (!r->obs_stop) {
        pthread_mutex_unlock(&r->obs_lock);
        relay_observe(r->cfg, &pg, &rd, 1, r->obs_interrupt, o);
        pthread_mutex_lock(&r->obs_lock);
        memcpy(r->obs_new, o, sizeof(*o));
        r->obs_fresh = 1;
        ev_async_send(r->loop, &r->obs_async);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        uint64_t ns = (uint64_t)until.tv_nsec + (uint64_t)r->cfg->observe_interval_ms * 1000000u;
        until.tv_sec += (time_t)(ns / 1000000000u);
        until.tv_nsec = (long)(ns % 1000000000u);
        while (!r->obs_stop && pthread_cond_timedwait(&r->obs_cond, &r->obs_lock, &until) == 0)
            ;
    }
    pthread_mutex_unlock(&r->obs_lock);
    PQfinish(pg);
    if (rd != NULL)
        redisFree(rd);
    free(o);
    return NULL;
}

/*
 * Writes the text[] literal of items, each element double-quoted with its
 * backslashes and quotes escaped, so that no name can break out of its
 * element: the value goes to the claim as a parameter, never into the SQL.
 * 0, or -1 when out is too small.
 */
static int pg_text_array(char *out, size_t outlen, char (*items)[RELAY_TOPIC_MAX + 1],
                         size_t n)
{
    size_t len = 0;
    if (outlen < 3)
        return -1;
    out[len++] = '{';
    for (size_t i = 0; i < n; i++) {
        if (i && len < outlen)
            out[len++] = ',';
        if (len < outlen)
            out[len++] = '"';
        for (const char *c = items[i]; *c != '\0' && len < outlen; c++) {
            if ((*c == '"' || *c == '\\') && len + 1 < outlen)
                out[len++] = '\\';
            out[len++] = *c;
        }
        if (len < outlen)
            out[len++] = '"';
    }
    if (len + 2 > outlen)
        return -1;
    out[len++] = '}';
    out[len] = '\0';
    return 0;
}

/* Stream-side age of a group: what waits in Redis, not in the outbox (a paused
 * stream's outbox wait must not keep it paused). */
static double stream_age(const struct relay_group_obs *g)
{
    return g->oldest_pending_age > g->oldest_undelivered_age ? g->oldest_pending_age
                                                              : g->oldest_undelivered_age;
}

static int topic_paused(const struct relay *r, const char *topic)
{
    for (size_t i = 0; i < r->npaused; i++)
        if (strcmp(r->paused_topics[i], topic) == 0)
            return 1;
    return 0;
}

/* Pauses a stream when a group lags beyond a high-water mark and resumes it
 * when every group is back below the low-water mark; the claim skips the
 * paused topics, whose rows wait safely in the outbox. */
static void apply_backpressure(struct relay *r)
{
    const struct relay_config *cfg = r->cfg;
    const struct relay_observation *o = r->obs;
    char next[RELAY_OBS_TOPICS_MAX][RELAY_TOPIC_MAX + 1];
    size_t nnext = 0;
    int resumed = 0;
    if (!o->redis_ok || (cfg->pause_lag_entries == 0 && cfg->pause_queue_age_ms == 0))
        goto apply;
    for (size_t t = 0; t < o->ntopics; t++) {
        const char *topic = o->topics[t].topic;
        int was = topic_paused(r, topic), over = 0, under = 1;
        for (size_t g = 0; g < o->ngroups; g++) {
            const struct relay_group_obs *go = &o->groups[g];
            if (go->topic != (int)t)
                continue;
            double age_ms = stream_age(go) * 1000.0;
            if (cfg->pause_lag_entries && go->lag >= (long long)cfg->pause_lag_entries)
                over = 1;
            if (cfg->pause_queue_age_ms && age_ms >= cfg->pause_queue_age_ms)
                over = 1;
            if ((cfg->pause_lag_entries && go->lag > (long long)cfg->resume_lag_entries) ||
                (cfg->pause_queue_age_ms && age_ms > cfg->resume_queue_age_ms))
                under = 0;
        }
        int paused = was ? !under : over;
        if (paused != was)
            relay_log(paused ? RELAY_LOG_WARNING : RELAY_LOG_INFO, COMPONENT,
                      "stream %s %s (backpressure: consumer groups %s)", o->topics[t].stream,
                      paused ? "paused" : "resumed",
                      paused ? "lag beyond the high-water mark; its rows wait in the outbox"
                             : "caught up below the low-water mark");
        if (paused && nnext < RELAY_OBS_TOPICS_MAX)
            snprintf(next[nnext++], sizeof(next[0]), "%s", topic);
        if (was && !paused)
            resumed = 1;
    }
apply:
    if (r->npaused > nnext)
        resumed = 1; /* also when Redis went away or backpressure was switched off */
    r->npaused = nnext;
    for (size_t i = 0; i < nnext; i++)
        memcpy(r->paused_topics[i], next[i], sizeof(next[i]));
    if (pg_text_array(r->paused_param, sizeof(r->paused_param), next, nnext) < 0) {
        /* Cannot happen with the sizes above; claim everything rather than
         * send a literal that would fail every claim. */
        r->npaused = 0;
        snprintf(r->paused_param, sizeof(r->paused_param), "{}");
    }
    /* The rows of a resumed stream wait in the outbox and nothing will
     * notify for them: claim now rather than at the next poll. */
    if (resumed)
        want_cycle(r);
}

static void on_observation(struct ev_loop *loop, ev_async *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    pthread_mutex_lock(&r->obs_lock);
    int fresh = r->obs_fresh;
    if (fresh)
        memcpy(r->obs, r->obs_new, sizeof(*r->obs));
    r->obs_fresh = 0;
    pthread_mutex_unlock(&r->obs_lock);
    if (fresh)
        apply_backpressure(r);
}

/* No lane is stuck: each stage of a batch (claim and wait for the batch
 * ahead; publish and mark) ends within its deadlines. */
static int healthy(struct relay *r)
{
    double limit = (r->cfg->publish_timeout_ms + 2.0 * r->cfg->statement_timeout_ms +
                    r->cfg->connect_timeout_ms) /
                   1000.0;
    for (size_t i = 0; i < r->nlanes; i++) {
        const struct lane *l = &r->lanes[i];
        if (l->state == LANE_IDLE)
            continue;
        /* Claiming and waiting for the batch ahead count from the claim;
         * publishing, marking and rolling back from their own start. */
        int claiming = l->state == LANE_BEGIN || l->state == LANE_CLAIM ||
                       l->state == LANE_CLAIMED;
        ev_tstamp since = claiming ? l->claimed_at : l->stage_at;
        if (mono_now() - since >= limit)
            return 0;
    }
    return 1;
}

/* 1 when every claiming connection is connected. */
static int postgres_up(const struct relay *r)
{
    for (size_t i = 0; i < r->nlanes; i++) {
        enum relay_pgsrc_state st = relay_pgsrc_state(r->lanes[i].pg);
        if (st != RELAY_PG_READY && st != RELAY_PG_BUSY)
            return 0;
    }
    return 1;
}

static int relay_is_ready(void *arg, char *why, size_t whylen)
{
    struct relay *r = arg;
    if (!postgres_up(r)) {
        snprintf(why, whylen, "PostgreSQL not connected");
        return 0;
    }
    if (!relay_sink_ready(r->sink)) {
        snprintf(why, whylen, "Redis not connected");
        return 0;
    }
    if (!healthy(r)) {
        snprintf(why, whylen, "a claim cycle is stalled");
        return 0;
    }
    if (r->failures_in_row >= FAILURES_NOT_READY) {
        snprintf(why, whylen, "batches keep failing (%u in a row): %s", r->failures_in_row,
                 r->last_batch_error);
        return 0;
    }
    return 1;
}

static void metric_help(struct relay_text *t, const char *name, const char *type,
                        const char *help)
{
    relay_text_printf(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static long render_metrics(void *arg, char **out)
{
    struct relay *r = arg;
    const struct relay_observation *o = r->obs;
    struct relay_text t = {NULL, 0, 0, 0};
    char why[128];
    int pqv = PQlibVersion();

    metric_help(&t, "outbox_relay_build_info", "gauge", "Version of the relay and its libraries.");
    relay_text_printf(&t,
                      "outbox_relay_build_info{version=\"%s\",libpq=\"%d.%d\",hiredis=\"%d.%d.%d\"} 1\n",
                      RELAY_VERSION, pqv / 10000, pqv % 10000, HIREDIS_MAJOR, HIREDIS_MINOR,
                      HIREDIS_PATCH);
    metric_help(&t, "outbox_relay_up", "gauge", "Connection state of each server (1 connected).");
    relay_text_printf(&t, "outbox_relay_up{server=\"postgres\"} %d\n",
                      postgres_up(r));
    relay_text_printf(&t, "outbox_relay_up{server=\"redis\"} %d\n", relay_sink_ready(r->sink));
    metric_help(&t, "outbox_relay_ready", "gauge",
                "1 when connected to both servers and not stalled.");
    relay_text_printf(&t, "outbox_relay_ready %d\n", relay_is_ready(r, why, sizeof(why)));

    metric_help(&t, "outbox_relay_messages_published_total", "counter",
                "Messages published to their stream, per topic.");
    for (size_t i = 0; i < r->ntopic_counts; i++) {
        relay_text_printf(&t, "outbox_relay_messages_published_total{topic=\"");
        relay_text_label(&t, r->topic_counts[i].topic);
        relay_text_printf(&t, "\"} %llu\n", r->topic_counts[i].published);
    }
    if (r->other_published)
        relay_text_printf(&t, "outbox_relay_messages_published_total{topic=\"_other\"} %llu\n",
                          r->other_published);
    metric_help(&t, "outbox_relay_batches_total", "counter", "Claim cycles committed.");
    relay_text_printf(&t, "outbox_relay_batches_total %llu\n", r->batches_total);
    metric_help(&t, "outbox_relay_batch_duration_seconds", "histogram",
                "Time from claim to commit of a batch.");
    unsigned long long cum = 0;
    for (size_t b = 0; b < RELAY_ARRAY_LEN(batch_buckets); b++) {
        cum += r->batch_hist[b];
        relay_text_printf(&t, "outbox_relay_batch_duration_seconds_bucket{le=\"%g\"} %llu\n",
                          batch_buckets[b], cum);
    }
    cum += r->batch_hist[RELAY_ARRAY_LEN(batch_buckets)];
    relay_text_printf(&t, "outbox_relay_batch_duration_seconds_bucket{le=\"+Inf\"} %llu\n", cum);
    relay_text_printf(&t, "outbox_relay_batch_duration_seconds_sum %.6f\n", r->batch_sum);
    relay_text_printf(&t, "outbox_relay_batch_duration_seconds_count %llu\n", cum);
    metric_help(&t, "outbox_relay_publish_errors_total", "counter",
                "Failed batches by kind, and rows that failed for reasons of their own (row).");
    for (size_t k = 0; k < RELAY_ARRAY_LEN(error_kinds); k++)
        relay_text_printf(&t, "outbox_relay_publish_errors_total{kind=\"%s\"} %llu\n",
                          error_kinds[k], r->errors[k]);
    metric_help(&t, "outbox_relay_wakeup_lock_foreign_holder", "gauge",
                "1 for the session other than this relay that holds the wake-up lock while "
                "this relay is idle: producers skip their notifications meanwhile.");
    if (r->foreign_pid != 0) {
        relay_text_printf(&t, "outbox_relay_wakeup_lock_foreign_holder{pid=\"%ld\","
                              "application_name=\"",
                          r->foreign_pid);
        relay_text_label(&t, r->foreign_app);
        relay_text_printf(&t, "\",client_addr=\"");
        relay_text_label(&t, r->foreign_addr);
        relay_text_printf(&t, "\"} 1\n");
    }
    metric_help(&t, "outbox_relay_batch_failures_in_row", "gauge",
                "Whole-batch failures since the last committed batch (3 or more: not ready).");
    relay_text_printf(&t, "outbox_relay_batch_failures_in_row %u\n", r->failures_in_row);
    metric_help(&t, "outbox_relay_rows_quarantined_total", "counter",
                "Rows this relay quarantined: at once for a permanent failure, after max_attempts for a transient one.");
    relay_text_printf(&t, "outbox_relay_rows_quarantined_total %llu\n", r->quarantined_total);

    if (o->taken_at > 0) {
        metric_help(&t, "outbox_relay_observation_age_seconds", "gauge",
                    "Age of the observation behind the gauges below.");
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        relay_text_printf(&t, "outbox_relay_observation_age_seconds %.3f\n",
                          (double)now.tv_sec + now.tv_nsec / 1e9 - o->taken_at);
    }
    if (o->pg_ok) {
        metric_help(&t, "outbox_relay_outbox_pending_rows", "gauge",
                    "Rows waiting in the outbox (an estimate from the span of pending ids).");
        relay_text_printf(&t, "outbox_relay_outbox_pending_rows %lld\n", o->outbox_pending);
        metric_help(&t, "outbox_relay_outbox_oldest_pending_age_seconds", "gauge",
                    "Age of the oldest row waiting in the outbox (0 when none).");
        relay_text_printf(&t, "outbox_relay_outbox_oldest_pending_age_seconds %.3f\n",
                          o->outbox_oldest_age < 0 ? 0 : o->outbox_oldest_age);
        metric_help(&t, "outbox_relay_outbox_quarantined_rows", "gauge",
                    "Quarantined rows waiting for an operator.");
        relay_text_printf(&t, "outbox_relay_outbox_quarantined_rows %lld\n", o->quarantined);
        metric_help(&t, "outbox_relay_topic_admitting", "gauge",
                    "1 when producers of the topic are admitted, 0 when refused (backpressure).");
        for (size_t i = 0; i < o->ntopics; i++) {
            if (o->topics[i].admitting < 0)
                continue;
            relay_text_printf(&t, "outbox_relay_topic_admitting{topic=\"");
            relay_text_label(&t, o->topics[i].topic);
            relay_text_printf(&t, "\"} %d\n", o->topics[i].admitting);
        }
    }
    metric_help(&t, "outbox_relay_stream_paused", "gauge",
                "1 while the relay holds a stream back for its lagging consumer groups.");
    for (size_t i = 0; i < o->ntopics; i++) {
        relay_text_printf(&t, "outbox_relay_stream_paused{stream=\"");
        relay_text_label(&t, o->topics[i].stream);
        relay_text_printf(&t, "\"} %d\n", topic_paused(r, o->topics[i].topic));
    }
    if (o->redis_ok) {
        static const char *const names[6][2] = {
            {"outbox_relay_group_lag_entries", "Entries not yet delivered to the group."},
            {"outbox_relay_group_pending_entries", "Entries delivered, not acknowledged."},
            {"outbox_relay_group_oldest_pending_age_seconds",
             "Age of the oldest delivered, unacknowledged entry (0 when none)."},
            {"outbox_relay_group_oldest_undelivered_age_seconds",
             "Age of the oldest entry not yet delivered (0 when none)."},
            {"outbox_relay_group_queue_age_seconds",
             "Age of the oldest message the group has not acknowledged, from its outbox row."},
            {"outbox_relay_group_dead_letters", "Entries in the group's dead-letter stream."},
        };
        for (int m = 0; m < 6; m++) {
            metric_help(&t, names[m][0], "gauge", names[m][1]);
            for (size_t i = 0; i < o->ngroups; i++) {
                const struct relay_group_obs *g = &o->groups[i];
                double v = m == 0 ? (double)g->lag
                         : m == 1 ? (double)g->pending
                         : m == 2 ? g->oldest_pending_age
                         : m == 3 ? g->oldest_undelivered_age
                         : m == 4 ? g->queue_age
                                  : (double)g->dead_letters;
                if (m == 0 && g->lag < 0)
                    continue; /* Redis cannot tell: no sample rather than a wrong one */
                relay_text_printf(&t, "%s{stream=\"", names[m][0]);
                relay_text_label(&t, g->stream);
                relay_text_printf(&t, "\",group=\"");
                relay_text_label(&t, g->group);
                relay_text_printf(&t, "\"} %.3f\n", v < 0 ? 0 : v);
            }
        }
    }
    if (t.failed) {
        free(t.data);
        return -1;
    }
    *out = t.data;
    return (long)t.len;
}

/* ---- supervision ---------------------------------------------------- */

/* The loop is healthy when it runs (this timer fires) and no cycle is stuck
 * beyond every deadline that should have ended it. */

static void on_watchdog(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    if (healthy(r))
        relay_sd_notify("WATCHDOG=1");
    else
        relay_warn(COMPONENT, "a claim cycle is stuck past every deadline; not feeding the "
                              "systemd watchdog");
}

static void on_status(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    char text[256];
    (void)loop;
    (void)revents;
    snprintf(text, sizeof(text), "STATUS=%llu published, %llu quarantined; PostgreSQL %s, Redis %s%s",
             r->published_total, r->quarantined_total,
             postgres_up(r) ? "up" : "down",
             relay_sink_ready(r->sink) ? "up" : "down", r->in_backoff ? "; retrying a batch" : "");
    if (strcmp(text, r->status_text) == 0)
        return;
    snprintf(r->status_text, sizeof(r->status_text), "%s", text);
    relay_sd_notify(text);
}

/* Starts the watchdog timer when systemd asked for one (sd_watchdog_enabled). */
static void start_watchdog(struct relay *r)
{
    const char *usec = getenv("WATCHDOG_USEC");
    const char *pid = getenv("WATCHDOG_PID");
    if (usec == NULL || usec[0] == '\0')
        return;
    if (pid != NULL && pid[0] != '\0' && strtol(pid, NULL, 10) != (long)getpid())
        return;
    char *end;
    unsigned long long us = strtoull(usec, &end, 10);
    if (*end != '\0' || us == 0)
        return;
    double every = us / 2e6;
    ev_timer_init(&r->watchdog, on_watchdog, every, every);
    r->watchdog.data = r;
    ev_timer_start(r->loop, &r->watchdog);
    relay_info(COMPONENT, "systemd watchdog: feeding it every %.3f s while healthy", every);
}

/* ---- signals --------------------------------------------------------- */

static void on_drain_deadline(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)revents;
    (void)w;
    relay_warn(COMPONENT, "drain_timeout reached with a batch in flight; exiting (the batch is "
                          "rolled back and will be published by the next run)");
    ev_break(loop, EVBREAK_ALL);
}

static void on_term(struct ev_loop *loop, ev_signal *w, int revents)
{
    struct relay *r = w->data;
    (void)revents;
    if (r->draining) {
        relay_warn(COMPONENT, "second signal: exiting now (the batch in flight is rolled back)");
        ev_break(loop, EVBREAK_ALL);
        return;
    }
    r->draining = 1;
    relay_sd_notify("STOPPING=1");
    ev_timer_stop(loop, &r->poll_timer);
    ev_timer_stop(loop, &r->kick);
    ev_timer_stop(loop, &r->retry_timer);
    if (drained(r)) {
        relay_info(COMPONENT, "signal %d: shutting down", w->signum);
        ev_break(loop, EVBREAK_ALL);
        return;
    }
    relay_info(COMPONENT, "signal %d: finishing the batch in flight (at most %u ms)", w->signum,
               r->cfg->drain_timeout_ms);
    ev_timer_set(&r->drain_timer, r->cfg->drain_timeout_ms / 1000.0, 0.0);
    ev_timer_start(loop, &r->drain_timer);
}

static void on_hup(struct ev_loop *loop, ev_signal *w, int revents)
{
    struct relay *r = w->data;
    struct relay_config fresh;
    char err[RELAY_CONFIG_ERR_MAX];
    (void)loop;
    (void)revents;

    /* RELOADING=1 must carry the monotonic time of the reload (systemd 253+). */
    struct timespec now;
    char reloading[64];
    clock_gettime(CLOCK_MONOTONIC, &now);
    snprintf(reloading, sizeof(reloading), "RELOADING=1\nMONOTONIC_USEC=%llu",
             (unsigned long long)now.tv_sec * 1000000ull + (unsigned long long)now.tv_nsec / 1000);
    relay_sd_notify(reloading);
    relay_config_init(&fresh);
    if (relay_config_load(&fresh, r->reload.config_path, environ, r->reload.argc, r->reload.argv,
                          err, sizeof(err)) < 0) {
        relay_error("config", "reload failed, keeping the running configuration: %s", err);
    } else {
        char changed[512];
        r->cfg->log_level = fresh.log_level;
        relay_log_set_level((enum relay_log_level)fresh.log_level);
        if (relay_config_diff_restart(r->cfg, &fresh, changed, sizeof(changed)) > 0)
            relay_warn("config", "reloaded log_level; changed keys that need a restart: %s",
                       changed);
        else
            relay_info("config", "reloaded: log_level applied");
    }
    relay_config_free(&fresh);
    relay_sd_notify("READY=1");
}

/* ---- life cycle ------------------------------------------------------ */

struct relay *relay_new(struct ev_loop *loop, struct relay_config *cfg,
                        const struct relay_reload_source *reload)
{
    struct relay *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return NULL;
    r->loop = loop;
    r->cfg = cfg;
    if (reload != NULL)
        r->reload = *reload;
    r->nlanes = cfg->pipeline ? 2 : 1;
    for (size_t i = 0; i < r->nlanes; i++) {
        r->lanes[i].r = r;
        r->lanes[i].rows = calloc(cfg->batch_size, sizeof(*r->lanes[i].rows));
        if (r->lanes[i].rows == NULL) {
            relay_free(r);
            return NULL;
        }
    }
    relay_backoff_init(&r->batch_backoff, cfg->reconnect_min_ms, cfg->reconnect_max_ms);

    ev_init(&r->kick, on_kick);
    r->kick.data = r;
    ev_init(&r->retry_timer, on_retry);
    r->retry_timer.data = r;
    ev_init(&r->deadline, on_deadline);
    r->deadline.data = r;
    ev_init(&r->drain_timer, on_drain_deadline);
    ev_init(&r->settle_timer, on_settle_timer);
    r->settle_timer.data = r;
    r->drain_timer.data = r;
    double poll = cfg->poll_interval_ms / 1000.0;
    ev_timer_init(&r->poll_timer, on_poll, poll, poll);
    r->poll_timer.data = r;
    ev_timer_start(loop, &r->poll_timer);

    ev_signal_init(&r->sigterm, on_term, SIGTERM);
    r->sigterm.data = r;
    ev_signal_init(&r->sigint, on_term, SIGINT);
    r->sigint.data = r;
    ev_signal_init(&r->sighup, on_hup, SIGHUP);
    r->sighup.data = r;
    ev_signal_start(loop, &r->sigterm);
    ev_signal_start(loop, &r->sigint);
    ev_signal_start(loop, &r->sighup);

    struct relay_pgsrc_hooks claim_hooks = {.arg = r, .on_ready = pg_ready, .on_down = pg_down};
    int lanes_ok = 1;
    for (size_t i = 0; i < r->nlanes; i++) {
        r->lanes[i].pg = relay_pgsrc_new(loop, cfg, RELAY_PGSRC_CLAIM, &claim_hooks);
        if (r->lanes[i].pg == NULL)
            lanes_ok = 0;
    }
    if (cfg->listen) {
        struct relay_pgsrc_hooks listen_hooks = {.arg = r, .on_ready = pg_ready,
                                                 .on_down = listen_down, .on_notify = pg_notify};
        r->listen = relay_pgsrc_new(loop, cfg, RELAY_PGSRC_LISTEN, &listen_hooks);
    }
    struct relay_sink_hooks sink_hooks = {.arg = r, .on_ready = sink_ready};
    r->sink = relay_sink_new(loop, cfg, &sink_hooks);
    if (!lanes_ok || (cfg->listen && r->listen == NULL) || r->sink == NULL) {
        relay_free(r);
        return NULL;
    }
    r->want_claim = 1;
    snprintf(r->paused_param, sizeof(r->paused_param), "{}");

    r->obs = calloc(1, sizeof(*r->obs));
    r->obs_new = calloc(1, sizeof(*r->obs_new));
    if (r->obs == NULL || r->obs_new == NULL) {
        relay_free(r);
        return NULL;
    }
    pthread_mutex_init(&r->obs_lock, NULL);
    pthread_cond_init(&r->obs_cond, NULL);
    ev_async_init(&r->obs_async, on_observation);
    r->obs_async.data = r;
    ev_async_start(loop, &r->obs_async);
    r->obs_interrupt = relay_observe_stop_new(); /* NULL: waits end at their deadlines */
    if (pthread_create(&r->obs_thread, NULL, observe_main, r) == 0)
        r->obs_started = 1;
    else
        relay_warn(COMPONENT, "cannot start the observation thread: no queue age, lag or "
                              "backpressure");
    if (cfg->metrics_listen != NULL && cfg->metrics_listen[0] != '\0') {
        char err[300];
        struct relay_metrics_hooks mh = {r, render_metrics, relay_is_ready};
        r->metrics = relay_metrics_new(loop, cfg->metrics_listen, &mh, err, sizeof(err));
        if (r->metrics == NULL)
            relay_warn("metrics", "%s", err);
    }
    return r;
}

int relay_run(struct relay *r)
{
    unsigned backend = ev_backend(r->loop);
    int pqv = PQlibVersion();
    relay_info(COMPONENT,
               "outbox-relay %s running (libpq %d.%d, hiredis %d.%d.%d, libev %d.%d %s): "
               "batch_size=%u poll_interval=%u ms listen=%s pipeline=%s",
               RELAY_VERSION, pqv / 10000, pqv % 10000, HIREDIS_MAJOR, HIREDIS_MINOR,
               HIREDIS_PATCH, ev_version_major(), ev_version_minor(),
               backend == EVBACKEND_EPOLL ? "epoll" : backend == EVBACKEND_POLL ? "poll"
                                                      : backend == EVBACKEND_SELECT ? "select"
                                                                                    : "other",
               r->cfg->batch_size, r->cfg->poll_interval_ms, r->cfg->listen ? "on" : "off",
               r->nlanes > 1 ? "on" : "off");
    start_watchdog(r);
    ev_timer_init(&r->status, on_status, 0.0, 2.0);
    r->status.data = r;
    ev_timer_start(r->loop, &r->status);
    relay_sd_notify("READY=1");
    ev_run(r->loop, 0);
    r->stopping = 1;
    relay_info(COMPONENT, "stopped: %llu messages published, %llu rows quarantined",
               r->published_total, r->quarantined_total);
    return 0;
}

void relay_free(struct relay *r)
{
    if (r == NULL)
        return;
    r->stopping = 1;
    if (r->loop != NULL) {
        ev_timer_stop(r->loop, &r->poll_timer);
        ev_timer_stop(r->loop, &r->kick);
        ev_timer_stop(r->loop, &r->retry_timer);
        ev_timer_stop(r->loop, &r->deadline);
        ev_timer_stop(r->loop, &r->drain_timer);
        ev_timer_stop(r->loop, &r->watchdog);
        ev_timer_stop(r->loop, &r->settle_timer);
        ev_timer_stop(r->loop, &r->status);
        ev_signal_stop(r->loop, &r->sigterm);
        ev_signal_stop(r->loop, &r->sigint);
        ev_signal_stop(r->loop, &r->sighup);
    }
    if (r->obs_started) {
        pthread_mutex_lock(&r->obs_lock);
        r->obs_stop = 1;
        pthread_cond_signal(&r->obs_cond);
        pthread_mutex_unlock(&r->obs_lock);
        relay_observe_stop_trigger(r->obs_interrupt); /* a server may not be answering */
        pthread_join(r->obs_thread, NULL);
        pthread_mutex_destroy(&r->obs_lock);
        pthread_cond_destroy(&r->obs_cond);
    }
    if (r->loop != NULL)
        ev_async_stop(r->loop, &r->obs_async);
    relay_metrics_free(r->metrics);
    relay_observe_stop_free(r->obs_interrupt);
    free(r->obs);
    free(r->obs_new);
    /* Redis first: its pending callbacks run now and see r->stopping. */
    relay_sink_free(r->sink);
    relay_pgsrc_free(r->listen);
    for (size_t i = 0; i < r->nlanes; i++) {
        relay_pgsrc_free(r->lanes[i].pg);
        free_batch(&r->lanes[i]);
        free(r->lanes[i].rows);
        relay_sqlbuf_free(&r->lanes[i].sql);
    }
    relay_respbuf_free(&r->out);
    free(r->settle_writers);
    free(r);
}
