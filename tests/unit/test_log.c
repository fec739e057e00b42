/*
 * Unit tests of relay/log.c's JSON lines (log_format = json): the object's
 * members, the key=value pairs taken from the message, and escaping of
 * hostile text (quotes, backslashes, control bytes, bytes that are not UTF-8,
 * text far over the caps). Every line is checked by a small JSON reader of
 * its own, which also decodes the strings to compare them with the input.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "relay/log.h"

struct log_pair {
    const char *key, *value;
    size_t keylen, valuelen;
};

size_t log_utf8_len(const unsigned char *s, size_t n);
size_t log_find_pairs(const char *text, struct log_pair *pairs, size_t max);
size_t log_format_json(char *out, size_t outlen, const char *stamp, const char *level,
                       const char *component, const char *text);

#define STAMP "2026-11-30T11:35:14.123Z"
/* Larger than any line log_format_json writes (relay/log.c, LOG_JSON_MAX). */
#define LINE_MAX_BYTES 32768

static char line[LINE_MAX_BYTES * 2];

/* ---- a JSON reader for objects of strings -------------------------------- */

/* Decodes the JSON string at *p (at its opening quote) into out (may be NULL);
 * advances *p past it. -1 when it is not a valid JSON string of valid UTF-8
 * without raw control characters. */
static int read_string(const char **p, char *out, size_t outlen, size_t *outn)
{
    const unsigned char *s = (const unsigned char *)*p;
    size_t n = 0;
    if (*s++ != '"')
        return -1;
    for (;;) {
        unsigned char c = *s;
        char buf[4];
        size_t blen = 0;
        if (c == '\0' || c < 0x20)
            return -1;
        if (c == '"') {
            s++;
            break;
        }
        if (c == '\\') {
            s++;
            switch (*s) {
            case '"':
            case '\\':
            case '/':
                buf[0] = (char)*s;
                blen = 1;
                break;
            case 'n':
                buf[0] = '\n';
                blen = 1;
                break;
            case 'r':
                buf[0] = '\r';
                blen = 1;
                break;
            case 't':
                buf[0] = '\t';
                blen = 1;
                break;
            case 'b':
                buf[0] = '\b';
                blen = 1;
                break;
            case 'f':
                buf[0] = '\f';
                blen = 1;
                break;
            case 'u': {
                char hex[5] = {0};
                memcpy(hex, s + 1, 4);
                if (strspn(hex, "0123456789abcdefABCDEF") != 4)
                    return -1;
                unsigned long cp = strtoul(hex, NULL, 16);
                if (cp < 0x80) {
                    buf[0] = (char)cp;
                    blen = 1;
                } else if (cp == 0xFFFD) {
                    memcpy(buf, "\xef\xbf\xbd", 3);
                    blen = 3;
                } else {
                    return -1; /* the writer escapes nothing else */
                }
                s += 4;
                break;
            }
            default:
                return -1;
            }
            s++;
        } else {
            size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : 4;
            if (c >= 0x80 && (c < 0xC2 || c > 0xF4))
                return -1;
            for (size_t i = 1; i < len; i++)
                if ((s[i] & 0xC0) != 0x80)
                    return -1;
            if ((c == 0xE0 && s[1] < 0xA0) || (c == 0xED && s[1] > 0x9F) ||
                (c == 0xF0 && s[1] < 0x90) || (c == 0xF4 && s[1] > 0x8F))
                return -1;
            memcpy(buf, s, len);
            blen = len;
            s += len;
        }
        if (out != NULL && n + blen < outlen)
            memcpy(out + n, buf, blen);
        n += blen;
    }
    if (out != NULL)
        out[n < outlen ? n : outlen - 1] = '\0';
    if (outn != NULL)
        *outn = n;
    *p = (const char *)s;
    return 0;
}

/* 0 when text is exactly one JSON object whose members are strings with
 * distinct names; the number of members in *count. */
static int valid_object(const char *text, int *count)
{
    char names[64][128];
    int n = 0;
    const char *p = text;
    if (*p++ != '{')
        return -1;
    if (*p == '}')
        return p[1] == '\0' ? 0 : -1;
    for (;;) {
        if (n >= 64 || read_string(&p, names[n], sizeof(names[n]), NULL) < 0)
            return -1;
        for (int i = 0; i < n; i++)
            if (strcmp(names[i], names[n]) == 0)
                return -1;
        n++;
        if (*p++ != ':' || read_string(&p, NULL, 0, NULL) < 0)
            return -1;
        if (*p == ',') {
            p++;
            continue;
        }
        if (*p++ != '}' || *p != '\0')
            return -1;
        break;
    }
    if (count != NULL)
        *count = n;
    return 0;
}

/* The decoded string value of member name, or NULL. */
static const char *member(const char *text, const char *name)
{
    static char value[LINE_MAX_BYTES];
    char key[256];
    const char *p = text + 1;
    while (*p == '"') {
        if (read_string(&p, key, sizeof(key), NULL) < 0 || *p++ != ':')
            return NULL;
        if (read_string(&p, value, sizeof(value), NULL) < 0)
            return NULL;
        if (strcmp(key, name) == 0)
            return value;
        if (*p == ',')
            p++;
    }
    return NULL;
}

