/*
 * Unit tests of relay/loop.c: scripts of events played against fake ops that
 * record every effect as a word in a log ("tick read2.0 publish0 ..."), so
 * each test states the whole sequence it expects.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "relay/loop.h"

struct fake {
    char log[2048];
    int ready;
    int send_rc;      /* what tick, read and record answer */
    int publish_ends; /* 0: answers come later; 1: published at once; 2: failed at once */
    uint64_t gen;     /* the generation of the last call */
    uint32_t last_retry_ms;
    int reload;      /* what prepare answers once */
    uint64_t behind; /* the lowest position behind the lead; 0: none */
    struct relay_loop *l;
};

static struct fake F;
static struct relay_loop L;

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

static int op_ready(void *arg)
{
    return ((struct fake *)arg)->ready;
}
static int op_tick(void *arg, uint64_t gen)
{
    struct fake *f = arg;
    f->gen = gen;
    if (f->send_rc == 0)
        say(f, "tick");
    return f->send_rc;
}
static int op_read(void *arg, uint64_t gen, uint64_t prev, uint64_t next, uint32_t chunk)
{
    struct fake *f = arg;
    f->gen = gen;
    if (f->send_rc == 0)
        say(f, "read%llu-%llu.%u", (unsigned long long)prev, (unsigned long long)next, chunk);
    return f->send_rc;
}
static void op_publish(void *arg, uint64_t gen, uint32_t chunk)
{
    struct fake *f = arg;
    f->gen = gen;
    say(f, "publish%u", chunk);
    if (f->publish_ends == 1)
        relay_loop_published(f->l, gen, chunk);
    else if (f->publish_ends == 2)
        relay_loop_failed(f->l, gen, RELAY_FAIL_REDIS_CONNECTION, "not ready");
}
static int op_record(void *arg, uint64_t gen, uint64_t prev, uint64_t next, int lead)
{
    struct fake *f = arg;
    f->gen = gen;
    (void)prev;
    if (f->send_rc == 0)
        say(f, "record%llu%s", (unsigned long long)next, lead ? "" : "*");
    return f->send_rc;
}
static int op_prepare(void *arg)
{
    struct fake *f = arg;
    int reload = f->reload;
    f->reload = 0;
    return reload;
}
static int op_load(void *arg, uint64_t gen)
{
    struct fake *f = arg;
    f->gen = gen;
    if (f->send_rc == 0)
        say(f, "load");
    return f->send_rc;
}
static uint64_t op_behind(void *arg, uint64_t lead)
{
    struct fake *f = arg;
    return f->behind != 0 && f->behind < lead ? f->behind : lead;
}
static void op_abandon(void *arg)
{
    say(arg, "abandon");
}
static void op_failed(void *arg, enum relay_fail_kind kind, const char *why)
{
    (void)why;
    say(arg, "failed:%s", relay_fail_kind_name(kind));
}
static void op_arm_retry(void *arg, uint32_t ms)
{
    struct fake *f = arg;
    f->last_retry_ms = ms;
    say(f, "retry");
}
static void op_idle(void *arg)
{
    say(arg, "idle");
}
static void op_drained(void *arg)
{
    say(arg, "drained");
}

static int setup(void **state)
{
    (void)state;
    memset(&F, 0, sizeof(F));
    F.ready = 1;
    F.l = &L;
    struct relay_loop_ops ops = {
        .arg = &F,
        .ready = op_ready,
        .prepare = op_prepare,
        .load = op_load,
        .behind = op_behind,
        .tick = op_tick,
        .read = op_read,
        .publish = op_publish,
        .record = op_record,
        .abandon = op_abandon,
        .failed = op_failed,
        .arm_retry = op_arm_retry,
        .idle = op_idle,
        .drained = op_drained,
    };
    relay_loop_init(&L, &ops, 3, 100, 30000);
    relay_loop_set_lead(&L, 1);
    return 0;
}

#define expect_log(text)                                                                           \
    do {                                                                                           \
        assert_string_equal(F.log, text);                                                          \
        F.log[0] = '\0';                                                                           \
    } while (0)

