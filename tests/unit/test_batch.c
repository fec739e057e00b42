/* Unit tests of relay/batch.c: what a stream's MULTI / XADD ... / EXEC looks
 * like, which rows cannot be published and why, entry ids, and the binary
 * decoders. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>

#include "relay/batch.h"
#include "common/keys.h"

static const char MID[] = "0b6c3b7e-8f5e-4f7a-9a51-1c2d3e4f5a6b";

static struct relay_row make_row(const char *topic, const char *payload, size_t payload_len)
{
    struct relay_row row;
    memset(&row, 0, sizeof(row));
    row.id = 42;
    row.message_id = MID;
    row.message_id_len = strlen(MID);
    row.topic = topic;
    row.topic_len = strlen(topic);
    row.payload = payload;
    row.payload_len = payload_len;
    row.created_at = "2026-11-30T11:35:14.123456Z";
    row.created_at_len = strlen(row.created_at);
    return row;
}

/* Builds a binary text[] the way PostgreSQL sends it. */
static size_t encode_array(char *buf, const char *const *items, int n)
{
    size_t off = 0;
    uint32_t hdr[5] = {1, 0, 25, (uint32_t)n, 1};
    if (n == 0) {
        uint32_t empty[3] = {0, 0, 25};
        for (int i = 0; i < 3; i++) {
            uint32_t v = __builtin_bswap32(empty[i]);
            memcpy(buf + off, &v, 4);
            off += 4;
        }
        return off;
    }
    for (int i = 0; i < 5; i++) {
        uint32_t v = __builtin_bswap32(hdr[i]);
        memcpy(buf + off, &v, 4);
        off += 4;
    }
    for (int i = 0; i < n; i++) {
        uint32_t len = (uint32_t)strlen(items[i]);
        uint32_t v = __builtin_bswap32(len);
        memcpy(buf + off, &v, 4);
        off += 4;
        memcpy(buf + off, items[i], len);
        off += len;
    }
    return off;
}

static void test_topic_charset(void **state)
{
    (void)state;
    assert_true(outbox_topic_valid("orders", 6));
    assert_true(outbox_topic_valid("Orders.v2_eu-west", 17));
    assert_false(outbox_topic_valid("", 0));
    assert_false(outbox_topic_valid("bad topic", 9));
    assert_false(outbox_topic_valid("{x}", 3));
    assert_false(outbox_topic_valid("a:b", 3));
    assert_false(outbox_topic_valid("caf\xc3\xa9", 5));
    char longt[OUTBOX_TOPIC_MAX + 2];
    memset(longt, 'a', sizeof(longt));
    assert_true(outbox_topic_valid(longt, OUTBOX_TOPIC_MAX));
    assert_false(outbox_topic_valid(longt, OUTBOX_TOPIC_MAX + 1));
}

static void test_stream_and_dedup_key_share_hash_tag(void **state)
{
    (void)state;
    char stream[64], key[128];
    assert_int_equal(outbox_key_stream("app:", "orders", 6, stream, sizeof(stream)), 10);
    assert_string_equal(stream, "app:orders");
    assert_true(outbox_key_dedup(stream, MID, strlen(MID), key, sizeof(key)) > 0);
    assert_string_equal(key, "{app:orders}:dedup:0b6c3b7e-8f5e-4f7a-9a51-1c2d3e4f5a6b");
    assert_int_equal(outbox_key_stream("", "orders", 6, stream, 4), -1);
}

/* CLUSTER KEYSLOT's answers (the Redis Cluster specification's examples and
 * redis-server 7.0), and the hash tag rules: first "{", next "}", not empty. */
static void test_cluster_slot(void **state)
{
    (void)state;
    assert_int_equal(outbox_key_slot("foo", 3), 12182);
    assert_int_equal(outbox_key_slot("hello", 5), 866);
    assert_int_equal(outbox_key_slot("somekey", 7), 11058);
    assert_int_equal(outbox_key_slot("foo{hash_tag}", 13), 2515);
    assert_int_equal(outbox_key_slot("bar{hash_tag}", 13), 2515);
    assert_int_equal(outbox_key_slot("{}foo", 5), outbox_key_slot("{}foo", 5));
    assert_int_equal(outbox_key_slot("{}foo", 5) == outbox_key_slot("foo", 3), 0);
    assert_int_equal(outbox_key_slot("{foo", 4) == outbox_key_slot("foo", 3), 0);
    assert_int_equal(outbox_key_slot("{foo}{bar}", 10), outbox_key_slot("foo", 3));
    assert_int_equal(outbox_key_slot("x{{foo}}", 8), outbox_key_slot("{foo", 4));
    /* A stream and every key derived from it share a slot. */
    char key[128];
    unsigned slot = outbox_key_slot("app:orders", 10);
    assert_true(outbox_key_dedup("app:orders", MID, strlen(MID), key, sizeof(key)) > 0);
    assert_int_equal(outbox_key_slot(key, strlen(key)), slot);
    assert_true(outbox_key_lease("app:orders", "g", "lease", key, sizeof(key)) > 0);
    assert_int_equal(outbox_key_slot(key, strlen(key)), slot);
}

/* The vectors of docs/PARTITIONS.md; tests/integration/test_partitions.py
 * checks outbox.fnv1a32 against the same. */
static void test_partition_hash_vectors(void **state)
{
    (void)state;
    static const struct {
        const char *key;
        uint32_t hash;
    } v[] = {
        {"", 0x811c9dc5u},         {"a", 0xe40c292cu},
        {"foobar", 0xbf9cf968u},   {"123456789", 0xbb86b11cu},
        {"\xc3\xa9", 0x1e9de8c1u}, {"\xe6\x97\xa5\xe6\x9c\xac", 0x9f26ee51u},
        {"order-42", 0x572446f4u},
    };
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(v); i++)
        assert_int_equal(outbox_partition_hash(v[i].key, strlen(v[i].key)), v[i].hash);
    assert_int_equal(outbox_partition_of("order-42", 8, 7, 8), 0x572446f4u % 8);
    assert_int_equal(outbox_partition_of("order-42", 8, 7, 1000), 0x572446f4u % 1000);
    assert_int_equal(outbox_partition_of("order-42", 8, 7, 1), 0);
    assert_int_equal(outbox_partition_of("order-42", 8, 7, 0), 0);
    /* No key: spread by id. */
    assert_int_equal(outbox_partition_of(NULL, 0, 13, 8), 5);
    assert_int_equal(outbox_partition_of(NULL, 0, 13, 1), 0);
}

