/*
 * bench-loadgen: producers at a fixed rate and two consumers, to measure the
 * time from a producer's commit to its entry in the stream and to its
 * acknowledgement by a consumer group.
 *
 *   producers  P threads, one connection each, committing single-row
 *              transactions (INSERT ... RETURNING id in autocommit: the reply
 *              comes after the commit) on a shared open-loop schedule of
 *              `rate` rows per second; the commit time is the monotonic clock
 *              right after the reply. rate 0: as fast as they can.
 *   visible    one thread doing XREAD BLOCK on every stream from its last
 *              entry on; an entry is visible when the reply holding it arrives:
 *              commit -> visible is the latency a reader sees, the same
 *              measure for the relay and for PgQ. (An entry id's time part
 *              says nothing of when the entry was added: the relay writes
 *              the time of the tick whose batch holds the row, PostgreSQL's
 *              clock, and bench-pgq lets Redis choose.)
 *   acked      one thread doing XREADGROUP BLOCK as consumer group `group`
 *              and XACK of what it read; acknowledged when the XACK returns.
 *
 * Entries are matched to commits by their outbox_id field (the row's id, as
 * unique as its message_id and an array index here). All clocks are this
 * process's CLOCK_MONOTONIC. An entry can be visible before its producer saw
 * the commit reply (the relay read and published it in between): that latency is
 * negative, and kept.
 *
 *   bench-loadgen --postgres CONNINFO --redis-port PORT [--redis-host HOST]
 *                 --rate R (--seconds S | --count N) [--producers P]
 *                 [--topics T] [--payload BYTES] [--group NAME] [--wait S]
 *                 [--windows W] [--pgq QUEUE] [--async-commit 1]
 *
 * --pgq QUEUE produces PgQ events instead of outbox rows, for the benchmark's
 * side-by-side section: pgq.insert_event(QUEUE, topic, payload) with a text
 * payload of the same size, matched to stream entries by the event id (which
 * bench-pgq writes as the outbox_id field). "duplicate_visible" counts entries
 * whose id was already seen: a message published twice. --async-commit 1 makes
 * the producers commit with synchronous_commit off, so that the WAL flush does
 * not cap the rate they can offer.
 *
 * --windows W adds "windows": the latency of the rows committed in each W
 * seconds of the run (its start "t" in seconds from the first commit, "n",
 * "missing" for rows not seen in the stream; commit -> visible "p50", "p99"
 * and "max" in ms), for a run long enough to show how it changes.
 * Topics are bench0..bench<T-1>, round-robin. Prints one JSON object.
 */
#include "common/compat.h"

#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_TOPICS 16
#define MAX_PRODUCERS 256

static const char *conninfo;
static const char *rhost = "127.0.0.1";
static int rport = 6379;
static double rate = 0;
static double seconds = 0;
static long count = 0;
static int producers = 4;
static int ntopics = 4;
static int payload_bytes = 200;
static const char *group = "bench";
static double wait_s = 10;
static double windows_s = 0;
static const char *pgq_queue; /* --pgq: PgQ events instead of outbox rows */
static int async_commit;      /* --async-commit: producers with synchronous_commit off */

static long long base_id; /* ids above it are ours */
static long cap;          /* slots in the arrays below */
static double *t_commit, *t_visible, *t_acked;
static double t0;

static atomic_long slot_next; /* next schedule slot */
static atomic_long committed; /* rows committed by the producers */
static atomic_long n_visible, n_acked, out_of_range, dup_visible;
static atomic_int producers_done;
static atomic_int consumers_stop;
/* Producers connect and prepare before the clock starts (producers_go), and
 * stay connected until the consumers have stopped: the start and the exit of
 * their server sessions are not part of the load being measured. */
static atomic_int producers_ready, producers_finished, producers_go, producers_failed;
static double last_commit_at; /* under last_lock */
static pthread_mutex_t last_lock = PTHREAD_MUTEX_INITIALIZER;

struct producer {
    pthread_t thread;
    int index;
    double *commit_lat; /* seconds, one per commit */
    long ncommit, capcommit;
    char error[512];
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_until(double t)
{
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0)
        ;
}

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "bench-loadgen: %s: %s\n", what, detail ? detail : "");
    exit(1);
}

