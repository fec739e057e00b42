/*
 * What the relay tells about itself: the /metrics text (Prometheus text
 * format, label values escaped: names come from Redis and from data), the
 * /readyz verdict, and the stuck-cycle check that the watchdog shares with
 * it. docs/OPERATIONS.md documents every metric.
 */
#include "common/compat.h"

#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core/config.h"
#include "relay/daemon.h"
#include "relay/metrics.h"
#include "relay/ownership_io.h"
#include "relay/pgsrc.h"
#include "relay/sink.h"

int relay_healthy(const struct relay *r)
{
    /* Every stage of a batch ends within its deadlines: publishing within
     * publish_timeout (and a WAIT for replicas within replica_timeout more),
     * each statement within statement_timeout (and the client's own
     * deadline), a reconnect within connect_timeout. */
    double wait_ms = r->cfg->min_replicas > 0 ? r->cfg->replica_timeout_ms : 0.0;
    double limit = (r->cfg->publish_timeout_ms + wait_ms + 2.0 * r->cfg->statement_timeout_ms +
                    r->cfg->connect_timeout_ms) /
                   1000.0;
    enum relay_loop_state st = r->batch.loop.state;
    if (st == RELAY_LOOP_IDLE || st == RELAY_LOOP_BACKOFF)
        return 1;
    return relay_now() - r->batch.stage_at <= limit;
}

int relay_postgres_up(const struct relay *r)
{
    return relay_pgsrc_up(r->batch.pg);
}

static int ready(const struct relay *r, char *why, size_t whylen)
{
    if (!relay_postgres_up(r)) {
        /* The claiming connections' last failure says what to do about it
         * (an old schema names the migration to apply). */
        const char *problem = "";
        problem = relay_pgsrc_problem(r->batch.pg);
        if (problem[0] != '\0')
            snprintf(why, whylen, "PostgreSQL: %s", problem);
        else
            snprintf(why, whylen, "PostgreSQL not connected");
        return 0;
    }
    if (!relay_sink_ready(r->sink)) {
        snprintf(why, whylen, "Redis not connected");
        return 0;
    }
    if (!relay_healthy(r)) {
        snprintf(why, whylen, "a claim cycle is stalled");
        return 0;
    }
    if (r->batch.loop.failures_in_row >= RELAY_FAILURES_NOT_READY) {
        /* The last error may be cut to fit: the reason stays readable. */
        if (snprintf(why, whylen, "batches keep failing (%u in a row): %s",
                     r->batch.loop.failures_in_row, r->fig.last_batch_error) < 0)
            why[0] = '\0';
        return 0;
    }
    return 1;
}

int relay_is_ready(void *arg, char *why, size_t whylen)
{
    return ready(arg, why, whylen);
}

static void help(struct outbox_buf *t, const char *name, const char *type, const char *text)
{
    outbox_buf_printf(t, "# HELP %s %s\n# TYPE %s %s\n", name, text, name, type);
}

/* A histogram over relay_batch_buckets (hist has one more count, for
 * +Inf): its cumulated buckets, sum and count, with labels ("" or
 * name="value") on each sample. */
static void render_seconds(struct outbox_buf *t, const char *name, const char *labels,
                           const unsigned long long *hist, double sum)
{
    const char *sep = labels[0] != '\0' ? "," : "";
    unsigned long long cum = 0;
    for (size_t b = 0; b < OUTBOX_ARRAY_LEN(relay_batch_buckets); b++) {
        cum += hist[b];
        outbox_buf_printf(t, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels, sep,
                          relay_batch_buckets[b], cum);
    }
    cum += hist[OUTBOX_ARRAY_LEN(relay_batch_buckets)];
    outbox_buf_printf(t, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep, cum);
    const char *lb = labels[0] != '\0' ? "{" : "", *rb = labels[0] != '\0' ? "}" : "";
    outbox_buf_printf(t, "%s_sum%s%s%s %.6f\n", name, lb, labels, rb, sum);
    outbox_buf_printf(t, "%s_count%s%s%s %llu\n", name, lb, labels, rb, cum);
}

