/*
 * The relay's streams in Redis, and when to scan for them again
 * (core/streamlist.h).
 */
#include "common/compat.h"

#include "core/streamlist.h"

#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/keys.h"
#include "common/redisconn.h"

/* The most SCAN calls one node's scan makes (COUNT 1000 each). */
#define SCAN_ROUNDS_MAX 10000

static int topic_stream(const char *name, size_t len)
{
    int partition;
    return outbox_topic_valid(name, outbox_key_stream_topic_len(name, len, &partition));
}

enum relay_stream_kind relay_stream_kind(const char *key, size_t len, const char *prefix)
{
    if (prefix == NULL)
        prefix = "";
    size_t plen = strlen(prefix);
    if (len < 7 || memcmp(key + len - 7, ".replay", 7) != 0) {
        if (len < plen || memcmp(key, prefix, plen) != 0 ||
            (len >= 4 && memcmp(key + len - 4, ".dlq", 4) == 0))
            return RELAY_STREAM_OTHER;
        return topic_stream(key + plen, len - plen) ? RELAY_STREAM_TOPIC : RELAY_STREAM_OTHER;
    }
    /* "{<prefix><topic>[:<ppp>]}.<group>.replay" */
    if (len < plen + 3 || key[0] != '{' || memcmp(key + 1, prefix, plen) != 0)
        return RELAY_STREAM_OTHER;
    const char *close = memchr(key + 1, '}', len - 1);
    if (close == NULL || close + 1 >= key + len || close[1] != '.')
        return RELAY_STREAM_OTHER;
    const char *topic = key + 1 + plen;
    if (close < topic)
        return RELAY_STREAM_OTHER;
    return topic_stream(topic, (size_t)(close - topic)) ? RELAY_STREAM_REPLAY : RELAY_STREAM_OTHER;
}

/* Forgets the streams listed from index first on. */
static void drop_from(struct relay_stream_list *l, size_t first)
{
    for (size_t i = first; i < l->n; i++)
        free(l->streams[i].key);
    l->n = first;
}

static void forget_all(struct relay_stream_list *l)
{
    drop_from(l, 0);
    l->nnodes = 0;
}

static void drop_fresh(struct relay_stream_list *l)
{
    for (size_t i = 0; i < l->nfresh; i++)
        free(l->fresh[i]);
    free(l->fresh);
    l->fresh = NULL;
    l->nfresh = 0;
}

static int listed(const struct relay_stream_list *l, const char *key)
{
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->streams[i].key, key) == 0)
            return 1;
    return 0;
}

void relay_stream_list_round(struct relay_stream_list *l, char **fresh, size_t nfresh, int overflow)
{
    /* A name no node listed in the last round: a node was not reached, or
     * the stream is gone again. The scan finds it, if it is there. */
    for (size_t i = 0; i < l->nfresh; i++)
        if (l->fresh[i] != NULL)
            l->stale = 1;
    drop_fresh(l);
    l->fresh = fresh;
    l->nfresh = nfresh;
    l->since_scan++;
    if (l->scanned && !l->stale && !overflow && l->since_scan < RELAY_STREAM_RESCAN_EVERY) {
        for (size_t i = 0; i < l->nfresh; i++)
            if (l->fresh[i] != NULL && listed(l, l->fresh[i])) {
                free(l->fresh[i]);
                l->fresh[i] = NULL;
            }
        return;
    }
    drop_fresh(l); /* the scan finds them */
    forget_all(l);
    l->scanned = 1;
    l->stale = 0;
    l->since_scan = 0;
}

void relay_stream_list_forget(struct relay_stream_list *l)
{
    l->stale = 1;
}

int relay_stream_list_rescan(struct relay_stream_list *l)
{
    if (!l->stale)
        return 0;
    forget_all(l);
    l->stale = 0;
    l->since_scan = 0;
    return 1;
}

static void node_name(const redisContext *c, char out[RELAY_STREAM_NODE_MAX])
{
    if (c->connection_type == REDIS_CONN_UNIX && c->unix_sock.path != NULL)
        snprintf(out, RELAY_STREAM_NODE_MAX, "%s", c->unix_sock.path);
    else
        snprintf(out, RELAY_STREAM_NODE_MAX, "%s:%d", c->tcp.host != NULL ? c->tcp.host : "",
                 c->tcp.port);
}

static int add_stream(struct relay_stream_list *l, const char *key, size_t len, uint32_t node,
                      enum relay_stream_kind kind)
{
    if (l->n == l->cap) {
        size_t cap = l->cap != 0 ? 2 * l->cap : 64;
        struct relay_listed_stream *grown = realloc(l->streams, cap * sizeof(*grown));
        if (grown == NULL)
            return -1;
        l->streams = grown;
        l->cap = cap;
    }
    char *copy = malloc(len + 1);
    if (copy == NULL)
        return -1;
    memcpy(copy, key, len);
    copy[len] = '\0';
    struct relay_listed_stream *s = &l->streams[l->n++];
    s->key = copy;
    s->len = len;
    s->node = node;
    s->kind = kind;
    return 0;
}

static int by_key(const void *a, const void *b)
{
    const struct relay_listed_stream *x = a, *y = b;
    return strcmp(x->key, y->key);
}

/* Every stream of the relay's on the node, into l under index node, each
 * once (SCAN may return a key twice), in name order. */
