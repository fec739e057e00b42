/*
 * Observation of the outbox and the streams (core/observe.h).
 *
 * Every read is bounded: the outbox figures come from outbox.backlog (its
 * cost is described at outbox_sql below), and the Redis figures from XINFO
 * GROUPS, the XPENDING summary and single-entry XRANGEs.
 *
 * Every wait has a deadline of our own and ends early when the caller's stop
 * is triggered: each wait is a poll() on the server's socket and the stop's
 * pipe (common/wait.c; the PostgreSQL connection and its statements come
 * from core/pg.c, the Redis connection and its commands from
 * common/redisconn.c, the one Redis connect). Blocking libpq or hiredis calls
 * would wait as long as the kernel keeps a silent connection open: in a
 * network partition, a quarter of an hour with a request unacknowledged,
 * for ever without keepalives once it was; and the daemon's shutdown waits
 * for this thread. Host names are looked up the same way, with c-ares
 * (common/resolve.c), not with getaddrinfo, which blocks.
 */
#include "common/compat.h"

#include "core/observe.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "common/buf.h"
#include "core/config.h"
#include "common/keys.h"
#include "core/pg.h"
#include "common/redisconn.h"
#include "common/wait.h"
#include "core/streamlist.h"

double relay_observe_parse_time(const char *s)
{
    struct tm tm;
    int us = 0, n = 0;
    memset(&tm, 0, sizeof(tm));
    if (s == NULL || sscanf(s, "%4d-%2d-%2dT%2d:%2d:%2d%n", &tm.tm_year, &tm.tm_mon, &tm.tm_mday,
                            &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &n) != 6)
        return -1;
    const char *p = s + n;
    if (*p == '.') {
        int digits = 0;
        for (p++; *p >= '0' && *p <= '9'; p++, digits++)
            if (digits < 6)
                us = us * 10 + (*p - '0');
        for (; digits < 6; digits++)
            us *= 10;
    }
    if (*p != 'Z')
        return -1;
    tm.tm_year -= 1900;
    tm.tm_mon -= 1;
    time_t t = timegm(&tm);
    return (double)t + us / 1e6;
}

