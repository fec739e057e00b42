/*
 * bench-naive: the yardstick of the benchmark. A plain, single-threaded relay
 * loop with the synchronous libpq and hiredis APIs:
 *
 *   loop {
 *     BEGIN
 *     the relay's own claim statement (relay_pgsrc_claim_sql), batch_size rows
 *     FCALL the relay's publish function once per row, pipelined (the argv is
 *     built by relay_batch_build_publish, so it is the relay's own, dedup on)
 *     wait for every reply
 *     finish the rows as the relay does by default: outbox.delete_published(ids),
 *     or with --mark, UPDATE outbox.messages SET sent_at = ... WHERE id = ANY(ids)
 *     COMMIT
 *   }
 *
 * until a claim comes back empty. PostgreSQL idles while Redis works and Redis
 * idles while PostgreSQL works: a relay that overlaps the two can beat it.
 *
 * It links the daemon's library only for the statement, the function source and the argv
 * builder, so it always does the relay's work and no other. Binary results, as
 * the relay asks for: bytea arrives as its bytes, not as hex text.
 *
 *   bench-naive --postgres CONNINFO --redis-port PORT [--redis-host HOST]
 *               [--batch-size N] [--dedup-ttl MS] [--publish-timeout MS]
 *               [--drop-dedup] [--hold] [--mark]
 *   bench-naive --claim-only --postgres CONNINFO [--batch-size N] [--seconds S]
 *               [--paused TOPICS]
 *   bench-naive --claim-mark --postgres CONNINFO [--batch-size N] [--count N] [--mark]
 *   bench-naive --print-argv [--publish-timeout MS] [--call-rows N]
 *   bench-naive --print-claim-sql [--paused TOPICS] | --print-function
 *
 * --drop-dedup also removes the dedup records after each commit (UNLINK), as
 * the relay does; without it the loop is exactly the one above. --hold keeps
 * the connections open after the result is printed, until stdin closes.
 * --claim-only times the claim statement alone (BEGIN; claim; ROLLBACK), over
 * and over for S seconds: nothing changes in the table. --paused takes the
 * claim's $2, the paused topics as a text[] literal ('{orders}'), and makes
 * --claim-only and --print-claim-sql use the statement the relay prepares for
 * when topics are paused.
 * --claim-mark runs the loop without Redis (BEGIN; claim; finish; COMMIT), N
 * times: the rate PostgreSQL alone allows. --mark finishes rows by marking
 * them sent (the relay with sent_retention above 0) instead of deleting them
 * (the relay's default, sent_retention = 0).
 * --print-argv prints the argv of one sample publish, one argument a line
 * (the benchmark feeds it to redis-benchmark): a row sent after another of
 * its stream, so it names the record {bench0}:dedup:ffffffff-ffff-ffff-ffff-
 * ffffffffffff, which must exist for the call to publish; with --call-rows N
 * (1 to RELAY_CALL_ROWS) the relay's call of N such rows of one stream
 * (relay_batch_append_publish_call), which names that record before its
 * first row; --print-claim-sql the claim;
 * --print-function the publish function's source.
 * pgbench cannot run the claim as a prepared statement: it takes the ":MI" of
 * the to_char format inside a string literal for a variable.
 * Prints one JSON line at exit.
 */
#include "common/compat.h"

#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/functions.h"
#include "relay/batch.h"
#include "relay/pgsrc.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "bench-naive: %s: %s\n", what, detail ? detail : "");
    exit(1);
}

/* An allocation that cannot fail: the tool stops, saying so. */
static void *need(void *p)
{
    if (p == NULL)
        die("out of memory", "run with a smaller --count or --batch-size");
    return p;
}

static void pg_ok(PGconn *pg, PGresult *res, const char *what)
{
    ExecStatusType st = PQresultStatus(res);
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", PQerrorMessage(pg));
        PQclear(res);
        die(what, msg);
    }
}

static void pg_exec(PGconn *pg, const char *sql)
{
    PGresult *res = PQexec(pg, sql);
    pg_ok(pg, res, sql);
    PQclear(res);
}

/* The relay's default max_payload_bytes, for the claim and the argv. */
#define MAX_PAYLOAD_BYTES (1u << 20)

