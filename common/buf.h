/*
 * The one growable byte buffer of the project: the metrics page, the SQL that
 * ends a cycle and the Redis protocol the relay writes all grow in it.
 *
 * Zero-initialise it (optionally set max), append, read data[0..len), then
 * reset to reuse the memory or free to release it. data is always
 * NUL-terminated once anything was reserved, so text can be handed to C
 * string functions as it is; binary data may hold NULs of its own.
 *
 * A buffer never grows past max bytes (0: OUTBOX_BUF_MAX_DEFAULT), counting
 * the terminating NUL. An append that would take it past max, or that finds
 * no memory, appends nothing and sets failed, which sticks until reset: a
 * writer can append a whole text and check once at the end.
 */
#ifndef OUTBOX_BUF_H
#define OUTBOX_BUF_H

#include <stdarg.h>
#include <stddef.h>

struct outbox_buf {
    char *data;
    size_t len, cap;
    size_t max; /* 0: OUTBOX_BUF_MAX_DEFAULT */
    int failed; /* an append did not fit or found no memory */
};

#define OUTBOX_BUF_MAX_DEFAULT ((size_t)1 << 30)

/* outbox_buf_reserve's answers besides 0. */
#define OUTBOX_BUF_FULL (-2) /* past max */
#define OUTBOX_BUF_NOMEM (-1)

/*
 * Makes room for need more bytes after len (plus the terminating NUL)
 * without changing len, so a caller that knows the exact size of what it
 * writes can write it straight into data + len. Returns 0, OUTBOX_BUF_FULL or
 * OUTBOX_BUF_NOMEM; on failure the buffer is as it was (failed is not set:
 * the caller decides).
 */
int outbox_buf_reserve(struct outbox_buf *b, size_t need) __attribute__((warn_unused_result));

/* Appends n bytes (binary-safe) or a C string, or sets failed. */
void outbox_buf_append(struct outbox_buf *b, const void *p, size_t n);
void outbox_buf_puts(struct outbox_buf *b, const char *s);
/* Appends formatted text, or sets failed. */
void outbox_buf_printf(struct outbox_buf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Empties b and clears failed; keeps its memory and max. */
void outbox_buf_reset(struct outbox_buf *b);
/* Releases b's memory and empties it (max is kept). NULL-safe. */
void outbox_buf_free(struct outbox_buf *b);

#endif
