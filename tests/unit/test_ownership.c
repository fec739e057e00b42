/* Unit tests of relay/ownership.c: how the relays divide the partitions. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "common/keys.h"
#include "relay/ownership.h"

#define CAP 64

static struct relay_topic_parts topic(const char *name, uint32_t n)
{
    struct relay_topic_parts t;
    memset(&t, 0, sizeof(t));
    strcpy(t.topic, name);
    t.partitions = n;
    return t;
}

static size_t wanted(const struct relay_unit *u, size_t n)
{
    size_t w = 0;
    for (size_t i = 0; i < n; i++)
        w += u[i].want != 0;
    return w;
}

static void test_unit_key_is_documented(void **state)
{
    (void)state;
    /* fnv1a32("orders") = 845059820 (docs/PARTITIONS.md's hash), plus the
     * partition, in [0, 2^31). */
    assert_int_equal(relay_unit_key("orders", 6, 0), 845059820);
    assert_int_equal(relay_unit_key("orders", 6, 7), 845059827);
    /* fnv1a32("a") = 0xe40c292c has the top bit set: it is cleared. */
    assert_int_equal(relay_unit_key("a", 1, 0), 0xe40c292c & 0x7fffffff);
}

static void test_member_position(void **state)
{
    (void)state;
    const int32_t members[] = {0, 2, 5};
    assert_int_equal(relay_member_position(members, 3, 0), 0);
    assert_int_equal(relay_member_position(members, 3, 5), 2);
    assert_int_equal(relay_member_position(members, 3, 1), -1);
    assert_int_equal(relay_member_position(members, 0, 0), -1);
}

/* Three relays, one topic of 8 partitions: 3, 3 and 2, each partition once. */
static void test_three_relays_share_eight_partitions(void **state)
{
    (void)state;
    struct relay_topic_parts t = topic("orders", 8);
    struct relay_unit out[3][CAP];
    size_t total = 0;
    int owners[8] = {0};
    for (long me = 0; me < 3; me++) {
        long n = relay_units_plan(NULL, 0, &t, 1, 3, me, out[me], CAP);
        assert_int_equal(n, 8);
        total += wanted(out[me], 8);
        for (size_t i = 0; i < 8; i++) {
            assert_string_equal(out[me][i].topic, "orders");
            assert_int_equal(out[me][i].partition, i);
            assert_int_equal(out[me][i].key, relay_unit_key("orders", 6, (uint32_t)i));
            owners[i] += out[me][i].want != 0;
            assert_false(out[me][i].held);
        }
    }
    assert_int_equal(wanted(out[0], 8), 3);
    assert_int_equal(wanted(out[1], 8), 3);
    assert_int_equal(wanted(out[2], 8), 2);
    assert_int_equal(total, 8);
    for (size_t i = 0; i < 8; i++)
        assert_int_equal(owners[i], 1);
}

/* The round-robin runs on across topics: two topics of 3 partitions over
 * two relays give each relay 3, not 4 and 2. */
static void test_share_is_even_over_topics(void **state)
{
    (void)state;
    struct relay_topic_parts t[2] = {topic("a", 3), topic("b", 3)};
    struct relay_unit out[CAP];
    assert_int_equal(relay_units_plan(NULL, 0, t, 2, 2, 0, out, CAP), 6);
    assert_int_equal(wanted(out, 6), 3);
    assert_int_equal(relay_units_plan(NULL, 0, t, 2, 2, 1, out, CAP), 6);
    assert_int_equal(wanted(out, 6), 3);
}

/* Partitions whose lock keys collide share one owner: a relay that holds the
 * key holds both, and no other relay is told to take a lock it cannot get.
 * fnv1a32("t37922") = fnv1a32("t268696") + 2, so t268696/0 and t37922/2 share
 * a key; by plan order they would go to different relays. */
static void test_colliding_keys_share_an_owner(void **state)
{
    (void)state;
    struct relay_topic_parts t[2] = {topic("t268696", 3), topic("t37922", 3)};
    assert_int_equal(relay_unit_key("t268696", 7, 0), relay_unit_key("t37922", 6, 2));
    struct relay_unit out[2][CAP];
    int owners[6] = {0};
    for (long me = 0; me < 2; me++) {
        assert_int_equal(relay_units_plan(NULL, 0, t, 2, 2, me, out[me], CAP), 6);
        for (size_t i = 0; i < 6; i++)
            for (size_t j = 0; j < 6; j++)
                if (out[me][i].key == out[me][j].key)
                    assert_int_equal(out[me][i].want, out[me][j].want);
        for (size_t i = 0; i < 6; i++)
            owners[i] += out[me][i].want != 0;
    }
    for (size_t i = 0; i < 6; i++)
        assert_int_equal(owners[i], 1);
    /* Nothing else moves: the other partitions keep their round-robin owner. */
    for (size_t i = 0; i < 5; i++)
        assert_int_equal(out[0][i].want, i % 2 == 0);
    assert_int_equal(out[0][5].want, 1); /* t37922/2 follows t268696/0 */
}

