/* Unit tests of relay/batch.c: what a row's publish command looks like, which
 * rows cannot be published and why, the binary decoders, and which Redis
 * errors blame a row rather than the batch. */
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
#include "common/functions.h"
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

static int find_field(const struct relay_publish_cmd *cmd, const char *name)
{
    /* Fields start after FCALL fn 2 stream dedup ttl not_after. */
    for (int i = 7; i + 1 < cmd->argc; i += 2)
        if (cmd->argvlen[i] == strlen(name) && memcmp(cmd->argv[i], name, cmd->argvlen[i]) == 0)
            return i + 1;
    return -1;
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

static void test_build_publish_fields(void **state)
{
    (void)state;
    static const char payload[] = {'a', '\0', '\xff', '\r', '\n'};
    struct relay_row row = make_row("orders", payload, sizeof(payload));
    row.key = "customer-7";
    row.key_len = 10;
    struct relay_publish_cmd cmd;
    char err[256];
    assert_int_equal(
        relay_batch_build_publish(&row, "", 1024, 60000, 1796040000000ull, &cmd, err, sizeof(err)),
        0);
    assert_string_equal(cmd.argv[0], "FCALL");
    assert_string_equal(cmd.argv[1], RELAY_FUNCTION_PUBLISH);
    assert_string_equal(cmd.argv[2], "2");
    assert_string_equal(cmd.argv[3], "orders");
    assert_string_equal(cmd.argv[4], "{orders}:dedup:0b6c3b7e-8f5e-4f7a-9a51-1c2d3e4f5a6b");
    assert_string_equal(cmd.argv[5], "60000");
    assert_string_equal(cmd.argv[6], "1796040000000");
    int p = find_field(&cmd, "payload");
    assert_true(p > 0);
    assert_int_equal(cmd.argvlen[p], sizeof(payload));
    assert_memory_equal(cmd.argv[p], payload, sizeof(payload));
    assert_int_equal(cmd.argvlen[find_field(&cmd, "id")], 36);
    assert_memory_equal(cmd.argv[find_field(&cmd, "key")], "customer-7", 10);
    assert_memory_equal(cmd.argv[find_field(&cmd, "outbox_id")], "42", 2);
    assert_memory_equal(cmd.argv[find_field(&cmd, "created_at")], "2026-11-30T11:35:14.123456Z",
                        27);
    assert_int_equal(find_field(&cmd, "h.x"), -1);
    /* FCALL fn numkeys 2 keys ttl not_after + 6 fields. */
    assert_int_equal(cmd.argc, 7 + 12);
}

static void test_build_publish_no_key_field_when_null(void **state)
{
    (void)state;
    struct relay_row row = make_row("orders", "x", 1);
    struct relay_publish_cmd cmd;
    char err[256];
    assert_int_equal(
        relay_batch_build_publish(&row, "p.", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)),
        0);
    assert_int_equal(find_field(&cmd, "key"), -1);
    assert_string_equal(cmd.argv[3], "p.orders");
}

static void test_build_publish_headers(void **state)
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
    struct relay_publish_cmd cmd;
    char err[256];
    assert_int_equal(
        relay_batch_build_publish(&row, "", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)),
        0);
    int i = find_field(&cmd, "h.content-type");
    assert_true(i > 0);
    assert_memory_equal(cmd.argv[i], "application/json", 16);
    assert_memory_equal(cmd.argv[find_field(&cmd, "h.trace")], "abc", 3);
    /* A header named like a contract field cannot collide with it. */
    assert_int_equal(find_field(&cmd, "trace"), -1);
}

static void test_row_errors_say_what_to_do(void **state)
{
    (void)state;
    struct relay_publish_cmd cmd;
    char err[512];

    struct relay_row bad_topic = make_row("bad topic", "x", 1);
    assert_int_equal(relay_batch_build_publish(&bad_topic, "", 1024, 1000, 1796040000000ull, &cmd,
                                               err, sizeof(err)),
                     -1);
    assert_non_null(strstr(err, "topic \"bad topic\" is not allowed"));
    /* The row itself is wrong: re-queued as it is, it is quarantined again,
     * so the advice is to drop it and write it again, never to retry it. */
    assert_non_null(strstr(err, "'outbox-relay failed drop 42'"));
    assert_non_null(strstr(err, "write it again from the fixed producer"));
    assert_null(strstr(err, "failed retry"));

    /* A limit an operator can raise: the same row then goes through, so the
     * advice is to raise it and re-queue the row. */
    struct relay_row big = make_row("orders", "0123456789", 10);
    assert_int_equal(
        relay_batch_build_publish(&big, "", 9, 1000, 1796040000000ull, &cmd, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "payload of 10 bytes exceeds max_payload_bytes (9)"));
    assert_non_null(strstr(err, "raise max_payload_bytes to at least 10"));
    assert_non_null(strstr(err, "then re-queue the row with 'outbox-relay failed retry 42'"));

    /* Over the largest max_payload_bytes there is, no setting helps. */
    struct relay_row huge = make_row("orders", NULL, 536870913);
    assert_int_equal(relay_batch_build_publish(&huge, "", 536870912, 1000, 1796040000000ull, &cmd,
                                               err, sizeof(err)),
                     -1);
    assert_non_null(strstr(err, "the largest it can be (536870912)"));
    assert_non_null(strstr(err, "'outbox-relay failed drop 42'"));
    assert_null(strstr(err, "failed retry"));

    struct relay_row arr = make_row("orders", "x", 1);
    arr.headers_type = "array";
    assert_int_equal(
        relay_batch_build_publish(&arr, "", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)),
        -1);
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
    assert_int_equal(
        relay_batch_build_publish(&hdr, "", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)),
        -1);
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

static void test_classify_errors(void **state)
{
    (void)state;
    static const char *batch[] = {
        "OOM command not allowed when used memory > 'maxmemory'.",
        "MISCONF Redis is configured to save RDB snapshots",
        "READONLY You can't write against a read only replica.",
        "ERR Function not found",
        "NOAUTH Authentication required.",
        "LOADING Redis is loading the dataset in memory",
        "BUSY Redis is busy running a script.",
        "",
    };
    for (size_t i = 0; i < sizeof(batch) / sizeof(batch[0]); i++)
        assert_int_equal(relay_batch_classify_error(batch[i], strlen(batch[i])), RELAY_ERROR_BATCH);
    const char *wt = "WRONGTYPE Operation against a key holding the wrong kind of value";
    assert_int_equal(relay_batch_classify_error(wt, strlen(wt)), RELAY_ERROR_ROW);
    assert_int_equal(relay_batch_classify_error(NULL, 0), RELAY_ERROR_BATCH);
}

static void test_row_retry_delay_grows_and_caps(void **state)
{
    (void)state;
    assert_int_equal(relay_batch_row_retry_ms(1, 1000, 300000), 1000);
    assert_int_equal(relay_batch_row_retry_ms(2, 1000, 300000), 2000);
    assert_int_equal(relay_batch_row_retry_ms(5, 1000, 300000), 16000);
    assert_int_equal(relay_batch_row_retry_ms(30, 1000, 300000), 300000);
    assert_int_equal(relay_batch_row_retry_ms(0, 1000, 300000), 1000);
}

static void test_function_source_records_after_xadd(void **state)
{
    (void)state;
    /* The dedup record must be written only after XADD succeeded, and the
     * deadline checked before XADD. */
    const char *xadd = strstr(outbox_functions_relay_source, "'XADD'");
    const char *set = strstr(outbox_functions_relay_source, "'SET'");
    const char *expired = strstr(outbox_functions_relay_source, "EXPIRED");
    assert_non_null(xadd);
    assert_non_null(set);
    assert_non_null(expired);
    assert_true(xadd < set);
    assert_true(expired < xadd);
    assert_non_null(strstr(outbox_functions_relay_source, "#!lua name=" RELAY_FUNCTION_LIBRARY));
}

static const char MID_BEFORE[] = "7d0f7a52-3c1e-4b8e-8d6a-2f5e4c3b2a19";

/* A row sent after another to the same stream names that row's dedup record
 * as a third key: the function refuses it while the record is missing. */
