/*
 * Unit tests of relay/wake.c, the wake-up protocol: fake ops record every
 * command the machine would send on the LISTEN connection as a word in a log.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "relay/wake.h"

struct fake {
    char log[1024];
    double now;
    int rc; /* what every send returns */
};

static struct fake F;
static struct relay_wake W;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    size_t len = strlen(F.log);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(F.log + len, sizeof(F.log) - len, fmt, ap);
    va_end(ap);
    len = strlen(F.log);
    snprintf(F.log + len, sizeof(F.log) - len, " ");
}

static double op_now(void *arg)
{
    (void)arg;
    return F.now;
}
static int op_take_lock(void *arg)
{
    (void)arg;
    if (F.rc == 0)
        say("take_lock");
    return F.rc;
}
static int op_declare(void *arg)
{
    (void)arg;
    if (F.rc == 0)
        say("declare");
    return F.rc;
}
static int op_settle_check(void *arg)
{
    (void)arg;
    if (F.rc == 0)
        say("check");
    return F.rc;
}
static void op_arm_settle(void *arg, double delay)
{
    (void)arg;
    say("settle_in_%.0fms", delay * 1000);
}
static void op_want_claim(void *arg, double delay)
{
    (void)arg;
    say("claim_in_%.0fms", delay * 1000);
}
static void op_check_holder(void *arg)
{
    (void)arg;
    say("holder");
}

static const struct relay_wake_ops ops = {NULL,          op_now,          op_take_lock,
                                          op_declare,    op_settle_check, op_arm_settle,
                                          op_want_claim, op_check_holder};

static int setup(void **state)
{
    (void)state;
    memset(&F, 0, sizeof(F));
    relay_wake_init(&W, &ops, 1, 30.0);
    return 0;
}

#define expect_log(text)                                                                           \
    do {                                                                                           \
        assert_string_equal(F.log, text);                                                          \
        F.log[0] = '\0';                                                                           \
    } while (0)

/* Busy with the lock held. */
static void busy_and_held(void)
{
    relay_wake_busy(&W);
    relay_wake_lock_taken(&W, 1);
    F.log[0] = '\0';
}

static void test_starts_busy_for_the_catch_up(void **state)
{
    (void)state;
    assert_true(relay_wake_self_driven(&W));
    assert_int_equal(W.lock, RELAY_LOCK_FREE);
}

static void test_busy_takes_the_lock(void **state)
{
    (void)state;
    relay_wake_busy(&W);
    expect_log("take_lock ");
    assert_int_equal(W.lock, RELAY_LOCK_TAKING);
    relay_wake_busy(&W); /* already taking: no second request */
    expect_log("");
    relay_wake_lock_taken(&W, 1);
    assert_int_equal(W.lock, RELAY_LOCK_HELD);
}

static void test_lock_not_taken_is_tried_after_the_next_batch(void **state)
{
    (void)state;
    relay_wake_busy(&W);
    relay_wake_lock_taken(&W, 0); /* lock_timeout: a notifying producer */
    assert_int_equal(W.lock, RELAY_LOCK_FREE);
    F.log[0] = '\0';
    relay_wake_busy(&W);
    expect_log("take_lock ");
}

static void test_empty_claim_while_the_lock_is_pending(void **state)
{
    (void)state;
    relay_wake_busy(&W);
    F.log[0] = '\0';
    relay_wake_empty(&W);
    /* Producers already skip notifying: keep claiming until the lock answers. */
    expect_log("claim_in_2ms ");
    assert_int_equal(W.settling, 0);
    relay_wake_lock_taken(&W, 1);
    expect_log("claim_in_0ms ");
    relay_wake_empty(&W);
    expect_log("declare ");
}

static void test_declared_with_no_open_writer_ends_at_once(void **state)
{
    (void)state;
    busy_and_held();
    relay_wake_empty(&W);
    relay_wake_declared(&W, 1, 0);
    expect_log("declare claim_in_0ms holder ");
    assert_int_equal(W.mode, RELAY_WAKE_IDLE);
    assert_int_equal(W.lock, RELAY_LOCK_FREE);
    assert_false(relay_wake_self_driven(&W));
}

