/* The growable buffer (common/buf.h). */
#include "common/compat.h"

#include "common/buf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int outbox_buf_reserve(struct outbox_buf *b, size_t need)
{
    size_t max = b->max ? b->max : OUTBOX_BUF_MAX_DEFAULT;
    /* len + need + 1 <= max, written so that nothing overflows */
    if (need >= max || b->len > max - need - 1)
        return OUTBOX_BUF_FULL;
    size_t want = b->len + need + 1;
    if (want <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 4096;
    if (cap > max)
        cap = max;
    while (cap < want)
        cap = cap > max / 2 ? max : cap * 2;
    char *p = realloc(b->data, cap);
    if (p == NULL)
        return OUTBOX_BUF_NOMEM;
    if (b->data == NULL)
        p[0] = '\0';
    b->data = p;
    b->cap = cap;
    return 0;
}

void outbox_buf_append(struct outbox_buf *b, const void *p, size_t n)
{
    if (b->failed)
        return;
    if (outbox_buf_reserve(b, n) != 0) {
        b->failed = 1;
        return;
    }
    if (n > 0)
        memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0';
}

void outbox_buf_puts(struct outbox_buf *b, const char *s)
{
    outbox_buf_append(b, s, strlen(s));
}

void outbox_buf_printf(struct outbox_buf *b, const char *fmt, ...)
{
    if (b->failed)
        return;
    for (int tries = 0; tries < 2; tries++) {
        size_t room = b->cap > b->len ? b->cap - b->len : 0;
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(room ? b->data + b->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0)
            break;
        if ((size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        if (outbox_buf_reserve(b, (size_t)n) != 0)
            break;
    }
    /* A failed vsnprintf may have written into the spare room: keep the
     * terminating NUL where len says. */
    if (b->data != NULL)
        b->data[b->len] = '\0';
    b->failed = 1;
}

void outbox_buf_reset(struct outbox_buf *b)
{
    b->len = 0;
    b->failed = 0;
    if (b->data != NULL)
        b->data[0] = '\0';
}

void outbox_buf_free(struct outbox_buf *b)
{
    if (b == NULL)
        return;
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
    b->failed = 0;
}
