/*
 * Retention: deleting sent rows and trimming streams (relay/retention.h).
 */
#include "common/compat.h"

#include "relay/retention.h"

#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "relay/batch.h"
#include "core/config.h"
#include "relay/log.h"
#include "core/observe.h"
#include "core/pg.h"
#include "common/redisconn.h"
#include "core/streamlist.h"
#include "core/text.h"
#include "common/wait.h"

/* A purge call deletes at most this many rows; a run makes calls for at most
 * PURGE_BUDGET seconds, so that the next observation is not held up. */
#define PURGE_BATCH 5000
#define PURGE_BUDGET 1.0
/* While outbox.rotate reports a partition kept for a stream behind it, a row
 * of a due partition is deleted once its stream's recorded position has
 * passed it and it was committed before the last tick taken sent_retention
 * ago (outbox.purge_sent, migrations/019_rotation.sql); never a row
 * outbox.unsent shows nor a quarantined one. The purge steps over the rows
 * it must keep (not yet in their stream, paused, quarantined) and goes on
 * from after them; once it has caught up, it starts from the first row
 * again, for the rows it stepped over that were published since: as often
 * as sent_retention, between these bounds. */
#define PURGE_RESTART_MIN 10.0
#define PURGE_RESTART_MAX 60.0
/* Streams are trimmed at most this often. */
#define TRIM_EVERY 10.0

static void failed(struct relay_retention *st, const char *what, const char *why)
{
    char text[sizeof(st->last_error)];
    snprintf(text, sizeof(text), "%s: %s", what, why);
    st->errors_total++;
    if (strcmp(text, st->last_error) != 0)
        relay_warn("retention", "%s; retrying at the next observation", text);
    snprintf(st->last_error, sizeof(st->last_error), "%s", text);
}

/* ---- published rows -------------------------------------------------- */

/* The table's partitions (outbox.rotate, migrations/019_rotation.sql): those
 * ahead of the transaction counter created, those every stream is past since
 * sent_retention dropped. Returns how many partitions are due but kept for a
 * stream behind them (their published rows go one at a time, purge_sent),
 * or -1 when the call failed. */
static const char rotate_sql[] = "SELECT created, dropped, kept,"
                                 " extract(epoch FROM statement_timestamp() - oldest_kept)"
                                 " FROM outbox.rotate($1::bigint * interval '1 millisecond')";

static int rotate(const struct relay_config *cfg, PGconn **pg, int stop_fd,
                  struct relay_retention *st)
{
    char ms[24], err[256];
    snprintf(ms, sizeof(ms), "%u", cfg->sent_retention_ms);
    const char *params[1] = {ms};
    PGresult *r = relay_pg_exec(pg, cfg, stop_fd, rotate_sql, 1, params, err, sizeof(err));
    st->oldest_sent_age = -1; /* unknown unless the call succeeds */
    if (r == NULL) {
        failed(st, "rotating the outbox's partitions", err);
        return -1;
    }
    if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1) {
        failed(st, "rotating the outbox's partitions", PQresultErrorMessage(r));
        PQclear(r);
        return -1;
    }
    int created = atoi(PQgetvalue(r, 0, 0)), dropped = atoi(PQgetvalue(r, 0, 1));
    int kept = atoi(PQgetvalue(r, 0, 2));
    st->partitions_dropped_total += (unsigned long long)dropped;
    if (!PQgetisnull(r, 0, 3))
        st->oldest_sent_age = strtod(PQgetvalue(r, 0, 3), NULL);
    PQclear(r);
    if (created > 0 || dropped > 0)
        relay_info("retention", "outbox partitions: %d created, %d dropped", created, dropped);
    st->last_error[0] = '\0';
    return kept;
}

static const char purge_sql[] = "SELECT deleted, next_after_id, caught_up"
                                " FROM outbox.purge_sent($1::bigint * interval '1 millisecond',"
                                " $2::bigint, $3::integer)";