/* The relay's parse_row, for the claim's binary result. */
static int parse_row(PGresult *res, int i, struct relay_row *row)
{
    memset(row, 0, sizeof(*row));
    if (PQgetlength(res, i, 0) != 8 || PQgetlength(res, i, 9) != 4 || PQgetlength(res, i, 10) != 4)
        return -1;
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
    row->attempts = relay_batch_decode_int4(PQgetvalue(res, i, 9));
    return 0;
}

static int print_argv(uint32_t publish_timeout_ms, int call_rows)
{
    static const char mid[] = "00000000-0000-0000-0000-000000000000";
    static const char created[] = "2026-01-01T00:00:00.000000Z";
    char payload[200];
    memset(payload, 'x', sizeof(payload));
    /* Sent after another row of its stream, as most rows of a batch are: the
     * argv names that row's record, which the caller creates. */
    static const char before_mid[] = "ffffffff-ffff-ffff-ffff-ffffffffffff";
    struct relay_row before;
    memset(&before, 0, sizeof(before));
    before.message_id = before_mid;
    before.message_id_len = sizeof(before_mid) - 1;
    struct relay_row row;
    memset(&row, 0, sizeof(row));
    row.after = &before;
    row.id = 1;
    row.message_id = mid;
    row.message_id_len = sizeof(mid) - 1;
    row.topic = "bench0";
    row.topic_len = 6;
    row.payload = payload;
    row.payload_len = sizeof(payload);
    row.created_at = created;
    row.created_at_len = sizeof(created) - 1;
    if (call_rows > 0) {
        /* The relay's call of call_rows rows, read back from the protocol. */
        static struct relay_row rows[RELAY_CALL_ROWS];
        const struct relay_row *call[RELAY_CALL_ROWS];
        char err[OUTBOX_ERROR_MAX];
        enum relay_row_fault fault;
        for (int i = 0; i < call_rows; i++) {
            rows[i] = row;
            rows[i].after = NULL;
            if (relay_batch_check_publish(&rows[i], "", MAX_PAYLOAD_BYTES, err, sizeof(err),
                                          &fault) != 0)
                die("cannot check a row", err);
            call[i] = &rows[i];
        }
        struct outbox_buf out;
        memset(&out, 0, sizeof(out));
        if (relay_batch_append_publish_call(call, (size_t)call_rows, &before, "", MAX_PAYLOAD_BYTES,
                                            86400000u, wall_ms() + publish_timeout_ms, &out) != 0)
            die("cannot build a publish call", "");
        const char *p = strchr(out.data, '\n') + 1;
        while (*p == '$') {
            char *end;
            size_t n = strtoul(p + 1, &end, 10);
            printf("%.*s\n", (int)n, end + 2);
            p = end + 2 + n + 2;
        }
        outbox_buf_free(&out);
        return 0;
    }
    struct relay_publish_cmd cmd;
    char err[OUTBOX_ERROR_MAX];
    if (relay_batch_build_publish(&row, "", MAX_PAYLOAD_BYTES, 86400000u,
                                  wall_ms() + publish_timeout_ms, &cmd, err, sizeof(err)) < 0)
        die("cannot build a publish", err);
    for (int i = 0; i < cmd.argc; i++)
        printf("%.*s\n", (int)cmd.argvlen[i], cmd.argv[i]);
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* CPU seconds (user + system) the server process pid has used, from
 * /proc/<pid>/stat; -1 when it cannot be read (a server on another host). */
static double proc_cpu_s(int pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    unsigned long long utime = 0, stime = 0;
    if (p == NULL ||
        sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime) != 2)
        return -1;
    return (double)(utime + stime) / (double)sysconf(_SC_CLK_TCK);
}

/* BEGIN; claim; ROLLBACK over and over: the claim statement's own time, and
 * the server process's CPU per claim, which other work on a shared machine
 * disturbs less than the time. */
