/*
 * The claim cycle's state machine (relay/cycle.h): which lane claims,
 * which batch publishes, what a failure rolls back, when to claim again. It
 * holds no rows and sends nothing itself: every effect goes through the ops.
 */
#include "common/compat.h"

#include "relay/cycle.h"

#include <string.h>

static const char *const fail_kind_names[RELAY_FAIL_KINDS] = {"redis_connection", "redis_timeout",
                                                              "redis_error",      "redis_reply",
                                                              "redis_replicas",   "postgres"};

const char *relay_fail_kind_name(enum relay_fail_kind kind)
{
    return (unsigned)kind < RELAY_FAIL_KINDS ? fail_kind_names[kind] : "postgres";
}

void relay_cycle_init(struct relay_cycle *c, const struct relay_cycle_ops *ops, size_t nlanes,
                      uint32_t retry_min_ms, uint32_t retry_max_ms)
{
    memset(c, 0, sizeof(*c));
    c->ops = *ops;
    c->nlanes = nlanes < 1 ? 1 : nlanes > RELAY_CYCLE_LANES_MAX ? RELAY_CYCLE_LANES_MAX : nlanes;
    c->publishing = -1;
    c->want_claim = 1;
    outbox_backoff_init(&c->backoff, retry_min_ms, retry_max_ms);
}

int relay_cycle_all_idle(const struct relay_cycle *c)
{
    for (size_t i = 0; i < c->nlanes; i++)
        if (c->lanes[i].state != RELAY_LANE_IDLE)
            return 0;
    return 1;
}

size_t relay_cycle_in_flight(const struct relay_cycle *c)
{
    size_t n = 0;
    for (size_t i = 0; i < c->nlanes; i++)
        if (c->lanes[i].state != RELAY_LANE_IDLE)
            n++;
    return n;
}

static int others_idle(const struct relay_cycle *c, size_t lane)
{
    for (size_t i = 0; i < c->nlanes; i++)
        if (i != lane && c->lanes[i].state != RELAY_LANE_IDLE)
            return 0;
    return 1;
}

/* A lane that may claim now: none is claiming or waiting to publish (so at
 * most two batches exist), and its connection is ready. -1 when none. */
static int free_lane(const struct relay_cycle *c)
{
    int found = -1;
    if (c->hold_seq != 0 || c->hold_all)
        return -1; /* the batch ending it calls relay_cycle_want */
    for (size_t i = 0; i < c->nlanes; i++) {
        switch (c->lanes[i].state) {
        case RELAY_LANE_BEGIN:
        case RELAY_LANE_CLAIM:
        case RELAY_LANE_CLAIMED:
            return -1;
        case RELAY_LANE_IDLE:
            if (found < 0 && c->ops.lane_ready(c->ops.arg, i))
                found = (int)i;
            break;
        default:
            break;
        }
    }
    return found;
}

static void set_stage(struct relay_cycle *c, size_t lane, enum relay_lane_state state)
{
    c->lanes[lane].state = state;
    c->lanes[lane].stage_at = c->ops.now(c->ops.arg);
}

/* The lane's publishes are over: the oldest batch still publishing, if any,
 * is the one whose replies come in first. */
static void publish_ended(struct relay_cycle *c, size_t lane)
{
    if (c->publishing != (int)lane)
        return;
    c->publishing = -1;
    for (size_t i = 0; i < c->nlanes; i++)
        if (i != lane && c->lanes[i].state == RELAY_LANE_PUBLISH &&
            (c->publishing < 0 || c->lanes[i].seq < c->lanes[c->publishing].seq))
            c->publishing = (int)i;
}

/* A claimed batch may publish now: none is publishing, or the one that is
 * (the only one: at most two batches exist) lets it follow at once. */
static int may_publish(const struct relay_cycle *c, size_t lane)
{
    if (c->publishing < 0)
        return 1;
    const struct relay_cycle_lane *ahead = &c->lanes[c->publishing];
    return c->ops.overlap != NULL && ahead->state == RELAY_LANE_PUBLISH && !ahead->doomed &&
           ahead->seq < c->lanes[lane].seq &&
           c->ops.overlap(c->ops.arg, (size_t)c->publishing, lane);
}

void relay_cycle_want(struct relay_cycle *c)
{
    if (c->stopping)
        return;
    c->want_claim = 1;
    if (!c->in_backoff && !c->draining && free_lane(c) >= 0)
        c->ops.kick(c->ops.arg);
}

/* The lane's batch is over: leave if draining and nothing is left in flight,
 * or run what is wanted next. */
static void lane_ended(struct relay_cycle *c, size_t lane)
{
    struct relay_cycle_lane *l = &c->lanes[lane];
    c->ops.release(c->ops.arg, lane);
    if (c->hold_seq == l->seq)
        c->hold_seq = 0;
    l->state = RELAY_LANE_IDLE;
    l->abandon = 0;
    l->doomed = 0;
    if (c->hold_all && relay_cycle_all_idle(c))
        c->hold_all = 0;
    if (c->draining) {
        if (relay_cycle_all_idle(c))
            c->ops.drained(c->ops.arg);
        return;
    }
    if (c->want_claim)
        relay_cycle_want(c);
}