/* An allocation that cannot fail: the tool stops, saying so. */
static void *need(void *p)
{
    if (p == NULL)
        die("out of memory", "run with a smaller --rate, --seconds or --count");
    return p;
}

static void *producer_main(void *arg)
{
    struct producer *p = arg;
    PGconn *pg = PQconnectdb(conninfo);
    if (PQstatus(pg) != CONNECTION_OK) {
        snprintf(p->error, sizeof(p->error), "connect: %s", PQerrorMessage(pg));
        PQfinish(pg);
        atomic_fetch_add(&producers_failed, 1);
        return NULL;
    }
    if (async_commit) {
        PGresult *set = PQexec(pg, "SET synchronous_commit = off");
        int ok = PQresultStatus(set) == PGRES_COMMAND_OK;
        PQclear(set);
        if (!ok) {
            snprintf(p->error, sizeof(p->error), "SET: %s", PQerrorMessage(pg));
            PQfinish(pg);
            atomic_fetch_add(&producers_failed, 1);
            return NULL;
        }
    }
    PGresult *res = PQprepare(pg, "ins",
                              pgq_queue ? "SELECT pgq.insert_event($3, $1, $2)"
                                        : "INSERT INTO outbox.messages (topic, payload)"
                                          " VALUES ($1, $2) RETURNING id",
                              pgq_queue ? 3 : 2, NULL);
    if (PQresultStatus(res) != PGRES_COMMAND_OK) {
        snprintf(p->error, sizeof(p->error), "prepare: %s", PQerrorMessage(pg));
        PQclear(res);
        PQfinish(pg);
        atomic_fetch_add(&producers_failed, 1);
        return NULL;
    }
    PQclear(res);
    atomic_fetch_add(&producers_ready, 1);
    while (!atomic_load(&producers_go))
        sleep_until(now_s() + 0.001);
    char *payload = need(malloc((size_t)payload_bytes + 1));
    unsigned seed = 12345u + (unsigned)p->index;
    for (int i = 0; i < payload_bytes; i++)
        payload[i] = pgq_queue ? (char)('a' + rand_r(&seed) % 26) : (char)(rand_r(&seed) & 0xff);
    payload[payload_bytes] = '\0'; /* PgQ's ev_data is text */
    char topics[MAX_TOPICS][24];
    for (int i = 0; i < ntopics; i++)
        snprintf(topics[i], sizeof(topics[i]), "bench%d", i);
    int lens[3] = {0, payload_bytes, 0}, formats[3] = {0, pgq_queue ? 0 : 1, 0};
    double end = t0 + seconds;

    for (;;) {
        long slot = atomic_fetch_add(&slot_next, 1);
        if (count > 0 && slot >= count)
            break;
        if (rate > 0) {
            double at = t0 + (double)slot / rate;
            if (seconds > 0 && at >= end)
                break;
            if (at > now_s())
                sleep_until(at);
        } else if (seconds > 0 && now_s() >= end) {
            break;
        }
        const char *params[3] = {topics[slot % ntopics], payload, pgq_queue};
        double started = now_s();
        res = PQexecPrepared(pg, "ins", pgq_queue ? 3 : 2, params, lens, formats, 0);
        double done = now_s();
        if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
            snprintf(p->error, sizeof(p->error), "insert: %s", PQerrorMessage(pg));
            PQclear(res);
            break;
        }
        long long id = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
        PQclear(res);
        long idx = (long)(id - base_id);
        if (idx >= 0 && idx < cap)
            t_commit[idx] = done - t0;
        else
            atomic_fetch_add(&out_of_range, 1);
        if (p->ncommit == p->capcommit) {
            p->capcommit = p->capcommit ? p->capcommit * 2 : 4096;
            p->commit_lat = need(realloc(p->commit_lat, (size_t)p->capcommit * sizeof(double)));
        }
        p->commit_lat[p->ncommit++] = done - started;
        atomic_fetch_add(&committed, 1);
        pthread_mutex_lock(&last_lock);
        if (done > last_commit_at)
            last_commit_at = done;
        pthread_mutex_unlock(&last_lock);
    }
    free(payload);
    atomic_fetch_add(&producers_finished, 1);
    while (!atomic_load(&consumers_stop))
        sleep_until(now_s() + 0.005);
    PQfinish(pg);
    return NULL;
}