static int claim_only(PGconn *pg, int batch, double seconds, const char *paused)
{
    char limit[16];
    snprintf(limit, sizeof(limit), "%d", batch);
    /* No partition owned: the rows of partitioned topics are not claimed. */
    /* The paused claim takes 5 parameters; the hot path a sixth: the id its
     * walk starts after, 0 for the whole index. */
    const char *params[6] = {limit, paused ? paused : "{}", "{}", "{}", "0", "0"};
    int nparams = paused ? 5 : 6;
    size_t cap = 1024, n = 0;
    double *t = need(malloc(cap * sizeof(double)));
    long long rows = 0;
    double cpu_before = proc_cpu_s(PQbackendPID(pg));
    double started = now_s();
    while (now_s() - started < seconds || n < 5) {
        pg_exec(pg, "BEGIN");
        double a = now_s();
        PGresult *res = PQexecPrepared(pg, "claim", nparams, params, NULL, NULL, 1);
        double b = now_s();
        pg_ok(pg, res, "claim");
        rows += PQntuples(res);
        PQclear(res);
        pg_exec(pg, "ROLLBACK");
        if (n == cap)
            t = need(realloc(t, (cap *= 2) * sizeof(double)));
        t[n++] = b - a;
    }
    double took = now_s() - started, sum = 0, first = t[0];
    double cpu_after = proc_cpu_s(PQbackendPID(pg));
    double cpu_ms =
        cpu_before < 0 || cpu_after < 0 ? -1 : (cpu_after - cpu_before) / (double)n * 1e3;
    for (size_t i = 0; i < n; i++)
        sum += t[i];
    qsort(t, n, sizeof(double), cmp_double);
    printf("{\"claims\": %zu, \"seconds\": %.6f, \"rows_per_claim\": %.1f, \"mean_ms\": %.4f,"
           " \"p50_ms\": %.4f, \"p90_ms\": %.4f, \"min_ms\": %.4f, \"max_ms\": %.4f,"
           " \"first_ms\": %.4f, \"server_cpu_ms\": %.4f, \"batch_size\": %d}\n",
           n, took, (double)rows / (double)n, sum / (double)n * 1e3, t[n / 2] * 1e3,
           t[(size_t)(n * 0.9)] * 1e3, t[0] * 1e3, t[n - 1] * 1e3, first * 1e3, cpu_ms, batch);
    free(t);
    return 0;
}

