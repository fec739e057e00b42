/* Unit tests of the pure parts of the consumer library (consumer/): the backoff schedule, the
 * dead-letter and replay stream names, the order of the dead-letter and replay
 * functions, the check of an entry against the stream contract (replies are
 * built by hiredis's own reader from RESP), and how problems are reported. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>

#include "common/common.h"
#include "outbox/consumer.h"
#include "common/functions.h"
#include "common/keys.h"
#include "consumer/internal.h"

/* File-local in consumer/leases.c, reached through OUTBOX_STATIC. */
const redisReply *parked_key_left(const redisReply *before, const redisReply *now);
long long redis_time_ms(const redisReply *t);

/* Parses one RESP reply; the caller frees it with freeReplyObject. */
static redisReply *resp(const char *buf, size_t len)
{
    redisReader *r = redisReaderCreate();
    void *reply = NULL;
    assert_int_equal(redisReaderFeed(r, buf, len), REDIS_OK);
    assert_int_equal(redisReaderGetReply(r, &reply), REDIS_OK);
    assert_non_null(reply);
    redisReaderFree(r);
    return reply;
}

/* RESP array of bulk strings from pairs; NULL-terminated list of C strings,
 * except that a string starting with "\x01" is taken as 3 bytes a\0b. */
static size_t build(char *out, size_t cap, const char *const *items)
{
    size_t n = 0, off = 0;
    while (items[n] != NULL)
        n++;
    off += (size_t)snprintf(out + off, cap - off, "*%zu\r\n", n);
    for (size_t i = 0; i < n; i++) {
        if (items[i][0] == '\x01') {
            memcpy(out + off, "$3\r\na\0b\r\n", 9);
            off += 9;
            continue;
        }
        off += (size_t)snprintf(out + off, cap - off, "$%zu\r\n%s\r\n", strlen(items[i]), items[i]);
    }
    return off;
}

static void test_default_backoff_schedule(void **state)
{
    (void)state;
    struct outbox_consumer_options o;
    memset(&o, 0, sizeof(o));
    assert_int_equal(outbox_consumer_backoff_ms(&o, 1), 1000);
    assert_int_equal(outbox_consumer_backoff_ms(&o, 2), 10000);
    assert_int_equal(outbox_consumer_backoff_ms(&o, 3), 100000);
    assert_int_equal(outbox_consumer_backoff_ms(&o, 4), 1000000);
    /* The last step repeats. */
    assert_int_equal(outbox_consumer_backoff_ms(&o, 9), 1000000);
}

static void test_custom_backoff_schedule(void **state)
{
    (void)state;
    struct outbox_consumer_options o;
    memset(&o, 0, sizeof(o));
    o.backoff_ms[0] = 200;
    o.backoff_ms[1] = 400;
    o.nbackoff = 2;
    assert_int_equal(outbox_consumer_backoff_ms(&o, 1), 200);
    assert_int_equal(outbox_consumer_backoff_ms(&o, 2), 400);
    assert_int_equal(outbox_consumer_backoff_ms(&o, 3), 400);
}

static void test_stream_names(void **state)
{
    (void)state;
    char buf[64];
    assert_int_equal(outbox_consumer_dlq_name("orders", "email", buf, sizeof(buf)), 18);
    assert_string_equal(buf, "{orders}.email.dlq");
    assert_true(outbox_consumer_replay_name("orders", "email", buf, sizeof(buf)) > 0);
    assert_string_equal(buf, "{orders}.email.replay");
    assert_int_equal(outbox_consumer_dlq_name("orders", "email", buf, 18), -1);
    /* The names before 0.2, which "outbox-relay dlq migrate" renames. */
    assert_int_equal(outbox_key_dlq_old("orders", "email", buf, sizeof(buf)), 16);
    assert_string_equal(buf, "orders.email.dlq");
    assert_true(outbox_key_replay_old("orders", "email", buf, sizeof(buf)) > 0);
    assert_string_equal(buf, "orders.email.replay");
    /* In the stream's hash slot. */
    assert_true(outbox_consumer_dlq_name("app:orders:003", "email", buf, sizeof(buf)) > 0);
    assert_int_equal(outbox_key_slot(buf, strlen(buf)), outbox_key_slot("app:orders:003", 14));
}

