/*
 * Each stream's place in the publish order, as the relay knows it
 * (docs/DESIGN.md, "Batches from snapshots"): the rank the stream's next row
 * takes in the batch being read, and the stream's last entry id in Redis as
 * last read or written. A row's entry id is "<tick ms>-<rank>", so the rank
 * counts every row of the stream in the batch, published or not, and the
 * count goes on from chunk to chunk of one batch. A row whose id is at or
 * below the stream's last id is in Redis already and is not sent again.
 *
 * Pure: no I/O. A stream is named by its topic and partition (the stream
 * prefix is the same for all); the table grows with the streams met, and
 * between batches past RELAY_CURSORS_MAX it keeps only the last batch's
 * (relay_cursors_trim: topics come and go), which costs only reads of the
 * dropped streams' last ids again. A stream's rank is never lost in the
 * middle of its batch.
 */
#ifndef RELAY_CURSORS_H
#define RELAY_CURSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct relay_row;

#define RELAY_CURSORS_MAX 65536

struct relay_cursor {
    char topic[OUTBOX_TOPIC_MAX + 1]; /* "" for an empty slot */
    uint32_t partition;               /* in a partitioned topic, else 0 */
    uint32_t partitioned;             /* partitions > 1 */
    uint64_t tick;                    /* the batch read next_seq counts in (its serial: a
                                         batch read again counts again from 0) */
    uint64_t next_seq;                /* the rank of the stream's next row in it */
    int top_known;                    /* top_ms/top_seq read or written since forgotten */
    uint64_t top_ms, top_seq;         /* the stream's last entry id in Redis */
    int in_flight;                    /* a call of the stream awaits its reply */
    int touched;                      /* a row of the batch being published is the stream's */
    /* Where the stream stands (docs/DESIGN.md, "Streams behind the lead"). */
    int known;    /* follows/pos hold: loaded, or met first above the lead */
    int follows;  /* published with the lead: every batch up to it is in */
    uint64_t pos; /* else: the last tick whose batch is all in the stream */
    int owned;    /* this relay publishes it (ownership epoch own_epoch) */
    unsigned long own_epoch;
    int paused;            /* held back for its consumer groups */
    int met;               /* the batch being read has rows of it this relay skips */
    uint64_t active_batch; /* the batch `active` was decided for (a serial) */
    int active;            /* this relay publishes its rows of that batch */
    /* The last id the stream should hold (what this relay appended, or its
     * recorded entry id): a Redis that comes back below it lost entries. */
    uint64_t expect_ms, expect_seq;
    int checking; /* its last id in Redis is being read */
};

struct relay_cursors {
    struct relay_cursor *slots;
    size_t mask; /* the table's size less one; a power of two, or 0 before the first */
    size_t n;
};

void relay_cursors_init(struct relay_cursors *c);
void relay_cursors_free(struct relay_cursors *c);

/* The cursor of row's stream, made when new; NULL out of memory. A pointer
 * is valid until the next relay_cursors_get of a stream not met before. */
struct relay_cursor *relay_cursors_get(struct relay_cursors *c, const struct relay_row *row);

/* The cursor of the stream (topic, partition), partition -1 for a topic of
 * one partition, made when new; NULL for a bad name or out of memory. */
struct relay_cursor *relay_cursors_find(struct relay_cursors *c, const char *topic,
                                        int32_t partition);

/* Where the stream stands: the last tick whose batch is all in it. */
uint64_t relay_cursor_position(const struct relay_cursor *cur, uint64_t lead);

/* The lowest position of the streams the relay publishes that are behind
 * the lead (neither paused nor following it), or lead when none is. */
uint64_t relay_cursors_behind(const struct relay_cursors *c, uint64_t lead);

/* The batch (prev, prev + 1] was recorded: each stream published in it (at
 * prev, owned, not paused) now stands at prev + 1, and joins the lead when
 * that is the lead. */
void relay_cursors_advance(struct relay_cursors *c, uint64_t prev, uint64_t lead);

/* The rank of the stream's next row in the batch read `batch` (a serial
 * that changes with every batch read, also when the same tick's batch is
 * read again): 0 for the first of the batch, then 1, 2, ... */
uint64_t relay_cursor_rank(struct relay_cursor *cur, uint64_t batch);

/* Raises what the stream should hold to (ms, seq). */
void relay_cursor_expect(struct relay_cursor *cur, uint64_t ms, uint64_t seq);

/* 1 when the entry id (ms, seq) is at or below the stream's last known id:
 * the row is in Redis already. 0 when above it or when the last id is not
 * known. */
int relay_cursor_present(const struct relay_cursor *cur, uint64_t ms, uint64_t seq);

/* The stream's last id is (ms, seq), as Redis said (XINFO STREAM) or as an
 * XADD answered: it never moves back here except through
 * relay_cursor_set_top, which a read of the stream calls. */
void relay_cursor_appended(struct relay_cursor *cur, uint64_t ms, uint64_t seq);
void relay_cursor_set_top(struct relay_cursor *cur, uint64_t ms, uint64_t seq);

/* Forgets the stream's last id (a call failed, Redis reconnected): the next
 * publish reads it again. */
void relay_cursor_forget(struct relay_cursor *cur);

/* Between batches, past RELAY_CURSORS_MAX streams: keeps only the streams
 * of the batch read `batch` (those ranked in it), and those whose place differs
 * from the lead's (paused, behind, not owned: forgetting them would lose
 * where they stand), so that the table holds at most
 * the streams of one batch more than the limit. A stream dropped only has its
 * last id read again when it is next met. */
void relay_cursors_trim(struct relay_cursors *c, uint64_t batch);

/* The batch read `batch` is read again from its start (after a failure): the
 * ranks of its streams count from 0 again. */
void relay_cursors_restart(struct relay_cursors *c, uint64_t batch);

/* A batch is recorded: no stream is touched by the next one yet. */
void relay_cursors_untouch(struct relay_cursors *c);

/* Forgets every stream's last id (Redis reconnected: it may hold less),
 * keeping it as what the stream should hold. */
void relay_cursors_forget_all(struct relay_cursors *c);

#endif