static redisContext *redis_connect(void)
{
    redisContext *rd = redisConnect(rhost, rport);
    if (rd == NULL || rd->err)
        die("cannot connect to Redis", rd ? rd->errstr : "out of memory");
    return rd;
}

/* The outbox_id field of one entry ([id, [f, v, f, v ...]]), or -1. */
static long long entry_outbox_id(const redisReply *entry)
{
    if (entry->type != REDIS_REPLY_ARRAY || entry->elements != 2)
        return -1;
    const redisReply *fields = entry->element[1];
    if (fields->type != REDIS_REPLY_ARRAY)
        return -1;
    for (size_t i = 0; i + 1 < fields->elements; i += 2) {
        const redisReply *f = fields->element[i];
        if (f->type == REDIS_REPLY_STRING && f->len == 9 && memcmp(f->str, "outbox_id", 9) == 0)
            return strtoll(fields->element[i + 1]->str, NULL, 10);
    }
    return -1;
}

static int all_seen(atomic_long *n)
{
    return atomic_load(&producers_done) && atomic_load(n) >= atomic_load(&committed);
}

static void *visible_main(void *arg)
{
    (void)arg;
    redisContext *rd = redis_connect();
    char last[MAX_TOPICS][64];
    char names[MAX_TOPICS][24];
    const char *argv[4 + 2 * MAX_TOPICS];
    for (int i = 0; i < ntopics; i++) {
        snprintf(names[i], sizeof(names[i]), "bench%d", i);
        redisReply *r = redisCommand(rd, "XREVRANGE %s + - COUNT 1", names[i]);
        if (r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 1)
            snprintf(last[i], sizeof(last[i]), "%s", r->element[0]->element[0]->str);
        else
            snprintf(last[i], sizeof(last[i]), "0-0");
        freeReplyObject(r);
    }
    while (!atomic_load(&consumers_stop) && !all_seen(&n_visible)) {
        int argc = 0;
        argv[argc++] = "XREAD";
        argv[argc++] = "COUNT";
        argv[argc++] = "10000";
        argv[argc++] = "BLOCK";
        argv[argc++] = "100";
        argv[argc++] = "STREAMS";
        for (int i = 0; i < ntopics; i++)
            argv[argc++] = names[i];
        for (int i = 0; i < ntopics; i++)
            argv[argc++] = last[i];
        redisReply *r = redisCommandArgv(rd, argc, argv, NULL);
        double at = now_s() - t0;
        if (r == NULL)
            die("XREAD", rd->errstr);
        if (r->type == REDIS_REPLY_ARRAY) {
            for (size_t s = 0; s < r->elements; s++) {
                const redisReply *sr = r->element[s];
                const redisReply *entries = sr->element[1];
                int ti = -1;
                for (int i = 0; i < ntopics; i++)
                    if (strcmp(names[i], sr->element[0]->str) == 0)
                        ti = i;
                for (size_t e = 0; e < entries->elements; e++) {
                    long long id = entry_outbox_id(entries->element[e]);
                    long idx = (long)(id - base_id);
                    if (id > 0 && idx >= 0 && idx < cap && t_visible[idx] < -1e8) {
                        t_visible[idx] = at;
                        atomic_fetch_add(&n_visible, 1);
                    } else if (id > 0 && idx >= 0 && idx < cap) {
                        atomic_fetch_add(&dup_visible, 1);
                    }
                }
                if (ti >= 0 && entries->elements > 0)
                    snprintf(last[ti], sizeof(last[ti]), "%s",
                             entries->element[entries->elements - 1]->element[0]->str);
            }
        } else if (r->type == REDIS_REPLY_ERROR) {
            die("XREAD", r->str);
        }
        freeReplyObject(r);
    }
    redisFree(rd);
    return NULL;
}

