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
 *   - after a listed stream was found gone or in another primary's slot (the
 *     observation then starts again at once), a scan failed part way, a
 *     node turned up that was not scanned (a cluster's new primary), or a
 *     name handed over (below) was on no node visited;
 *   - every RELAY_STREAM_RESCAN_EVERY observations, for the streams other
 *     processes created (other relays, the replay tool, an operator).
 * A stream the claim cycle publishes to for the first time (a new topic, or
 * a new partition of one) needs no scan: the daemon hands its name over at
 * the next round (relay/streamseen.h), and the list takes it on the node that
 * has it. docs/DESIGN.md, "Finding the streams".
 */
#ifndef RELAY_STREAMLIST_H
#define RELAY_STREAMLIST_H

#include <stddef.h>
#include <stdint.h>

struct redisContext;

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
    char **fresh; /* names handed over, not listed yet; NULL once placed */
    size_t nfresh;
    unsigned since_scan;      /* observations since the last full scan */
    int scanned;              /* a full scan began once */
    int stale;                /* the list may miss a stream: scan at the next round */
    unsigned long long scans; /* nodes scanned, since the start */
};

/* Starts an observation: takes the nfresh names of streams the claim cycle
 * published to since the last round (the list owns them and the array; fresh
 * may be NULL), with overflow set when some names were not handed over, and
 * when the list may miss a stream (see above), forgets every stream, so that
 * each node is scanned at its first visit. */
void relay_stream_list_round(struct relay_stream_list *l, char **fresh, size_t nfresh,
                             int overflow);

/* The node c is connected to, as an index into l->nodes, scanning it first
 * when it is not listed, then listing the handed-over names it has (an
 * EXISTS each, for a name no node has listed yet): 0, or -1 with err set
 * (the list is then stale). */
int relay_stream_list_node(struct relay_stream_list *l, struct redisContext *c, const char *prefix,
                           int stop_fd, uint32_t timeout_ms, uint32_t *node, char *err,
                           size_t errlen) __attribute__((warn_unused_result));

/* A listed stream was not found, or is in another primary's slot: scan at
 * the next round. */
void relay_stream_list_forget(struct relay_stream_list *l);
/* When the list may miss a stream, forgets every stream, so that each node
 * is scanned at its next visit: 1, else 0. For an observation to start
 * again at once. */
int relay_stream_list_rescan(struct relay_stream_list *l);

void relay_stream_list_free(struct relay_stream_list *l);

#endif
