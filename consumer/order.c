/*
 * The pure decisions of an ordered consumer (consumer/order.h).
 *
 * A key's entries are handled one at a time, in id order: an entry that
 * failed for a reason that may pass holds back the later entries of its key
 * until it is acknowledged or dead-lettered, and the other keys of the
 * partition go on meanwhile. The entries in hand are few (the consumer reads
 * a partition `count` entries at a time), so a scan from the front is as
 * good as an index.
 */
#include "common/compat.h"

#include "consumer/order.h"

#include <string.h>

static int same_key(const struct outbox_order_item *a, const struct outbox_order_item *b)
{
    return a->has_key && b->has_key && a->key_len == b->key_len &&
           memcmp(a->key, b->key, a->key_len) == 0;
}

long outbox_order_next(const struct outbox_order_item *items, size_t n, long long now,
                       long long *wake_at)
{
    long long wake = -1;
    for (size_t i = 0; i < n; i++) {
        const struct outbox_order_item *it = &items[i];
        if (it->done)
            continue;
        int behind = 0;
        for (size_t j = 0; j < i && !behind; j++)
            behind = !items[j].done && same_key(&items[j], it);
        if (behind)
            continue;
        if (it->retry_at <= now)
            return (long)i;
        if (wake < 0 || it->retry_at < wake)
            wake = it->retry_at;
    }
    if (wake_at != NULL)
        *wake_at = wake;
    return -1;
}

int outbox_order_mine(uint32_t p, uint32_t rank, uint32_t members)
{
    return members > 0 && p % members == rank;
}
