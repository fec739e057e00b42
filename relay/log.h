/*
 * Logging: one line per event on stderr, "<time> <LEVEL> <component>: <text>",
 * or with log_format = json one JSON object per line (relay/log.c).
 * journald keeps stderr, so the daemon never opens a log file of its own.
 */
#ifndef RELAY_LOG_H
#define RELAY_LOG_H

#include "core/config.h" /* enum relay_log_level */

/* Lines below this level are dropped. Default RELAY_LOG_INFO. */
void relay_log_set_level(enum relay_log_level level);
enum relay_log_level relay_log_get_level(void);

/* 1: "<N>" priority prefixes for journald instead of timestamps; 0: timestamps.
 * By default the journal is detected from $JOURNAL_STREAM. */
void relay_log_set_journal(int on);

/* 1: each event as one JSON object per line (log_format = json); 0: text. */
void relay_log_set_json(int on);

/* Writes one line. The text must not contain secrets: callers redact first. */
void relay_log(enum relay_log_level level, const char *component, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define relay_debug(comp, ...) relay_log(RELAY_LOG_DEBUG, comp, __VA_ARGS__)
#define relay_info(comp, ...) relay_log(RELAY_LOG_INFO, comp, __VA_ARGS__)
#define relay_warn(comp, ...) relay_log(RELAY_LOG_WARNING, comp, __VA_ARGS__)
#define relay_error(comp, ...) relay_log(RELAY_LOG_ERROR, comp, __VA_ARGS__)

#endif
