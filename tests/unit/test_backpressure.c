/*
 * Unit tests of relay/backpressure.c: pause and resume with hysteresis, what
 * happens without Redis, and the claim's text[] value for any topic name.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "relay/backpressure.h"
#include "core/pg.h"
#include "core/config.h"

static struct relay_config cfg;
static struct relay_observation obs;
static struct relay_paused paused;
static struct relay_bp_change changes[RELAY_OBS_TOPICS_MAX];

static int setup(void **state)
{
    (void)state;
    memset(&cfg, 0, sizeof(cfg));
    memset(&obs, 0, sizeof(obs));
    cfg.pause_lag_entries = 100;
    cfg.resume_lag_entries = 10;
    obs.redis_ok = 1;
    obs.ntopics = 2;
    snprintf(obs.topics[0].topic, sizeof(obs.topics[0].topic), "orders");
    snprintf(obs.topics[0].stream, sizeof(obs.topics[0].stream), "orders");
    snprintf(obs.topics[1].topic, sizeof(obs.topics[1].topic), "invoices");
    snprintf(obs.topics[1].stream, sizeof(obs.topics[1].stream), "invoices");
    obs.ngroups = 2;
    obs.groups[0].topic = 0;
    obs.groups[1].topic = 1;
    obs.groups[0].oldest_pending_age = obs.groups[1].oldest_pending_age = -1;
    obs.groups[0].oldest_undelivered_age = obs.groups[1].oldest_undelivered_age = -1;
    relay_paused_init(&paused);
    return 0;
}

static size_t apply(int *resumed)
{
    return relay_backpressure_apply(&paused, &cfg, &obs, changes, resumed);
}

static void test_nothing_paused_at_first(void **state)
{
    (void)state;
    int resumed;
    assert_int_equal(apply(&resumed), 0);
    assert_int_equal(paused.n, 0);
    assert_string_equal(paused.param, "{}");
    assert_int_equal(resumed, 0);
}

static void test_a_lagging_group_pauses_its_stream_only(void **state)
{
    (void)state;
    int resumed;
    obs.groups[0].lag = 100;
    assert_int_equal(apply(&resumed), 1);
    assert_int_equal(changes[0].topic, 0);
    assert_int_equal(changes[0].paused, 1);
    assert_true(relay_paused_has(&paused, "orders"));
    assert_false(relay_paused_has(&paused, "invoices"));
    assert_string_equal(paused.param, "{\"orders\"}");
}

static void test_hysteresis_between_the_marks(void **state)
{
    (void)state;
    int resumed;
    obs.groups[0].lag = 150;
    apply(&resumed);
    obs.groups[0].lag = 50; /* below the pause mark, above the resume mark */
    assert_int_equal(apply(&resumed), 0);
    assert_true(relay_paused_has(&paused, "orders"));
    assert_int_equal(resumed, 0);
    obs.groups[0].lag = 10;
    assert_int_equal(apply(&resumed), 1);
    assert_int_equal(changes[0].paused, 0);
    assert_int_equal(resumed, 1);
    assert_int_equal(paused.n, 0);
    /* Not paused again until the high mark. */
    obs.groups[0].lag = 99;
    assert_int_equal(apply(&resumed), 0);
}

static void test_every_group_must_catch_up(void **state)
{
    (void)state;
    int resumed;
    obs.ngroups = 3;
    obs.groups[2].topic = 0;
    obs.groups[2].oldest_pending_age = obs.groups[2].oldest_undelivered_age = -1;
    obs.groups[0].lag = 200;
    apply(&resumed);
    obs.groups[0].lag = 0;
    obs.groups[2].lag = 11;
    apply(&resumed);
    assert_true(relay_paused_has(&paused, "orders"));
}

/* A partitioned topic: the groups of all its partition streams decide for
 * the topic, once, and a stream that caught up does not resume it. */
static void test_partition_streams_decide_for_their_topic(void **state)
{
    (void)state;
    int resumed;
    obs.ntopics = 3;
    snprintf(obs.topics[1].topic, sizeof(obs.topics[1].topic), "orders");
    snprintf(obs.topics[1].stream, sizeof(obs.topics[1].stream), "orders:001");
    snprintf(obs.topics[2].topic, sizeof(obs.topics[2].topic), "invoices");
    snprintf(obs.topics[2].stream, sizeof(obs.topics[2].stream), "invoices");
    snprintf(obs.topics[0].stream, sizeof(obs.topics[0].stream), "orders:000");
    obs.ngroups = 3;
    obs.groups[1].topic = 1;
    obs.groups[2].topic = 2;
    obs.groups[2].oldest_pending_age = obs.groups[2].oldest_undelivered_age = -1;
    obs.groups[1].lag = 150; /* on orders:001 alone */
    assert_int_equal(apply(&resumed), 1);
    assert_int_equal(changes[0].paused, 1);
    assert_string_equal(paused.param, "{\"orders\"}");
    /* orders:000 is fine, orders:001 still above the resume mark. */
    assert_int_equal(apply(&resumed), 0);
    assert_int_equal(resumed, 0);
    assert_string_equal(paused.param, "{\"orders\"}");
    obs.groups[1].lag = 5;
    assert_int_equal(apply(&resumed), 1);
    assert_int_equal(changes[0].paused, 0);
    assert_int_equal(resumed, 1);
    assert_int_equal(paused.n, 0);
}