static void test_new_validates_options(void **state)
{
    (void)state;
    char err[256];
    struct outbox_consumer_options o;
    memset(&o, 0, sizeof(o));
    o.redis_url = "redis://127.0.0.1:6379/0";
    o.stream = "orders";
    assert_null(outbox_consumer_new(&o, NULL, NULL, err, sizeof(err)));
    o.group = "email";
    o.redis_url = "http://x";
    assert_null(outbox_consumer_new(&o, (outbox_consumer_handler_fn *)1, NULL, err, sizeof(err)));
    o.redis_url = "redis://127.0.0.1:6379/0";
    o.nbackoff = 1; /* a zero step */
    assert_null(outbox_consumer_new(&o, (outbox_consumer_handler_fn *)1, NULL, err, sizeof(err)));
    assert_non_null(strstr(err, "at least 1 ms"));
    o.nbackoff = 0;
    struct outbox_consumer *c =
        outbox_consumer_new(&o, (outbox_consumer_handler_fn *)1, NULL, err, sizeof(err));
    assert_non_null(c);
    assert_string_equal(outbox_consumer_dlq(c), "{orders}.email.dlq");
    outbox_consumer_free(c);
    outbox_consumer_free(NULL);
}

static void test_processed_horizon_against_redelivery(void **state)
{
    (void)state;
    char err[512];
    struct outbox_consumer_options o;
    memset(&o, 0, sizeof(o));
    o.redis_url = "redis://127.0.0.1:6379/0";
    o.stream = "orders";
    o.group = "email";
    /* Defaults: 5 deliveries, 1 s, 10 s, 100 s, 1000 s apart, each after a
     * reclaim pass of 250 ms. */
    assert_int_equal(outbox_consumer_redelivery_horizon_ms(&o), 1111000 + 4 * 250);
    o.max_deliveries = 3;
    o.nbackoff = 1;
    o.backoff_ms[0] = 2000;
    o.reclaim_interval_ms = 100;
    assert_int_equal(outbox_consumer_redelivery_horizon_ms(&o), 2 * 2100);

    o.processed_horizon_ms = 4199; /* a millisecond short */
    assert_null(outbox_consumer_new(&o, (outbox_consumer_handler_fn *)1, NULL, err, sizeof(err)));
    assert_non_null(strstr(err, "shorter than the redelivery horizon (4200 ms"));
    o.allow_short_processed_horizon = 1; /* the operator's choice: accepted */
    struct outbox_consumer *c =
        outbox_consumer_new(&o, (outbox_consumer_handler_fn *)1, NULL, err, sizeof(err));
    assert_non_null(c);
    outbox_consumer_free(c);
    o.allow_short_processed_horizon = 0;
    o.processed_horizon_ms = 4200;
    c = outbox_consumer_new(&o, (outbox_consumer_handler_fn *)1, NULL, err, sizeof(err));
    assert_non_null(c);
    outbox_consumer_free(c);
}

/* What the log hook saw. */
struct seen {
    int calls;
    enum outbox_consumer_log_level level;
    char message[256];
};

static void remember(enum outbox_consumer_log_level level, const char *message, void *arg)
{
    struct seen *s = arg;
    s->calls++;
    s->level = level;
    snprintf(s->message, sizeof(s->message), "%s", message);
}

/* The library reports through its hook and its object, never by itself: a
 * problem is kept as kind and text, logged as an error once per change of its
 * text, on one line. */
