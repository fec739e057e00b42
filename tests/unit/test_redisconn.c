/*
 * Unit tests for the pure part of common/redisconn.c: reading a CLUSTER SLOTS
 * reply, which the relay's sink and the blocking helpers share. The replies
 * are RESP bytes as redis-server 7.0 sends them, parsed by hiredis's reader.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <hiredis/hiredis.h>
#include <stdlib.h>
#include <string.h>

#include "common/keys.h"
#include "common/redisconn.h"
#include "common/url.h"

static redisReply *parse(const char *resp)
{
    redisReader *reader = redisReaderCreate();
    assert_non_null(reader);
    assert_int_equal(redisReaderFeed(reader, resp, strlen(resp)), REDIS_OK);
    void *reply = NULL;
    assert_int_equal(redisReaderGetReply(reader, &reply), REDIS_OK);
    assert_non_null(reply);
    redisReaderFree(reader);
    return reply;
}

/* One range's entry: first and last slot, then the primary (host, port, id). */
#define RANGE(lo, hi, host, port)                                                                  \
    "*3\r\n:" #lo "\r\n:" #hi "\r\n*3\r\n$" host "\r\n:" #port "\r\n$2\r\nid\r\n"

static void test_three_primaries(void **state)
{
    (void)state;
    /* Two ranges of one primary, and a host left empty ("the node asked"). */
    redisReply *r = parse(
        "*4\r\n" RANGE(0, 5460, "9\r\n127.0.0.1", 7000) RANGE(5461, 10922, "9\r\n127.0.0.1", 7001)
            RANGE(10923, 16000, "0\r\n", 7002) RANGE(16001, 16383, "9\r\n127.0.0.1", 7000));
    struct outbox_addr primaries[4];
    uint8_t *map = malloc(OUTBOX_CLUSTER_SLOTS);
    assert_non_null(map);
    assert_int_equal(outbox_cluster_slots_parse(r, "10.0.0.9", primaries, 4, map), 3);
    assert_string_equal(primaries[0].host, "127.0.0.1");
    assert_int_equal(primaries[0].port, 7000);
    assert_int_equal(primaries[1].port, 7001);
    assert_string_equal(primaries[2].host, "10.0.0.9");
    assert_int_equal(primaries[2].port, 7002);
    assert_int_equal(map[0], 0);
    assert_int_equal(map[5461], 1);
    assert_int_equal(map[16000], 2);
    assert_int_equal(map[16383], 0);
    assert_int_equal(map[outbox_key_slot("foo", 3)], 2); /* 12182 */
    /* Too many primaries for the caller's array. */
    assert_int_equal(outbox_cluster_slots_parse(r, "h", primaries, 2, NULL), -1);
    freeReplyObject(r);

    /* A gap: the slots no range covers are marked. */
    r = parse("*1\r\n" RANGE(0, 100, "1\r\na", 1));
    assert_int_equal(outbox_cluster_slots_parse(r, "h", primaries, 4, map), 1);
    assert_int_equal(map[100], 0);
    assert_int_equal(map[101], OUTBOX_SLOT_UNCOVERED);
    freeReplyObject(r);
    free(map);
}

/* A server without cluster support answers with an error: not a slot map. */
static void test_not_a_cluster(void **state)
{
    (void)state;
    struct outbox_addr primaries[1];
    redisReply *r = parse("-ERR This instance has cluster support disabled\r\n");
    assert_int_equal(outbox_cluster_slots_parse(r, "h", primaries, 1, NULL), -2);
    freeReplyObject(r);
    assert_int_equal(outbox_cluster_slots_parse(NULL, "h", primaries, 1, NULL), -2);
    /* Malformed ranges are skipped. */
    r = parse("*2\r\n*1\r\n:5\r\n" RANGE(0, 16383, "1\r\nb", 2));
    assert_int_equal(outbox_cluster_slots_parse(r, "h", primaries, 1, NULL), 1);
    assert_int_equal(primaries[0].port, 2);
    freeReplyObject(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_three_primaries),
        cmocka_unit_test(test_not_a_cluster),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