static void test_partition_stream_names(void **state)
{
    (void)state;
    char stream[64];
    int partition;
    assert_int_equal(outbox_key_partition_stream("app:", "orders", 6, 3, 8, stream, sizeof(stream)),
                     14);
    assert_string_equal(stream, "app:orders:003");
    assert_int_equal(
        outbox_key_partition_stream("", "orders", 6, 999, 1000, stream, sizeof(stream)), 10);
    assert_string_equal(stream, "orders:999");
    assert_int_equal(outbox_key_partition_stream("app:", "orders", 6, 0, 1, stream, sizeof(stream)),
                     10);
    assert_string_equal(stream, "app:orders");
    assert_int_equal(outbox_key_partition_stream("", "orders", 6, 1, 2, stream, 10), -1);

    assert_int_equal(outbox_key_stream_topic_len("orders:003", 10, &partition), 6);
    assert_int_equal(partition, 3);
    assert_int_equal(outbox_key_stream_topic_len("a.b:120", 7, &partition), 3);
    assert_int_equal(partition, 120);
    assert_int_equal(outbox_key_stream_topic_len("orders", 6, &partition), 6);
    assert_int_equal(partition, -1);
    assert_int_equal(outbox_key_stream_topic_len("orders:12", 9, &partition), 9);
    assert_int_equal(partition, -1);
    assert_int_equal(outbox_key_stream_topic_len("x:1234", 6, &partition), 6);
    assert_int_equal(partition, -1);
    assert_int_equal(outbox_key_stream_topic_len(":003", 4, &partition), 4);
    assert_int_equal(partition, -1);
    assert_int_equal(outbox_key_stream_topic_len("o:0a3", 5, &partition), 5);
    assert_int_equal(partition, -1);
}

static void test_row_errors_say_what_to_do(void **state)
{
    (void)state;
    char err[512];
    enum relay_row_fault fault;

    struct relay_row bad_topic = make_row("bad topic", "x", 1);
    assert_int_equal(relay_batch_check_publish(&bad_topic, "", 1024, err, sizeof(err), &fault), -1);
    assert_non_null(strstr(err, "topic \"bad topic\" is not allowed"));
    /* The row itself is wrong: re-queued as it is, it is quarantined again,
     * so the advice is to drop it and write it again, never to retry it. */
    assert_non_null(strstr(err, "'outbox-relay failed drop 42'"));
    assert_non_null(strstr(err, "write it again from the fixed producer"));
    assert_null(strstr(err, "failed retry"));

    /* A limit an operator can raise: the same row then goes through, so the
     * advice is to raise it and re-queue the row. */
    struct relay_row big = make_row("orders", "0123456789", 10);
    assert_int_equal(relay_batch_check_publish(&big, "", 9, err, sizeof(err), &fault), -1);
    assert_non_null(strstr(err, "payload of 10 bytes exceeds max_payload_bytes (9)"));
    assert_non_null(strstr(err, "raise max_payload_bytes to at least 10"));
    assert_non_null(strstr(err, "then re-queue the row with 'outbox-relay failed retry 42'"));

    /* Over the largest max_payload_bytes there is, no setting helps. */
    struct relay_row huge = make_row("orders", NULL, 536870913);
    assert_int_equal(relay_batch_check_publish(&huge, "", 536870912, err, sizeof(err), &fault), -1);
    assert_non_null(strstr(err, "the largest it can be (536870912)"));
    assert_non_null(strstr(err, "'outbox-relay failed drop 42'"));
    assert_null(strstr(err, "failed retry"));

    struct relay_row arr = make_row("orders", "x", 1);
    arr.headers_type = "array";
    assert_int_equal(relay_batch_check_publish(&arr, "", 1024, err, sizeof(err), &fault), -1);
    assert_non_null(strstr(err, "headers must be a JSON object"));
    assert_non_null(strstr(err, "'outbox-relay failed drop 42'"));

    char toolong[OUTBOX_HEADER_NAME_MAX + 2];
    memset(toolong, 'n', sizeof(toolong) - 1);
    toolong[sizeof(toolong) - 1] = '\0';
    const char *names[] = {toolong};
    const char *values[] = {"v"};
    char nbuf[512], vbuf[64];
    struct relay_row hdr = make_row("orders", "x", 1);
    hdr.headers_type = "object";
    hdr.header_names = nbuf;
    hdr.header_names_len = encode_array(nbuf, names, 1);
    hdr.header_values = vbuf;
    hdr.header_values_len = encode_array(vbuf, values, 1);
    assert_int_equal(relay_batch_check_publish(&hdr, "", 1024, err, sizeof(err), &fault), -1);
    assert_non_null(strstr(err, "names are 1 to 128 bytes"));
    assert_non_null(strstr(err, "'outbox-relay failed drop 42'"));
}

static void test_decode_text_array(void **state)
{
    (void)state;
    const char *items[] = {"a", "", "xyz"};
    char buf[128];
    size_t len = encode_array(buf, items, 3);
    const char *out[4];
    size_t lens[4];
    assert_int_equal(relay_batch_decode_text_array(buf, len, out, lens, 4), 3);
    assert_int_equal(lens[0], 1);
    assert_int_equal(lens[1], 0);
    assert_memory_equal(out[2], "xyz", 3);
    /* Too many for the cap, truncated data, trailing junk. */
    assert_int_equal(relay_batch_decode_text_array(buf, len, out, lens, 2), -1);
    assert_int_equal(relay_batch_decode_text_array(buf, len - 1, out, lens, 4), -1);
    assert_int_equal(relay_batch_decode_text_array(buf, len + 1, out, lens, 4), -1);
    assert_int_equal(relay_batch_decode_text_array(buf, 8, out, lens, 4), -1);
    size_t elen = encode_array(buf, items, 0);
    assert_int_equal(relay_batch_decode_text_array(buf, elen, out, lens, 4), 0);
}