static int scan_node(struct relay_stream_list *l, redisContext *c, const char *prefix, int stop_fd,
                     uint32_t timeout_ms, uint32_t node, char *err, size_t errlen)
{
    char cursor[32] = "0";
    int rounds = 0;
    size_t first = l->n;
    l->scans++;
    do {
        redisReply *r =
            outbox_redis_call(c, stop_fd, timeout_ms, "SCAN %s TYPE stream COUNT 1000", cursor);
        if (r == NULL || r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
            r->element[0]->type != REDIS_REPLY_STRING || r->element[1]->type != REDIS_REPLY_ARRAY) {
            snprintf(err, errlen, "SCAN failed: %s",
                     r != NULL && r->type == REDIS_REPLY_ERROR ? r->str
                     : r != NULL                               ? "an unexpected reply"
                                                               : c->errstr);
            if (r != NULL)
                freeReplyObject(r);
            drop_from(l, first);
            return -1;
        }
        snprintf(cursor, sizeof(cursor), "%s", r->element[0]->str);
        const redisReply *keys = r->element[1];
        for (size_t i = 0; i < keys->elements && l->n < RELAY_STREAM_LIST_MAX; i++) {
            const redisReply *k = keys->element[i];
            if (k->type != REDIS_REPLY_STRING)
                continue;
            enum relay_stream_kind kind = relay_stream_kind(k->str, k->len, prefix);
            if (kind != RELAY_STREAM_OTHER && add_stream(l, k->str, k->len, node, kind) < 0) {
                freeReplyObject(r);
                snprintf(err, errlen, "out of memory listing the streams");
                drop_from(l, first);
                return -1;
            }
        }
        freeReplyObject(r);
    } while (strcmp(cursor, "0") != 0 && ++rounds < SCAN_ROUNDS_MAX &&
             l->n < RELAY_STREAM_LIST_MAX);
    if (l->n - first > 1)
        qsort(&l->streams[first], l->n - first, sizeof(l->streams[0]), by_key);
    size_t kept = first;
    for (size_t i = first; i < l->n; i++) {
        if (kept > first && strcmp(l->streams[kept - 1].key, l->streams[i].key) == 0)
            free(l->streams[i].key);
        else
            l->streams[kept++] = l->streams[i];
    }
    l->n = kept;
    return 0;
}

/* The handed-over names the node has, into the list under node. */
static int place_fresh(struct relay_stream_list *l, redisContext *c, const char *prefix,
                       int stop_fd, uint32_t timeout_ms, uint32_t node, char *err, size_t errlen)
{
    for (size_t i = 0; i < l->nfresh; i++) {
        if (l->fresh[i] == NULL)
            continue;
        if (listed(l, l->fresh[i])) { /* found by this round's scan of a node */
            free(l->fresh[i]);
            l->fresh[i] = NULL;
            continue;
        }
        redisReply *r = outbox_redis_call(c, stop_fd, timeout_ms, "EXISTS %s", l->fresh[i]);
        if (r == NULL) {
            snprintf(err, errlen, "EXISTS failed: %s", c->errstr);
            l->stale = 1;
            return -1;
        }
        /* 0: not on this node, or gone; an error: another primary's slot. */
        int here = r->type == REDIS_REPLY_INTEGER && r->integer == 1;
        freeReplyObject(r);
        if (!here)
            continue;
        size_t len = strlen(l->fresh[i]);
        enum relay_stream_kind kind = relay_stream_kind(l->fresh[i], len, prefix);
        if (kind != RELAY_STREAM_OTHER && l->n < RELAY_STREAM_LIST_MAX &&
            add_stream(l, l->fresh[i], len, node, kind) < 0) {
            snprintf(err, errlen, "out of memory listing the streams");
            l->stale = 1;
            return -1;
        }
        free(l->fresh[i]);
        l->fresh[i] = NULL;
    }
    return 0;
}

int relay_stream_list_node(struct relay_stream_list *l, redisContext *c, const char *prefix,
                           int stop_fd, uint32_t timeout_ms, uint32_t *node, char *err,
                           size_t errlen)
{
    char name[RELAY_STREAM_NODE_MAX];
    node_name(c, name);
    for (size_t i = 0; i < l->nnodes; i++)
        if (strcmp(l->nodes[i], name) == 0) {
            *node = (uint32_t)i;
            return place_fresh(l, c, prefix, stop_fd, timeout_ms, *node, err, errlen);
        }
    if (l->nnodes == l->nodes_cap) {
        size_t cap = l->nodes_cap != 0 ? 2 * l->nodes_cap : 4;
        char(*nodes)[RELAY_STREAM_NODE_MAX] = realloc(l->nodes, cap * sizeof(*nodes));
        if (nodes == NULL) {
            snprintf(err, errlen, "out of memory listing the streams");
            l->stale = 1;
            return -1;
        }
        l->nodes = nodes;
        l->nodes_cap = cap;
    }
    /* A node not scanned since the last full scan began: a cluster's new
     * primary, whose slots came from nodes listed before. Their streams are
     * listed twice until the next round, which scans them all again. */
    if (l->since_scan > 0)
        l->stale = 1;
    *node = (uint32_t)l->nnodes;
    if (scan_node(l, c, prefix, stop_fd, timeout_ms, *node, err, errlen) < 0) {
        /* The node is scanned again at its next visit, and all of them at
         * the next round. */
        l->stale = 1;
        return -1;
    }
    memcpy(l->nodes[l->nnodes++], name, RELAY_STREAM_NODE_MAX);
    return place_fresh(l, c, prefix, stop_fd, timeout_ms, *node, err, errlen);
}

void relay_stream_list_free(struct relay_stream_list *l)
{
    forget_all(l);
    drop_fresh(l);
    free(l->streams);
    free(l->nodes);
    memset(l, 0, sizeof(*l));
}
