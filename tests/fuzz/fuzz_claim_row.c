/*
 * A row of a batch, from its columns to its XADD (relay/loop_io.c parse_row,
 * relay/batch.c): the bytes are the batch's rows, each as its 11 columns in
 * the batch query's order, every column a 2-byte big-endian length (0xffff
 * for SQL NULL) and that many bytes, as libpq hands them over (binary id,
 * payload size and partitions; binary text[] of header names and
 * values). Before the rows, one byte picks the stream prefix and one the
 * max_payload_bytes.
 *
 * Each row that decodes is checked (relay_batch_check_publish): a row that
 * cannot be published must say why and with what kind of failure; one that
 * can must go alone into a MULTI / XADD / EXEC (relay_batch_append_xadd_call)
 * whose XADD reads back as its stream, its entry id and its fields, the
 * header names and values as the row holds them. Then the published rows of
 * one stream must go in one call that reads back as MULTI, one XADD each of
 * the right length, and EXEC.
 */
#include "common/compat.h"

#include <libpq-fe.h>

#include "common/buf.h"
#include "common/keys.h"
#include "relay/batch.h"

#include "fuzz.h"

/* File-local in relay/loop_io.c (OUTBOX_STATIC is empty in relay_unit). */
int parse_row(PGresult *res, int i, struct relay_row *row);

#define ROWS_MAX 8
#define COLUMNS 11

static const char *const prefixes[] = {"", "outbox:", "a.b_c-d:", "p"};
static const uint32_t payload_limits[] = {1048576, 16, 0, 536870912};

/* Reads one row's columns into res's row i: 0, or -1 when the bytes end. */
static int read_row(PGresult *res, int i, const uint8_t *data, size_t size, size_t *off)
{
    for (int col = 0; col < COLUMNS; col++) {
        if (size - *off < 2)
            return -1;
        unsigned len = (unsigned)data[*off] << 8 | data[*off + 1];
        *off += 2;
        if (len == 0xffff) {
            if (!PQsetvalue(res, i, col, NULL, -1))
                abort();
            continue;
        }
        if (len > size - *off)
            return -1;
        /* PostgreSQL text has no NUL byte: message_id, topic, partition_key,
         * created_at and jsonb_typeof come as text. */
        char value[0xffff];
        memcpy(value, data + *off, len);
        if (col == 1 || col == 2 || col == 3 || col == 5 || col == 6)
            for (unsigned k = 0; k < len; k++)
                if (value[k] == '\0')
                    value[k] = '\1';
        /* PQsetvalue copies and NUL-terminates, as libpq does for a value it read. */
        if (!PQsetvalue(res, i, col, value, (int)len))
            abort();
        *off += len;
    }
    return 0;
}

/* The commands the protocol in buf reads back as, each one array of
 * strings: n of them in rs. */
static void read_commands(const char *buf, size_t len, redisReply **rs, size_t n)
{
    if (fuzz_replies((const uint8_t *)buf, len, rs, n) != (int)n)
        fuzz_fail("a call that does not read back as its commands", buf);
    for (size_t i = 0; i < n; i++) {
        if (rs[i]->type != REDIS_REPLY_ARRAY)
            fuzz_fail("a command that does not read back as an array", buf);
        for (size_t k = 0; k < rs[i]->elements; k++)
            if (rs[i]->element[k]->type != REDIS_REPLY_STRING)
                fuzz_fail("a command argument that is not a string", buf);
    }
}

/* Whether the header names and values have no NUL byte, as the elements of
 * a text[] from PostgreSQL never do. */
static int headers_are_text(const struct relay_row *row)
{
    const char *items[OUTBOX_HEADERS_MAX];
    size_t lens[OUTBOX_HEADERS_MAX];
    const char *arrays[2] = {row->header_names, row->header_values};
    size_t array_lens[2] = {row->header_names_len, row->header_values_len};
    for (int a = 0; a < 2; a++) {
        int n = relay_batch_decode_text_array(arrays[a], array_lens[a], items, lens,
                                              OUTBOX_HEADERS_MAX);
        for (int i = 0; i < n; i++)
            if (memchr(items[i], '\0', lens[i]) != NULL)
                return 0;
    }
    return 1;
}

