/*
 * Jittered exponential backoff ("equal jitter"): the ceiling doubles with each
 * failure and the delay is drawn from its upper half, so retries spread out
 * without ever collapsing to zero.
 */
#include "common/compat.h"

#include "common/backoff.h"

#include <stdlib.h>

void outbox_backoff_init(struct outbox_backoff *b, uint32_t min_ms, uint32_t max_ms)
{
    b->min_ms = min_ms ? min_ms : 1;
    b->max_ms = max_ms < b->min_ms ? b->min_ms : max_ms;
    b->attempt = 0;
}

uint32_t outbox_backoff_next(struct outbox_backoff *b, uint32_t rnd)
{
    uint64_t ceiling = b->min_ms;
    for (uint32_t i = 0; i < b->attempt && ceiling < b->max_ms; i++)
        ceiling *= 2;
    if (ceiling > b->max_ms)
        ceiling = b->max_ms;
    if (b->attempt < UINT32_MAX)
        b->attempt++;
    uint64_t half = ceiling / 2;
    uint64_t span = ceiling - half + 1;
    return (uint32_t)(half + rnd % span);
}

void outbox_backoff_reset(struct outbox_backoff *b)
{
    b->attempt = 0;
}

uint32_t outbox_backoff_random(void)
{
    return (uint32_t)random();
}