/* Ends the lane's transaction without marking anything. */
static void roll_back(struct relay_cycle *c, size_t lane, int empty)
{
    if (c->ops.rollback(c->ops.arg, lane, empty) == 0) {
        set_stage(c, lane, RELAY_LANE_ROLLBACK);
        return;
    }
    lane_ended(c, lane);
}

/* Every batch claimed after the lane's that has not begun publishing rolls
 * back: at once when it waits to publish, when its claim returns when it is
 * still claiming. */
static void roll_back_later(struct relay_cycle *c, size_t lane)
{
    unsigned long long seq = c->lanes[lane].seq;
    for (size_t i = 0; i < c->nlanes; i++) {
        struct relay_cycle_lane *later = &c->lanes[i];
        if (i == lane || later->seq < seq)
            continue;
        if (later->state == RELAY_LANE_CLAIMED)
            roll_back(c, i, 0);
        else if (later->state == RELAY_LANE_BEGIN || later->state == RELAY_LANE_CLAIM)
            later->abandon = 1;
    }
}

void relay_cycle_failed(struct relay_cycle *c, size_t lane, enum relay_fail_kind kind,
                        const char *why)
{
    if (c->stopping || c->lanes[lane].state == RELAY_LANE_IDLE ||
        c->lanes[lane].state == RELAY_LANE_ROLLBACK)
        return;
    c->failures_in_row++;
    c->failed_at_seq = c->next_seq;
    c->ops.failed(c->ops.arg, lane, kind, why);
    publish_ended(c, lane);
    /* A batch claimed after this one has published already, or is
     * publishing: its claim passed over this batch's rows, and the next
     * claim must not start above them, nor publish with nothing to chain to,
     * while it is in flight. */
    for (size_t i = 0; i < c->nlanes; i++)
        if (i != lane && c->lanes[i].seq > c->lanes[lane].seq &&
            (c->lanes[i].state == RELAY_LANE_PUBLISH || c->lanes[i].state == RELAY_LANE_FINISH))
            c->hold_all = 1;
    c->in_backoff = 1;
    c->want_claim = 1;
    c->ops.arm_retry(c->ops.arg, outbox_backoff_next(&c->backoff, outbox_backoff_random()));
    /* Batches claimed after this one that have not published yet go too, so
     * their rows cannot reach the streams ahead of this batch's. */
    roll_back_later(c, lane);
    roll_back(c, lane, 0);
}

static void start_publish(struct relay_cycle *c, size_t lane)
{
    if (c->publishing < 0)
        c->publishing = (int)lane;
    set_stage(c, lane, RELAY_LANE_PUBLISH);
    c->ops.publish(c->ops.arg, lane); /* may end the batch before it returns */
}

void relay_cycle_run(struct relay_cycle *c)
{
    if (c->stopping || c->in_backoff || c->draining || !c->want_claim)
        return;
    if (!c->ops.sink_ready(c->ops.arg))
        return; /* Redis coming up calls relay_cycle_want */
    int lane = free_lane(c);
    if (lane < 0)
        return; /* a lane's end or a connection coming up calls relay_cycle_want */
    struct relay_cycle_lane *l = &c->lanes[lane];
    /* Read before BEGIN is sent, so that begin sees it too: the batch's
     * duration, its phases and its publish deadline count from one instant,
     * and the deadline does not lose the time the send took. */
    l->claimed_at = c->ops.now(c->ops.arg);
    if (c->ops.begin(c->ops.arg, (size_t)lane) < 0)
        return; /* still wanted: its connection coming back calls relay_cycle_want */
    c->want_claim = 0;
    l->seq = ++c->next_seq;
    l->abandon = 0;
    l->doomed = 0;
    set_stage(c, (size_t)lane, RELAY_LANE_BEGIN);
}

void relay_cycle_begun(struct relay_cycle *c, size_t lane)
{
    if (c->stopping || c->lanes[lane].state != RELAY_LANE_BEGIN)
        return;
    if (c->lanes[lane].abandon) {
        roll_back(c, lane, 0);
        return;
    }
    char why[256] = "PostgreSQL connection lost before the claim";
    if (c->ops.claim(c->ops.arg, lane, why, sizeof(why)) < 0) {
        relay_cycle_failed(c, lane, RELAY_FAIL_POSTGRES, why);
        return;
    }
    set_stage(c, lane, RELAY_LANE_CLAIM); /* claimed_at still counts from BEGIN */
}

