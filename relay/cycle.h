/*
 * The claim cycle as a state machine (docs/DESIGN.md, "The claim cycle"),
 * pure: it never touches a connection, a timer or a clock. The daemon feeds
 * it events (a command answered, a connection lost, a timer fired) and it
 * decides what happens next by calling the ops the daemon filled in, the way
 * hiredis's async context drives an event loop through its adapter's hooks.
 * Unit tests play scripts of events against fake ops (tests/unit/test_cycle.c).
 *
 * A batch lives on a lane: a claiming connection with its own transaction.
 * With two lanes, batch N+1 is claimed while N publishes, and N+1 publishes
 * while N is marked sent. The rules that keep this as safe and as ordered as
 * one batch at a time:
 *   - claims run one at a time, and a lane claims ahead only while no claimed
 *     batch waits to publish, so at most two batches exist;
 *   - batches start publishing in claim order, each only after every reply
 *     of the one before it came back, unless ops.overlap allows it to follow
 *     the one before while that one's replies come in: then each of its
 *     streams' first rows names the last row the batch before sent to that
 *     stream, and Redis publishes it only behind that row (the order check of
 *     docs/DESIGN.md, "The claim cycle"), so it needs no undoing when the
 *     batch before fails;
 *   - when a batch fails, every batch claimed after it that has not started
 *     publishing is rolled back, so its rows cannot overtake the failed ones;
 *     when one claimed after it already publishes, or a batch left rows
 *     behind the batch ahead, nothing is claimed until every batch in flight
 *     has ended (hold_all).
 */
#ifndef RELAY_CYCLE_H
#define RELAY_CYCLE_H

#include <stddef.h>
#include <stdint.h>

#include "common/backoff.h"

#define RELAY_CYCLE_LANES_MAX 2

enum relay_lane_state {
    RELAY_LANE_IDLE = 0,
    RELAY_LANE_BEGIN,    /* BEGIN sent */
    RELAY_LANE_CLAIM,    /* claim sent */
    RELAY_LANE_CLAIMED,  /* rows locked; waiting for the batch ahead to finish publishing */
    RELAY_LANE_PUBLISH,  /* publishes in flight */
    RELAY_LANE_FINISH,   /* mark + COMMIT sent */
    RELAY_LANE_ROLLBACK, /* ROLLBACK (or the COMMIT of an empty claim) sent */
};

/* Why a whole batch failed: chosen where the failure is found, never read
 * back from an error message. Also the labels of
 * outbox_relay_publish_errors_total. */
enum relay_fail_kind {
    RELAY_FAIL_REDIS_CONNECTION = 0, /* Redis unreachable or the connection dropped */
    RELAY_FAIL_REDIS_TIMEOUT,        /* no reply within publish_timeout */
    RELAY_FAIL_REDIS_ERROR,          /* an error reply about the server, not the row */
    RELAY_FAIL_REDIS_REPLY,          /* a reply of an unexpected type */
    RELAY_FAIL_REDIS_REPLICAS,       /* fewer than min_replicas replicas hold the batch */
    RELAY_FAIL_POSTGRES,             /* BEGIN, the claim, the mark or COMMIT failed */
    RELAY_FAIL_KINDS
};

/* The label of a failure kind in the metrics: "redis_connection", ... */
const char *relay_fail_kind_name(enum relay_fail_kind kind);

/*
 * What the machine asks of the daemon. Each call that sends a command returns
 * 0 when it was sent (its answer comes back later as an event) or -1 when it
 * could not be (the connection is not ready), with a reason in why. None of
 * them may call back into the machine before returning, except publish, whose
 * batch may end at once (every row failed on its own, or nothing could be
 * sent): it then reports relay_cycle_published or relay_cycle_failed itself.
 */
struct relay_cycle_ops {
    void *arg;
    double (*now)(void *arg);                  /* monotonic seconds */
    int (*lane_ready)(void *arg, size_t lane); /* its connection can take a command */
    int (*sink_ready)(void *arg);              /* Redis is connected and set up */
    int (*begin)(void *arg, size_t lane);
    int (*claim)(void *arg, size_t lane, char *why, size_t whylen);
    void (*publish)(void *arg, size_t lane);
    int (*finish)(void *arg, size_t lane, char *why, size_t whylen); /* mark sent + COMMIT */
    int (*rollback)(void *arg, size_t lane, int empty); /* ROLLBACK, or COMMIT when empty */
    void (*release)(void *arg, size_t lane); /* the lane's batch is over: free its rows */
    void (*failed)(void *arg, size_t lane, enum relay_fail_kind kind, const char *why);
    void (*kick)(void *arg);                   /* call relay_cycle_run from the loop, soon */
    void (*arm_retry)(void *arg, uint32_t ms); /* call relay_cycle_retry_due after ms */
    int (*self_driven)(void *arg); /* producers skip notifying: claim until a claim is empty */
    void (*went_empty)(void *arg); /* an empty claim, nothing else in flight, self-driven */
    void (*drained)(void *arg);    /* draining and no batch left in flight */
    /* The published batch has rows that failed on their own in a partitioned
     * topic: they hold back the later rows of their keys. May be NULL. */
    int (*holds_keys)(void *arg, size_t lane);
    /* The lane's claimed batch may start publishing while the batch of
     * `ahead` waits for its replies. May be NULL: never. */
    int (*overlap)(void *arg, size_t ahead, size_t lane);
    /* The published batch left rows behind the batch ahead of it, for the
     * next claim (relay_batch_apply_reply). May be NULL: never. */
    int (*left_rows)(void *arg, size_t lane);
};

