/*
 * The operator commands (tools/): their arguments, which an operator types
 * and scripts pass on, and the dead letters they show, which come from
 * Redis. The first byte picks what the rest is:
 *   0  "outbox-relay dlq VERB STREAM GROUP ARGS..." arguments, split at NUL
 *      bytes: the names, "list --count N", and the entry ids and FROM-TO
 *      ranges of "show", "replay" and "purge";
 *   1  "outbox-relay failed VERB ARGS...": "list --limit N" and the row ids
 *      of "retry" and "drop", into the SQL array they become;
 *   2  "outbox-relay status ARGS...";
 *   3  an XRANGE entry of a dead-letter stream in the Redis protocol, shown
 *      as "dlq list" and "dlq show" show it.
 * Only the parsing runs: nothing connects to a server.
 */
#include "common/compat.h"

#include <hiredis/hiredis.h>

#include "tools/dlq.h"

#include "fuzz.h"

/* File-local in tools/failed.c and tools/status.c (OUTBOX_STATIC is empty in
 * relay_unit); tools/dlq.h declares dlq.c's. */
int parse_id(const char *s, long long *out);
char *id_array(int nids, char **ids, FILE *errout, int *rc);
int parse_status_args(int argc, char **argv, FILE *errout, int *json);

#define ARGS_MAX 64

static FILE *devnull(void)
{
    static FILE *f;
    if (f == NULL && (f = fopen("/dev/null", "w")) == NULL)
        abort();
    return f;
}

/* An entry id as Redis writes it: "<ms>-<seq>", both decimal. */
static void check_id(const char *id)
{
    char *end;
    if (*id < '0' || *id > '9')
        fuzz_fail("an entry id that does not start with a digit", id);
    (void)strtoull(id, &end, 10);
    if (*end != '-' || end[1] < '0' || end[1] > '9')
        fuzz_fail("an entry id without its dash", id);
    (void)strtoull(end + 1, &end, 10);
    if (*end != '\0')
        fuzz_fail("an entry id with more after it", id);
}

static void dlq_args(int argc, char **argv)
{
    struct dlq_ctx d;
    memset(&d, 0, sizeof(d));
    d.out = d.errout = devnull();
    if (argc < 4 || dlq_names(&d, argv[2], argv[3]) < 0)
        return;
    if (strlen(d.dlq) >= sizeof(d.dlq) || strlen(d.replay) >= sizeof(d.replay))
        fuzz_fail("a dead-letter name that overflows", NULL);
    if (strcmp(argv[1], "list") == 0) {
        long long count = 100;
        if (parse_list_args(argc, argv, d.errout, &count) == 0 &&
            (count < 1 || count > DLQ_LIST_MAX))
            fuzz_fail("a count out of range", NULL);
        return;
    }
    struct dlq_sel *sels = calloc((size_t)argc, sizeof(*sels));
    int nsel = 0, all = 0;
    if (sels == NULL)
        abort();
    if (parse_selections(argv[1], argc, argv, d.errout, sels, &nsel, &all) == 0) {
        if (nsel > argc - 4 || (all && nsel > 0))
            fuzz_fail("selections out of range", NULL);
        for (int i = 0; i < nsel; i++) {
            check_id(sels[i].from);
            check_id(sels[i].to);
            if (!sels[i].is_range && strcmp(sels[i].from, sels[i].to) != 0)
                fuzz_fail("a single id with two ends", sels[i].from);
        }
    }
    free(sels);
}

static void failed_args(int argc, char **argv)
{
    if (argc < 2)
        return;
    if (strcmp(argv[1], "list") == 0) {
        for (int i = 2; i + 1 < argc; i++) {
            long long limit;
            if (strcmp(argv[i], "--limit") == 0 && parse_id(argv[i + 1], &limit) == 0 && limit < 1)
                fuzz_fail("a limit out of range", argv[i + 1]);
        }
        return;
    }
    int rc = 0;
    char *arr = id_array(argc - 2, argv + 2, devnull(), &rc);
    if (arr == NULL)
        return;
    /* '{1,2,3}': what PostgreSQL reads as a bigint[]. */
    size_t len = strlen(arr);
    if (len < 2 || arr[0] != '{' || arr[len - 1] != '}' ||
        strspn(arr + 1, "0123456789,") != len - 2)
        fuzz_fail("an id array PostgreSQL would not read", arr);
    free(arr);
}

static void dlq_entry(const uint8_t *data, size_t size)
{
    struct dlq_ctx d;
    redisReply *e = NULL;
    if (fuzz_replies(data, size, &e, 1) != 1)
        return;
    memset(&d, 0, sizeof(d));
    d.out = d.errout = devnull();
    if (entry_ok(e))
        list_entry(&d, e);
    freeReplyObject(e);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    if (data[0] % 4 == 3) {
        dlq_entry(data + 1, size - 1);
        return 0;
    }
    char *buf, **argv;
    /* argv[0] is the command's name, as cli/main.c passes it on. */
    static const char *const names[] = {"dlq", "failed", "status"};
    int argc = fuzz_args(data + 1, size - 1, names[data[0] % 4], &buf, &argv, ARGS_MAX);
    switch (data[0] % 4) {
    case 0:
        dlq_args(argc, argv);
        break;
    case 1:
        failed_args(argc, argv);
        break;
    default: {
        int json = -1;
        if (parse_status_args(argc, argv, devnull(), &json) == 0 && json != 0 && json != 1)
            fuzz_fail("status --json neither on nor off", NULL);
        break;
    }
    }
    free(argv);
    free(buf);
    return 0;
}