static void *acked_main(void *arg)
{
    (void)arg;
    redisContext *rd = redis_connect();
    char names[MAX_TOPICS][24];
    const char *argv[8 + 2 * MAX_TOPICS];
    const char **ack = need(malloc((10000 + 3) * sizeof(*ack)));
    long *pending_idx = need(malloc(10000 * MAX_TOPICS * sizeof(*pending_idx)));
    for (int i = 0; i < ntopics; i++)
        snprintf(names[i], sizeof(names[i]), "bench%d", i);
    while (!atomic_load(&consumers_stop) && !all_seen(&n_acked)) {
        int argc = 0;
        argv[argc++] = "XREADGROUP";
        argv[argc++] = "GROUP";
        argv[argc++] = group;
        argv[argc++] = "c1";
        argv[argc++] = "COUNT";
        argv[argc++] = "10000";
        argv[argc++] = "BLOCK";
        argv[argc++] = "100";
        argv[argc++] = "STREAMS";
        for (int i = 0; i < ntopics; i++)
            argv[argc++] = names[i];
        for (int i = 0; i < ntopics; i++)
            argv[argc++] = ">";
        redisReply *r = redisCommandArgv(rd, argc, argv, NULL);
        if (r == NULL)
            die("XREADGROUP", rd->errstr);
        if (r->type == REDIS_REPLY_ERROR)
            die("XREADGROUP", r->str);
        long npending = 0;
        int nacks = 0;
        if (r->type == REDIS_REPLY_ARRAY) {
            for (size_t s = 0; s < r->elements; s++) {
                const redisReply *sr = r->element[s];
                const redisReply *entries = sr->element[1];
                if (entries->elements == 0)
                    continue;
                int n = 0;
                ack[n++] = "XACK";
                ack[n++] = sr->element[0]->str;
                ack[n++] = group;
                for (size_t e = 0; e < entries->elements; e++) {
                    ack[n++] = entries->element[e]->element[0]->str;
                    long long id = entry_outbox_id(entries->element[e]);
                    long idx = (long)(id - base_id);
                    if (id > 0 && idx >= 0 && idx < cap)
                        pending_idx[npending++] = idx;
                }
                redisAppendCommandArgv(rd, n, ack, NULL);
                nacks++;
            }
        }
        for (int i = 0; i < nacks; i++) {
            void *ar = NULL;
            if (redisGetReply(rd, &ar) != REDIS_OK)
                die("XACK", rd->errstr);
            freeReplyObject(ar);
        }
        double at = now_s() - t0;
        for (long i = 0; i < npending; i++) {
            if (t_acked[pending_idx[i]] < -1e8) {
                t_acked[pending_idx[i]] = at;
                atomic_fetch_add(&n_acked, 1);
            }
        }
        freeReplyObject(r);
    }
    free(ack);
    free(pending_idx);
    redisFree(rd);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(const double *v, long n, double p)
{
    if (n == 0)
        return NAN;
    long i = (long)ceil(p / 100.0 * (double)n) - 1;
    if (i < 0)
        i = 0;
    if (i >= n)
        i = n - 1;
    return v[i];
}

static void print_stats(const char *name, double *v, long n, int last)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    double sum = 0;
    for (long i = 0; i < n; i++)
        sum += v[i];
    printf("  \"%s\": {\"n\": %ld", name, n);
    if (n > 0)
        printf(", \"min\": %.4f, \"mean\": %.4f, \"p50\": %.4f, \"p90\": %.4f, \"p99\": %.4f,"
               " \"p999\": %.4f, \"max\": %.4f",
               v[0] * 1e3, sum / (double)n * 1e3, pct(v, n, 50) * 1e3, pct(v, n, 90) * 1e3,
               pct(v, n, 99) * 1e3, pct(v, n, 99.9) * 1e3, v[n - 1] * 1e3);
    printf("}%s\n", last ? "" : ",");
}

/* A row's window and its commit -> visible latency (missing: not seen). */
struct windowed {
    long window;
    int missing;
    double latency;
};

static int cmp_windowed(const void *a, const void *b)
{
    const struct windowed *x = a, *y = b;
    if (x->window != y->window)
        return x->window < y->window ? -1 : 1;
    return x->latency < y->latency ? -1 : x->latency > y->latency;
}

