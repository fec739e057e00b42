/*
 * Dividing the partitions of the partitioned topics among the relays that
 * run against one database (docs/DESIGN.md, "Several relays"): the pure part
 * of relay/ownership_io.c. Every relay holds a member slot; the partitions, listed
 * topic by topic in name order and partition by partition, go round-robin
 * to the members in slot order, so each relay wants the same share (at most
 * one more than another's) and all relays compute the same assignment from
 * the same two lists.
 */
#ifndef RELAY_OWNERSHIP_H
#define RELAY_OWNERSHIP_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

/* One partition of a partitioned topic, as one relay sees it. */
struct relay_unit {
    char topic[OUTBOX_TOPIC_MAX + 1];
    uint32_t partition;
    int32_t key;  /* its advisory lock's second key (relay_unit_key) */
    int want;     /* the assignment gives it to this relay */
    int held;     /* this relay's owner session holds its lock */
    int ready;    /* held: this relay publishes its rows */
    double since; /* when it was last taken, released or found wanted */
};

/* A partitioned topic and its count, from outbox.topics. */
struct relay_topic_parts {
    char topic[OUTBOX_TOPIC_MAX + 1];
    uint32_t partitions;
};

/* The lock key of a partition: fnv1a32 of the topic's name plus the
 * partition, in [0, 2^31). Two partitions that share a key share an owner:
 * relay_units_plan gives both to the owner of the first in plan order. */
int32_t relay_unit_key(const char *topic, size_t topic_len, uint32_t partition);

/* Whether the relay at position me of nmembers publishes an unpartitioned
 * topic: the hash of its name (outbox_partition_hash) mod nmembers is me.
 * With the members not known (nmembers 0, or me < 0: no slot listed), every
 * relay publishes it, as a lone relay must; entry ids make that safe. */
int relay_topic_wanted(const char *topic, size_t topic_len, size_t nmembers, long me);

/* The position of slot in members (sorted, ascending), or -1. */
long relay_member_position(const int32_t *members, size_t nmembers, int32_t slot);

/*
 * The relay's table after a look at the database: every partition that
 * exists now (topics sorted by name) or that the relay still holds, with
 * want set for its share (position me of nmembers; me < 0 wants none). The
 * held, ready and since of a unit carry over from old. Returns the number of
 * units written to out, or -1 if cap is too small or memory ran out.
 */
long relay_units_plan(const struct relay_unit *old, size_t nold,
                      const struct relay_topic_parts *topics, size_t ntopics, size_t nmembers,
                      long me, struct relay_unit *out, size_t cap);

#endif