static void purge_sent(const struct relay_config *cfg, PGconn **pg, int stop_fd,
                       struct relay_retention *st)
{
    double started = outbox_mono_now();
    if (st->purge_caught_up && started >= st->purge_restart_at) {
        double every = cfg->sent_retention_ms / 1000.0;
        every = every < PURGE_RESTART_MIN   ? PURGE_RESTART_MIN
                : every > PURGE_RESTART_MAX ? PURGE_RESTART_MAX
                                            : every;
        st->purge_after_id = 0;
        st->purge_restart_at = started + every;
    }
    for (;;) {
        char ms[24], after[24], max[16], err[256];
        snprintf(ms, sizeof(ms), "%u", cfg->sent_retention_ms);
        snprintf(after, sizeof(after), "%lld", st->purge_after_id);
        snprintf(max, sizeof(max), "%d", PURGE_BATCH);
        const char *params[3] = {ms, after, max};
        PGresult *r = relay_pg_exec(pg, cfg, stop_fd, purge_sql, 3, params, err, sizeof(err));
        if (r == NULL) {
            failed(st, "deleting sent rows", err);
            return;
        }
        if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1) {
            failed(st, "deleting sent rows", PQresultErrorMessage(r));
            PQclear(r);
            return;
        }
        st->sent_deleted_total += strtoull(PQgetvalue(r, 0, 0), NULL, 10);
        st->purge_after_id = strtoll(PQgetvalue(r, 0, 1), NULL, 10);
        int caught_up = strcmp(PQgetvalue(r, 0, 2), "t") == 0;
        st->purge_caught_up = caught_up;
        PQclear(r);
        st->last_error[0] = '\0';
        if (caught_up || outbox_mono_now() - started >= PURGE_BUDGET)
            return;
    }
}

/* ---- vacuum ---------------------------------------------------------- */

/* 1 when the session's role may VACUUM outbox.messages (owns it, through
 * membership, or is a superuser), 0 when not, -1 when it cannot tell. */
static int may_vacuum(const struct relay_config *cfg, PGconn **c, int stop_fd, char *err,
                      size_t errlen)
{
    static const char sql[] = "SELECT pg_has_role(c.relowner, 'USAGE')"
                              " OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
                              " FROM pg_class AS c WHERE c.oid = 'outbox.messages'::regclass";
    PGresult *r = relay_pg_exec(c, cfg, stop_fd, sql, 0, NULL, err, errlen);
    if (r == NULL)
        return -1;
    int rc = -1;
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1)
        rc = strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    else
        snprintf(err, errlen, "%s", PQresultErrorMessage(r));
    PQclear(r);
    return rc;
}

/* Starts a VACUUM on a connection of its own and returns at once. */
static void vacuum_start(const struct relay_config *cfg, int stop_fd, struct relay_retention *st,
                         long long dead_rows)
{
    char err[256];
    PGconn *c = relay_pg_open(cfg, "outbox-relay vacuum", stop_fd, err, sizeof(err));
    if (c == NULL) {
        failed(st, "vacuuming the outbox", err);
        return;
    }
    int may = may_vacuum(cfg, &c, stop_fd, err, sizeof(err));
    if (may == 0) {
        relay_warn("retention",
                   "the relay's role does not own outbox.messages, so it cannot VACUUM it: "
                   "autovacuum alone removes the dead rows, and the claim is slower until it "
                   "has; set vacuum_dead_rows = 0 to say so, or see docs/OPERATIONS.md, "
                   "\"Retention\"");
        st->vacuum_not_owner = 1;
    }
    /* VACUUM takes as long as the table needs, not statement_timeout. */
    PGresult *r = may == 1 ? relay_pg_exec(&c, cfg, stop_fd, "SET statement_timeout = 0", 0, NULL,
                                           err, sizeof(err))
                           : NULL;
    if (r != NULL && PQresultStatus(r) == PGRES_COMMAND_OK &&
        PQsendQuery(c, "VACUUM (INDEX_CLEANUP ON) outbox.messages") == 1) {
        PQclear(r);
        st->vacuum_conn = c;
        st->vacuum_started = outbox_mono_now();
        relay_info("retention", "VACUUM of outbox.messages started (%lld dead rows)", dead_rows);
        return;
    }
    if (may != 0)
        failed(st, "vacuuming the outbox", r != NULL ? PQresultErrorMessage(r) : err);
    PQclear(r);
    if (c != NULL)
        PQfinish(c);
}

/* Looks at the VACUUM in flight without waiting for it. */
static void vacuum_poll(struct relay_retention *st)
{
    PGconn *c = st->vacuum_conn;
    if (PQconsumeInput(c) == 1 && PQisBusy(c))
        return;
    const char *why = PQerrorMessage(c);
    int ok = 0;
    PGresult *r;
    while ((r = PQgetResult(c)) != NULL) {
        if (PQresultStatus(r) == PGRES_COMMAND_OK)
            ok = 1;
        else
            why = PQresultErrorMessage(r);
        PQclear(r);
    }
    if (ok) {
        st->vacuums_total++;
        relay_info("retention", "VACUUM of outbox.messages done in %.1f s",
                   outbox_mono_now() - st->vacuum_started);
    } else {
        failed(st, "vacuuming the outbox", why);
    }
    relay_retention_end(st);
}

