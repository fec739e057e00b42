/* Unit tests of common/backoff.c: growth, cap, jitter range and reset. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/backoff.h"

static void test_first_delay_within_min(void **state)
{
    (void)state;
    struct outbox_backoff b;
    outbox_backoff_init(&b, 100, 30000);
    uint32_t lo = outbox_backoff_next(&b, 0);
    outbox_backoff_reset(&b);
    uint32_t hi = outbox_backoff_next(&b, UINT32_MAX - 1);
    assert_in_range(lo, 50, 100);
    assert_in_range(hi, 50, 100);
    assert_int_equal(lo, 50);
}

static void test_ceiling_doubles_then_caps(void **state)
{
    (void)state;
    struct outbox_backoff b;
    outbox_backoff_init(&b, 100, 1000);
    uint32_t expect_ceiling[] = {100, 200, 400, 800, 1000, 1000, 1000};
    for (size_t i = 0; i < sizeof(expect_ceiling) / sizeof(expect_ceiling[0]); i++) {
        /* rnd = 0 gives the lower bound: half the ceiling. */
        uint32_t d = outbox_backoff_next(&b, 0);
        assert_int_equal(d, expect_ceiling[i] / 2);
    }
}

static void test_jitter_spans_upper_half(void **state)
{
    (void)state;
    struct outbox_backoff b;
    uint32_t min = UINT32_MAX, max = 0;
    for (uint32_t rnd = 0; rnd < 5000; rnd += 7) {
        outbox_backoff_init(&b, 1000, 1000);
        uint32_t d = outbox_backoff_next(&b, rnd);
        if (d < min)
            min = d;
        if (d > max)
            max = d;
    }
    assert_int_equal(min, 500);
    assert_int_equal(max, 1000);
}

static void test_never_exceeds_max_after_many_failures(void **state)
{
    (void)state;
    struct outbox_backoff b;
    outbox_backoff_init(&b, 10, 30000);
    for (int i = 0; i < 10000; i++)
        assert_true(outbox_backoff_next(&b, (uint32_t)i * 2654435761u) <= 30000);
    outbox_backoff_reset(&b);
    assert_true(outbox_backoff_next(&b, 12345) <= 10);
}

static void test_degenerate_bounds(void **state)
{
    (void)state;
    struct outbox_backoff b;
    outbox_backoff_init(&b, 0, 0);
    assert_int_equal(b.min_ms, 1);
    assert_int_equal(b.max_ms, 1);
    assert_true(outbox_backoff_next(&b, 99) <= 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_delay_within_min),
        cmocka_unit_test(test_ceiling_doubles_then_caps),
        cmocka_unit_test(test_jitter_spans_upper_half),
        cmocka_unit_test(test_never_exceeds_max_after_many_failures),
        cmocka_unit_test(test_degenerate_bounds),
    };
    return cmocka_run_group_tests_name("backoff", tests, NULL, NULL);
}
