/*
 * Unit tests of relay/cycle.c: scripts of events played against fake ops that
 * record every effect as a word in a log ("begin0 claim0 publish0 ..."), so
 * each test states the whole sequence it expects.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "relay/cycle.h"

struct fake {
    char log[2048];
    double now;
    int lane_ready[2];
    int sink_ready;
    int begin_rc, claim_rc, finish_rc, rollback_rc;
    double begin_takes;      /* how far the clock moves while BEGIN is sent */
    double claimed_at_begin; /* the lane's claimed_at as begin saw it */
    int self_driven;
    int publish_ends; /* 0: replies come later; 1: published at once; 2: failed at once */
    int holds[2];     /* what holds_keys answers for each lane */
    int overlap;      /* what overlap answers */
    int left[2];      /* what left_rows answers for each lane */
    uint32_t last_retry_ms;
    struct relay_cycle *c;
};

static void say(struct fake *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(struct fake *f, const char *fmt, ...)
{
    size_t len = strlen(f->log);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->log + len, sizeof(f->log) - len, fmt, ap);
    va_end(ap);
    len = strlen(f->log);
    snprintf(f->log + len, sizeof(f->log) - len, " ");
}

static double op_now(void *arg)
{
    return ((struct fake *)arg)->now;
}
static int op_lane_ready(void *arg, size_t lane)
{
    return ((struct fake *)arg)->lane_ready[lane];
}
static int op_sink_ready(void *arg)
{
    return ((struct fake *)arg)->sink_ready;
}
static int op_begin(void *arg, size_t lane)
{
    struct fake *f = arg;
    f->claimed_at_begin = f->c->lanes[lane].claimed_at;
    f->now += f->begin_takes;
    if (f->begin_rc == 0)
        say(f, "begin%zu", lane);
    return f->begin_rc;
}
static int op_claim(void *arg, size_t lane, char *why, size_t whylen)
{
    struct fake *f = arg;
    (void)why;
    (void)whylen;
    if (f->claim_rc == 0)
        say(f, "claim%zu", lane);
    return f->claim_rc;
}
static void op_publish(void *arg, size_t lane)
{
    struct fake *f = arg;
    say(f, "publish%zu", lane);
    if (f->publish_ends == 1)
        relay_cycle_published(f->c, lane);
    else if (f->publish_ends == 2)
        relay_cycle_failed(f->c, lane, RELAY_FAIL_REDIS_CONNECTION, "not ready");
}
static int op_finish(void *arg, size_t lane, char *why, size_t whylen)
{
    struct fake *f = arg;
    (void)why;
    (void)whylen;
    if (f->finish_rc == 0)
        say(f, "finish%zu", lane);
    return f->finish_rc;
}
static int op_rollback(void *arg, size_t lane, int empty)
{
    struct fake *f = arg;
    if (f->rollback_rc == 0)
        say(f, "%s%zu", empty ? "commit_empty" : "rollback", lane);
    return f->rollback_rc;
}
static void op_release(void *arg, size_t lane)
{
    say(arg, "release%zu", lane);
}
static void op_failed(void *arg, size_t lane, enum relay_fail_kind kind, const char *why)
{
    (void)why;
    say(arg, "failed%zu:%s", lane, relay_fail_kind_name(kind));
}
static void op_kick(void *arg)
{
    say(arg, "kick");
}
static void op_arm_retry(void *arg, uint32_t ms)
{
    struct fake *f = arg;
    f->last_retry_ms = ms;
    say(f, "retry");
}
static int op_self_driven(void *arg)
{
    return ((struct fake *)arg)->self_driven;
}
static void op_went_empty(void *arg)
{
    say(arg, "empty");
}
static void op_drained(void *arg)
{
    say(arg, "drained");
}

static int op_holds_keys(void *arg, size_t lane)
{
    return ((struct fake *)arg)->holds[lane];
}

static int op_overlap(void *arg, size_t ahead, size_t lane)
{
    struct fake *f = arg;
    say(f, "overlap%zu>%zu?", ahead, lane);
    return f->overlap;
}

