/*
 * The batch loop as a state machine (docs/DESIGN.md, "Batches from
 * snapshots"), pure: it never touches a connection, a timer or a clock. The
 * daemon feeds it events (a statement answered, a chunk's calls answered, a
 * connection lost, a timer fired) and it decides what happens next through
 * the ops the daemon fills in.
 * Unit tests play scripts of events against fake ops (tests/unit/test_loop.c).
 *
 *   (LOAD first, and whenever prepare asks: the streams' positions)
 *   IDLE ──want──▶ TICK ──ticked(latest > lead)──▶ READ ──chunk(n > 0)──▶ PUBLISH
 *    ▲               │                              ▲  │                   │ │
 *    │  ticked(none) │             read ahead while │  │ chunk(0), nothing │ │ published,
 *    └───────────────┘             publishing ──────┘  ▼ publishing        │ │ chunk ahead
 *    ▲                                               RECORD ◀──────────────┘ │ read: publish it
 *    │                   recorded: the lead moves; ─┘                        │
 *    │                   latest > lead: READ again, else TICK                ▼
 *    └──────────── retry ◀── BACKOFF ◀── failed (any state) ─────────────── ...
 *
 * A batch is the rows between two ticks, read in chunks of at most
 * chunk_rows rows. While a chunk publishes, the next is read (one query
 * ahead at most), and it publishes once every call of the chunk before has
 * been answered: a stream has one call in flight at a time, and at most two
 * chunks are in memory. When the batch is read and published, its positions
 * are recorded, and the lead moves to its tick. Streams behind the lead
 * (resumed, taken over) go through the batches from their own position to
 * the lead, one batch at a time, taking turns with the lead's batches. A
 * failure anywhere abandons
 * the batch: after a backoff it is read again from its start, and what Redis
 * already holds is skipped (relay/cursors.h).
 */
#ifndef RELAY_LOOP_H
#define RELAY_LOOP_H

#include <stddef.h>
#include <stdint.h>

#include "common/backoff.h"
#include "relay/fail.h"

enum relay_loop_state {
    RELAY_LOOP_IDLE = 0,
    RELAY_LOOP_LOAD,    /* the streams' recorded positions asked for */
    RELAY_LOOP_TICK,    /* outbox.tick() sent */
    RELAY_LOOP_READ,    /* a chunk's query sent, nothing publishing */
    RELAY_LOOP_PUBLISH, /* a chunk publishing; maybe the next one's query sent */
    RELAY_LOOP_RECORD,  /* the batch's positions sent */
    RELAY_LOOP_BACKOFF, /* a failure: waiting to read the batch again */
};

struct relay_loop_ops {
    void *arg;
    /* 1 when PostgreSQL and Redis are both ready for a batch. */
    int (*ready)(void *arg);
    /* Each call below carries the batch's generation (gen), which its answer
     * carries back: an answer of an abandoned batch is then ignored. */
    /* Between batches: applies what changed meanwhile (pauses, ownership).
     * Returns 1 when streams the relay now publishes need their recorded
     * positions read (load). */
    int (*prepare)(void *arg);
    /* Reads the streams' recorded positions, and the lead the first time;
     * its answer is relay_loop_loaded. 0 or -1 as tick. */
    int (*load)(void *arg, uint64_t gen);
    /* The lowest position of a stream behind the lead (relay/cursors.h), or
     * the lead when none is. */
    uint64_t (*behind)(void *arg, uint64_t lead);
    /* Sends outbox.tick(); its answer is relay_loop_ticked. 0, or -1 when it
     * cannot be sent (the connection is down: its return calls want). */
    int (*tick)(void *arg, uint64_t gen);
    /* Sends the query of the batch's chunk number `chunk` (0 for the first),
     * which resumes after the last row of chunk - 1; its rows are
     * relay_loop_chunk's. 0 or -1 as tick. */
    int (*read)(void *arg, uint64_t gen, uint64_t prev, uint64_t next, uint32_t chunk);
    /* Publishes the rows of chunk `chunk`; relay_loop_published or
     * relay_loop_failed answers, possibly before it returns. */
    void (*publish)(void *arg, uint64_t gen, uint32_t chunk);
    /* Records the positions of the streams the batch (prev, next] touched,
     * and its quarantined rows; lead: the batch is the lead's, not one of
     * streams catching up. relay_loop_recorded answers. 0 or -1 as tick. */
    int (*record)(void *arg, uint64_t gen, uint64_t prev, uint64_t next, int lead);
    /* The batch was abandoned: drop its chunks and what they hold. */
    void (*abandon)(void *arg);
    /* A failure, counted and logged by kind. */
    void (*failed)(void *arg, enum relay_fail_kind kind, const char *why);
    /* Arms the retry timer: relay_loop_retry in ms. */
    void (*arm_retry)(void *arg, uint32_t ms);
    /* Caught up: nothing committed since the last tick. */
    void (*idle)(void *arg);
    /* A drain that was asked for is complete. */
    void (*drained)(void *arg);
};