static void test_decode_integers(void **state)
{
    (void)state;
    const char i8[8] = {0, 0, 0, 0, 0, 0, 0x01, 0x02};
    const char neg[8] = {'\xff', '\xff', '\xff', '\xff', '\xff', '\xff', '\xff', '\xfe'};
    const char i4[4] = {0, 0, 0x01, 0x00};
    assert_int_equal(relay_batch_decode_int8(i8), 258);
    assert_true(relay_batch_decode_int8(neg) == -2);
    assert_int_equal(relay_batch_decode_int4(i4), 256);
}

/* Each expected text is what PostgreSQL 15 writes for the same value with
 * to_char(ts AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'). */
static void test_format_timestamp_as_to_char(void **state)
{
    (void)state;
    static const struct {
        int64_t us; /* since 2000-01-01 00:00 UTC */
        const char *text;
    } cases[] = {
        {0, "2000-01-01T00:00:00.000000Z"},
        {-1, "1999-12-31T23:59:59.999999Z"},
        {INT64_C(849999481123456), "2026-12-07T22:58:01.123456Z"},
        {INT64_C(762507296000001), "2024-02-29T07:34:56.000001Z"},
        {INT64_C(-946684800000000), "1970-01-01T00:00:00.000000Z"},
        {INT64_C(-63082281600000000), "0001-01-01T00:00:00.000000Z"},
        {INT64_C(-63082281600000001), "0001-12-31T23:59:59.999999Z"},  /* 1 BC */
        {INT64_C(-64464465600000000), "0044-03-15T12:00:00.000000Z"},  /* 44 BC */
        {INT64_C(-211810204800000000), "4713-01-01T00:00:00.000000Z"}, /* 4713 BC */
        {INT64_C(252455615999999999), "9999-12-31T23:59:59.999999Z"},
        {INT64_C(252455616000000000), "10000-01-01T00:00:00.000000Z"},
        {INT64_C(9223371331199999999), "294276-12-31T23:59:59.999999Z"},
        {INT64_MAX, ""}, /* infinity: to_char's NULL */
        {INT64_MIN, ""}, /* -infinity */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char out[RELAY_TIMESTAMP_MAX];
        memset(out, 'x', sizeof(out));
        size_t n = relay_batch_format_timestamp(cases[i].us, out);
        assert_string_equal(out, cases[i].text);
        assert_int_equal(n, strlen(cases[i].text));
    }
}

static void test_format_uuid_as_uuid_out(void **state)
{
    (void)state;
    const unsigned char id[16] = {0xa0, 0xee, 0xbc, 0x99, 0x9c, 0x0b, 0x4e, 0xf8,
                                  0xbb, 0x6d, 0x6b, 0xb9, 0xbd, 0x38, 0x0a, 0x11};
    char out[RELAY_UUID_LEN + 1];
    relay_batch_format_uuid(id, out);
    assert_string_equal(out, "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11");
}

/* The predecessor of each row by brute force: the last earlier row of its
 * stream that was sent. */
static int32_t last_sent_before(const struct relay_row *rows, const int *sent, size_t i)
{
    for (size_t j = i; j-- > 0;)
        if (sent[j] && rows[j].topic_len == rows[i].topic_len &&
            memcmp(rows[j].topic, rows[i].topic, rows[i].topic_len) == 0 &&
            rows[j].partitions == rows[i].partitions && rows[j].partition == rows[i].partition)
            return (int32_t)j;
    return -1;
}

static void test_stream_index_finds_the_row_before(void **state)
{
    (void)state;
    enum { N = 600 };
    static struct relay_row rows[N];
    static char topics[N][16];
    static int sent[N];
    struct relay_batch_streams x;
    assert_int_equal(relay_batch_streams_init(&x, N), 0);

    for (int round = 0; round < 4; round++) {
        /* Round 0: a few streams, partitions among them; round 1: as many
         * streams as rows (every slot probed past collisions); round 2: the
         * table cleared between batches, with some rows not sent; round 3:
         * the same across the wrap of the batch count. */
        for (size_t i = 0; i < N; i++) {
            unsigned t = round == 0 ? (unsigned)(i % 3) : (unsigned)((i * 7919u) % (N / 2 + 1));
            snprintf(topics[i], sizeof(topics[i]), "t%u", t);
            rows[i] = make_row(topics[i], "x", 1);
            if (round == 0 && t == 2) {
                rows[i].partitions = 4;
                rows[i].partition = (uint32_t)(i % 4);
            }
            sent[i] = round < 2 || i % 5 != 0;
        }
        if (round == 3)
            x.batch = UINT32_MAX;
        relay_batch_streams_clear(&x);
        for (size_t i = 0; i < N; i++) {
            int32_t *slot = relay_batch_streams_slot(&x, rows, i);
            assert_non_null(slot);
            assert_int_equal(*slot, last_sent_before(rows, sent, i));
            if (sent[i])
                *slot = (int32_t)i;
        }
    }
    relay_batch_streams_free(&x);
    assert_null(x.slots);
}

static void test_utf8_prefix_never_cuts_a_character(void **state)
{
    (void)state;
    const char *s = "a\xc3\xa9\xc3\xa9"; /* a, e-acute, e-acute: 5 bytes */
    assert_int_equal(relay_batch_utf8_prefix(s, 5, 10), 5);
    assert_int_equal(relay_batch_utf8_prefix(s, 5, 3), 3);
    assert_int_equal(relay_batch_utf8_prefix(s, 5, 2), 1);
    assert_int_equal(relay_batch_utf8_prefix(s, 5, 4), 3);
    const char *euro = "\xe2\x82\xac\xe2\x82\xac";
    assert_int_equal(relay_batch_utf8_prefix(euro, 6, 5), 3);
    assert_int_equal(relay_batch_utf8_prefix(euro, 6, 1), 0);

    /* A long non-ASCII topic: the quoted part in the error stays valid UTF-8. */
    char topic[128];
    topic[0] = 'a';
    for (int i = 0; i < 40; i++)
        memcpy(topic + 1 + 2 * i, "\xc3\xa9", 2);
    topic[81] = '\0';
    struct relay_row row = make_row(topic, "x", 1);
    char err[512];
    enum relay_row_fault fault;
    assert_int_equal(relay_batch_check_publish(&row, "", 1024, err, sizeof(err), &fault), -1);
    const char *q = strstr(err, "\"") + 1;
    const char *end = strchr(q, '\"');
    assert_int_equal((end - q) % 2, 1); /* "a" plus whole two-byte characters */
}