static int op_left_rows(void *arg, size_t lane)
{
    return ((struct fake *)arg)->left[lane];
}

static struct fake F;
static struct relay_cycle C;

static const struct relay_cycle_ops fake_ops = {
    &F,         op_now,        op_lane_ready, op_sink_ready,  op_begin,
    op_claim,   op_publish,    op_finish,     op_rollback,    op_release,
    op_failed,  op_kick,       op_arm_retry,  op_self_driven, op_went_empty,
    op_drained, op_holds_keys, op_overlap,    op_left_rows};

static int setup(size_t nlanes)
{
    memset(&F, 0, sizeof(F));
    F.lane_ready[0] = F.lane_ready[1] = 1;
    F.sink_ready = 1;
    F.c = &C;
    relay_cycle_init(&C, &fake_ops, nlanes, 100, 10000);
    return 0;
}
static int one_lane(void **state)
{
    (void)state;
    return setup(1);
}
static int two_lanes(void **state)
{
    (void)state;
    return setup(2);
}

/* Asserts the log so far and clears it. */
#define expect_log(text)                                                                           \
    do {                                                                                           \
        assert_string_equal(F.log, text);                                                          \
        F.log[0] = '\0';                                                                           \
    } while (0)

/* Claims a batch of n rows on the free lane; leaves the log empty. */
static size_t claim_batch(size_t lane, size_t n, int full)
{
    relay_cycle_run(&C);
    relay_cycle_begun(&C, lane);
    relay_cycle_claimed(&C, lane, n, full);
    F.log[0] = '\0';
    return lane;
}

static void test_starts_wanting_the_catch_up_claim(void **state)
{
    (void)state;
    relay_cycle_run(&C);
    expect_log("begin0 ");
    assert_int_equal(C.lanes[0].state, RELAY_LANE_BEGIN);
}

static void test_no_claim_while_redis_is_down(void **state)
{
    (void)state;
    F.sink_ready = 0;
    relay_cycle_run(&C);
    expect_log("");
    F.sink_ready = 1;
    relay_cycle_want(&C);
    expect_log("kick ");
    relay_cycle_run(&C);
    expect_log("begin0 ");
}

static void test_whole_cycle_on_one_lane(void **state)
{
    (void)state;
    relay_cycle_run(&C);
    relay_cycle_begun(&C, 0);
    relay_cycle_claimed(&C, 0, 5, 0);
    expect_log("begin0 claim0 publish0 ");
    relay_cycle_published(&C, 0);
    expect_log("finish0 ");
    relay_cycle_committed(&C, 0, 0);
    /* Not full and not self-driven: nothing more to claim. */
    expect_log("release0 ");
    assert_true(relay_cycle_all_idle(&C));
    assert_int_equal(C.want_claim, 0);
}

static void test_full_batch_claims_again_at_once(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    relay_cycle_published(&C, 0);
    relay_cycle_committed(&C, 0, 1);
    expect_log("finish0 release0 kick ");
    relay_cycle_run(&C);
    expect_log("begin0 ");
}

static void test_self_driven_relay_claims_until_empty(void **state)
{
    (void)state;
    F.self_driven = 1;
    claim_batch(0, 3, 0);
    relay_cycle_published(&C, 0);
    relay_cycle_committed(&C, 0, 0);
    expect_log("finish0 release0 kick ");
}

static void test_full_batch_claims_ahead_on_the_other_lane(void **state)
{
    (void)state;
    relay_cycle_run(&C);
    relay_cycle_begun(&C, 0);
    relay_cycle_claimed(&C, 0, 500, 1);
    expect_log("begin0 claim0 publish0 begin1 ");
    assert_int_equal(relay_cycle_in_flight(&C), 2);
}

static void test_second_batch_waits_for_every_reply_of_the_first(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 500, 1);
    expect_log("claim1 overlap0>1? ");
    assert_int_equal(C.lanes[1].state, RELAY_LANE_CLAIMED);
    relay_cycle_published(&C, 0);
    expect_log("finish0 publish1 ");
}

/* Lane 0 publishes a full batch; lane 1 claims one and, allowed to, publishes
 * it behind at once. Leaves the log empty. */
