/*
 * Logging: one line per event on stderr,
 *
 *   2026-11-30T11:35:14.123Z INFO pgsrc: LISTEN outbox_new ok (fd 7)
 *
 * The level is tested before anything is formatted (redis serverLog). The
 * whole line goes out in one fprintf followed by fflush, so lines from one
 * process never interleave mid-line and nothing sits in a buffer when the
 * process dies. Control characters in the text (a server's multi-line error,
 * say) become spaces, so one event is always one line for journald and grep.
 *
 * Two threads log: the event loop and the observation thread (retention,
 * relay/retention.c). A line is built on the caller's stack and written by one
 * fprintf, which holds stderr's lock for the call, so lines of the two never
 * mix. The settings are written by the loop: all of them at start, before the
 * thread runs, and the level again at a reload, which is why it is atomic;
 * this file keeps no lock of its own.
 *
 * With log_format = json each event is instead one JSON object per line, for
 * log pipelines (relay_log_set_json):
 *
 *   {"time":"2026-11-30T11:35:14.123Z","level":"info","component":"pg",
 *    "message":"listen connection to host=10.0.0.5 port=5432 ... ready",
 *    "host":"10.0.0.5","port":"5432",...}
 *
 * The message is kept whole, and every key=value pair in it (a key of
 * letters, digits, '_', '.' or '-' after a space, a '(' or the start; the
 * value up to the next space, or in double quotes) is repeated as a string
 * member, the first of a key winning; a pair named like one of the four fixed
 * members stays in the message only. Strings are escaped as RFC 8259 asks,
 * with control characters as escapes (a newline stays a "\n" inside the one
 * line) and bytes that are not UTF-8 as U+FFFD; the message, each key and each
 * value have caps, so a line has a bounded size whatever the text.
 */
#include "common/compat.h"

#include "relay/log.h"

#include "common/common.h"
#include "core/text.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

/* Longest text of one event; longer text is cut and ends in "...". */
#define LOG_TEXT_MAX 4096

/* An enum relay_log_level; the observation thread reads it too. */
static atomic_int log_min_level = RELAY_LOG_INFO;

/* Under systemd, stderr goes to the journal, which stamps each line itself:
 * there we write sd-daemon(3) "<N>" priority prefixes instead of a time, so
 * journalctl -p works. systemd sets JOURNAL_STREAM for such a stderr. */
static int log_journal = -1;
static const int log_syslog_priority[] = {7, 6, 4, 3}; /* debug info warning err */

void relay_log_set_journal(int on)
{
    log_journal = on;
}

static const char *const log_level_names[] = {"DEBUG", "INFO", "WARNING", "ERROR"};
static const char *const log_json_levels[] = {"debug", "info", "warning", "error"};

static int log_json;

void relay_log_set_json(int on)
{
    log_json = on != 0;
}

/* ---- JSON lines -------------------------------------------------------- */

/* Caps on the escaped text of the message, a key and a value, and on the
 * pairs taken from one message. With them the whole line fits LOG_JSON_MAX. */
#define LOG_JSON_MESSAGE_MAX 8192
#define LOG_JSON_KEY_MAX 64
#define LOG_JSON_VALUE_MAX 512
#define LOG_JSON_FIELDS_MAX 24
#define LOG_JSON_MAX                                                                               \
    (LOG_JSON_MESSAGE_MAX + LOG_JSON_FIELDS_MAX * (LOG_JSON_KEY_MAX + LOG_JSON_VALUE_MAX + 16) +   \
     512)

/* One key=value pair found in a message. */
struct log_pair {
    const char *key, *value;
    size_t keylen, valuelen;
};

/* File-local, reachable from tests/unit/test_log.c (OUTBOX_STATIC is empty there). */
OUTBOX_STATIC size_t log_utf8_len(const unsigned char *s, size_t n);
OUTBOX_STATIC size_t log_find_pairs(const char *text, struct log_pair *pairs, size_t max);
OUTBOX_STATIC size_t log_format_json(char *out, size_t outlen, const char *stamp, const char *level,
                                     const char *component, const char *text);

/* The length of the well-formed UTF-8 sequence at s (at most n bytes), or 0:
 * no overlong forms, no surrogates, nothing above U+10FFFF. */
OUTBOX_STATIC size_t log_utf8_len(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF; /* the range of the second byte */

    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0)
            lo = 0xA0;
        else if (c == 0xED)
            hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F;
    } else
        return 0;
    if (n < len || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF)
            return 0;
    return len;
}

/* Writes s[0..n) as a JSON string, its escaped content at most max bytes:
 * longer text is cut at a character boundary and ends in "...". */
