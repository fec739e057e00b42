/*
 * bench-pgq: what a user would build instead of the relay with PgQ (Debian's
 * postgresql-15-pgq3), for the benchmark's side-by-side section. Producers
 * call pgq.insert_event(queue, topic, payload) in their transaction; this
 * consumer moves the events to Redis Streams, one stream per event type:
 *
 *   loop {
 *     pgq.ticker(queue)          the ticker, run here instead of by pgqd, so
 *                                that a tick follows each new event at once
 *     BEGIN
 *     pgq.next_batch(queue, consumer)       NULL: nothing new, sleep poll_ms
 *     pgq.get_batch_cursor(batch, 'c', fetch), then FETCH fetch FROM c
 *     XADD <ev_type> * outbox_id <ev_id> topic <ev_type> payload <ev_data>,
 *       pipelined per fetch, every reply waited for
 *     pgq.finish_batch(batch)
 *     COMMIT
 *   }
 *
 * At least once: a batch whose COMMIT is lost is delivered again, whole. There
 * is no record in Redis that would absorb such a copy: PgQ itself has none,
 * and this is the plain consumer its documentation describes. The queue and
 * the consumer are created by the caller (bench/bench.py); the queue's
 * ticker_max_count should be 1, so that one new event is enough for a tick.
 *
 *   bench-pgq --postgres CONNINFO --redis-port PORT --queue Q [--consumer C]
 *             [--redis-host HOST] [--fetch N] [--poll-ms MS] [--until N]
 *
 * It runs until SIGTERM, or with --until N until N events are published, and
 * then prints one JSON line. The benchmark reads its CPU time from /proc while
 * it runs.
 */
#include "common/compat.h"

#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "bench-pgq: %s: %s\n", what, detail ? detail : "");
    exit(1);
}

static PGresult *run(PGconn *pg, const char *sql, int n, const char *const *params)
{
    PGresult *res = PQexecParams(pg, sql, n, NULL, params, NULL, NULL, 0);
    ExecStatusType st = PQresultStatus(res);
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", PQerrorMessage(pg));
        PQclear(res);
        die(sql, msg);
    }
    return res;
}

/* XADDs every row of res (ev_id, ev_type, ev_data), pipelined; returns how many. */
static long publish(redisContext *rd, PGresult *res)
{
    int n = PQntuples(res);
    int c_id = PQfnumber(res, "ev_id"), c_type = PQfnumber(res, "ev_type"),
        c_data = PQfnumber(res, "ev_data");
    if (c_id < 0 || c_type < 0 || c_data < 0)
        die("batch rows", "no ev_id, ev_type or ev_data column");
    for (int i = 0; i < n; i++) {
        const char *argv[9] = {"XADD",
                               PQgetvalue(res, i, c_type),
                               "*",
                               "outbox_id",
                               PQgetvalue(res, i, c_id),
                               "topic",
                               PQgetvalue(res, i, c_type),
                               "payload",
                               PQgetvalue(res, i, c_data)};
        size_t lens[9];
        for (int k = 0; k < 9; k++)
            lens[k] = strlen(argv[k]);
        if (redisAppendCommandArgv(rd, 9, argv, lens) != REDIS_OK)
            die("XADD", rd->errstr);
    }
    for (int i = 0; i < n; i++) {
        void *r = NULL;
        if (redisGetReply(rd, &r) != REDIS_OK)
            die("XADD", rd->errstr);
        redisReply *reply = r;
        if (reply->type == REDIS_REPLY_ERROR)
            die("XADD refused", reply->str);
        freeReplyObject(reply);
    }
    return n;
}

int main(int argc, char **argv)
{
    const char *conninfo = NULL, *rhost = "127.0.0.1", *queue = NULL, *consumer = "bench";
    int rport = 6379, fetch = 500, poll_ms = 1;
    long until = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL)
            die("usage", "see the comment at the top of bench/pgq.c");
        i++;
        if (strcmp(a, "--postgres") == 0)
            conninfo = v;
        else if (strcmp(a, "--redis-host") == 0)
            rhost = v;
        else if (strcmp(a, "--redis-port") == 0)
            rport = atoi(v);
        else if (strcmp(a, "--queue") == 0)
            queue = v;
        else if (strcmp(a, "--consumer") == 0)
            consumer = v;
        else if (strcmp(a, "--fetch") == 0)
            fetch = atoi(v);
        else if (strcmp(a, "--poll-ms") == 0)
            poll_ms = atoi(v);
        else if (strcmp(a, "--until") == 0)
            until = atol(v);
        else
            die("unknown option", a);
    }
    if (conninfo == NULL || queue == NULL || fetch < 1 || poll_ms < 0)
        die("usage", "--postgres CONNINFO --redis-port PORT --queue Q [--fetch N >= 1]");
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);

    PGconn *pg = PQconnectdb(conninfo);
    if (PQstatus(pg) != CONNECTION_OK)
        die("cannot connect to PostgreSQL", PQerrorMessage(pg));
    redisContext *rd = redisConnect(rhost, rport);
    if (rd == NULL || rd->err)
        die("cannot connect to Redis", rd ? rd->errstr : "out of memory");

    char fetch_sql[64], limit[16];
    snprintf(fetch_sql, sizeof(fetch_sql), "FETCH %d FROM c", fetch);
    snprintf(limit, sizeof(limit), "%d", fetch);
    const char *qc[2] = {queue, consumer};
    long total = 0, batches = 0;
    double started = now_s(), first = 0;
    while (!stop && (until == 0 || total < until)) {
        PQclear(run(pg, "SELECT pgq.ticker($1)", 1, qc));
        PQclear(run(pg, "BEGIN", 0, NULL));
        PGresult *res = run(pg, "SELECT pgq.next_batch($1, $2)", 2, qc);
        if (PQgetisnull(res, 0, 0)) {
            PQclear(res);
            PQclear(run(pg, "COMMIT", 0, NULL));
            if (poll_ms > 0) {
                struct timespec ts = {poll_ms / 1000, (long)(poll_ms % 1000) * 1000000L};
                nanosleep(&ts, NULL);
            }
            continue;
        }
        char batch_id[32];
        snprintf(batch_id, sizeof(batch_id), "%s", PQgetvalue(res, 0, 0));
        PQclear(res);
        if (first == 0)
            first = now_s();
        const char *bc[3] = {batch_id, "c", limit};
        res = run(pg, "SELECT * FROM pgq.get_batch_cursor($1, $2, $3)", 3, bc);
        long got = publish(rd, res);
        int more = PQntuples(res) == fetch;
        PQclear(res);
        while (more) {
            res = run(pg, fetch_sql, 0, NULL);
            got += publish(rd, res);
            more = PQntuples(res) == fetch;
            PQclear(res);
        }
        PQclear(run(pg, "CLOSE c", 0, NULL));
        const char *fb[1] = {batch_id};
        PQclear(run(pg, "SELECT pgq.finish_batch($1)", 1, fb));
        PQclear(run(pg, "COMMIT", 0, NULL));
        total += got;
        batches++;
    }
    double took = now_s() - started;
    printf("{\"events\": %ld, \"batches\": %ld, \"seconds\": %.4f, \"first_batch_after\": %.4f}\n",
           total, batches, took, first > 0 ? first - started : 0.0);
    fflush(stdout);
    redisFree(rd);
    PQfinish(pg);
    return 0;
}