static void publish_two_overlapping(void)
{
    F.overlap = 1;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 500, 1);
    assert_int_equal(C.lanes[1].state, RELAY_LANE_PUBLISH);
    F.log[0] = '\0';
}

/* Allowed to, the second batch publishes behind the first at once; the
 * first's replies still end first, and the second is then the one whose
 * deadline runs. */
static void test_second_batch_follows_the_first_when_overlap_allows(void **state)
{
    (void)state;
    F.overlap = 1;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 500, 1);
    expect_log("claim1 overlap0>1? publish1 ");
    assert_int_equal(C.lanes[1].state, RELAY_LANE_PUBLISH);
    assert_int_equal(C.publishing, 0);
    /* Both lanes are busy: nothing more is claimed. */
    relay_cycle_run(&C);
    expect_log("");
    relay_cycle_published(&C, 0);
    expect_log("finish0 ");
    assert_int_equal(C.publishing, 1);
    relay_cycle_committed(&C, 0, 1);
    relay_cycle_run(&C);
    expect_log("release0 kick begin0 ");
    relay_cycle_begun(&C, 0);
    relay_cycle_claimed(&C, 0, 500, 1);
    expect_log("claim0 overlap1>0? publish0 ");
    relay_cycle_published(&C, 1);
    expect_log("finish1 ");
    assert_int_equal(C.publishing, 0);
}

/* The batch behind a failed one that already publishes keeps going: its
 * rows reach a stream only behind the failed batch's rows there (the order
 * check), so it is marked sent on its own replies. Its claim passed over the
 * failed batch's rows, so nothing is claimed until it has ended too, and its
 * commit does not end the failures in a row. */
static void test_failure_ahead_leaves_the_batch_publishing_behind_it(void **state)
{
    (void)state;
    publish_two_overlapping();
    relay_cycle_failed(&C, 0, RELAY_FAIL_REDIS_ERROR, "OOM");
    expect_log("failed0:redis_error retry rollback0 ");
    assert_int_equal(C.lanes[1].state, RELAY_LANE_PUBLISH);
    assert_int_equal(C.publishing, 1);
    relay_cycle_published(&C, 1);
    expect_log("finish1 ");
    relay_cycle_rolled_back(&C, 0);
    relay_cycle_retry_due(&C);
    relay_cycle_run(&C);
    expect_log("release0 ");
    relay_cycle_committed(&C, 1, 1);
    assert_int_equal(C.failures_in_row, 1);
    relay_cycle_run(&C);
    expect_log("release1 kick begin0 ");
    assert_int_equal(C.publishing, -1);
}

/* The same when the batch behind has all its replies already (another
 * cluster node answered first) and is being marked sent. */
static void test_failure_ahead_of_a_finishing_batch_holds_the_next_claim(void **state)
{
    (void)state;
    publish_two_overlapping();
    relay_cycle_published(&C, 1);
    relay_cycle_failed(&C, 0, RELAY_FAIL_REDIS_TIMEOUT, "no reply");
    relay_cycle_rolled_back(&C, 0);
    relay_cycle_retry_due(&C);
    relay_cycle_run(&C);
    expect_log("finish1 failed0:redis_timeout retry rollback0 release0 ");
    relay_cycle_committed(&C, 1, 0);
    relay_cycle_run(&C);
    expect_log("release1 kick begin0 ");
}

/* A batch that left rows behind the batch ahead: the batch claimed after it
 * goes back unpublished, and the next claim waits until nothing is in
 * flight, so that it starts from the left rows. */
static void test_rows_left_behind_hold_the_next_claim_until_all_end(void **state)
{
    (void)state;
    publish_two_overlapping();
    relay_cycle_published(&C, 0);
    relay_cycle_committed(&C, 0, 1);
    relay_cycle_run(&C);
    relay_cycle_begun(&C, 0);
    F.overlap = 0;
    relay_cycle_claimed(&C, 0, 500, 1);
    expect_log("finish0 release0 kick begin0 claim0 overlap1>0? ");
    assert_int_equal(C.lanes[0].state, RELAY_LANE_CLAIMED);
    F.left[1] = 1;
    relay_cycle_published(&C, 1);
    expect_log("finish1 rollback0 ");
    relay_cycle_rolled_back(&C, 0);
    relay_cycle_want(&C);
    relay_cycle_run(&C);
    expect_log("release0 ");
    relay_cycle_committed(&C, 1, 1);
    relay_cycle_run(&C);
    expect_log("release1 kick begin0 ");
}

