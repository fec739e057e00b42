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

/* Each command's words after its name: the verbs of failed and dlq, which
 * come first, or the options of status, which are all its arguments; and the
 * usage line shown when one is not known. */
struct tool_words {
    const char *tool;
    const char *const *words;
    size_t n;
    int options; /* every argument is one of words, not only the first */
    const char *usage;
};

static const char *const failed_verbs[] = {"list", "retry", "drop"};
static const char *const dlq_verbs[] = {"list", "show", "replay", "purge", "migrate"};
static const char *const status_options[] = {"--json"};

static const struct tool_words tool_words[] = {
    {"failed", failed_verbs, OUTBOX_ARRAY_LEN(failed_verbs), 0,
     "Usage: outbox-relay [-c FILE] failed list|retry|drop ...; see 'outbox-relay failed --help'"},
    {"dlq", dlq_verbs, OUTBOX_ARRAY_LEN(dlq_verbs), 0,
     "Usage: outbox-relay [-c FILE] dlq list|show|replay|purge|migrate STREAM GROUP ...; see "
     "'outbox-relay dlq --help'"},
    {"status", status_options, OUTBOX_ARRAY_LEN(status_options), 1,
     "Usage: outbox-relay [-c FILE] status [--json]"},
};

static int tool_word_in(const char *word, const char *const *words, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(word, words[i]) == 0)
            return 1;
    return 0;
}

static const struct tool_words *words_of(const char *tool)
{
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(tool_words); i++)
        if (strcmp(tool, tool_words[i].tool) == 0)
            return &tool_words[i];
    return NULL;
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
    const struct tool_words *w = words_of(tool);
    const char *near = w != NULL ? relay_config_nearest(word, w->words, w->n) : NULL;
    fprintf(errout, "outbox-relay: %s: %s \"%s\"", tool,
            w == NULL || w->options ? "unexpected" : "unknown command", word);
    if (near != NULL)
        fprintf(errout, " (did you mean %s?)", near);
    fputc('\n', errout);
}

int relay_tool_check_usage(int argc, char **argv, FILE *errout)
{
    if (argc < 2)
        return OUTBOX_EX_OK; /* the command says what it needs */
    const struct tool_words *w = words_of(argv[0]);
    if (w == NULL)
        return OUTBOX_EX_OK;
    int last = w->options ? argc : 2;
    for (int i = 1; i < last; i++) {
        if (tool_word_in(argv[i], w->words, w->n))
            continue;
        relay_tool_unknown(errout, w->tool, argv[i]);
        fprintf(errout, "%s\n", w->usage);
        return OUTBOX_EX_USAGE;
    }
    return OUTBOX_EX_OK;
}