static void test_build_publish_names_the_row_before(void **state)
{
    (void)state;
    struct relay_row before = make_row("orders", "a", 1);
    before.message_id = MID_BEFORE;
    before.message_id_len = strlen(MID_BEFORE);
    struct relay_row row = make_row("orders", "b", 1);
    row.after = &before;
    struct relay_publish_cmd cmd;
    char err[256];
    assert_int_equal(relay_batch_build_publish(&row, "app:", 1024, 60000, 1796040000000ull, &cmd,
                                               err, sizeof(err)),
                     0);
    assert_string_equal(cmd.argv[2], "3");
    assert_string_equal(cmd.argv[3], "app:orders");
    assert_string_equal(cmd.argv[4], "{app:orders}:dedup:0b6c3b7e-8f5e-4f7a-9a51-1c2d3e4f5a6b");
    assert_string_equal(cmd.argv[5], "{app:orders}:dedup:7d0f7a52-3c1e-4b8e-8d6a-2f5e4c3b2a19");
    assert_string_equal(cmd.argv[6], "60000");
    assert_string_equal(cmd.argv[7], "1796040000000");
    assert_int_equal(cmd.argc, 8 + 10);

    /* A partition's stream: the record is in that partition's slot. */
    before.partitions = row.partitions = 8;
    before.partition = row.partition = 5;
    assert_int_equal(
        relay_batch_build_publish(&row, "", 1024, 60000, 1796040000000ull, &cmd, err, sizeof(err)),
        0);
    assert_string_equal(cmd.argv[3], "orders:005");
    assert_string_equal(cmd.argv[5], "{orders:005}:dedup:7d0f7a52-3c1e-4b8e-8d6a-2f5e4c3b2a19");
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
            /* The batch behind reads the same answer without taking a slot. */
            assert_int_equal(relay_batch_streams_find(&x, rows, &rows[i]),
                             last_sent_before(rows, sent, i));
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

static void test_apply_reply_order(void **state)
{
    (void)state;
    struct relay_row rows[3];
    rows[0] = make_row("orders", "a", 1);
    rows[1] = make_row("orders", "b", 1);
    rows[2] = make_row("orders", "c", 1);
    rows[1].id = 43;
    rows[2].id = 44;
    rows[1].after = &rows[0];
    rows[2].after = &rows[1];
    const char *wt = "WRONGTYPE Operation against a key holding the wrong kind of value";
    const char *order = "ORDER the message before this one in its stream was not published";
    struct relay_tally cycle;

    /* The row before failed for a reason of its own (the stream key holds
     * another type): this one waits with it, for the same reason. */
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 3;
    assert_int_equal(relay_batch_apply_reply(&cycle, &rows[0], RELAY_REPLY_ERROR, wt, strlen(wt)),
                     0);
    assert_int_equal(
        relay_batch_apply_reply(&cycle, &rows[1], RELAY_REPLY_ERROR, order, strlen(order)), 0);
    assert_int_equal(
        relay_batch_apply_reply(&cycle, &rows[2], RELAY_REPLY_ERROR, order, strlen(order)), 1);
    assert_false(cycle.failed);
    for (int i = 1; i < 3; i++) {
        assert_int_equal(rows[i].state, RELAY_ROW_FAILED);
        assert_int_equal(rows[i].fault, RELAY_FAULT_TRANSIENT);
        /* The first row that failed is named, not the chain up to it. */
        assert_non_null(strstr(rows[i].error, "held back behind row 42 of its stream, which "
                                              "failed: Redis refused the entry: WRONGTYPE"));
        assert_non_null(strstr(rows[i].error, "rename or delete that key"));
        /* Nothing is wrong with the held-back row: re-queued, it goes on. */
        assert_int_equal(rows[i].cause, RELAY_CAUSE_SETUP);
        char retry[64];
        snprintf(retry, sizeof(retry), "outbox-relay failed retry %lld", (long long)rows[i].id);
        assert_non_null(strstr(rows[i].error, retry));
    }

    /* The row before failed with the batch (a slot being migrated): the
     * batch is retried, both rows in claim order. */
    rows[0].state = rows[1].state = RELAY_ROW_PUBLISHING;
    rows[2].after = NULL;
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 2;
    const char *tryagain = "TRYAGAIN Multiple keys request during rehashing of slot";
    assert_int_equal(
        relay_batch_apply_reply(&cycle, &rows[0], RELAY_REPLY_ERROR, tryagain, strlen(tryagain)),
        0);
    assert_int_equal(
        relay_batch_apply_reply(&cycle, &rows[1], RELAY_REPLY_ERROR, order, strlen(order)), 1);
    assert_true(cycle.failed);
    assert_non_null(strstr(cycle.error, "TRYAGAIN"));
    assert_int_equal(rows[1].state, RELAY_ROW_PUBLISHING);

    /* Refused while the row before has no answer yet: the batch fails. */
    rows[0].state = rows[1].state = RELAY_ROW_PUBLISHING;
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    assert_int_equal(
        relay_batch_apply_reply(&cycle, &rows[1], RELAY_REPLY_ERROR, order, strlen(order)), 1);
    assert_true(cycle.failed);
    assert_non_null(strstr(cycle.error, "ORDER"));

    /* The row before was sent by the batch ahead and is not in the stream:
     * the row and the one chained to it are left for the next claim, with
     * no attempt counted and the batch not failed. */
    rows[1].after = NULL;
    rows[1].after_ahead = 1;
    rows[2].after = &rows[1];
    rows[1].state = rows[2].state = RELAY_ROW_PUBLISHING;
    rows[1].fault = rows[2].fault = RELAY_FAULT_NONE;
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 2;
    assert_int_equal(
        relay_batch_apply_reply(&cycle, &rows[1], RELAY_REPLY_ERROR, order, strlen(order)), 0);
    assert_int_equal(
        relay_batch_apply_reply(&cycle, &rows[2], RELAY_REPLY_ERROR, order, strlen(order)), 1);
    assert_false(cycle.failed);
    assert_int_equal(cycle.left, 2);
    assert_int_equal(rows[1].state, RELAY_ROW_CLAIMED);
    assert_int_equal(rows[2].state, RELAY_ROW_CLAIMED);
    assert_int_equal(rows[1].fault, RELAY_FAULT_NONE);

    /* Any other error of such a row fails the batch as before. */
    rows[1].state = RELAY_ROW_PUBLISHING;
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    assert_int_equal(
        relay_batch_apply_reply(&cycle, &rows[1], RELAY_REPLY_ERROR, tryagain, strlen(tryagain)),
        1);
    assert_true(cycle.failed);
}

static void test_apply_reply_cycle(void **state)
{
    (void)state;
    struct relay_row rows[3];
    rows[0] = make_row("orders", "a", 1);
    rows[1] = make_row("orders", "b", 1);
    rows[2] = make_row("orders", "c", 1);
    struct relay_tally cycle;
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 3;

    assert_int_equal(relay_batch_apply_reply(&cycle, &rows[0], RELAY_REPLY_ENTRY, NULL, 0), 0);
    assert_int_equal(rows[0].state, RELAY_ROW_PUBLISHED);
    const char *wt = "WRONGTYPE Operation against a key holding the wrong kind of value";
    assert_int_equal(relay_batch_apply_reply(&cycle, &rows[1], RELAY_REPLY_ERROR, wt, strlen(wt)),
                     0);
    assert_int_equal(rows[1].state, RELAY_ROW_FAILED);
    /* An operator can fix the key while the row waits: retried with backoff. */
    assert_int_equal(rows[1].fault, RELAY_FAULT_TRANSIENT);
    assert_non_null(strstr(rows[1].error, "rename or delete that key"));
    /* Once the key is fixed the same row goes through: re-queue, not drop. */
    assert_int_equal(rows[1].cause, RELAY_CAUSE_SETUP);
    assert_non_null(
        strstr(rows[1].error, "then re-queue the row with 'outbox-relay failed retry 42'"));
    assert_null(strstr(rows[1].error, "failed drop"));
    assert_false(cycle.failed);
    /* The last reply ends the cycle. */
    assert_int_equal(relay_batch_apply_reply(&cycle, &rows[2], RELAY_REPLY_ENTRY, NULL, 0), 1);
    assert_false(cycle.failed);
    /* A reply after the end is ignored. */
    assert_int_equal(relay_batch_apply_reply(&cycle, &rows[2], RELAY_REPLY_LOST, NULL, 0), 0);
    assert_false(cycle.failed);
}

static void test_apply_reply_batch_failures(void **state)
{
    (void)state;
    struct relay_row row = make_row("orders", "a", 1);
    struct relay_tally cycle;

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 2;
    const char *oom = "OOM command not allowed when used memory > 'maxmemory'.";
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_ERROR, oom, strlen(oom)), 0);
    assert_true(cycle.failed);
    assert_non_null(strstr(cycle.error, "OOM"));
    assert_int_equal(row.state, RELAY_ROW_CLAIMED);
    /* The first reason is kept. */
    assert_int_equal(
        relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_LOST, "Connection reset", 16), 1);
    assert_non_null(strstr(cycle.error, "OOM"));

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    const char *nf = "ERR Function not found";
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_ERROR, nf, strlen(nf)), 1);
    assert_true(cycle.failed);
    assert_true(cycle.function_missing);

    /* A primary demoted to a replica: the sink reconnects (and asks Sentinel). */
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    const char *ro = "READONLY You can't write against a read only replica.";
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_ERROR, ro, strlen(ro)), 1);
    assert_true(cycle.failed);
    assert_true(cycle.not_primary);
    assert_false(cycle.function_missing);

    /* A cluster's slot moved: the sink reads the slot map again. ASK and
     * TRYAGAIN (a slot being migrated) fail the batch, which is retried. */
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 2;
    const char *moved = "MOVED 3999 127.0.0.1:6381";
    const char *ask = "ASK 3999 127.0.0.1:6381";
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_ERROR, ask, strlen(ask)), 0);
    assert_true(cycle.failed);
    assert_false(cycle.slots_moved);
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_ERROR, moved, strlen(moved)),
                     1);
    assert_true(cycle.slots_moved);
    assert_int_equal(row.state, RELAY_ROW_CLAIMED);

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_OTHER, NULL, 0), 1);
    assert_true(cycle.failed);
    assert_non_null(strstr(cycle.error, "unexpected reply type"));

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_LOST, NULL, 0), 1);
    assert_true(cycle.failed);
    assert_string_equal(cycle.error, "Redis connection lost: dropped");

    /* A connection dropped on purpose leaves hiredis's error empty: the
     * message still says what happened. */
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_LOST, "", 0), 1);
    assert_string_equal(cycle.error, "Redis connection lost: dropped");
}

