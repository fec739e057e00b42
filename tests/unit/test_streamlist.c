/* Unit tests of core/streamlist.c: which keys are the relay's streams, when
 * the list of streams is scanned again, and what it does with the names the
 * claim cycle hands over (relay/streamseen.c). The scan itself runs against
 * real servers (tests/integration/test_observer.py). */
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
#include "relay/streamseen.h"

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

/* A round with the names handed over through seen (may be NULL), as the
 * observer starts one. */
static void round_with(struct relay_stream_list *l, struct relay_stream_seen *seen)
{
    char **fresh = NULL;
    int overflow = 0;
    size_t nfresh = seen != NULL ? relay_stream_seen_take(seen, &fresh, &overflow) : 0;
    relay_stream_list_round(l, fresh, nfresh, overflow);
}

/* A list after its first round, as that round's scan would leave it. */
static void first_round(struct relay_stream_list *l, struct relay_stream_seen *seen)
{
    memset(l, 0, sizeof(*l));
    round_with(l, seen);
    listed(l);
}

static void test_first_round_scans(void **state)
{
    (void)state;
    struct relay_stream_list l;
    memset(&l, 0, sizeof(l));
    round_with(&l, NULL);
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
        round_with(&l, NULL);
        assert_int_equal(l.n, 1);
        assert_int_equal(l.nnodes, 1);
    }
    round_with(&l, NULL);
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
    round_with(&l, NULL);
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
    round_with(&l, &seen);
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
    round_with(&l, &seen);
    assert_int_equal(l.n, 0); /* forgotten: each node is scanned again */
    assert_int_equal(l.nfresh, 0);
    relay_stream_list_free(&l);
    relay_stream_seen_free(&seen);
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
    round_with(&l, &seen);
    assert_int_equal(l.n, 1);
    assert_non_null(l.fresh[0]); /* not listed: looked for with EXISTS on each node */
    round_with(&l, &seen);       /* no node was visited */
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
        cmocka_unit_test(test_a_name_no_node_listed_rescans),
        cmocka_unit_test(test_rescan_at_once_only_when_stale),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