/* "windows": one object per windows_s seconds of commits, in order. */
static void print_windows(void)
{
    struct windowed *w = need(malloc((size_t)cap * sizeof(*w)));
    double *lat = need(malloc((size_t)cap * sizeof(double)));
    long n = 0;
    for (long i = 0; i < cap; i++)
        if (t_commit[i] > -1e8) {
            w[n].window = (long)(t_commit[i] / windows_s); /* from t0 already */
            w[n].missing = t_visible[i] < -1e8;
            w[n].latency = w[n].missing ? 0 : t_visible[i] - t_commit[i];
            n++;
        }
    qsort(w, (size_t)n, sizeof(*w), cmp_windowed);
    printf("  \"windows\": [");
    for (long i = 0, first = 1; i < n;) {
        long j = i, nl = 0, missing = 0;
        for (; j < n && w[j].window == w[i].window; j++) {
            if (w[j].missing) {
                missing++;
            } else {
                lat[nl++] = w[j].latency;
            }
        }
        printf("%s\n    {\"t\": %.1f, \"n\": %ld, \"missing\": %ld", first ? "" : ",",
               (double)w[i].window * windows_s, j - i, missing);
        if (nl > 0) {
            printf(", \"p50\": %.4f, \"p99\": %.4f, \"max\": %.4f", pct(lat, nl, 50) * 1e3,
                   pct(lat, nl, 99) * 1e3, lat[nl - 1] * 1e3);
        }
        printf("}");
        first = 0;
        i = j;
    }
    printf("\n  ],\n");
    free(w);
    free(lat);
}

