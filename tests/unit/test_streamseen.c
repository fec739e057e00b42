/* Unit tests of relay/streamseen.c: the streams the claim cycle published
 * to, each handed over to the observer once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "relay/batch.h"
#include "common/keys.h"
#include "core/streamlist.h"
#include "relay/streamseen.h"

static struct relay_row row_of(const char *topic, uint32_t partition, uint32_t partitions)
{
    struct relay_row row;
    memset(&row, 0, sizeof(row));
    row.topic = topic;
    row.topic_len = strlen(topic);
    row.partition = partition;
    row.partitions = partitions;
    return row;
}

static void test_seen_hands_each_stream_over_once(void **state)
{
    (void)state;
    struct relay_stream_seen s;
    relay_stream_seen_init(&s);
    struct relay_row a = row_of("orders", 0, 1);
    struct relay_row b = row_of("payments", 0, 1);
    struct relay_row p1 = row_of("orders", 1, 8);
    struct relay_row p2 = row_of("orders", 2, 8);
    relay_stream_seen_note(&s, "app.", &a);
    relay_stream_seen_note(&s, "app.", &a);
    relay_stream_seen_note(&s, "app.", &b);
    relay_stream_seen_note(&s, "app.", &p1);
    relay_stream_seen_note(&s, "app.", &p2);
    relay_stream_seen_note(&s, "app.", &p1);
    char **names;
    int overflow = 1;
    size_t n = relay_stream_seen_take(&s, &names, &overflow);
    assert_int_equal(n, 4);
    assert_int_equal(overflow, 0);
    assert_string_equal(names[0], "app.orders");
    assert_string_equal(names[1], "app.payments");
    assert_string_equal(names[2], "app.orders:001");
    assert_string_equal(names[3], "app.orders:002");
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    relay_stream_seen_note(&s, "app.", &b); /* known: not handed over again */
    assert_int_equal(relay_stream_seen_take(&s, &names, &overflow), 0);
    assert_null(names);
    relay_stream_seen_free(&s);
}

/* Past RELAY_STREAM_LIST_MAX streams the table starts again and the observer
 * is told to scan once; every new stream is still handed over. */
static void test_seen_starts_again_past_the_cap(void **state)
{
    (void)state;
    struct relay_stream_seen s;
    relay_stream_seen_init(&s);
    struct relay_row row = row_of("t", 0, OUTBOX_PARTITIONS_MAX);
    char name[2] = "a";
    size_t handed = 0;
    int overflows = 0;
    for (uint32_t topic = 0; topic < 12; topic++) {
        name[0] = (char)('a' + topic);
        row.topic = name;
        row.topic_len = 1;
        for (uint32_t p = 0; p < OUTBOX_PARTITIONS_MAX; p++) {
            row.partition = p;
            relay_stream_seen_note(&s, NULL, &row);
            if (s.nfresh == RELAY_STREAM_FRESH_MAX || p + 1 == OUTBOX_PARTITIONS_MAX) {
                char **names;
                int overflow;
                size_t n = relay_stream_seen_take(&s, &names, &overflow);
                handed += n;
                overflows += overflow;
                for (size_t i = 0; i < n; i++)
                    free(names[i]);
                free(names);
            }
        }
    }
    assert_int_equal(handed, 12 * OUTBOX_PARTITIONS_MAX);
    assert_int_equal(overflows, 1);
    assert_int_equal(s.n, 12 * OUTBOX_PARTITIONS_MAX - RELAY_STREAM_LIST_MAX);
    /* Known since the new start: not handed over again, no scan asked. */
    relay_stream_seen_note(&s, NULL, &row);
    char **names;
    int overflow;
    assert_int_equal(relay_stream_seen_take(&s, &names, &overflow), 0);
    assert_int_equal(overflow, 0);
    relay_stream_seen_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_seen_hands_each_stream_over_once),
        cmocka_unit_test(test_seen_starts_again_past_the_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