static double now_unix(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- waiting --------------------------------------------------------- */

struct relay_observe_stop {
    int fd[2]; /* a pipe; its read end is readable once triggered */
};

struct relay_observe_stop *relay_observe_stop_new(void)
{
    struct relay_observe_stop *s = malloc(sizeof(*s));
    if (s == NULL)
        return NULL;
    if (pipe(s->fd) != 0) {
        free(s);
        return NULL;
    }
    for (int i = 0; i < 2; i++) {
        int fl = fcntl(s->fd[i], F_GETFL);
        if (fl < 0 || fcntl(s->fd[i], F_SETFL, fl | O_NONBLOCK) < 0 ||
            fcntl(s->fd[i], F_SETFD, FD_CLOEXEC) < 0) {
            relay_observe_stop_free(s);
            return NULL;
        }
    }
    return s;
}

void relay_observe_stop_trigger(struct relay_observe_stop *s)
{
    /* The byte is never read, so the pipe stays readable; a write that fails
     * finds the pipe full, triggered before. */
    if (s != NULL && write(s->fd[1], "x", 1) < 0)
        return;
}

void relay_observe_stop_free(struct relay_observe_stop *s)
{
    if (s == NULL)
        return;
    close(s->fd[0]);
    close(s->fd[1]);
    free(s);
}

int relay_observe_stop_fd(const struct relay_observe_stop *stop)
{
    return stop != NULL ? stop->fd[0] : -1;
}

/* ---- PostgreSQL ------------------------------------------------------ */

/* 1 when r holds rows; else 0 with the error in o (r is cleared). */
static int pg_rows(PGresult *r, struct relay_observation *o)
{
    return relay_pg_rows(r, o->pg_error, sizeof(o->pg_error));
}
/* The relays' advisory locks in this database (relay/ownership_io.c). */
#define OWNER_LOCKS                                                                                \
    " FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted"              \
    " AND l.mode = 'ExclusiveLock' AND l.database ="                                               \
    " (SELECT oid FROM pg_database WHERE datname = current_database())"

/*
 * The outbox's figures. What waits is what outbox.unsent shows: rows their
 * stream's recorded position has not passed and that are not quarantined.
 * outbox.backlog (migrations/022_no_topic_index.sql) counts them per topic
 * without a scan of the table, in one walk of messages_txid_idx over the rows
 * written since the oldest position of any stream and of the lead: a few
 * seconds of rows while the relays keep up; the backlog and what the other
 * topics wrote meanwhile while a stream is paused or stalled, or before any
 * relay ran. That walk is the observation's only one: its rows, a topic each
 * (columns 9 to 12; NULL when no topic has rows or a position), give the
 * admission decisions their figures (admission_args) and every stream its
 * own (topic_figures). The first row also carries the outbox's totals
 * (columns 0 to 8).
 */
static const char outbox_sql[] =
    /* outbox.messages is locked first, as a TRUNCATE or ALTER of several of
     * the outbox's tables takes it first (the lock order of migration 017):
     * holding outbox.topics or outbox.quarantine while outbox.backlog waits
     * for it would deadlock with one. */
    "WITH lock_order AS (SELECT FROM outbox.messages LIMIT 0),"
    " w AS MATERIALIZED (SELECT x.topic, x.pending, x.oldest_created_at"
    "   FROM outbox.backlog(NULL) x),"
    " b AS (SELECT sum(w.pending) AS pending, min(w.oldest_created_at) AS oldest FROM w)"
    " SELECT b.pending, extract(epoch FROM clock_timestamp() - b.oldest),"
    " (SELECT count(*) FROM outbox.quarantine),"
    " (SELECT sum(pg_total_relation_size(t.relid))::bigint"
    "  FROM pg_partition_tree('outbox.messages'::regclass) AS t),"
    " (SELECT sum(n_dead_tup)::bigint FROM pg_stat_all_tables WHERE relid IN"
    "  (SELECT t.relid FROM pg_partition_tree('outbox.messages'::regclass) AS t)),"
    /* Keys of partitioned topics held back by a quarantined row: the relay
     * quarantines their later rows behind it until it is retried or dropped. */
    " (SELECT count(*) FROM (SELECT DISTINCT q.topic, q.partition_key FROM outbox.quarantine q"
    "   WHERE q.partition_key IS NOT NULL"
    "   AND q.topic = ANY(ARRAY(SELECT t.topic FROM outbox.topics t WHERE t.partitions > 1))) k),"
    /* The relays running against this database, the partitions they own
     * and the partitions there are (relay/ownership_io.c). */
    " (SELECT count(*)" OWNER_LOCKS " AND l.classid = " RELAY_OWNER_MEMBER_NS "),"
    " (SELECT count(DISTINCT l.objid)" OWNER_LOCKS " AND l.classid = " RELAY_OWNER_UNIT_NS "),"
    " (SELECT coalesce(sum(t.partitions), 0) FROM outbox.topics t WHERE t.partitions > 1),"
    " w.topic, w.pending, extract(epoch FROM clock_timestamp() - w.oldest_created_at),"
    " w.oldest_created_at"
    " FROM b LEFT JOIN w ON true";

/*
 * Admission, from PostgreSQL alone: every topic with limits, and every topic
 * with a state row (a topic whose limits were deleted is released by
 * observe_topic, which admits a topic without limits), with its backlog from
 * the walk of outbox_sql, passed as three arrays: topics ($1), rows waiting
 * ($2) and the oldest row's created_at ($3). Columns: topic, rows waiting,
 * age of the oldest, admitting; refused topics first.
 *
 * Deciding takes each state row's lock (observe_topic's FOR UPDATE) until the
 * statement ends, in topic order, so relays that decide at the same time wait
 * for each other instead of deadlocking.
 */
#define ADMISSION_FROM                                                                             \
    " FROM (SELECT topic FROM outbox.topic_limits UNION SELECT topic FROM outbox.topic_state) t"   \
    " LEFT JOIN unnest($1::text[], $2::bigint[], $3::timestamptz[])"                               \
    "   AS o(topic, pending, oldest_created_at) ON o.topic = t.topic"

static const char admission_decide_sql[] =
    "SELECT topic, span, age, outbox.observe_topic(topic, coalesce(span, 0), created_at)"
    " AS admitting FROM (SELECT t.topic, o.pending AS span, o.oldest_created_at AS created_at,"
    "   extract(epoch FROM clock_timestamp() - o.oldest_created_at) AS age" ADMISSION_FROM
    "   ORDER BY t.topic OFFSET 0) f"
    " ORDER BY admitting, topic";

static const char admission_read_sql[] =
    "SELECT t.topic, o.pending, extract(epoch FROM clock_timestamp() - o.oldest_created_at),"
    " coalesce(s.admitting, true) AS admitting" ADMISSION_FROM
    " LEFT JOIN outbox.topic_state s ON s.topic = t.topic"
    " ORDER BY 4, 1";

static struct relay_topic_obs *find_topic(struct relay_topic_obs *list, size_t n, const char *topic)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(list[i].topic, topic) == 0)
            return &list[i];
    return NULL;
}

