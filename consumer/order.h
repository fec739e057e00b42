/*
 * The pure decisions of an ordered consumer (consumer/order.c; docs/
 * CONSUMERS.md, "Ordered consumers"): which partitions are this consumer's
 * share, and which of a partition's entries in hand may be handled next.
 * No I/O; the consumer library's ordered mode calls them.
 */
#ifndef OUTBOX_ORDER_H
#define OUTBOX_ORDER_H

#include <stddef.h>
#include <stdint.h>

/*
 * One entry in hand of a partition, in id order. An entry without a key has
 * no order to keep: it never waits for, nor holds back, another.
 */
struct outbox_order_item {
    const char *key;
    size_t key_len;
    long long retry_at; /* may be handled from this time on (ms) */
    int has_key;
    int done; /* acknowledged or dead-lettered: holds back nothing */
};

/*
 * The next entry to handle at time now: the first entry, in order, that is
 * not done, whose retry_at has come, and behind no earlier entry of its key
 * that is not done. Returns its index, or -1 when none may be handled now;
 * then *wake_at (when not NULL) is the earliest retry_at of an entry that
 * waits only for its backoff, or -1 when every entry waits for another.
 */
long outbox_order_next(const struct outbox_order_item *items, size_t n, long long now,
                       long long *wake_at);

/*
 * Whether partition p is the share of the member at position rank (0-based,
 * in the members' name order) of members: partitions go round-robin,
 * p % members == rank. No member (members 0) has a share.
 */
int outbox_order_mine(uint32_t p, uint32_t rank, uint32_t members);

#endif