void relay_retention_end(struct relay_retention *st)
{
    if (st->vacuum_conn != NULL && PQisBusy(st->vacuum_conn)) {
        /* The server would go on vacuuming for a client that is gone. */
        char err[256];
        PGcancel *cancel = PQgetCancel(st->vacuum_conn);
        if (cancel != NULL && PQcancel(cancel, err, sizeof(err)) == 0)
            relay_warn("retention", "cannot cancel the VACUUM in flight: %s", err);
        PQfreeCancel(cancel);
    }
    if (st->vacuum_conn != NULL)
        PQfinish(st->vacuum_conn);
    st->vacuum_conn = NULL;
    st->vacuum_started = 0;
}

static void vacuum(const struct relay_config *cfg, int stop_fd, struct relay_retention *st,
                   const struct relay_observation *o)
{
    if (st->vacuum_conn != NULL)
        vacuum_poll(st);
    else if (cfg->vacuum_dead_rows > 0 && !st->vacuum_not_owner && o->pg_ok &&
             (o->outbox_dead_rows >= (long long)cfg->vacuum_dead_rows ||
              /* drained: the next burst's claims start on a clean index */
              (o->outbox_pending == 0 &&
               o->outbox_dead_rows >= (long long)cfg->vacuum_dead_rows / 10)))
        vacuum_start(cfg, stop_fd, st, o->outbox_dead_rows);
}

/* ---- streams --------------------------------------------------------- */

/* The trim function on one stream: 0, 1 when the stream's slot is another
 * primary's now (the list of streams is out of date), or -1 when the
 * connection failed. */
static int trim_stream(const struct relay_config *cfg, redisContext *c, int stop_fd,
                       const char *stream, uint32_t retention_ms, struct relay_retention *st,
                       struct relay_observation *o)
{
    redisReply *r =
        outbox_redis_call(c, stop_fd, cfg->connect_timeout_ms, "FCALL %s 1 %s %u %u",
                          RELAY_FUNCTION_TRIM, stream, retention_ms, cfg->stream_trim_max_hold_ms);
    if (r == NULL) {
        failed(st, "trimming streams", c->errstr);
        return -1;
    }
    if (r->type == REDIS_REPLY_ERROR &&
        (strncmp(r->str, "MOVED ", 6) == 0 || strncmp(r->str, "ASK ", 4) == 0)) {
        freeReplyObject(r); /* trimmed where it is, once it is listed there */
        return 1;
    }
    if (r->type == REDIS_REPLY_ERROR && strstr(r->str, "Function not found") != NULL) {
        /* Until the relay's Redis connection has loaded the library (it
         * reports its own failures to): the next run trims. */
        relay_debug("retention", "trim function not loaded yet");
    } else if (r->type == REDIS_REPLY_ERROR) {
        failed(st, "trimming streams", r->str);
    } else if (r->type == REDIS_REPLY_ARRAY && r->elements == 5 &&
               r->element[0]->type == REDIS_REPLY_INTEGER) {
        st->stream_trimmed_total += (unsigned long long)r->element[0]->integer;
        const redisReply *holder = r->element[2], *held = r->element[3], *passed = r->element[4];
        if (holder->type == REDIS_REPLY_STRING && holder->len > 0 &&
            held->type == REDIS_REPLY_INTEGER && held->integer > 0 &&
            st->nheld < RELAY_OBS_TOPICS_MAX) {
            double past = o->taken_at - (double)held->integer / 1000.0 - retention_ms / 1000.0;
            if (past > 0) {
                snprintf(st->held[st->nheld].stream, sizeof(st->held[0].stream), "%s", stream);
                snprintf(st->held[st->nheld].group, sizeof(st->held[0].group), "%s", holder->str);
                st->held[st->nheld].held_back = past;
                st->nheld++;
            }
        }
        if (passed->type == REDIS_REPLY_STRING && passed->len > 0) {
            char shown_stream[200], shown_group[200];
            relay_text_escape(shown_stream, sizeof(shown_stream), stream, strlen(stream), 0, 0);
            relay_text_escape(shown_group, sizeof(shown_group), passed->str, passed->len, 0, 0);
            relay_warn("retention",
                       "trimmed %s past the pending entries of group %s, whose oldest is "
                       "older than stream_trim_max_hold: its consumers record them as lost",
                       shown_stream, shown_group);
        }
    }
    freeReplyObject(r);
    return 0;
}