int relay_observe_first_of_topic(const struct relay_observation *o, size_t i)
{
    for (size_t j = 0; j < i; j++)
        if (strcmp(o->topics[j].topic, o->topics[i].topic) == 0)
            return 0;
    return 1;
}

/* The outbox's figures of a topic for every stream of it: PostgreSQL
 * answers per topic, into the topic's first entry, and a partitioned topic
 * has an entry per partition stream. covered may be NULL. */
static void spread_topic_figures(struct relay_observation *o, unsigned char *covered)
{
    for (size_t i = 0; i < o->ntopics; i++) {
        struct relay_topic_obs *t = &o->topics[i];
        const struct relay_topic_obs *first = find_topic(o->topics, o->ntopics, t->topic);
        if (first == t)
            continue;
        t->pending = first->pending;
        t->oldest_pending_age = first->oldest_pending_age;
        t->admitting = first->admitting;
        if (covered != NULL)
            covered[i] = covered[first - o->topics];
    }
}

/*
 * Lists the topics of the admission rows r together with the streams the
 * scan of Redis found (o->topics, which the groups point into): the refused
 * topics first, which an operator must see, then the streams, then the other
 * admission topics, RELAY_OBS_TOPICS_MAX in all. A topic the relay could not
 * publish (not [A-Za-z0-9._-]) is decided but not listed. covered[i] is set
 * for each listed topic whose figures came with its admission row.
 */
static void merge_admission(const char *prefix, struct relay_observation *o, PGresult *r,
                            unsigned char *covered)
{
    struct relay_topic_obs prev[RELAY_OBS_TOPICS_MAX];
    int remap[RELAY_OBS_TOPICS_MAX];
    size_t nprev = o->ntopics, n = 0;
    int rows = PQntuples(r);

    memcpy(prev, o->topics, nprev * sizeof(prev[0]));
    for (size_t i = 0; i < RELAY_OBS_TOPICS_MAX; i++) {
        remap[i] = -1;
        covered[i] = 0;
    }
    o->admission_topics = rows;
    o->admission_refused = 0;
    for (int pass = 0; pass < 3; pass++) {
        if (pass == 1) {
            for (size_t i = 0; i < nprev && n < RELAY_OBS_TOPICS_MAX; i++) {
                if (remap[i] >= 0)
                    continue; /* listed as refused */
                o->topics[n] = prev[i];
                remap[i] = (int)n++;
            }
            continue;
        }
        for (int i = 0; i < rows; i++) {
            int admitting = strcmp(PQgetvalue(r, i, 3), "t") == 0;
            if (admitting != (pass == 2))
                continue;
            if (!admitting)
                o->admission_refused++;
            const char *topic = PQgetvalue(r, i, 0);
            if (!outbox_topic_valid(topic, (size_t)PQgetlength(r, i, 0)))
                continue;
            struct relay_topic_obs *t = find_topic(o->topics, n, topic);
            if (t == NULL) {
                if (n == RELAY_OBS_TOPICS_MAX)
                    continue;
                t = &o->topics[n];
                struct relay_topic_obs *p = find_topic(prev, nprev, topic);
                if (p != NULL) {
                    *t = *p;
                    remap[p - prev] = (int)n;
                } else {
                    memset(t, 0, sizeof(*t));
                    t->partition = -1;
                    snprintf(t->topic, sizeof(t->topic), "%s", topic);
                    snprintf(t->stream, sizeof(t->stream), "%s%s", prefix, topic);
                }
                n++;
            }
            covered[t - o->topics] = 1;
            t->pending = PQgetisnull(r, i, 1) ? 0 : strtoll(PQgetvalue(r, i, 1), NULL, 10);
            t->oldest_pending_age = PQgetisnull(r, i, 2) ? -1 : strtod(PQgetvalue(r, i, 2), NULL);
            t->admitting = admitting;
        }
    }
    for (size_t g = 0; g < o->ngroups; g++) {
        int ti = o->groups[g].topic;
        o->groups[g].topic = ti >= 0 && (size_t)ti < nprev ? remap[ti] : -1;
    }
    o->ntopics = n;
}

