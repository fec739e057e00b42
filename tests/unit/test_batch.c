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

#include "relay/batch.h"

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
    assert_true(relay_batch_topic_valid("orders", 6));
    assert_true(relay_batch_topic_valid("Orders.v2_eu-west", 17));
    assert_false(relay_batch_topic_valid("", 0));
    assert_false(relay_batch_topic_valid("bad topic", 9));
    assert_false(relay_batch_topic_valid("{x}", 3));
    assert_false(relay_batch_topic_valid("a:b", 3));
    assert_false(relay_batch_topic_valid("caf\xc3\xa9", 5));
    char longt[RELAY_TOPIC_MAX + 2];
    memset(longt, 'a', sizeof(longt));
    assert_true(relay_batch_topic_valid(longt, RELAY_TOPIC_MAX));
    assert_false(relay_batch_topic_valid(longt, RELAY_TOPIC_MAX + 1));
}

static void test_stream_and_dedup_key_share_hash_tag(void **state)
{
    (void)state;
    char stream[64], key[128];
    assert_int_equal(relay_batch_stream_name("app:", "orders", 6, stream, sizeof(stream)), 10);
    assert_string_equal(stream, "app:orders");
    assert_true(relay_batch_dedup_key(stream, MID, strlen(MID), key, sizeof(key)) > 0);
    assert_string_equal(key, "{app:orders}:dedup:0b6c3b7e-8f5e-4f7a-9a51-1c2d3e4f5a6b");
    assert_int_equal(relay_batch_stream_name("", "orders", 6, stream, 4), -1);
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
    assert_int_equal(relay_batch_build_publish(&row, "", 1024, 60000, 1796040000000ull, &cmd, err, sizeof(err)), 0);
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
    assert_int_equal(relay_batch_build_publish(&row, "p.", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)), 0);
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
    assert_int_equal(relay_batch_build_publish(&row, "", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)), 0);
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
    assert_int_equal(relay_batch_build_publish(&bad_topic, "", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)),
                     -1);
    assert_non_null(strstr(err, "topic \"bad topic\" is not allowed"));
    assert_non_null(strstr(err, "outbox-relay failed retry"));

    struct relay_row big = make_row("orders", "0123456789", 10);
    assert_int_equal(relay_batch_build_publish(&big, "", 9, 1000, 1796040000000ull, &cmd, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "payload of 10 bytes exceeds max_payload_bytes (9)"));

    struct relay_row arr = make_row("orders", "x", 1);
    arr.headers_type = "array";
    assert_int_equal(relay_batch_build_publish(&arr, "", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "headers must be a JSON object"));

    char toolong[RELAY_HEADER_NAME_MAX + 2];
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
    assert_int_equal(relay_batch_build_publish(&hdr, "", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "names are 1 to 128 bytes"));
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
    const char *xadd = strstr(relay_batch_function_source, "'XADD'");
    const char *set = strstr(relay_batch_function_source, "'SET'");
    const char *expired = strstr(relay_batch_function_source, "EXPIRED");
    assert_non_null(xadd);
    assert_non_null(set);
    assert_non_null(expired);
    assert_true(xadd < set);
    assert_true(expired < xadd);
    assert_non_null(strstr(relay_batch_function_source, "#!lua name=" RELAY_FUNCTION_LIBRARY));
}