static void json_string(struct relay_text_out *o, const char *s, size_t n, size_t max)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t used = 0, i = 0;
    char esc[8];

    relay_text_out_putn(o, "\"", 1);
    while (i < n) {
        const char *piece = esc;
        size_t plen, step = 1;
        unsigned char c = u[i];
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            plen = 2;
        } else if (c == '\n' || c == '\r' || c == '\t' || c == '\b' || c == '\f') {
            esc[0] = '\\';
            esc[1] = c == '\n' ? 'n' : c == '\r' ? 'r' : c == '\t' ? 't' : c == '\b' ? 'b' : 'f';
            plen = 2;
        } else if (c < 0x20 || c == 0x7F) {
            snprintf(esc, sizeof(esc), "\\u%04x", (unsigned)c);
            plen = 6;
        } else if ((step = log_utf8_len(u + i, n - i)) == 0) {
            piece = "\\ufffd"; /* not UTF-8: one replacement per byte */
            plen = 6;
            step = 1;
        } else {
            piece = s + i;
            plen = step;
        }
        if (used + plen > max - 3) {
            relay_text_out_putn(o, "...", 3);
            break;
        }
        relay_text_out_putn(o, piece, plen);
        used += plen;
        i += step;
    }
    relay_text_out_putn(o, "\"", 1);
}

static int log_key_char(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
}

