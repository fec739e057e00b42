/* The Redis function libraries of functions/, as embedded in common/: each
 * is the library its callers name, and registers exactly the functions they
 * call, under the names the C code spells (relay/batch.h for the relay's,
 * common/functions.h and include/outbox/consumer.h for the consumers'; this
 * file includes both of the last two, so the compiler checks they agree). */
#include "common/compat.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "common/functions.h"
#include "outbox/consumer.h"
#include "relay/batch.h"

#define REGISTER "redis.register_function('"

/* Checks that src registers the functions of names[0..n) and no other. */
static void assert_registers(const char *src, const char *const *names, size_t n)
{
    size_t registered = 0;
    for (const char *p = strstr(src, REGISTER); p != NULL; p = strstr(p + 1, REGISTER)) {
        const char *name = p + strlen(REGISTER);
        const char *end = strchr(name, '\'');
        assert_non_null(end);
        int known = 0;
        for (size_t i = 0; i < n && !known; i++)
            known = strlen(names[i]) == (size_t)(end - name) &&
                    memcmp(names[i], name, (size_t)(end - name)) == 0;
        if (!known)
            fail_msg("a function the C code does not name: %.*s", (int)(end - name), name);
        registered++;
    }
    for (size_t i = 0; i < n; i++) {
        char call[128];
        snprintf(call, sizeof(call), REGISTER "%s'", names[i]);
        if (strstr(src, call) == NULL)
            fail_msg("not registered: %s", names[i]);
    }
    assert_int_equal(registered, n);
}

static void test_relay_library(void **state)
{
    (void)state;
    static const char *const names[] = {RELAY_FUNCTION_TRIM};
    const char *src = outbox_functions_relay_source;
    /* FUNCTION LOAD reads the library's name from the first line. */
    assert_int_equal(strncmp(src, "#!lua name=" RELAY_FUNCTION_LIBRARY "\n",
                             strlen("#!lua name=" RELAY_FUNCTION_LIBRARY "\n")),
                     0);
    assert_registers(src, names, sizeof(names) / sizeof(names[0]));
}

static void test_consumer_library(void **state)
{
    (void)state;
    static const char *const names[] = {
        OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER, OUTBOX_CONSUMER_FUNCTION_REPLAY,
        OUTBOX_CONSUMER_FUNCTION_LEASE,       OUTBOX_CONSUMER_FUNCTION_RELEASE,
        OUTBOX_CONSUMER_FUNCTION_READ,        OUTBOX_CONSUMER_FUNCTION_TAKE,
        OUTBOX_CONSUMER_FUNCTION_ACK,         OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER_LEASED,
    };
    const char *src = outbox_functions_consumer_source;
    assert_int_equal(strncmp(src, "#!lua name=" OUTBOX_CONSUMER_FUNCTION_LIBRARY "\n",
                             strlen("#!lua name=" OUTBOX_CONSUMER_FUNCTION_LIBRARY "\n")),
                     0);
    /* Two libraries: loading one never replaces the other. */
    assert_string_not_equal(OUTBOX_CONSUMER_FUNCTION_LIBRARY, RELAY_FUNCTION_LIBRARY);
    assert_registers(src, names, sizeof(names) / sizeof(names[0]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_relay_library),
        cmocka_unit_test(test_consumer_library),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
