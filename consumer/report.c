/*
 * How the consumer library reports (consumer/internal.h): it never prints.
 * Events go to the caller's log hook, one line each (none: silent), and the
 * most recent failure stays in the object, in err and errstr, with its kind
 * decided where it happens, for outbox_consumer_err and
 * outbox_consumer_errstr.
 */
#include "common/compat.h"

#include "consumer/internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Longest line given to the log hook; longer text is cut and ends in "...". */
#define LOG_LINE_MAX 2048

void outbox_report_emit(const struct outbox_consumer *c, enum outbox_consumer_log_level level,
                        const char *fmt, ...)
{
    char text[LOG_LINE_MAX];
    va_list ap;
    int n;

    if (c->o.log == NULL)
        return;
    va_start(ap, fmt);
    n = vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (n < 0)
        snprintf(text, sizeof(text), "(log message could not be formatted)");
    else if ((size_t)n >= sizeof(text))
        memcpy(text + sizeof(text) - 4, "...", 4);
    for (char *p = text; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            *p = ' '; /* a server's multi-line error is still one line */
    c->o.log(level, text, c->o.log_arg);
}

void outbox_report_set_error(struct outbox_consumer *c, enum outbox_consumer_err kind,
                             const char *text)
{
    c->err = kind;
    snprintf(c->errstr, sizeof(c->errstr), "%s", text);
}

void outbox_report_clear_error(struct outbox_consumer *c)
{
    c->err = OUTBOX_CONSUMER_ERR_NONE;
    c->errstr[0] = '\0';
}

void outbox_report_problem(struct outbox_consumer *c, enum outbox_consumer_err kind,
                           const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    outbox_report_set_error(c, kind, text);
    if (strcmp(text, c->last_error) == 0) {
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_DEBUG, "%s", text);
        return;
    }
    snprintf(c->last_error, sizeof(c->last_error), "%s", text);
    outbox_report_emit(c, OUTBOX_CONSUMER_LOG_ERROR, "%s; retrying with backoff", text);
}