static void test_problems_go_to_the_hook_and_the_object(void **state)
{
    (void)state;
    char err[256];
    struct seen seen = {0, OUTBOX_CONSUMER_LOG_DEBUG, ""};
    struct outbox_consumer_options o;
    memset(&o, 0, sizeof(o));
    o.redis_url = "redis://127.0.0.1:6379/0";
    o.stream = "orders";
    o.group = "email";
    o.log = remember;
    o.log_arg = &seen;
    struct outbox_consumer *c =
        outbox_consumer_new(&o, (outbox_consumer_handler_fn *)1, NULL, err, sizeof(err));
    assert_non_null(c);
    assert_int_equal(seen.calls, 0);
    assert_int_equal(outbox_consumer_err(c), OUTBOX_CONSUMER_ERR_NONE);
    assert_string_equal(outbox_consumer_errstr(c), "");

    outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "cannot connect to Redis: %s",
                          "Connection\nrefused");
    assert_int_equal(seen.calls, 1);
    assert_int_equal(seen.level, OUTBOX_CONSUMER_LOG_ERROR);
    assert_string_equal(seen.message,
                        "cannot connect to Redis: Connection refused; retrying with backoff");
    assert_int_equal(outbox_consumer_err(c), OUTBOX_CONSUMER_ERR_IO);
    assert_string_equal(outbox_consumer_errstr(c), "cannot connect to Redis: Connection\nrefused");

    outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "cannot connect to Redis: %s",
                          "Connection\nrefused");
    assert_int_equal(seen.calls, 2);
    assert_int_equal(seen.level, OUTBOX_CONSUMER_LOG_DEBUG); /* a repeat */

    outbox_report_problem(c, OUTBOX_CONSUMER_ERR_REDIS, "XREADGROUP failed: %s", "NOGROUP");
    assert_int_equal(seen.level, OUTBOX_CONSUMER_LOG_ERROR);
    assert_int_equal(outbox_consumer_err(c), OUTBOX_CONSUMER_ERR_REDIS);
    outbox_consumer_free(c);

    /* Without a hook the library is silent, and still keeps the error. */
    o.log = NULL;
    c = outbox_consumer_new(&o, (outbox_consumer_handler_fn *)1, NULL, err, sizeof(err));
    assert_non_null(c);
    outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s", "timeout");
    assert_int_equal(seen.calls, 3);
    assert_string_equal(outbox_consumer_errstr(c), "Redis connection lost: timeout");
    outbox_consumer_free(c);
}

static void test_parse_good_entry(void **state)
{
    (void)state;
    static const char *const items[] = {"id",         "0b6c3b7e-8f5e-4f7a-9a51-1c2d3e4f5a6b",
                                        "topic",      "orders",
                                        "key",        "k-1",
                                        "payload",    "\x01",
                                        "created_at", "2026-11-30T11:35:14.123456Z",
                                        "outbox_id",  "42",
                                        "h.trace",    "abc",
                                        NULL};
    char buf[1024];
    redisReply *r = resp(buf, build(buf, sizeof(buf), items));
    struct outbox_message m;
    const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
    size_t vlens[OUTBOX_HEADERS_MAX];
    memset(&m, 0, sizeof(m));
    assert_null(outbox_msg_parse(r, &m, names, values, vlens));
    assert_string_equal(m.id, "0b6c3b7e-8f5e-4f7a-9a51-1c2d3e4f5a6b");
    assert_string_equal(m.topic, "orders");
    assert_int_equal(m.key_len, 3);
    assert_int_equal(m.payload_len, 3);
    assert_memory_equal(m.payload, "a\0b", 3);
    assert_true(m.outbox_id == 42);
    assert_int_equal(m.nheaders, 1);
    assert_string_equal(m.header_names[0], "trace");
    assert_string_equal(m.header_values[0], "abc");
    freeReplyObject(r);
}

static void test_parse_rejects_foreign_entries(void **state)
{
    (void)state;
    static const char *const foreign[] = {"foo", "bar", NULL};
    static const char *const no_payload[] = {"id", "x",         "topic", "t", "created_at",
                                             "c",  "outbox_id", "1",     NULL};
    static const char *const bad_outbox_id[] = {
        "id", "x", "topic", "t", "payload", "p", "created_at", "c", "outbox_id", "1x", NULL};
    char buf[512];
    struct outbox_message m;
    const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
    size_t vlens[OUTBOX_HEADERS_MAX];

    redisReply *r = resp(buf, build(buf, sizeof(buf), foreign));
    const char *why = outbox_msg_parse(r, &m, names, values, vlens);
    assert_non_null(why);
    assert_non_null(strstr(why, "\"id\""));
    freeReplyObject(r);

    r = resp(buf, build(buf, sizeof(buf), no_payload));
    assert_non_null(strstr(outbox_msg_parse(r, &m, names, values, vlens), "payload"));
    freeReplyObject(r);

    r = resp(buf, build(buf, sizeof(buf), bad_outbox_id));
    assert_non_null(strstr(outbox_msg_parse(r, &m, names, values, vlens), "not a number"));
    freeReplyObject(r);

    r = resp("$-1\r\n", 5);
    assert_non_null(outbox_msg_parse(r, &m, names, values, vlens));
    freeReplyObject(r);
}

