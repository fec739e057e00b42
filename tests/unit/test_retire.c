/* Unit tests of relay/retire.c: order, due times that never go back, the
 * byte count, and the milliseconds left until a removal is due. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "relay/retire.h"

static void test_first_in_first_out(void **state)
{
    (void)state;
    struct relay_retire_queue q;
    memset(&q, 0, sizeof(q));
    assert_null(relay_retire_head(&q));
    relay_retire_pop(&q); /* popping nothing is harmless */

    assert_int_equal(relay_retire_push(&q, 10.0, "one", 3), 0);
    assert_int_equal(relay_retire_push(&q, 11.0, "second", 6), 0);
    assert_int_equal(relay_retire_push(&q, 12.5, "3", 1), 0);
    assert_int_equal(q.items, 3);
    assert_int_equal(q.bytes, 10);

    const struct relay_retire_item *it = relay_retire_head(&q);
    assert_non_null(it);
    assert_int_equal(it->len, 3);
    assert_memory_equal(it->cmd, "one", 3);
    assert_true(it->due == 10.0);
    relay_retire_pop(&q);
    it = relay_retire_head(&q);
    assert_memory_equal(it->cmd, "second", 6);
    assert_int_equal(q.bytes, 7);
    relay_retire_pop(&q);
    relay_retire_pop(&q);
    assert_null(relay_retire_head(&q));
    assert_int_equal(q.items, 0);
    assert_int_equal(q.bytes, 0);

    /* Empty again: the tail was reset, and a push starts a new list. */
    assert_int_equal(relay_retire_push(&q, 20.0, "again", 5), 0);
    assert_memory_equal(relay_retire_head(&q)->cmd, "again", 5);
    relay_retire_clear(&q);
    assert_null(relay_retire_head(&q));
    assert_int_equal(q.bytes, 0);
}

/* A removal added after another is never due before it, even when
 * publish_timeout was shortened in between: the head stays the first due. */
static void test_due_never_goes_back(void **state)
{
    (void)state;
    struct relay_retire_queue q;
    memset(&q, 0, sizeof(q));
    assert_int_equal(relay_retire_push(&q, 100.0, "a", 1), 0);
    assert_int_equal(relay_retire_push(&q, 97.0, "b", 1), 0);
    assert_int_equal(relay_retire_push(&q, 101.0, "c", 1), 0);
    relay_retire_pop(&q);
    assert_true(relay_retire_head(&q)->due == 100.0);
    relay_retire_pop(&q);
    assert_true(relay_retire_head(&q)->due == 101.0);
    relay_retire_clear(&q);
}

/* Enough to fill several chunks, with one command larger than a chunk in
 * the middle: every command comes back whole, in order, and the queue can be
 * used again after it emptied. */
static void test_many_commands_across_chunks(void **state)
{
    (void)state;
    struct relay_retire_queue q;
    memset(&q, 0, sizeof(q));
    static char big[3 << 20];
    for (size_t i = 0; i < sizeof(big); i++)
        big[i] = (char)('a' + i % 26);
    char cmd[200];
    size_t total = 0;
    for (int round = 0; round < 2; round++) {
        for (unsigned i = 0; i < 40000; i++) {
            size_t len = 1 + (i * 7919u) % sizeof(cmd);
            memset(cmd, (int)(i % 251), len);
            assert_int_equal(relay_retire_push(&q, (double)i, cmd, len), 0);
            total += len;
            if (i == 20000) {
                assert_int_equal(relay_retire_push(&q, (double)i, big, sizeof(big)), 0);
                total += sizeof(big);
            }
        }
        assert_int_equal(q.bytes, total);
        for (unsigned i = 0; i < 40000; i++) {
            const struct relay_retire_item *it = relay_retire_head(&q);
            assert_non_null(it);
            size_t len = 1 + (i * 7919u) % sizeof(cmd);
            assert_int_equal(it->len, len);
            assert_true(it->due == (double)i);
            memset(cmd, (int)(i % 251), len);
            assert_memory_equal(it->cmd, cmd, len);
            relay_retire_pop(&q);
            if (i == 20000) {
                it = relay_retire_head(&q);
                assert_int_equal(it->len, sizeof(big));
                assert_memory_equal(it->cmd, big, sizeof(big));
                relay_retire_pop(&q);
            }
        }
        assert_null(relay_retire_head(&q));
        assert_int_equal(q.bytes, 0);
        assert_int_equal(q.items, 0);
        total = 0;
    }
    relay_retire_clear(&q);
    assert_null(relay_retire_head(&q));
}

/* A queue that emptied keeps its last chunk for the next push. A command too
 * large for that chunk, pushed next, must still be the head: the queue is
 * read where it was written, and an emptied chunk never blocks what follows. */
static void test_large_command_into_an_emptied_queue(void **state)
{
    (void)state;
    struct relay_retire_queue q;
    memset(&q, 0, sizeof(q));
    static char big[(1 << 20) - 8];
    memset(big, 'u', sizeof(big));
    for (int round = 0; round < 3; round++) {
        assert_int_equal(relay_retire_push(&q, 1.0, "small", 5), 0);
        relay_retire_pop(&q);
        assert_null(relay_retire_head(&q));
        assert_int_equal(relay_retire_push(&q, 2.0, big, sizeof(big)), 0);
        assert_int_equal(relay_retire_push(&q, 3.0, "after", 5), 0);
        assert_int_equal(q.items, 2);
        const struct relay_retire_item *it = relay_retire_head(&q);
        assert_non_null(it);
        assert_int_equal(it->len, sizeof(big));
        assert_memory_equal(it->cmd, big, sizeof(big));
        relay_retire_pop(&q);
        it = relay_retire_head(&q);
        assert_non_null(it);
        assert_memory_equal(it->cmd, "after", 5);
        relay_retire_pop(&q);
        assert_null(relay_retire_head(&q));
        assert_int_equal(q.items, 0);
        assert_int_equal(q.bytes, 0);
    }
    relay_retire_clear(&q);
}

static void test_ms_left_rounds_up(void **state)
{
    (void)state;
    assert_int_equal(relay_retire_ms_left(10.0, 5.0), 5000);
    assert_int_equal(relay_retire_ms_left(10.0, 9.9995), 1);
    assert_int_equal(relay_retire_ms_left(10.0, 9.9981), 2);
    assert_int_equal(relay_retire_ms_left(10.0025, 10.0), 3);
    /* Due already, or now: at least 1 ms, never 0 (which PEXPIRE takes as
     * "now") nor a wrapped value. */
    assert_int_equal(relay_retire_ms_left(10.0, 10.0), 1);
    assert_int_equal(relay_retire_ms_left(10.0, 50.0), 1);
    assert_int_equal(relay_retire_ms_left(1e12, 0.0), 4000000000u);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_in_first_out),
        cmocka_unit_test(test_due_never_goes_back),
        cmocka_unit_test(test_many_commands_across_chunks),
        cmocka_unit_test(test_large_command_into_an_emptied_queue),
        cmocka_unit_test(test_ms_left_rounds_up),
    };
    return cmocka_run_group_tests_name("retire", tests, NULL, NULL);
}