/* The WAIT after a batch's publishes (min_replicas): enough replicas let the
 * batch be marked; too few, an error or a lost connection fail it whole. */
static void test_apply_wait(void **state)
{
    (void)state;
    struct relay_row row = make_row("orders", "a", 1);
    struct relay_tally cycle;

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 2;
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_ENTRY, NULL, 0), 0);
    assert_int_equal(relay_batch_apply_wait(&cycle, RELAY_REPLY_COUNT, 2, NULL, 0, 2, 1000), 1);
    assert_false(cycle.failed);

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    assert_int_equal(relay_batch_apply_wait(&cycle, RELAY_REPLY_COUNT, 1, NULL, 0, 2, 1000), 1);
    assert_true(cycle.failed);
    assert_int_equal(cycle.kind, RELAY_FAIL_REDIS_REPLICAS);
    assert_non_null(strstr(cycle.error, "1 of min_replicas = 2 replicas"));
    assert_non_null(strstr(cycle.error, "replica_timeout (1000 ms)"));
    /* A reply after the end is ignored. */
    assert_int_equal(relay_batch_apply_wait(&cycle, RELAY_REPLY_COUNT, 5, NULL, 0, 2, 1000), 0);
    assert_true(cycle.failed);

    /* A publish that failed first keeps its reason. */
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 2;
    const char *oom = "OOM command not allowed when used memory > 'maxmemory'.";
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_ERROR, oom, strlen(oom)), 0);
    assert_int_equal(relay_batch_apply_wait(&cycle, RELAY_REPLY_COUNT, 0, NULL, 0, 1, 1000), 1);
    assert_int_equal(cycle.kind, RELAY_FAIL_REDIS_ERROR);
    assert_non_null(strstr(cycle.error, "OOM"));

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    const char *ro = "ERR WAIT cannot be used with replica instances.";
    assert_int_equal(relay_batch_apply_wait(&cycle, RELAY_REPLY_ERROR, -1, ro, strlen(ro), 1, 10),
                     1);
    assert_int_equal(cycle.kind, RELAY_FAIL_REDIS_ERROR);
    assert_non_null(strstr(cycle.error, "replica instances"));

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    assert_int_equal(relay_batch_apply_wait(&cycle, RELAY_REPLY_LOST, -1, NULL, 0, 1, 10), 1);
    assert_int_equal(cycle.kind, RELAY_FAIL_REDIS_CONNECTION);

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    assert_int_equal(relay_batch_apply_wait(&cycle, RELAY_REPLY_OTHER, -1, NULL, 0, 1, 10), 1);
    assert_int_equal(cycle.kind, RELAY_FAIL_REDIS_REPLY);
}

/* Quotes like PQescapeLiteral for plain text: 'x' with quotes doubled. */
static char *fake_quote(void *ctx, const char *s, size_t len)
{
    (void)ctx;
    char *out = malloc(len * 2 + 3);
    size_t o = 0;
    out[o++] = '\'';
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '\'')
            out[o++] = '\'';
        out[o++] = s[i];
    }
    out[o++] = '\'';
    out[o] = '\0';
    return out;
}

static void test_finish_sql(void **state)
{
    (void)state;
    struct relay_row rows[5];
    for (int i = 0; i < 5; i++) {
        rows[i] = make_row("orders", "x", 1);
        rows[i].id = 10 + i;
        rows[i].state = RELAY_ROW_PUBLISHED;
    }
    /* A permanent failure on its first attempt: quarantined at once. */
    rows[1].state = RELAY_ROW_FAILED;
    rows[1].fault = RELAY_FAULT_PERMANENT;
    rows[1].attempts = 0;
    snprintf(rows[1].error, sizeof(rows[1].error), "topic \"it's\" is not allowed");
    /* A transient failure at its max_attempts-th attempt: quarantined. */
    rows[3].state = RELAY_ROW_FAILED;
    rows[3].fault = RELAY_FAULT_TRANSIENT;
    rows[3].attempts = 2;
    snprintf(rows[3].error, sizeof(rows[3].error), "WRONGTYPE");
    /* A transient failure before that: retried later. */
    rows[4].state = RELAY_ROW_FAILED;
    rows[4].fault = RELAY_FAULT_TRANSIENT;
    rows[4].attempts = 1;
    snprintf(rows[4].error, sizeof(rows[4].error), "WRONGTYPE again");
    struct relay_sql_quoter q = {fake_quote, free, NULL};
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));

    assert_int_equal(relay_batch_finish_sql(rows, 5, 3, 0, &q, &buf), 2);
    assert_string_equal(
        buf.data,
        "UPDATE outbox.messages SET sent_at = statement_timestamp() WHERE id = "
        "ANY('{10,12}'::bigint[]);"
        "UPDATE outbox.messages SET attempts = attempts + 1, last_error = 'topic \"it''s\" is "
        "not allowed', retry_at = statement_timestamp() + interval '1000 milliseconds', failed_at "
        "= statement_timestamp() WHERE "
        "id = 11;"
        "UPDATE outbox.messages SET attempts = attempts + 1, last_error = 'WRONGTYPE', retry_at "
        "= statement_timestamp() + interval '4000 milliseconds', failed_at = statement_timestamp() "
        "WHERE id = 13;"
        "UPDATE outbox.messages SET attempts = attempts + 1, last_error = 'WRONGTYPE again', "
        "retry_at "
        "= statement_timestamp() + interval '2000 milliseconds', failed_at = NULL WHERE id = 14;"
        "COMMIT");

    /* sent_retention = 0: the published rows are deleted, not marked; the
     * failed ones are counted as before. */
    assert_int_equal(relay_batch_finish_sql(rows, 5, 3, 1, &q, &buf), 2);
    static const char head[] = "SELECT outbox.delete_published('{10,12}'::bigint[]);UPDATE";
    assert_memory_equal(buf.data, head, sizeof(head) - 1);
    assert_null(strstr(buf.data, "sent_at ="));
    assert_non_null(strstr(buf.data, "WHERE id = 14;COMMIT"));

    /* Nothing published: no sent_at update at all. */
    rows[0].state = rows[2].state = RELAY_ROW_FAILED;
    assert_int_equal(relay_batch_finish_sql(rows, 1, 3, 0, &q, &buf), 0);
    assert_null(strstr(buf.data, "sent_at"));

    /* A cap that is too small is an error, never a truncated statement. */
    struct outbox_buf small;
    memset(&small, 0, sizeof(small));
    small.max = 16;
    assert_int_equal(relay_batch_finish_sql(rows, 4, 3, 0, &q, &small), -1);
    outbox_buf_free(&small);
    outbox_buf_free(&buf);
}

