/* Unit tests of relay/streamlist.c: which keys are the relay's streams, when
 * the list of streams is scanned again, and the streams the claim cycle
 * published to. The scan itself runs against real servers
 * (tests/integration/test_observer.py). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>

#include "relay/batch.h"
#include "relay/keys.h"
#include "relay/streamlist.h"

static enum relay_stream_kind kind(const char *key, const char *prefix)
{
    return relay_stream_kind(key, strlen(key), prefix);
}

static void test_kinds(void **state)
{
    (void)state;
    assert_int_equal(kind("orders", NULL), RELAY_STREAM_TOPIC);
    assert_int_equal(kind("orders", ""), RELAY_STREAM_TOPIC);
    assert_int_equal(kind("orders.eu-west_1", NULL), RELAY_STREAM_TOPIC);
    assert_int_equal(kind("orders:007", NULL), RELAY_STREAM_TOPIC);
    assert_int_equal(kind("{orders}.billing.replay", NULL), RELAY_STREAM_REPLAY);
    assert_int_equal(kind("{orders:007}.billing.replay", NULL), RELAY_STREAM_REPLAY);
    /* Dead letters are never trimmed, nor listed as topics. */
    assert_int_equal(kind("{orders}.billing.dlq", NULL), RELAY_STREAM_OTHER);
    assert_int_equal(kind("orders.dlq", NULL), RELAY_STREAM_OTHER);
    assert_int_equal(kind("orders.replay", NULL), RELAY_STREAM_OTHER);
    /* Someone else's: not a topic the relay could publish. */
    assert_int_equal(kind("{orders}:dedup:m-1", NULL), RELAY_STREAM_OTHER);
    assert_int_equal(kind("with space", NULL), RELAY_STREAM_OTHER);
    assert_int_equal(kind("", NULL), RELAY_STREAM_OTHER);
    assert_int_equal(kind("{}.g.replay", NULL), RELAY_STREAM_OTHER);
    assert_int_equal(kind("{orders.g.replay", NULL), RELAY_STREAM_OTHER);
    assert_int_equal(kind("{orders}g.replay", NULL), RELAY_STREAM_OTHER);
    assert_int_equal(kind("{orders}.replay", NULL), RELAY_STREAM_REPLAY);
    /* With a prefix, only the names under it. */
    assert_int_equal(kind("app.orders", "app."), RELAY_STREAM_TOPIC);
    assert_int_equal(kind("orders", "app."), RELAY_STREAM_OTHER);
    assert_int_equal(kind("app.", "app."), RELAY_STREAM_OTHER);
    assert_int_equal(kind("{app.orders}.g.replay", "app."), RELAY_STREAM_REPLAY);
    assert_int_equal(kind("{orders}.g.replay", "app."), RELAY_STREAM_OTHER);
    assert_int_equal(kind("{app.}.g.replay", "app."), RELAY_STREAM_OTHER);
    assert_int_equal(kind("{ap}.g.replay", "app."), RELAY_STREAM_OTHER);
}

/* A list as a scan would leave it: one stream on one node. */
static void listed(struct relay_stream_list *l)
{
    l->streams = calloc(1, sizeof(*l->streams));
    l->nodes = calloc(1, sizeof(*l->nodes));
    assert_non_null(l->streams);
    assert_non_null(l->nodes);
    l->cap = l->nodes_cap = 1;
    l->streams[0].key = strdup("orders");
    l->streams[0].len = 6;
    l->streams[0].kind = RELAY_STREAM_TOPIC;
    l->n = 1;
    strcpy(l->nodes[0], "127.0.0.1:6379");
    l->nnodes = 1;
}

static void test_first_round_scans(void **state)
{
    (void)state;
    struct relay_stream_list l;
    memset(&l, 0, sizeof(l));
    relay_stream_list_round(&l, 0);
    assert_int_equal(l.scanned, 1);
    assert_int_equal(l.since_scan, 0);
    assert_int_equal(l.nnodes, 0); /* every node scanned at its first visit */
    relay_stream_list_free(&l);
}

static void test_rounds_keep_the_list_until_the_rescan(void **state)
{
    (void)state;
    struct relay_stream_list l;
    memset(&l, 0, sizeof(l));
    relay_stream_list_round(&l, 5);
    listed(&l);
    for (int i = 1; i < RELAY_STREAM_RESCAN_EVERY; i++) {
        relay_stream_list_round(&l, 5);
        assert_int_equal(l.n, 1);
        assert_int_equal(l.nnodes, 1);
    }
    relay_stream_list_round(&l, 5);
    assert_int_equal(l.n, 0);
    assert_int_equal(l.nnodes, 0);
    assert_int_equal(l.since_scan, 0);
    relay_stream_list_free(&l);
}

