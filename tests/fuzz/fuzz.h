/*
 * What the fuzz targets share: the libFuzzer entry point's prototype, and
 * turning bytes into the shapes the parsers take (a NUL-terminated string, a
 * vector of arguments, a tree of Redis replies).
 */
#ifndef RELAY_FUZZ_H
#define RELAY_FUZZ_H

#include <hiredis/hiredis.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A broken promise: says which, with the text that shows it, and crashes. */
__attribute__((noreturn)) static inline void fuzz_fail(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz: %s: %s\n", what, detail != NULL ? detail : "");
    abort();
}

/* The bytes as a C string (cut at the first NUL); the caller frees it. */
static inline char *fuzz_string(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1);
    if (s == NULL)
        abort();
    memcpy(s, data, size);
    s[size] = '\0';
    return s;
}

/*
 * The bytes as the arguments of a command called name: argv[0] is name, the
 * rest are the bytes split at each NUL (argc in all, at most max, then a
 * NULL). The strings point into *buf; the caller frees *buf and *argv.
 */
static inline int fuzz_args(const uint8_t *data, size_t size, const char *name, char **buf,
                            char ***argv, int max)
{
    int argc = 0;
    *buf = malloc(size + 1 + strlen(name) + 1);
    *argv = calloc((size_t)max + 1, sizeof(**argv));
    if (*buf == NULL || *argv == NULL)
        abort();
    memcpy(*buf, data, size);
    (*buf)[size] = '\0';
    strcpy(*buf + size + 1, name);
    (*argv)[argc++] = *buf + size + 1;
    for (size_t i = 0; i <= size && argc < max;) {
        (*argv)[argc++] = *buf + i;
        i += strlen(*buf + i) + 1;
    }
    return argc;
}

/*
 * The complete replies at the start of the bytes, read by hiredis's protocol
 * reader as replies from Redis would be: at most max into out; returns how
 * many (fewer at a protocol error or an incomplete reply). The caller frees
 * each with freeReplyObject.
 */
static void *(*fuzz_create_array)(const redisReadTask *, int);

/* hiredis 0.14 allocates an array of as many elements as the reply's header
 * says before any of them arrive; the bytes may say billions. Real replies
 * of the shapes fuzzed here have a few thousand at most. */
static inline void *fuzz_bounded_array(const redisReadTask *task, int elements)
{
    if (elements > 4096)
        return NULL; /* the reader reports out of memory: not a reply */
    return fuzz_create_array(task, elements);
}

static inline int fuzz_replies(const uint8_t *data, size_t size, redisReply **out, int max)
{
    static redisReplyObjectFunctions fns;
    redisReader *r = redisReaderCreate();
    int n = 0;
    if (r == NULL)
        abort();
    if (fuzz_create_array == NULL) {
        fns = *r->fn;
        fuzz_create_array = fns.createArray;
        fns.createArray = fuzz_bounded_array;
    }
    r->fn = &fns;
    if (redisReaderFeed(r, (const char *)data, size) == REDIS_OK) {
        while (n < max) {
            void *reply = NULL;
            if (redisReaderGetReply(r, &reply) != REDIS_OK || reply == NULL)
                break;
            out[n++] = reply;
        }
    }
    redisReaderFree(r);
    return n;
}

/* Frees what fuzz_replies read. */
static inline void fuzz_replies_free(redisReply **rs, int n)
{
    for (int i = 0; i < n; i++)
        freeReplyObject(rs[i]);
}

#endif
