/*
 * The words of the operator commands' command lines: the commands (failed,
 * dlq, status) and their verbs, checked before the configuration is loaded,
 * so that a misspelt word is bad usage (64) with the nearest known word to
 * try, whatever the configuration holds. The nearness is the configuration's
 * own "did you mean" (relay_config_nearest).
 */
#include "common/compat.h"

#include "tools/tools.h"

#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "core/config.h"

static const char *const tool_commands[] = {"failed", "dlq", "status"};
static const char *const tool_failed_verbs[] = {"list", "retry", "drop"};
static const char *const tool_dlq_verbs[] = {"list", "show", "replay", "purge", "migrate"};

static int tool_word_in(const char *word, const char *const *words, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(word, words[i]) == 0)
            return 1;
    return 0;
}

int relay_tool_is_help(const char *word)
{
    return strcmp(word, "--help") == 0 || strcmp(word, "-h") == 0;
}

int relay_tool_is_command(const char *word)
{
    return tool_word_in(word, tool_commands, OUTBOX_ARRAY_LEN(tool_commands));
}

const char *relay_tool_nearest_command(const char *word)
{
    return relay_config_nearest(word, tool_commands, OUTBOX_ARRAY_LEN(tool_commands));
}

void relay_tool_unknown(FILE *errout, const char *tool, const char *word)
{
    const char *const *words = tool_failed_verbs;
    size_t n = OUTBOX_ARRAY_LEN(tool_failed_verbs);
    if (strcmp(tool, "dlq") == 0) {
        words = tool_dlq_verbs;
        n = OUTBOX_ARRAY_LEN(tool_dlq_verbs);
    } else if (strcmp(tool, "status") == 0) {
        static const char *const status_options[] = {"--json"};
        words = status_options;
        n = OUTBOX_ARRAY_LEN(status_options);
    }
    const char *near = relay_config_nearest(word, words, n);
    fprintf(errout, "outbox-relay: %s: %s \"%s\"", tool,
            strcmp(tool, "status") == 0 ? "unexpected" : "unknown command", word);
    if (near != NULL)
        fprintf(errout, " (did you mean %s?)", near);
    fputc('\n', errout);
}

int relay_tool_check_usage(int argc, char **argv, FILE *errout)
{
    if (argc < 2)
        return OUTBOX_EX_OK; /* the command says what it needs */
    const char *tool = argv[0], *verb = argv[1];
    if (strcmp(tool, "failed") == 0 &&
        !tool_word_in(verb, tool_failed_verbs, OUTBOX_ARRAY_LEN(tool_failed_verbs))) {
        relay_tool_unknown(errout, tool, verb);
        fprintf(errout, "Usage: outbox-relay [-c FILE] failed list|retry|drop ...; see "
                        "'outbox-relay --help'\n");
        return OUTBOX_EX_USAGE;
    }
    if (relay_tool_is_help(verb))
        return OUTBOX_EX_OK; /* the command prints its usage */
    if (strcmp(tool, "dlq") == 0 &&
        !tool_word_in(verb, tool_dlq_verbs, OUTBOX_ARRAY_LEN(tool_dlq_verbs))) {
        relay_tool_unknown(errout, tool, verb);
        fprintf(errout, "Usage: outbox-relay [-c FILE] dlq list|show|replay|purge|migrate STREAM "
                        "GROUP ...; see 'outbox-relay dlq --help'\n");
        return OUTBOX_EX_USAGE;
    }
    if (strcmp(tool, "status") == 0) {
        for (int i = 1; i < argc; i++) {
            if (strcmp(argv[i], "--json") == 0)
                continue;
            relay_tool_unknown(errout, tool, argv[i]);
            fprintf(errout, "Usage: outbox-relay [-c FILE] status [--json]\n");
            return OUTBOX_EX_USAGE;
        }
    }
    return OUTBOX_EX_OK;
}
