/*
 * What the operator tools share: showing bytes that may be anything.
 *
 * Topics and errors come from producers, stream, group and field names and
 * payloads from whoever can write to Redis, and the tools print them on an
 * operator's terminal. A terminal acts on some bytes instead of showing them:
 * ESC starts sequences that retitle it, clear it or rewrite its lines, BEL,
 * CR and newline move or forge lines, the C1 controls (U+0080..U+009F) act
 * like ESC sequences on some terminals, and the bidirectional overrides
 * reorder the rest of the line. Every human line of every tool goes through
 * one form here, which shows all of those, and any byte that is not UTF-8,
 * as \xNN, so nothing shown can act and the text still says which bytes are
 * stored. Scripts get JSON instead, which needs no such form.
 *
 * Also the one bounded writer of text into a caller's array (the
 * configuration's messages and documents, the status page).
 */
#include "common/compat.h"

#include "core/text.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

size_t relay_text_utf8_char(const char *s, size_t len, unsigned long *cp)
{
    const unsigned char *p = (const unsigned char *)s;
    unsigned char lo = 0x80, hi = 0xbf; /* the range of the second byte */
    unsigned long v;
    size_t need;

    if (len == 0)
        return 0;
    if (p[0] < 0x80) {
        v = p[0];
        need = 0;
    } else if (p[0] >= 0xc2 && p[0] <= 0xdf) {
        v = p[0] & 0x1fu;
        need = 1;
    } else if (p[0] >= 0xe0 && p[0] <= 0xef) {
        v = p[0] & 0x0fu;
        need = 2;
        if (p[0] == 0xe0)
            lo = 0xa0; /* no overlong forms */
        else if (p[0] == 0xed)
            hi = 0x9f; /* no surrogates */
    } else if (p[0] >= 0xf0 && p[0] <= 0xf4) {
        v = p[0] & 0x07u;
        need = 3;
        if (p[0] == 0xf0)
            lo = 0x90; /* no overlong forms */
        else if (p[0] == 0xf4)
            hi = 0x8f; /* nothing above U+10FFFF */
    } else {
        return 0; /* a continuation byte, 0xc0, 0xc1 or 0xf5.. */
    }
    if (len < need + 1 || (need > 0 && (p[1] < lo || p[1] > hi)))
        return 0;
    for (size_t k = 1; k <= need; k++) {
        if ((p[k] & 0xc0) != 0x80)
            return 0;
        v = (v << 6) | (p[k] & 0x3fu);
    }
    if (cp != NULL)
        *cp = v;
    return need + 1;
}

int relay_text_control_char(unsigned long cp)
{
    return cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp <= 0x9f) ||
           (cp >= 0x202a && cp <= 0x202e) || (cp >= 0x2066 && cp <= 0x2069);
}

/* One character of the input as shown: its bytes, the input bytes it stands
 * for, and the columns it takes. */
struct shown {
    char buf[8];
    size_t blen, used, cols;
};

static void show_next(const char *s, size_t len, unsigned flags, struct shown *sh)
{
    unsigned char c = (unsigned char)s[0];
    unsigned long cp;
    size_t n;

    if (c == '\\' || (c == '"' && (flags & RELAY_ESCAPE_QUOTE))) {
        sh->buf[0] = '\\';
        sh->buf[1] = (char)c;
        sh->blen = sh->cols = 2;
        sh->used = 1;
    } else if ((n = relay_text_utf8_char(s, len, &cp)) > 0 && !relay_text_control_char(cp)) {
        memcpy(sh->buf, s, n);
        sh->blen = sh->used = n;
        sh->cols = 1;
    } else {
        /* A control, or a byte that is not UTF-8: one byte at a time, so
         * every byte of a C1 control or an override is shown. */
        snprintf(sh->buf, sizeof(sh->buf), "\\x%02x", c);
        sh->blen = sh->cols = 4;
        sh->used = 1;
    }
}