struct relay_cycle_lane {
    enum relay_lane_state state;
    unsigned long long seq; /* claim order */
    int abandon;            /* a batch ahead failed: roll back instead of publishing */
    int doomed;             /* its connection broke while it published: fail at the end */
    double claimed_at;      /* before BEGIN was sent: duration, phases, deadline */
    double stage_at;        /* the current stage began: the stuck check */
};

struct relay_cycle {
    struct relay_cycle_ops ops;
    size_t nlanes;
    struct relay_cycle_lane lanes[RELAY_CYCLE_LANES_MAX];
    unsigned long long next_seq;
    int publishing; /* the oldest lane whose publishes are in flight, or -1 */
    int want_claim;
    int in_backoff;
    int draining;
    int stopping; /* the loop is being left: every event is ignored */
    unsigned failures_in_row;
    /* A batch whose failed rows hold back their keys: nothing is claimed
     * until its commit has ended, so that the next claim sees them. 0 when
     * none. */
    unsigned long long hold_seq;
    /* Rows went back below batches still in flight (a batch failed while the
     * one behind it published, or a batch left rows behind the one ahead):
     * nothing is claimed until every batch in flight has ended, so that the
     * next claim starts from the lowest pending id with no batch ahead. */
    int hold_all;
    /* The claim order of the newest batch when the last failure happened: a
     * batch claimed before it that commits does not end the failures in a
     * row. */
    unsigned long long failed_at_seq;
    struct outbox_backoff backoff;
};

/* nlanes is 1 (pipeline off) or 2. Starts wanting a claim (the catch-up). */
void relay_cycle_init(struct relay_cycle *c, const struct relay_cycle_ops *ops, size_t nlanes,
                      uint32_t retry_min_ms, uint32_t retry_max_ms);

/* ---- events -------------------------------------------------------------- */

/* Something may be pending (a notification, the poll, a connection that came
 * up): claim soon unless a claim is already under way. */
void relay_cycle_want(struct relay_cycle *c);
/* The kick: claims now if a claim is wanted and a lane is free. */
void relay_cycle_run(struct relay_cycle *c);
void relay_cycle_begun(struct relay_cycle *c, size_t lane);
/* The claim returned nrows rows, full when as many as were asked for. */
void relay_cycle_claimed(struct relay_cycle *c, size_t lane, size_t nrows, int full);
/* Every publish of the lane's batch was answered, none failing the batch.
 * When its failed rows hold back their keys (ops.holds_keys), the later
 * batches that have not published go back, as after a failure, and no claim
 * starts until this batch's commit has ended (docs/PARTITIONS.md). */
void relay_cycle_published(struct relay_cycle *c, size_t lane);
void relay_cycle_committed(struct relay_cycle *c, size_t lane, int full);
/* The ROLLBACK (or the COMMIT of an empty claim) was answered, either way. */
void relay_cycle_rolled_back(struct relay_cycle *c, size_t lane);
/* The lane's batch failed as a whole: roll it back and retry after backoff. */
void relay_cycle_failed(struct relay_cycle *c, size_t lane, enum relay_fail_kind kind,
                        const char *why);
/* The lane's connection broke between commands (with a command in flight,
 * that command's failure is the event). */
void relay_cycle_lane_down(struct relay_cycle *c, size_t lane);
void relay_cycle_retry_due(struct relay_cycle *c);
/* SIGTERM: claim nothing more; drained() once no batch is in flight (at
 * once, from this call, when none is). */
void relay_cycle_drain(struct relay_cycle *c);

/* ---- questions ----------------------------------------------------------- */

int relay_cycle_all_idle(const struct relay_cycle *c);
/* The lane holding a batch whose stage has lasted limit seconds or more, or
 * -1: claiming and waiting to publish count from the claim, the other stages
 * from their own start. */
int relay_cycle_stuck(const struct relay_cycle *c, double now, double limit);
/* Batches in flight (claimed and not ended). */
size_t relay_cycle_in_flight(const struct relay_cycle *c);

#endif