/* The walk's figures as admission_decide_sql's and admission_read_sql's
 * arrays (topics, rows waiting, oldest created_at), from outbox_sql's rows;
 * -1 when they found no memory. */
static int admission_args(PGresult *walk, struct outbox_buf arrays[3])
{
    for (int k = 0; k < 3; k++)
        outbox_buf_puts(&arrays[k], "{");
    int first = 1;
    for (int i = 0; i < PQntuples(walk); i++) {
        if (PQgetisnull(walk, i, 9))
            continue;
        relay_pg_array_element(&arrays[0], first, PQgetvalue(walk, i, 9));
        relay_pg_array_element(&arrays[1], first,
                               PQgetisnull(walk, i, 10) ? "0" : PQgetvalue(walk, i, 10));
        relay_pg_array_element(&arrays[2], first,
                               PQgetisnull(walk, i, 12) ? NULL : PQgetvalue(walk, i, 12));
        first = 0;
    }
    for (int k = 0; k < 3; k++)
        outbox_buf_puts(&arrays[k], "}");
    return arrays[0].failed || arrays[1].failed || arrays[2].failed ? -1 : 0;
}

/* A topic's figures from the walk's rows (outbox_sql): none when it has no
 * row waiting and no stream position. */
static void topic_figures(PGresult *walk, struct relay_topic_obs *t)
{
    t->pending = 0;
    t->oldest_pending_age = -1;
    for (int i = 0; i < PQntuples(walk); i++) {
        if (PQgetisnull(walk, i, 9) || strcmp(PQgetvalue(walk, i, 9), t->topic) != 0)
            continue;
        t->pending = PQgetisnull(walk, i, 10) ? 0 : strtoll(PQgetvalue(walk, i, 10), NULL, 10);
        t->oldest_pending_age =
            PQgetisnull(walk, i, 11) ? -1 : strtod(PQgetvalue(walk, i, 11), NULL);
        return;
    }
}