/* Where the form goes: a FILE, or a buffer with room for cap bytes. */
struct sink {
    FILE *f;
    char *dst;
    size_t cap, len;
};

static void emit(struct sink *o, const char *b, size_t n)
{
    if (o->f != NULL) {
        fwrite(b, 1, n, o->f);
    } else {
        memcpy(o->dst + o->len, b, n);
        o->len += n;
    }
}

static size_t escape(struct sink *o, const char *s, size_t len, size_t maxcols, unsigned flags)
{
    size_t colroom = maxcols > 0 ? maxcols : SIZE_MAX;
    size_t room = o->f != NULL ? SIZE_MAX : o->cap;
    struct shown sh;
    size_t i, cols, bytes;
    int cut = 0;

    /* First see whether the whole form fits; if not, keep room for "...". */
    if (colroom != SIZE_MAX || room != SIZE_MAX) {
        for (i = 0, cols = 0, bytes = 0; i < len && !cut; i += sh.used) {
            show_next(s + i, len - i, flags, &sh);
            cols += sh.cols;
            bytes += sh.blen;
            cut = cols > colroom || bytes > room;
        }
        if (cut) {
            colroom = colroom > 3 ? colroom - 3 : 0;
            room = room > 3 ? room - 3 : 0;
        }
    }
    for (i = 0, cols = 0, bytes = 0; i < len; i += sh.used) {
        show_next(s + i, len - i, flags, &sh);
        if (cols + sh.cols > colroom || bytes + sh.blen > room)
            break;
        emit(o, sh.buf, sh.blen);
        cols += sh.cols;
        bytes += sh.blen;
    }
    if (cut && (o->f != NULL || o->cap - o->len >= 3)) {
        emit(o, "...", 3);
        cols += 3;
    }
    return cols;
}

size_t relay_text_escape(char *dst, size_t dstlen, const char *s, size_t len, size_t maxcols,
                         unsigned flags)
{
    if (dstlen == 0)
        return 0;
    struct sink o = {NULL, dst, dstlen - 1, 0};
    size_t cols = escape(&o, s, len, maxcols, flags);
    dst[o.len] = '\0';
    return cols;
}

size_t relay_text_put_escaped(FILE *f, const char *s, size_t len, size_t maxcols, unsigned flags)
{
    struct sink o = {f, NULL, 0, 0};
    return escape(&o, s, len, maxcols, flags);
}

void relay_text_put_column(FILE *f, const char *s, size_t len, size_t width, size_t maxcols)
{
    size_t cols = relay_text_put_escaped(f, s, len, maxcols, 0);
    do
        fputc(' ', f);
    while (++cols < width + 1);
}

int relay_text_ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* ---- bounded text ----------------------------------------------------- */

void relay_text_out_init(struct relay_text_out *o, char *p, size_t cap)
{
    o->p = p;
    o->cap = cap;
    o->len = 0;
    if (cap > 0)
        p[0] = '\0';
}

void relay_text_out_putn(struct relay_text_out *o, const char *s, size_t n)
{
    size_t room;

    if (o->cap == 0)
        return;
    room = o->cap - 1 - o->len;
    if (n > room)
        n = room;
    memcpy(o->p + o->len, s, n);
    o->len += n;
    o->p[o->len] = '\0';
}

void relay_text_out_puts(struct relay_text_out *o, const char *s)
{
    relay_text_out_putn(o, s, strlen(s));
}

void relay_text_out_printf(struct relay_text_out *o, const char *fmt, ...)
{
    va_list ap;
    size_t room;
    int n;

    if (o->cap == 0)
        return;
    room = o->cap - o->len;
    va_start(ap, fmt);
    n = vsnprintf(o->p + o->len, room, fmt, ap);
    va_end(ap);
    if (n < 0)
        o->p[o->len] = '\0';
    else if ((size_t)n >= room)
        o->len = o->cap - 1; /* truncated: vsnprintf filled what fits */
    else
        o->len += (size_t)n;
}
