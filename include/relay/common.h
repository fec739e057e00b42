/*
 * Small definitions shared by every module: exit codes from sysexits(3), the
 * RELAY_STATIC seam that lets unit tests reach file-local functions, and the
 * limits that bound every size that comes from data.
 */
#ifndef RELAY_COMMON_H
#define RELAY_COMMON_H

#include <stddef.h>

/* Unit tests compile a module with RELAY_STATIC defined empty (curl UNITTEST). */
#ifndef RELAY_STATIC
#define RELAY_STATIC static
#endif

/* sysexits(3) codes, spelled out so no header is needed. */
#define RELAY_EX_OK 0
#define RELAY_EX_USAGE 64
#define RELAY_EX_DATAERR 65
#define RELAY_EX_UNAVAILABLE 69
#define RELAY_EX_SOFTWARE 70
#define RELAY_EX_OSERR 71
#define RELAY_EX_TEMPFAIL 75
#define RELAY_EX_NOPERM 77
#define RELAY_EX_CONFIG 78

/* Topics: 1..RELAY_TOPIC_MAX bytes of [A-Za-z0-9._-], safe inside a {hash tag}. */
#define RELAY_TOPIC_MAX 200
/* Headers: at most this many per message, each name and value capped. */
#define RELAY_HEADERS_MAX 64
#define RELAY_HEADER_NAME_MAX 128
#define RELAY_HEADER_VALUE_MAX 8192
/* Partition keys are capped so one row cannot blow up a command. */
#define RELAY_KEY_MAX 1024
/* Error text stored in outbox.messages.last_error is capped to this. */
#define RELAY_ERROR_MAX 512

#define RELAY_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#endif