static void test_queue_age_pauses_and_resumes(void **state)
{
    (void)state;
    int resumed;
    cfg.pause_lag_entries = 0;
    cfg.resume_lag_entries = 0;
    cfg.pause_queue_age_ms = 60000;
    cfg.resume_queue_age_ms = 20000;
    obs.groups[1].oldest_pending_age = 61.0;
    apply(&resumed);
    assert_true(relay_paused_has(&paused, "invoices"));
    obs.groups[1].oldest_pending_age = 30.0;
    apply(&resumed);
    assert_true(relay_paused_has(&paused, "invoices"));
    obs.groups[1].oldest_pending_age = 5.0;
    apply(&resumed);
    assert_false(relay_paused_has(&paused, "invoices"));
    assert_int_equal(resumed, 1);
}

static void test_without_redis_nothing_stays_paused(void **state)
{
    (void)state;
    int resumed;
    obs.groups[0].lag = 500;
    apply(&resumed);
    obs.redis_ok = 0;
    assert_int_equal(apply(&resumed), 0);
    assert_int_equal(paused.n, 0);
    assert_int_equal(resumed, 1); /* the held rows may go now: claim */
}

static void test_pausing_switched_off(void **state)
{
    (void)state;
    int resumed;
    cfg.pause_lag_entries = 0;
    obs.groups[0].lag = 1000000;
    assert_int_equal(apply(&resumed), 0);
    assert_int_equal(paused.n, 0);
}

static void test_array_value_escapes_every_name(void **state)
{
    (void)state;
    char items[3][OUTBOX_TOPIC_MAX + 1] = {"plain", "quo\"te", "back\\slash"};
    char out[128];
    assert_int_equal(
        relay_pg_text_array(out, sizeof(out), (const char(*)[OUTBOX_TOPIC_MAX + 1]) items, 3), 0);
    assert_string_equal(out, "{\"plain\",\"quo\\\"te\",\"back\\\\slash\"}");
    assert_int_equal(
        relay_pg_text_array(out, sizeof(out), (const char(*)[OUTBOX_TOPIC_MAX + 1]) items, 0), 0);
    assert_string_equal(out, "{}");
}

static void test_array_value_too_small(void **state)
{
    (void)state;
    char items[1][OUTBOX_TOPIC_MAX + 1] = {"orders"};
    char out[8];
    assert_int_equal(
        relay_pg_text_array(out, sizeof(out), (const char(*)[OUTBOX_TOPIC_MAX + 1]) items, 1), -1);
    assert_int_equal(relay_pg_text_array(out, 2, (const char(*)[OUTBOX_TOPIC_MAX + 1]) items, 0),
                     -1);
}

static void test_worst_case_names_fit(void **state)
{
    (void)state;
    static char items[RELAY_OBS_TOPICS_MAX][OUTBOX_TOPIC_MAX + 1];
    for (size_t i = 0; i < RELAY_OBS_TOPICS_MAX; i++) {
        memset(items[i], '"', OUTBOX_TOPIC_MAX);
        items[i][OUTBOX_TOPIC_MAX] = '\0';
    }
    assert_int_equal(relay_pg_text_array(paused.param, sizeof(paused.param),
                                         (const char(*)[OUTBOX_TOPIC_MAX + 1]) items,
                                         RELAY_OBS_TOPICS_MAX),
                     0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_nothing_paused_at_first, setup),
        cmocka_unit_test_setup(test_a_lagging_group_pauses_its_stream_only, setup),
        cmocka_unit_test_setup(test_hysteresis_between_the_marks, setup),
        cmocka_unit_test_setup(test_every_group_must_catch_up, setup),
        cmocka_unit_test_setup(test_partition_streams_decide_for_their_topic, setup),
        cmocka_unit_test_setup(test_queue_age_pauses_and_resumes, setup),
        cmocka_unit_test_setup(test_without_redis_nothing_stays_paused, setup),
        cmocka_unit_test_setup(test_pausing_switched_off, setup),
        cmocka_unit_test_setup(test_array_value_escapes_every_name, setup),
        cmocka_unit_test_setup(test_array_value_too_small, setup),
        cmocka_unit_test_setup(test_worst_case_names_fit, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