static void test_row_quarantined_by_kind(void **state)
{
    (void)state;
    struct relay_row row = make_row("orders", "x", 1);
    row.state = RELAY_ROW_FAILED;

    /* Permanent: the first attempt already, whatever max_attempts allows. */
    row.fault = RELAY_FAULT_PERMANENT;
    row.attempts = 0;
    assert_true(relay_batch_row_quarantined(&row, 10));
    assert_true(relay_batch_row_quarantined(&row, 1000));

    /* Transient (and a failure of no stated kind): only at max_attempts. */
    enum relay_row_fault retried[] = {RELAY_FAULT_TRANSIENT, RELAY_FAULT_NONE};
    for (size_t i = 0; i < sizeof(retried) / sizeof(retried[0]); i++) {
        row.fault = retried[i];
        row.attempts = 0;
        assert_false(relay_batch_row_quarantined(&row, 10));
        assert_true(relay_batch_row_quarantined(&row, 1));
        row.attempts = 8;
        assert_false(relay_batch_row_quarantined(&row, 10));
        row.attempts = 9;
        assert_true(relay_batch_row_quarantined(&row, 10));
    }

    /* Rows that did not fail are never quarantined. */
    row.fault = RELAY_FAULT_PERMANENT;
    row.state = RELAY_ROW_PUBLISHED;
    assert_false(relay_batch_row_quarantined(&row, 10));
    row.state = RELAY_ROW_CLAIMED;
    assert_false(relay_batch_row_quarantined(&row, 10));
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
    struct relay_publish_cmd cmd;
    char err[512];
    assert_int_equal(
        relay_batch_build_publish(&row, "", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)),
        -1);
    const char *q = strstr(err, "\"") + 1;
    const char *end = strchr(q, '\"');
    assert_int_equal((end - q) % 2, 1); /* "a" plus whole two-byte characters */
}

static char *refusing_quote(void *ctx, const char *s, size_t len)
{
    (void)ctx;
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)s[i] >= 0x80)
            return NULL;
    return fake_quote(NULL, s, len);
}

static void test_finish_sql_survives_unquotable_error(void **state)
{
    (void)state;
    struct relay_row row = make_row("orders", "x", 1);
    row.state = RELAY_ROW_FAILED;
    snprintf(row.error, sizeof(row.error), "bad \xc3");
    struct relay_sql_quoter q = {refusing_quote, free, NULL};
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    assert_int_equal(relay_batch_finish_sql(&row, 1, 3, 0, &q, &buf), 0);
    assert_non_null(strstr(buf.data, "could not be stored"));
    assert_non_null(strstr(buf.data, "COMMIT"));
    outbox_buf_free(&buf);
}

/* ---- commands in the Redis protocol ------------------------------------ */

/*
 * What one call of several rows must be: the argv of each row's call of its
 * own (relay_batch_build_publish) taken apart and put together as
 * RELAY_FUNCTION_PUBLISH_MANY takes it, formatted by hiredis.
 */
static char *hiredis_publish_call(const struct relay_row *const *rows, size_t n,
                                  const struct relay_row *after, const char *prefix,
                                  uint32_t max_payload, uint32_t ttl, uint64_t not_after, int *len)
{
    enum { MAX_ARGS = 4096 };
    static const char *argv[MAX_ARGS];
    static size_t argvlen[MAX_ARGS];
    static struct relay_publish_cmd cmds[RELAY_CALL_ROWS + 1];
    static char nums[RELAY_CALL_ROWS + 2][24];
    char err[512];
    int argc = 0;
    assert_true(n <= RELAY_CALL_ROWS);
    for (size_t i = 0; i < n; i++) {
        struct relay_row one = *rows[i];
        one.after = NULL;
        assert_int_equal(relay_batch_build_publish(&one, prefix, max_payload, ttl, not_after,
                                                   &cmds[i], err, sizeof(err)),
                         0);
    }
    if (after != NULL) {
        struct relay_row one = *after;
        one.after = NULL;
        assert_int_equal(relay_batch_build_publish(&one, prefix, max_payload, ttl, not_after,
                                                   &cmds[n], err, sizeof(err)),
                         0);
    }
    /* A call of its own: FCALL fn 2 stream record ttl not_after fields... */
    argv[argc] = "FCALL";
    argvlen[argc++] = 5;
    argv[argc] = RELAY_FUNCTION_PUBLISH_MANY;
    argvlen[argc++] = strlen(RELAY_FUNCTION_PUBLISH_MANY);
    argvlen[argc] = (size_t)snprintf(nums[0], sizeof(nums[0]), "%zu", 1 + (after != NULL) + n);
    argv[argc++] = nums[0];
    argv[argc] = cmds[0].argv[3];
    argvlen[argc++] = cmds[0].argvlen[3];
    if (after != NULL) {
        argv[argc] = cmds[n].argv[4];
        argvlen[argc++] = cmds[n].argvlen[4];
    }
    for (size_t i = 0; i < n; i++) {
        argv[argc] = cmds[i].argv[4];
        argvlen[argc++] = cmds[i].argvlen[4];
    }
    argv[argc] = cmds[0].argv[5];
    argvlen[argc++] = cmds[0].argvlen[5];
    argv[argc] = cmds[0].argv[6];
    argvlen[argc++] = cmds[0].argvlen[6];
    argvlen[argc] = (size_t)snprintf(nums[1], sizeof(nums[1]), "%zu", n);
    argv[argc] = nums[1];
    argc++;
    for (size_t i = 0; i < n; i++) {
        argvlen[argc] = (size_t)snprintf(nums[2 + i], sizeof(nums[2 + i]), "%d", cmds[i].argc - 7);
        argv[argc] = nums[2 + i];
        argc++;
        for (int k = 7; k < cmds[i].argc; k++) {
            assert_true(argc < MAX_ARGS);
            argv[argc] = cmds[i].argv[k];
            argvlen[argc++] = cmds[i].argvlen[k];
        }
    }
    char *out = NULL;
    *len = redisFormatCommandArgv(&out, argc, argv, argvlen);
    assert_true(*len > 0);
    return out;
}

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

static void check_publish_call_same(const struct relay_row *const *rows, size_t n,
                                    const struct relay_row *after, const char *prefix,
                                    struct outbox_buf *buf)
{
    int len;
    char *want =
        hiredis_publish_call(rows, n, after, prefix, 1 << 16, 60000, 1796040000000ull, &len);
    size_t before = buf->len;
    assert_int_equal(relay_batch_append_publish_call(checked_copies(rows, n, prefix, 1 << 16), n,
                                                     after, prefix, 1 << 16, 60000,
                                                     1796040000000ull, buf),
                     0);
    assert_int_equal(buf->len - before, (size_t)len);
    assert_memory_equal(buf->data + before, want, (size_t)len);
    redisFreeCommand(want);
}

/* row alone in a call, as the relay sends it (row->after names the row
 * before): the bytes hiredis makes of its argv. */
static void check_publish_same(const struct relay_row *row, const char *prefix,
                               uint32_t max_payload, uint32_t ttl, uint64_t not_after,
                               struct outbox_buf *buf)
{
    int len;
    const struct relay_row *one = row;
    char *want =
        hiredis_publish_call(&one, 1, row->after, prefix, max_payload, ttl, not_after, &len);
    size_t before = buf->len;
    assert_int_equal(relay_batch_append_publish_call(checked_copies(&one, 1, prefix, max_payload),
                                                     1, row->after, prefix, max_payload, ttl,
                                                     not_after, buf),
                     0);
    assert_int_equal(buf->len - before, (size_t)len);
    assert_memory_equal(buf->data + before, want, (size_t)len);
    assert_int_equal(buf->data[buf->len], '\0');
    redisFreeCommand(want);
}

/* MULTI, one "XADD <stream> <ms>-<seq> <fields>" per row, EXEC: the bytes
 * hiredis makes of each argv, the fields being those of the one-row publish
 * (relay_batch_build_publish puts them after its 7 fixed arguments). */
