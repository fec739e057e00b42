/*
 * bench-cursor: the prototype of "batches from snapshots, and a fenced cursor
 * that moves with the entries" (bench/extra/snapshot_cursor.sql has the
 * design and the schema cursor_proto, bench/extra/snapshot_cursor.lua the
 * Redis function). Exactly once without a record per message:
 *
 *   loop {
 *     the batch of tick last+1: cursor_proto.tick() when that tick is not
 *       taken yet (nothing new: sleep poll_ms)
 *     cursor_proto.batch_bounds(last, last+1)
 *     chunks of --fetch rows in (txid, id) order, cursor_proto.batch_rows,
 *       each chunk's query sent as soon as the one before has arrived, so
 *       that PostgreSQL reads while this program and Redis publish;
 *       for each chunk, per stream, pipelined:
 *         --publish fcall (the default): one
 *           FCALL cursor_proto_publish_v1 2 <stream> {<stream>}:cursor
 *                 <expected> <new> <n> <entries>
 *           A refused call answers where the stream's cursor is: the rows up
 *           to there are skipped (a restart after a crash, or a second relay
 *           that got there first), the rest sent again with that expectation.
 *         --publish ids: MULTI, XADD <stream> <ms>-<seq> <entry> per row,
 *           EXEC, with no function and no key besides the stream: the entry
 *           id is the row's place in the publish order (ms: its tick's,
 *           strictly increasing from tick to tick; seq: the row's rank in its
 *           batch), so the stream's last id is the cursor, and XADD itself
 *           refuses an entry at or below it. MULTI makes a stream's rows of a
 *           chunk all or nothing when a command cannot be queued (memory
 *           full, a slot moved), so no later row lands past a missing one.
 *           The stream's last entry is read once when a stream is first met
 *           and again after a refusal; rows at or below it are skipped.
 *     cursor_proto.finish_batch: one row per stream touched, the consumer's
 *       last tick, and the next tick, in one transaction
 *   }
 *
 * The entries have the fields of the relay's stream contract (README, "The
 * stream contract"): id, topic, key (absent when NULL), payload, created_at,
 * outbox_id, h.<name>; the stream is the topic (no prefix, no partitions).
 * The caller applies the SQL and registers the consumer
 * (cursor_proto.register); with --publish fcall this program loads the
 * function.
 *
 *   bench-cursor --postgres CONNINFO --redis-port PORT [--redis-host HOST]
 *                [--consumer NAME] [--fetch N] [--poll-ms MS] [--until N]
 *                [--publish fcall|ids] [--function FILE]
 *
 * It runs until SIGTERM, or with --until N until N rows are in Redis (appended
 * or found there), and then prints one JSON line. A cursor found behind where
 * this program left it (Redis lost writes) stops it with exit status 3: the
 * prototype does not publish again from there.
 */
#include "common/compat.h"

#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <libpq-fe.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef CURSOR_FUNCTION_FILE
#define CURSOR_FUNCTION_FILE "bench/extra/snapshot_cursor.lua"
#endif
#define FUNCTION_NAME "cursor_proto_publish_v1"

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

static _Noreturn void die(const char *what, const char *detail)
{
    fprintf(stderr, "bench-cursor: %s: %s\n", what, detail ? detail : "");
    exit(1);
}

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (q == NULL)
        die("out of memory", NULL);
    return q;
}

/* ---- positions ----------------------------------------------------------- */

/* Where a row sits in the outbox's publish order: its batch's tick, its
 * transaction, its id. The cursor of a stream is the position of its last
 * entry; tick 0 is "no cursor" ('' in Redis). In Redis each number is
 * zero-padded to a fixed width, so that the function can compare two cursors
 * as strings. */
struct pos {
    int64_t tick;
    uint64_t txid;
    int64_t id;
};

static int pos_cmp(struct pos a, struct pos b)
{
    if (a.tick != b.tick)
        return a.tick < b.tick ? -1 : 1;
    if (a.txid != b.txid)
        return a.txid < b.txid ? -1 : 1;
    if (a.id != b.id)
        return a.id < b.id ? -1 : 1;
    return 0;
}

static int pos_format(struct pos p, char *out, size_t len)
{
    if (p.tick == 0) {
        out[0] = '\0';
        return 0;
    }
    return snprintf(out, len, "%019" PRId64 ":%020" PRIu64 ":%019" PRId64, p.tick, p.txid, p.id);
}

