/*
 * Small definitions shared by every module: exit codes from sysexits(3), the
 * OUTBOX_STATIC seam that lets unit tests reach file-local functions, and the
 * limits that bound every size that comes from data.
 */
#ifndef OUTBOX_COMMON_H
#define OUTBOX_COMMON_H

#include <stddef.h>

/* Unit tests compile a module with OUTBOX_STATIC defined empty (curl UNITTEST). */
#ifndef OUTBOX_STATIC
#define OUTBOX_STATIC static
#endif

/* sysexits(3) codes, spelled out so no header is needed. */
#define OUTBOX_EX_OK 0
#define OUTBOX_EX_USAGE 64
#define OUTBOX_EX_DATAERR 65
#define OUTBOX_EX_UNAVAILABLE 69
#define OUTBOX_EX_SOFTWARE 70
#define OUTBOX_EX_OSERR 71
#define OUTBOX_EX_TEMPFAIL 75
#define OUTBOX_EX_NOPERM 77
#define OUTBOX_EX_CONFIG 78

/* Topics: 1..OUTBOX_TOPIC_MAX bytes of [A-Za-z0-9._-], safe inside a {hash tag}. */
#define OUTBOX_TOPIC_MAX 200
/* Headers: at most this many per message, each name and value capped. */
#define OUTBOX_HEADERS_MAX 64
#define OUTBOX_HEADER_NAME_MAX 128
#define OUTBOX_HEADER_VALUE_MAX 8192
/* Partition keys are capped so one row cannot blow up a command. */
#define OUTBOX_KEY_MAX 1024
/* Error text stored in outbox.messages.last_error is capped to this. */
#define OUTBOX_ERROR_MAX 512

#define OUTBOX_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#endif