static char *hiredis_xadd_call(const struct relay_row *const *rows, size_t n, const char *prefix,
                               uint64_t ms, size_t *len)
{
    static struct relay_publish_cmd cmd;
    static char all[1 << 20];
    const char *argv[RELAY_PUBLISH_ARGV_MAX];
    size_t argvlen[RELAY_PUBLISH_ARGV_MAX];
    char err[512], id[64];
    size_t off = 0;
    char *one = NULL;
    int l = redisFormatCommand(&one, "MULTI");
    memcpy(all + off, one, (size_t)l);
    off += (size_t)l;
    redisFreeCommand(one);
    for (size_t i = 0; i < n; i++) {
        struct relay_row row = *rows[i];
        row.after = NULL;
        assert_int_equal(
            relay_batch_build_publish(&row, prefix, 1 << 16, 1, 2, &cmd, err, sizeof(err)), 0);
        int argc = 0;
        argv[argc] = "XADD";
        argvlen[argc++] = 4;
        argv[argc] = cmd.argv[3];
        argvlen[argc++] = cmd.argvlen[3];
        argvlen[argc] = (size_t)snprintf(id, sizeof(id), "%llu-%llu", (unsigned long long)ms,
                                         (unsigned long long)rows[i]->seq);
        argv[argc++] = id;
        for (int k = 7; k < cmd.argc; k++) {
            argv[argc] = cmd.argv[k];
            argvlen[argc++] = cmd.argvlen[k];
        }
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

static void test_append_publish_call_matches_hiredis(void **state)
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
        /* Payloads, keys and headers that differ from row to row. */
        rows[i] = make_row("orders", payload, (i * 97) % sizeof(payload));
        snprintf(mids[i], sizeof(mids[i]), "00000000-0000-0000-0000-%012zu", i);
        rows[i].message_id = mids[i];
        rows[i].message_id_len = strlen(mids[i]);
        rows[i].id = (int64_t)(1000 * i + 9);
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
    struct relay_row before = make_row("orders", "x", 1);
    before.message_id = MID_BEFORE;
    before.message_id_len = strlen(MID_BEFORE);

    /* One row, a few, nine and ten (argument counts change digits), all. */
    static const size_t counts[] = {1, 2, 3, 9, 10, RELAY_CALL_ROWS};
    for (size_t c = 0; c < OUTBOX_ARRAY_LEN(counts); c++) {
        check_publish_call_same(call, counts[c], NULL, "", &buf);
        check_publish_call_same(call, counts[c], &before, "app:", &buf);
        check_publish_call_same(call, counts[c], NULL, NULL, &buf);
    }
    /* A partition's stream. */
    for (size_t i = 0; i < RELAY_CALL_ROWS; i++) {
        rows[i].partitions = 16;
        rows[i].partition = 15;
    }
    before.partitions = 16;
    before.partition = 15;
    check_publish_call_same(call, 5, &before, "p.", &buf);

    /* A row that fails its check, one of another stream, or one not
     * checked: nothing is appended. */
    char err[512];
    enum relay_row_fault fault = RELAY_FAULT_NONE;
    for (size_t i = 0; i < 7; i++)
        assert_int_equal(relay_batch_check_publish(&rows[i], "", 1 << 16, err, sizeof(err), &fault),
                         0);
    size_t len = buf.len;
    struct relay_row other = rows[3];
    other.partition = 14;
    call[3] = &other;
    assert_int_equal(relay_batch_append_publish_call(call, 5, NULL, "", 1 << 16, 1, 2, &buf), -1);
    other = rows[3];
    other.topic = "bad topic";
    other.topic_len = strlen(other.topic);
    assert_int_equal(relay_batch_append_publish_call(call, 5, NULL, "", 1 << 16, 1, 2, &buf), -1);
    assert_int_equal(relay_batch_append_publish_call(call, 0, NULL, "", 1 << 16, 1, 2, &buf), -1);
    call[3] = &rows[3];
    rows[6].call_bytes = 0;
    assert_int_equal(relay_batch_append_publish_call(call, 7, NULL, "", 1 << 16, 1, 2, &buf), -1);
    assert_int_equal(buf.len, len);

    /* The check: a row's part of a call, and its refusals. */
    assert_int_equal(relay_batch_check_publish(&rows[4], "", 1 << 16, err, sizeof(err), &fault), 0);
    /* What a row adds to a call is its part (no count changes its digits
     * from one row to two). */
    assert_int_equal(relay_batch_check_publish(&rows[1], "", 1 << 16, err, sizeof(err), &fault), 0);
    struct outbox_buf one, two;
    memset(&one, 0, sizeof(one));
    memset(&two, 0, sizeof(two));
    const struct relay_row *pair[] = {&rows[0], &rows[1]};
    assert_int_equal(relay_batch_append_publish_call(pair, 1, NULL, "", 1 << 16, 1, 2, &one), 0);
    assert_int_equal(relay_batch_append_publish_call(pair, 2, NULL, "", 1 << 16, 1, 2, &two), 0);
    char stream[256];
    int slen = outbox_key_partition_stream("", "orders", 6, rows[1].partition, rows[1].partitions,
                                           stream, sizeof(stream));
    assert_true(slen > 0);
    /* and its record, "{<stream>}:dedup:<message id>", as a bulk string */
    size_t key = (size_t)slen + 9 + rows[1].message_id_len;
    char head[32];
    size_t key_bulk = (size_t)snprintf(head, sizeof(head), "$%zu\r\n", key) + key + 2;
    assert_int_equal(two.len - one.len, rows[1].call_bytes + key_bulk);
    outbox_buf_free(&one);
    outbox_buf_free(&two);
    assert_int_equal(relay_batch_check_publish(&other, "", 1 << 16, err, sizeof(err), &fault), -1);
    assert_int_equal(fault, RELAY_FAULT_PERMANENT);
    assert_non_null(strstr(err, "is not allowed"));
    rows[4].payload_len = 100;
    assert_int_equal(relay_batch_check_publish(&rows[4], "", 99, err, sizeof(err), &fault), -1);
    assert_non_null(strstr(err, "max_payload_bytes"));
    outbox_buf_free(&buf);
}

static void test_append_publish_matches_hiredis(void **state)
{
    (void)state;
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));

    /* Binary payload, a key, every prefix form. */
    static const char bin[] = {'a', '\0', '\xff', '\r', '\n', '$', '*'};
    struct relay_row row = make_row("orders", bin, sizeof(bin));
    check_publish_same(&row, "", 1024, 60000, 1796040000000ull, &buf);
    check_publish_same(&row, NULL, 1024, 60000, 1796040000000ull, &buf);
    row.key = "customer-7";
    row.key_len = 10;
    check_publish_same(&row, "app:", 1024, 60000, 1796040000000ull, &buf);
    row.key = "";
    row.key_len = 0;
    check_publish_same(&row, "app:", 1024, 60000, 1796040000000ull, &buf);
    /* A partition's stream, the first, the last. */
    row.partitions = 8;
    row.partition = 5;
    check_publish_same(&row, "app:", 1024, 60000, 1796040000000ull, &buf);
    row.partitions = 1000;
    row.partition = 0;
    check_publish_same(&row, "", 1024, 60000, 1796040000000ull, &buf);
    row.partition = 999;
    check_publish_same(&row, NULL, 1024, 60000, 1796040000000ull, &buf);
    row.partitions = 1;
    row.partition = 0;

    /* Sent after another row of its stream: a third key. */
    struct relay_row before = row;
    before.message_id = MID_BEFORE;
    row.after = &before;
    check_publish_same(&row, "app:", 1024, 60000, 1796040000000ull, &buf);
    before.partitions = row.partitions = 16;
    before.partition = row.partition = 15;
    check_publish_same(&row, NULL, 1024, 60000, 1796040000000ull, &buf);
    row.after = NULL;
    row.partitions = 1;
    row.partition = 0;

    /* Integers at their edges, in every argument that is one. */
    static const int64_t ids[] = {0, 1, 9, 10, 42, 99999, INT64_MAX, -1, INT64_MIN};
    static const uint32_t ttls[] = {0, 9, 10, 86400000u, UINT32_MAX};
    static const uint64_t deadlines[] = {0, 1796040000000ull, UINT64_MAX};
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(ids); i++)
        for (size_t t = 0; t < OUTBOX_ARRAY_LEN(ttls); t++)
            for (size_t d = 0; d < OUTBOX_ARRAY_LEN(deadlines); d++) {
                row.id = ids[i];
                check_publish_same(&row, "p.", 1024, ttls[t], deadlines[d], &buf);
            }

    /* Lengths on both sides of each change in digit count, across the
     * buffer's first growth. */
    static char big[20000];
    memset(big, 'x', sizeof(big));
    static const size_t lens[] = {0,   1,    9,    10,   99,   100,   199,  200,
                                  999, 1000, 4095, 4096, 9999, 10000, 19999};
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(lens); i++) {
        struct relay_row r = make_row("bench1", big, lens[i]);
        check_publish_same(&r, "", sizeof(big), 1000, 1796040000000ull, &buf);
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
    check_publish_same(&hdr, "stream:", 1024, 1000, 1796040000000ull, &buf);
    hdr.key = "k";
    hdr.key_len = 1;
    check_publish_same(&hdr, "stream:", 1024, 1000, 1796040000000ull, &buf);

    /* The empty headers object. */
    hdr.header_names_len = encode_array(nbuf, names, 0);
    hdr.header_values_len = encode_array(vbuf, values, 0);
    check_publish_same(&hdr, "", 1024, 1000, 1796040000000ull, &buf);

    outbox_buf_free(&buf);
    assert_null(buf.data);
    outbox_buf_free(NULL);
}

/* A refused row: the same message from the argv and the check, permanent,
 * and nothing appended for a call that holds it. */
static void check_publish_refused_same(const struct relay_row *row, const char *prefix,
                                       uint32_t max_payload, const char *expect,
                                       enum relay_row_cause cause)
{
    char err1[512], err2[512];
    static struct relay_publish_cmd cmd;
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    struct relay_row ok = make_row("orders", "x", 1);
    enum relay_row_fault ok_fault;
    assert_int_equal(relay_batch_check_publish(&ok, "", 1024, err2, sizeof(err2), &ok_fault), 0);
    const struct relay_row *call[] = {&ok, row};
    assert_int_equal(relay_batch_append_publish_call(call, 1, NULL, "", 1024, 1, 2, &buf), 0);
    size_t before = buf.len;

