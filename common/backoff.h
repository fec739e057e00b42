/*
 * Jittered exponential backoff, pure: the caller supplies the random source so
 * unit tests are deterministic. Used for every reconnect and every retried batch.
 */
#ifndef OUTBOX_BACKOFF_H
#define OUTBOX_BACKOFF_H

#include <stdint.h>

struct outbox_backoff {
    uint32_t min_ms;  /* first delay's ceiling */
    uint32_t max_ms;  /* no delay exceeds this */
    uint32_t attempt; /* failures since the last success */
};

void outbox_backoff_init(struct outbox_backoff *b, uint32_t min_ms, uint32_t max_ms);

/*
 * Returns the next delay in milliseconds and counts one more failure. The ceiling
 * doubles per failure from min_ms up to max_ms; the delay is drawn uniformly from
 * [ceiling/2, ceiling] using rnd (any 32-bit random value), so a fleet of relays
 * does not reconnect in lockstep.
 */
uint32_t outbox_backoff_next(struct outbox_backoff *b, uint32_t rnd);

/* Forgets past failures after a success. */
void outbox_backoff_reset(struct outbox_backoff *b);

/* A random 32-bit value from the process's generator (seeded at start-up). */
uint32_t outbox_backoff_random(void);

#endif
