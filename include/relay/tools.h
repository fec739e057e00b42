/*
 * Operator commands that run once and exit, sharing the daemon's
 * configuration: "outbox-relay failed list|retry". They use blocking libpq
 * calls with deadlines (connect_timeout and statement_timeout from the
 * configuration), which is right for a command line tool and never happens in
 * the daemon's loop.
 */
#ifndef RELAY_TOOLS_H
#define RELAY_TOOLS_H

#include <stdio.h>

struct relay_config;

/*
 * outbox-relay failed list [--limit N] | failed retry ID... | failed retry --all
 * argv[0] is "failed". Output goes to out, errors to errout. Returns an exit
 * code (0, 64 for bad usage, 69 when the database cannot be reached, 65 when
 * an ID names no quarantined row).
 */
int relay_tool_failed(const struct relay_config *cfg, int argc, char **argv, FILE *out,
                      FILE *errout);

#endif