static int log_space(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/*
 * Finds the key=value pairs of text, in order, at most max. A key starts the
 * text or follows a space or '(' and begins with a letter or '_'; a value runs
 * to the next space, less a trailing ',', ';' or ':' and a ')' or ']' it did not
 * open, or is the text between double quotes (a backslash keeps the next
 * character in). Empty values, values that start with '=' and repeated keys
 * are skipped.
 */
OUTBOX_STATIC size_t log_find_pairs(const char *text, struct log_pair *pairs, size_t max)
{
    size_t np = 0;
    const char *p = text;

    while (*p != '\0' && np < max) {
        if (p != text && !log_space((unsigned char)p[-1]) && p[-1] != '(') {
            p++;
            continue;
        }
        const char *k = p;
        if (!((*k >= 'a' && *k <= 'z') || (*k >= 'A' && *k <= 'Z') || *k == '_')) {
            p++;
            continue;
        }
        while (log_key_char((unsigned char)*p))
            p++;
        if (*p != '=' || (size_t)(p - k) > LOG_JSON_KEY_MAX) {
            if (*p != '\0' && !log_space((unsigned char)*p))
                p++;
            continue;
        }
        size_t keylen = (size_t)(p - k);
        const char *v = ++p, *end;
        if (*v == '"') {
            v++;
            for (end = v; *end != '\0' && *end != '"'; end++)
                if (*end == '\\' && end[1] != '\0')
                    end++;
            p = *end == '"' ? end + 1 : end;
        } else {
            int depth = 0;
            for (end = v; *end != '\0' && !log_space((unsigned char)*end); end++)
                depth += *end == '(' || *end == '[' ? 1 : *end == ')' || *end == ']' ? -1 : 0;
            p = end;
            while (end > v && (end[-1] == ',' || end[-1] == ';' || end[-1] == ':' ||
                               ((end[-1] == ')' || end[-1] == ']') && depth < 0))) {
                if (end[-1] == ')' || end[-1] == ']')
                    depth++;
                end--;
            }
        }
        if (end == v || *v == '=')
            continue;
        int seen = 0;
        for (size_t i = 0; i < np && !seen; i++)
            seen = pairs[i].keylen == keylen && memcmp(pairs[i].key, k, keylen) == 0;
        if (seen)
            continue;
        pairs[np].key = k;
        pairs[np].keylen = keylen;
        pairs[np].value = v;
        pairs[np].valuelen = (size_t)(end - v);
        np++;
    }
    return np;
}

/*
 * Writes one event as a JSON object (no newline) into out and returns its
 * length. stamp is the RFC 3339 time, level one of "debug" ... "error",
 * component may be NULL; text is the formatted message, as it is.
 */
OUTBOX_STATIC size_t log_format_json(char *out, size_t outlen, const char *stamp, const char *level,
                                     const char *component, const char *text)
{
    static const char *const fixed[] = {"time", "level", "component", "message"};
    struct relay_text_out o;

    relay_text_out_init(&o, out, outlen);
    struct log_pair pairs[LOG_JSON_FIELDS_MAX];
    size_t np = log_find_pairs(text, pairs, LOG_JSON_FIELDS_MAX);

    if (outlen > 0)
        out[0] = '\0';
    relay_text_out_puts(&o, "{\"time\":");
    json_string(&o, stamp, strlen(stamp), 64);
    relay_text_out_puts(&o, ",\"level\":");
    json_string(&o, level, strlen(level), 16);
    if (component != NULL) {
        relay_text_out_puts(&o, ",\"component\":");
        json_string(&o, component, strlen(component), LOG_JSON_KEY_MAX);
    }
    relay_text_out_puts(&o, ",\"message\":");
    json_string(&o, text, strlen(text), LOG_JSON_MESSAGE_MAX);
    for (size_t i = 0; i < np; i++) {
        int reserved = 0;
        for (size_t f = 0; f < sizeof(fixed) / sizeof(fixed[0]) && !reserved; f++)
            reserved = strlen(fixed[f]) == pairs[i].keylen &&
                       memcmp(fixed[f], pairs[i].key, pairs[i].keylen) == 0;
        if (reserved)
            continue;
        relay_text_out_putn(&o, ",", 1);
        json_string(&o, pairs[i].key, pairs[i].keylen, LOG_JSON_KEY_MAX + 8);
        relay_text_out_putn(&o, ":", 1);
        json_string(&o, pairs[i].value, pairs[i].valuelen, LOG_JSON_VALUE_MAX);
    }
    relay_text_out_putn(&o, "}", 1);
    return o.len;
}

void relay_log_set_level(enum relay_log_level level)
{
    int l = (int)level;

    if (l >= (int)RELAY_LOG_DEBUG && l <= (int)RELAY_LOG_ERROR)
        atomic_store_explicit(&log_min_level, l, memory_order_relaxed);
}

enum relay_log_level relay_log_get_level(void)
{
    return (enum relay_log_level)atomic_load_explicit(&log_min_level, memory_order_relaxed);
}

/* The time as RFC 3339 UTC with milliseconds. */
static void log_stamp(char *out, size_t outlen)
{
    struct timespec ts;
    struct tm tm;
    char day[32];

    if (clock_gettime(CLOCK_REALTIME, &ts) != 0 || gmtime_r(&ts.tv_sec, &tm) == NULL ||
        strftime(day, sizeof(day), "%Y-%m-%dT%H:%M:%S", &tm) == 0) {
        snprintf(day, sizeof(day), "0000-00-00T00:00:00");
        ts.tv_nsec = 0;
    }
    snprintf(out, outlen, "%s.%03ldZ", day, (long)(ts.tv_nsec / 1000000));
}

static int log_under_journal(void)
{
    if (log_journal < 0) {
        const char *js = getenv("JOURNAL_STREAM");
        log_journal = js != NULL && js[0] != '\0';
    }
    return log_journal;
}

/* One event as a JSON line; under the journal behind its "<N>" priority,
 * which journald takes off, leaving the object as the message. */
static void log_json_line(enum relay_log_level level, const char *component, const char *text)
{
    char line[LOG_JSON_MAX];
    char stamp[48];
    int known = (int)level >= 0 && (int)level <= (int)RELAY_LOG_ERROR;

    log_stamp(stamp, sizeof(stamp));
    log_format_json(line, sizeof(line), stamp, known ? log_json_levels[level] : "info", component,
                    text);
    if (log_under_journal())
        fprintf(stderr, "<%d>%s\n", known ? log_syslog_priority[level] : 6, line);
    else
        fprintf(stderr, "%s\n", line);
    fflush(stderr);
}

void relay_log(enum relay_log_level level, const char *component, const char *fmt, ...)
{
    char text[LOG_TEXT_MAX];
    char stamp[32];
    struct timespec ts;
    struct tm tm;
    const char *name;
    va_list ap;
    char *p;
    int saved_errno = errno; /* callers log and then look at errno */
    int n;

    if ((int)level < atomic_load_explicit(&log_min_level, memory_order_relaxed))
        return;
    name = ((int)level >= 0 && (int)level <= (int)RELAY_LOG_ERROR) ? log_level_names[level] : "LOG";

    va_start(ap, fmt);
    n = vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (n < 0)
        snprintf(text, sizeof(text), "(log message could not be formatted)");
    else if ((size_t)n >= sizeof(text))
        memcpy(text + sizeof(text) - 4, "...", 4);
    if (log_json) {
        log_json_line(level, component, text);
        errno = saved_errno;
        return;
    }
    for (p = text; *p; p++)
        if ((unsigned char)*p < 0x20 && *p != '\t')
            *p = ' '; /* \r and \n above all: one event, one line */

    if (clock_gettime(CLOCK_REALTIME, &ts) != 0 || gmtime_r(&ts.tv_sec, &tm) == NULL ||
        strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &tm) == 0) {
        snprintf(stamp, sizeof(stamp), "0000-00-00T00:00:00");
        ts.tv_nsec = 0;
    }

    if (log_under_journal()) {
        int prio = ((int)level >= 0 && (int)level <= (int)RELAY_LOG_ERROR)
                       ? log_syslog_priority[level]
                       : 6;
        fprintf(stderr, "<%d>%s %s%s%s\n", prio, name, component != NULL ? component : "",
                component != NULL ? ": " : "", text);
        fflush(stderr);
        errno = saved_errno;
        return;
    }
    fprintf(stderr, "%s.%03ldZ %s %s%s%s\n", stamp, (long)(ts.tv_nsec / 1000000), name,
            component != NULL ? component : "", component != NULL ? ": " : "", text);
    fflush(stderr);
    errno = saved_errno;
}