/* Whether argument k of the command r read back is the n bytes at s. */
static int same_arg(const redisReply *r, size_t k, const char *s, size_t n)
{
    return k < r->elements && r->element[k]->len == n && memcmp(r->element[k]->str, s, n) == 0;
}

/* Whether the XADD x read back holds row's fields, from argument 3 on: id,
 * topic, key, payload, created_at, outbox_id, then "h.<name>" and value per
 * header. */
static int same_fields(const redisReply *x, const struct relay_row *row)
{
    size_t k = 3;
    char id[24];
    int idlen = snprintf(id, sizeof(id), "%lld", (long long)row->id);
    int ok = same_arg(x, k, "id", 2) && same_arg(x, k + 1, row->message_id, row->message_id_len) &&
             same_arg(x, k + 2, "topic", 5) && same_arg(x, k + 3, row->topic, row->topic_len);
    k += 4;
    if (ok && row->key != NULL) {
        ok = same_arg(x, k, "key", 3) && same_arg(x, k + 1, row->key, row->key_len);
        k += 2;
    }
    ok = ok && same_arg(x, k, "payload", 7) && same_arg(x, k + 1, row->payload, row->payload_len) &&
         same_arg(x, k + 2, "created_at", 10) &&
         same_arg(x, k + 3, row->created_at, row->created_at_len) &&
         same_arg(x, k + 4, "outbox_id", 9) && same_arg(x, k + 5, id, (size_t)idlen);
    k += 6;
    if (ok && row->headers_type != NULL) {
        const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
        size_t nlens[OUTBOX_HEADERS_MAX], vlens[OUTBOX_HEADERS_MAX];
        int n = relay_batch_decode_text_array(row->header_names, row->header_names_len, names,
                                              nlens, OUTBOX_HEADERS_MAX);
        if (relay_batch_decode_text_array(row->header_values, row->header_values_len, values, vlens,
                                          OUTBOX_HEADERS_MAX) != n)
            return 0;
        for (int i = 0; ok && i < n; i++) {
            if (k + 1 >= x->elements)
                return 0;
            const redisReply *name = x->element[k];
            ok = name->len == 2 + nlens[i] && memcmp(name->str, "h.", 2) == 0 &&
                 memcmp(name->str + 2, names[i], nlens[i]) == 0 &&
                 same_arg(x, k + 1, values[i], vlens[i]);
            k += 2;
        }
    }
    return ok && k == x->elements;
}

static void publish(struct relay_row *row, const char *prefix, uint32_t max_payload)
{
    char err[OUTBOX_ERROR_MAX];
    enum relay_row_fault fault = RELAY_FAULT_NONE;
    err[0] = '\0';
    if (relay_batch_check_publish(row, prefix, max_payload, err, sizeof(err), &fault) != 0) {
        if (fault == RELAY_FAULT_NONE)
            fuzz_fail("a row that cannot be published without a kind of failure", err);
        if (err[0] == '\0')
            fuzz_fail("a row that cannot be published without a reason", NULL);
        if (row->call_bytes != 0)
            fuzz_fail("a row that cannot be published with a size", err);
        return;
    }
    /* The row alone in a call: MULTI, its XADD, EXEC. */
    const struct relay_row *one = row;
    struct outbox_buf out;
    memset(&out, 0, sizeof(out));
    size_t ends[3];
    if (relay_batch_append_xadd_call(&one, 1, prefix, max_payload, 1718000000000ULL, &out, ends) !=
        0)
        fuzz_fail("a row that can be published cannot go in a call", "");
    if (out.data[out.len] != '\0')
        fuzz_fail("the call is not NUL-terminated", out.data);
    if (ends[2] != out.len)
        fuzz_fail("the call does not end where its last command does", out.data);
    redisReply *got[3];
    read_commands(out.data, out.len, got, 3);
    char stream[512], id[RELAY_ENTRY_ID_MAX];
    int slen = outbox_key_partition_stream(prefix, row->topic, row->topic_len, row->partition,
                                           row->partitions, stream, sizeof(stream));
    size_t idlen = relay_batch_entry_id(1718000000000ULL, row->seq, id);
    int ok = same_arg(got[0], 0, "MULTI", 5) && got[0]->elements == 1 &&
             same_arg(got[2], 0, "EXEC", 4) && got[2]->elements == 1 &&
             same_arg(got[1], 0, "XADD", 4) && slen > 0 &&
             same_arg(got[1], 1, stream, (size_t)slen) && same_arg(got[1], 2, id, idlen);
    if (!ok)
        fuzz_fail("the call is not MULTI, the row's XADD to its stream, EXEC", out.data);
    if (headers_are_text(row) && !same_fields(got[1], row))
        fuzz_fail("the XADD does not hold the row's fields", out.data);
    for (int i = 0; i < 3; i++)
        freeReplyObject(got[i]);
    outbox_buf_free(&out);
    row->state = RELAY_ROW_PUBLISHED;
}