    assert_int_equal(relay_batch_build_publish(row, prefix, max_payload, 1000, 1796040000000ull,
                                               &cmd, err1, sizeof(err1)),
                     -1);
    memset(err2, 0, sizeof(err2));
    enum relay_row_fault fault = RELAY_FAULT_NONE;
    struct relay_row copy = *row;
    assert_int_equal(
        relay_batch_check_publish(&copy, prefix, max_payload, err2, sizeof(err2), &fault), -1);
    /* What the producer wrote fails the same way on every attempt: the row is
     * quarantined at once rather than retried. */
    assert_int_equal(fault, RELAY_FAULT_PERMANENT);
    /* Whose the fault is decides the advice: drop a row the producer wrote
     * wrongly, re-queue one the setup refused once the setup is changed. */
    assert_int_equal(copy.cause, cause);
    char advice[64];
    snprintf(advice, sizeof(advice), "outbox-relay failed %s %lld",
             cause == RELAY_CAUSE_ROW ? "drop" : "retry", (long long)row->id);
    assert_non_null(strstr(err2, advice));
    if (cause == RELAY_CAUSE_ROW)
        assert_null(strstr(err2, "failed retry"));
    assert_string_equal(err2, err1);
    assert_non_null(strstr(err2, expect));
    assert_int_equal(relay_batch_append_publish_call(&call[1], 1, NULL, prefix, max_payload, 1000,
                                                     1796040000000ull, &buf),
                     -1);
    assert_int_equal(buf.len, before);
    outbox_buf_free(&buf);
}

static void test_append_publish_refuses_what_build_refuses(void **state)
{
    (void)state;
    struct relay_row bad_topic = make_row("bad topic", "x", 1);
    check_publish_refused_same(&bad_topic, "", 1024, "topic \"bad topic\" is not allowed",
                               RELAY_CAUSE_ROW);
    struct relay_row no_topic = make_row("", "x", 1);
    check_publish_refused_same(&no_topic, "", 1024, "is not allowed", RELAY_CAUSE_ROW);

    struct relay_row big = make_row("orders", "0123456789", 10);
    check_publish_refused_same(&big, "", 9, "payload of 10 bytes exceeds max_payload_bytes (9)",
                               RELAY_CAUSE_SETUP);

    /* Over the limit, the claim sends only the payload's size: refused by that
     * size, and a missing payload is never read whatever the size says. */
    struct relay_row unfetched = make_row("orders", NULL, 104857600);
    check_publish_refused_same(&unfetched, "", 1048576,
                               "payload of 104857600 bytes exceeds max_payload_bytes (1048576)",
                               RELAY_CAUSE_SETUP);
    unfetched.payload_len = 10;
    check_publish_refused_same(&unfetched, "", 1048576, "payload of 10 bytes", RELAY_CAUSE_SETUP);
    /* Over the largest max_payload_bytes there is: the producer's to fix. */
    unfetched.payload_len = 536870913;
    check_publish_refused_same(&unfetched, "", 536870912, "the largest it can be (536870912)",
                               RELAY_CAUSE_ROW);

    static char longkey[OUTBOX_KEY_MAX + 1];
    memset(longkey, 'k', sizeof(longkey));
    struct relay_row key = make_row("orders", "x", 1);
    key.key = longkey;
    key.key_len = sizeof(longkey);
    check_publish_refused_same(&key, "", 1024, "partition key of 1025 bytes", RELAY_CAUSE_ROW);

    struct relay_row arr = make_row("orders", "x", 1);
    arr.headers_type = "array";
    check_publish_refused_same(&arr, "", 1024, "headers must be a JSON object", RELAY_CAUSE_ROW);

    char nbuf[512], vbuf[16384];
    const char *one[] = {"a"};
    const char *two[] = {"a", "b"};
    struct relay_row count = make_row("orders", "x", 1);
    count.headers_type = "object";
    count.header_names = nbuf;
    count.header_names_len = encode_array(nbuf, one, 1);
    count.header_values = vbuf;
    count.header_values_len = encode_array(vbuf, two, 2);
    check_publish_refused_same(&count, "", 1024, "headers cannot be encoded", RELAY_CAUSE_ROW);

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
    check_publish_refused_same(&hdr, "", 1024, "names are 1 to 128 bytes", RELAY_CAUSE_ROW);
    hdr.header_names_len = encode_array(nbuf, empty, 1);
    check_publish_refused_same(&hdr, "", 1024, "names are 1 to 128 bytes", RELAY_CAUSE_ROW);

    static char bigvalue[OUTBOX_HEADER_VALUE_MAX + 2];
    memset(bigvalue, 'v', sizeof(bigvalue) - 1);
    const char *bigvalues[] = {bigvalue};
    hdr.header_names_len = encode_array(nbuf, one, 1);
    hdr.header_values_len = encode_array(vbuf, bigvalues, 1);
    check_publish_refused_same(&hdr, "", 1024, "exceeds 8192 bytes", RELAY_CAUSE_ROW);

    /* Stream name and dedup key: the longest that fit, then one byte more. */
    char prefix[512];
    char topic[OUTBOX_TOPIC_MAX + 1];
    memset(topic, 't', OUTBOX_TOPIC_MAX);
    topic[OUTBOX_TOPIC_MAX] = '\0';
    struct relay_row longest = make_row(topic, "x", 1);
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    /* stream: < 256 + 200 bytes; dedup key "{stream}:dedup:<36>": < 500. */
    size_t fits = 500 - 1 - 9 - 36 - OUTBOX_TOPIC_MAX;
    memset(prefix, 'p', fits);
    prefix[fits] = '\0';
    check_publish_same(&longest, prefix, 1024, 1000, 1796040000000ull, &buf);
    prefix[fits] = 'p';
    prefix[fits + 1] = '\0';
    check_publish_refused_same(&longest, prefix, 1024, "stream name too long", RELAY_CAUSE_SETUP);
    memset(prefix, 'p', 256);
    prefix[256] = '\0';
    check_publish_refused_same(&longest, prefix, 1024, "stream name too long", RELAY_CAUSE_SETUP);
    const struct relay_row *call[] = {&longest};
    assert_int_equal(relay_batch_append_publish_call(call, 1, NULL, prefix, 1024, 1, 2, &buf), -1);
    outbox_buf_free(&buf);
}

/* cycle_io.c's retire_dedup_records as it stands, formatted by hiredis: every
 * command concatenated, and the rows' states restored afterwards. */
#define RETIRE_TTL "5000"

static size_t hiredis_retires(struct relay_row *rows, size_t n, const char *prefix, int unlink,
                              char *out, size_t outlen, int *commands)
{
    const size_t keymax = 320 + OUTBOX_TOPIC_MAX;
    char stream[256 + OUTBOX_TOPIC_MAX];
    static const char *argv[4 + 64];
    static size_t lens[4 + 64];
    static char keys[64][320 + OUTBOX_TOPIC_MAX];
    int saved[64];
    size_t len = 0;

    assert_true(n <= 64);
    *commands = 0;
    for (size_t i = 0; i < n; i++)
        saved[i] = rows[i].state;
    for (size_t i = 0; i < n; i++) {
        struct relay_row *lead = &rows[i];
        if (lead->state != RELAY_ROW_PUBLISHED)
            continue;
        if (outbox_key_partition_stream(prefix, lead->topic, lead->topic_len, lead->partition,
                                        lead->partitions, stream, sizeof(stream)) < 0)
            continue;
        int argc = 0, first;
        char nkeys[16];
        if (unlink) {
            argv[argc] = "UNLINK";
            lens[argc++] = 6;
        } else {
            argv[argc] = "FCALL";
            lens[argc++] = 5;
            argv[argc] = RELAY_FUNCTION_RETIRE;
            lens[argc++] = strlen(RELAY_FUNCTION_RETIRE);
            argv[argc] = nkeys;
            lens[argc++] = 0; /* set below */
        }
        first = argc;
        for (size_t j = i; j < n; j++) {
            struct relay_row *row = &rows[j];
            if (row->state != RELAY_ROW_PUBLISHED || row->topic_len != lead->topic_len ||
                memcmp(row->topic, lead->topic, lead->topic_len) != 0 ||
                (row->partitions > 1) != (lead->partitions > 1) ||
                (row->partitions > 1 && row->partition != lead->partition))
                continue;
            char *key = keys[argc - first];
            int k = outbox_key_dedup(stream, row->message_id, row->message_id_len, key, keymax);
            row->state = RELAY_ROW_CLAIMED;
            if (k < 0)
                continue;
            argv[argc] = key;
            lens[argc++] = (size_t)k;
        }
        if (argc > first) {
            if (!unlink) {
                lens[2] = (size_t)snprintf(nkeys, sizeof(nkeys), "%d", argc - first);
                argv[argc] = RETIRE_TTL;
                lens[argc++] = strlen(RETIRE_TTL);
            }
            char *cmd;
            int k = redisFormatCommandArgv(&cmd, argc, argv, lens);
            assert_true(k > 0 && len + (size_t)k <= outlen);
            memcpy(out + len, cmd, (size_t)k);
            len += (size_t)k;
            redisFreeCommand(cmd);
            (*commands)++;
        }
    }
    for (size_t i = 0; i < n; i++)
        rows[i].state = saved[i];
    return len;
}

