/*
 * A claimed row, from its columns to the publish command (relay/cycle_io.c
 * parse_row, relay/batch.c): the bytes are the claim's rows, each as its 12
 * columns in the claim query's order, every column a 2-byte big-endian
 * length (0xffff for SQL NULL) and that many bytes, as libpq hands them
 * over (binary id, attempts, payload size and partitions; binary text[] of
 * header names and values). Before the rows, one byte picks the stream
 * prefix and one the max_payload_bytes.
 *
 * Each row that decodes is checked and built both ways: as the argv of a
 * call of its own (relay_batch_build_publish), and as the relay sends it,
 * checked (relay_batch_check_publish) and straight into the Redis protocol
 * in a call of several rows (relay_batch_append_publish_call). They must
 * agree on whether the row can be published and why not, and when it can,
 * the call of the row alone must read back as that argv's stream, record,
 * deadline and fields. Then the published rows of one stream must go in one
 * call that reads back whole, and their retire commands must read back as
 * well-formed commands.
 */
#include "common/compat.h"

#include <libpq-fe.h>

#include "common/buf.h"
#include "relay/batch.h"

#include "fuzz.h"

/* File-local in relay/cycle_io.c (OUTBOX_STATIC is empty in relay_unit). */
int parse_row(PGresult *res, int i, struct relay_row *row);

#define ROWS_MAX 8
#define COLUMNS 12

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

/* The reply the protocol in buf reads back as: one array of strings. */
static redisReply *read_command(const char *buf, size_t len)
{
    redisReply *r = NULL;
    if (fuzz_replies((const uint8_t *)buf, len, &r, 1) != 1 || r->type != REDIS_REPLY_ARRAY)
        fuzz_fail("a command that does not read back as an array", buf);
    for (size_t k = 0; k < r->elements; k++)
        if (r->element[k]->type != REDIS_REPLY_STRING)
            fuzz_fail("a command argument that is not a string", buf);
    return r;
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

static void publish(struct relay_row *row, const char *prefix, uint32_t max_payload)
{
    static struct relay_publish_cmd cmd;
    char err1[OUTBOX_ERROR_MAX], err2[OUTBOX_ERROR_MAX];
    enum relay_row_fault fault = RELAY_FAULT_NONE;

    int built = relay_batch_build_publish(row, prefix, max_payload, 86400000, 1718000000000ULL,
                                          &cmd, err1, sizeof(err1));
    int checked = relay_batch_check_publish(row, prefix, max_payload, err2, sizeof(err2), &fault);
    if ((built == 0) != (checked == 0))
        fuzz_fail("argv and check disagree on whether the row can be published",
                  built != 0 ? err1 : err2);
    if (built != 0) {
        if (strcmp(err1, err2) != 0)
            fuzz_fail("argv and check give different reasons", err2);
        if (fault == RELAY_FAULT_NONE)
            fuzz_fail("a row that cannot be published without a kind of failure", err2);
        return;
    }
    /* The row alone in a call: its stream, its record, then its fields as
     * the argv of its own call has them, after their count. */
    const struct relay_row *one = row;
    struct outbox_buf out;
    memset(&out, 0, sizeof(out));
    if (relay_batch_append_publish_call(&one, 1, NULL, prefix, max_payload, 86400000,
                                        1718000000000ULL, &out) != 0)
        fuzz_fail("a row that can be published cannot go in a call", "");
    if (out.data[out.len] != '\0')
        fuzz_fail("the call is not NUL-terminated", out.data);
    redisReply *got = read_command(out.data, out.len);
    int keyed = row->after != NULL;
    size_t nfields = (size_t)cmd.argc - 7 - (size_t)keyed;
    char count[24];
    int clen = snprintf(count, sizeof(count), "%zu", nfields);
    int ok = got->elements == 9 + nfields && same_arg(got, 0, "FCALL", 5) &&
             same_arg(got, 1, RELAY_FUNCTION_PUBLISH_MANY, strlen(RELAY_FUNCTION_PUBLISH_MANY)) &&
             same_arg(got, 2, "2", 1) && same_arg(got, 3, cmd.argv[3], cmd.argvlen[3]) &&
             same_arg(got, 4, cmd.argv[4], cmd.argvlen[4]) &&
             same_arg(got, 5, cmd.argv[5 + keyed], cmd.argvlen[5 + keyed]) &&
             same_arg(got, 6, cmd.argv[6 + keyed], cmd.argvlen[6 + keyed]) &&
             same_arg(got, 7, "1", 1) && same_arg(got, 8, count, (size_t)clen);
    for (size_t k = 0; ok && k < nfields; k++)
        ok = same_arg(got, 9 + k, cmd.argv[7 + keyed + k], cmd.argvlen[7 + keyed + k]);
    if (headers_are_text(row) && !ok)
        fuzz_fail("the call is not the argv of the row's own call", out.data);
    freeReplyObject(got);
    outbox_buf_free(&out);
    row->state = RELAY_ROW_PUBLISHED;
}

/* The published rows of the first published row's stream, in one call
 * behind the first row: it reads back as one command of the right length. */
static void publish_together(struct relay_row *rows, size_t n, const char *prefix,
                             uint32_t max_payload)
{
    const struct relay_row *call[ROWS_MAX];
    const struct relay_row *after = NULL;
    size_t m = 0, fields = 0;
    for (size_t i = 0; i < n; i++) {
        if (rows[i].state != RELAY_ROW_PUBLISHED)
            continue;
        if (after == NULL) {
            after = &rows[i];
            continue;
        }
        if (!relay_batch_same_stream(&rows[i], after))
            continue;
        static struct relay_publish_cmd cmd;
        char err[OUTBOX_ERROR_MAX];
        struct relay_row alone = rows[i];
        alone.after = NULL;
        if (relay_batch_build_publish(&alone, prefix, max_payload, 1, 2, &cmd, err, sizeof(err)) !=
            0)
            fuzz_fail("a published row that cannot be built again", err);
        fields += (size_t)cmd.argc - 7;
        call[m++] = &rows[i];
    }
    if (m == 0)
        return;
    struct outbox_buf out;
    memset(&out, 0, sizeof(out));
    if (relay_batch_append_publish_call(call, m, after, prefix, max_payload, 1, 2, &out) != 0)
        fuzz_fail("rows of one stream that can be published cannot go in one call", "");
    redisReply *got = read_command(out.data, out.len);
    if (got->elements != 3 + 2 + m + 3 + m + fields)
        fuzz_fail("a call of several rows with the wrong number of arguments", out.data);
    freeReplyObject(got);
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

    struct outbox_buf out;
    memset(&out, 0, sizeof(out));
    size_t pos = 0;
    int rc;
    while ((rc = relay_batch_append_retire(rows, nrows, prefix, 86400000, &pos, &out)) == 1) {
        freeReplyObject(read_command(out.data, out.len));
        outbox_buf_reset(&out);
    }
    if (rc != 0)
        fuzz_fail("retire did not fit an empty buffer", NULL);
    outbox_buf_free(&out);
    PQclear(res);
    return 0;
}
