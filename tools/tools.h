/*
 * Operator commands that run once and exit, sharing the daemon's
 * configuration: "outbox-relay failed list|retry|drop" (PostgreSQL),
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
 * outbox-relay failed list [--limit N] | failed retry ID... | failed retry --all
 *              | failed drop ID...
 * argv[0] is "failed". Output goes to out, errors to errout. Returns an exit
 * code (0, 64 for bad usage, 69 when the database cannot be reached, 65 when
 * an ID names no quarantined row). With cfg NULL it checks the arguments
 * only (0 or 64) and connects to nothing.
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
 * 75 when a replay kept racing with other writers. With cfg NULL it checks
 * the arguments only (0 or 64) and connects to nothing.
 */
int relay_tool_dlq(const struct relay_config *cfg, int argc, char **argv, FILE *out, FILE *errout)
    __attribute__((warn_unused_result));

/*
 * outbox-relay status [--json]: queue age, lag, pending, dead letters and
 * quarantined rows per stream and group, the servers' state and the Redis
 * durability in force. 0, or 69 when a server cannot be reached; 64 for bad
 * usage. With cfg NULL it checks the arguments only and connects to nothing.
 */
int relay_tool_status(const struct relay_config *cfg, int argc, char **argv, FILE *out,
                      FILE *errout) __attribute__((warn_unused_result));

/* 1 when word asks for a command's usage: --help or -h. Each command then
 * prints its usage to out and returns 0, with or without a configuration. */
int relay_tool_is_help(const char *word);

/* 1 when word names an operator command: failed, dlq or status. */
int relay_tool_is_command(const char *word);

/* The command nearest to word, for "did you mean" (relay_config_nearest);
 * NULL when none is near. */
const char *relay_tool_nearest_command(const char *word);

/*
 * An operator command's words (argv[0] the command), checked before its
 * configuration is loaded: the verb of failed and dlq, the options of
 * status. 0, or 64 (bad usage) after writing to errout what is wrong, with
 * the nearest known word when there is one:
 *   outbox-relay: dlq: unknown command "lst" (did you mean list?)
 * The other arguments each command checks with no configuration (cfg NULL),
 * which cli/main.c does next.
 */
int relay_tool_check_usage(int argc, char **argv, FILE *errout) __attribute__((warn_unused_result));

/* Writes `outbox-relay: TOOL: unknown command "WORD"` (for status:
 * `unexpected "WORD"`) and the nearest known word of that command, if any. */
void relay_tool_unknown(FILE *errout, const char *tool, const char *word);

#endif