/* A relay that is alone wants everything; one not yet listed wants nothing. */
static void test_alone_and_unlisted(void **state)
{
    (void)state;
    struct relay_topic_parts t = topic("orders", 4);
    struct relay_unit out[CAP];
    assert_int_equal(relay_units_plan(NULL, 0, &t, 1, 1, 0, out, CAP), 4);
    assert_int_equal(wanted(out, 4), 4);
    assert_int_equal(relay_units_plan(NULL, 0, &t, 1, 2, -1, out, CAP), 4);
    assert_int_equal(wanted(out, 4), 0);
    assert_int_equal(relay_units_plan(NULL, 0, &t, 1, 0, 0, out, CAP), 4);
    assert_int_equal(wanted(out, 4), 0);
}

/* What the relay holds carries over; a relay that joins moves the share. */
static void test_state_carries_over_and_share_moves(void **state)
{
    (void)state;
    struct relay_topic_parts t = topic("orders", 4);
    struct relay_unit first[CAP], second[CAP];
    assert_int_equal(relay_units_plan(NULL, 0, &t, 1, 1, 0, first, CAP), 4);
    for (size_t i = 0; i < 4; i++) {
        first[i].held = 1;
        first[i].ready = 1;
        first[i].since = 1.5;
    }
    /* A second relay joins before this one: this one is now position 1. */
    assert_int_equal(relay_units_plan(first, 4, &t, 1, 2, 1, second, CAP), 4);
    for (size_t i = 0; i < 4; i++) {
        assert_true(second[i].held);
        assert_true(second[i].ready);
        assert_true(second[i].since == 1.5);
        assert_int_equal(second[i].want, i % 2 == 1);
    }
}

/* A partition held whose topic went back to one partition is kept, unwanted,
 * so that it is released; one not held is simply gone. */
static void test_vanished_partitions_are_released(void **state)
{
    (void)state;
    struct relay_topic_parts t[2] = {topic("a", 2), topic("b", 2)};
    struct relay_unit first[CAP], second[CAP];
    assert_int_equal(relay_units_plan(NULL, 0, t, 2, 1, 0, first, CAP), 4);
    first[2].held = 1; /* b/0 */
    assert_int_equal(relay_units_plan(first, 4, t, 1, 1, 0, second, CAP), 3);
    assert_string_equal(second[2].topic, "b");
    assert_int_equal(second[2].partition, 0);
    assert_true(second[2].held);
    assert_false(second[2].want);
}

/* Each unpartitioned topic has exactly one relay among the members, the
 * same whoever computes it; with the members unknown, every relay has it. */
static void test_unpartitioned_topics_have_one_relay_each(void **state)
{
    (void)state;
    char topic[32];
    size_t per_relay[3] = {0, 0, 0};
    for (int t = 0; t < 300; t++) {
        snprintf(topic, sizeof(topic), "topic-%d", t);
        int owners = 0;
        for (long me = 0; me < 3; me++)
            if (relay_topic_wanted(topic, strlen(topic), 3, me)) {
                owners++;
                per_relay[me]++;
            }
        assert_int_equal(owners, 1);
        assert_true(relay_topic_wanted(topic, strlen(topic), 1, 0));
        assert_true(relay_topic_wanted(topic, strlen(topic), 0, -1));
        assert_true(relay_topic_wanted(topic, strlen(topic), 3, -1));
    }
    /* The hash spreads them: no relay has fewer than half its even share. */
    for (int me = 0; me < 3; me++)
        assert_true(per_relay[me] >= 50);
    assert_int_equal(relay_topic_wanted("orders", 6, 2, 0),
                     outbox_partition_hash("orders", 6) % 2 == 0);
}

static void test_cap_is_refused(void **state)
{
    (void)state;
    struct relay_topic_parts t = topic("orders", 8);
    struct relay_unit out[CAP];
    assert_int_equal(relay_units_plan(NULL, 0, &t, 1, 1, 0, out, 7), -1);
    assert_int_equal(relay_units_plan(NULL, 0, &t, 1, 1, 0, out, 8), 8);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unit_key_is_documented),
        cmocka_unit_test(test_member_position),
        cmocka_unit_test(test_three_relays_share_eight_partitions),
        cmocka_unit_test(test_share_is_even_over_topics),
        cmocka_unit_test(test_colliding_keys_share_an_owner),
        cmocka_unit_test(test_alone_and_unlisted),
        cmocka_unit_test(test_state_carries_over_and_share_moves),
        cmocka_unit_test(test_vanished_partitions_are_released),
        cmocka_unit_test(test_cap_is_refused),
        cmocka_unit_test(test_unpartitioned_topics_have_one_relay_each),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
