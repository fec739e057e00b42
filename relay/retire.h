/*
 * The removals of dedup records that wait for their time (relay/retire.c).
 *
 * A committed batch's dedup records must outlive any copy of its rows that
 * another relay (or this one, before it gave up a batch) sent before its claim
 * ended: such a copy can reach Redis until publish_timeout after that claim,
 * and it must find the record (docs/DESIGN.md, "The publish deadline"). The
 * relay removes them itself, with one UNLINK per stream once publish_timeout
 * has passed since the commit: cheaper for Redis than setting each record's
 * time to live and expiring it later. This queue holds those UNLINKs, oldest
 * first, until they are due.
 *
 * The commands are stored one after the other in chunks of their own memory
 * (mmap), reused as the queue turns over: a steady stream of removals
 * allocates nothing, and never interleaves with the heap, where the Redis
 * client's output buffer grows by realloc.
 */
#ifndef RELAY_RETIRE_H
#define RELAY_RETIRE_H

#include <stddef.h>

/* The most bytes of commands the queue holds. A key takes about 60 bytes (a
 * 36-character message id, a short topic): 5 s of 40,000 messages a second
 * is about 12 MiB. Past it the oldest removals, RELAY_RETIRE_HANDOFF bytes of
 * them, are handed to Redis as expiries instead (relay_batch_unlink_as_retire),
 * as every removal was before: the relay's memory stays bounded, at the price
 * of Redis's work. */
#define RELAY_RETIRE_QUEUE_MAX ((size_t)16 << 20)
/* The most bytes of removals handed to Redis at once: they pass through the
 * Redis client's output buffer together. */
#define RELAY_RETIRE_HANDOFF ((size_t)1 << 20)

/* One waiting removal, inside a chunk. */
struct relay_retire_item {
    double due; /* monotonic seconds (relay_now) */
    size_t len;
    char cmd[]; /* one UNLINK, in the protocol */
};

struct relay_retire_chunk;

struct relay_retire_queue {
    struct relay_retire_chunk *head, *tail; /* items are read at head, written at tail */
    struct relay_retire_chunk *spare;       /* emptied chunks kept for reuse */
    size_t spares;
    double last_due;
    size_t bytes; /* of the commands held */
    size_t items;
};

/* Adds cmd, due at due, or at the last due added if that is later: a removal
 * added later is never sent earlier, so the head is always the first due.
 * 0, or -1 when out of memory (the records are then left to their
 * dedup_ttl). */
int relay_retire_push(struct relay_retire_queue *q, double due, const char *cmd, size_t len)
    __attribute__((warn_unused_result));

/* The oldest item, or NULL; it stays queued, valid until the next push or pop. */
const struct relay_retire_item *relay_retire_head(const struct relay_retire_queue *q);

/* Removes the oldest item. */
void relay_retire_pop(struct relay_retire_queue *q);

/* Removes every item and returns all memory. */
void relay_retire_clear(struct relay_retire_queue *q);

/* Whole milliseconds from now until due, rounded up; at least 1. */
unsigned relay_retire_ms_left(double due, double now);

#endif