/* ---- commands in the Redis protocol ------------------------------------ */

/* Copies of rows, each checked as the relay checks a row before its call. */
static const struct relay_row *const *checked_copies(const struct relay_row *const *rows, size_t n,
                                                     const char *prefix, uint32_t max_payload)
{
    static struct relay_row copies[RELAY_CALL_ROWS];
    static const struct relay_row *out[RELAY_CALL_ROWS];
    char err[512];
    enum relay_row_fault fault;
    assert_true(n <= RELAY_CALL_ROWS);
    for (size_t i = 0; i < n; i++) {
        copies[i] = *rows[i];
        assert_int_equal(
            relay_batch_check_publish(&copies[i], prefix, max_payload, err, sizeof(err), &fault),
            0);
        out[i] = &copies[i];
    }
    return out;
}

/* The fields of row's entry, as the relay's contract names them (id, topic,
 * key, payload, created_at, outbox_id, then "h.<name>" per header), into
 * argv from position at: the new argc. */
static int entry_fields(const struct relay_row *row, const char **argv, size_t *argvlen, int at,
                        char outbox_id[24], char hnames[][OUTBOX_HEADER_NAME_MAX + 3])
{
    int argc = at;
#define ARG(s, l)                                                                                  \
    do {                                                                                           \
        argv[argc] = (s);                                                                          \
        argvlen[argc++] = (l);                                                                     \
    } while (0)
    ARG("id", 2);
    ARG(row->message_id, row->message_id_len);
    ARG("topic", 5);
    ARG(row->topic, row->topic_len);
    if (row->key != NULL) {
        ARG("key", 3);
        ARG(row->key, row->key_len);
    }
    ARG("payload", 7);
    ARG(row->payload, row->payload_len);
    ARG("created_at", 10);
    ARG(row->created_at, row->created_at_len);
    ARG("outbox_id", 9);
    ARG(outbox_id, (size_t)snprintf(outbox_id, 24, "%lld", (long long)row->id));
    if (row->headers_type != NULL) {
        const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
        size_t nlens[OUTBOX_HEADERS_MAX], vlens[OUTBOX_HEADERS_MAX];
        int n = relay_batch_decode_text_array(row->header_names, row->header_names_len, names,
                                              nlens, OUTBOX_HEADERS_MAX);
        assert_int_equal(relay_batch_decode_text_array(row->header_values, row->header_values_len,
                                                       values, vlens, OUTBOX_HEADERS_MAX),
                         n);
        for (int i = 0; i < n; i++) {
            ARG(hnames[i], (size_t)snprintf(hnames[i], OUTBOX_HEADER_NAME_MAX + 3, "h.%.*s",
                                            (int)nlens[i], names[i]));
            ARG(values[i], vlens[i]);
        }
    }
#undef ARG
    return argc;
}

/* MULTI, one "XADD <stream> <ms>-<seq> <fields>" per row, EXEC: the bytes
 * hiredis makes of each argv. */
static char *hiredis_xadd_call(const struct relay_row *const *rows, size_t n, const char *prefix,
                               uint64_t ms, size_t *len)
{
    static char all[1 << 20];
    enum { MAX_ARGS = 20 + 2 * OUTBOX_HEADERS_MAX };
    const char *argv[MAX_ARGS];
    size_t argvlen[MAX_ARGS];
    char id[64], stream[256 + OUTBOX_TOPIC_MAX], outbox_id[24];
    static char hnames[OUTBOX_HEADERS_MAX][OUTBOX_HEADER_NAME_MAX + 3];
    size_t off = 0;
    char *one = NULL;
    int l = redisFormatCommand(&one, "MULTI");
    memcpy(all + off, one, (size_t)l);
    off += (size_t)l;
    redisFreeCommand(one);
    for (size_t i = 0; i < n; i++) {
        const struct relay_row *row = rows[i];
        int slen = outbox_key_partition_stream(prefix, row->topic, row->topic_len, row->partition,
                                               row->partitions, stream, sizeof(stream));
        assert_true(slen > 0);
        int argc = 0;
        argv[argc] = "XADD";
        argvlen[argc++] = 4;
        argv[argc] = stream;
        argvlen[argc++] = (size_t)slen;
        argvlen[argc] = (size_t)snprintf(id, sizeof(id), "%llu-%llu", (unsigned long long)ms,
                                         (unsigned long long)row->seq);
        argv[argc++] = id;
        argc = entry_fields(row, argv, argvlen, argc, outbox_id, hnames);
        l = redisFormatCommandArgv(&one, argc, argv, argvlen);
        assert_true(l > 0 && off + (size_t)l < sizeof(all));
        memcpy(all + off, one, (size_t)l);
        off += (size_t)l;
        redisFreeCommand(one);
    }
    l = redisFormatCommand(&one, "EXEC");
    memcpy(all + off, one, (size_t)l);
    off += (size_t)l;
    redisFreeCommand(one);
    *len = off;
    return all;
}

/* row alone in a call, as the relay sends it: the bytes hiredis makes of
 * its commands. */
static void check_xadd_same(const struct relay_row *row, const char *prefix, uint32_t max_payload,
                            uint64_t ms, struct outbox_buf *buf)
{
    size_t len, ends[3];
    const struct relay_row *one = row;
    const char *want = hiredis_xadd_call(&one, 1, prefix, ms, &len);
    size_t before = buf->len;
    assert_int_equal(relay_batch_append_xadd_call(checked_copies(&one, 1, prefix, max_payload), 1,
                                                  prefix, max_payload, ms, buf, ends),
                     0);
    assert_int_equal(buf->len - before, len);
    assert_memory_equal(buf->data + before, want, len);
    assert_int_equal(buf->data[buf->len], '\0');
}

/* The XADD of row alone in a call, read back as Redis reads it: an array of
 * its arguments (freed with freeReplyObject). */