void relay_cycle_claimed(struct relay_cycle *c, size_t lane, size_t nrows, int full)
{
    if (c->stopping || c->lanes[lane].state != RELAY_LANE_CLAIM)
        return;
    if (c->lanes[lane].abandon) {
        roll_back(c, lane, 0);
        return;
    }
    if (nrows == 0) {
        if (c->ops.self_driven(c->ops.arg)) {
            /* A relay that producers do not notify must never just stop:
             * declare it idle once nothing else is in flight, or claim again
             * once the other lane ends. */
            if (others_idle(c, lane))
                c->ops.went_empty(c->ops.arg);
            else
                c->want_claim = 1;
        }
        roll_back(c, lane, 1);
        return;
    }
    /* A full batch: more is likely waiting, so the other lane claims it
     * while this one publishes. */
    if (full && c->nlanes > 1)
        c->want_claim = 1;
    if (may_publish(c, lane))
        start_publish(c, lane);
    else
        set_stage(c, lane, RELAY_LANE_CLAIMED);
    relay_cycle_run(c);
}

/* The next batch in claim order that waits to publish, or -1. */
static int next_claimed(const struct relay_cycle *c)
{
    int next = -1;
    for (size_t i = 0; i < c->nlanes; i++)
        if (c->lanes[i].state == RELAY_LANE_CLAIMED &&
            (next < 0 || c->lanes[i].seq < c->lanes[next].seq))
            next = (int)i;
    return next;
}

void relay_cycle_published(struct relay_cycle *c, size_t lane)
{
    if (c->stopping || c->lanes[lane].state != RELAY_LANE_PUBLISH)
        return;
    if (c->lanes[lane].doomed) {
        relay_cycle_failed(c, lane, RELAY_FAIL_POSTGRES,
                           "PostgreSQL connection lost while the batch was published");
        return;
    }
    publish_ended(c, lane);
    char why[256] = "PostgreSQL connection lost before the batch was marked sent";
    if (c->ops.finish(c->ops.arg, lane, why, sizeof(why)) < 0) {
        relay_cycle_failed(c, lane, RELAY_FAIL_POSTGRES, why);
        return;
    }
    set_stage(c, lane, RELAY_LANE_FINISH);
    if (c->ops.holds_keys != NULL && c->ops.holds_keys(c->ops.arg, lane)) {
        /* The later batches were claimed before these failures are
         * committed, so they may hold rows the failures hold back: they go
         * back, and the next claim waits for this commit. */
        c->hold_seq = c->lanes[lane].seq;
        c->want_claim = 1;
        roll_back_later(c, lane);
        return;
    }
    if (c->ops.left_rows != NULL && c->ops.left_rows(c->ops.arg, lane)) {
        /* Its rows left behind the batch ahead lie below the batches
         * claimed after it: those that have not published go back, and the
         * next claim waits until nothing is in flight, so that it takes the
         * left rows first, with no batch ahead to chain them to. */
        c->hold_all = 1;
        c->want_claim = 1;
        roll_back_later(c, lane);
        return;
    }
    /* Every reply of this batch is in: the next batch may publish now. */
    int next = next_claimed(c);
    if (next >= 0 && may_publish(c, (size_t)next))
        start_publish(c, (size_t)next);
}

void relay_cycle_committed(struct relay_cycle *c, size_t lane, int full)
{
    if (c->stopping || c->lanes[lane].state != RELAY_LANE_FINISH)
        return;
    if (c->lanes[lane].seq > c->failed_at_seq) {
        c->failures_in_row = 0;
        outbox_backoff_reset(&c->backoff);
    }
    /* A full batch means more may be waiting; a self-driven relay gets no
     * notifications, so it claims again until a claim comes back empty. */
    if (full || c->ops.self_driven(c->ops.arg))
        c->want_claim = 1;
    lane_ended(c, lane);
}

void relay_cycle_rolled_back(struct relay_cycle *c, size_t lane)
{
    if (c->stopping || c->lanes[lane].state != RELAY_LANE_ROLLBACK)
        return;
    lane_ended(c, lane);
}

void relay_cycle_lane_down(struct relay_cycle *c, size_t lane)
{
    if (c->stopping)
        return;
    struct relay_cycle_lane *l = &c->lanes[lane];
    if (l->state == RELAY_LANE_CLAIMED)
        relay_cycle_failed(c, lane, RELAY_FAIL_POSTGRES,
                           "PostgreSQL connection lost while the batch waited to publish");
    else if (l->state == RELAY_LANE_PUBLISH)
        l->doomed = 1; /* its rows are unlocked: it must not be marked sent */
}

void relay_cycle_retry_due(struct relay_cycle *c)
{
    c->in_backoff = 0;
    relay_cycle_want(c);
}

void relay_cycle_drain(struct relay_cycle *c)
{
    c->draining = 1;
    c->want_claim = 0;
    if (relay_cycle_all_idle(c))
        c->ops.drained(c->ops.arg);
}

int relay_cycle_stuck(const struct relay_cycle *c, double now, double limit)
{
    for (size_t i = 0; i < c->nlanes; i++) {
        const struct relay_cycle_lane *l = &c->lanes[i];
        if (l->state == RELAY_LANE_IDLE)
            continue;
        int claiming = l->state == RELAY_LANE_BEGIN || l->state == RELAY_LANE_CLAIM ||
                       l->state == RELAY_LANE_CLAIMED;
        if (now - (claiming ? l->claimed_at : l->stage_at) >= limit)
            return (int)i;
    }
    return -1;
}