static void test_settle_waits_for_the_open_writers(void **state)
{
    (void)state;
    busy_and_held();
    F.now = 10.0;
    relay_wake_empty(&W);
    relay_wake_declared(&W, 1, 2);
    expect_log("declare check ");
    relay_wake_settle_checked(&W, 2);
    expect_log("settle_in_1ms ");
    F.now = 10.05;
    relay_wake_settle_due(&W);
    relay_wake_settle_checked(&W, 1);
    expect_log("check settle_in_10ms ");
    F.now = 10.5;
    relay_wake_settle_due(&W);
    relay_wake_settle_checked(&W, 1);
    expect_log("check settle_in_50ms ");
    relay_wake_settle_due(&W);
    relay_wake_settle_checked(&W, 0);
    expect_log("check claim_in_0ms holder ");
    assert_int_equal(W.settling, 0);
}

static void test_settle_is_bounded_by_the_poll(void **state)
{
    (void)state;
    busy_and_held();
    relay_wake_empty(&W);
    relay_wake_declared(&W, 1, 1);
    F.log[0] = '\0';
    F.now = 30.0; /* poll_interval has passed: the poll covers the rest */
    relay_wake_settle_checked(&W, 1);
    expect_log("claim_in_0ms holder ");
}

static void test_settle_check_that_fails_ends_the_settle(void **state)
{
    (void)state;
    busy_and_held();
    relay_wake_empty(&W);
    relay_wake_declared(&W, 1, 1);
    F.log[0] = '\0';
    relay_wake_settle_checked(&W, -1);
    expect_log("claim_in_0ms holder ");
}

static void test_declare_that_fails_stays_busy(void **state)
{
    (void)state;
    busy_and_held();
    relay_wake_empty(&W);
    relay_wake_declared(&W, 0, 0);
    expect_log("declare ");
    assert_int_equal(W.mode, RELAY_WAKE_BUSY);
    assert_int_equal(W.settling, 0);
}

static void test_declare_that_cannot_be_sent(void **state)
{
    (void)state;
    busy_and_held();
    F.rc = -1;
    relay_wake_empty(&W);
    expect_log("");
    assert_int_equal(W.settling, 0);
    assert_true(relay_wake_self_driven(&W));
}

static void test_nothing_new_while_settling(void **state)
{
    (void)state;
    busy_and_held();
    relay_wake_empty(&W);
    relay_wake_declared(&W, 1, 1);
    F.log[0] = '\0';
    relay_wake_empty(&W);
    relay_wake_busy(&W); /* rows found during the settle: busy, lock later */
    expect_log("");
    assert_true(relay_wake_self_driven(&W));
    relay_wake_settle_checked(&W, 0);
    relay_wake_busy(&W);
    expect_log("claim_in_0ms holder take_lock ");
}

static void test_listen_connection_lost_frees_the_lock(void **state)
{
    (void)state;
    busy_and_held();
    relay_wake_listen_down(&W);
    assert_int_equal(W.lock, RELAY_LOCK_FREE);
}

static void test_poll_checks_the_holder_only_when_idle(void **state)
{
    (void)state;
    relay_wake_poll(&W);
    expect_log("");
    busy_and_held();
    relay_wake_empty(&W);
    relay_wake_declared(&W, 1, 0);
    F.log[0] = '\0';
    relay_wake_poll(&W);
    expect_log("holder ");
}

static void test_listen_off_does_nothing(void **state)
{
    (void)state;
    relay_wake_init(&W, &ops, 0, 1.0);
    relay_wake_busy(&W);
    relay_wake_empty(&W);
    expect_log("");
    assert_false(relay_wake_self_driven(&W));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_starts_busy_for_the_catch_up, setup),
        cmocka_unit_test_setup(test_busy_takes_the_lock, setup),
        cmocka_unit_test_setup(test_lock_not_taken_is_tried_after_the_next_batch, setup),
        cmocka_unit_test_setup(test_empty_claim_while_the_lock_is_pending, setup),
        cmocka_unit_test_setup(test_declared_with_no_open_writer_ends_at_once, setup),
        cmocka_unit_test_setup(test_settle_waits_for_the_open_writers, setup),
        cmocka_unit_test_setup(test_settle_is_bounded_by_the_poll, setup),
        cmocka_unit_test_setup(test_settle_check_that_fails_ends_the_settle, setup),
        cmocka_unit_test_setup(test_declare_that_fails_stays_busy, setup),
        cmocka_unit_test_setup(test_declare_that_cannot_be_sent, setup),
        cmocka_unit_test_setup(test_nothing_new_while_settling, setup),
        cmocka_unit_test_setup(test_listen_connection_lost_frees_the_lock, setup),
        cmocka_unit_test_setup(test_poll_checks_the_holder_only_when_idle, setup),
        cmocka_unit_test_setup(test_listen_off_does_nothing, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
