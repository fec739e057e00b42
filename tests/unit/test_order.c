/* consumer/order.c: which entry in hand an ordered consumer handles next. */
#include "common/compat.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "consumer/order.h"

static struct outbox_order_item item(const char *key, long long retry_at, int done)
{
    struct outbox_order_item it;
    memset(&it, 0, sizeof(it));
    if (key != NULL) {
        it.key = key;
        it.key_len = strlen(key);
        it.has_key = 1;
    }
    it.retry_at = retry_at;
    it.done = done;
    return it;
}

static void test_first_ready_entry_in_order(void **state)
{
    (void)state;
    struct outbox_order_item items[] = {item("a", 0, 0), item("b", 0, 0), item("a", 0, 0)};
    long long wake = 123;
    assert_int_equal(outbox_order_next(items, 3, 100, &wake), 0);
    assert_int_equal(wake, 123); /* untouched when an entry is ready */
    items[0].done = 1;
    assert_int_equal(outbox_order_next(items, 3, 100, NULL), 1);
    items[1].done = 1;
    assert_int_equal(outbox_order_next(items, 3, 100, NULL), 2);
    items[2].done = 1;
    assert_int_equal(outbox_order_next(items, 3, 100, &wake), -1);
    assert_int_equal(wake, -1);
    assert_int_equal(outbox_order_next(items, 0, 100, &wake), -1);
}

static void test_a_retry_holds_back_its_key_only(void **state)
{
    (void)state;
    /* a:1 waits out its backoff until 500: a:2 and a:3 wait behind it, b goes on. */
    struct outbox_order_item items[] = {item("a", 500, 0), item("a", 0, 0), item("b", 0, 0),
                                        item("a", 0, 0), item("c", 0, 0)};
    long long wake = 0;
    assert_int_equal(outbox_order_next(items, 5, 100, &wake), 2);
    items[2].done = 1;
    assert_int_equal(outbox_order_next(items, 5, 100, &wake), 4);
    items[4].done = 1;
    assert_int_equal(outbox_order_next(items, 5, 100, &wake), -1);
    assert_int_equal(wake, 500);
    /* Its backoff over, a:1 comes first, then a:2, never a:3 before a:2. */
    assert_int_equal(outbox_order_next(items, 5, 500, &wake), 0);
    items[0].done = 1;
    assert_int_equal(outbox_order_next(items, 5, 500, &wake), 1);
    items[1].retry_at = 900; /* a:2 failed in turn */
    assert_int_equal(outbox_order_next(items, 5, 600, &wake), -1);
    assert_int_equal(wake, 900);
}

static void test_keys_are_compared_by_bytes(void **state)
{
    (void)state;
    /* "a\0x" and "a\0y" differ after the NUL; "a" and "ab" differ in length. */
    struct outbox_order_item items[] = {item("a", 800, 0), item("ab", 0, 0), item(NULL, 0, 0),
                                        item(NULL, 0, 0)};
    items[0].key = "a\0x";
    items[0].key_len = 3;
    items[1].key = "a\0y";
    items[1].key_len = 3;
    assert_int_equal(outbox_order_next(items, 4, 0, NULL), 1);
    items[1].done = 1;
    /* Entries without a key wait for nothing and hold back nothing. */
    items[2].retry_at = 700;
    long long wake;
    assert_int_equal(outbox_order_next(items, 4, 0, &wake), 3);
    items[3].done = 1;
    assert_int_equal(outbox_order_next(items, 4, 0, &wake), -1);
    assert_int_equal(wake, 700);
}

static void test_partitions_go_round_robin(void **state)
{
    (void)state;
    /* 8 partitions over 3 members: 3, 3 and 2, each exactly once. */
    unsigned counts[3] = {0, 0, 0};
    for (uint32_t p = 0; p < 8; p++) {
        int owners = 0;
        for (uint32_t r = 0; r < 3; r++)
            if (outbox_order_mine(p, r, 3)) {
                owners++;
                counts[r]++;
            }
        assert_int_equal(owners, 1);
    }
    assert_int_equal(counts[0], 3);
    assert_int_equal(counts[1], 3);
    assert_int_equal(counts[2], 2);
    assert_false(outbox_order_mine(0, 0, 0));
    assert_true(outbox_order_mine(5, 0, 1));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_ready_entry_in_order),
        cmocka_unit_test(test_a_retry_holds_back_its_key_only),
        cmocka_unit_test(test_keys_are_compared_by_bytes),
        cmocka_unit_test(test_partitions_go_round_robin),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
