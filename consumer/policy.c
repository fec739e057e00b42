/*
 * What the library answers without a connection (include/outbox/consumer.h):
 * the names of a group's dead-letter and replay streams and of a topic's
 * lease keys, the backoff before each delivery, and how long a message can
 * keep coming back. Every other file of the library may ask; this one asks
 * none of them.
 */
#include "common/compat.h"

#include "consumer/internal.h"

#include <stdint.h>
#include <string.h>

#include "common/common.h"
#include "common/keys.h"

static const uint32_t default_backoff[] = {1000, 10000, 100000, 1000000};

int outbox_consumer_dlq_name(const char *stream, const char *group, char *out, size_t outlen)
{
    return outbox_key_dlq(stream, group, out, outlen);
}

int outbox_consumer_replay_name(const char *stream, const char *group, char *out, size_t outlen)
{
    return outbox_key_replay(stream, group, out, outlen);
}

int outbox_consumer_lease_names(const char *stream, const char *group, char *lease, char *token,
                                size_t outlen)
{
    /* The counter's name is the longer: when it fits, both do. */
    if (strlen(stream) + strlen(group) + sizeof("{}:lease-token:") > outlen)
        return -1;
    if (outbox_key_lease(stream, group, "lease-token", token, outlen) < 0)
        return -1;
    return outbox_key_lease(stream, group, "lease", lease, outlen);
}

uint32_t outbox_consumer_backoff_ms(const struct outbox_consumer_options *opts, uint32_t deliveries)
{
    const uint32_t *b = opts->nbackoff ? opts->backoff_ms : default_backoff;
    uint32_t n = opts->nbackoff ? opts->nbackoff : OUTBOX_ARRAY_LEN(default_backoff);
    uint32_t i = deliveries == 0 ? 0 : deliveries - 1;
    return b[i < n ? i : n - 1];
}

uint64_t outbox_consumer_redelivery_horizon_ms(const struct outbox_consumer_options *opts)
{
    uint32_t deliveries = opts->max_deliveries ? opts->max_deliveries : 5;
    uint32_t reclaim = opts->reclaim_interval_ms ? opts->reclaim_interval_ms : 250;
    uint64_t ms = 0;
    for (uint32_t d = 1; d < deliveries; d++)
        ms += (uint64_t)outbox_consumer_backoff_ms(opts, d) + reclaim;
    return ms;
}

/* The shortest backoff step: the idle time from which the unordered mode's
 * reclaim pass looks at pending entries. */
uint32_t outbox_policy_min_backoff(const struct outbox_consumer_options *o)
{
    uint32_t n = o->nbackoff ? o->nbackoff : OUTBOX_ARRAY_LEN(default_backoff);
    uint32_t m = UINT32_MAX;
    for (uint32_t d = 1; d <= n; d++) {
        uint32_t b = outbox_consumer_backoff_ms(o, d);
        if (b < m)
            m = b;
    }
    return m;
}