static struct pos pos_parse(const char *s, size_t len)
{
    struct pos p = {0, 0, 0};
    char buf[96];
    if (len == 0)
        return p;
    if (len >= sizeof(buf))
        die("cursor", "too long");
    memcpy(buf, s, len);
    buf[len] = '\0';
    if (sscanf(buf, "%" SCNd64 ":%" SCNu64 ":%" SCNd64, &p.tick, &p.txid, &p.id) != 3)
        die("cursor not understood", buf);
    return p;
}

/* ---- streams ------------------------------------------------------------- */

struct stream {
    char *name;
    size_t name_len;
    char *cursor_key;
    size_t cursor_key_len;
    struct pos expected; /* where its cursor is, as far as this relay knows */
    int touched;         /* in the batch being published: record it */
    /* --publish ids: the stream's last entry id, once read (top_known) */
    uint64_t top_ms, top_seq;
    int64_t top_outbox; /* the outbox_id of that entry */
    int top_known;
    /* the rows of the chunk being published, as indexes into the result */
    int *rows;
    int nrows, caprows;
};

static struct stream *streams;
static int nstreams, capstreams;

static struct stream *stream_get(const char *name, size_t len)
{
    for (int i = 0; i < nstreams; i++)
        if (streams[i].name_len == len && memcmp(streams[i].name, name, len) == 0)
            return &streams[i];
    if (nstreams == capstreams) {
        capstreams = capstreams ? capstreams * 2 : 16;
        streams = xrealloc(streams, sizeof(*streams) * (size_t)capstreams);
    }
    struct stream *s = &streams[nstreams++];
    memset(s, 0, sizeof(*s));
    s->name = xrealloc(NULL, len + 1);
    memcpy(s->name, name, len);
    s->name[len] = '\0';
    s->name_len = len;
    s->cursor_key = xrealloc(NULL, len + 16);
    s->cursor_key_len = (size_t)snprintf(s->cursor_key, len + 16, "{%s}:cursor", s->name);
    return s;
}

/* ---- PostgreSQL ---------------------------------------------------------- */

static PGresult *run(PGconn *pg, const char *stmt, int n, const char *const *params, int binary)
{
    PGresult *res = PQexecPrepared(pg, stmt, n, params, NULL, NULL, binary);
    ExecStatusType st = PQresultStatus(res);
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", PQerrorMessage(pg));
        PQclear(res);
        die(stmt, msg);
    }
    return res;
}

static void prepare(PGconn *pg, const char *name, const char *sql)
{
    PGresult *res = PQprepare(pg, name, sql, 0, NULL);
    if (PQresultStatus(res) != PGRES_COMMAND_OK)
        die(sql, PQerrorMessage(pg));
    PQclear(res);
}

/* The batch_rows query, sent without waiting for its result. */
static void send_rows(PGconn *pg, const char *const *params)
{
    if (!PQsendQueryPrepared(pg, "rows", 8, params, NULL, NULL, 1))
        die("rows", PQerrorMessage(pg));
}

static PGresult *get_rows(PGconn *pg)
{
    PGresult *res = PQgetResult(pg), *more;
    if (PQresultStatus(res) != PGRES_TUPLES_OK)
        die("rows", PQerrorMessage(pg));
    while ((more = PQgetResult(pg)) != NULL)
        PQclear(more);
    return res;
}

static uint64_t be64(const char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | (unsigned char)p[i];
    return v;
}

/* The result columns of cursor_proto.batch_rows, in binary. */
enum { C_TXID, C_ID, C_MESSAGE_ID, C_TOPIC, C_KEY, C_PAYLOAD, C_CREATED_AT, C_HEADERS };

static struct pos row_pos(const PGresult *res, int row, int64_t tick)
{
    struct pos p = {tick, be64(PQgetvalue(res, row, C_TXID)),
                    (int64_t)be64(PQgetvalue(res, row, C_ID))};
    return p;
}

/* A chunk of a batch being published. */
struct chunk {
    const PGresult *res;
    int64_t tick;
    uint64_t tick_ms; /* --publish ids: the ms of the entries' ids */
    uint64_t base;    /* --publish ids: the rank in the batch of the chunk's first row */
};

static int id_cmp(uint64_t ams, uint64_t aseq, uint64_t bms, uint64_t bseq)
{
    if (ams != bms)
        return ams < bms ? -1 : 1;
    return aseq < bseq ? -1 : aseq > bseq;
}

/* ---- the publish calls ------------------------------------------------------ */

struct argv {
    const char **v;
    size_t *len;
    int n, cap;
    char *scratch; /* numbers and header names, alive until the call is appended */
    size_t used, capscratch;
};

