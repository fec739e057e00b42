/*
 * Feature macros, included first by every .c file (hiredis fmacros.h): the
 * POSIX 2008 and BSD interfaces the relay uses (clock_gettime, strdup,
 * random, sendto flags) without relying on the compiler's defaults.
 */
#ifndef OUTBOX_COMPAT_H
#define OUTBOX_COMPAT_H

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#ifndef _DEFAULT_SOURCE
#define _DEFAULT_SOURCE 1
#endif

#endif
