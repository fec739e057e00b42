/*
 * The parts of "outbox-relay dlq" (tools/dlq.c) that reach past one
 * function: the command's state, a selection of entries, and the parsers of
 * what an operator types and of what Redis answers. Private to tools/dlq.c;
 * its fuzz target (tests/fuzz/fuzz_tools.c) includes it too, and links the
 * parsers with OUTBOX_STATIC empty.
 */
#ifndef RELAY_TOOLS_DLQ_H
#define RELAY_TOOLS_DLQ_H

#include <stdio.h>

#include "common/common.h" /* OUTBOX_STATIC */
#include "core/text.h"     /* RELAY_ESCAPED_SIZE */

struct redisContext;
struct redisReply;

/* Longest stream, dead-letter or replay name we handle (the names are ours). */
#define DLQ_NAME_MAX 1024
/* Entries read per XRANGE while walking a range. */
#define DLQ_PAGE 100
/* Columns of the error text in "dlq list". */
#define DLQ_ERROR_COLS 80
#define DLQ_LIST_MAX 1000000

struct dlq_ctx {
    struct redisContext *c;
    FILE *out;
    FILE *errout;
    const char *stream;
    const char *group;
    char dlq[DLQ_NAME_MAX];
    char replay[DLQ_NAME_MAX];
    struct {
        /* The names as messages show them (relay_text_escape): a name may be
         * any bytes, and the operator may have typed them as $'\x1b...'. */
        char stream[RELAY_ESCAPED_SIZE(DLQ_NAME_MAX)];
        char group[RELAY_ESCAPED_SIZE(DLQ_NAME_MAX)];
        char dlq[RELAY_ESCAPED_SIZE(DLQ_NAME_MAX)];
        char replay[RELAY_ESCAPED_SIZE(DLQ_NAME_MAX)];
    } shown;
    char where[512]; /* redis://user:***@host:port/db, for messages */
};

/* One selection argument: an entry id, or an inclusive range of them. */
struct dlq_sel {
    char from[48]; /* "<ms>-<seq>" */
    char to[48];   /* same as from for a single id */
    int is_range;
};

/* Fills d's names of the group's dead-letter and replay streams: 0, or -1
 * with the reason written to d->errout. */
OUTBOX_STATIC int dlq_names(struct dlq_ctx *d, const char *stream, const char *group);

/* 1 when e is an XRANGE entry: an id and an array of fields. */
OUTBOX_STATIC int entry_ok(const struct redisReply *e);

/* Writes one line of "dlq list" for the entry e to d->out. */
OUTBOX_STATIC void list_entry(struct dlq_ctx *d, const struct redisReply *e);

/* "dlq list"'s options after STREAM GROUP: 0 with *count, or -1 (usage
 * written to errout). */
OUTBOX_STATIC int parse_list_args(int argc, char **argv, FILE *errout, long long *count);

/* The ids and FROM-TO ranges of "dlq show|replay|purge" (or --all): 0 with
 * sels[0..*nsel) and *all, or -1 (usage written to errout). */
OUTBOX_STATIC int parse_selections(const char *verb, int argc, char **argv, FILE *errout,
                                   struct dlq_sel *sels, int *nsel, int *all);

#endif
