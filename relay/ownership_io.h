/*
 * The owner connection (relay/ownership_io.c): the partitions of partitioned topics
 * and the unpartitioned topics that this relay publishes, shared with the
 * other relays of the database.
 */
#ifndef RELAY_OWNERSHIP_IO_H
#define RELAY_OWNERSHIP_IO_H

#include <stddef.h>
#include <stdint.h>

struct relay;
struct relay_owner;

struct relay_owner_figures {
    size_t members;               /* relays holding a member slot, this one included */
    size_t partitions;            /* partitions of partitioned topics in all */
    size_t owned;                 /* partitions this relay publishes */
    unsigned long long takeovers; /* partitions taken since start */
};

/* What the owner connection tells the rest of the relay. */
struct relay_owner_hooks {
    void *arg;
    /* Another relay runs against the database: the members read were more
     * than one. Called at every such reading. */
    void (*shared)(void *arg);
};

struct relay_owner *relay_ownership_io_start(struct relay *r, const struct relay_owner_hooks *hooks)
    __attribute__((warn_unused_result));
void relay_ownership_io_stop(struct relay_owner *o);

/* Moves whenever the partitions or unpartitioned topics this relay
 * publishes may have changed (never 0). */
unsigned long relay_ownership_io_epoch(const struct relay_owner *o);
/* 1 when this relay publishes the partition now. */
int relay_ownership_io_owns(const struct relay_owner *o, const char *topic, uint32_t partition);
/* 1 when this relay publishes the unpartitioned topic now (relay_topic_wanted
 * for the members of the last look). */
int relay_ownership_io_owns_topic(const struct relay_owner *o, const char *topic);
void relay_ownership_io_figures(const struct relay_owner *o, struct relay_owner_figures *f);

#endif