static int pg_observe(const struct relay_config *cfg, PGconn **pg, int stop_fd,
                      int update_admission, struct relay_observation *o)
{
    PGresult *walk =
        relay_pg_exec(pg, cfg, stop_fd, outbox_sql, 0, NULL, o->pg_error, sizeof(o->pg_error));
    if (!pg_rows(walk, o)) {
        /* A schema that is behind fails with whatever object it lacks:
         * say instead which migration to apply. */
        char advice[sizeof(o->pg_error)];
        if (*pg != NULL && relay_pg_schema_check(pg, cfg, stop_fd, advice, sizeof(advice)) == 1) {
            snprintf(o->pg_error, sizeof(o->pg_error), "%s", advice);
            o->pg_schema_behind = 1;
        }
        return -1;
    }
    o->outbox_pending = PQgetisnull(walk, 0, 0) ? 0 : strtoll(PQgetvalue(walk, 0, 0), NULL, 10);
    o->outbox_oldest_age = PQgetisnull(walk, 0, 1) ? -1 : strtod(PQgetvalue(walk, 0, 1), NULL);
    o->quarantined = strtoll(PQgetvalue(walk, 0, 2), NULL, 10);
    o->outbox_bytes = PQgetisnull(walk, 0, 3) ? -1 : strtoll(PQgetvalue(walk, 0, 3), NULL, 10);
    o->outbox_dead_rows = PQgetisnull(walk, 0, 4) ? -1 : strtoll(PQgetvalue(walk, 0, 4), NULL, 10);
    o->blocked_keys = strtoll(PQgetvalue(walk, 0, 5), NULL, 10);
    o->relays = strtoll(PQgetvalue(walk, 0, 6), NULL, 10);
    o->partitions_owned = strtoll(PQgetvalue(walk, 0, 7), NULL, 10);
    o->partitions = strtoll(PQgetvalue(walk, 0, 8), NULL, 10);

    struct outbox_buf arrays[3];
    memset(arrays, 0, sizeof(arrays));
    if (admission_args(walk, arrays) < 0) {
        snprintf(o->pg_error, sizeof(o->pg_error),
                 "no memory for the figures of %d topics: the observation is skipped",
                 PQntuples(walk));
        for (int k = 0; k < 3; k++)
            outbox_buf_free(&arrays[k]);
        PQclear(walk);
        return -1;
    }
    const char *params[3] = {arrays[0].data, arrays[1].data, arrays[2].data};
    PGresult *r = relay_pg_exec(pg, cfg, stop_fd,
                                update_admission ? admission_decide_sql : admission_read_sql, 3,
                                params, o->pg_error, sizeof(o->pg_error));
    for (int k = 0; k < 3; k++)
        outbox_buf_free(&arrays[k]);
    unsigned char covered[RELAY_OBS_TOPICS_MAX] = {0};
    const char *state = r != NULL ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
    int admission_known = 1;
    if (!update_admission && state != NULL && strcmp(state, "42501") == 0) {
        /* Reading only, as a role that may not read the limits: the rest of
         * the observation does not need them; admission stays unknown. */
        PQclear(r);
        admission_known = 0;
    } else {
        if (!pg_rows(r, o)) {
            PQclear(walk);
            return -1;
        }
        merge_admission(cfg->stream_prefix != NULL ? cfg->stream_prefix : "", o, r, covered);
        spread_topic_figures(o, covered);
        PQclear(r);
    }

    /* The streams of topics without limits or state: their figures, for the
     * queue age. They admit (observe_topic admits a topic without limits). */
    for (size_t i = 0; i < o->ntopics; i++) {
        if (covered[i])
            continue;
        o->topics[i].admitting = admission_known ? 1 : -1;
        if (relay_observe_first_of_topic(o, i))
            topic_figures(walk, &o->topics[i]);
    }
    PQclear(walk);
    spread_topic_figures(o, NULL);
    return 0;
}

/* ---- Redis ----------------------------------------------------------- */

/* A non-blocking context from outbox_redis_open with the observer's stop and
 * each command's deadline, connect_timeout. */
struct rconn {
    redisContext *c;
    int stop_fd;
    uint32_t timeout_ms;
};

/* The reply (caller frees), or NULL with rc->c->err set. */
/* Fresh-scan passes of an observation that met a listed stream missing, and
 * the wait before each after the first. */
#define OBSERVE_PASSES 2
#define OBSERVE_PASS_WAIT_S 0.2

#define cmd(rc, ...) outbox_redis_call((rc)->c, (rc)->stop_fd, (rc)->timeout_ms, __VA_ARGS__)

static const redisReply *map_get(const redisReply *m, const char *key)
{
    if (m == NULL || m->type != REDIS_REPLY_ARRAY)
        return NULL;
    for (size_t i = 0; i + 1 < m->elements; i += 2)
        if (m->element[i]->type == REDIS_REPLY_STRING && strcmp(m->element[i]->str, key) == 0)
            return m->element[i + 1];
    return NULL;
}