/* A batch may not follow one whose claiming connection broke while it
 * published: that batch will fail, and the one behind waits as before. */
static void test_no_overlap_behind_a_doomed_batch(void **state)
{
    (void)state;
    F.overlap = 1;
    claim_batch(0, 500, 1);
    relay_cycle_lane_down(&C, 0);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 500, 1);
    expect_log("claim1 ");
    assert_int_equal(C.lanes[1].state, RELAY_LANE_CLAIMED);
}

/* With the second batch's replies in first (it went to other cluster
 * nodes), it finishes first; the first is still the one publishing. */
static void test_batch_behind_may_finish_first(void **state)
{
    (void)state;
    publish_two_overlapping();
    relay_cycle_published(&C, 1);
    expect_log("finish1 ");
    assert_int_equal(C.publishing, 0);
    relay_cycle_published(&C, 0);
    expect_log("finish0 ");
    assert_int_equal(C.publishing, -1);
}

/* A batch whose failed rows hold back their keys: the batch claimed behind
 * it (before its failures are committed) goes back without publishing, and
 * nothing is claimed until its commit has ended. */
static void test_failed_rows_that_hold_keys_send_the_next_batch_back(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 500, 1);
    expect_log("claim1 overlap0>1? ");
    F.holds[0] = 1;
    relay_cycle_published(&C, 0);
    expect_log("finish0 rollback1 ");
    relay_cycle_rolled_back(&C, 1);
    expect_log("release1 ");
    relay_cycle_run(&C);
    expect_log("");
    relay_cycle_committed(&C, 0, 1);
    expect_log("release0 kick ");
    relay_cycle_run(&C);
    expect_log("begin0 ");
    assert_int_equal(C.hold_seq, 0);
}

/* The same while the next batch is still claiming: abandoned when its claim
 * returns; a failed commit ends the hold as well. */
static void test_hold_abandons_a_claim_in_flight_and_ends_with_a_failed_commit(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    expect_log("claim1 ");
    F.holds[0] = 1;
    relay_cycle_published(&C, 0);
    expect_log("finish0 ");
    relay_cycle_claimed(&C, 1, 500, 1);
    expect_log("rollback1 ");
    relay_cycle_rolled_back(&C, 1);
    expect_log("release1 ");
    relay_cycle_failed(&C, 0, RELAY_FAIL_POSTGRES, "COMMIT failed");
    expect_log("failed0:postgres retry rollback0 ");
    relay_cycle_rolled_back(&C, 0);
    expect_log("release0 ");
    assert_int_equal(C.hold_seq, 0);
    relay_cycle_retry_due(&C);
    expect_log("kick ");
}

/* Nothing held: the next batch publishes as ever. */
static void test_batch_without_held_keys_lets_the_next_publish(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 500, 1);
    F.holds[1] = 1; /* the other lane's answer does not matter here */
    F.log[0] = '\0';
    relay_cycle_published(&C, 0);
    expect_log("finish0 publish1 ");
}

static void test_never_more_than_two_batches(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 500, 1);
    F.log[0] = '\0';
    relay_cycle_want(&C);
    relay_cycle_run(&C);
    expect_log("");
    /* Lane 0 commits: it claims the third batch, on the lane just freed. */
    relay_cycle_published(&C, 0);
    relay_cycle_committed(&C, 0, 1);
    expect_log("finish0 publish1 release0 kick ");
    relay_cycle_run(&C);
    expect_log("begin0 ");
    assert_int_equal(C.lanes[0].seq, 3);
}

static void test_one_claim_at_a_time(void **state)
{
    (void)state;
    relay_cycle_run(&C);
    expect_log("begin0 ");
    relay_cycle_want(&C);
    relay_cycle_run(&C);
    expect_log("");
}