static void format(const char *component, const char *text)
{
    size_t n = log_format_json(line, sizeof(line), STAMP, "info", component, text);
    assert_int_equal(n, strlen(line));
    assert_true(n < LINE_MAX_BYTES);
    int count = 0;
    if (valid_object(line, &count) != 0)
        fail_msg("not one valid JSON object: %.400s", line);
}

/* ---- tests ---------------------------------------------------------------- */

static void test_fixed_members(void **state)
{
    (void)state;
    format("pg", "listen connection ready");
    assert_string_equal(line, "{\"time\":\"" STAMP "\",\"level\":\"info\",\"component\":\"pg\","
                              "\"message\":\"listen connection ready\"}");
    format(NULL, "no component");
    assert_null(member(line, "component"));
    assert_string_equal(member(line, "message"), "no component");
}

static void test_pairs_become_members(void **state)
{
    (void)state;
    const char *text = "listen connection to host=10.0.0.5 port=5432 dbname=app user=relay: "
                       "ready (fd=7) batch_size=500, poll_interval=1000 ms";
    format("pg", text);
    assert_string_equal(member(line, "message"), text);
    assert_string_equal(member(line, "host"), "10.0.0.5");
    assert_string_equal(member(line, "port"), "5432");
    assert_string_equal(member(line, "dbname"), "app");
    assert_string_equal(member(line, "user"), "relay");
    assert_string_equal(member(line, "fd"), "7");
    assert_string_equal(member(line, "batch_size"), "500");
    assert_string_equal(member(line, "poll_interval"), "1000");
    /* Not pairs: "a = b", "x==", a key after ':', a key that starts with a digit. */
    format("relay", "SET a = b; x== no:k=v 9k=v =v");
    assert_null(member(line, "a"));
    assert_null(member(line, "x"));
    assert_null(member(line, "k"));
    assert_null(member(line, "9k"));
}

static void test_quoted_values_and_repeated_keys(void **state)
{
    (void)state;
    format("relay", "stream=\"orders eu\" mode=a mode=b empty= tail=\"unterminated");
    assert_string_equal(member(line, "stream"), "orders eu");
    assert_string_equal(member(line, "mode"), "a");
    assert_null(member(line, "empty"));
    assert_string_equal(member(line, "tail"), "unterminated");
}

static void test_fixed_names_are_not_overwritten(void **state)
{
    (void)state;
    format("relay", "message=spoof level=error time=0 component=x other=y");
    assert_string_equal(member(line, "level"), "info");
    assert_string_equal(member(line, "time"), STAMP);
    assert_string_equal(member(line, "component"), "relay");
    assert_string_equal(member(line, "message"),
                        "message=spoof level=error time=0 component=x other=y");
    assert_string_equal(member(line, "other"), "y");
}

static void test_quotes_and_backslashes(void **state)
{
    (void)state;
    const char *text = "say \"hi\" \\ path=C:\\dir\\ q=\"a \\\" b\" \\\"}\"{";
    format("relay\"\\", text);
    assert_string_equal(member(line, "message"), text);
    assert_string_equal(member(line, "component"), "relay\"\\");
    assert_string_equal(member(line, "path"), "C:\\dir\\");
    assert_string_equal(member(line, "q"), "a \\\" b");
}

static void test_control_bytes_are_escaped(void **state)
{
    (void)state;
    char text[64];
    size_t n = 0;
    for (int c = 1; c < 0x20; c++)
        text[n++] = (char)c;
    text[n++] = 0x7F;
    memcpy(text + n, " k=v\nx=y", 9);
    format("pg", text);
    for (const char *p = line; *p; p++)
        assert_true((unsigned char)*p >= 0x20 && (unsigned char)*p != 0x7F);
    assert_non_null(strstr(line, "\\u0001"));
    assert_non_null(strstr(line, "\\n"));
    assert_non_null(strstr(line, "\\u007f"));
    assert_string_equal(member(line, "message"), text);
    assert_string_equal(member(line, "k"), "v");
    assert_string_equal(member(line, "x"), "y");
}

static void test_invalid_utf8_becomes_replacement_characters(void **state)
{
    (void)state;
    /* é and 😀 are kept; a lone continuation byte, 0xFF, an overlong '/', a
     * surrogate, a code point above U+10FFFF and a cut-off sequence are not. */
    format("pg", "caf\xc3\xa9 \xf0\x9f\x98\x80 \x80 \xff \xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80 "
                 "\xe2\x82");
    assert_string_equal(member(line, "message"),
                        "caf\xc3\xa9 \xf0\x9f\x98\x80 \xef\xbf\xbd \xef\xbf\xbd "
                        "\xef\xbf\xbd\xef\xbf\xbd \xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd "
                        "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd "
                        "\xef\xbf\xbd\xef\xbf\xbd");
}

