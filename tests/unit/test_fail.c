/*
 * Unit tests of relay/fail.c: the labels of outbox_relay_publish_errors_total.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "relay/fail.h"

static void test_fail_kind_names(void **state)
{
    (void)state;
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_REDIS_CONNECTION), "redis_connection");
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_REDIS_TIMEOUT), "redis_timeout");
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_REDIS_ERROR), "redis_error");
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_REDIS_REPLY), "redis_reply");
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_REDIS_REPLICAS), "redis_replicas");
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_POSTGRES), "postgres");
    /* A kind out of range is never read past the table. */
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_KINDS), "postgres");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fail_kind_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