static void arg(struct argv *a, const char *s, size_t len)
{
    if (a->n == a->cap) {
        a->cap = a->cap ? a->cap * 2 : 256;
        a->v = xrealloc(a->v, sizeof(*a->v) * (size_t)a->cap);
        a->len = xrealloc(a->len, sizeof(*a->len) * (size_t)a->cap);
    }
    a->v[a->n] = s;
    a->len[a->n++] = len;
}

/* Room for len bytes of scratch; the caller sized the scratch for the call. */
static char *scratch(struct argv *a, size_t len)
{
    if (a->used + len > a->capscratch)
        die("scratch", "sized too small");
    char *p = a->scratch + a->used;
    a->used += len;
    return p;
}

static void arg_num(struct argv *a, long long v)
{
    char *p = scratch(a, 24);
    arg(a, p, (size_t)snprintf(p, 24, "%lld", v));
}

/* Parses one netstring "<len>:<bytes>" at *p (end e): 0, or -1 when malformed. */
static int netstring(const char **p, const char *e, const char **s, size_t *len)
{
    size_t n = 0;
    const char *q = *p;
    while (q < e && *q >= '0' && *q <= '9')
        n = n * 10 + (size_t)(*q++ - '0');
    if (q == *p || q >= e || *q != ':' || (size_t)(e - q - 1) < n)
        return -1;
    *s = q + 1;
    *len = n;
    *p = q + 1 + n;
    return 0;
}

/* The entry's fields of row: the relay's stream contract. */
static void add_fields(struct argv *a, const PGresult *res, int row)
{
    arg(a, "id", 2);
    arg(a, PQgetvalue(res, row, C_MESSAGE_ID), (size_t)PQgetlength(res, row, C_MESSAGE_ID));
    arg(a, "topic", 5);
    arg(a, PQgetvalue(res, row, C_TOPIC), (size_t)PQgetlength(res, row, C_TOPIC));
    if (!PQgetisnull(res, row, C_KEY)) {
        arg(a, "key", 3);
        arg(a, PQgetvalue(res, row, C_KEY), (size_t)PQgetlength(res, row, C_KEY));
    }
    arg(a, "payload", 7);
    arg(a, PQgetvalue(res, row, C_PAYLOAD), (size_t)PQgetlength(res, row, C_PAYLOAD));
    arg(a, "created_at", 10);
    arg(a, PQgetvalue(res, row, C_CREATED_AT), (size_t)PQgetlength(res, row, C_CREATED_AT));
    arg(a, "outbox_id", 9);
    arg_num(a, (long long)be64(PQgetvalue(res, row, C_ID)));
    if (!PQgetisnull(res, row, C_HEADERS)) {
        const char *p = PQgetvalue(res, row, C_HEADERS);
        const char *e = p + PQgetlength(res, row, C_HEADERS);
        while (p < e) {
            const char *name, *value;
            size_t nlen, vlen;
            if (netstring(&p, e, &name, &nlen) < 0 || netstring(&p, e, &value, &vlen) < 0)
                die("headers", "not netstrings");
            char *f = scratch(a, nlen + 2);
            memcpy(f, "h.", 2);
            memcpy(f + 2, name, nlen);
            arg(a, f, nlen + 2);
            arg(a, value, vlen);
        }
    }
}

/* The entry of row in a publish call: the number of its fields' arguments,
 * then the fields. */
static void add_entry(struct argv *a, const PGresult *res, int row)
{
    int count_at = a->n;
    arg(a, "", 0); /* filled in below */
    int first = a->n;
    add_fields(a, res, row);
    char *c = scratch(a, 8);
    a->v[count_at] = c;
    a->len[count_at] = (size_t)snprintf(c, 8, "%d", a->n - first);
}

/* Sizes the scratch for n rows' numbers and header names, and empties the
 * argument list. */
static void scratch_for(struct argv *a, const PGresult *res, const int *rows, int n)
{
    size_t need = 3 * 96 + 24;
    for (int i = 0; i < n; i++)
        need += 24 + 48 + 8 + (size_t)PQgetlength(res, rows[i], C_HEADERS) + 2;
    if (need > a->capscratch) {
        a->capscratch = need * 2;
        a->scratch = xrealloc(a->scratch, a->capscratch);
    }
    a->n = 0;
    a->used = 0;
}

/* Appends (does not send) the call that publishes rows[0..n) of s's rows of
 * res, expecting s's cursor at expected and moving it to *moved_to. */