static void test_parse_caps_headers(void **state)
{
    (void)state;
    const char *items[2 * (OUTBOX_HEADERS_MAX + 1) + 11];
    char names_buf[OUTBOX_HEADERS_MAX + 1][16];
    size_t n = 0;
    static const char *const base[] = {"id", "x",          "topic", "t",         "payload",
                                       "p",  "created_at", "c",     "outbox_id", "1"};
    for (size_t i = 0; i < 10; i++)
        items[n++] = base[i];
    for (int i = 0; i <= OUTBOX_HEADERS_MAX; i++) {
        snprintf(names_buf[i], sizeof(names_buf[i]), "h.n%d", i);
        items[n++] = names_buf[i];
        items[n++] = "v";
    }
    items[n] = NULL;
    static char buf[8192];
    redisReply *r = resp(buf, build(buf, sizeof(buf), items));
    struct outbox_message m;
    const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
    size_t vlens[OUTBOX_HEADERS_MAX];
    assert_non_null(strstr(outbox_msg_parse(r, &m, names, values, vlens), "more headers"));
    freeReplyObject(r);
}

static void test_dead_letter_function_acknowledges_after_xadd(void **state)
{
    (void)state;
    const char *src = outbox_functions_consumer_source;
    /* A library of its own: replacing the relay's would drop its publish function. */
    assert_non_null(strstr(src, "#!lua name=" OUTBOX_CONSUMER_FUNCTION_LIBRARY "\n"));
    assert_string_not_equal(OUTBOX_CONSUMER_FUNCTION_LIBRARY, "outbox_relay");
    assert_non_null(
        strstr(src, "redis.register_function('" OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER "'"));
    /* The XADD must not abort the call (pcall), and the XACK runs only after
     * it, behind the return of its error: a function body does not roll back. */
    const char *body = strstr(src, "local function move_to_dead_letters(");
    assert_non_null(body);
    const char *xadd = strstr(body, "redis.pcall('XADD'");
    const char *err = strstr(body, "return added\n");
    const char *xack = strstr(body, "'XACK'");
    assert_non_null(xadd);
    assert_non_null(err);
    assert_non_null(xack);
    assert_true(xadd < err);
    assert_true(err < xack);
    assert_null(strstr(src, "redis.call('XADD'"));
    assert_non_null(strstr(src, "delete or rename it"));
}

static void test_lease_functions_check_the_token_first(void **state)
{
    (void)state;
    const char *src = outbox_functions_consumer_source;
    static const char *const fenced[] = {"local function leased_read(", "local function take(",
                                         "local function leased_ack(",
                                         "local function leased_dead_letter("};
    for (size_t i = 0; i < sizeof(fenced) / sizeof(fenced[0]); i++) {
        const char *body = strstr(src, fenced[i]);
        assert_non_null(body);
        const char *check = strstr(body, "lease_lost(");
        const char *stop = strstr(body, "if lost then return lost end");
        const char *end = strstr(body, "\nend\n");
        /* The check, and the return on its error, come before anything else
         * in the body that calls Redis. */
        assert_non_null(check);
        assert_non_null(stop);
        assert_true(check < stop && stop < end);
        const char *call = strstr(body, "redis.call(");
        assert_true(call == NULL || call > stop);
    }
    assert_non_null(strstr(src, "redis.register_function('" OUTBOX_CONSUMER_FUNCTION_LEASE "'"));
    assert_non_null(strstr(src, "redis.register_function('" OUTBOX_CONSUMER_FUNCTION_RELEASE "'"));
    /* Tokens come from a counter that never expires. */
    assert_non_null(strstr(src, "redis.call('INCR', keys[2])"));

    char lease[64], token[64];
    assert_int_equal(
        outbox_consumer_lease_names("orders:003", "billing", lease, token, sizeof(lease)),
        (int)strlen("{orders:003}:lease:billing"));
    assert_string_equal(lease, "{orders:003}:lease:billing");
    assert_string_equal(token, "{orders:003}:lease-token:billing");
    /* The counter's name does not fit: neither is written. */
    char small_lease[32] = "untouched", small_token[32] = "untouched";
    assert_int_equal(outbox_consumer_lease_names("orders:003", "billing", small_lease, small_token,
                                                 sizeof("{orders:003}:lease-token:billing") - 1),
                     -1);
    assert_string_equal(small_lease, "untouched");
    assert_string_equal(small_token, "untouched");
}

