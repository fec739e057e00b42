/*
 * Unit tests of relay/cursors.c: each stream's rank in a batch and its last
 * entry id in Redis.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "relay/batch.h"
#include "relay/cursors.h"

static struct relay_row row_of(const char *topic, uint32_t partitions, uint32_t partition)
{
    struct relay_row row;
    memset(&row, 0, sizeof(row));
    row.topic = topic;
    row.topic_len = strlen(topic);
    row.partitions = partitions;
    row.partition = partition;
    return row;
}

static void test_ranks_count_per_stream_and_start_again_per_batch(void **state)
{
    (void)state;
    struct relay_cursors c;
    relay_cursors_init(&c);
    struct relay_row a = row_of("orders", 1, 0), b = row_of("mail", 1, 0);
    struct relay_row p0 = row_of("orders", 4, 0), p3 = row_of("orders", 4, 3);
    /* Rows of one batch (tick 7) in (txid, id) order, over several chunks:
     * the count goes on from call to call. */
    const struct relay_row *order[] = {&a, &b, &a, &p3, &p0, &p3, &a, &b};
    const uint64_t want[] = {0, 0, 1, 0, 0, 1, 2, 1};
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(order); i++) {
        struct relay_cursor *cur = relay_cursors_get(&c, order[i]);
        assert_non_null(cur);
        assert_int_equal(relay_cursor_rank(cur, 7), want[i]);
    }
    /* A topic of one partition and partition 0 of a partitioned one are
     * two streams. */
    assert_ptr_not_equal(relay_cursors_get(&c, &a), relay_cursors_get(&c, &p0));
    /* The next batch starts at 0 again, stream by stream. */
    assert_int_equal(relay_cursor_rank(relay_cursors_get(&c, &b), 8), 0);
    assert_int_equal(relay_cursor_rank(relay_cursors_get(&c, &a), 8), 0);
    assert_int_equal(relay_cursor_rank(relay_cursors_get(&c, &b), 8), 1);
    assert_int_equal(c.n, 4);
    relay_cursors_free(&c);
}

static void test_present_is_at_or_below_the_last_id(void **state)
{
    (void)state;
    struct relay_cursors c;
    relay_cursors_init(&c);
    struct relay_row a = row_of("orders", 1, 0);
    struct relay_cursor *cur = relay_cursors_get(&c, &a);
    /* Not known: nothing counts as present. */
    assert_int_equal(relay_cursor_present(cur, 1, 0), 0);
    relay_cursor_set_top(cur, 100, 5);
    assert_int_equal(relay_cursor_present(cur, 99, 999), 1);
    assert_int_equal(relay_cursor_present(cur, 100, 5), 1);
    assert_int_equal(relay_cursor_present(cur, 100, 6), 0);
    assert_int_equal(relay_cursor_present(cur, 101, 0), 0);
    /* An XADD's id moves it forward, never back. */
    relay_cursor_appended(cur, 100, 3);
    assert_int_equal(relay_cursor_present(cur, 100, 5), 1);
    relay_cursor_appended(cur, 101, 0);
    assert_int_equal(relay_cursor_present(cur, 101, 0), 1);
    /* A read of the stream may move it back (Redis lost writes). */
    relay_cursor_set_top(cur, 50, 0);
    assert_int_equal(relay_cursor_present(cur, 100, 0), 0);
    relay_cursor_forget(cur);
    assert_int_equal(relay_cursor_present(cur, 1, 0), 0);
    relay_cursor_appended(cur, 7, 7); /* known again from an XADD */
    assert_int_equal(relay_cursor_present(cur, 7, 7), 1);
    relay_cursors_forget_all(&c);
    assert_int_equal(relay_cursor_present(cur, 7, 7), 0);
    relay_cursors_free(&c);
}

static void test_many_streams_keep_their_counts_as_the_table_grows(void **state)
{
    (void)state;
    struct relay_cursors c;
    relay_cursors_init(&c);
    static char topics[3000][16];
    static struct relay_row rows[3000];
    for (size_t i = 0; i < 3000; i++) {
        snprintf(topics[i], sizeof(topics[i]), "t%zu", i % 1000);
        rows[i] = row_of(topics[i], i < 1000 ? 1 : 8, (uint32_t)(i / 1000));
    }
    for (int round = 0; round < 3; round++)
        for (size_t i = 0; i < 3000; i++)
            assert_int_equal(relay_cursor_rank(relay_cursors_get(&c, &rows[i]), 1),
                             (uint64_t)round);
    assert_int_equal(c.n, 3000);
    relay_cursors_free(&c);
}

