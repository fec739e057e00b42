/* Unit tests of core/text.c: the form in which the tools show bytes that
 * may be anything. */
#include "common/compat.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/text.h"

/* The form of s (len bytes) with no limit. */
static const char *shown(const char *s, size_t len, unsigned flags)
{
    static char buf[1024];
    size_t cols = relay_text_escape(buf, sizeof(buf), s, len, 0, flags);
    (void)cols;
    return buf;
}

#define SHOWN(lit) shown(lit, sizeof(lit) - 1, 0)

static void test_printable_text_is_unchanged(void **state)
{
    (void)state;
    assert_string_equal(SHOWN("orders.email-2_x"), "orders.email-2_x");
    assert_string_equal(SHOWN("say \"hi\" ~{}"), "say \"hi\" ~{}");
    assert_string_equal(SHOWN(""), "");
}

static void test_terminal_sequences_are_escaped(void **state)
{
    (void)state;
    /* OSC 0 retitles the terminal, CSI 2 J clears it. */
    assert_string_equal(SHOWN("a\x1b]0;pwned\x07z"), "a\\x1b]0;pwned\\x07z");
    assert_string_equal(SHOWN("\x1b[2J"), "\\x1b[2J");
    assert_string_equal(SHOWN("one\ntwo\r\tthree"), "one\\x0atwo\\x0d\\x09three");
    assert_string_equal(SHOWN("del\x7f"), "del\\x7f");
    assert_string_equal(SHOWN("\x01\x1f"), "\\x01\\x1f");
}

static void test_nul_bytes_are_shown(void **state)
{
    (void)state;
    assert_string_equal(shown("a\0b", 3, 0), "a\\x00b");
}

static void test_backslash_and_quote(void **state)
{
    (void)state;
    /* A shown \x41 must not be confused with the byte 'A'. */
    assert_string_equal(SHOWN("\\x41"), "\\\\x41");
    assert_string_equal(SHOWN("\"q\""), "\"q\"");
    assert_string_equal(shown("\"q\\\"", 4, RELAY_ESCAPE_QUOTE), "\\\"q\\\\\\\"");
}

static void test_valid_utf8_is_shown_as_it_is(void **state)
{
    (void)state;
    assert_string_equal(SHOWN("caf\xc3\xa9"), "caf\xc3\xa9");
    assert_string_equal(SHOWN("\xe2\x82\xac 5"), "\xe2\x82\xac 5");     /* U+20AC */
    assert_string_equal(SHOWN("\xf0\x9f\x98\x80"), "\xf0\x9f\x98\x80"); /* U+1F600 */
    assert_string_equal(SHOWN("\xc2\xa0nbsp"), "\xc2\xa0nbsp");         /* U+00A0 */
    assert_string_equal(SHOWN("\xef\xbf\xbd"), "\xef\xbf\xbd");         /* U+FFFD */
}

static void test_c1_controls_and_overrides_are_escaped(void **state)
{
    (void)state;
    /* U+009B is the 8-bit CSI ("CSI m" resets the colours); U+0085 a next-line. */
    assert_string_equal(SHOWN("\xc2\x9bm"), "\\xc2\\x9bm");
    assert_string_equal(SHOWN("\xc2\x85"), "\\xc2\\x85");
    assert_string_equal(SHOWN("\xc2\x80\xc2\x9f"), "\\xc2\\x80\\xc2\\x9f");
    /* U+202E RIGHT-TO-LEFT OVERRIDE, U+2066 LEFT-TO-RIGHT ISOLATE. */
    assert_string_equal(SHOWN("a\xe2\x80\xaez"), "a\\xe2\\x80\\xaez");
    assert_string_equal(SHOWN("\xe2\x81\xa6"), "\\xe2\\x81\\xa6");
    /* Their neighbours are ordinary characters. */
    assert_string_equal(SHOWN("\xe2\x80\xa9\xe2\x81\xaa"), "\xe2\x80\xa9\xe2\x81\xaa");
}