static redisReply *xadd_of(const struct relay_row *row, const char *prefix, uint64_t ms)
{
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    size_t ends[3];
    const struct relay_row *one = row;
    assert_int_equal(relay_batch_append_xadd_call(checked_copies(&one, 1, prefix, 1024), 1, prefix,
                                                  1024, ms, &buf, ends),
                     0);
    redisReader *reader = redisReaderCreate();
    assert_int_equal(redisReaderFeed(reader, buf.data + ends[0], ends[1] - ends[0]), REDIS_OK);
    void *reply = NULL;
    assert_int_equal(redisReaderGetReply(reader, &reply), REDIS_OK);
    assert_non_null(reply);
    redisReaderFree(reader);
    outbox_buf_free(&buf);
    return reply;
}

/* The value of the entry's field name, or -1. */
static int find_field(const redisReply *xadd, const char *name)
{
    /* Fields start after XADD stream id. */
    for (size_t i = 3; i + 1 < xadd->elements; i += 2)
        if (xadd->element[i]->len == strlen(name) &&
            memcmp(xadd->element[i]->str, name, xadd->element[i]->len) == 0)
            return (int)i + 1;
    return -1;
}

static void test_xadd_fields(void **state)
{
    (void)state;
    static const char payload[] = {'a', '\0', '\xff', '\r', '\n'};
    struct relay_row row = make_row("orders", payload, sizeof(payload));
    row.key = "customer-7";
    row.key_len = 10;
    row.seq = 3;
    redisReply *x = xadd_of(&row, "", 1796040000000ull);
    assert_int_equal(x->type, REDIS_REPLY_ARRAY);
    assert_string_equal(x->element[0]->str, "XADD");
    assert_string_equal(x->element[1]->str, "orders");
    assert_string_equal(x->element[2]->str, "1796040000000-3");
    int p = find_field(x, "payload");
    assert_true(p > 0);
    assert_int_equal(x->element[p]->len, sizeof(payload));
    assert_memory_equal(x->element[p]->str, payload, sizeof(payload));
    assert_int_equal(x->element[find_field(x, "id")]->len, 36);
    assert_memory_equal(x->element[find_field(x, "key")]->str, "customer-7", 10);
    assert_memory_equal(x->element[find_field(x, "outbox_id")]->str, "42", 2);
    assert_memory_equal(x->element[find_field(x, "created_at")]->str, "2026-11-30T11:35:14.123456Z",
                        27);
    assert_int_equal(find_field(x, "h.x"), -1);
    /* XADD stream id + 6 fields. */
    assert_int_equal(x->elements, 3 + 12);
    freeReplyObject(x);
}

static void test_xadd_no_key_field_when_null(void **state)
{
    (void)state;
    struct relay_row row = make_row("orders", "x", 1);
    redisReply *x = xadd_of(&row, "p.", 7);
    assert_int_equal(find_field(x, "key"), -1);
    assert_string_equal(x->element[1]->str, "p.orders");
    assert_string_equal(x->element[2]->str, "7-0");
    freeReplyObject(x);
}

static void test_xadd_headers(void **state)
{
    (void)state;
    const char *names[] = {"content-type", "trace"};
    const char *values[] = {"application/json", "abc"};
    char nbuf[256], vbuf[256];
    size_t nlen = encode_array(nbuf, names, 2), vlen = encode_array(vbuf, values, 2);
    struct relay_row row = make_row("orders", "x", 1);
    row.headers_type = "object";
    row.header_names = nbuf;
    row.header_names_len = nlen;
    row.header_values = vbuf;
    row.header_values_len = vlen;
    redisReply *x = xadd_of(&row, "", 1);
    int i = find_field(x, "h.content-type");
    assert_true(i > 0);
    assert_memory_equal(x->element[i]->str, "application/json", 16);
    assert_memory_equal(x->element[find_field(x, "h.trace")]->str, "abc", 3);
    /* A header named like a contract field cannot collide with it. */
    assert_int_equal(find_field(x, "trace"), -1);
    freeReplyObject(x);
}

static void test_append_xadd_matches_hiredis_one_row(void **state)
{
    (void)state;
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));

    /* Binary payload, a key, every prefix form. */
    static const char bin[] = {'a', '\0', '\xff', '\r', '\n', '$', '*'};
    struct relay_row row = make_row("orders", bin, sizeof(bin));
    check_xadd_same(&row, "", 1024, 1796040000000ull, &buf);
    check_xadd_same(&row, NULL, 1024, 1796040000000ull, &buf);
    row.key = "customer-7";
    row.key_len = 10;
    check_xadd_same(&row, "app:", 1024, 1796040000000ull, &buf);
    row.key = "";
    row.key_len = 0;
    check_xadd_same(&row, "app:", 1024, 1796040000000ull, &buf);
    /* A partition's stream, the first, the last. */
    row.partitions = 8;
    row.partition = 5;
    check_xadd_same(&row, "app:", 1024, 1796040000000ull, &buf);
    row.partitions = 1000;
    row.partition = 0;
    check_xadd_same(&row, "", 1024, 1796040000000ull, &buf);
    row.partition = 999;
    check_xadd_same(&row, NULL, 1024, 1796040000000ull, &buf);
    row.partitions = 1;
    row.partition = 0;

    /* Integers at their edges, in every argument that is one. */
    static const int64_t ids[] = {0, 1, 9, 10, 42, 99999, INT64_MAX, -1, INT64_MIN};
    static const uint64_t seqs[] = {0, 9, 10, UINT64_MAX};
    static const uint64_t times[] = {0, 1796040000000ull, UINT64_MAX};
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(ids); i++)
        for (size_t q = 0; q < OUTBOX_ARRAY_LEN(seqs); q++)
            for (size_t t = 0; t < OUTBOX_ARRAY_LEN(times); t++) {
                row.id = ids[i];
                row.seq = seqs[q];
                check_xadd_same(&row, "p.", 1024, times[t], &buf);
            }

    /* Lengths on both sides of each change in digit count, across the
     * buffer's first growth. */
    static char big[20000];
    memset(big, 'x', sizeof(big));
    static const size_t lens[] = {0,   1,    9,    10,   99,   100,   199,  200,
                                  999, 1000, 4095, 4096, 9999, 10000, 19999};
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(lens); i++) {
        struct relay_row r = make_row("bench1", big, lens[i]);
        check_xadd_same(&r, "", sizeof(big), 1796040000000ull, &buf);
    }

    /* Headers, one empty value among them; the longest topic and name. */
    char name128[OUTBOX_HEADER_NAME_MAX + 1];
    memset(name128, 'n', OUTBOX_HEADER_NAME_MAX);
    name128[OUTBOX_HEADER_NAME_MAX] = '\0';
    const char *names[] = {"content-type", "trace", name128};
    const char *values[] = {"application/json", "", "v"};
    char nbuf[512], vbuf[256];
    char topic[OUTBOX_TOPIC_MAX + 1];
    memset(topic, 'T', OUTBOX_TOPIC_MAX);
    topic[OUTBOX_TOPIC_MAX] = '\0';
    struct relay_row hdr = make_row(topic, "{\"a\":1}", 7);
    hdr.headers_type = "object";
    hdr.header_names = nbuf;
    hdr.header_names_len = encode_array(nbuf, names, 3);
    hdr.header_values = vbuf;
    hdr.header_values_len = encode_array(vbuf, values, 3);
    check_xadd_same(&hdr, "stream:", 1024, 1796040000000ull, &buf);
    hdr.key = "k";
    hdr.key_len = 1;
    check_xadd_same(&hdr, "stream:", 1024, 1796040000000ull, &buf);

    /* The empty headers object. */
    hdr.header_names_len = encode_array(nbuf, names, 0);
    hdr.header_values_len = encode_array(vbuf, values, 0);
    check_xadd_same(&hdr, "", 1024, 1796040000000ull, &buf);

    outbox_buf_free(&buf);
    assert_null(buf.data);
    outbox_buf_free(NULL);
}

