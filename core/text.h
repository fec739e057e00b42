/*
 * Text that may hold any bytes, shown on a terminal or in a log line: the one
 * escaped form that the operator commands and the daemon's log use; and text
 * written into a bounded array.
 */
#ifndef RELAY_TEXT_H
#define RELAY_TEXT_H

#include <stddef.h>
#include <stdio.h>

/*
 * Showing bytes that may be anything (core/text.c). Every human line a tool
 * prints with a topic, a name, an error or a payload in it uses this one form:
 * printable ASCII and UTF-8 characters as they are, a backslash as \\ (and,
 * with RELAY_ESCAPE_QUOTE, a double quote as \"), and as \xNN each byte of a
 * control character (relay_text_control_char) and each byte that is not part
 * of valid UTF-8. Nothing shown can move the cursor, retitle or clear the
 * terminal, forge a line or reorder one, and the form still says which bytes
 * are stored. JSON output does not use it: JSON escapes carry the exact text.
 */
#define RELAY_ESCAPE_QUOTE 1u

/* Bytes that always hold the whole form of len bytes (and a NUL). */
#define RELAY_ESCAPED_SIZE(len) (4 * (len) + 1)

/*
 * The length (1 to 4) of the valid UTF-8 character at s, which has len bytes,
 * and its code point in *cp (cp may be NULL); 0 when s does not start with
 * one: a stray continuation byte, an overlong form, a surrogate, a value above
 * U+10FFFF or a character cut short.
 */
size_t relay_text_utf8_char(const char *s, size_t len, unsigned long *cp);

/*
 * 1 for a character a terminal acts on instead of showing: the C0 controls,
 * DEL, the C1 controls (U+0080..U+009F) and the bidirectional embeddings,
 * overrides and isolates (U+202A..U+202E, U+2066..U+2069).
 */
int relay_text_control_char(unsigned long cp);

/* 1 when s ends with suffix. */
int relay_text_ends_with(const char *s, const char *suffix);

/*
 * Writes the form of s[0..len) into dst, which has dstlen bytes, and a NUL
 * (nothing when dstlen is 0). A form longer than maxcols columns (when
 * maxcols, at least 3, is not 0) or than dst holds is cut between characters,
 * never inside one or inside an escape, and ends in "...", within both. A
 * character counts one column, \\ two and \xNN four. Returns the columns
 * written.
 */
size_t relay_text_escape(char *dst, size_t dstlen, const char *s, size_t len, size_t maxcols,
                         unsigned flags);

/* The same form written to f, for text of any size; returns the columns written. */
size_t relay_text_put_escaped(FILE *f, const char *s, size_t len, size_t maxcols, unsigned flags);

/* relay_text_put_escaped with no flags, then spaces up to width columns and
 * one more: a column of a table. */
void relay_text_put_column(FILE *f, const char *s, size_t len, size_t width, size_t maxcols);

/*
 * Text written into an array of the caller's: each append writes what fits
 * and drops the rest, and the text stays NUL-terminated, so a long text is
 * cut, never overrun. Initialise with relay_text_out_init; len is the length
 * written.
 */
struct relay_text_out {
    char *p;
    size_t cap; /* bytes at p, NUL included */
    size_t len;
};

void relay_text_out_init(struct relay_text_out *o, char *p, size_t cap);
void relay_text_out_putn(struct relay_text_out *o, const char *s, size_t n);
void relay_text_out_puts(struct relay_text_out *o, const char *s);
void relay_text_out_printf(struct relay_text_out *o, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
