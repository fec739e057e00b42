/*
 * The partitions' leases of the ordered mode (consumer/leases.c), which the
 * ordered loop (consumer/ordered.c) calls.
 */
#ifndef OUTBOX_CONSUMER_LEASES_H
#define OUTBOX_CONSUMER_LEASES_H

#include <stddef.h>

#include "consumer/part.h"

/* Beats, renews, gives up what is not this consumer's share and takes what
 * is. */
void outbox_lease_upkeep(struct outbox_consumer *c, struct ordered *od);

/* The lease of a partition held is lost (why, for the log): counted, logged,
 * and the partition dropped. */
void outbox_lease_lost(struct outbox_consumer *c, struct part *pt, const char *why);

/* Gives a partition's lease up (why, for the log) and drops the partition. */
void outbox_lease_release(struct outbox_consumer *c, struct part *pt, const char *why);

/* Reads a partition's parked keys (park_keys): 0, or -1 when the connection
 * failed or Redis refused (the problem recorded). */
int outbox_lease_load_parked(struct outbox_consumer *c, struct part *pt);

/* Whether key is parked on the partition (as last read). */
int outbox_lease_is_parked(const struct part *pt, const char *key, size_t len);

#endif