static void append_call(redisContext *rd, struct argv *a, const PGresult *res, struct stream *s,
                        const int *rows, int n, struct pos expected, int64_t tick,
                        struct pos *moved_to)
{
    scratch_for(a, res, rows, n);
    *moved_to = row_pos(res, rows[n - 1], tick);
    char *exp = scratch(a, 96), *mov = scratch(a, 96);
    arg(a, "FCALL", 5);
    arg(a, FUNCTION_NAME, sizeof(FUNCTION_NAME) - 1);
    arg(a, "2", 1);
    arg(a, s->name, s->name_len);
    arg(a, s->cursor_key, s->cursor_key_len);
    arg(a, exp, (size_t)pos_format(expected, exp, 96));
    arg(a, mov, (size_t)pos_format(*moved_to, mov, 96));
    arg_num(a, n);
    for (int i = 0; i < n; i++)
        add_entry(a, res, rows[i]);
    if (redisAppendCommandArgv(rd, a->n, a->v, a->len) != REDIS_OK)
        die("FCALL", rd->errstr);
}

static void flush(redisContext *rd)
{
    int done = 0;
    while (!done)
        if (redisBufferWrite(rd, &done) != REDIS_OK)
            die("Redis", rd->errstr);
}

/* One reply of the publish function: 1 (appended, cursor moved) or 0 (refused,
 * *cursor where the stream's cursor is). */
static int read_reply(redisContext *rd, struct pos *cursor)
{
    void *r = NULL;
    if (redisGetReply(rd, &r) != REDIS_OK)
        die("FCALL", rd->errstr);
    redisReply *reply = r;
    if (reply->type == REDIS_REPLY_ERROR)
        die("FCALL refused", reply->str);
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 2 ||
        reply->element[0]->type != REDIS_REPLY_INTEGER ||
        reply->element[1]->type != REDIS_REPLY_STRING)
        die("FCALL", "unexpected reply");
    int ok = reply->element[0]->integer == 1;
    *cursor = pos_parse(reply->element[1]->str, reply->element[1]->len);
    freeReplyObject(reply);
    return ok;
}

struct counts {
    long appended, skipped, refused, calls, batches, chunks;
    double tick_s, read_s, publish_wait_s, finish_s;
};

/* ---- --publish ids: the entry id as the cursor ------------------------------ */

/* Reads s's last entry: its id, and its outbox_id for the check of the row
 * that has that id. No reply of a pipeline may be waiting. */
static int64_t top_outbox_id;

static void read_top(redisContext *rd, struct stream *s)
{
    redisReply *r = redisCommand(rd, "XREVRANGE %b + - COUNT 1", s->name, s->name_len);
    if (r == NULL)
        die("XREVRANGE", rd->errstr);
    if (r->type == REDIS_REPLY_ERROR)
        die("XREVRANGE", r->str);
    s->top_ms = s->top_seq = 0;
    top_outbox_id = 0;
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 1) {
        const redisReply *e = r->element[0];
        if (e->type != REDIS_REPLY_ARRAY || e->elements != 2 ||
            sscanf(e->element[0]->str, "%" SCNu64 "-%" SCNu64, &s->top_ms, &s->top_seq) != 2)
            die("XREVRANGE", "unexpected reply");
        const redisReply *f = e->element[1];
        for (size_t i = 0; f->type == REDIS_REPLY_ARRAY && i + 1 < f->elements; i += 2)
            if (strcmp(f->element[i]->str, "outbox_id") == 0)
                top_outbox_id = atoll(f->element[i + 1]->str);
    }
    s->top_known = 1;
    freeReplyObject(r);
}

/* Whether row r of the chunk is in s already (its id at or below the stream's
 * last): the row with the last id must be the entry's own. */
static int in_stream(redisContext *rd, const struct chunk *ch, struct stream *s, int r)
{
    if (!s->top_known) {
        read_top(rd, s);
        s->top_outbox = top_outbox_id;
    }
    int cmp = id_cmp(ch->tick_ms, ch->base + (uint64_t)r, s->top_ms, s->top_seq);
    if (cmp == 0 && s->top_outbox != (int64_t)be64(PQgetvalue(ch->res, r, C_ID))) {
        fprintf(stderr,
                "bench-cursor: the last entry of %s, %" PRIu64 "-%" PRIu64 ", is outbox_id %" PRId64
                ", not the row with that place\n",
                s->name, s->top_ms, s->top_seq, s->top_outbox);
        exit(3);
    }
    return cmp <= 0;
}

/* Appends (does not send) MULTI, one XADD with its id per row of s in the
 * chunk, EXEC. */