/* The relay's own state and counters. */
static void render_relay(const struct relay *r, struct outbox_buf *t)
{
    const struct relay_figures *f = &r->fig;
    char why[128];
    int pqv = PQlibVersion();
    help(t, "outbox_relay_build_info", "gauge", "Version of the relay and its libraries.");
    outbox_buf_printf(t,
                      "outbox_relay_build_info{version=\"%s\",libpq=\"%d.%d\","
                      "hiredis=\"%d.%d.%d\"} 1\n",
                      RELAY_VERSION, pqv / 10000, pqv % 10000, HIREDIS_MAJOR, HIREDIS_MINOR,
                      HIREDIS_PATCH);
    help(t, "outbox_relay_up", "gauge", "Connection state of each server (1 connected).");
    outbox_buf_printf(t, "outbox_relay_up{server=\"postgres\"} %d\n", relay_postgres_up(r));
    outbox_buf_printf(t, "outbox_relay_up{server=\"redis\"} %d\n", relay_sink_ready(r->sink));
    help(t, "outbox_relay_redis_ask_redirects_total", "counter",
         "ASK replies of a Redis Cluster in slot migration, followed with ASKING.");
    outbox_buf_printf(t, "outbox_relay_redis_ask_redirects_total %llu\n",
                      (unsigned long long)relay_sink_asks_followed(r->sink));
    help(t, "outbox_relay_ready", "gauge", "1 when connected to both servers and not stalled.");
    outbox_buf_printf(t, "outbox_relay_ready %d\n", ready(r, why, sizeof(why)));

    help(t, "outbox_relay_messages_published_total", "counter",
         "Messages published to their stream, per topic.");
    for (size_t i = 0; i < f->ntopics; i++) {
        outbox_buf_printf(t, "outbox_relay_messages_published_total{topic=\"");
        relay_metrics_label(t, f->topics[i].topic);
        outbox_buf_printf(t, "\"} %llu\n", f->topics[i].published);
    }
    if (f->other_published)
        outbox_buf_printf(t, "outbox_relay_messages_published_total{topic=\"_other\"} %llu\n",
                          f->other_published);
    help(t, "outbox_relay_batches_total", "counter", "Batches published and recorded.");
    outbox_buf_printf(t, "outbox_relay_batches_total %llu\n", f->batches_total);
    help(t, "outbox_relay_batch_duration_seconds", "histogram",
         "Time from the first read of a batch to its positions recorded.");
    render_seconds(t, "outbox_relay_batch_duration_seconds", "", f->batch_hist, f->batch_sum);
    help(t, "outbox_relay_batch_phase_seconds", "histogram",
         "Time recorded batches spent in each phase: read (waiting for its rows, nothing "
         "publishing), publish (its calls in flight, until the last reply), record (until its "
         "positions are recorded).");
    static const char *const phases[RELAY_PHASES] = {"phase=\"read\"", "phase=\"publish\"",
                                                     "phase=\"record\""};
    for (int p = 0; p < RELAY_PHASES; p++)
        render_seconds(t, "outbox_relay_batch_phase_seconds", phases[p], f->phase_hist[p],
                       f->phase_sum[p]);
    help(t, "outbox_relay_publish_errors_total", "counter",
         "Failed batches by kind, and rows that failed for reasons of their own (row).");
    for (int k = 0; k < RELAY_FAIL_KINDS; k++)
        outbox_buf_printf(t, "outbox_relay_publish_errors_total{kind=\"%s\"} %llu\n",
                          relay_fail_kind_name((enum relay_fail_kind)k), f->errors[k]);
    outbox_buf_printf(t, "outbox_relay_publish_errors_total{kind=\"row\"} %llu\n", f->row_errors);
    help(t, "outbox_relay_batch_failures_in_row", "gauge",
         "Whole-batch failures since the last committed batch (3 or more: not ready).");
    outbox_buf_printf(t, "outbox_relay_batch_failures_in_row %u\n", r->batch.loop.failures_in_row);
    help(t, "outbox_relay_rows_quarantined_total", "counter",
         "Rows this relay recorded in outbox.quarantine: rows that can never be published, and "
         "the later rows of a partitioned key held behind one.");
    outbox_buf_printf(t, "outbox_relay_rows_quarantined_total %llu\n", f->quarantined_total);
    struct relay_owner_figures own;
    relay_ownership_io_figures(r->owner, &own);
    help(t, "outbox_relay_relays", "gauge",
         "Relays running against this database (member slots held), as this relay last saw; 0 "
         "while its owner connection is down.");
    outbox_buf_printf(t, "outbox_relay_relays %zu\n", own.members);
    help(t, "outbox_relay_partitions", "gauge",
         "Partitions of partitioned topics in this database, divided among the relays.");
    outbox_buf_printf(t, "outbox_relay_partitions %zu\n", own.partitions);
    help(t, "outbox_relay_partitions_owned", "gauge",
         "Partitions this relay owns and claims from.");
    outbox_buf_printf(t, "outbox_relay_partitions_owned %zu\n", own.owned);
    help(t, "outbox_relay_partition_takeovers_total", "counter",
         "Partitions this relay has taken: at start, from a relay that stopped or was cut off, "
         "and when the relays rebalance.");
    outbox_buf_printf(t, "outbox_relay_partition_takeovers_total %llu\n", own.takeovers);
    help(t, "outbox_relay_wakeup_lock_foreign_holder", "gauge",
         "1 for the session other than this relay that holds the wake-up lock while this relay "
         "is idle: producers skip their notifications meanwhile.");
    if (r->foreign_pid != 0) {
        outbox_buf_printf(t,
                          "outbox_relay_wakeup_lock_foreign_holder{pid=\"%ld\","
                          "application_name=\"",
                          r->foreign_pid);
        relay_metrics_label(t, r->foreign_app);
        outbox_buf_printf(t, "\",client_addr=\"");
        relay_metrics_label(t, r->foreign_addr);
        outbox_buf_printf(t, "\"} 1\n");
    }
}