static void test_failure_after_the_next_batch_was_claimed_rolls_both_back(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 500, 1);
    F.log[0] = '\0';
    relay_cycle_failed(&C, 0, RELAY_FAIL_REDIS_TIMEOUT, "no reply");
    /* The later batch goes first, so its rows never overtake batch 0's. */
    expect_log("failed0:redis_timeout retry rollback1 rollback0 ");
    relay_cycle_rolled_back(&C, 1);
    relay_cycle_rolled_back(&C, 0);
    expect_log("release1 release0 ");
    assert_int_equal(C.publishing, -1);
}

static void test_failure_while_the_next_batch_is_claiming_abandons_it(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    assert_int_equal(C.lanes[1].state, RELAY_LANE_BEGIN);
    relay_cycle_failed(&C, 0, RELAY_FAIL_REDIS_CONNECTION, "lost");
    expect_log("failed0:redis_connection retry rollback0 ");
    relay_cycle_begun(&C, 1);
    expect_log("rollback1 ");
    relay_cycle_rolled_back(&C, 1);
    relay_cycle_rolled_back(&C, 0);
    expect_log("release1 release0 ");
}

static void test_abandoned_claim_is_rolled_back_not_published(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    F.log[0] = '\0';
    relay_cycle_failed(&C, 0, RELAY_FAIL_REDIS_ERROR, "OOM");
    F.log[0] = '\0';
    relay_cycle_claimed(&C, 1, 500, 1);
    expect_log("rollback1 ");
}

static void test_failure_backs_off_until_retry_is_due(void **state)
{
    (void)state;
    claim_batch(0, 5, 0);
    relay_cycle_failed(&C, 0, RELAY_FAIL_REDIS_ERROR, "OOM");
    relay_cycle_rolled_back(&C, 0);
    F.log[0] = '\0';
    relay_cycle_want(&C);
    relay_cycle_run(&C);
    expect_log("");
    assert_in_range(F.last_retry_ms, 50, 100);
    relay_cycle_retry_due(&C);
    expect_log("kick ");
    relay_cycle_run(&C);
    expect_log("begin0 ");
}

static void test_failures_in_row_and_reset_on_commit(void **state)
{
    (void)state;
    for (int i = 0; i < 3; i++) {
        claim_batch(0, 5, 0);
        relay_cycle_failed(&C, 0, RELAY_FAIL_POSTGRES, "gone");
        relay_cycle_rolled_back(&C, 0);
        relay_cycle_retry_due(&C);
    }
    assert_int_equal(C.failures_in_row, 3);
    assert_int_equal(C.backoff.attempt, 3);
    claim_batch(0, 5, 0);
    relay_cycle_published(&C, 0);
    relay_cycle_committed(&C, 0, 0);
    assert_int_equal(C.failures_in_row, 0);
    assert_int_equal(C.backoff.attempt, 0);
}

static void test_empty_claim_alone_declares_idle(void **state)
{
    (void)state;
    F.self_driven = 1;
    relay_cycle_run(&C);
    relay_cycle_begun(&C, 0);
    relay_cycle_claimed(&C, 0, 0, 0);
    expect_log("begin0 claim0 empty commit_empty0 ");
    relay_cycle_rolled_back(&C, 0);
    expect_log("release0 ");
}

static void test_empty_claim_while_the_other_lane_finishes_claims_again(void **state)
{
    (void)state;
    F.self_driven = 1;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 0, 0);
    /* Not idle yet: lane 0 still publishes. Claim again once it can. */
    expect_log("claim1 commit_empty1 ");
    assert_int_equal(C.want_claim, 1);
    relay_cycle_rolled_back(&C, 1);
    expect_log("release1 kick ");
}

static void test_empty_claim_of_a_notified_relay_just_ends(void **state)
{
    (void)state;
    relay_cycle_run(&C);
    relay_cycle_begun(&C, 0);
    relay_cycle_claimed(&C, 0, 0, 0);
    expect_log("begin0 claim0 commit_empty0 ");
    assert_int_equal(C.want_claim, 0);
}