int main(int argc, char **argv)
{
    long max_rows = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL)
            die("usage", "see the comment at the top of bench/loadgen.c");
        i++;
        if (strcmp(a, "--postgres") == 0)
            conninfo = v;
        else if (strcmp(a, "--redis-host") == 0)
            rhost = v;
        else if (strcmp(a, "--redis-port") == 0)
            rport = atoi(v);
        else if (strcmp(a, "--rate") == 0)
            rate = atof(v);
        else if (strcmp(a, "--seconds") == 0)
            seconds = atof(v);
        else if (strcmp(a, "--count") == 0)
            count = atol(v);
        else if (strcmp(a, "--producers") == 0)
            producers = atoi(v);
        else if (strcmp(a, "--topics") == 0)
            ntopics = atoi(v);
        else if (strcmp(a, "--payload") == 0)
            payload_bytes = atoi(v);
        else if (strcmp(a, "--group") == 0)
            group = v;
        else if (strcmp(a, "--wait") == 0)
            wait_s = atof(v);
        else if (strcmp(a, "--windows") == 0)
            windows_s = atof(v);
        else if (strcmp(a, "--max-rows") == 0)
            max_rows = atol(v);
        else if (strcmp(a, "--pgq") == 0)
            pgq_queue = v;
        else if (strcmp(a, "--async-commit") == 0)
            async_commit = atoi(v);
        else
            die("unknown option", a);
    }
    if (conninfo == NULL || (seconds <= 0 && count <= 0) || producers < 1 ||
        producers > MAX_PRODUCERS || ntopics < 1 || ntopics > MAX_TOPICS || payload_bytes < 0)
        die("usage", "--postgres CONNINFO --redis-port PORT --rate R (--seconds S | --count N)");

    if (max_rows <= 0)
        max_rows = count > 0 ? count : (long)((rate > 0 ? rate : 50000.0) * seconds * 1.5);
    cap = max_rows + 10000;
    t_commit = need(malloc((size_t)cap * sizeof(double)));
    t_visible = need(malloc((size_t)cap * sizeof(double)));
    t_acked = need(malloc((size_t)cap * sizeof(double)));
    for (long i = 0; i < cap; i++)
        t_commit[i] = t_visible[i] = t_acked[i] = -1e9;

    /* Every row inserted from now on has an id above base_id. */
    PGconn *pg = PQconnectdb(conninfo);
    if (PQstatus(pg) != CONNECTION_OK)
        die("cannot connect to PostgreSQL", PQerrorMessage(pg));
    const char *seq_params[1] = {pgq_queue};
    PGresult *res =
        pgq_queue ? PQexecParams(pg,
                                 "SELECT nextval(queue_event_seq::regclass) FROM pgq.queue"
                                 " WHERE queue_name = $1",
                                 1, NULL, seq_params, NULL, NULL, 0)
                  : PQexec(pg, "SELECT nextval(pg_get_serial_sequence('outbox.messages', 'id'))");
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1)
        die("reading the id sequence", PQerrorMessage(pg));
    base_id = strtoll(PQgetvalue(res, 0, 0), NULL, 10) + 1;
    PQclear(res);
    PQfinish(pg);

    /* The group starts at the streams' ends: it sees only our entries. */
    redisContext *rd = redis_connect();
    for (int i = 0; i < ntopics; i++) {
        redisReply *r = redisCommand(rd, "XGROUP CREATE bench%d %s $ MKSTREAM", i, group);
        if (r != NULL && r->type == REDIS_REPLY_ERROR && strncmp(r->str, "BUSYGROUP", 9) != 0)
            die("XGROUP CREATE", r->str);
        freeReplyObject(r);
        r = redisCommand(rd, "XGROUP SETID bench%d %s $", i, group);
        freeReplyObject(r);
    }
    redisFree(rd);

    t0 = now_s();
    pthread_t vis, ack;
    pthread_create(&vis, NULL, visible_main, NULL);
    pthread_create(&ack, NULL, acked_main, NULL);
    struct producer *ps = need(calloc((size_t)producers, sizeof(*ps)));
    for (int i = 0; i < producers; i++) {
        ps[i].index = i;
        pthread_create(&ps[i].thread, NULL, producer_main, &ps[i]);
    }
    while (atomic_load(&producers_ready) + atomic_load(&producers_failed) < producers)
        sleep_until(now_s() + 0.005);
    sleep_until(now_s() + 0.2); /* consumers blocking before the first commit */
    t0 = now_s();
    atomic_store(&producers_go, 1);
    while (atomic_load(&producers_finished) + atomic_load(&producers_failed) < producers)
        sleep_until(now_s() + 0.001);
    double produced_at = now_s();
    atomic_store(&producers_done, 1);
    while (now_s() < produced_at + wait_s && (!all_seen(&n_visible) || !all_seen(&n_acked)))
        sleep_until(now_s() + 0.01);
    atomic_store(&consumers_stop, 1);
    pthread_join(vis, NULL);
    pthread_join(ack, NULL);
    for (int i = 0; i < producers; i++)
        pthread_join(ps[i].thread, NULL);

    long n_committed = atomic_load(&committed);
    double span = last_commit_at - t0;
    double *vis_lat = need(malloc((size_t)cap * sizeof(double)));
    double *ack_lat = need(malloc((size_t)cap * sizeof(double)));
    long nv = 0, na = 0, miss_v = 0, miss_a = 0;
    for (long i = 0; i < cap; i++) {
        if (t_commit[i] < -1e8)
            continue;
        if (t_visible[i] > -1e8) {
            vis_lat[nv++] = t_visible[i] - t_commit[i];
        } else {
            miss_v++;
        }
        if (t_acked[i] > -1e8)
            ack_lat[na++] = t_acked[i] - t_commit[i];
        else
            miss_a++;
    }
    long ncl = 0;
    for (int i = 0; i < producers; i++)
        ncl += ps[i].ncommit;
    double *commit_lat = need(malloc(((size_t)ncl + 1) * sizeof(double)));
    ncl = 0;
    for (int i = 0; i < producers; i++) {
        memcpy(commit_lat + ncl, ps[i].commit_lat, (size_t)ps[i].ncommit * sizeof(double));
        ncl += ps[i].ncommit;
    }
    int failed = 0;
    for (int i = 0; i < producers; i++)
        if (ps[i].error[0]) {
            fprintf(stderr, "bench-loadgen: producer %d: %s\n", i, ps[i].error);
            failed = 1;
        }

    printf("{\n  \"target_rate\": %.1f, \"producers\": %d, \"committed\": %ld,"
           " \"seconds\": %.3f, \"achieved_rate\": %.1f,\n"
           "  \"missing_visible\": %ld, \"missing_acked\": %ld, \"out_of_range\": %ld,"
           " \"duplicate_visible\": %ld,\n",
           rate, producers, n_committed, span, span > 0 ? n_committed / span : 0.0, miss_v, miss_a,
           atomic_load(&out_of_range), atomic_load(&dup_visible));
    if (windows_s > 0)
        print_windows();
    print_stats("commit_ms", commit_lat, ncl, 0);
    print_stats("visible_ms", vis_lat, nv, 0);
    print_stats("acked_ms", ack_lat, na, 1);
    printf("}\n");
    for (int i = 0; i < producers; i++)
        free(ps[i].commit_lat);
    free(ps);
    free(commit_lat);
    free(ack_lat);
    free(vis_lat);
    free(t_acked);
    free(t_visible);
    free(t_commit);
    return failed ? 1 : 0;
}