/* A refused row: a message that says what to do, permanent, and nothing
 * appended for a call that holds it. */
static void check_xadd_refused(const struct relay_row *row, const char *prefix,
                               uint32_t max_payload, const char *expect, enum relay_row_cause cause)
{
    char err[512];
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    struct relay_row ok = make_row("orders", "x", 1);
    enum relay_row_fault ok_fault;
    assert_int_equal(relay_batch_check_publish(&ok, "", 1024, err, sizeof(err), &ok_fault), 0);
    size_t ends[3];
    const struct relay_row *call[] = {&ok, row};
    assert_int_equal(relay_batch_append_xadd_call(call, 1, "", 1024, 1, &buf, ends), 0);
    size_t before = buf.len;

    memset(err, 0, sizeof(err));
    enum relay_row_fault fault = RELAY_FAULT_NONE;
    struct relay_row copy = *row;
    assert_int_equal(
        relay_batch_check_publish(&copy, prefix, max_payload, err, sizeof(err), &fault), -1);
    assert_int_equal(copy.call_bytes, 0);
    /* What the producer wrote fails the same way on every attempt: the row is
     * quarantined at once rather than retried. */
    assert_int_equal(fault, RELAY_FAULT_PERMANENT);
    /* Whose the fault is decides the advice: drop a row the producer wrote
     * wrongly, re-queue one the setup refused once the setup is changed. */
    assert_int_equal(copy.cause, cause);
    char advice[64];
    snprintf(advice, sizeof(advice), "outbox-relay failed %s %lld",
             cause == RELAY_CAUSE_ROW ? "drop" : "retry", (long long)row->id);
    assert_non_null(strstr(err, advice));
    if (cause == RELAY_CAUSE_ROW)
        assert_null(strstr(err, "failed retry"));
    assert_non_null(strstr(err, expect));
    const struct relay_row *refused[] = {&copy};
    assert_int_equal(relay_batch_append_xadd_call(refused, 1, prefix, max_payload, 1, &buf, ends),
                     -1);
    assert_int_equal(buf.len, before);
    outbox_buf_free(&buf);
}