struct relay_loop {
    struct relay_loop_ops ops;
    enum relay_loop_state state;
    uint64_t lead;   /* the last tick whose batch is published (0: none yet) */
    uint64_t latest; /* the latest tick known */
    /* The batch in flight: (prev, next], prev the lead or, catching up, the
     * lowest position behind it; and the generation of what was asked for
     * it (or for the tick): answers of another are ignored. */
    uint64_t prev;
    uint64_t next;
    int catching_up; /* the batch in flight is one of streams behind the lead */
    int loaded;      /* the positions were read at least once */
    int turn;        /* 1: streams behind go next, when both could */
    uint64_t gen;
    uint32_t read_chunk;    /* the chunk whose query is in flight, if reading */
    int reading;            /* a chunk's query is in flight */
    int read_done;          /* the last chunk of the batch has been read */
    int publishing;         /* a chunk is publishing */
    uint32_t publish_chunk; /* which */
    int ahead;              /* a chunk read and waiting for the one publishing */
    uint32_t ahead_chunk;   /* which */
    uint32_t chunk_rows;    /* a chunk of fewer rows is the batch's last */
    int wanted;             /* a notification or the poll came while busy */
    int draining, stopping;
    struct outbox_backoff backoff;
    unsigned failures_in_row;
    unsigned long long batches; /* recorded */
};

void relay_loop_init(struct relay_loop *l, const struct relay_loop_ops *ops, uint32_t chunk_rows,
                     uint32_t backoff_base_ms, uint32_t backoff_max_ms);

/* Where the loop starts: the last tick already published for its streams. */
void relay_loop_set_lead(struct relay_loop *l, uint64_t lead);

/* A notification, the poll, a connection that came up: look for work. */
void relay_loop_want(struct relay_loop *l);

/* The answer of load: the positions are applied; lead is the recorded
 * lead (used the first time only). */
void relay_loop_loaded(struct relay_loop *l, uint64_t gen, uint64_t lead);

/* The answer of tick: the latest tick's number. */
void relay_loop_ticked(struct relay_loop *l, uint64_t gen, uint64_t latest);

/* The rows of the chunk asked for have arrived: n of them (0 ends the batch). */
void relay_loop_chunk(struct relay_loop *l, uint64_t gen, uint32_t chunk, size_t n);

/* Every call of the chunk was answered and each row is in its stream. */
void relay_loop_published(struct relay_loop *l, uint64_t gen, uint32_t chunk);

/* The batch's positions are recorded. */
void relay_loop_recorded(struct relay_loop *l, uint64_t gen);

/* Anything failed: the batch is abandoned and read again after a backoff. */
void relay_loop_failed(struct relay_loop *l, uint64_t gen, enum relay_fail_kind kind,
                       const char *why);

/* The retry timer fired. */
void relay_loop_retry(struct relay_loop *l);

/* SIGTERM: finish the batch in flight (or none), then ops.drained. */
void relay_loop_drain(struct relay_loop *l);

/* Stops at once: every later event is ignored. */
void relay_loop_stop(struct relay_loop *l);

#endif