static void test_nothing_new_is_idle(void **state)
{
    (void)state;
    relay_loop_want(&L);
    expect_log("tick ");
    relay_loop_ticked(&L, F.gen, 1);
    expect_log("idle ");
    assert_int_equal(L.state, RELAY_LOOP_IDLE);
}

static void test_a_batch_in_chunks_reads_ahead_while_publishing(void **state)
{
    (void)state;
    relay_loop_want(&L);
    relay_loop_ticked(&L, F.gen, 2);
    expect_log("tick read1-2.0 ");
    relay_loop_chunk(&L, F.gen, 0, 3); /* full: the next is read while it publishes */
    expect_log("read1-2.1 publish0 ");
    relay_loop_published(&L, F.gen, 0);
    expect_log("");
    assert_int_equal(L.state, RELAY_LOOP_READ);
    relay_loop_chunk(&L, F.gen, 1, 2); /* short: the last */
    expect_log("publish1 ");
    relay_loop_published(&L, F.gen, 1);
    expect_log("record2 ");
    relay_loop_recorded(&L, F.gen);
    expect_log("tick ");
    assert_int_equal(L.lead, 2);
    assert_int_equal(L.batches, 1);
}

static void test_the_chunk_ahead_waits_for_the_one_publishing(void **state)
{
    (void)state;
    relay_loop_want(&L);
    relay_loop_ticked(&L, F.gen, 2);
    relay_loop_chunk(&L, F.gen, 0, 3);
    expect_log("tick read1-2.0 read1-2.1 publish0 ");
    relay_loop_chunk(&L, F.gen, 1, 3); /* before chunk 0's calls are answered */
    expect_log("");
    relay_loop_published(&L, F.gen, 0);
    expect_log("read1-2.2 publish1 ");
    relay_loop_chunk(&L, F.gen, 2, 0); /* the batch was a multiple of the chunk */
    expect_log("");
    relay_loop_published(&L, F.gen, 1);
    expect_log("record2 ");
}

static void test_an_empty_batch_is_recorded(void **state)
{
    (void)state;
    relay_loop_want(&L);
    relay_loop_ticked(&L, F.gen, 2);
    relay_loop_chunk(&L, F.gen, 0, 0);
    expect_log("tick read1-2.0 record2 ");
}

static void test_known_ticks_are_read_without_ticking(void **state)
{
    (void)state;
    relay_loop_want(&L);
    relay_loop_ticked(&L, F.gen, 4); /* two batches are known */
    relay_loop_chunk(&L, F.gen, 0, 1);
    relay_loop_published(&L, F.gen, 0);
    relay_loop_recorded(&L, F.gen);
    expect_log("tick read1-2.0 publish0 record2 read2-3.0 ");
    relay_loop_chunk(&L, F.gen, 0, 0);
    relay_loop_recorded(&L, F.gen);
    expect_log("record3 read3-4.0 ");
}

static void test_publish_that_answers_at_once(void **state)
{
    (void)state;
    F.publish_ends = 1;
    relay_loop_want(&L);
    relay_loop_ticked(&L, F.gen, 2);
    relay_loop_chunk(&L, F.gen, 0, 3);
    expect_log("tick read1-2.0 read1-2.1 publish0 ");
    relay_loop_chunk(&L, F.gen, 1, 1);
    expect_log("publish1 record2 ");
}

static void test_failure_abandons_the_batch_and_reads_it_again(void **state)
{
    (void)state;
    relay_loop_want(&L);
    relay_loop_ticked(&L, F.gen, 2);
    relay_loop_chunk(&L, F.gen, 0, 3);
    uint64_t old = F.gen;
    expect_log("tick read1-2.0 read1-2.1 publish0 ");
    relay_loop_failed(&L, old, RELAY_FAIL_REDIS_ERROR, "OOM");
    expect_log("abandon failed:redis_error retry ");
    assert_int_equal(L.state, RELAY_LOOP_BACKOFF);
    /* What the abandoned batch had in flight answers: ignored. */
    relay_loop_chunk(&L, old, 1, 3);
    relay_loop_published(&L, old, 0);
    relay_loop_failed(&L, old, RELAY_FAIL_REDIS_CONNECTION, "lost");
    relay_loop_want(&L);
    expect_log("");
    relay_loop_retry(&L);
    expect_log("read1-2.0 ");
    /* And from a retry, the old generation's answers are still ignored. */
    relay_loop_chunk(&L, old, 0, 3);
    expect_log("");
    relay_loop_chunk(&L, F.gen, 0, 2);
    relay_loop_published(&L, F.gen, 0);
    relay_loop_recorded(&L, F.gen);
    expect_log("publish0 record2 tick ");
    assert_int_equal(L.failures_in_row, 0);
}