/* The outbox and its topics, as last observed. */
static void render_streams(const struct relay_observation *o, struct outbox_buf *t);

/* Storage on both sides and retention (docs/OPERATIONS.md, "Retention"). */
static void render_retention(const struct relay_config *cfg, const struct relay_observation *o,
                             struct outbox_buf *t)
{
    if (o->outbox_bytes >= 0) {
        help(t, "outbox_relay_outbox_bytes", "gauge",
             "Size of outbox.messages with its indexes and TOAST.");
        outbox_buf_printf(t, "outbox_relay_outbox_bytes %lld\n", o->outbox_bytes);
    }
    if (o->outbox_dead_rows >= 0) {
        help(t, "outbox_relay_outbox_dead_rows", "gauge",
             "Dead row versions in outbox.messages that vacuum has not removed yet.");
        outbox_buf_printf(t, "outbox_relay_outbox_dead_rows %lld\n", o->outbox_dead_rows);
    }
    help(t, "outbox_relay_outbox_oldest_sent_age_seconds", "gauge",
         "Age of the oldest published row still kept in the outbox, from its created_at (0 when "
         "none is kept).");
    outbox_buf_printf(t, "outbox_relay_outbox_oldest_sent_age_seconds %.3f\n",
                      o->oldest_sent_age < 0 ? 0 : o->oldest_sent_age);
    help(t, "outbox_relay_sent_retention_seconds", "gauge",
         "The sent_retention setting: published rows are deleted once their stream passed them "
         "this long ago.");
    outbox_buf_printf(t, "outbox_relay_sent_retention_seconds %.3f\n",
                      cfg->sent_retention_ms / 1000.0);
    help(t, "outbox_relay_stream_retention_seconds", "gauge",
         "The stream_retention setting: acknowledged entries older than this are trimmed "
         "(0: never).");
    outbox_buf_printf(t, "outbox_relay_stream_retention_seconds %.3f\n",
                      cfg->stream_retention_ms / 1000.0);
    help(t, "outbox_relay_sent_rows_deleted_total", "counter",
         "Published rows deleted one at a time by retention (sent_retention), in partitions "
         "kept for a stream behind them.");
    outbox_buf_printf(t, "outbox_relay_sent_rows_deleted_total %llu\n", o->sent_deleted_total);
    help(t, "outbox_relay_outbox_partitions_dropped_total", "counter",
         "Partitions of outbox.messages dropped by retention, every row of them published "
         "sent_retention ago.");
    outbox_buf_printf(t, "outbox_relay_outbox_partitions_dropped_total %llu\n",
                      o->partitions_dropped_total);
    help(t, "outbox_relay_stream_entries_trimmed_total", "counter",
         "Stream entries removed by trimming (stream_retention).");
    outbox_buf_printf(t, "outbox_relay_stream_entries_trimmed_total %llu\n",
                      o->stream_trimmed_total);
    help(t, "outbox_relay_vacuums_total", "counter",
         "VACUUMs of outbox.messages the relay ran (vacuum_dead_rows) that finished.");
    outbox_buf_printf(t, "outbox_relay_vacuums_total %llu\n", o->vacuums_total);
    help(t, "outbox_relay_retention_errors_total", "counter",
         "Retention runs that failed (deleting sent rows or trimming); each is logged.");
    outbox_buf_printf(t, "outbox_relay_retention_errors_total %llu\n", o->retention_errors_total);
    render_streams(o, t);
}