static void test_bytes_that_are_not_utf8_are_escaped(void **state)
{
    (void)state;
    /* Raw bytes 0x80..0x9f act as C1 controls on 8-bit terminals. */
    assert_string_equal(SHOWN("\x9bm"), "\\x9bm");
    assert_string_equal(SHOWN("bad\xff\xfe"), "bad\\xff\\xfe");
    assert_string_equal(SHOWN("\xc3"), "\\xc3");                            /* cut short */
    assert_string_equal(SHOWN("\xc3Z"), "\\xc3Z");                          /* no continuation */
    assert_string_equal(SHOWN("\xc0\xaf"), "\\xc0\\xaf");                   /* overlong '/' */
    assert_string_equal(SHOWN("\xe0\x80\xaf"), "\\xe0\\x80\\xaf");          /* overlong */
    assert_string_equal(SHOWN("\xed\xa0\x80"), "\\xed\\xa0\\x80");          /* surrogate */
    assert_string_equal(SHOWN("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80"); /* > U+10FFFF */
    assert_string_equal(SHOWN("\xf8\x88\x80\x80\x80"), "\\xf8\\x88\\x80\\x80\\x80");
}

static void test_utf8_char(void **state)
{
    (void)state;
    unsigned long cp = 0;
    assert_int_equal(relay_text_utf8_char("A", 1, &cp), 1);
    assert_int_equal(cp, 0x41);
    assert_int_equal(relay_text_utf8_char("\xc3\xa9", 2, &cp), 2);
    assert_int_equal(cp, 0xe9);
    assert_int_equal(relay_text_utf8_char("\xe2\x82\xac", 3, &cp), 3);
    assert_int_equal(cp, 0x20ac);
    assert_int_equal(relay_text_utf8_char("\xf4\x8f\xbf\xbf", 4, &cp), 4);
    assert_int_equal(cp, 0x10ffff);
    assert_int_equal(relay_text_utf8_char("\xe2\x82\xac", 2, &cp), 0); /* cut short */
    assert_int_equal(relay_text_utf8_char("\x80", 1, &cp), 0);
    assert_int_equal(relay_text_utf8_char("", 0, NULL), 0);
    assert_true(relay_text_control_char(0x1b));
    assert_true(relay_text_control_char(0x7f));
    assert_true(relay_text_control_char(0x9b));
    assert_true(relay_text_control_char(0x202e));
    assert_false(relay_text_control_char(' '));
    assert_false(relay_text_control_char(0xa0));
    assert_false(relay_text_control_char(0x20ac));
}

static void test_columns(void **state)
{
    (void)state;
    char buf[64];
    assert_int_equal(relay_text_escape(buf, sizeof(buf), "ab", 2, 0, 0), 2);
    assert_int_equal(relay_text_escape(buf, sizeof(buf), "\xc3\xa9", 2, 0, 0), 1);
    assert_int_equal(relay_text_escape(buf, sizeof(buf), "\\", 1, 0, 0), 2);
    assert_int_equal(relay_text_escape(buf, sizeof(buf), "\x1b", 1, 0, 0), 4);
}

static void test_maxcols_cuts_between_characters(void **state)
{
    (void)state;
    char buf[64];
    /* Fits exactly: no cut. */
    assert_int_equal(relay_text_escape(buf, sizeof(buf), "abcdef", 6, 6, 0), 6);
    assert_string_equal(buf, "abcdef");
    /* One more: cut to 3 and "...", within 6. */
    assert_int_equal(relay_text_escape(buf, sizeof(buf), "abcdefg", 7, 6, 0), 6);
    assert_string_equal(buf, "abc...");
    /* An escape that would cross the limit is left out whole. */
    assert_int_equal(relay_text_escape(buf, sizeof(buf), "ab\x1bzzzzzz", 9, 8, 0), 5);
    assert_string_equal(buf, "ab...");
    /* So is a UTF-8 character: never half of one. */
    assert_int_equal(
        relay_text_escape(buf, sizeof(buf), "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9z", 9, 4, 0), 4);
    assert_string_equal(buf, "\xc3\xa9...");
}

static void test_small_buffer_cuts_and_terminates(void **state)
{
    (void)state;
    char buf[8];
    /* Shown, "\x1b\x1b" is 8 bytes and 7 fit: one escape and "..." do. */
    relay_text_escape(buf, sizeof(buf), "\x1b\x1b", 2, 0, 0);
    assert_string_equal(buf, "\\x1b...");
    relay_text_escape(buf, sizeof(buf), "abcdefgh", 8, 0, 0);
    assert_string_equal(buf, "abcd...");
    relay_text_escape(buf, sizeof(buf), "abcdefg", 7, 0, 0);
    assert_string_equal(buf, "abcdefg");
    char tiny[3] = "zz";
    relay_text_escape(tiny, sizeof(tiny), "abcdef", 6, 0, 0);
    assert_string_equal(tiny, "");
    char one[1] = "z";
    relay_text_escape(one, sizeof(one), "abc", 3, 0, 0);
    assert_string_equal(one, "");
    assert_int_equal(relay_text_escape(NULL, 0, "abc", 3, 0, 0), 0);
}

static void test_worst_case_size_holds_everything(void **state)
{
    (void)state;
    char in[256], out[RELAY_ESCAPED_SIZE(256)];
    for (int i = 0; i < 256; i++)
        in[i] = (char)i;
    size_t cols = relay_text_escape(out, sizeof(out), in, sizeof(in), 0, 0);
    assert_int_equal(strlen(out), cols); /* one byte per column: all ASCII */
    assert_null(strstr(out, "..."));
    for (const char *p = out; *p; p++)
        assert_true(*p >= 0x20 && *p < 0x7f);
}

/* Every byte sequence's form is printable ASCII or UTF-8 with no control. */
static void test_no_control_ever_survives(void **state)
{
    (void)state;
    unsigned seed = 12345;
    char in[64], out[RELAY_ESCAPED_SIZE(64)];
    for (int round = 0; round < 20000; round++) {
        size_t len = (size_t)(round % 64);
        for (size_t i = 0; i < len; i++) {
            seed = seed * 1103515245u + 12345u;
            unsigned b = (seed >> 16) & 0xff;
            /* Favour the interesting bytes. */
            in[i] = (char)(b % 3 == 0 ? 0x80 + b % 0x40 : b % 3 == 1 ? 0xc0 + b % 0x38 : b);
        }
        relay_text_escape(out, sizeof(out), in, len, round % 7 == 0 ? 10 : 0, 0);
        size_t n = strlen(out);
        for (size_t i = 0; i < n;) {
            unsigned long cp;
            size_t k = relay_text_utf8_char(out + i, n - i, &cp);
            assert_true(k > 0);
            assert_false(relay_text_control_char(cp));
            i += k;
        }
    }
}

static void test_put_escaped_matches_escape(void **state)
{
    (void)state;
    const char in[] = "caf\xc3\xa9\x1b[2J\\\"\xff and a long tail of text";
    char want[256], got[256];
    memset(got, 0, sizeof(got));
    for (size_t maxcols = 0; maxcols < 40; maxcols += maxcols == 0 ? 3 : 1) {
        size_t c1 =
            relay_text_escape(want, sizeof(want), in, sizeof(in) - 1, maxcols, RELAY_ESCAPE_QUOTE);
        FILE *f = fmemopen(got, sizeof(got), "w");
        assert_non_null(f);
        size_t c2 = relay_text_put_escaped(f, in, sizeof(in) - 1, maxcols, RELAY_ESCAPE_QUOTE);
        fclose(f);
        assert_string_equal(got, want);
        assert_int_equal(c1, c2);
    }
}

static void test_put_column_pads(void **state)
{
    (void)state;
    char got[64];
    memset(got, 0, sizeof(got));
    FILE *f = fmemopen(got, sizeof(got), "w");
    assert_non_null(f);
    relay_text_put_column(f, "\xc3\xa9\x07", 3, 8, 0);
    relay_text_put_column(f, "toolongforit", 12, 4, 8);
    relay_text_put_column(f, "x", 1, 0, 0);
    fclose(f);
    assert_string_equal(got, "\xc3\xa9\\x07    toolo... x ");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_printable_text_is_unchanged),
        cmocka_unit_test(test_terminal_sequences_are_escaped),
        cmocka_unit_test(test_nul_bytes_are_shown),
        cmocka_unit_test(test_backslash_and_quote),
        cmocka_unit_test(test_valid_utf8_is_shown_as_it_is),
        cmocka_unit_test(test_c1_controls_and_overrides_are_escaped),
        cmocka_unit_test(test_bytes_that_are_not_utf8_are_escaped),
        cmocka_unit_test(test_utf8_char),
        cmocka_unit_test(test_columns),
        cmocka_unit_test(test_maxcols_cuts_between_characters),
        cmocka_unit_test(test_small_buffer_cuts_and_terminates),
        cmocka_unit_test(test_worst_case_size_holds_everything),
        cmocka_unit_test(test_no_control_ever_survives),
        cmocka_unit_test(test_put_escaped_matches_escape),
        cmocka_unit_test(test_put_column_pads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
