/*
 * Retention: deleting sent rows and trimming streams (include/relay/retention.h).
 */
#include "relay/compat.h"

#include "relay/retention.h"

#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "relay/batch.h"
#include "relay/config.h"
#include "relay/keys.h"
#include "relay/log.h"
#include "relay/observe.h"
#include "relay/redisconn.h"
#include "relay/tools.h"
#include "relay/wait.h"

/* A purge call deletes at most this many rows; a run makes calls for at most
 * PURGE_BUDGET seconds, so that the next observation is not held up. */
#define PURGE_BATCH 5000
#define PURGE_BUDGET 1.0
/* The purge steps over rows that are not sent yet (in flight, paused,
 * quarantined) and goes on from after them; once it has caught up, it starts
 * from the first row again at most this often, for the rows it stepped over
 * that were sent since. */
#define PURGE_RESTART_EVERY 10.0
/* Streams are trimmed at most this often. */
#define TRIM_EVERY 10.0
/* The most streams one run trims, so that a run stays short. */
#define TRIM_STREAMS_MAX 10000

static void failed(struct relay_retention *st, const char *what, const char *why)
{
    char text[sizeof(st->last_error)];
    snprintf(text, sizeof(text), "%s: %s", what, why);
    st->errors_total++;
    if (strcmp(text, st->last_error) != 0)
        relay_warn("retention", "%s; retrying at the next observation", text);
    snprintf(st->last_error, sizeof(st->last_error), "%s", text);
}

/* ---- sent rows ------------------------------------------------------- */

static const char purge_sql[] = "SELECT deleted, next_after_id, caught_up,"
                                " extract(epoch FROM statement_timestamp() - oldest_kept)"
                                " FROM outbox.purge_sent($1::bigint * interval '1 millisecond',"
                                " $2::bigint, $3::integer)";

static void purge_sent(const struct relay_config *cfg, PGconn **pg,
                       const struct relay_observe_stop *stop, struct relay_retention *st)
{
    double started = relay_mono_now();
    if (st->purge_caught_up && started >= st->purge_restart_at) {
        st->purge_after_id = 0;
        st->purge_restart_at = started + PURGE_RESTART_EVERY;
    }
    for (;;) {
        char ms[24], after[24], max[16], err[256];
        snprintf(ms, sizeof(ms), "%u", cfg->sent_retention_ms);
        snprintf(after, sizeof(after), "%lld", st->purge_after_id);
        snprintf(max, sizeof(max), "%d", PURGE_BATCH);
        const char *params[3] = {ms, after, max};
        PGresult *r = relay_observe_pg_exec(pg, cfg, stop, purge_sql, 3, params, err, sizeof(err));
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
        st->oldest_sent_age = PQgetisnull(r, 0, 3) ? -1 : strtod(PQgetvalue(r, 0, 3), NULL);
        PQclear(r);
        st->last_error[0] = '\0';
        if (caught_up || relay_mono_now() - started >= PURGE_BUDGET)
            return;
    }
}

/* ---- streams --------------------------------------------------------- */

/* The trim function on one stream: 0, or -1 when the connection failed. */
static int trim_stream(const struct relay_config *cfg, redisContext *c, int stop_fd,
                       const char *stream, uint32_t retention_ms, struct relay_retention *st,
                       struct relay_observation *o)
{
    redisReply *r =
        relay_redis_call(c, stop_fd, cfg->connect_timeout_ms, "FCALL %s 1 %s %u %u",
                         RELAY_FUNCTION_TRIM, stream, retention_ms, cfg->stream_trim_max_hold_ms);
    if (r == NULL) {
        failed(st, "trimming streams", c->errstr);
        return -1;
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
            relay_tools_escape(shown_stream, sizeof(shown_stream), stream, strlen(stream), 0, 0);
            relay_tools_escape(shown_group, sizeof(shown_group), passed->str, passed->len, 0, 0);
            relay_warn("retention",
                       "trimmed %s past group %s, whose oldest unacknowledged entry is older "
                       "than stream_trim_max_hold: its consumers record what they miss as lost",
                       shown_stream, shown_group);
        }
    }
    freeReplyObject(r);
    return 0;
}

/*
 * Every stream of the relay's topics ("<prefix><topic>", as the observer
 * finds them, but all of them, not only those it lists), with
 * stream_retention; then the replay stream of each group observed, with 0:
 * a replayed entry is gone once its group acknowledged it. Dead-letter
 * streams are never trimmed. Names ending in ".dlq" or ".replay" are not
 * taken for topics, as the observer does not take them.
 */
static void trim_streams(const struct relay_config *cfg, redisContext **rd, int stop_fd,
                         struct relay_retention *st, struct relay_observation *o)
{
    const char *prefix = cfg->stream_prefix != NULL ? cfg->stream_prefix : "";
    size_t plen = strlen(prefix);
    char cursor[32] = "0";
    int trimmed = 0, rounds = 0;
    st->nheld = 0;
    do {
        redisReply *r = relay_redis_call(*rd, stop_fd, cfg->connect_timeout_ms,
                                         "SCAN %s TYPE stream COUNT 1000", cursor);
        if (r == NULL || r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
            failed(st, "trimming streams",
                   r != NULL && r->type == REDIS_REPLY_ERROR ? r->str : (*rd)->errstr);
            if (r != NULL)
                freeReplyObject(r);
            return;
        }
        snprintf(cursor, sizeof(cursor), "%s", r->element[0]->str);
        const redisReply *keys = r->element[1];
        for (size_t i = 0; i < keys->elements && trimmed < TRIM_STREAMS_MAX; i++) {
            const redisReply *k = keys->element[i];
            if (k->type != REDIS_REPLY_STRING || k->len < plen ||
                strncmp(k->str, prefix, plen) != 0 ||
                !relay_batch_topic_valid(k->str + plen, k->len - plen) ||
                relay_tools_ends_with(k->str, ".dlq") || relay_tools_ends_with(k->str, ".replay"))
                continue;
            trimmed++;
            if (trim_stream(cfg, *rd, stop_fd, k->str, cfg->stream_retention_ms, st, o) < 0) {
                freeReplyObject(r);
                return;
            }
        }
        freeReplyObject(r);
    } while (strcmp(cursor, "0") != 0 && ++rounds < 10000 && trimmed < TRIM_STREAMS_MAX);

    for (size_t g = 0; g < o->ngroups; g++) {
        char replay[RELAY_TOPIC_MAX + 300];
        if (relay_key_replay(o->groups[g].stream, o->groups[g].group, replay, sizeof(replay)) < 0)
            continue;
        if (trim_stream(cfg, *rd, stop_fd, replay, 0, st, o) < 0)
            return;
    }
}

void relay_retention_run(const struct relay_config *cfg, PGconn **pg, redisContext **rd,
                         const struct relay_observe_stop *stop, struct relay_retention *st,
                         struct relay_observation *o)
{
    if (st->purge_restart_at == 0)
        st->oldest_sent_age = -1;
    if (*pg != NULL && PQstatus(*pg) == CONNECTION_OK)
        purge_sent(cfg, pg, stop, st);
    double now = relay_mono_now();
    if (cfg->stream_retention_ms > 0 && *rd != NULL && (*rd)->err == 0 && now >= st->next_trim_at) {
        st->next_trim_at = now + TRIM_EVERY;
        trim_streams(cfg, rd, relay_observe_stop_fd(stop), st, o);
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
    o->stream_trimmed_total = st->stream_trimmed_total;
    o->retention_errors_total = st->errors_total;
}