static void test_drain_waits_for_the_batch_in_flight(void **state)
{
    (void)state;
    claim_batch(0, 5, 0);
    relay_cycle_drain(&C);
    expect_log("");
    relay_cycle_want(&C);
    relay_cycle_run(&C);
    expect_log("");
    relay_cycle_published(&C, 0);
    relay_cycle_committed(&C, 0, 1);
    expect_log("finish0 release0 drained ");
}

static void test_drain_when_idle_is_immediate(void **state)
{
    (void)state;
    relay_cycle_drain(&C);
    expect_log("drained ");
}

static void test_drain_waits_for_both_lanes(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 500, 1);
    relay_cycle_drain(&C);
    F.log[0] = '\0';
    relay_cycle_published(&C, 0);
    relay_cycle_committed(&C, 0, 1);
    expect_log("finish0 publish1 release0 ");
    relay_cycle_published(&C, 1);
    relay_cycle_committed(&C, 1, 1);
    expect_log("finish1 release1 drained ");
}

static void test_stuck_stage_is_detected(void **state)
{
    (void)state;
    assert_int_equal(relay_cycle_stuck(&C, 1000.0, 10.0), -1);
    F.now = 100.0;
    relay_cycle_run(&C);
    relay_cycle_begun(&C, 0);
    F.now = 105.0;
    relay_cycle_claimed(&C, 0, 5, 0); /* publishing since 105 */
    assert_int_equal(relay_cycle_stuck(&C, 114.0, 10.0), -1);
    assert_int_equal(relay_cycle_stuck(&C, 115.0, 10.0), 0);
}

static void test_claiming_counts_from_the_claim(void **state)
{
    (void)state;
    F.now = 100.0;
    relay_cycle_run(&C);
    F.now = 108.0;
    relay_cycle_begun(&C, 0); /* in CLAIM since 108, but claiming since 100 */
    assert_int_equal(relay_cycle_stuck(&C, 110.0, 10.0), 0);
}

/* The batch's start is read before BEGIN is sent, and begin sees it: the
 * batch's phases and its duration then count from the same instant, and the
 * publish deadline does not lose the time the send took. */
static void test_batch_counts_from_before_begin_was_sent(void **state)
{
    (void)state;
    F.now = 100.0;
    F.begin_takes = 0.005;
    relay_cycle_run(&C);
    assert_true(C.lanes[0].claimed_at == 100.0);
    assert_true(F.claimed_at_begin == 100.0);
}

static void test_claiming_connection_lost_while_waiting_to_publish(void **state)
{
    (void)state;
    claim_batch(0, 500, 1);
    relay_cycle_begun(&C, 1);
    relay_cycle_claimed(&C, 1, 500, 1);
    F.log[0] = '\0';
    F.rollback_rc = -1; /* the connection is gone: the lane ends at once */
    relay_cycle_lane_down(&C, 1);
    expect_log("failed1:postgres retry release1 ");
    assert_int_equal(C.lanes[0].state, RELAY_LANE_PUBLISH);
}

static void test_claiming_connection_lost_while_publishing(void **state)
{
    (void)state;
    claim_batch(0, 5, 0);
    relay_cycle_lane_down(&C, 0);
    expect_log("");
    /* Its row locks are gone: the replies must not lead to a mark. */
    F.rollback_rc = -1;
    relay_cycle_published(&C, 0);
    expect_log("failed0:postgres retry release0 ");
}

static void test_connection_lost_with_a_command_in_flight(void **state)
{
    (void)state;
    F.rollback_rc = -1;
    for (enum relay_lane_state st = RELAY_LANE_BEGIN; st <= RELAY_LANE_FINISH; st++) {
        setup(1);
        F.rollback_rc = -1;
        relay_cycle_run(&C);
        if (st >= RELAY_LANE_CLAIM)
            relay_cycle_begun(&C, 0);
        if (st >= RELAY_LANE_PUBLISH)
            relay_cycle_claimed(&C, 0, 5, 0);
        if (st >= RELAY_LANE_FINISH)
            relay_cycle_published(&C, 0);
        if (st == RELAY_LANE_CLAIMED)
            continue; /* one lane never waits to publish */
        assert_int_equal(C.lanes[0].state, st);
        relay_cycle_lane_down(&C, 0); /* the command's failure is the event */
        F.log[0] = '\0';
        relay_cycle_failed(&C, 0, RELAY_FAIL_POSTGRES, "server closed the connection");
        expect_log("failed0:postgres retry release0 ");
        assert_true(relay_cycle_all_idle(&C));
    }
}

