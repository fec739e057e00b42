/*
 * The relay's streams in Redis, as the observer and the trim pass visit
 * them, and when to look for them again.
 *
 * Redis has no index of keys by type: the only way to find streams is a
 * SCAN of the whole keyspace, which visits every key, the dedup records too
 * (about 1.5 us a key; a backlog draining at 50,000 messages a second keeps
 * some 250,000 records). So the streams found are kept in a list between
 * observations, and a node is scanned again only when the list may have
 * missed a stream:
 *   - at the first observation;
 *   - after the relay published to a stream it had not published to before
 *     (relay_stream_seen, on the claim cycle's side: a new topic, or a new
 *     partition of one);
 *   - after a listed stream was found gone, or a scan failed part way, or a
 *     node turned up that was not scanned (a cluster's new primary);
 *   - every RELAY_STREAM_RESCAN_EVERY observations, for the streams other
 *     processes created (other relays, the replay tool, an operator).
 * docs/DESIGN.md, "Finding the streams".
 */
#ifndef RELAY_STREAMLIST_H
#define RELAY_STREAMLIST_H

#include <stddef.h>
#include <stdint.h>

struct redisContext;
struct relay_row;

/* Observations between two full scans when nothing else calls for one: a
 * minute at the default observe_interval of 5 s. */
#define RELAY_STREAM_RESCAN_EVERY 12
/* The most streams listed over all nodes; the trim pass visits no more. */
#define RELAY_STREAM_LIST_MAX 10000
/* A node's name: "host:port", or a Unix socket's path. */
#define RELAY_STREAM_NODE_MAX 300

enum relay_stream_kind {
    RELAY_STREAM_OTHER = 0, /* not the relay's: someone else's, a dead-letter stream */
    RELAY_STREAM_TOPIC,     /* "<prefix><topic>" or "<prefix><topic>:<ppp>" */
    RELAY_STREAM_REPLAY,    /* "{<prefix><topic>[:<ppp>]}.<group>.replay" */
};

/* What a stream key of this name is to a relay with this stream prefix.
 * Names ending in ".dlq" or ".replay" are never topics. */
enum relay_stream_kind relay_stream_kind(const char *key, size_t len, const char *prefix);

struct relay_listed_stream {
    char *key;
    size_t len;
    uint32_t node; /* index into relay_stream_list.nodes */
    enum relay_stream_kind kind;
};

struct relay_stream_list {
    struct relay_listed_stream *streams;
    size_t n, cap;
    char (*nodes)[RELAY_STREAM_NODE_MAX]; /* scanned since the last full scan began */
    size_t nnodes, nodes_cap;
    unsigned since_scan;    /* observations since the last full scan */
    unsigned generation;    /* relay_stream_seen's generation at that scan */
    int scanned;            /* a full scan began once */
    int stale;              /* the list may miss a stream: scan at the next round */
    unsigned long long scans; /* nodes scanned, since the start */
};

/* Starts an observation: when the list may miss a stream (see above), it
 * forgets every stream, and each node is scanned at its first visit.
 * generation is relay_stream_seen_generation's, or 0 without a relay. */
void relay_stream_list_round(struct relay_stream_list *l, unsigned generation);

/* The node c is connected to, as an index into l->nodes, scanning it first
 * when it is not listed: 0, or -1 with err set (the list is then stale). */
int relay_stream_list_node(struct relay_stream_list *l, struct redisContext *c,
                           const char *prefix, int stop_fd, uint32_t timeout_ms, uint32_t *node,
                           char *err, size_t errlen) __attribute__((warn_unused_result));

/* A listed stream was not found: scan at the next round. */
void relay_stream_list_forget(struct relay_stream_list *l);

void relay_stream_list_free(struct relay_stream_list *l);

/*
 * The streams the claim cycle has published to, as 64-bit hashes of topic
 * and partition, and a generation counted up at each new one, which the
 * observation thread reads. Owned by the loop; only the generation is read
 * from the other thread.
 */
struct relay_stream_seen {
    uint64_t *hashes; /* open addressing; 0 is an empty slot */
    size_t mask, n;
    unsigned generation; /* atomic: read by the observation thread */
};

/* Notes row's stream; the generation counts up when it is new. Past
 * RELAY_STREAM_LIST_MAX streams, or out of memory, nothing more is noted:
 * the periodic scan finds them. */
void relay_stream_seen_note(struct relay_stream_seen *s, const struct relay_row *row);
unsigned relay_stream_seen_generation(const struct relay_stream_seen *s);
void relay_stream_seen_free(struct relay_stream_seen *s);

#endif