static void append_multi(redisContext *rd, struct argv *a, const struct chunk *ch,
                         const struct stream *s)
{
    if (redisAppendCommand(rd, "MULTI") != REDIS_OK)
        die("MULTI", rd->errstr);
    scratch_for(a, ch->res, s->rows, s->nrows);
    for (int i = 0; i < s->nrows; i++) {
        a->n = 0;
        arg(a, "XADD", 4);
        arg(a, s->name, s->name_len);
        char *id = scratch(a, 48);
        arg(a, id,
            (size_t)snprintf(id, 48, "%" PRIu64 "-%" PRIu64, ch->tick_ms,
                             ch->base + (uint64_t)s->rows[i]));
        add_fields(a, ch->res, s->rows[i]);
        if (redisAppendCommandArgv(rd, a->n, a->v, a->len) != REDIS_OK)
            die("XADD", rd->errstr);
    }
    if (redisAppendCommand(rd, "EXEC") != REDIS_OK)
        die("EXEC", rd->errstr);
}

static redisReply *get_reply(redisContext *rd, const char *what)
{
    void *r = NULL;
    if (redisGetReply(rd, &r) != REDIS_OK)
        die(what, rd->errstr);
    return r;
}

/* The replies of append_multi's commands: each row appended, or refused by
 * XADD as at or below the stream's last id, which another relay (or this
 * one before a restart) put there. */
static void read_multi(redisContext *rd, const struct chunk *ch, struct stream *s, struct counts *c)
{
    redisReply *r = get_reply(rd, "MULTI");
    if (r->type == REDIS_REPLY_ERROR)
        die("MULTI", r->str);
    freeReplyObject(r);
    for (int i = 0; i < s->nrows; i++) {
        r = get_reply(rd, "XADD");
        if (r->type == REDIS_REPLY_ERROR)
            fprintf(stderr, "bench-cursor: XADD not queued: %s\n", r->str);
        freeReplyObject(r);
    }
    r = get_reply(rd, "EXEC");
    if (r->type != REDIS_REPLY_ARRAY || r->elements != (size_t)s->nrows)
        die("EXEC", r->type == REDIS_REPLY_ERROR ? r->str : "the transaction did not run");
    int refused = 0;
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (e->type == REDIS_REPLY_STRING) {
            c->appended++;
        } else if (e->type == REDIS_REPLY_ERROR && strstr(e->str, "equal or smaller") != NULL) {
            refused++;
            c->skipped++;
        } else {
            die("XADD", e->type == REDIS_REPLY_ERROR ? e->str : "unexpected reply");
        }
    }
    freeReplyObject(r);
    int last = s->rows[s->nrows - 1];
    s->expected = row_pos(ch->res, last, ch->tick);
    s->touched = 1;
    if (refused) {
        /* Another relay is ahead: where is read before the next chunk (the
         * replies of this one's other streams are still coming), and the
         * rows up to there are skipped. */
        c->refused += refused;
        s->top_known = 0;
    } else {
        s->top_ms = ch->tick_ms;
        s->top_seq = ch->base + (uint64_t)last;
        s->top_outbox = (int64_t)be64(PQgetvalue(ch->res, last, C_ID));
    }
}

/* Groups the rows of a chunk by stream, in order, leaving out the rows at or
 * before their stream's cursor: they are in Redis already (found there by a
 * refused call or, with --publish ids, by the stream's last id: this relay
 * restarted, or another relay got there first). */
static void group_rows(redisContext *rd, const struct chunk *ch, int ids, int *order, int *norder,
                       struct counts *c)
{
    *norder = 0;
    for (int i = 0; i < nstreams; i++)
        streams[i].nrows = 0;
    int n = PQntuples(ch->res);
    for (int r = 0; r < n; r++) {
        struct stream *s =
            stream_get(PQgetvalue(ch->res, r, C_TOPIC), (size_t)PQgetlength(ch->res, r, C_TOPIC));
        struct pos p = row_pos(ch->res, r, ch->tick);
        if (pos_cmp(p, s->expected) <= 0 || (ids && in_stream(rd, ch, s, r))) {
            c->skipped++;
            if (pos_cmp(p, s->expected) > 0)
                s->expected = p;
            s->touched = 1;
            continue;
        }
        if (s->nrows == 0)
            order[(*norder)++] = (int)(s - streams);
        if (s->nrows == s->caprows) {
            s->caprows = s->caprows ? s->caprows * 2 : 64;
            s->rows = xrealloc(s->rows, sizeof(int) * (size_t)s->caprows);
        }
        s->rows[s->nrows++] = r;
    }
}

/* A refused call for s's rows of the chunk: the cursor is at cur. Skips what is
 * there already and sends the rest again, one call at a time, until the
 * cursor is past the chunk's last row of s. */