static void test_replay_function_deletes_after_xadd(void **state)
{
    (void)state;
    const char *src = outbox_functions_consumer_source;
    /* In the same library, so loading either tool or consumer loads both. */
    assert_non_null(strstr(src, "redis.register_function('" OUTBOX_CONSUMER_FUNCTION_REPLAY "'"));
    const char *body = strstr(src, "local function replay(");
    assert_non_null(body);
    /* The dead letter is deleted only after the XADD succeeded. */
    const char *xadd = strstr(body, "redis.pcall('XADD'");
    const char *err = xadd != NULL ? strstr(xadd, "return id\n") : NULL;
    const char *xdel = strstr(body, "'XDEL'");
    assert_non_null(xadd);
    assert_non_null(err);
    assert_non_null(xdel);
    assert_true(xadd < err);
    assert_true(err < xdel);
    assert_null(strstr(body, "redis.call('XADD'"));
    assert_non_null(strstr(body, "'dlq.'"));
}

#define RESP(lit) resp(lit, sizeof(lit) - 1)

/* An operator unparks a key by removing it from the set: the key that left
 * is found; members that are not strings (no Redis sends them, a proxy
 * might) are never compared, and park nothing. */
static void test_parked_key_left(void **state)
{
    (void)state;
    redisReply *ab = RESP("*2\r\n$1\r\na\r\n$2\r\nbb\r\n");
    redisReply *b = RESP("*1\r\n$2\r\nbb\r\n");
    redisReply *none = RESP("*0\r\n");
    redisReply *odd = RESP("*3\r\n:5\r\n$-1\r\n$2\r\nbb\r\n");
    redisReply *err = RESP("-ERR no\r\n");

    assert_null(parked_key_left(NULL, ab));
    assert_null(parked_key_left(ab, ab));
    assert_null(parked_key_left(b, ab));
    const redisReply *left = parked_key_left(ab, b);
    assert_non_null(left);
    assert_string_equal(left->str, "a");
    assert_string_equal(parked_key_left(b, none)->str, "bb");
    assert_string_equal(parked_key_left(ab, err)->str, "a");
    /* Odd members before: skipped; odd members now: never match. */
    assert_null(parked_key_left(odd, b));
    assert_string_equal(parked_key_left(ab, odd)->str, "a");
    assert_null(parked_key_left(err, none));

    freeReplyObject(ab);
    freeReplyObject(b);
    freeReplyObject(none);
    freeReplyObject(odd);
    freeReplyObject(err);
}

static void test_redis_time_ms(void **state)
{
    (void)state;
    redisReply *t = RESP("*2\r\n$10\r\n1764720000\r\n$6\r\n123456\r\n");
    assert_int_equal(redis_time_ms(t), 1764720000123LL);
    freeReplyObject(t);
    const char *odd[] = {"*1\r\n$1\r\n1\r\n", "*2\r\n:1\r\n:2\r\n", "*2\r\n$-1\r\n$1\r\n0\r\n",
                         "$4\r\nTIME\r\n", "*2\r\n$2\r\nxy\r\n$1\r\n0\r\n"};
    for (size_t i = 0; i < sizeof(odd) / sizeof(odd[0]); i++) {
        t = resp(odd[i], strlen(odd[i]));
        assert_int_equal(redis_time_ms(t), -1);
        freeReplyObject(t);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_backoff_schedule),
        cmocka_unit_test(test_custom_backoff_schedule),
        cmocka_unit_test(test_stream_names),
        cmocka_unit_test(test_new_validates_options),
        cmocka_unit_test(test_problems_go_to_the_hook_and_the_object),
        cmocka_unit_test(test_parse_good_entry),
        cmocka_unit_test(test_parse_rejects_foreign_entries),
        cmocka_unit_test(test_parse_caps_headers),
        cmocka_unit_test(test_processed_horizon_against_redelivery),
        cmocka_unit_test(test_dead_letter_function_acknowledges_after_xadd),
        cmocka_unit_test(test_replay_function_deletes_after_xadd),
        cmocka_unit_test(test_lease_functions_check_the_token_first),
        cmocka_unit_test(test_parked_key_left),
        cmocka_unit_test(test_redis_time_ms),
    };
    return cmocka_run_group_tests_name("consumer", tests, NULL, NULL);
}