static void test_append_xadd_call_matches_hiredis(void **state)
{
    (void)state;
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    static struct relay_row rows[RELAY_CALL_ROWS];
    static char mids[RELAY_CALL_ROWS][40];
    static char payload[4096];
    memset(payload, 'p', sizeof(payload));
    const struct relay_row *call[RELAY_CALL_ROWS];
    char nbuf[256], vbuf[256];
    const char *names[] = {"content-type", "trace"};
    const char *values[] = {"application/json", ""};
    for (size_t i = 0; i < RELAY_CALL_ROWS; i++) {
        rows[i] = make_row("orders", payload, (i * 97) % sizeof(payload));
        snprintf(mids[i], sizeof(mids[i]), "00000000-0000-0000-0000-%012zu", i);
        rows[i].message_id = mids[i];
        rows[i].message_id_len = strlen(mids[i]);
        rows[i].id = (int64_t)(1000 * i + 9);
        /* Ranks with gaps (a quarantined row keeps its rank) and of every width. */
        rows[i].seq = i * i * 1000003ull + (i == RELAY_CALL_ROWS - 1 ? UINT64_MAX / 2 : 0);
        if (i % 3 == 1) {
            rows[i].key = "customer-7";
            rows[i].key_len = 10;
        }
        if (i % 4 == 2) {
            rows[i].headers_type = "object";
            rows[i].header_names = nbuf;
            rows[i].header_names_len = encode_array(nbuf, names, 2);
            rows[i].header_values = vbuf;
            rows[i].header_values_len = encode_array(vbuf, values, 2);
        }
        call[i] = &rows[i];
    }
    static const size_t counts[] = {1, 2, 9, 10, RELAY_CALL_ROWS};
    static const char *const prefixes[] = {"", "app:", NULL};
    static const uint64_t times[] = {1, 1796040000000ull, UINT64_MAX};
    for (size_t c = 0; c < OUTBOX_ARRAY_LEN(counts); c++) {
        for (size_t k = 0; k < OUTBOX_ARRAY_LEN(prefixes); k++) {
            uint64_t ms = times[(c + k) % OUTBOX_ARRAY_LEN(times)];
            size_t len;
            const char *want = hiredis_xadd_call(call, counts[c], prefixes[k], ms, &len);
            size_t before = buf.len, ends[RELAY_CALL_ROWS + 2];
            assert_int_equal(
                relay_batch_append_xadd_call(checked_copies(call, counts[c], prefixes[k], 1 << 16),
                                             counts[c], prefixes[k], 1 << 16, ms, &buf, ends),
                0);
            assert_int_equal(buf.len - before, len);
            assert_memory_equal(buf.data + before, want, len);
            assert_int_equal(buf.data[buf.len], '\0');
            /* Where each command ends: MULTI, each XADD, EXEC. */
            assert_int_equal(ends[0], 15);
            assert_int_equal(ends[counts[c] + 1], len);
            for (size_t e = 0; e <= counts[c]; e++) {
                assert_true(ends[e] < ends[e + 1]);
                assert_int_equal(buf.data[before + ends[e]], '*');
            }
            assert_memory_equal(buf.data + before + ends[counts[c]], "*1\r\n$4\r\nEXEC\r\n", 14);
        }
    }
    /* A partition's stream. */
    for (size_t i = 0; i < 5; i++) {
        rows[i].partitions = 16;
        rows[i].partition = 15;
    }
    size_t len, before = buf.len, ends[RELAY_CALL_ROWS + 2];
    const char *want = hiredis_xadd_call(call, 5, "p.", 7, &len);
    assert_int_equal(relay_batch_append_xadd_call(checked_copies(call, 5, "p.", 1 << 16), 5, "p.",
                                                  1 << 16, 7, &buf, ends),
                     0);
    assert_int_equal(buf.len - before, len);
    assert_memory_equal(buf.data + before, want, len);

    /* A row of another stream, one not checked, none: nothing is appended. */
    before = buf.len;
    const struct relay_row *const *checked = checked_copies(call, 7, "", 1 << 16);
    struct relay_row other = *checked[3];
    other.partition = 14;
    const struct relay_row *mixed[7];
    memcpy(mixed, checked, sizeof(mixed));
    mixed[3] = &other;
    assert_int_equal(relay_batch_append_xadd_call(mixed, 7, "", 1 << 16, 7, &buf, ends), -1);
    rows[6].call_bytes = 0;
    assert_int_equal(relay_batch_append_xadd_call(call, 7, "", 1 << 16, 7, &buf, ends), -1);
    assert_int_equal(relay_batch_append_xadd_call(call, 0, "", 1 << 16, 7, &buf, ends), -1);
    assert_int_equal(buf.len, before);
    outbox_buf_free(&buf);
}

static void test_entry_ids(void **state)
{
    (void)state;
    char id[RELAY_ENTRY_ID_MAX];
    assert_int_equal(relay_batch_entry_id(1796040000000ull, 0, id), 15);
    assert_string_equal(id, "1796040000000-0");
    assert_int_equal(relay_batch_entry_id(UINT64_MAX, UINT64_MAX, id), 41);
    assert_string_equal(id, "18446744073709551615-18446744073709551615");
    uint64_t ms = 0, seq = 0;
    assert_int_equal(relay_batch_parse_entry_id(id, strlen(id), &ms, &seq), 0);
    assert_true(ms == UINT64_MAX && seq == UINT64_MAX);
    assert_int_equal(relay_batch_parse_entry_id("12-3", 4, &ms, &seq), 0);
    assert_true(ms == 12 && seq == 3);
    static const char *const bad[] = {"",
                                      "-",
                                      "12",
                                      "12-",
                                      "-3",
                                      "1a-2",
                                      "1-2-3",
                                      "1 -2",
                                      "18446744073709551616-0",
                                      "0-18446744073709551616"};
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(bad); i++)
        assert_int_equal(relay_batch_parse_entry_id(bad[i], strlen(bad[i]), &ms, &seq), -1);
    /* Only the length given is read. */
    assert_int_equal(relay_batch_parse_entry_id("5-67", 3, &ms, &seq), 0);
    assert_true(ms == 5 && seq == 6);

    static const char top[] = "ERR The ID specified in XADD is equal or smaller than the target "
                              "stream top item";
    assert_int_equal(relay_batch_xadd_present(top, strlen(top)), 1);
    static const char wrongtype[] =
        "WRONGTYPE Operation against a key holding the wrong kind of value";
    assert_int_equal(relay_batch_xadd_present(wrongtype, strlen(wrongtype)), 0);
    assert_int_equal(relay_batch_xadd_present(top, 20), 0);
}