static void test_apply_reply_cycle(void **state)
{
    (void)state;
    struct relay_row rows[3];
    rows[0] = make_row("orders", "a", 1);
    rows[1] = make_row("orders", "b", 1);
    rows[2] = make_row("orders", "c", 1);
    struct relay_cycle cycle;
    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 3;

    assert_int_equal(relay_batch_apply_reply(&cycle, &rows[0], RELAY_REPLY_ENTRY, NULL, 0), 0);
    assert_int_equal(rows[0].state, RELAY_ROW_PUBLISHED);
    const char *wt = "WRONGTYPE Operation against a key holding the wrong kind of value";
    assert_int_equal(relay_batch_apply_reply(&cycle, &rows[1], RELAY_REPLY_ERROR, wt, strlen(wt)),
                     0);
    assert_int_equal(rows[1].state, RELAY_ROW_FAILED);
    assert_non_null(strstr(rows[1].error, "rename or delete that key"));
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
    struct relay_cycle cycle;

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 2;
    const char *oom = "OOM command not allowed when used memory > 'maxmemory'.";
    relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_ERROR, oom, strlen(oom));
    assert_true(cycle.failed);
    assert_non_null(strstr(cycle.error, "OOM"));
    assert_int_equal(row.state, RELAY_ROW_CLAIMED);
    /* The first reason is kept. */
    relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_LOST, "Connection reset", 16);
    assert_non_null(strstr(cycle.error, "OOM"));

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    const char *nf = "ERR Function not found";
    assert_int_equal(relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_ERROR, nf, strlen(nf)), 1);
    assert_true(cycle.failed);
    assert_true(cycle.function_missing);

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_OTHER, NULL, 0);
    assert_true(cycle.failed);
    assert_non_null(strstr(cycle.error, "unexpected reply type"));

    memset(&cycle, 0, sizeof(cycle));
    cycle.pending = 1;
    relay_batch_apply_reply(&cycle, &row, RELAY_REPLY_LOST, NULL, 0);
    assert_true(cycle.failed);
    assert_non_null(strstr(cycle.error, "connection lost"));
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
    struct relay_row rows[4];
    for (int i = 0; i < 4; i++) {
        rows[i] = make_row("orders", "x", 1);
        rows[i].id = 10 + i;
        rows[i].state = RELAY_ROW_PUBLISHED;
    }
    rows[1].state = RELAY_ROW_FAILED;
    rows[1].attempts = 0;
    snprintf(rows[1].error, sizeof(rows[1].error), "topic \"it's\" is not allowed");
    rows[3].state = RELAY_ROW_FAILED;
    rows[3].attempts = 2;
    snprintf(rows[3].error, sizeof(rows[3].error), "too large");
    struct relay_sql_quoter q = {fake_quote, free, NULL};
    struct relay_sqlbuf buf;
    memset(&buf, 0, sizeof(buf));

    assert_int_equal(relay_batch_finish_sql(rows, 4, 3, &q, NULL, &buf), 1);
    assert_string_equal(
        buf.data,
        "UPDATE outbox.messages SET sent_at = statement_timestamp() WHERE id = ANY('{10,12}'::bigint[]);"
        "UPDATE outbox.messages SET attempts = attempts + 1, last_error = 'topic \"it''s\" is "
        "not allowed', retry_at = statement_timestamp() + interval '1000 milliseconds', failed_at = NULL WHERE "
        "id = 11;"
        "UPDATE outbox.messages SET attempts = attempts + 1, last_error = 'too large', retry_at "
        "= statement_timestamp() + interval '4000 milliseconds', failed_at = statement_timestamp() WHERE id = 13;"
        "COMMIT");

    /* Nothing published: no sent_at update at all. */
    rows[0].state = rows[2].state = RELAY_ROW_FAILED;
    assert_int_equal(relay_batch_finish_sql(rows, 1, 3, &q, NULL, &buf), 0);
    assert_null(strstr(buf.data, "sent_at"));

    /* A cap that is too small is an error, never a truncated statement. */
    struct relay_sqlbuf small;
    memset(&small, 0, sizeof(small));
    small.max = 16;
    assert_int_equal(relay_batch_finish_sql(rows, 4, 3, &q, NULL, &small), -1);
    relay_sqlbuf_free(&small);
    relay_sqlbuf_free(&buf);
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
    assert_int_equal(relay_batch_build_publish(&row, "", 1024, 1000, 1796040000000ull, &cmd, err, sizeof(err)), -1);
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
    struct relay_sqlbuf buf;
    memset(&buf, 0, sizeof(buf));
    assert_int_equal(relay_batch_finish_sql(&row, 1, 3, &q, NULL, &buf), 0);
    assert_non_null(strstr(buf.data, "could not be stored"));
    assert_non_null(strstr(buf.data, "COMMIT"));
    relay_sqlbuf_free(&buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_topic_charset),
        cmocka_unit_test(test_stream_and_dedup_key_share_hash_tag),
        cmocka_unit_test(test_build_publish_fields),
        cmocka_unit_test(test_build_publish_no_key_field_when_null),
        cmocka_unit_test(test_build_publish_headers),
        cmocka_unit_test(test_row_errors_say_what_to_do),
        cmocka_unit_test(test_decode_text_array),
        cmocka_unit_test(test_decode_integers),
        cmocka_unit_test(test_classify_errors),
        cmocka_unit_test(test_row_retry_delay_grows_and_caps),
        cmocka_unit_test(test_function_source_records_after_xadd),
        cmocka_unit_test(test_apply_reply_cycle),
        cmocka_unit_test(test_apply_reply_batch_failures),
        cmocka_unit_test(test_finish_sql),
        cmocka_unit_test(test_utf8_prefix_never_cuts_a_character),
        cmocka_unit_test(test_finish_sql_survives_unquotable_error),
    };
    return cmocka_run_group_tests_name("batch", tests, NULL, NULL);
}