static void test_utf8_lengths(void **state)
{
    (void)state;
    assert_int_equal(log_utf8_len((const unsigned char *)"a", 1), 1);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xc3\xa9", 2), 2);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xe2\x82\xac", 3), 3);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xf0\x9f\x98\x80", 4), 4);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xf4\x8f\xbf\xbf", 4), 4);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xc1\xbf", 2), 0);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xe0\x9f\xbf", 3), 0);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xed\xbf\xbf", 3), 0);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xf0\x8f\xbf\xbf", 4), 0);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xf4\x90\x80\x80", 4), 0);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xf5\x80\x80\x80", 4), 0);
    assert_int_equal(log_utf8_len((const unsigned char *)"\xe2\x82\xac", 2), 0); /* cut */
    assert_int_equal(log_utf8_len((const unsigned char *)"\xc3(", 2), 0);
}

static void test_long_text_is_capped(void **state)
{
    (void)state;
    size_t big = 100000;
    char *text = malloc(big + 1);
    assert_non_null(text);

    /* Every byte escapes to six: the message is cut, still one valid line. */
    memset(text, 0x01, big);
    text[big] = '\0';
    format("pg", text);
    const char *m = member(line, "message");
    assert_true(strlen(m) < 2000);
    assert_string_equal(m + strlen(m) - 3, "...");

    /* Two-byte characters are never cut in half. */
    for (size_t i = 0; i + 1 < big; i += 2)
        memcpy(text + i, "\xc3\xa9", 2);
    text[big] = '\0';
    format("pg", text);
    m = member(line, "message");
    assert_string_equal(m + strlen(m) - 3, "...");
    assert_true((strlen(m) - 3) % 2 == 0);

    /* A long value is cut; a long key is no key; at most 24 pairs. */
    size_t n = (size_t)snprintf(text, big, "v=");
    memset(text + n, 'x', 5000);
    n += 5000;
    n += (size_t)snprintf(text + n, big - n, " ");
    memset(text + n, 'k', 100);
    n += 100;
    n += (size_t)snprintf(text + n, big - n, "=1");
    for (int i = 0; i < 100; i++)
        n += (size_t)snprintf(text + n, big - n, " f%d=%d", i, i);
    format("relay", text);
    m = member(line, "v");
    assert_true(strlen(m) <= 512);
    assert_string_equal(m + strlen(m) - 3, "...");
    int count = 0;
    assert_int_equal(valid_object(line, &count), 0);
    assert_true(count <= 4 + 24);
    assert_string_equal(member(line, "f0"), "0");
    assert_null(member(line, "f99"));

    /* The worst of both: a huge message of pairs with escaped values. */
    n = 0;
    while (n + 40 < big)
        n += (size_t)snprintf(text + n, big - n, "k%zu=\"\x01\x02\x03\x04\x05\x06\" ", n);
    format("relay", text);
    free(text);
}

static void test_small_buffer_never_overflows(void **state)
{
    (void)state;
    char small[24];
    memset(small, 'Z', sizeof(small));
    size_t n = log_format_json(small, 16, STAMP, "info", "pg", "a=1 b=2 \"quoted\"");
    assert_true(n <= 15);
    assert_int_equal(small[n], '\0');
    assert_int_equal(small[16], 'Z');
    assert_int_equal(log_format_json(small, 0, STAMP, "info", "pg", "x"), 0);
    assert_int_equal(small[16], 'Z');
}

static void test_find_pairs_limits(void **state)
{
    (void)state;
    struct log_pair pairs[2];
    assert_int_equal(log_find_pairs("a=1 b=2 c=3", pairs, 2), 2);
    assert_int_equal(pairs[1].valuelen, 1);
    assert_memory_equal(pairs[1].key, "b", 1);
    assert_int_equal(log_find_pairs("", pairs, 2), 0);
    assert_int_equal(log_find_pairs("k=(a) x=y)", pairs, 2), 2);
    assert_int_equal(pairs[0].valuelen, 3); /* "(a)" keeps its own parenthesis */
    assert_int_equal(pairs[1].valuelen, 1); /* "y)" loses one it did not open */
}

static void test_parse_format(void **state)
{
    (void)state;
    assert_int_equal(relay_config_parse_log_format("text"), 0);
    assert_int_equal(relay_config_parse_log_format("json"), 1);
    assert_int_equal(relay_config_parse_log_format("JSON "), -1);
    assert_int_equal(relay_config_parse_log_format(""), -1);
    assert_int_equal(relay_config_parse_log_format(NULL), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixed_members),
        cmocka_unit_test(test_pairs_become_members),
        cmocka_unit_test(test_quoted_values_and_repeated_keys),
        cmocka_unit_test(test_fixed_names_are_not_overwritten),
        cmocka_unit_test(test_quotes_and_backslashes),
        cmocka_unit_test(test_control_bytes_are_escaped),
        cmocka_unit_test(test_invalid_utf8_becomes_replacement_characters),
        cmocka_unit_test(test_utf8_lengths),
        cmocka_unit_test(test_long_text_is_capped),
        cmocka_unit_test(test_small_buffer_never_overflows),
        cmocka_unit_test(test_find_pairs_limits),
        cmocka_unit_test(test_parse_format),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
