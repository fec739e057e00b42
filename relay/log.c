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
 * The daemon is single-threaded; this file keeps no lock.
 */
#include "relay/compat.h"

#include "relay/log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

/* Longest text of one event; longer text is cut and ends in "...". */
#define LOG_TEXT_MAX 4096

static enum relay_log_level log_min_level = RELAY_LOG_INFO;

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

void relay_log_set_level(enum relay_log_level level)
{
    int l = (int)level;

    if (l >= (int)RELAY_LOG_DEBUG && l <= (int)RELAY_LOG_ERROR)
        log_min_level = level;
}

enum relay_log_level relay_log_get_level(void)
{
    return log_min_level;
}

int relay_log_parse_level(const char *name)
{
    static const char *const names[] = {"debug", "info", "warning", "error"};
    size_t i;

    if (name == NULL)
        return -1;
    for (i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strcasecmp(name, names[i]) == 0)
            return (int)i;
    return -1;
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

    if ((int)level < (int)log_min_level)
        return;
    name = ((int)level >= 0 && (int)level <= (int)RELAY_LOG_ERROR) ? log_level_names[level] : "LOG";

    va_start(ap, fmt);
    n = vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (n < 0)
        snprintf(text, sizeof(text), "(log message could not be formatted)");
    else if ((size_t)n >= sizeof(text))
        memcpy(text + sizeof(text) - 4, "...", 4);
    for (p = text; *p; p++)
        if ((unsigned char)*p < 0x20 && *p != '\t')
            *p = ' '; /* \r and \n above all: one event, one line */

    if (clock_gettime(CLOCK_REALTIME, &ts) != 0 || gmtime_r(&ts.tv_sec, &tm) == NULL ||
        strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &tm) == 0) {
        snprintf(stamp, sizeof(stamp), "0000-00-00T00:00:00");
        ts.tv_nsec = 0;
    }

    if (log_journal < 0) {
        const char *js = getenv("JOURNAL_STREAM");
        log_journal = js != NULL && js[0] != '\0';
    }
    if (log_journal) {
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