/* The published rows of the first published row's stream, in one call: it
 * reads back as MULTI, one XADD per row, EXEC. */
static void publish_together(struct relay_row *rows, size_t n, const char *prefix,
                             uint32_t max_payload)
{
    const struct relay_row *call[ROWS_MAX];
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (rows[i].state == RELAY_ROW_PUBLISHED &&
            (m == 0 || relay_batch_same_stream(&rows[i], call[0]))) {
            rows[i].seq = m;
            call[m++] = &rows[i];
        }
    if (m == 0)
        return;
    struct outbox_buf out;
    memset(&out, 0, sizeof(out));
    size_t ends[ROWS_MAX + 2];
    if (relay_batch_append_xadd_call(call, m, prefix, max_payload, 7, &out, ends) != 0)
        fuzz_fail("rows of one stream that can be published cannot go in one call", "");
    redisReply *got[ROWS_MAX + 2];
    read_commands(out.data, out.len, got, m + 2);
    for (size_t i = 0; i < m; i++)
        if (!same_arg(got[i + 1], 0, "XADD", 4) || got[i + 1]->elements != 3 + call[i]->call_fields)
            fuzz_fail("an XADD of a call of several rows with the wrong number of arguments",
                      out.data);
    for (size_t i = 0; i < m + 2; i++)
        freeReplyObject(got[i]);
    outbox_buf_free(&out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct relay_row rows[ROWS_MAX];
    if (size < 2)
        return 0;
    const char *prefix = prefixes[data[0] % OUTBOX_ARRAY_LEN(prefixes)];
    uint32_t max_payload = payload_limits[data[1] % OUTBOX_ARRAY_LEN(payload_limits)];
    size_t off = 2;

    PGresult *res = PQmakeEmptyPGresult(NULL, PGRES_TUPLES_OK);
    PGresAttDesc attrs[COLUMNS];
    static char names[COLUMNS][4];
    memset(attrs, 0, sizeof(attrs));
    for (int col = 0; col < COLUMNS; col++) {
        snprintf(names[col], sizeof(names[col]), "c%d", col);
        attrs[col].name = names[col];
        attrs[col].format = 1;
    }
    if (res == NULL || !PQsetResultAttrs(res, COLUMNS, attrs))
        abort();
    int n = 0;
    while (n < ROWS_MAX && read_row(res, n, data, size, &off) == 0)
        n++;

    size_t nrows = 0;
    for (int i = 0; i < n; i++) {
        if (parse_row(res, i, &rows[nrows]) != 0)
            continue;
        if (rows[nrows].partitions > 1 && rows[nrows].partition >= rows[nrows].partitions)
            fuzz_fail("a partition out of range", NULL);
        publish(&rows[nrows], prefix, max_payload);
        nrows++;
    }
    publish_together(rows, nrows, prefix, max_payload);
    PQclear(res);
    return 0;
}