/* created_at of one entry (or the ms part of its id when it has none). */
static double entry_time(struct rconn *c, const char *stream, const char *id, int exclusive)
{
    redisReply *r = exclusive ? cmd(c, "XRANGE %s (%s + COUNT 1", stream, id)
                              : cmd(c, "XRANGE %s %s %s COUNT 1", stream, id, id);
    double t = -1;
    if (r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 1) {
        const redisReply *e = r->element[0];
        const redisReply *f = e->elements == 2 ? map_get(e->element[1], "created_at") : NULL;
        if (f != NULL && f->type == REDIS_REPLY_STRING)
            t = relay_observe_parse_time(f->str);
        if (t < 0 && e->element[0]->type == REDIS_REPLY_STRING)
            t = strtod(e->element[0]->str, NULL) / 1000.0;
    } else if (r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 0 && !exclusive) {
        t = strtod(id, NULL) / 1000.0; /* deleted entry: its id still dates it */
    }
    if (r != NULL)
        freeReplyObject(r);
    return t;
}

/* The persistence settings, for the durability warning: 0, or -1 with
 * o->redis_error set when the connection failed. */
static int redis_durability(struct rconn *c, struct relay_observation *o)
{
    redisReply *r = cmd(c, "CONFIG GET appendonly");
    redisReply *r2 = cmd(c, "CONFIG GET appendfsync");
    int rc = 0;
    if (r == NULL || r2 == NULL) {
        snprintf(o->redis_error, sizeof(o->redis_error), "%s", c->c->errstr);
        rc = -1;
    } else if (r->type == REDIS_REPLY_ARRAY && r->elements == 2 && r2->type == REDIS_REPLY_ARRAY &&
               r2->elements == 2) {
        snprintf(o->durability, sizeof(o->durability), "appendonly %s, appendfsync %s",
                 r->element[1]->str, r2->element[1]->str);
    } else {
        snprintf(o->durability, sizeof(o->durability), "unknown (CONFIG not permitted)");
    }
    if (r != NULL)
        freeReplyObject(r);
    if (r2 != NULL)
        freeReplyObject(r2);
    return rc;
}

/* Streams: the topic streams of the list on this node (dead-letter and
 * replay streams are not topics), scanning the node first when the list
 * says so. Other keys are someone else's, and their names may be any bytes:
 * a name that is not UTF-8 would make the topics query fail as a whole, so
 * only valid topics are listed. 0, or -1 with o->redis_error set. */
static int redis_streams(const struct relay_config *cfg, struct rconn *c,
                         struct relay_stream_list *list, struct relay_observation *o)
{
    const char *prefix = cfg->stream_prefix != NULL ? cfg->stream_prefix : "";
    size_t plen = strlen(prefix);
    uint32_t node;
    if (relay_stream_list_node(list, c->c, prefix, c->stop_fd, c->timeout_ms, &node, o->redis_error,
                               sizeof(o->redis_error)) < 0)
        return -1;
    for (size_t i = 0; i < list->n && o->ntopics < RELAY_OBS_TOPICS_MAX; i++) {
        const struct relay_listed_stream *s = &list->streams[i];
        if (s->node != node || s->kind != RELAY_STREAM_TOPIC)
            continue;
        int partition = -1;
        size_t tlen = outbox_key_stream_topic_len(s->key + plen, s->len - plen, &partition);
        struct relay_topic_obs *t = &o->topics[o->ntopics++];
        snprintf(t->stream, sizeof(t->stream), "%s", s->key);
        snprintf(t->topic, sizeof(t->topic), "%.*s", (int)tlen, s->key + plen);
        t->partition = partition;
        t->oldest_pending_age = -1;
        t->admitting = -1;
        t->memory_bytes = -1;
    }
    return 0;
}

static long long int_field(const redisReply *info, const char *key, long long missing)
{
    const redisReply *v = map_get(info, key);
    return v != NULL && v->type == REDIS_REPLY_INTEGER ? v->integer : missing;
}

/* One group of a stream, from its XINFO GROUPS entry, with the ages of its
 * oldest pending and oldest undelivered entries and its dead letters. */