static void test_redis_lost_while_publishing(void **state)
{
    (void)state;
    claim_batch(0, 5, 0);
    relay_cycle_failed(&C, 0, RELAY_FAIL_REDIS_CONNECTION, "connection lost");
    expect_log("failed0:redis_connection retry rollback0 ");
}

static void test_begin_that_cannot_be_sent_stays_wanted(void **state)
{
    (void)state;
    F.begin_rc = -1;
    relay_cycle_run(&C);
    expect_log("");
    assert_int_equal(C.want_claim, 1);
    assert_true(relay_cycle_all_idle(&C));
    F.lane_ready[0] = 0;
    relay_cycle_want(&C);
    expect_log(""); /* no lane ready: the connection coming up wants again */
}

static void test_claim_that_cannot_be_sent_fails_the_batch(void **state)
{
    (void)state;
    F.claim_rc = -1;
    F.rollback_rc = -1;
    relay_cycle_run(&C);
    relay_cycle_begun(&C, 0);
    expect_log("begin0 failed0:postgres retry release0 ");
}

static void test_mark_that_cannot_be_sent_fails_the_batch(void **state)
{
    (void)state;
    claim_batch(0, 5, 0);
    F.finish_rc = -1;
    relay_cycle_published(&C, 0);
    expect_log("failed0:postgres retry rollback0 ");
}

static void test_batch_that_publishes_nothing_ends_at_once(void **state)
{
    (void)state;
    F.publish_ends = 1; /* every row failed on its own: nothing to wait for */
    relay_cycle_run(&C);
    relay_cycle_begun(&C, 0);
    relay_cycle_claimed(&C, 0, 5, 0);
    expect_log("begin0 claim0 publish0 finish0 ");
    F.publish_ends = 2;
    relay_cycle_committed(&C, 0, 0);
    relay_cycle_want(&C);
    relay_cycle_run(&C);
    relay_cycle_begun(&C, 0);
    F.log[0] = '\0';
    relay_cycle_claimed(&C, 0, 5, 0);
    expect_log("publish0 failed0:redis_connection retry rollback0 ");
}

static void test_stale_events_are_ignored(void **state)
{
    (void)state;
    relay_cycle_committed(&C, 0, 1);
    relay_cycle_published(&C, 0);
    relay_cycle_rolled_back(&C, 0);
    relay_cycle_failed(&C, 0, RELAY_FAIL_POSTGRES, "late");
    relay_cycle_claimed(&C, 0, 5, 0);
    expect_log("");
    assert_int_equal(C.failures_in_row, 0);
}

static void test_stopping_ignores_everything(void **state)
{
    (void)state;
    claim_batch(0, 5, 0);
    C.stopping = 1;
    relay_cycle_published(&C, 0);
    relay_cycle_failed(&C, 0, RELAY_FAIL_POSTGRES, "x");
    relay_cycle_want(&C);
    expect_log("");
}