/* The retires of rows, one per call, each checked to be one whole command. */
static size_t append_retires(const struct relay_row *rows, size_t n, const char *prefix,
                             uint32_t ttl_ms, struct outbox_buf *buf, int *commands)
{
    size_t pos = 0;
    int rc;
    *commands = 0;
    outbox_buf_reset(buf);
    while ((rc = relay_batch_append_retire(rows, n, prefix, ttl_ms, &pos, buf)) == 1) {
        (*commands)++;
        assert_true(pos <= n);
    }
    assert_int_equal(rc, 0);
    assert_int_equal(pos, n);
    /* Done stays done. */
    assert_int_equal(relay_batch_append_retire(rows, n, prefix, ttl_ms, &pos, buf), 0);
    return buf->len;
}

/* The UNLINKs of rows, one call each, each turned into its retire: together
 * they must be the retires relay_batch_append_retire formats. */
static size_t unlinks_as_retires(const struct relay_row *rows, size_t n, const char *prefix,
                                 struct outbox_buf *buf)
{
    struct outbox_buf one;
    memset(&one, 0, sizeof(one));
    size_t pos = 0;
    outbox_buf_reset(buf);
    for (;;) {
        outbox_buf_reset(&one);
        if (relay_batch_append_retire(rows, n, prefix, 0, &pos, &one) != 1)
            break;
        assert_int_equal(relay_batch_unlink_as_retire(one.data, one.len, 5000, buf), 0);
    }
    outbox_buf_free(&one);
    return buf->len;
}

static void check_retires_same(struct relay_row *rows, size_t n, const char *prefix)
{
    static char want[1 << 16];
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    struct relay_row copy[64];
    memcpy(copy, rows, n * sizeof(*rows));

    int want_cmds, got_cmds;
    for (int unlink = 0; unlink < 2; unlink++) {
        size_t want_len = hiredis_retires(rows, n, prefix, unlink, want, sizeof(want), &want_cmds);
        size_t got_len = append_retires(rows, n, prefix, unlink ? 0 : 5000, &buf, &got_cmds);
        assert_int_equal(got_cmds, want_cmds);
        assert_int_equal(got_len, want_len);
        if (want_len > 0)
            assert_memory_equal(buf.data, want, want_len);
        if (!unlink) {
            /* The same retires, made from the UNLINKs. */
            got_len = unlinks_as_retires(rows, n, prefix, &buf);
            assert_int_equal(got_len, want_len);
            if (want_len > 0)
                assert_memory_equal(buf.data, want, want_len);
        }
    }
    /* The rows are read, not changed. */
    assert_memory_equal(copy, rows, n * sizeof(*rows));
    outbox_buf_free(&buf);
}