static void resolve_refusal(redisContext *rd, struct argv *a, const PGresult *res, struct stream *s,
                            int64_t tick, struct pos cur, struct counts *c)
{
    for (;;) {
        c->refused++;
        if (pos_cmp(cur, s->expected) < 0) {
            char have[96], want[96];
            pos_format(cur, have, sizeof(have));
            pos_format(s->expected, want, sizeof(want));
            fprintf(stderr,
                    "bench-cursor: the cursor of %s is at '%s', behind '%s' where this relay"
                    " left it: Redis lost writes\n",
                    s->name, have, want);
            exit(3);
        }
        int first = 0;
        while (first < s->nrows && pos_cmp(row_pos(res, s->rows[first], tick), cur) <= 0)
            first++;
        c->skipped += first;
        s->expected = cur;
        s->touched = 1;
        if (first == s->nrows)
            return;
        struct pos moved;
        append_call(rd, a, res, s, s->rows + first, s->nrows - first, cur, tick, &moved);
        c->calls++;
        if (read_reply(rd, &cur)) {
            c->appended += s->nrows - first;
            s->expected = moved;
            return;
        }
    }
}

/* ---- main ---------------------------------------------------------------- */

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        die("cannot open the function library", path);
    char *buf = NULL;
    size_t len = 0, cap = 0, n;
    do {
        if (len + 4096 + 1 > cap) {
            cap = (len + 4096 + 1) * 2;
            buf = xrealloc(buf, cap);
        }
        n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
    } while (n > 0);
    fclose(f);
    buf[len] = '\0';
    return buf;
}

/* A PostgreSQL array literal being written: "{a,b,...}". */
struct text {
    char *p;
    size_t len, cap;
};

static void text_put(struct text *t, const char *s, size_t n)
{
    if (t->len + n + 1 > t->cap) {
        t->cap = (t->len + n + 1) * 2;
        t->p = xrealloc(t->p, t->cap);
    }
    memcpy(t->p + t->len, s, n);
    t->len += n;
    t->p[t->len] = '\0';
}

/* One element, double-quoted when quote is set (a stream's name). */
static void array_item(struct text *t, const char *s, int quote)
{
    text_put(t, t->len == 0 ? "{" : ",", 1);
    if (quote)
        text_put(t, "\"", 1);
    for (; *s; s++) {
        if (quote && (*s == '"' || *s == '\\'))
            text_put(t, "\\", 1);
        text_put(t, s, 1);
    }
    if (quote)
        text_put(t, "\"", 1);
}

static const char *array_end(struct text *t)
{
    if (t->len == 0)
        text_put(t, "{", 1);
    text_put(t, "}", 1);
    return t->p;
}

static void array_item_num(struct text *t, uint64_t v)
{
    char num[24];
    snprintf(num, sizeof(num), "%" PRIu64, v);
    array_item(t, num, 0);
}

