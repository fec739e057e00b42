/*
 * The state of the ordered mode of the consumer library (docs/CONSUMERS.md,
 * "Ordered consumers"): each partition stream and the entries in hand, which
 * ordered.c (handling them in order) and leases.c (the partitions' leases,
 * the group's members and the parked keys) share (consumer/part.c).
 *
 * The consumers of a group divide the partition streams of a topic through
 * the lease functions (functions/outbox_consumer.lua), and each handles its
 * partitions' entries one key at a time, in id order (consumer/order.c
 * decides which entry is next). Every call that touches a partition carries
 * the lease's token, so once a lease is lost (this process was frozen past
 * it, or its connection was slow) nothing more of that partition is read,
 * acknowledged or dead-lettered; the entries in hand are dropped
 * unacknowledged, and the next holder takes them over first.
 *
 * The members of the group beat in a sorted set "{<stream>}:lease-members:
 * <group>" (scored by Redis's clock); each member's share is the partitions p
 * with p % members == its rank in name order (outbox_order_mine). A member
 * gives up what is no longer its share and takes what is, as leases allow.
 */
#ifndef OUTBOX_CONSUMER_PART_H
#define OUTBOX_CONSUMER_PART_H

#include <stddef.h>
#include <stdint.h>

#include "consumer/internal.h"

/* One entry in a partition's hand. */
struct held {
    struct redisReply *entry; /* [id, fields], owned */
    int replayed;             /* read from the partition's replay stream */
    uint32_t deliveries;
    long long retry_at;
    int done;
    int dropped;     /* its key was parked: left pending, out of hand */
    char *dl_reason; /* a dead letter Redis refused, to write again */
    char *dl_why;
};

/* One partition stream of the topic, and what this consumer holds of it. */
struct part {
    uint32_t p;
    int node; /* its primary's connection: c->node[node] */
    char stream[NAME_MAX_LEN];
    char replay[2 * NAME_MAX_LEN + 16];
    char dlq[2 * NAME_MAX_LEN + 16];
    char lease[2 * NAME_MAX_LEN + 32];
    char tokens[2 * NAME_MAX_LEN + 32];
    long long token; /* 0: not held */
    char token_s[24];
    long long valid_until; /* ms: the lease's end at the latest, on our clock */
    int ready;             /* taken over in full: the others' pending entries, the
                              parked keys; only then is anything read or handled */
    int pel_done[2];       /* own pending entries read (main, replay) */
    char pel_cursor[2][64];
    char last_id[2][64]; /* what XREAD waits after (main, replay); "" unknown */
    struct held q[ORDER_QUEUE_MAX];
    size_t nq;
    char parked_key[2 * NAME_MAX_LEN + 32];
    struct redisReply *parked; /* SMEMBERS of parked_key, with park_keys */
};

/* The ordered mode while it runs (consumer/ordered.c, outbox_ordered_run). */
struct ordered {
    struct part *parts;
    uint32_t n;
    char members_key[2 * NAME_MAX_LEN + 32];
    uint32_t rank, members;
    long long next_upkeep;
    uint32_t rr; /* where the next handling round starts */
    int poll;    /* the partitions span hash slots of a cluster: no single XREAD
                    can wait on them, so the loop reads again every
                    ORDER_POLL_MS */
};

/* How often an ordered consumer in a Redis Cluster reads its partitions
 * again when nothing is in hand (docs/CONSUMERS.md, "Limits"). */
#define ORDER_POLL_MS 50

/* Commands of this partition go to its primary from here on. */
static inline void use_part(struct outbox_consumer *c, const struct part *pt)
{
    if (pt->node < c->nnodes)
        c->wr = c->node[pt->node];
}

/* Commands of the topic's own keys (the members key) go to its primary. */
static inline void use_base(struct outbox_consumer *c)
{
    if (c->nnodes > 0)
        c->wr = c->node[0];
}

/* Frees what an entry in hand owns and clears it. */
void outbox_part_held_free(struct held *h);

/* Drops a partition: its entries in hand, its parked keys, its token. */
void outbox_part_drop(struct part *pt);

#endif