static void redis_group(struct rconn *c, const char *stream, const redisReply *info,
                        struct relay_group_obs *go)
{
    go->consumers = int_field(info, "consumers", 0);
    go->pending = int_field(info, "pending", 0);
    go->lag = int_field(info, "lag", -1);
    go->oldest_pending_age = go->oldest_undelivered_age = -1;
    double now = now_unix();
    if (go->pending > 0) {
        redisReply *p = cmd(c, "XPENDING %s %s", stream, go->group);
        if (p != NULL && p->type == REDIS_REPLY_ARRAY && p->elements >= 2 &&
            p->element[1]->type == REDIS_REPLY_STRING) {
            double t = entry_time(c, stream, p->element[1]->str, 0);
            if (t > 0)
                go->oldest_pending_age = now - t;
        }
        if (p != NULL)
            freeReplyObject(p);
    }
    const redisReply *last = map_get(info, "last-delivered-id");
    if (last != NULL && last->type == REDIS_REPLY_STRING) {
        double t = entry_time(c, stream, last->str, 1);
        if (t > 0)
            go->oldest_undelivered_age = now - t;
    }
    char dlq[OUTBOX_TOPIC_MAX + 300];
    if (outbox_key_dlq(stream, go->group, dlq, sizeof(dlq)) < 0)
        dlq[0] = '\0'; /* cannot happen: both names are bounded above */
    redisReply *d = cmd(c, "XLEN %s", dlq);
    go->dead_letters = d != NULL && d->type == REDIS_REPLY_INTEGER ? d->integer : 0;
    if (d != NULL)
        freeReplyObject(d);
}

/* used_memory from INFO memory, when Redis answers it. */
static void redis_memory(struct rconn *c, struct relay_observation *o)
{
    redisReply *r = cmd(c, "INFO memory");
    if (r != NULL && r->type == REDIS_REPLY_STRING) {
        const char *p = strstr(r->str, "\nused_memory:"); /* after "# Memory" */
        if (p != NULL)                                    /* summed over a cluster's primaries */
            o->redis_used_memory =
                (o->redis_used_memory > 0 ? o->redis_used_memory : 0) + strtoll(p + 13, NULL, 10);
    }
    if (r != NULL)
        freeReplyObject(r);
}

static int redis_observe(const struct relay_config *cfg, struct rconn *c,
                         struct relay_stream_list *list, struct relay_observation *o)
{
    size_t first = o->ntopics;
    if (redis_durability(c, o) < 0 || redis_streams(cfg, c, list, o) < 0)
        return -1;
    redis_memory(c, o);
    for (size_t ti = first; ti < o->ntopics; ti++) {
        const char *stream = o->topics[ti].stream;
        redisReply *m = cmd(c, "MEMORY USAGE %s", stream);
        if (m != NULL && m->type == REDIS_REPLY_INTEGER)
            o->topics[ti].memory_bytes = m->integer;
        if (m != NULL)
            freeReplyObject(m);
        redisReply *r = cmd(c, "XINFO GROUPS %s", stream);
        if (r == NULL) {
            snprintf(o->redis_error, sizeof(o->redis_error), "%s", c->c->errstr);
            return -1;
        }
        if (r->type == REDIS_REPLY_ERROR)
            relay_stream_list_forget(list); /* deleted since the list was made */
        for (size_t g = 0;
             r->type == REDIS_REPLY_ARRAY && g < r->elements && o->ngroups < RELAY_OBS_GROUPS_MAX;
             g++) {
            const redisReply *name = map_get(r->element[g], "name");
            if (name == NULL || name->type != REDIS_REPLY_STRING)
                continue;
            struct relay_group_obs *go = &o->groups[o->ngroups++];
            memset(go, 0, sizeof(*go));
            snprintf(go->stream, sizeof(go->stream), "%s", stream);
            snprintf(go->group, sizeof(go->group), "%s", name->str);
            go->topic = (int)ti;
            redis_group(c, stream, r->element[g], go);
        }
        freeReplyObject(r);
    }
    return 0;
}

/* redis_observe on one primary of a cluster, or on the one server. */
struct observe_each {
    const struct relay_config *cfg;
    struct relay_stream_list *list;
    struct relay_observation *o;
    int stop_fd;
};