static void test_failures_back_off_longer(void **state)
{
    (void)state;
    uint32_t longest = 0;
    for (int i = 0; i < 12; i++) {
        relay_loop_want(&L);
        relay_loop_retry(&L);
        relay_loop_failed(&L, F.gen, RELAY_FAIL_POSTGRES, "down");
        if (F.last_retry_ms > longest)
            longest = F.last_retry_ms;
        assert_true(F.last_retry_ms <= 30000);
    }
    assert_int_equal(L.failures_in_row, 12);
    assert_true(longest > 100);
}

static void test_a_notification_during_the_tick_ticks_again(void **state)
{
    (void)state;
    relay_loop_want(&L);
    relay_loop_want(&L); /* a commit notified while the tick was on its way */
    relay_loop_ticked(&L, F.gen, 1);
    expect_log("tick tick ");
    relay_loop_ticked(&L, F.gen, 1);
    expect_log("idle ");
}

static void test_statements_that_cannot_be_sent_wait_for_the_connection(void **state)
{
    (void)state;
    F.send_rc = -1;
    relay_loop_want(&L);
    assert_int_equal(L.state, RELAY_LOOP_IDLE);
    F.send_rc = 0;
    relay_loop_want(&L); /* the connection came back */
    relay_loop_ticked(&L, F.gen, 2);
    expect_log("tick read1-2.0 ");
    relay_loop_chunk(&L, F.gen, 0, 1);
    F.send_rc = -1; /* lost before the record */
    relay_loop_published(&L, F.gen, 0);
    expect_log("publish0 abandon failed:postgres retry ");
}

static void test_not_ready_waits_for_want(void **state)
{
    (void)state;
    F.ready = 0;
    relay_loop_want(&L);
    expect_log("");
    F.ready = 1;
    relay_loop_want(&L);
    expect_log("tick ");
}

static void test_drain_finishes_the_batch_in_flight(void **state)
{
    (void)state;
    relay_loop_want(&L);
    relay_loop_ticked(&L, F.gen, 3);
    relay_loop_chunk(&L, F.gen, 0, 1);
    relay_loop_drain(&L);
    expect_log("tick read1-2.0 publish0 ");
    relay_loop_published(&L, F.gen, 0);
    relay_loop_recorded(&L, F.gen);
    expect_log("record2 drained "); /* the known batch 3 waits for the next start */
    relay_loop_want(&L);
    expect_log("drained ");
}

static void test_drain_when_idle_or_backing_off_is_immediate(void **state)
{
    (void)state;
    relay_loop_drain(&L);
    expect_log("drained ");
    setup(NULL);
    relay_loop_want(&L);
    relay_loop_failed(&L, F.gen, RELAY_FAIL_POSTGRES, "down");
    relay_loop_drain(&L);
    expect_log("tick abandon failed:postgres retry drained ");
    relay_loop_retry(&L); /* drained once: the retry that was armed does nothing */
    expect_log("");
    setup(NULL);
    relay_loop_want(&L);
    relay_loop_drain(&L);
    relay_loop_failed(&L, F.gen, RELAY_FAIL_POSTGRES, "down");
    expect_log("tick abandon failed:postgres drained ");
}

static void test_positions_are_loaded_first_and_when_asked(void **state)
{
    (void)state;
    L.loaded = 0;
    L.lead = 0;
    relay_loop_want(&L);
    expect_log("load ");
    relay_loop_ticked(&L, F.gen, 9); /* not what was asked */
    expect_log("");
    relay_loop_loaded(&L, F.gen, 5);
    expect_log("tick ");
    assert_int_equal(L.lead, 5);
    relay_loop_ticked(&L, F.gen, 5);
    expect_log("idle ");
    F.reload = 1; /* ownership changed: positions again, the lead kept */
    relay_loop_want(&L);
    expect_log("load ");
    relay_loop_loaded(&L, F.gen, 2);
    expect_log("tick ");
    assert_int_equal(L.lead, 5);
}