/* Redis's memory and the trimming of each stream. */
static void render_streams(const struct relay_observation *o, struct outbox_buf *t)
{
    if (o->redis_used_memory >= 0) {
        help(t, "outbox_relay_redis_used_memory_bytes", "gauge",
             "Memory Redis uses in all (INFO memory used_memory).");
        outbox_buf_printf(t, "outbox_relay_redis_used_memory_bytes %lld\n", o->redis_used_memory);
    }
    help(t, "outbox_relay_stream_memory_bytes", "gauge",
         "Memory of each of the relay's streams in Redis (MEMORY USAGE, sampled).");
    for (size_t i = 0; i < o->ntopics; i++) {
        if (o->topics[i].memory_bytes < 0)
            continue;
        outbox_buf_printf(t, "outbox_relay_stream_memory_bytes{stream=\"");
        relay_metrics_label(t, o->topics[i].stream);
        outbox_buf_printf(t, "\"} %lld\n", o->topics[i].memory_bytes);
    }
    help(t, "outbox_relay_stream_trim_held_back_seconds", "gauge",
         "How far past stream_retention a consumer group keeps a stream's oldest entry, by "
         "not acknowledging it.");
    for (size_t i = 0; i < o->ntopics; i++) {
        if (o->topics[i].trim_holder[0] == '\0')
            continue;
        outbox_buf_printf(t, "outbox_relay_stream_trim_held_back_seconds{stream=\"");
        relay_metrics_label(t, o->topics[i].stream);
        outbox_buf_printf(t, "\",group=\"");
        relay_metrics_label(t, o->topics[i].trim_holder);
        outbox_buf_printf(t, "\"} %.3f\n", o->topics[i].trim_held_back);
    }
}