static int observe_node(redisContext *node, void *arg)
{
    struct observe_each *e = arg;
    struct rconn rc = {node, e->stop_fd, e->cfg->connect_timeout_ms};
    return redis_observe(e->cfg, &rc, e->list, e->o);
}

static void finish_queue_ages(struct relay_observation *o)
{
    for (size_t i = 0; i < o->ngroups; i++) {
        struct relay_group_obs *g = &o->groups[i];
        double age = 0;
        if (g->oldest_pending_age > age)
            age = g->oldest_pending_age;
        if (g->oldest_undelivered_age > age)
            age = g->oldest_undelivered_age;
        if (g->topic >= 0 && o->topics[g->topic].oldest_pending_age > age)
            age = o->topics[g->topic].oldest_pending_age;
        g->queue_age = age;
    }
}

int relay_observe(const struct relay_config *cfg, PGconn **pg, redisContext **rd,
                  int update_admission, const struct relay_observe_stop *stop,
                  struct relay_stream_list *streams, struct relay_observation *o)
{
    struct relay_stream_list once;
    memset(&once, 0, sizeof(once));
    struct relay_stream_list *list = streams != NULL ? streams : &once;
    if (streams == NULL)
        relay_stream_list_round(&once, NULL, 0, 0);
    memset(o, 0, sizeof(*o));
    o->taken_at = now_unix();
    o->outbox_oldest_age = -1;
    o->outbox_bytes = o->outbox_dead_rows = o->redis_used_memory = -1;
    o->oldest_sent_age = -1;

    if (*rd != NULL && (*rd)->err) {
        redisFree(*rd);
        *rd = NULL;
    }
    enum outbox_redis_fault fault;
    if (*rd == NULL)
        *rd = outbox_redis_open(&cfg->redis_url, cfg->connect_timeout_ms, cfg->connect_timeout_ms,
                                relay_observe_stop_fd(stop), o->redis_error, sizeof(o->redis_error),
                                &fault);
    if (*rd != NULL) {
        struct observe_each each = {cfg, list, o, relay_observe_stop_fd(stop)};
        o->redis_ok = outbox_redis_each_primary(*rd, &cfg->redis_url, cfg->connect_timeout_ms,
                                                cfg->connect_timeout_ms, each.stop_fd, observe_node,
                                                &each, o->redis_error, sizeof(o->redis_error)) == 0;
        /* A listed stream was gone, or in another primary's slot: observe
         * again from a fresh scan, so that no topic is shown without its
         * groups (backpressure would release a paused one). While a slot
         * migrates, the stream can be missing from both primaries' answers
         * (ASK from one, MOVED from the other) until the slot's owner
         * changes: after a short wait, a third look. */
        for (int pass = 0; pass < OBSERVE_PASSES && o->redis_ok && relay_stream_list_rescan(list);
             pass++) {
            if (pass > 0 &&
                outbox_wait_fd(-1, 0, each.stop_fd, outbox_mono_now() + OBSERVE_PASS_WAIT_S) ==
                    OUTBOX_WAIT_STOPPED)
                break;
            o->ntopics = 0;
            o->ngroups = 0;
            o->redis_used_memory = -1;
            o->redis_ok =
                outbox_redis_each_primary(*rd, &cfg->redis_url, cfg->connect_timeout_ms,
                                          cfg->connect_timeout_ms, each.stop_fd, observe_node,
                                          &each, o->redis_error, sizeof(o->redis_error)) == 0;
        }
        if (!o->redis_ok && (*rd)->err) {
            redisFree(*rd);
            *rd = NULL;
        }
    }

    if (*pg != NULL && PQstatus(*pg) != CONNECTION_OK) {
        PQfinish(*pg);
        *pg = NULL;
    }
    if (*pg == NULL)
        *pg = relay_pg_open(cfg, "outbox-relay observe", relay_observe_stop_fd(stop), o->pg_error,
                            sizeof(o->pg_error));
    if (*pg != NULL)
        o->pg_ok = pg_observe(cfg, pg, relay_observe_stop_fd(stop), update_admission, o) == 0;
    finish_queue_ages(o);
    relay_stream_list_free(&once);
    return o->pg_ok && o->redis_ok ? 0 : -1;
}