int main(int argc, char **argv)
{
    const char *conninfo = NULL, *rhost = "127.0.0.1", *consumer = "bench";
    const char *function_file = CURSOR_FUNCTION_FILE, *publish = "fcall";
    int rport = 6379, fetch = 500, poll_ms = 1;
    long until = 0;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL)
            die("usage", "see the comment at the top of bench/extra/snapshot_cursor.c");
        i++;
        if (strcmp(o, "--postgres") == 0)
            conninfo = v;
        else if (strcmp(o, "--redis-host") == 0)
            rhost = v;
        else if (strcmp(o, "--redis-port") == 0)
            rport = atoi(v);
        else if (strcmp(o, "--consumer") == 0)
            consumer = v;
        else if (strcmp(o, "--fetch") == 0)
            fetch = atoi(v);
        else if (strcmp(o, "--poll-ms") == 0)
            poll_ms = atoi(v);
        else if (strcmp(o, "--until") == 0)
            until = atol(v);
        else if (strcmp(o, "--function") == 0)
            function_file = v;
        else if (strcmp(o, "--publish") == 0)
            publish = v;
        else
            die("unknown option", o);
    }
    int ids = strcmp(publish, "ids") == 0;
    if (conninfo == NULL || fetch < 1 || poll_ms < 0 || (!ids && strcmp(publish, "fcall") != 0))
        die("usage",
            "--postgres CONNINFO --redis-port PORT [--fetch N >= 1] [--publish fcall|ids]");
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);

    PGconn *pg = PQconnectdb(conninfo);
    if (PQstatus(pg) != CONNECTION_OK)
        die("cannot connect to PostgreSQL", PQerrorMessage(pg));
    redisContext *rd = redisConnect(rhost, rport);
    if (rd == NULL || rd->err)
        die("cannot connect to Redis", rd ? rd->errstr : "out of memory");
    if (!ids) {
        char *library = read_file(function_file);
        redisReply *lr = redisCommand(rd, "FUNCTION LOAD REPLACE %s", library);
        if (lr == NULL || lr->type == REDIS_REPLY_ERROR)
            die("FUNCTION LOAD", lr ? lr->str : rd->errstr);
        freeReplyObject(lr);
        free(library);
    }
    /* The chunk query is planned once: its plan does not depend on the values. */
    PGresult *set = PQexec(pg, "SET plan_cache_mode = force_generic_plan");
    if (PQresultStatus(set) != PGRES_COMMAND_OK)
        die("SET plan_cache_mode", PQerrorMessage(pg));
    PQclear(set);

    prepare(pg, "tick", "SELECT cursor_proto.tick()");
    prepare(pg, "bounds",
            "SELECT lo, hi, older, prev_snap, next_snap, next_ms"
            " FROM cursor_proto.batch_bounds($1::bigint, $2::bigint)");
    prepare(pg, "rows",
            "SELECT * FROM cursor_proto.batch_rows($1::xid8, $2::xid8, $3::xid8[],"
            " $4::pg_snapshot, $5::pg_snapshot, $6::xid8, $7::bigint, $8::integer)");
    prepare(pg, "finish",
            "SELECT last_tick, latest_tick FROM cursor_proto.finish_batch($1, $2::bigint,"
            " $3::text[], $4::bigint[], $5::xid8[], $6::bigint[])");

    /* Where this consumer is, and where PostgreSQL last saw each cursor. */
    const char *cp[1] = {consumer};
    PGresult *res = PQexecParams(pg, "SELECT last_tick FROM cursor_proto.state WHERE name = $1", 1,
                                 NULL, cp, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1)
        die("no consumer: SELECT cursor_proto.register(name) first", PQerrorMessage(pg));
    int64_t last = atoll(PQgetvalue(res, 0, 0)), latest = 0;
    PQclear(res);
    res = PQexec(pg, "SELECT stream, tick, txid::text, id FROM cursor_proto.positions");
    if (PQresultStatus(res) != PGRES_TUPLES_OK)
        die("positions", PQerrorMessage(pg));
    for (int i = 0; i < PQntuples(res); i++) {
        struct stream *s = stream_get(PQgetvalue(res, i, 0), (size_t)PQgetlength(res, i, 0));
        s->expected.tick = atoll(PQgetvalue(res, i, 1));
        s->expected.txid = strtoull(PQgetvalue(res, i, 2), NULL, 10);
        s->expected.id = atoll(PQgetvalue(res, i, 3));
    }
    PQclear(res);

    struct argv a = {0};
    struct counts c = {0};
    int *order = NULL, caporder = 0;
    struct pos *moved = NULL;
    char fetch_s[16];
    snprintf(fetch_s, sizeof(fetch_s), "%d", fetch);
    double started = now_s(), first = 0;
    while (!stop && (until == 0 || c.appended + c.skipped < until)) {
        int64_t tick = last + 1;
        if (latest < tick) {
            double t0 = now_s();
            res = run(pg, "tick", 0, NULL, 0);
            latest = atoll(PQgetvalue(res, 0, 0));
            PQclear(res);
            c.tick_s += now_s() - t0;
            if (latest < tick) {
                if (poll_ms > 0) {
                    struct timespec ts = {poll_ms / 1000, (long)(poll_ms % 1000) * 1000000L};
                    nanosleep(&ts, NULL);
                }
                continue;
            }
        }
        if (first == 0)
            first = now_s();
        double t0 = now_s();
        char last_s[24], tick_s[24];
        snprintf(last_s, sizeof(last_s), "%" PRId64, last);
        snprintf(tick_s, sizeof(tick_s), "%" PRId64, tick);
        const char *bp[2] = {last_s, tick_s};
        PGresult *bounds = run(pg, "bounds", 2, bp, 0);
        if (PQntuples(bounds) != 1)
            die("batch bounds", "a tick is missing");
        char after_txid[24] = "0", after_id[24] = "0";
        const char *rp[8] = {PQgetvalue(bounds, 0, 0),
                             PQgetvalue(bounds, 0, 1),
                             PQgetvalue(bounds, 0, 2),
                             PQgetvalue(bounds, 0, 3),
                             PQgetvalue(bounds, 0, 4),
                             after_txid,
                             after_id,
                             fetch_s};
        struct chunk ch = {NULL, tick, strtoull(PQgetvalue(bounds, 0, 5), NULL, 10), 0};
        send_rows(pg, rp);
        res = get_rows(pg);
        c.read_s += now_s() - t0;
        while (res != NULL) {
            int n = PQntuples(res);
            if (n == 0) {
                PQclear(res);
                break;
            }
            c.chunks++;
            /* The next chunk's query at once: PostgreSQL reads it while this
             * one is published. */
            int more = n == fetch;
            if (more) {
                struct pos lastpos = row_pos(res, n - 1, tick);
                snprintf(after_txid, sizeof(after_txid), "%" PRIu64, lastpos.txid);
                snprintf(after_id, sizeof(after_id), "%" PRId64, lastpos.id);
                send_rows(pg, rp);
            }
            if (n > caporder) {
                caporder = n;
                order = xrealloc(order, sizeof(int) * (size_t)caporder);
                moved = xrealloc(moved, sizeof(struct pos) * (size_t)caporder);
            }
            ch.res = res;
            int norder;
            group_rows(rd, &ch, ids, order, &norder, &c);
            for (int k = 0; k < norder; k++) {
                struct stream *s = &streams[order[k]];
                if (ids)
                    append_multi(rd, &a, &ch, s);
                else
                    append_call(rd, &a, res, s, s->rows, s->nrows, s->expected, tick, &moved[k]);
                c.calls++;
            }
            flush(rd);
            t0 = now_s();
            int refusals = 0;
            for (int k = 0; k < norder; k++) {
                struct stream *s = &streams[order[k]];
                if (ids) {
                    read_multi(rd, &ch, s, &c);
                } else if (read_reply(rd, &moved[k])) {
                    c.appended += s->nrows;
                    s->expected = moved[k];
                    s->touched = 1;
                    order[k] = -1;
                } else {
                    refusals++; /* moved[k]: where the cursor is */
                }
            }
            /* Every reply of the pipeline is in: now the refused calls, one
             * at a time. */
            for (int k = 0; refusals > 0 && k < norder; k++)
                if (order[k] >= 0)
                    resolve_refusal(rd, &a, res, &streams[order[k]], tick, moved[k], &c);
            c.publish_wait_s += now_s() - t0;
            ch.base += (uint64_t)n;
            PQclear(res);
            res = NULL;
            if (more) {
                t0 = now_s();
                res = get_rows(pg);
                c.read_s += now_s() - t0;
            }
        }
        PQclear(bounds);

        /* The batch is in Redis: record each stream's cursor and the tick. */
        t0 = now_s();
        struct text sa = {0}, ta = {0}, xa = {0}, ia = {0};
        for (int i = 0; i < nstreams; i++) {
            struct stream *s = &streams[i];
            if (!s->touched)
                continue;
            array_item(&sa, s->name, 1);
            array_item_num(&ta, (uint64_t)s->expected.tick);
            array_item_num(&xa, s->expected.txid);
            array_item_num(&ia, (uint64_t)s->expected.id);
            s->touched = 0;
        }
        const char *fp[6] = {consumer,       tick_s,         array_end(&sa),
                             array_end(&ta), array_end(&xa), array_end(&ia)};
        res = run(pg, "finish", 6, fp, 0);
        int64_t recorded = atoll(PQgetvalue(res, 0, 0));
        latest = atoll(PQgetvalue(res, 0, 1));
        PQclear(res);
        free(sa.p);
        free(ta.p);
        free(xa.p);
        free(ia.p);
        c.finish_s += now_s() - t0;
        c.batches++;
        /* Another relay recorded later batches: their rows are in Redis. */
        last = recorded > tick ? recorded : tick;
    }
    double took = now_s() - started;
    printf("{\"events\": %ld, \"appended\": %ld, \"skipped\": %ld, \"refused\": %ld,"
           " \"calls\": %ld, \"batches\": %ld, \"chunks\": %ld, \"last_tick\": %" PRId64 ","
           " \"seconds\": %.4f, \"first_batch_after\": %.4f, \"tick_s\": %.4f,"
           " \"read_s\": %.4f, \"publish_wait_s\": %.4f, \"finish_s\": %.4f}\n",
           c.appended + c.skipped, c.appended, c.skipped, c.refused, c.calls, c.batches, c.chunks,
           last, took, first > 0 ? first - started : 0.0, c.tick_s, c.read_s, c.publish_wait_s,
           c.finish_s);
    fflush(stdout);
    free(a.v);
    free(a.len);
    free(a.scratch);
    free(order);
    free(moved);
    for (int i = 0; i < nstreams; i++) {
        free(streams[i].name);
        free(streams[i].cursor_key);
        free(streams[i].rows);
    }
    free(streams);
    redisFree(rd);
    PQfinish(pg);
    return 0;
}