static void test_a_new_stream_of_the_relay_rescans(void **state)
{
    (void)state;
    struct relay_stream_list l;
    memset(&l, 0, sizeof(l));
    relay_stream_list_round(&l, 5);
    listed(&l);
    relay_stream_list_round(&l, 5);
    assert_int_equal(l.n, 1);
    relay_stream_list_round(&l, 6);
    assert_int_equal(l.n, 0);
    assert_int_equal(l.generation, 6);
    relay_stream_list_free(&l);
}

static void test_a_stream_gone_rescans(void **state)
{
    (void)state;
    struct relay_stream_list l;
    memset(&l, 0, sizeof(l));
    relay_stream_list_round(&l, 0);
    listed(&l);
    relay_stream_list_forget(&l);
    relay_stream_list_round(&l, 0);
    assert_int_equal(l.n, 0);
    assert_int_equal(l.stale, 0);
    relay_stream_list_free(&l);
}

/* A node listed since the last scan is not scanned again: no Redis call is
 * made, so none is needed here. */
static void test_a_listed_node_is_not_scanned(void **state)
{
    (void)state;
    struct relay_stream_list l;
    memset(&l, 0, sizeof(l));
    relay_stream_list_round(&l, 0);
    listed(&l);
    relay_stream_list_round(&l, 0);
    char host[] = "127.0.0.1";
    redisContext c;
    memset(&c, 0, sizeof(c));
    c.connection_type = REDIS_CONN_TCP;
    c.tcp.host = host;
    c.tcp.port = 6379;
    uint32_t node = 99;
    char err[64] = "";
    assert_int_equal(relay_stream_list_node(&l, &c, NULL, -1, 1000, &node, err, sizeof(err)), 0);
    assert_int_equal(node, 0);
    assert_int_equal(l.scans, 0);
    assert_int_equal(l.stale, 0);
    relay_stream_list_free(&l);
}

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

static void test_seen_counts_each_stream_once(void **state)
{
    (void)state;
    struct relay_stream_seen s;
    memset(&s, 0, sizeof(s));
    assert_int_equal(relay_stream_seen_generation(&s), 0);
    struct relay_row a = row_of("orders", 0, 1);
    struct relay_row b = row_of("payments", 0, 1);
    struct relay_row p1 = row_of("orders", 1, 8);
    struct relay_row p2 = row_of("orders", 2, 8);
    relay_stream_seen_note(&s, &a);
    assert_int_equal(relay_stream_seen_generation(&s), 1);
    relay_stream_seen_note(&s, &a);
    assert_int_equal(relay_stream_seen_generation(&s), 1);
    relay_stream_seen_note(&s, &b);
    relay_stream_seen_note(&s, &p1);
    relay_stream_seen_note(&s, &p2);
    relay_stream_seen_note(&s, &p1);
    assert_int_equal(relay_stream_seen_generation(&s), 4);
    relay_stream_seen_free(&s);
    assert_int_equal(relay_stream_seen_generation(NULL), 0);
}

/* Past RELAY_STREAM_LIST_MAX streams nothing more is noted; the table grows
 * to hold them all and still knows each of them. */
static void test_seen_grows_and_stops_at_the_cap(void **state)
{
    (void)state;
    struct relay_stream_seen s;
    memset(&s, 0, sizeof(s));
    struct relay_row row = row_of("t", 0, RELAY_PARTITIONS_MAX);
    unsigned noted = 0;
    for (uint32_t topic = 0; topic < 12; topic++) {
        char name[8];
        name[0] = (char)('a' + topic);
        name[1] = '\0';
        row.topic = name;
        row.topic_len = 1;
        for (uint32_t p = 0; p < RELAY_PARTITIONS_MAX; p++) {
            row.partition = p;
            relay_stream_seen_note(&s, &row);
            noted++;
        }
    }
    assert_true(noted > RELAY_STREAM_LIST_MAX);
    assert_int_equal(relay_stream_seen_generation(&s), RELAY_STREAM_LIST_MAX);
    assert_true(s.mask + 1 >= 2 * (size_t)RELAY_STREAM_LIST_MAX);
    char name[2] = "a";
    row.topic = name;
    row.partition = 7;
    relay_stream_seen_note(&s, &row); /* known */
    assert_int_equal(relay_stream_seen_generation(&s), RELAY_STREAM_LIST_MAX);
    relay_stream_seen_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kinds),
        cmocka_unit_test(test_first_round_scans),
        cmocka_unit_test(test_rounds_keep_the_list_until_the_rescan),
        cmocka_unit_test(test_a_new_stream_of_the_relay_rescans),
        cmocka_unit_test(test_a_stream_gone_rescans),
        cmocka_unit_test(test_a_listed_node_is_not_scanned),
        cmocka_unit_test(test_seen_counts_each_stream_once),
        cmocka_unit_test(test_seen_grows_and_stops_at_the_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
