/* Unit tests of common/buf.c: growth, the cap, the sticky failure, reuse. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "common/buf.h"

static void test_append_and_printf_grow(void **state)
{
    (void)state;
    struct outbox_buf b = {0};
    outbox_buf_puts(&b, "abc");
    outbox_buf_append(&b, "\0x", 2); /* binary-safe */
    assert_int_equal(b.len, 5);
    assert_memory_equal(b.data, "abc\0x", 6); /* and NUL-terminated */
    /* Past the first allocation: printf grows the buffer and retries. */
    char big[10000];
    memset(big, 'y', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    outbox_buf_printf(&b, "[%s]%d", big, 42);
    assert_false(b.failed);
    assert_int_equal(b.len, 5 + 1 + 9999 + 1 + 2);
    assert_string_equal(b.data + b.len - 3, "]42");
    assert_true(b.cap > b.len);
    outbox_buf_free(&b);
    assert_null(b.data);
    assert_int_equal(b.len, 0);
    outbox_buf_free(NULL);
}

static void test_max_counts_the_nul_and_failure_sticks(void **state)
{
    (void)state;
    struct outbox_buf b = {.max = 8};
    outbox_buf_puts(&b, "1234567"); /* 7 + NUL = 8: fits exactly */
    assert_false(b.failed);
    assert_true(b.cap <= 8);
    outbox_buf_puts(&b, "8"); /* would need 9 */
    assert_true(b.failed);
    assert_string_equal(b.data, "1234567"); /* nothing of it appended */
    outbox_buf_puts(&b, "");                /* sticks, even for what would fit */
    outbox_buf_printf(&b, "%s", "");
    assert_true(b.failed);
    assert_int_equal(b.len, 7);

    /* reserve reports, and leaves failed to the caller. */
    outbox_buf_reset(&b);
    assert_false(b.failed);
    assert_string_equal(b.data, "");
    assert_int_equal(outbox_buf_reserve(&b, 7), 0);
    assert_int_equal(outbox_buf_reserve(&b, 8), OUTBOX_BUF_FULL);
    assert_int_equal(outbox_buf_reserve(&b, SIZE_MAX), OUTBOX_BUF_FULL);
    assert_false(b.failed);

    /* printf past the cap: nothing kept, the text stays terminated. */
    outbox_buf_puts(&b, "ab");
    outbox_buf_printf(&b, "%s", "cdefghij");
    assert_true(b.failed);
    assert_int_equal(b.len, 2);
    assert_string_equal(b.data, "ab");
    outbox_buf_free(&b);
    assert_int_equal(b.max, 8);
}

static void test_reset_reuses_the_memory(void **state)
{
    (void)state;
    struct outbox_buf b = {0};
    outbox_buf_printf(&b, "%0500d", 7);
    char *data = b.data;
    size_t cap = b.cap;
    for (int i = 0; i < 100; i++) {
        outbox_buf_reset(&b);
        outbox_buf_printf(&b, "%0500d", i);
    }
    assert_ptr_equal(b.data, data);
    assert_int_equal(b.cap, cap);
    outbox_buf_free(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_append_and_printf_grow),
        cmocka_unit_test(test_max_counts_the_nul_and_failure_sticks),
        cmocka_unit_test(test_reset_reuses_the_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
