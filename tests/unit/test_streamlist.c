/* Unit tests of core/streamlist.c: which keys are the relay's streams, when
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
#include "common/keys.h"
#include "core/streamlist.h"

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
    assert_int_equal(kind(".replay", NULL), RELAY_STREAM_OTHER);
    assert_int_equal(kind(".dlq", NULL), RELAY_STREAM_OTHER);
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

/* A list after its first round, as that round's scan would leave it. */
static void first_round(struct relay_stream_list *l, struct relay_stream_seen *seen)
{
    memset(l, 0, sizeof(*l));
    relay_stream_list_round(l, seen);
    listed(l);
}

static void test_first_round_scans(void **state)
{
    (void)state;
    struct relay_stream_list l;
    memset(&l, 0, sizeof(l));
    relay_stream_list_round(&l, NULL);
    assert_int_equal(l.scanned, 1);
    assert_int_equal(l.since_scan, 0);
    assert_int_equal(l.nnodes, 0); /* every node scanned at its first visit */
    relay_stream_list_free(&l);
}

static void test_rounds_keep_the_list_until_the_rescan(void **state)
{
    (void)state;
    struct relay_stream_list l;
    first_round(&l, NULL);
    for (int i = 1; i < RELAY_STREAM_RESCAN_EVERY; i++) {
        relay_stream_list_round(&l, NULL);
        assert_int_equal(l.n, 1);
        assert_int_equal(l.nnodes, 1);
    }
    relay_stream_list_round(&l, NULL);
    assert_int_equal(l.n, 0);
    assert_int_equal(l.nnodes, 0);
    assert_int_equal(l.since_scan, 0);
    relay_stream_list_free(&l);
}

static void test_a_stream_gone_rescans(void **state)
{
    (void)state;
    struct relay_stream_list l;
    first_round(&l, NULL);
    relay_stream_list_forget(&l);
    relay_stream_list_round(&l, NULL);
    assert_int_equal(l.n, 0);
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

static void connected(redisContext *c, char *host)
{
    memset(c, 0, sizeof(*c));
    c->connection_type = REDIS_CONN_TCP;
    c->tcp.host = host;
    c->tcp.port = 6379;
}

/* A node listed since the last scan is not scanned again, and a name the
 * claim cycle hands over that is listed already costs no call: no Redis is
 * needed here, since none is called. */
static void test_a_listed_node_and_stream_cost_no_call(void **state)
{
    (void)state;
    struct relay_stream_seen seen;
    relay_stream_seen_init(&seen);
    struct relay_stream_list l;
    first_round(&l, &seen);
    struct relay_row row = row_of("orders", 0, 1);
    relay_stream_seen_note(&seen, NULL, &row);
    relay_stream_list_round(&l, &seen);
    assert_int_equal(l.nfresh, 1);
    assert_null(l.fresh[0]); /* listed: nothing to look for */
    char host[] = "127.0.0.1";
    redisContext c;
    connected(&c, host);
    uint32_t node = 99;
    char err[64] = "";
    assert_int_equal(relay_stream_list_node(&l, &c, NULL, -1, 1000, &node, err, sizeof(err)), 0);
    assert_int_equal(node, 0);
    assert_int_equal(l.scans, 0);
    assert_int_equal(l.stale, 0);
    assert_int_equal(l.n, 1);
    relay_stream_list_free(&l);
    relay_stream_seen_free(&seen);
}

/* More names than the hand-over holds: the observer scans instead. */
static void test_too_many_new_streams_rescan(void **state)
{
    (void)state;
    struct relay_stream_seen seen;
    relay_stream_seen_init(&seen);
    struct relay_stream_list l;
    first_round(&l, &seen);
    struct relay_row row = row_of("orders", 0, OUTBOX_PARTITIONS_MAX);
    for (uint32_t p = 0; p <= RELAY_STREAM_FRESH_MAX; p++) {
        row.partition = p;
        relay_stream_seen_note(&seen, NULL, &row);
    }
    relay_stream_list_round(&l, &seen);
    assert_int_equal(l.n, 0); /* forgotten: each node is scanned again */
    assert_int_equal(l.nfresh, 0);
    relay_stream_list_free(&l);
    relay_stream_seen_free(&seen);
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

/* A name handed over that no node listed in its round: the next round
 * scans. */
static void test_a_name_no_node_listed_rescans(void **state)
{
    (void)state;
    struct relay_stream_seen seen;
    relay_stream_seen_init(&seen);
    struct relay_stream_list l;
    first_round(&l, &seen);
    struct relay_row row = row_of("payments", 0, 1);
    relay_stream_seen_note(&seen, NULL, &row);
    relay_stream_list_round(&l, &seen);
    assert_int_equal(l.n, 1);
    assert_non_null(l.fresh[0]);        /* not listed: looked for with EXISTS on each node */
    relay_stream_list_round(&l, &seen); /* no node was visited */
    assert_int_equal(l.n, 0);
    assert_int_equal(l.nfresh, 0);
    relay_stream_list_free(&l);
    relay_stream_seen_free(&seen);
}

static void test_rescan_at_once_only_when_stale(void **state)
{
    (void)state;
    struct relay_stream_list l;
    first_round(&l, NULL);
    assert_int_equal(relay_stream_list_rescan(&l), 0);
    assert_int_equal(l.n, 1);
    relay_stream_list_forget(&l);
    assert_int_equal(relay_stream_list_rescan(&l), 1);
    assert_int_equal(l.n, 0);
    assert_int_equal(l.nnodes, 0);
    assert_int_equal(relay_stream_list_rescan(&l), 0);
    relay_stream_list_free(&l);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kinds),
        cmocka_unit_test(test_first_round_scans),
        cmocka_unit_test(test_rounds_keep_the_list_until_the_rescan),
        cmocka_unit_test(test_a_stream_gone_rescans),
        cmocka_unit_test(test_a_listed_node_and_stream_cost_no_call),
        cmocka_unit_test(test_too_many_new_streams_rescan),
        cmocka_unit_test(test_seen_hands_each_stream_over_once),
        cmocka_unit_test(test_seen_starts_again_past_the_cap),
        cmocka_unit_test(test_a_name_no_node_listed_rescans),
        cmocka_unit_test(test_rescan_at_once_only_when_stale),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
