/*
 * Operator commands that run once and exit, sharing the daemon's
 * configuration: "outbox-relay failed list|retry" (PostgreSQL),
 * "outbox-relay dlq list|show|replay|purge" (Redis) and "outbox-relay status"
 * (both), and the one way they show data on a terminal. They use blocking
 * libpq and hiredis calls with deadlines (connect_timeout and
 * statement_timeout from the configuration), which is right for a command
 * line tool and never happens in the daemon's loop.
 */
#ifndef RELAY_TOOLS_H
#define RELAY_TOOLS_H

#include <stddef.h>
#include <stdio.h>

struct relay_config;

/*
 * Showing bytes that may be anything (relay/tools.c). Every human line a tool
 * prints with a topic, a name, an error or a payload in it uses this one form:
 * printable ASCII and UTF-8 characters as they are, a backslash as \\ (and,
 * with RELAY_ESCAPE_QUOTE, a double quote as \"), and as \xNN each byte of a
 * control character (relay_tools_control_char) and each byte that is not part
 * of valid UTF-8. Nothing shown can move the cursor, retitle or clear the
 * terminal, forge a line or reorder one, and the form still says which bytes
 * are stored. JSON output does not use it: JSON escapes carry the exact text.
 */
#define RELAY_ESCAPE_QUOTE 1u

/* Bytes that always hold the whole form of len bytes (and a NUL). */
#define RELAY_ESCAPED_SIZE(len) (4 * (len) + 1)

/*
 * The length (1 to 4) of the valid UTF-8 character at s, which has len bytes,
 * and its code point in *cp (cp may be NULL); 0 when s does not start with
 * one: a stray continuation byte, an overlong form, a surrogate, a value above
 * U+10FFFF or a character cut short.
 */
size_t relay_tools_utf8_char(const char *s, size_t len, unsigned long *cp);

/*
 * 1 for a character a terminal acts on instead of showing: the C0 controls,
 * DEL, the C1 controls (U+0080..U+009F) and the bidirectional embeddings,
 * overrides and isolates (U+202A..U+202E, U+2066..U+2069).
 */
int relay_tools_control_char(unsigned long cp);

/*
 * Writes the form of s[0..len) into dst, which has dstlen bytes, and a NUL
 * (nothing when dstlen is 0). A form longer than maxcols columns (when
 * maxcols, at least 3, is not 0) or than dst holds is cut between characters,
 * never inside one or inside an escape, and ends in "...", within both. A
 * character counts one column, \\ two and \xNN four. Returns the columns
 * written.
 */
/* 1 when s ends with suffix. */
int relay_tools_ends_with(const char *s, const char *suffix);

size_t relay_tools_escape(char *dst, size_t dstlen, const char *s, size_t len, size_t maxcols,
                          unsigned flags);

/* The same form written to f, for text of any size; returns the columns written. */
size_t relay_tools_put_escaped(FILE *f, const char *s, size_t len, size_t maxcols, unsigned flags);

/* relay_tools_put_escaped with no flags, then spaces up to width columns and
 * one more: a column of a table. */
void relay_tools_put_column(FILE *f, const char *s, size_t len, size_t width, size_t maxcols);

/*
 * outbox-relay failed list [--limit N] | failed retry ID... | failed retry --all
 * argv[0] is "failed". Output goes to out, errors to errout. Returns an exit
 * code (0, 64 for bad usage, 69 when the database cannot be reached, 65 when
 * an ID names no quarantined row).
 */
int relay_tool_failed(const struct relay_config *cfg, int argc, char **argv, FILE *out,
                      FILE *errout) __attribute__((warn_unused_result));

/*
 * outbox-relay dlq list STREAM GROUP [--count N]
 *              dlq show STREAM GROUP ID
 *              dlq replay|purge STREAM GROUP (ID... | FROM-TO... | --all)
 * argv[0] is "dlq". Works on the dead letters of one consumer group,
 * "<stream>.<group>.dlq" (consumer.h); replay moves them, without their dlq.*
 * fields, to "<stream>.<group>.replay", which only that group reads. Uses only
 * cfg's Redis settings and timeouts. Output goes to out, errors to errout.
 * Returns an exit code: 0; 64 for bad usage; 65 when the stream, the group or
 * an ID does not exist (the other IDs are still processed) or a dead letter
 * cannot be replayed; 69 when Redis cannot be reached or refuses a command;
 * 75 when a replay kept racing with other writers.
 */
int relay_tool_dlq(const struct relay_config *cfg, int argc, char **argv, FILE *out, FILE *errout)
    __attribute__((warn_unused_result));

/*
 * outbox-relay status [--json]: queue age, lag, pending, dead letters and
 * quarantined rows per stream and group, the servers' state and the Redis
 * durability in force. 0, or 69 when a server cannot be reached.
 */
int relay_tool_status(const struct relay_config *cfg, int argc, char **argv, FILE *out,
                      FILE *errout) __attribute__((warn_unused_result));

#endif