static void test_fail_kind_names(void **state)
{
    (void)state;
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_REDIS_CONNECTION), "redis_connection");
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_REDIS_TIMEOUT), "redis_timeout");
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_REDIS_REPLICAS), "redis_replicas");
    assert_string_equal(relay_fail_kind_name(RELAY_FAIL_POSTGRES), "postgres");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_starts_wanting_the_catch_up_claim, one_lane),
        cmocka_unit_test_setup(test_no_claim_while_redis_is_down, one_lane),
        cmocka_unit_test_setup(test_whole_cycle_on_one_lane, one_lane),
        cmocka_unit_test_setup(test_full_batch_claims_again_at_once, one_lane),
        cmocka_unit_test_setup(test_self_driven_relay_claims_until_empty, one_lane),
        cmocka_unit_test_setup(test_full_batch_claims_ahead_on_the_other_lane, two_lanes),
        cmocka_unit_test_setup(test_second_batch_waits_for_every_reply_of_the_first, two_lanes),
        cmocka_unit_test_setup(test_second_batch_follows_the_first_when_overlap_allows, two_lanes),
        cmocka_unit_test_setup(test_failure_ahead_leaves_the_batch_publishing_behind_it, two_lanes),
        cmocka_unit_test_setup(test_failure_ahead_of_a_finishing_batch_holds_the_next_claim,
                               two_lanes),
        cmocka_unit_test_setup(test_rows_left_behind_hold_the_next_claim_until_all_end, two_lanes),
        cmocka_unit_test_setup(test_no_overlap_behind_a_doomed_batch, two_lanes),
        cmocka_unit_test_setup(test_batch_behind_may_finish_first, two_lanes),
        cmocka_unit_test_setup(test_failed_rows_that_hold_keys_send_the_next_batch_back, two_lanes),
        cmocka_unit_test_setup(test_hold_abandons_a_claim_in_flight_and_ends_with_a_failed_commit,
                               two_lanes),
        cmocka_unit_test_setup(test_batch_without_held_keys_lets_the_next_publish, two_lanes),
        cmocka_unit_test_setup(test_never_more_than_two_batches, two_lanes),
        cmocka_unit_test_setup(test_one_claim_at_a_time, two_lanes),
        cmocka_unit_test_setup(test_failure_after_the_next_batch_was_claimed_rolls_both_back,
                               two_lanes),
        cmocka_unit_test_setup(test_failure_while_the_next_batch_is_claiming_abandons_it,
                               two_lanes),
        cmocka_unit_test_setup(test_abandoned_claim_is_rolled_back_not_published, two_lanes),
        cmocka_unit_test_setup(test_failure_backs_off_until_retry_is_due, one_lane),
        cmocka_unit_test_setup(test_failures_in_row_and_reset_on_commit, one_lane),
        cmocka_unit_test_setup(test_empty_claim_alone_declares_idle, two_lanes),
        cmocka_unit_test_setup(test_empty_claim_while_the_other_lane_finishes_claims_again,
                               two_lanes),
        cmocka_unit_test_setup(test_empty_claim_of_a_notified_relay_just_ends, one_lane),
        cmocka_unit_test_setup(test_drain_waits_for_the_batch_in_flight, one_lane),
        cmocka_unit_test_setup(test_drain_when_idle_is_immediate, two_lanes),
        cmocka_unit_test_setup(test_drain_waits_for_both_lanes, two_lanes),
        cmocka_unit_test_setup(test_stuck_stage_is_detected, one_lane),
        cmocka_unit_test_setup(test_claiming_counts_from_the_claim, one_lane),
        cmocka_unit_test_setup(test_batch_counts_from_before_begin_was_sent, one_lane),
        cmocka_unit_test_setup(test_claiming_connection_lost_while_waiting_to_publish, two_lanes),
        cmocka_unit_test_setup(test_claiming_connection_lost_while_publishing, one_lane),
        cmocka_unit_test_setup(test_connection_lost_with_a_command_in_flight, one_lane),
        cmocka_unit_test_setup(test_redis_lost_while_publishing, one_lane),
        cmocka_unit_test_setup(test_begin_that_cannot_be_sent_stays_wanted, one_lane),
        cmocka_unit_test_setup(test_claim_that_cannot_be_sent_fails_the_batch, one_lane),
        cmocka_unit_test_setup(test_mark_that_cannot_be_sent_fails_the_batch, one_lane),
        cmocka_unit_test_setup(test_batch_that_publishes_nothing_ends_at_once, one_lane),
        cmocka_unit_test_setup(test_stale_events_are_ignored, one_lane),
        cmocka_unit_test_setup(test_stopping_ignores_everything, one_lane),
        cmocka_unit_test(test_fail_kind_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