static void render_outbox(const struct relay *r, struct outbox_buf *t)
{
    const struct relay_observation *o = r->obs;
    if (o->taken_at > 0) {
        help(t, "outbox_relay_observation_age_seconds", "gauge",
             "Age of the observation behind the gauges below.");
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        outbox_buf_printf(t, "outbox_relay_observation_age_seconds %.3f\n",
                          (double)now.tv_sec + now.tv_nsec / 1e9 - o->taken_at);
    }
    if (o->pg_ok) {
        help(t, "outbox_relay_outbox_pending_rows", "gauge",
             "Rows not yet in their stream (outbox.unsent): counted per topic from its "
             "streams' recorded positions, estimated from the span of ids for a topic never "
             "published.");
        outbox_buf_printf(t, "outbox_relay_outbox_pending_rows %lld\n", o->outbox_pending);
        help(t, "outbox_relay_outbox_oldest_pending_age_seconds", "gauge",
             "Age of the oldest row not yet in its stream, from its created_at (0 when none).");
        outbox_buf_printf(t, "outbox_relay_outbox_oldest_pending_age_seconds %.3f\n",
                          o->outbox_oldest_age < 0 ? 0 : o->outbox_oldest_age);
        help(t, "outbox_relay_outbox_quarantined_rows", "gauge",
             "Rows in outbox.quarantine, waiting for an operator (outbox-relay failed).");
        outbox_buf_printf(t, "outbox_relay_outbox_quarantined_rows %lld\n", o->quarantined);
        help(t, "outbox_relay_outbox_blocked_keys", "gauge",
             "Keys of partitioned topics whose later rows are quarantined behind a row of theirs.");
        outbox_buf_printf(t, "outbox_relay_outbox_blocked_keys %lld\n", o->blocked_keys);
        help(t, "outbox_relay_topic_admitting", "gauge",
             "1 when producers of the topic are admitted, 0 when refused (backpressure).");
        for (size_t i = 0; i < o->ntopics; i++) {
            if (o->topics[i].admitting < 0 || !relay_observe_first_of_topic(o, i))
                continue;
            outbox_buf_printf(t, "outbox_relay_topic_admitting{topic=\"");
            relay_metrics_label(t, o->topics[i].topic);
            outbox_buf_printf(t, "\"} %d\n", o->topics[i].admitting);
        }
    }
    render_retention(r->cfg, o, t);
    help(t, "outbox_relay_stream_paused", "gauge",
         "1 while the relay holds a stream back for its lagging consumer groups.");
    for (size_t i = 0; i < o->ntopics; i++) {
        outbox_buf_printf(t, "outbox_relay_stream_paused{stream=\"");
        relay_metrics_label(t, o->topics[i].stream);
        outbox_buf_printf(t, "\"} %d\n", relay_paused_has(&r->paused, o->topics[i].topic));
    }
}

/* Every consumer group of the relay's streams, as last observed. */
static void render_groups(const struct relay *r, struct outbox_buf *t)
{
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
    const struct relay_observation *o = r->obs;
    if (!o->redis_ok)
        return;
    for (int m = 0; m < 6; m++) {
        help(t, names[m][0], "gauge", names[m][1]);
        for (size_t i = 0; i < o->ngroups; i++) {
            const struct relay_group_obs *g = &o->groups[i];
            double v = m == 0   ? (double)g->lag
                       : m == 1 ? (double)g->pending
                       : m == 2 ? g->oldest_pending_age
                       : m == 3 ? g->oldest_undelivered_age
                       : m == 4 ? g->queue_age
                                : (double)g->dead_letters;
            if (m == 0 && g->lag < 0)
                continue; /* Redis cannot tell: no sample rather than a wrong one */
            outbox_buf_printf(t, "%s{stream=\"", names[m][0]);
            relay_metrics_label(t, g->stream);
            outbox_buf_printf(t, "\",group=\"");
            relay_metrics_label(t, g->group);
            outbox_buf_printf(t, "\"} %.3f\n", v < 0 ? 0 : v);
        }
    }
}

long relay_render_metrics(void *arg, char **out)
{
    const struct relay *r = arg;
    struct outbox_buf t = {.max = RELAY_METRICS_TEXT_MAX};
    render_relay(r, &t);
    render_outbox(r, &t);
    render_groups(r, &t);
    if (t.failed) {
        free(t.data);
        return -1;
    }
    *out = t.data;
    return (long)t.len;
}