int main(int argc, char **argv)
{
    const char *conninfo = NULL, *rhost = "127.0.0.1";
    int rport = 6379, batch = 500, drop_dedup = 0, hold = 0, mark_sent = 0;
    enum { DRAIN, CLAIM_ONLY, CLAIM_MARK, PRINT_ARGV, PRINT_SQL, PRINT_FUNCTION } mode = DRAIN;
    uint32_t ttl_ms = 86400000u, publish_timeout_ms = 5000u;
    double seconds = 5;
    long max_batches = -1;
    const char *paused = NULL;
    int call_rows = 0;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--drop-dedup") == 0) {
            drop_dedup = 1;
            continue;
        }
        if (strcmp(a, "--hold") == 0) {
            hold = 1;
            continue;
        }
        if (strcmp(a, "--print-argv") == 0) {
            mode = PRINT_ARGV;
            continue;
        }
        if (strcmp(a, "--print-claim-sql") == 0) {
            mode = PRINT_SQL;
            continue;
        }
        if (strcmp(a, "--print-function") == 0) {
            mode = PRINT_FUNCTION;
            continue;
        }
        if (strcmp(a, "--claim-only") == 0) {
            mode = CLAIM_ONLY;
            continue;
        }
        if (strcmp(a, "--claim-mark") == 0) {
            mode = CLAIM_MARK;
            continue;
        }
        if (strcmp(a, "--mark") == 0) {
            mark_sent = 1;
            continue;
        }
        if (v == NULL)
            die("usage", "see the comment at the top of bench/naive.c");
        i++;
        if (strcmp(a, "--postgres") == 0)
            conninfo = v;
        else if (strcmp(a, "--redis-host") == 0)
            rhost = v;
        else if (strcmp(a, "--redis-port") == 0)
            rport = atoi(v);
        else if (strcmp(a, "--batch-size") == 0)
            batch = atoi(v);
        else if (strcmp(a, "--dedup-ttl") == 0)
            ttl_ms = (uint32_t)strtoul(v, NULL, 10);
        else if (strcmp(a, "--publish-timeout") == 0)
            publish_timeout_ms = (uint32_t)strtoul(v, NULL, 10);
        else if (strcmp(a, "--seconds") == 0)
            seconds = atof(v);
        else if (strcmp(a, "--count") == 0)
            max_batches = atol(v);
        else if (strcmp(a, "--paused") == 0)
            paused = v;
        else if (strcmp(a, "--call-rows") == 0)
            call_rows = atoi(v);
        else
            die("unknown option", a);
    }
    if (call_rows < 0 || call_rows > RELAY_CALL_ROWS)
        die("--call-rows takes 1 to 64", "");
    if (mode == PRINT_ARGV)
        return print_argv(publish_timeout_ms, call_rows);
    if (mode == PRINT_FUNCTION) {
        fputs(outbox_functions_relay_source, stdout);
        return 0;
    }
    char claim_sql[RELAY_PGSRC_CLAIM_SQL_MAX];
    if (relay_pgsrc_claim_sql(paused != NULL, MAX_PAYLOAD_BYTES, claim_sql, sizeof(claim_sql)) < 0)
        die("the claim statement", "does not fit its buffer");
    if (mode == PRINT_SQL) {
        printf("%s\n", claim_sql);
        return 0;
    }
    if (conninfo == NULL || batch < 1 || batch > 100000)
        die("usage", "--postgres CONNINFO --redis-port PORT [--batch-size 1..100000]");

    PGconn *pg = PQconnectdb(conninfo);
    if (PQstatus(pg) != CONNECTION_OK)
        die("cannot connect to PostgreSQL", PQerrorMessage(pg));
    PGresult *res = PQprepare(pg, "claim", claim_sql, 0, NULL);
    pg_ok(pg, res, "prepare claim");
    PQclear(res);
    if (mode == CLAIM_ONLY)
        return claim_only(pg, batch, seconds, paused);

    redisContext *rd = NULL;
    if (mode == DRAIN) {
        rd = redisConnect(rhost, rport);
        if (rd == NULL || rd->err)
            die("cannot connect to Redis", rd ? rd->errstr : "out of memory");
        /* The relay's function, as the relay loads it. */
        redisReply *rep =
            redisCommand(rd, "FUNCTION LOAD REPLACE %s", outbox_functions_relay_source);
        if (rep == NULL || rep->type == REDIS_REPLY_ERROR)
            die("FUNCTION LOAD", rep ? rep->str : rd->errstr);
        freeReplyObject(rep);
    }
    res = PQprepare(pg, "mark",
                    mark_sent ? "UPDATE outbox.messages SET sent_at = statement_timestamp()"
                                " WHERE id = ANY($1::bigint[])"
                              : "SELECT outbox.delete_published($1::bigint[])",
                    1, NULL);
    pg_ok(pg, res, "prepare mark");
    PQclear(res);

    struct relay_row *rows = need(calloc((size_t)batch, sizeof(*rows)));
    struct relay_batch_streams streams;
    if (relay_batch_streams_init(&streams, (size_t)batch) != 0)
        die("cannot allocate", "out of memory");
    struct relay_publish_cmd *cmd = need(malloc(sizeof(*cmd)));
    char *keys = need(malloc((size_t)batch * 512));
    char *ids = need(malloc((size_t)batch * 24 + 8));
    const char **del_argv = need(calloc((size_t)batch + 1, sizeof(*del_argv)));
    size_t *del_lens = need(calloc((size_t)batch + 1, sizeof(*del_lens)));

    char limit[16];
    snprintf(limit, sizeof(limit), "%d", batch);
    const char *claim_params[6] = {limit, "{}", "{}", "{}", "0", "0"};
    char err[OUTBOX_ERROR_MAX];
    unsigned long long total = 0, batches = 0;
    /* Where each batch's time goes, summed over the batches. */
    double t_claim = 0, t_publish = 0, t_mark = 0, t_commit = 0, t_unlink = 0;
    double started = now_s();

    while (max_batches < 0 || (long)batches < max_batches) {
        double t = now_s();
        pg_exec(pg, "BEGIN");
        /* Rows point into the claim's result: it lives until the batch ends. */
        PGresult *claimed = PQexecPrepared(pg, "claim", 6, claim_params, NULL, NULL, 1);
        pg_ok(pg, claimed, "claim");
        int n = PQntuples(claimed);
        if (n == 0) {
            PQclear(claimed);
            pg_exec(pg, "COMMIT");
            break;
        }
        double t1 = now_s();
        t_claim += t1 - t;
        uint64_t not_after = wall_ms() + publish_timeout_ms;
        relay_batch_streams_clear(&streams);
        for (int i = 0; i < n; i++) {
            if (parse_row(claimed, i, &rows[i]) < 0)
                die("claim", "malformed row");
            if (rd == NULL)
                continue;
            /* Chained to the row before it in its stream, as the relay does. */
            int32_t *last = relay_batch_streams_slot(&streams, rows, (size_t)i);
            rows[i].after = *last >= 0 ? &rows[*last] : NULL;
            *last = i;
            if (relay_batch_build_publish(&rows[i], "", MAX_PAYLOAD_BYTES, ttl_ms, not_after, cmd,
                                          err, sizeof(err)) < 0)
                die("cannot build a publish", err);
            /* hiredis formats (copies) the command here. */
            if (redisAppendCommandArgv(rd, cmd->argc, cmd->argv, cmd->argvlen) != REDIS_OK)
                die("redisAppendCommandArgv", rd->errstr);
            if (drop_dedup)
                snprintf(keys + (size_t)i * 512, 512, "%s", cmd->dedup_key);
        }
        for (int i = 0; rd != NULL && i < n; i++) {
            void *r = NULL;
            if (redisGetReply(rd, &r) != REDIS_OK || r == NULL)
                die("Redis", rd->errstr);
            redisReply *reply = r;
            if (reply->type != REDIS_REPLY_STRING && reply->type != REDIS_REPLY_STATUS)
                die("publish refused", reply->type == REDIS_REPLY_ERROR ? reply->str : "?");
            freeReplyObject(reply);
        }
        double t2 = now_s();
        t_publish += t2 - t1;
        size_t len = 0;
        ids[len++] = '{';
        for (int i = 0; i < n; i++)
            len += (size_t)snprintf(ids + len, 24, "%s%lld", i ? "," : "", (long long)rows[i].id);
        ids[len++] = '}';
        ids[len] = '\0';
        const char *mark_params[1] = {ids};
        res = PQexecPrepared(pg, "mark", 1, mark_params, NULL, NULL, 0);
        pg_ok(pg, res, "mark sent");
        PQclear(res);
        double t3 = now_s();
        t_mark += t3 - t2;
        pg_exec(pg, "COMMIT");
        double t4 = now_s();
        t_commit += t4 - t3;
        if (drop_dedup && rd != NULL) {
            /* One UNLINK per topic, as the relay does: a batch's keys of one
             * stream share its hash slot. The topic is in the claimed row. */
            int pending = 0;
            unsigned char *done = need(calloc((size_t)n, 1));
            for (int i = 0; i < n; i++) {
                if (done[i])
                    continue;
                int argc2 = 0;
                del_argv[argc2] = "UNLINK";
                del_lens[argc2++] = 6;
                for (int j = i; j < n; j++) {
                    if (done[j] || rows[j].topic_len != rows[i].topic_len ||
                        memcmp(rows[j].topic, rows[i].topic, rows[i].topic_len) != 0)
                        continue;
                    done[j] = 1;
                    del_argv[argc2] = keys + (size_t)j * 512;
                    del_lens[argc2++] = strlen(keys + (size_t)j * 512);
                }
                redisAppendCommandArgv(rd, argc2, del_argv, del_lens);
                pending++;
            }
            free(done);
            for (int i = 0; i < pending; i++) {
                void *r = NULL;
                if (redisGetReply(rd, &r) != REDIS_OK || r == NULL)
                    die("Redis", rd->errstr);
                freeReplyObject(r);
            }
        }
        t_unlink += now_s() - t4;
        PQclear(claimed);
        total += (unsigned long long)n;
        batches++;
    }
    double took = now_s() - started;
    double nb = batches ? (double)batches : 1.0;
    printf("{\"rows\": %llu, \"batches\": %llu, \"seconds\": %.6f, \"rate\": %.1f, "
           "\"batch_size\": %d, \"drop_dedup\": %d, \"redis\": %d, \"claim_ms\": %.4f, "
           "\"publish_ms\": %.4f, \"mark_ms\": %.4f, \"commit_ms\": %.4f, \"unlink_ms\": %.4f}\n",
           total, batches, took, took > 0 ? total / took : 0.0, batch, drop_dedup, rd != NULL,
           t_claim / nb * 1e3, t_publish / nb * 1e3, t_mark / nb * 1e3, t_commit / nb * 1e3,
           t_unlink / nb * 1e3);
    fflush(stdout);
    if (hold) {
        /* Stay connected until told to go: the benchmark reads this process's
         * and its PostgreSQL backend's CPU time from /proc first. */
        char buf[64];
        while (fgets(buf, sizeof(buf), stdin) != NULL)
            ;
    }
    free(rows);
    relay_batch_streams_free(&streams);
    free(cmd);
    free(keys);
    free(ids);
    free(del_argv);
    free(del_lens);
    if (rd != NULL)
        redisFree(rd);
    PQfinish(pg);
    return 0;
}