static void test_append_retire_matches_hiredis(void **state)
{
    (void)state;
    static const char *ids[] = {
        "00000000-0000-0000-0000-000000000001", "00000000-0000-0000-0000-000000000002",
        "00000000-0000-0000-0000-000000000003", "00000000-0000-0000-0000-000000000004",
        "00000000-0000-0000-0000-000000000005", "00000000-0000-0000-0000-000000000006",
        "00000000-0000-0000-0000-000000000007", "00000000-0000-0000-0000-000000000008",
    };
    static const char *topics[] = {"orders", "users",  "orders", "ord",
                                   "users",  "orders", "x",      "orders"};
    static const int states[] = {RELAY_ROW_PUBLISHED, RELAY_ROW_PUBLISHED, RELAY_ROW_FAILED,
                                 RELAY_ROW_PUBLISHED, RELAY_ROW_PUBLISHED, RELAY_ROW_PUBLISHED,
                                 RELAY_ROW_CLAIMED,   RELAY_ROW_PUBLISHED};
    struct relay_row rows[8];
    for (size_t i = 0; i < 8; i++) {
        rows[i] = make_row(topics[i], "x", 1);
        rows[i].message_id = ids[i];
        rows[i].message_id_len = 36;
        rows[i].state = states[i];
    }
    check_retires_same(rows, 8, "");
    check_retires_same(rows, 8, "app:");
    check_retires_same(rows, 8, NULL);

    /* The first row of a stream may come late, after failed rows of it. */
    rows[0].state = RELAY_ROW_FAILED;
    check_retires_same(rows, 8, "s.");
    /* Nothing published: no command. */
    for (size_t i = 0; i < 8; i++)
        rows[i].state = RELAY_ROW_FAILED;
    check_retires_same(rows, 8, "s.");
    check_retires_same(rows, 0, "s.");

    /* One stream, a full batch of it: one command with every key; and ids of
     * other lengths. */
    struct relay_row many[64];
    static char idbuf[64][40];
    for (size_t i = 0; i < 64; i++) {
        snprintf(idbuf[i], sizeof(idbuf[i]), "id-%zu", i * 997);
        many[i] = make_row("bench1", "x", 1);
        many[i].message_id = idbuf[i];
        many[i].message_id_len = strlen(idbuf[i]);
        many[i].state = RELAY_ROW_PUBLISHED;
    }
    check_retires_same(many, 64, "");
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    int commands;
    append_retires(many, 64, "", 5000, &buf, &commands);
    assert_int_equal(commands, 1);
    static const char head[] = "*68\r\n$5\r\nFCALL\r\n$22\r\n" RELAY_FUNCTION_RETIRE
                               "\r\n$2\r\n64\r\n$19\r\n{bench1}:dedup:id-0\r\n";
    assert_memory_equal(buf.data, head, sizeof(head) - 1);
    append_retires(many, 64, "", 0, &buf, &commands);
    assert_int_equal(commands, 1);
    static const char uhead[] = "*65\r\n$6\r\nUNLINK\r\n$19\r\n{bench1}:dedup:id-0\r\n";
    assert_memory_equal(buf.data, uhead, sizeof(uhead) - 1);

    /* Only an UNLINK of keys becomes a retire, and only with a time to live. */
    struct outbox_buf conv;
    memset(&conv, 0, sizeof(conv));
    assert_int_equal(relay_batch_unlink_as_retire(buf.data, buf.len, 0, &conv), -1);
    static const char *bad[] = {"",
                                "*1\r\n$6\r\nUNLINK\r\n",
                                "*2\r\n$3\r\nDEL\r\n$1\r\nk\r\n",
                                "*2\r\n$6\r\nUNLIN",
                                "2\r\n$6\r\nUNLINK\r\n$1\r\nk\r\n",
                                "*x\r\n$6\r\nUNLINK\r\n$1\r\nk\r\n"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(relay_batch_unlink_as_retire(bad[i], strlen(bad[i]), 5000, &conv), -1);
    assert_int_equal(conv.len, 0);
    static const char one[] = "*2\r\n$6\r\nUNLINK\r\n$1\r\nk\r\n";
    assert_int_equal(relay_batch_unlink_as_retire(one, sizeof(one) - 1, 42, &conv), 0);
    static const char one_retire[] = "*5\r\n$5\r\nFCALL\r\n$22\r\n" RELAY_FUNCTION_RETIRE
                                     "\r\n$1\r\n1\r\n$1\r\nk\r\n$2\r\n42\r\n";
    assert_int_equal(conv.len, sizeof(one_retire) - 1);
    assert_memory_equal(conv.data, one_retire, sizeof(one_retire) - 1);
    outbox_buf_free(&conv);

    /* Partitions of one topic are streams of their own: one command each. */
    for (size_t i = 0; i < 64; i++) {
        many[i].partitions = 4;
        many[i].partition = (uint32_t)(i % 3);
    }
    check_retires_same(many, 64, "app:");
    append_retires(many, 64, "", 5000, &buf, &commands);
    assert_int_equal(commands, 3);
    static const char phead[] = "*26\r\n$5\r\nFCALL\r\n$22\r\n" RELAY_FUNCTION_RETIRE
                                "\r\n$2\r\n22\r\n$23\r\n{bench1:000}:dedup:id-0\r\n";
    assert_memory_equal(buf.data, phead, sizeof(phead) - 1);
    many[5].partitions = 1; /* the topic's unpartitioned stream, beside them */
    check_retires_same(many, 64, "");
    append_retires(many, 64, "", 5000, &buf, &commands);
    assert_int_equal(commands, 4);
    outbox_buf_free(&buf);

    /* A stream name that does not fit is skipped, as outbox_key_stream
     * refuses it. */
    char prefix[300];
    memset(prefix, 'p', sizeof(prefix) - 1);
    prefix[sizeof(prefix) - 1] = '\0';
    char topic[OUTBOX_TOPIC_MAX + 1];
    memset(topic, 't', OUTBOX_TOPIC_MAX);
    topic[OUTBOX_TOPIC_MAX] = '\0';
    many[3].topic = topic;
    many[3].topic_len = OUTBOX_TOPIC_MAX;
    check_retires_same(many, 64, prefix);
}

static void test_respbuf_caps_and_reuse(void **state)
{
    (void)state;
    static char payload[200];
    memset(payload, 'x', sizeof(payload));
    struct relay_row row = make_row("bench1", payload, sizeof(payload));
    row.state = RELAY_ROW_PUBLISHED;
    struct outbox_buf buf;
    memset(&buf, 0, sizeof(buf));
    char err[256];
    enum relay_row_fault fault;
    assert_int_equal(relay_batch_check_publish(&row, "", 1024, err, sizeof(err), &fault), 0);

    /* Reset between calls: the memory is reused, never reallocated. */
    const struct relay_row *call[] = {&row};
    assert_int_equal(relay_batch_append_publish_call(call, 1, NULL, "", 1024, 1000, 2, &buf), 0);
    const char *data = buf.data;
    size_t cap = buf.cap, one = buf.len;
    for (int i = 0; i < 1000; i++) {
        outbox_buf_reset(&buf);
        assert_int_equal(buf.len, 0);
        row.id = i;
        assert_int_equal(relay_batch_check_publish(&row, "", 1024, err, sizeof(err), &fault), 0);
        assert_int_equal(relay_batch_append_publish_call(call, 1, NULL, "", 1024, 1000, 2, &buf),
                         0);
        assert_true(buf.len <= one + 3);
    }
    assert_ptr_equal(buf.data, data);
    assert_int_equal(buf.cap, cap);
    outbox_buf_free(&buf);

    /* A cap: what does not fit is refused whole, and the buffer is intact. */
    memset(&buf, 0, sizeof(buf));
    buf.max = one + one / 2;
    assert_int_equal(relay_batch_append_publish_call(call, 1, NULL, "", 1024, 1000, 2, &buf), 0);
    size_t len = buf.len;
    assert_int_equal(relay_batch_append_publish_call(call, 1, NULL, "", 1024, 1000, 2, &buf),
                     OUTBOX_BUF_FULL);
    assert_int_equal(buf.len, len);
    assert_true(buf.cap <= buf.max);

    /* Retire: full keeps its place; after a reset it goes on from there. */
    struct relay_row rows[2] = {row, row};
    rows[1].topic = "other";
    rows[1].topic_len = 5;
    outbox_buf_reset(&buf);
    buf.max = 125; /* room for the first command (119 bytes), not the second (118) */
    size_t pos = 0;
    assert_int_equal(relay_batch_append_retire(rows, 2, "", 5000, &pos, &buf), 1);
    assert_int_equal(relay_batch_append_retire(rows, 2, "", 5000, &pos, &buf), OUTBOX_BUF_FULL);
    assert_int_equal(pos, 1);
    assert_int_equal(buf.len, 119);
    assert_memory_equal(buf.data, "*5\r\n$5\r\nFCALL\r\n", 15);
    assert_memory_equal(buf.data + 51, "$51\r\n{bench1}:dedup:", 20);
    assert_memory_equal(buf.data + 109, "$4\r\n5000\r\n", 10);
    outbox_buf_reset(&buf);
    assert_int_equal(relay_batch_append_retire(rows, 2, "", 5000, &pos, &buf), 1);
    assert_int_equal(buf.len, 118);
    assert_memory_equal(buf.data + 51, "$50\r\n{other}:dedup:", 19);
    assert_int_equal(relay_batch_append_retire(rows, 2, "", 5000, &pos, &buf), 0);
    outbox_buf_free(&buf);
}

/* The claim starts after the batches in flight only while each other lane
 * holds a full one, never for a relay that claims partitioned rows, and
 * walks the whole index again at least every RELAY_CLAIM_FULL_WALK_EVERY
 * claims, so a row left below the floor is not left for long. */
static void test_claim_floor(void **state)
{
    (void)state;
    unsigned run = 0;
    struct relay_claim_lane full = {1, 500, 1500};
    struct relay_claim_lane shorter = {1, 499, 1500};
    struct relay_claim_lane idle = {0, 500, 1500};

    assert_int_equal(relay_batch_claim_floor(&full, 1, 500, 0, &run), 1500);
    assert_int_equal(run, 1);
    run = 0;
    assert_int_equal(relay_batch_claim_floor(&shorter, 1, 500, 0, &run), 0);
    assert_int_equal(relay_batch_claim_floor(&idle, 1, 500, 0, &run), 0);
    assert_int_equal(relay_batch_claim_floor(&full, 1, 500, 1, &run), 0);
    assert_int_equal(relay_batch_claim_floor(NULL, 0, 500, 0, &run), 0); /* one lane */
    assert_int_equal(run, 0);

    /* Several lanes: after the highest, and only if every one is full. */
    struct relay_claim_lane two[2] = {{1, 500, 900}, {1, 500, 2100}};
    assert_int_equal(relay_batch_claim_floor(two, 2, 500, 0, &run), 2100);
    two[0].nrows = 12;
    run = 0;
    assert_int_equal(relay_batch_claim_floor(two, 2, 500, 0, &run), 0);

    /* A full walk breaks every run of bounded claims, and starts the next. */
    run = 0;
    for (int round = 0; round < 3; round++) {
        for (unsigned i = 1; i < RELAY_CLAIM_FULL_WALK_EVERY; i++)
            assert_int_equal(relay_batch_claim_floor(&full, 1, 500, 0, &run), 1500);
        assert_int_equal(relay_batch_claim_floor(&full, 1, 500, 0, &run), 0);
        assert_int_equal(run, 0);
    }
    /* A full walk for another reason starts the count again. */
    for (int i = 0; i < 3; i++)
        assert_int_equal(relay_batch_claim_floor(&full, 1, 500, 0, &run), 1500);
    assert_int_equal(relay_batch_claim_floor(&idle, 1, 500, 0, &run), 0);
    assert_int_equal(run, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_topic_charset),
        cmocka_unit_test(test_stream_and_dedup_key_share_hash_tag),
        cmocka_unit_test(test_partition_hash_vectors),
        cmocka_unit_test(test_cluster_slot),
        cmocka_unit_test(test_partition_stream_names),
        cmocka_unit_test(test_build_publish_fields),
        cmocka_unit_test(test_build_publish_no_key_field_when_null),
        cmocka_unit_test(test_build_publish_headers),
        cmocka_unit_test(test_row_errors_say_what_to_do),
        cmocka_unit_test(test_decode_text_array),
        cmocka_unit_test(test_decode_integers),
        cmocka_unit_test(test_classify_errors),
        cmocka_unit_test(test_row_retry_delay_grows_and_caps),
        cmocka_unit_test(test_function_source_records_after_xadd),
        cmocka_unit_test(test_build_publish_names_the_row_before),
        cmocka_unit_test(test_stream_index_finds_the_row_before),
        cmocka_unit_test(test_apply_reply_order),
        cmocka_unit_test(test_apply_reply_cycle),
        cmocka_unit_test(test_apply_reply_batch_failures),
        cmocka_unit_test(test_apply_wait),
        cmocka_unit_test(test_finish_sql),
        cmocka_unit_test(test_row_quarantined_by_kind),
        cmocka_unit_test(test_utf8_prefix_never_cuts_a_character),
        cmocka_unit_test(test_finish_sql_survives_unquotable_error),
        cmocka_unit_test(test_append_publish_matches_hiredis),
        cmocka_unit_test(test_append_publish_call_matches_hiredis),
        cmocka_unit_test(test_append_xadd_call_matches_hiredis),
        cmocka_unit_test(test_entry_ids),
        cmocka_unit_test(test_append_publish_refuses_what_build_refuses),
        cmocka_unit_test(test_append_retire_matches_hiredis),
        cmocka_unit_test(test_respbuf_caps_and_reuse),
        cmocka_unit_test(test_claim_floor),
    };
    return cmocka_run_group_tests_name("batch", tests, NULL, NULL);
}