static void test_append_xadd_refuses_what_the_check_refuses(void **state)
{
    (void)state;
    struct relay_row bad_topic = make_row("bad topic", "x", 1);
    check_xadd_refused(&bad_topic, "", 1024, "topic \"bad topic\" is not allowed", RELAY_CAUSE_ROW);
    struct relay_row no_topic = make_row("", "x", 1);
    check_xadd_refused(&no_topic, "", 1024, "is not allowed", RELAY_CAUSE_ROW);

    struct relay_row big = make_row("orders", "0123456789", 10);
    check_xadd_refused(&big, "", 9, "payload of 10 bytes exceeds max_payload_bytes (9)",
                       RELAY_CAUSE_SETUP);

    /* Over the limit, the claim sends only the payload's size: refused by that
     * size, and a missing payload is never read whatever the size says. */
    struct relay_row unfetched = make_row("orders", NULL, 104857600);
    check_xadd_refused(&unfetched, "", 1048576,
                       "payload of 104857600 bytes exceeds max_payload_bytes (1048576)",
                       RELAY_CAUSE_SETUP);
    unfetched.payload_len = 10;
    check_xadd_refused(&unfetched, "", 1048576, "payload of 10 bytes", RELAY_CAUSE_SETUP);
    /* Over the largest max_payload_bytes there is: the producer's to fix. */
    unfetched.payload_len = 536870913;
    check_xadd_refused(&unfetched, "", 536870912, "the largest it can be (536870912)",
                       RELAY_CAUSE_ROW);

    static char longkey[OUTBOX_KEY_MAX + 1];
    memset(longkey, 'k', sizeof(longkey));
    struct relay_row key = make_row("orders", "x", 1);
    key.key = longkey;
    key.key_len = sizeof(longkey);
    check_xadd_refused(&key, "", 1024, "partition key of 1025 bytes", RELAY_CAUSE_ROW);

    struct relay_row arr = make_row("orders", "x", 1);
    arr.headers_type = "array";
    check_xadd_refused(&arr, "", 1024, "headers must be a JSON object", RELAY_CAUSE_ROW);

    char nbuf[512], vbuf[16384];
    const char *one[] = {"a"};
    const char *two[] = {"a", "b"};
    struct relay_row count = make_row("orders", "x", 1);
    count.headers_type = "object";
    count.header_names = nbuf;
    count.header_names_len = encode_array(nbuf, one, 1);
    count.header_values = vbuf;
    count.header_values_len = encode_array(vbuf, two, 2);
    check_xadd_refused(&count, "", 1024, "headers cannot be encoded", RELAY_CAUSE_ROW);

    char toolong[OUTBOX_HEADER_NAME_MAX + 2];
    memset(toolong, 'n', sizeof(toolong) - 1);
    toolong[sizeof(toolong) - 1] = '\0';
    const char *names[] = {toolong};
    const char *empty[] = {""};
    const char *values[] = {"v"};
    struct relay_row hdr = make_row("orders", "x", 1);
    hdr.headers_type = "object";
    hdr.header_names = nbuf;
    hdr.header_names_len = encode_array(nbuf, names, 1);
    hdr.header_values = vbuf;
    hdr.header_values_len = encode_array(vbuf, values, 1);
    check_xadd_refused(&hdr, "", 1024, "names are 1 to 128 bytes", RELAY_CAUSE_ROW);
    hdr.header_names_len = encode_array(nbuf, empty, 1);
    check_xadd_refused(&hdr, "", 1024, "names are 1 to 128 bytes", RELAY_CAUSE_ROW);

    static char bigvalue[OUTBOX_HEADER_VALUE_MAX + 2];
    memset(bigvalue, 'v', sizeof(bigvalue) - 1);
    const char *bigvalues[] = {bigvalue};
    hdr.header_names_len = encode_array(nbuf, one, 1);
    hdr.header_values_len = encode_array(vbuf, bigvalues, 1);
    check_xadd_refused(&hdr, "", 1024, "exceeds 8192 bytes", RELAY_CAUSE_ROW);

    /* Stream name: the longest that fits, then one byte more. */
    char prefix[512];
    char topic[OUTBOX_TOPIC_MAX + 1];
    memset(topic, 't', OUTBOX_TOPIC_MAX);
    topic[OUTBOX_TOPIC_MAX] = '\0';
    struct relay_row longest = make_row(topic, "x", 1);
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    /* stream: < 256 + 200 bytes. */
    size_t fits = 256 - 1;
    memset(prefix, 'p', fits);
    prefix[fits] = '\0';
    check_xadd_same(&longest, prefix, 1024, 1796040000000ull, &buf);
    prefix[fits] = 'p';
    prefix[fits + 1] = '\0';
    check_xadd_refused(&longest, prefix, 1024, "stream name too long", RELAY_CAUSE_SETUP);
    outbox_buf_free(&buf);
}

static void test_respbuf_caps_and_reuse(void **state)
{
    (void)state;
    static char payload[200];
    memset(payload, 'x', sizeof(payload));
    struct relay_row row = make_row("bench1", payload, sizeof(payload));
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    char err[256];
    enum relay_row_fault fault;
    size_t ends[3];
    assert_int_equal(relay_batch_check_publish(&row, "", 1024, err, sizeof(err), &fault), 0);

    /* Reset between calls: the memory is reused, never reallocated. */
    const struct relay_row *call[] = {&row};
    assert_int_equal(relay_batch_append_xadd_call(call, 1, "", 1024, 2, &buf, ends), 0);
    const char *data = buf.data;
    size_t cap = buf.cap, one = buf.len;
    for (int i = 0; i < 1000; i++) {
        outbox_buf_reset(&buf);
        assert_int_equal(buf.len, 0);
        row.id = i;
        assert_int_equal(relay_batch_check_publish(&row, "", 1024, err, sizeof(err), &fault), 0);
        assert_int_equal(relay_batch_append_xadd_call(call, 1, "", 1024, 2, &buf, ends), 0);
        assert_true(buf.len <= one + 3);
    }
    assert_ptr_equal(buf.data, data);
    assert_int_equal(buf.cap, cap);
    outbox_buf_free(&buf);

    /* A cap: what does not fit is refused whole, and the buffer is intact. */
    memset(&buf, 0, sizeof(buf));
    buf.max = one + one / 2;
    assert_int_equal(relay_batch_append_xadd_call(call, 1, "", 1024, 2, &buf, ends), 0);
    size_t len = buf.len;
    assert_int_equal(relay_batch_append_xadd_call(call, 1, "", 1024, 2, &buf, ends),
                     OUTBOX_BUF_FULL);
    assert_int_equal(buf.len, len);
    assert_true(buf.cap <= buf.max);
    outbox_buf_free(&buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_topic_charset),
        cmocka_unit_test(test_stream_and_dedup_key_share_hash_tag),
        cmocka_unit_test(test_partition_hash_vectors),
        cmocka_unit_test(test_cluster_slot),
        cmocka_unit_test(test_partition_stream_names),
        cmocka_unit_test(test_xadd_fields),
        cmocka_unit_test(test_xadd_no_key_field_when_null),
        cmocka_unit_test(test_xadd_headers),
        cmocka_unit_test(test_row_errors_say_what_to_do),
        cmocka_unit_test(test_decode_text_array),
        cmocka_unit_test(test_decode_integers),
        cmocka_unit_test(test_format_timestamp_as_to_char),
        cmocka_unit_test(test_format_uuid_as_uuid_out),
        cmocka_unit_test(test_stream_index_finds_the_row_before),
        cmocka_unit_test(test_utf8_prefix_never_cuts_a_character),
        cmocka_unit_test(test_append_xadd_matches_hiredis_one_row),
        cmocka_unit_test(test_append_xadd_call_matches_hiredis),
        cmocka_unit_test(test_entry_ids),
        cmocka_unit_test(test_append_xadd_refuses_what_the_check_refuses),
        cmocka_unit_test(test_respbuf_caps_and_reuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