/*
 * Every stream of the relay's topics ("<prefix><topic>" and the partitions'
 * "<prefix><topic>:<ppp>", as the observer finds them, but all of them, not
 * only those it lists), with stream_retention, and every replay stream of
 * theirs ("{<stream>}.<group>.replay") with 0: a replayed entry is gone once
 * its group acknowledged it. Dead-letter streams are never trimmed. The
 * streams are those of the observer's list (core/streamlist.h). In
 * a cluster, on each primary in turn: each stream's replay streams share its
 * slot, so they are listed under the same primary.
 */
struct trim_each {
    const struct relay_config *cfg;
    int stop_fd;
    struct relay_stream_list *list;
    struct relay_retention *st;
    struct relay_observation *o;
};

static int trim_node(redisContext *c, void *arg)
{
    struct trim_each *e = arg;
    const struct relay_config *cfg = e->cfg;
    char err[256]; /* fits failed()'s message with its prefix */
    uint32_t node;
    if (relay_stream_list_node(e->list, c, cfg->stream_prefix, e->stop_fd, cfg->connect_timeout_ms,
                               &node, err, sizeof(err)) < 0) {
        failed(e->st, "trimming streams", err);
        return -1;
    }
    for (size_t i = 0; i < e->list->n; i++) {
        const struct relay_listed_stream *s = &e->list->streams[i];
        if (s->node != node)
            continue;
        /* A replayed entry is gone once its group acknowledged it. */
        uint32_t retention = s->kind == RELAY_STREAM_REPLAY ? 0 : cfg->stream_retention_ms;
        int rc = trim_stream(cfg, c, e->stop_fd, s->key, retention, e->st, e->o);
        if (rc < 0)
            return -1;
        if (rc > 0)
            relay_stream_list_forget(e->list);
    }
    return 0;
}

static void trim_streams(const struct relay_config *cfg, redisContext **rd, int stop_fd,
                         struct relay_stream_list *list, struct relay_retention *st,
                         struct relay_observation *o)
{
    struct trim_each each = {cfg, stop_fd, list, st, o};
    char err[512] = "";
    st->nheld = 0;
    if (outbox_redis_each_primary(*rd, &cfg->redis_url, cfg->connect_timeout_ms,
                                  cfg->connect_timeout_ms, stop_fd, trim_node, &each, err,
                                  sizeof(err)) < 0 &&
        err[0] != '\0')
        failed(st, "trimming streams", err);
}

void relay_retention_rows(const struct relay_config *cfg, PGconn **pg,
                          const struct relay_observe_stop *stop, struct relay_retention *st)
{
    int stop_fd = relay_observe_stop_fd(stop);
    if (*pg != NULL && PQstatus(*pg) == CONNECTION_OK && rotate(cfg, pg, stop_fd, st) > 0)
        purge_sent(cfg, pg, stop_fd, st);
}

void relay_retention_run(const struct relay_config *cfg, redisContext **rd,
                         const struct relay_observe_stop *stop, struct relay_stream_list *streams,
                         struct relay_retention *st, struct relay_observation *o)
{
    int stop_fd = relay_observe_stop_fd(stop);
    vacuum(cfg, stop_fd, st, o);
    double now = outbox_mono_now();
    if (cfg->stream_retention_ms > 0 && *rd != NULL && (*rd)->err == 0 && now >= st->next_trim_at) {
        st->next_trim_at = now + TRIM_EVERY;
        trim_streams(cfg, rd, stop_fd, streams, st, o);
    }
    for (size_t i = 0; i < st->nheld; i++)
        for (size_t t = 0; t < o->ntopics; t++)
            if (strcmp(o->topics[t].stream, st->held[i].stream) == 0) {
                snprintf(o->topics[t].trim_holder, sizeof(o->topics[t].trim_holder), "%s",
                         st->held[i].group);
                o->topics[t].trim_held_back = st->held[i].held_back;
            }
    o->oldest_sent_age = st->oldest_sent_age;
    o->sent_deleted_total = st->sent_deleted_total;
    o->partitions_dropped_total = st->partitions_dropped_total;
    o->stream_trimmed_total = st->stream_trimmed_total;
    o->retention_errors_total = st->errors_total;
    o->vacuums_total = st->vacuums_total;
    o->vacuum_running = st->vacuum_conn != NULL;
}