static void test_trim_keeps_the_streams_of_the_last_batch(void **state)
{
    (void)state;
    struct relay_cursors c;
    relay_cursors_init(&c);
    static char topics[RELAY_CURSORS_MAX + 100][16];
    struct relay_row row;
    for (size_t i = 0; i < RELAY_CURSORS_MAX + 100; i++) {
        snprintf(topics[i], sizeof(topics[i]), "t%zu", i);
        row = row_of(topics[i], 1, 0);
        /* The last 10 streams are the batch of tick 9, ranked twice each. */
        uint64_t tick = i >= RELAY_CURSORS_MAX + 90 ? 9 : 8;
        struct relay_cursor *cur = relay_cursors_get(&c, &row);
        assert_non_null(cur);
        cur->owned = 1;
        if (i == 7) { /* behind the lead: where it stands is kept */
            cur->follows = 0;
            cur->pos = 3;
        }
        relay_cursor_rank(cur, tick);
        if (tick == 9) {
            relay_cursor_rank(cur, tick);
            relay_cursor_set_top(cur, 5, i);
        }
    }
    relay_cursors_trim(&c, 9);
    assert_int_equal(c.n, 11);
    row = row_of(topics[7], 1, 0);
    assert_int_equal(relay_cursors_get(&c, &row)->pos, 3);
    for (size_t i = RELAY_CURSORS_MAX + 90; i < RELAY_CURSORS_MAX + 100; i++) {
        row = row_of(topics[i], 1, 0);
        struct relay_cursor *cur = relay_cursors_get(&c, &row);
        assert_int_equal(relay_cursor_rank(cur, 9), 2); /* the count went on */
        assert_int_equal(relay_cursor_present(cur, 5, i), 1);
    }
    assert_int_equal(c.n, 11);
    /* Under the limit, trim keeps everything. */
    row = row_of("other", 1, 0);
    relay_cursors_get(&c, &row);
    relay_cursors_trim(&c, 1);
    assert_int_equal(c.n, 12);
    relay_cursors_free(&c);
}

static void test_streams_behind_catch_up_one_batch_at_a_time(void **state)
{
    (void)state;
    struct relay_cursors c;
    relay_cursors_init(&c);
    struct relay_cursor *a = relay_cursors_find(&c, "a", -1);
    struct relay_cursor *b = relay_cursors_find(&c, "b", 3);
    struct relay_cursor *p = relay_cursors_find(&c, "p", -1);
    struct relay_cursor *o = relay_cursors_find(&c, "o", 1);
    assert_true(a->follows && a->known); /* met first by its rows: with the lead */
    assert_int_equal(b->partitioned, 1);
    assert_int_equal(b->partition, 3);
    a->owned = b->owned = p->owned = 1;
    assert_int_equal(relay_cursors_behind(&c, 10), 10);
    b->follows = 0;
    b->pos = 8;
    p->follows = 0;
    p->pos = 2;
    p->paused = 1; /* a paused stream waits, and holds nobody back */
    o->follows = 0;
    o->pos = 1; /* another relay's: not this one's to catch up */
    assert_int_equal(relay_cursors_behind(&c, 10), 8);
    assert_int_equal(relay_cursor_position(a, 10), 10);
    assert_int_equal(relay_cursor_position(b, 10), 8);
    relay_cursors_advance(&c, 8, 10);
    assert_int_equal(b->pos, 9);
    assert_int_equal(b->follows, 0);
    assert_int_equal(p->pos, 2);
    assert_int_equal(o->pos, 1);
    relay_cursors_advance(&c, 9, 10);
    assert_int_equal(b->follows, 1); /* at the lead: with it from now on */
    assert_int_equal(relay_cursors_behind(&c, 10), 10);
    assert_int_equal(relay_cursors_find(&c, "b", 3), b);
    relay_cursors_free(&c);
}

static void test_bad_topics_have_no_cursor(void **state)
{
    (void)state;
    struct relay_cursors c;
    relay_cursors_init(&c);
    struct relay_row none = row_of("", 1, 0);
    assert_null(relay_cursors_get(&c, &none));
    static char long_topic[OUTBOX_TOPIC_MAX + 2];
    memset(long_topic, 'x', sizeof(long_topic) - 1);
    struct relay_row too_long = row_of(long_topic, 1, 0);
    assert_null(relay_cursors_get(&c, &too_long));
    long_topic[OUTBOX_TOPIC_MAX] = '\0';
    struct relay_row longest = row_of(long_topic, 1, 0);
    assert_non_null(relay_cursors_get(&c, &longest));
    relay_cursors_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ranks_count_per_stream_and_start_again_per_batch),
        cmocka_unit_test(test_present_is_at_or_below_the_last_id),
        cmocka_unit_test(test_many_streams_keep_their_counts_as_the_table_grows),
        cmocka_unit_test(test_trim_keeps_the_streams_of_the_last_batch),
        cmocka_unit_test(test_bad_topics_have_no_cursor),
        cmocka_unit_test(test_streams_behind_catch_up_one_batch_at_a_time),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