static void test_streams_behind_take_turns_with_the_lead(void **state)
{
    (void)state;
    relay_loop_set_lead(&L, 4);
    F.behind = 2;
    relay_loop_want(&L);
    expect_log("read2-3.0 "); /* behind, and nothing new: catching up at once */
    relay_loop_chunk(&L, F.gen, 0, 0);
    expect_log("record3* ");
    F.behind = 3;
    relay_loop_recorded(&L, F.gen);
    assert_int_equal(L.lead, 4); /* a batch behind does not move the lead */
    expect_log("read3-4.0 ");
    relay_loop_chunk(&L, F.gen, 0, 0);
    F.behind = 0; /* caught up */
    relay_loop_recorded(&L, F.gen);
    expect_log("record4* tick ");
    F.behind = 1; /* a stream resumed */
    relay_loop_ticked(&L, F.gen, 6);
    expect_log("read4-5.0 "); /* the lead's batch first, then one behind */
    relay_loop_chunk(&L, F.gen, 0, 0);
    relay_loop_recorded(&L, F.gen);
    expect_log("record5 read1-2.0 ");
    assert_int_equal(L.lead, 5);
    relay_loop_chunk(&L, F.gen, 0, 0);
    relay_loop_recorded(&L, F.gen);
    expect_log("record2* read5-6.0 ");
}

static void test_a_stream_behind_is_caught_up_after_a_tick_finds_nothing(void **state)
{
    (void)state;
    relay_loop_want(&L);
    expect_log("tick ");
    F.behind = 0;
    relay_loop_ticked(&L, F.gen, 1);
    expect_log("idle ");
    relay_loop_set_lead(&L, 3);
    relay_loop_want(&L);
    expect_log("tick ");
    F.behind = 2; /* resumed while the tick was out */
    relay_loop_ticked(&L, F.gen, 3);
    expect_log("read2-3.0 ");
}

static void test_stop_ignores_everything(void **state)
{
    (void)state;
    relay_loop_want(&L);
    relay_loop_stop(&L);
    relay_loop_ticked(&L, F.gen, 5);
    relay_loop_want(&L);
    relay_loop_failed(&L, F.gen, RELAY_FAIL_POSTGRES, "down");
    relay_loop_drain(&L);
    expect_log("tick ");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_nothing_new_is_idle, setup),
        cmocka_unit_test_setup(test_a_batch_in_chunks_reads_ahead_while_publishing, setup),
        cmocka_unit_test_setup(test_the_chunk_ahead_waits_for_the_one_publishing, setup),
        cmocka_unit_test_setup(test_an_empty_batch_is_recorded, setup),
        cmocka_unit_test_setup(test_known_ticks_are_read_without_ticking, setup),
        cmocka_unit_test_setup(test_publish_that_answers_at_once, setup),
        cmocka_unit_test_setup(test_failure_abandons_the_batch_and_reads_it_again, setup),
        cmocka_unit_test_setup(test_failures_back_off_longer, setup),
        cmocka_unit_test_setup(test_a_notification_during_the_tick_ticks_again, setup),
        cmocka_unit_test_setup(test_statements_that_cannot_be_sent_wait_for_the_connection, setup),
        cmocka_unit_test_setup(test_not_ready_waits_for_want, setup),
        cmocka_unit_test_setup(test_drain_finishes_the_batch_in_flight, setup),
        cmocka_unit_test_setup(test_drain_when_idle_or_backing_off_is_immediate, setup),
        cmocka_unit_test_setup(test_stop_ignores_everything, setup),
        cmocka_unit_test_setup(test_positions_are_loaded_first_and_when_asked, setup),
        cmocka_unit_test_setup(test_streams_behind_take_turns_with_the_lead, setup),
        cmocka_unit_test_setup(test_a_stream_behind_is_caught_up_after_a_tick_finds_nothing, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
