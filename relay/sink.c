/*
 * The Redis connections: hiredis 0.14 async API on its libev adapter.
 *
 * A single server takes one connection. A Redis Cluster takes one per
 * primary: the first connection (to a seed node) asks CLUSTER SLOTS, and a
 * server without cluster support answers with an error and becomes the one
 * connection; a cluster's answer becomes the slot map, and the sink connects
 * to every primary and sets each up (the functions are loaded on every
 * primary). Every command goes to the primary of its first key's hash slot.
 * The sink is ready only when every connection is; any connection that
 * fails, and any MOVED reply the relay reports (relay_sink_abort), drops
 * them all, and the next connect reads the slot map again, which takes in
 * failovers, resharding and primaries that joined.
 *
 * hiredis 0.14 has neither connect nor command timeouts, and cannot cancel one
 * command: the only way out of a stuck server is to free the whole context,
 * which runs every pending callback with a NULL reply. The sink therefore
 * owns one timer for the connect-and-set-up phase, and the relay owns the
 * per-chunk deadline (publish_timeout) that calls relay_sink_abort. Set-up commands are queued
 * right after redisAsyncConnect: hiredis sends them once the socket connects.
 *
 * With Sentinels configured, every connect first asks them, one after the
 * other on a short-lived async context of its own, for the primary's
 * address (SINK_RESOLVING), and the set-up checks with ROLE that the server
 * is a primary; a lost connection or a READONLY reply (the primary became a
 * replica) makes the next connect ask again, which follows a failover.
 *
 * Lifetimes follow the hiredis README: after a failed connect callback or a
 * disconnect callback the context is freed by hiredis, so node->ac is cleared
 * there and never touched again; callbacks of an old context compare their ac
 * with their node's ac and ignore themselves when they differ.
 */
#include "common/compat.h"

#include "relay/sink.h"

#include <ev.h>
#include <hiredis/adapters/libev.h>
#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/backoff.h"
#include "common/functions.h"
#include "core/config.h"
#include "common/keys.h"
#include "relay/log.h"
#include "common/redisconn.h"
#include "common/resolve.h"
#include "common/tls.h"
#include "relay/lookup.h"

#define COMPONENT "redis"

/* Most primaries of a cluster the sink connects to (a bit each in a mask). */
#define SINK_NODES_MAX 32

enum sink_state {
    SINK_DOWN = 0,
    SINK_RESOLVING,  /* asking a Sentinel for the primary's address */
    SINK_PROBING,    /* connected to one node, asking CLUSTER SLOTS */
    SINK_CONNECTING, /* sockets connecting, set-up commands queued */
    SINK_READY,
};

/* One connection: to the server, or to one primary of a cluster. */
struct sink_node {
    struct relay_sink *s;
    redisAsyncContext *ac;
    struct ssl_st *tls; /* ac's TLS session (rediss://), freed with ac */
    char host[256];
    int port;
    int setup_pending;
    int ready;
    int probe;                   /* the first connection of a connect: CLUSTER SLOTS */
    struct relay_lookup *lookup; /* host's addresses, while they are looked up */
    unsigned addr_turn;          /* which of host's addresses connects: the next on failure */
};

struct relay_sink {
    struct ev_loop *loop;
    const struct relay_config *cfg;
    struct relay_sink_hooks hooks;

    enum sink_state state;
    int cluster; /* the slot map is in force */
    struct sink_node nodes[SINK_NODES_MAX];
    int nnodes;
    int nready;
    uint8_t slot_node[OUTBOX_CLUSTER_SLOTS]; /* slot -> node index, in a cluster */
    uint32_t written;                        /* nodes written since relay_sink_wait */
    uint64_t asks_followed;                  /* ASK replies sent on to the importing primary */
    int seed_next;                           /* the seed node the next connect tries */
    /* Sentinel: the context asking one, the next one to ask, why the last
     * one did not answer, and the primary's address they gave. */
    redisAsyncContext *sentinel_ac;
    struct ssl_st *sentinel_tls;          /* its TLS session (rediss://), freed with it */
    struct relay_lookup *sentinel_lookup; /* its name's addresses, while looked up */
    unsigned sentinel_addr_turn;          /* which of its addresses: the next on failure */
    int sentinel_next;
    int sentinel_refused_auth; /* the Sentinel asked refused AUTH: sentinel_error says so */
    char sentinel_error[512];
    char primary_host[256];
    int primary_port;
    ev_timer timer; /* connect + set-up deadline, or reconnect wait */
    struct outbox_backoff backoff;
    int was_ready;
    char last_logged[1024];
    char durability[512];
    char describe[600];
};

static void start_connect(struct relay_sink *s);

/* Set-up steps, passed as privdata to name the step in messages. */
static char step_auth[] = "AUTH";
static char step_select[] = "SELECT";
static char step_slots[] = "CLUSTER SLOTS";
static char step_setname[] = "CLIENT SETNAME";
static char step_function[] = "FUNCTION";
static char step_consumer_library[] = "FUNCTION LOAD of library " OUTBOX_CONSUMER_FUNCTION_LIBRARY;
static char step_config[] = "CONFIG";
static char step_role[] = "ROLE";

void *relay_sink_owner(const struct redisAsyncContext *ac)
{
    const struct sink_node *n = ac->data;
    return n != NULL ? n->s->hooks.arg : NULL;
}

const char *relay_sink_describe(const struct relay_sink *s)
{
    return s->describe;
}

int relay_sink_ready(const struct relay_sink *s)
{
    return s->state == SINK_READY;
}

static void timer_start(struct relay_sink *s, uint32_t ms)
{
    ev_timer_stop(s->loop, &s->timer);
    ev_timer_set(&s->timer, ms / 1000.0, 0.0);
    ev_timer_start(s->loop, &s->timer);
}

/* Names the server in log lines: the URL, the master and its primary, or
 * the cluster. */
static void describe(struct relay_sink *s)
{
    const struct outbox_redis_url *u = &s->cfg->redis_url;
    if (u->sentinels.n > 0) {
        int v6 = strchr(s->primary_host, ':') != NULL;
        snprintf(s->describe, sizeof(s->describe), "redis master %s (primary %s%s%s:%d, db %d)",
                 u->sentinels.master, v6 ? "[" : "", s->primary_host[0] ? s->primary_host : "?",
                 v6 ? "]" : "", s->primary_port, u->db);
        return;
    }
    if (s->cluster) {
        snprintf(s->describe, sizeof(s->describe), "redis cluster of %d primaries (seed %s:%d)",
                 s->nnodes, u->seeds[0].host, u->seeds[0].port);
        return;
    }
    int v6 = strchr(u->host, ':') != NULL;
    snprintf(s->describe, sizeof(s->describe), "%s://%s%s%s%s%s%s:%d/%d%s",
             u->tls.on ? "rediss" : "redis", u->user, u->password[0] ? ":***" : "",
             (u->user[0] || u->password[0]) ? "@" : "", v6 ? "[" : "", u->host, v6 ? "]" : "",
             u->port, u->db, u->nseeds > 1 ? " (and more seeds)" : "");
}

/* Frees every connection, detached first so that their callbacks (run by
 * redisAsyncFree with NULL replies) see a stale context and return. */
static void drop_nodes(struct relay_sink *s)
{
    for (int i = 0; i < s->nnodes; i++) {
        struct sink_node *n = &s->nodes[i];
        redisAsyncContext *ac = n->ac;
        n->ac = NULL;
        n->ready = 0;
        n->setup_pending = 0;
        relay_lookup_cancel(n->lookup);
        n->lookup = NULL;
        if (ac != NULL)
            redisAsyncFree(ac);
    }
    s->nready = 0;
}

/* Marks the sink down, logs once per state change and schedules a reconnect.
 * The contexts, if any, must already be detached from s. */
static void went_down(struct relay_sink *s, const char *what, const char *msg)
{
    int was_ready = s->was_ready;
    s->was_ready = 0;
    s->state = SINK_DOWN;
    s->nready = 0;

    uint32_t delay = outbox_backoff_next(&s->backoff, outbox_backoff_random());
    char line[1024];
    snprintf(line, sizeof(line), "%s: %s", what, msg != NULL ? msg : "unknown error");
    if (was_ready)
        s->last_logged[0] = '\0';
    if (strcmp(line, s->last_logged) == 0) {
        relay_debug(COMPONENT, "%s: %s; retrying in %u ms", s->describe, line, delay);
    } else {
        snprintf(s->last_logged, sizeof(s->last_logged), "%s", line);
        relay_error(COMPONENT, "%s: %s; retrying with backoff (first retry in %u ms)", s->describe,
                    line, delay);
    }
    timer_start(s, delay);
    if (s->hooks.on_down != NULL)
        s->hooks.on_down(s, s->hooks.arg);
}

/* One connection failed: all go, and the sink reconnects after a backoff. */
static void node_failed(struct relay_sink *s, const char *what, const char *msg)
{
    char copy[1024];
    snprintf(copy, sizeof(copy), "%s", msg != NULL ? msg : "unknown error");
    drop_nodes(s);
    went_down(s, what, copy);
}

void relay_sink_abort(struct relay_sink *s, const char *why)
{
    if (s->state != SINK_PROBING && s->state != SINK_CONNECTING && s->state != SINK_READY)
        return;
    ev_timer_stop(s->loop, &s->timer);
    node_failed(s, "connection dropped", why);
}

/* The connection a command with these bytes goes to. */
static struct sink_node *route(struct relay_sink *s, const char *cmd, size_t len)
{
    if (!s->cluster)
        return &s->nodes[0];
    return &s->nodes[s->slot_node[outbox_redis_command_slot(cmd, len)]];
}

/*
 * In a cluster every command carries a small record of its own, so that an
 * ASK reply (its slot is being migrated and the key already left) can be
 * followed: the same bytes go to the importing primary behind an ASKING.
 * When that primary still misses one of a multi-key command's keys it
 * answers TRYAGAIN, which fails the batch and is retried with backoff. With
 * min_replicas the redirected write gets a WAIT of its own on that primary,
 * and its reply reaches the caller only once the replicas hold it: the
 * batch's WAIT went out before the redirect and covers the other writes.
 */
struct sink_cmd {
    struct relay_sink *s;
    relay_sink_reply_fn *cb;
    void *arg;
    int redirected;
    redisReply *held; /* the redirected command's reply, kept until its WAIT answers */
    size_t len;
    char cmd[];
};

/* The primary an "ASK <slot> <host>:<port>" names, if the sink has it. */
static struct sink_node *ask_target(struct relay_sink *s, const char *str, size_t len)
{
    const char *sp = memchr(str + 4, ' ', len - 4);
    if (sp == NULL)
        return NULL;
    const char *addr = sp + 1, *end = str + len;
    const char *colon = NULL;
    for (const char *p = addr; p < end; p++)
        if (*p == ':')
            colon = p;
    if (colon == NULL)
        return NULL;
    size_t hlen = (size_t)(colon - addr);
    char *pe;
    long port = strtol(colon + 1, &pe, 10);
    if (pe != end || port <= 0 || port > 65535)
        return NULL;
    for (int i = 0; i < s->nnodes; i++) {
        struct sink_node *n = &s->nodes[i];
        if (n->ac != NULL && n->port == port && strlen(n->host) == hlen &&
            memcmp(n->host, addr, hlen) == 0)
            return n;
    }
    return NULL;
}

static void on_cmd_reply(redisAsyncContext *ac, void *reply, void *privdata);
static void on_cmd_wait(redisAsyncContext *ac, void *reply, void *privdata);

/* Queues WAIT replicas timeout_ms on ac: REDIS_OK or REDIS_ERR. */
static int queue_wait(redisAsyncContext *ac, unsigned replicas, uint32_t timeout_ms,
                      redisCallbackFn *cb, void *arg)
{
    char want[16], ms[16];
    snprintf(want, sizeof(want), "%u", replicas);
    snprintf(ms, sizeof(ms), "%u", timeout_ms);
    const char *argv[3] = {"WAIT", want, ms};
    size_t lens[3] = {4, strlen(want), strlen(ms)};
    return redisAsyncCommandArgv(ac, cb, arg, 3, argv, lens);
}

static int follow_ask(struct sink_cmd *c, struct sink_node *t)
{
    static const char *asking[1] = {"ASKING"};
    static const size_t asking_len[1] = {6};
    struct relay_sink *s = c->s;
    if (redisAsyncCommandArgv(t->ac, NULL, NULL, 1, asking, asking_len) != REDIS_OK ||
        redisAsyncFormattedCommand(t->ac, on_cmd_reply, c, c->cmd, c->len) != REDIS_OK)
        return -1;
    c->redirected = 1;
    s->asks_followed++;
    /* If the WAIT cannot be queued the connection is gone, and the
     * command's own callback runs with NULL. */
    if (s->cfg->min_replicas > 0 &&
        queue_wait(t->ac, s->cfg->min_replicas, s->cfg->replica_timeout_ms, on_cmd_wait, c) ==
            REDIS_OK)
        c->redirected = 2;
    return 0;
}

static void on_cmd_reply(redisAsyncContext *ac, void *reply, void *privdata)
{
    struct sink_cmd *c = privdata;
    const redisReply *r = reply;
    if (r != NULL && !c->redirected && r->type == REDIS_REPLY_ERROR && r->len > 4 &&
        memcmp(r->str, "ASK ", 4) == 0 && c->s->state == SINK_READY) {
        struct sink_node *t = ask_target(c->s, r->str, r->len);
        if (t != NULL && follow_ask(c, t) == 0)
            return;
    }
    if (c->redirected == 2 && r != NULL && r->type != REDIS_REPLY_ERROR) {
        /* Its WAIT decides; a reply that cannot be kept fails the batch. */
        c->held = outbox_redis_reply_copy(r);
        if (c->held != NULL)
            return;
        c->redirected = 3;
        c->cb(ac, NULL, c->arg);
        return;
    }
    if (c->redirected == 2)
        c->redirected = 3; /* answered: the WAIT's callback only frees */
    c->cb(ac, reply, c->arg);
    if (c->redirected != 3)
        free(c);
}

static void on_cmd_wait(redisAsyncContext *ac, void *reply, void *privdata)
{
    struct sink_cmd *c = privdata;
    const redisReply *r = reply;
    if (c->held != NULL) {
        if (r != NULL && r->type == REDIS_REPLY_INTEGER &&
            r->integer >= (long long)c->s->cfg->min_replicas) {
            c->cb(ac, c->held, c->arg);
        } else {
            char msg[200];
            snprintf(msg, sizeof(msg),
                     "NOREPLICAS %lld of min_replicas = %u replicas acknowledged a write "
                     "redirected by ASK within replica_timeout",
                     r != NULL && r->type == REDIS_REPLY_INTEGER ? r->integer : 0LL,
                     c->s->cfg->min_replicas);
            redisReply e = {.type = REDIS_REPLY_ERROR, .str = msg, .len = strlen(msg)};
            c->cb(ac, r != NULL ? &e : NULL, c->arg);
        }
        freeReplyObject(c->held);
    } else if (c->redirected == 2) {
        /* The command's reply never came (its context went first). */
        c->cb(ac, NULL, c->arg);
    }
    free(c);
}

int relay_sink_formatted(struct relay_sink *s, const char *cmd, size_t len, relay_sink_reply_fn *cb,
                         void *arg)
{
    if (s->state != SINK_READY)
        return -1;
    /* hiredis reads the command's name to spot SUBSCRIBE and MONITOR, with
     * strchr: anything but a protocol array would send it past the buffer. */
    if (len < 4 || cmd[0] != '*')
        return -1;
    struct sink_node *n = route(s, cmd, len);
    if (n->ac == NULL)
        return -1;
    if (!s->cluster) {
        if (redisAsyncFormattedCommand(n->ac, cb, arg, cmd, len) != REDIS_OK)
            return -1;
    } else {
        struct sink_cmd *c = malloc(sizeof(*c) + len + 1);
        if (c == NULL)
            return -1;
        *c = (struct sink_cmd){.s = s, .cb = cb, .arg = arg, .len = len};
        memcpy(c->cmd, cmd, len);
        c->cmd[len] = '\0'; /* as after a transaction's commands */
        if (redisAsyncFormattedCommand(n->ac, on_cmd_reply, c, cmd, len) != REDIS_OK) {
            free(c);
            return -1;
        }
    }
    s->written |= 1u << (n - s->nodes);
    return 0;
}

/*
 * A transaction in flight: every command has a callback (hiredis queues one
 * per command), the parts' only noting the first error a command got while
 * queued; the last callback to run answers and frees it.
 */
struct sink_tx {
    struct relay_sink *s;
    relay_sink_reply_fn *cb;
    void *arg;
    size_t queued, answered; /* callbacks queued, and run, in this round */
    int exec_queued;         /* the round's EXEC was queued */
    int redirected;          /* sent again behind ASKING */
    int answered_cb;         /* cb has run */
    char error[256];         /* the first error of a command while queued */
    size_t error_len;
    size_t n, len;
    size_t *ends; /* n of them, after the struct */
    char *cmd;    /* len bytes, after ends */
};

static void on_tx_reply(redisAsyncContext *ac, void *reply, void *privdata);

/* Queues the transaction's commands on ac, ASKING first when asking:
 * returns how many callbacks were queued. */
static size_t tx_queue(struct sink_tx *t, redisAsyncContext *ac, int asking)
{
    static const char *asking_argv[1] = {"ASKING"};
    static const size_t asking_len[1] = {6};
    t->queued = t->answered = 0;
    t->exec_queued = 0;
    t->error_len = 0;
    if (asking && redisAsyncCommandArgv(ac, NULL, NULL, 1, asking_argv, asking_len) != REDIS_OK)
        return 0;
    size_t start = 0;
    for (size_t i = 0; i < t->n; i++) {
        if (redisAsyncFormattedCommand(ac, on_tx_reply, t, t->cmd + start, t->ends[i] - start) !=
            REDIS_OK)
            break;
        t->queued++;
        t->exec_queued = i + 1 == t->n;
        start = t->ends[i];
    }
    return t->queued;
}

static void tx_answer(struct sink_tx *t, redisAsyncContext *ac, void *exec)
{
    if (t->answered_cb)
        return;
    t->answered_cb = 1;
    if (exec != NULL && t->error_len > 0) {
        /* EXECABORT says only that something was refused: say what. */
        redisReply e = {.type = REDIS_REPLY_ERROR, .str = t->error, .len = t->error_len};
        t->cb(ac, &e, t->arg);
    } else {
        t->cb(ac, exec, t->arg);
    }
}

static void on_tx_reply(redisAsyncContext *ac, void *reply, void *privdata)
{
    struct sink_tx *t = privdata;
    const redisReply *r = reply;
    t->answered++;
    int last = t->answered == t->queued;
    if (!last) {
        if (r != NULL && r->type == REDIS_REPLY_ERROR && t->error_len == 0) {
            t->error_len = r->len < sizeof(t->error) - 1 ? r->len : sizeof(t->error) - 1;
            memcpy(t->error, r->str, t->error_len);
            t->error[t->error_len] = '\0';
        }
        return;
    }
    /* The round's last callback: EXEC's, or a part's when EXEC could not be
     * queued (the connection is going: its reply is NULL then). */
    struct relay_sink *s = t->s;
    if (r != NULL && t->exec_queued && s->cluster && !t->redirected && t->error_len > 4 &&
        memcmp(t->error, "ASK ", 4) == 0 && s->state == SINK_READY) {
        struct sink_node *target = ask_target(s, t->error, t->error_len);
        if (target != NULL) {
            t->redirected = 1;
            s->asks_followed++;
            if (tx_queue(t, target->ac, 1) > 0)
                return;
        }
    }
    tx_answer(t, ac, t->exec_queued ? reply : NULL);
    free(t);
}

int relay_sink_transaction(struct relay_sink *s, const char *cmds, const size_t *ends, size_t n,
                           relay_sink_reply_fn *cb, void *arg)
{
    if (s->state != SINK_READY || n < 3 || cmds[0] != '*')
        return -1;
    size_t len = ends[n - 1];
    struct sink_node *node = route(s, cmds + ends[0], ends[1] - ends[0]);
    if (node->ac == NULL)
        return -1;
    /* A NUL after the commands: hiredis reads the byte after a command's
     * last line when it looks at the command. */
    struct sink_tx *t = malloc(sizeof(*t) + n * sizeof(size_t) + len + 1);
    if (t == NULL)
        return -1;
    *t = (struct sink_tx){.s = s, .cb = cb, .arg = arg, .n = n, .len = len};
    t->ends = (size_t *)(void *)(t + 1);
    t->cmd = (char *)(t->ends + n);
    memcpy(t->ends, ends, n * sizeof(size_t));
    memcpy(t->cmd, cmds, len);
    t->cmd[len] = '\0';
    if (tx_queue(t, node->ac, 0) == 0) {
        free(t);
        return -1;
    }
    s->written |= 1u << (node - s->nodes);
    return 0;
}

uint64_t relay_sink_asks_followed(const struct relay_sink *s)
{
    return s->asks_followed;
}

int relay_sink_wait(struct relay_sink *s, unsigned replicas, uint32_t timeout_ms,
                    relay_sink_reply_fn *cb, void *arg)
{
    if (s->state != SINK_READY)
        return -1;
    int sent = 0;
    for (int i = 0; i < s->nnodes; i++) {
        if (!(s->written & (1u << i)))
            continue;
        struct sink_node *n = &s->nodes[i];
        if (n->ac == NULL || queue_wait(n->ac, replicas, timeout_ms, cb, arg) != REDIS_OK)
            return -1;
        sent++;
    }
    s->written = 0;
    return sent;
}

void relay_sink_written_reset(struct relay_sink *s)
{
    s->written = 0;
}

void relay_sink_written_all(struct relay_sink *s)
{
    for (int i = 0; i < s->nnodes; i++)
        if (s->nodes[i].ac != NULL)
            s->written |= 1u << i;
}

/* Reports what an acknowledged XADD is worth on this server (docs/GUARANTEES.md, "What Redis
 * keeps is up to Redis"). */
static void check_durability(struct relay_sink *s, const redisReply *r)
{
    char text[512];
    const char *aof = NULL, *fsync = NULL, *policy = NULL;

    if (r == NULL || r->type != REDIS_REPLY_ARRAY) {
        snprintf(text, sizeof(text),
                 "could not check the durability settings (%s); make sure the server runs with "
                 "appendonly yes and appendfsync always, or acknowledged messages can be lost "
                 "in a crash",
                 r != NULL && r->type == REDIS_REPLY_ERROR ? r->str
                                                           : "unexpected reply to CONFIG GET");
    } else {
        for (size_t i = 0; i + 1 < r->elements; i += 2) {
            const redisReply *k = r->element[i], *v = r->element[i + 1];
            if (k->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING)
                continue;
            if (strcmp(k->str, "appendonly") == 0)
                aof = v->str;
            else if (strcmp(k->str, "appendfsync") == 0)
                fsync = v->str;
            else if (strcmp(k->str, "maxmemory-policy") == 0)
                policy = v->str;
        }
        const char *evict = policy != NULL && strcmp(policy, "noeviction") != 0
                                ? "; maxmemory-policy is not noeviction, so streams and dedup "
                                  "records can be evicted: set maxmemory-policy noeviction"
                                : "";
        if (aof == NULL || fsync == NULL)
            snprintf(text, sizeof(text), "could not read appendonly/appendfsync%s", evict);
        else if (strcmp(aof, "yes") != 0)
            snprintf(text, sizeof(text),
                     "appendonly is off: an acknowledged message survives only until the next "
                     "RDB snapshot and a crash can lose everything since the last one; set "
                     "appendonly yes and appendfsync always for no loss after acknowledgement%s",
                     evict);
        else if (strcmp(fsync, "always") != 0)
            snprintf(text, sizeof(text),
                     "appendfsync is %s: a crash can lose about %s of acknowledged messages; set "
                     "appendfsync always for no loss after acknowledgement%s",
                     fsync, strcmp(fsync, "everysec") == 0 ? "1-2 s" : "30 s", evict);
        else if (*evict)
            snprintf(text, sizeof(text), "appendonly yes, appendfsync always%s", evict);
        else
            snprintf(text, sizeof(text),
                     "appendonly yes, appendfsync always: acknowledged messages survive a crash");
    }
    if (strcmp(text, s->durability) == 0)
        return;
    snprintf(s->durability, sizeof(s->durability), "%s", text);
    if (strstr(text, "survive a crash") != NULL)
        relay_info(COMPONENT, "durability: %s", text);
    else
        relay_warn(COMPONENT, "durability: %s", text);
}

static void queue_setup(struct sink_node *n);
static void connect_node(struct relay_sink *s, struct sink_node *n, int probe);

/* Every connection is set up: the sink is ready. */
static void all_ready(struct relay_sink *s)
{
    ev_timer_stop(s->loop, &s->timer);
    s->state = SINK_READY;
    s->was_ready = 1;
    s->written = 0;
    outbox_backoff_reset(&s->backoff);
    relay_info(COMPONENT, "%s %s", s->describe,
               s->last_logged[0] ? "is back" : "ready (functions loaded)");
    s->last_logged[0] = '\0';
    if (s->hooks.on_ready != NULL)
        s->hooks.on_ready(s, s->hooks.arg);
}

/*
 * The answer to CLUSTER SLOTS on the first connection. A server without
 * cluster support answers with an error: it is the one connection, set up
 * now. A cluster's answer becomes the slot map, and the sink connects to each
 * of its primaries. 0, or -1 when the sink went down.
 */
static int take_slots(struct relay_sink *s, struct sink_node *first, const redisReply *r)
{
    char msg[400];
    if (r != NULL && r->type != REDIS_REPLY_ARRAY &&
        !(r->type == REDIS_REPLY_ERROR && strncmp(r->str, "CLUSTERDOWN", 11) == 0)) {
        /* "ERR This instance has cluster support disabled" (or an ACL that
         * forbids CLUSTER, or a proxy that answers for one server: none of
         * them is used as a cluster). */
        s->cluster = 0;
        s->nnodes = 1;
        describe(s);
        queue_setup(first);
        return 0;
    }
    if (r == NULL || r->type != REDIS_REPLY_ARRAY || r->elements == 0) {
        snprintf(msg, sizeof(msg), "CLUSTER SLOTS failed: %s",
                 r == NULL                      ? "connection closed"
                 : r->type == REDIS_REPLY_ERROR ? r->str
                                                : "the cluster has no slots assigned");
        node_failed(s, "cannot read the cluster's slot map", msg);
        return -1;
    }
    if (s->cfg->redis_url.db != 0) {
        node_failed(s, "cannot use the cluster",
                    "a Redis Cluster has database 0 only: remove the /db from redis");
        return -1;
    }
    struct outbox_addr primaries[SINK_NODES_MAX];
    int count = outbox_cluster_slots_parse(r, first->host, primaries, SINK_NODES_MAX, s->slot_node);
    if (count < 0) {
        snprintf(msg, sizeof(msg), "the cluster has more than %d primaries", SINK_NODES_MAX);
        node_failed(s, "cannot use the cluster", msg);
        return -1;
    }
    for (int slot = 0; slot < OUTBOX_CLUSTER_SLOTS; slot++) {
        if (s->slot_node[slot] == OUTBOX_SLOT_UNCOVERED) {
            snprintf(msg, sizeof(msg),
                     "slot %d has no primary (the cluster is not fully covered): check CLUSTER "
                     "SLOTS",
                     slot);
            node_failed(s, "cannot use the cluster", msg);
            return -1;
        }
    }
    /* The probe connection goes; every primary gets one of its own. */
    redisAsyncContext *ac = first->ac;
    first->ac = NULL;
    redisAsyncDisconnect(ac);
    s->cluster = 1;
    s->nnodes = count;
    s->nready = 0;
    describe(s);
    relay_debug(COMPONENT, "%s: slot map read, connecting to each primary", s->describe);
    s->state = SINK_CONNECTING;
    for (int i = 0; i < count; i++) {
        struct sink_node *n = &s->nodes[i];
        memcpy(n->host, primaries[i].host, sizeof(n->host));
        n->port = primaries[i].port;
        connect_node(s, n, 0);
        if (s->state != SINK_CONNECTING)
            return -1;
    }
    timer_start(s, s->cfg->connect_timeout_ms);
    return 0;
}

/* Starts TLS on ac for host when the URL is rediss://: 0, or -1 with msg. */
static int start_tls(const struct relay_sink *s, redisAsyncContext *ac, const char *host, int port,
                     struct ssl_st **tls, char *msg, size_t msglen)
{
    *tls = NULL;
#if OUTBOX_TLS
    if (s->cfg->redis_url.tls.on) {
        *tls = outbox_tls_start(&ac->c, &s->cfg->redis_url, host, port, msg, msglen);
        if (*tls == NULL)
            return -1;
    }
#else
    (void)s;
    (void)ac;
    (void)host;
    (void)port;
    (void)msg;
    (void)msglen;
#endif
    return 0;
}

/* Whether TLS explains why a connection to host:port failed (a refused
 * certificate, an unfinished handshake, a client certificate the server may
 * want while setting_up): 1 with msg written, else 0. */
static int tls_explains(const struct ssl_st *tls, const char *host, int port, const char *text,
                        int setting_up, char *msg, size_t msglen)
{
#if OUTBOX_TLS
    return outbox_tls_failure(tls, host, port, text, setting_up, msg, msglen);
#else
    (void)tls;
    (void)host;
    (void)port;
    (void)text;
    (void)setting_up;
    (void)msg;
    (void)msglen;
    return 0;
#endif
}

/* Why a connection to host:port failed: what TLS says when it explains it,
 * else "host:port: text". */
static void io_failure(const struct ssl_st *tls, const char *host, int port, const char *text,
                       int setting_up, char *msg, size_t msglen)
{
    if (!tls_explains(tls, host, port, text, setting_up, msg, msglen))
        snprintf(msg, msglen, "%.100s:%d: %s", host, port, text);
}

static void on_setup_reply(redisAsyncContext *ac, void *reply, void *privdata)
{
    struct sink_node *n = ac->data;
    const redisReply *r = reply;
    const char *step = privdata;

    if (n == NULL || ac != n->ac)
        return;
    struct relay_sink *s = n->s;
    if (s->state != SINK_CONNECTING && s->state != SINK_PROBING)
        return;
    if (step == step_slots) {
        if (take_slots(s, n, r) != 0)
            return;
        if (s->cluster)
            return; /* the probe connection is closing */
        /* The set-up just queued replaces this step. */
        n->setup_pending--;
        s->state = SINK_CONNECTING;
        return;
    }
    if (step == step_role) {
    } else if (step == step_role) {
        if (r == NULL || r->type != REDIS_REPLY_ARRAY || r->elements == 0 ||
            r->element[0]->type != REDIS_REPLY_STRING ||
            strcmp(r->element[0]->str, "master") != 0) {
            char msg[400];
            snprintf(msg, sizeof(msg),
                     "%s:%d, which the Sentinels name as the primary, is not a primary (a "
                     "failover in progress?); asking them again",
                     n->host, n->port);
            relay_sink_abort(s, msg);
            return;
        }
    } else if (step == step_config) {
        check_durability(s, r);
    } else if (step == step_consumer_library) {
        /* The consumers' functions, for consumers in any language: the C
         * library loads them itself too, so a refusal stops nothing here. */
        if (r == NULL || r->type == REDIS_REPLY_ERROR)
            relay_warn(COMPONENT,
                       "%s failed on %s:%d: %s; consumers in other languages that call its "
                       "functions (docs/CONSUMERS.md) need it loaded",
                       step, n->host, n->port, r != NULL ? r->str : "connection closed");
    } else if (r == NULL && n->tls != NULL) {
        /* A failed handshake shows as the first step's lost reply. */
        char msg[400];
        io_failure(n->tls, n->host, n->port, ac->errstr[0] ? ac->errstr : "connection closed", 1,
                   msg, sizeof(msg));
        relay_sink_abort(s, msg);
        return;
    } else if (r == NULL || r->type == REDIS_REPLY_ERROR) {
        char msg[400];
        int noperm = r != NULL && r->type == REDIS_REPLY_ERROR && strncmp(r->str, "NOPERM", 6) == 0;
        const char *hint = step == step_auth ? ": check the user and password of the redis setting"
                           : noperm ? ": the relay's Redis user needs FUNCTION LOAD, FCALL "
                                      "and CLIENT SETNAME (docs/OPERATIONS.md, \"Redis users\")"
                                    : "";
        snprintf(msg, sizeof(msg), "%s failed on %s:%d: %s%s", step, n->host, n->port,
                 r != NULL ? r->str : (ac->errstr[0] ? ac->errstr : "connection closed"), hint);
        relay_sink_abort(s, msg);
        return;
    }
    if (--n->setup_pending > 0)
        return;
    n->ready = 1;
    if (++s->nready == s->nnodes)
        all_ready(s);
}

static void on_connect(const redisAsyncContext *ac, int status)
{
    struct sink_node *n = ac->data;
    if (n == NULL || ac != n->ac || status == REDIS_OK)
        return;
    /* hiredis frees the context after this callback. */
    struct relay_sink *s = n->s;
    char msg[400];
    io_failure(n->tls, n->host, n->port, ac->c.errstr[0] ? ac->c.errstr : "connect failed", 1, msg,
               sizeof(msg));
    n->ac = NULL;
    n->addr_turn++; /* the next connect tries the host's next address */
    ev_timer_stop(s->loop, &s->timer);
    node_failed(s, "cannot connect", msg);
}

static void on_disconnect(const redisAsyncContext *ac, int status)
{
    struct sink_node *n = ac->data;
    (void)status;
    if (n == NULL || ac != n->ac)
        return;
    struct relay_sink *s = n->s;
    char msg[400];
    io_failure(n->tls, n->host, n->port,
               ac->c.errstr[0] ? ac->c.errstr : "server closed the connection", !n->ready, msg,
               sizeof(msg));
    n->ac = NULL;
    ev_timer_stop(s->loop, &s->timer);
    node_failed(s, "connection lost", msg);
}

/* AUTH, the one step a probe needs before CLUSTER SLOTS. */
static void queue_auth(struct sink_node *n)
{
    const struct outbox_redis_url *u = &n->s->cfg->redis_url;
    const char *argv[3];
    size_t lens[3];
    if (u->password[0] == '\0')
        return;
    int k = 0;
    argv[k] = "AUTH";
    lens[k++] = 4;
    if (u->user[0] != '\0') {
        argv[k] = u->user;
        lens[k++] = strlen(u->user);
    }
    argv[k] = u->password;
    lens[k++] = strlen(u->password);
    redisAsyncCommandArgv(n->ac, on_setup_reply, step_auth, k, argv, lens);
    n->setup_pending++;
}

/* The set-up of a connection that publishes (AUTH first when it was not a
 * probe): the database, ROLE with Sentinel, the name, both function
 * libraries, the durability settings. */
static void queue_setup(struct sink_node *n)
{
    struct relay_sink *s = n->s;
    const struct outbox_redis_url *u = &s->cfg->redis_url;
    const char *argv[4];
    size_t lens[4];
    char db[16];

    if (u->db != 0 && !s->cluster) {
        snprintf(db, sizeof(db), "%d", u->db);
        argv[0] = "SELECT";
        lens[0] = 6;
        argv[1] = db;
        lens[1] = strlen(db);
        redisAsyncCommandArgv(n->ac, on_setup_reply, step_select, 2, argv, lens);
        n->setup_pending++;
    }
    if (u->sentinels.n > 0) {
        /* Before anything is loaded: the address the Sentinels gave can
         * still be the old primary's, a replica now. */
        argv[0] = "ROLE";
        lens[0] = 4;
        redisAsyncCommandArgv(n->ac, on_setup_reply, step_role, 1, argv, lens);
        n->setup_pending++;
    }
    argv[0] = "CLIENT";
    argv[1] = "SETNAME";
    argv[2] = "outbox-relay";
    lens[0] = 6;
    lens[1] = 7;
    lens[2] = 12;
    redisAsyncCommandArgv(n->ac, on_setup_reply, step_setname, 3, argv, lens);
    n->setup_pending++;

    /* FUNCTION LOAD is persisted and replicated, unlike the script cache;
     * REPLACE makes a reconnect after an upgrade load the new body. In a
     * cluster each primary gets it: a function lives on one node. */
    argv[0] = "FUNCTION";
    argv[1] = "LOAD";
    argv[2] = "REPLACE";
    argv[3] = outbox_functions_relay_source;
    lens[0] = 8;
    lens[1] = 4;
    lens[2] = 7;
    lens[3] = strlen(outbox_functions_relay_source);
    redisAsyncCommandArgv(n->ac, on_setup_reply, step_function, 4, argv, lens);
    n->setup_pending++;
    argv[3] = outbox_functions_consumer_source;
    lens[3] = strlen(outbox_functions_consumer_source);
    redisAsyncCommandArgv(n->ac, on_setup_reply, step_consumer_library, 4, argv, lens);
    n->setup_pending++;

    /* Redis 7 takes several parameters in one CONFIG GET. An ACL that forbids
     * CONFIG answers with an error, which is reported and not fatal. */
    const char *cargv[5] = {"CONFIG", "GET", "appendonly", "appendfsync", "maxmemory-policy"};
    size_t clens[5] = {6, 3, 10, 11, 16};
    redisAsyncCommandArgv(n->ac, on_setup_reply, step_config, 5, cargv, clens);
    n->setup_pending++;
}

/* Connects n to addr, one of its host's addresses, and queues its set-up:
 * with n->probe, AUTH and CLUSTER SLOTS only. */
static void connect_node_to(struct relay_sink *s, struct sink_node *n, const char *addr)
{
    redisAsyncContext *ac = redisAsyncConnect(addr, n->port);
    if (ac == NULL) {
        node_failed(s, "cannot connect", "out of memory");
        return;
    }
    if (ac->err) {
        char msg[400];
        snprintf(msg, sizeof(msg), "%s:%d: %s", n->host, n->port, ac->errstr);
        redisAsyncFree(ac);
        node_failed(s, "cannot connect", msg);
        return;
    }
    char why[400];
    if (start_tls(s, ac, n->host, n->port, &n->tls, why, sizeof(why)) != 0) {
        redisAsyncFree(ac);
        node_failed(s, "cannot connect", why);
        return;
    }
    ac->data = n;
    if (redisLibevAttach(s->loop, ac) != REDIS_OK) {
        redisAsyncFree(ac);
        node_failed(s, "cannot connect", "cannot attach to the event loop");
        return;
    }
    /* Attach before setting the connect callback: setting it arms the write
     * watcher that detects the connection. */
    redisAsyncSetConnectCallback(ac, on_connect);
    redisAsyncSetDisconnectCallback(ac, on_disconnect);
    n->ac = ac;
    queue_auth(n);
    if (n->probe) {
        const char *argv[2] = {"CLUSTER", "SLOTS"};
        size_t lens[2] = {7, 5};
        redisAsyncCommandArgv(ac, on_setup_reply, step_slots, 2, argv, lens);
        n->setup_pending++;
    } else {
        queue_setup(n);
    }
}

static void on_node_resolved(void *arg, int ok, const struct outbox_addrs *addrs, const char *why)
{
    struct sink_node *n = arg;
    n->lookup = NULL;
    if (!ok) {
        node_failed(n->s, "cannot connect", why);
        return;
    }
    /* The address that worked last, or after one that did not connect, the
     * next: one that does not answer costs one backoff, not every connect. */
    connect_node_to(n->s, n, addrs->addr[n->addr_turn % (unsigned)addrs->n]);
}

/* Connects n to its host and port: at once to an address, after a lookup on
 * the loop to a name (relay/lookup.h). With probe, the first connection of
 * a connect, it asks for the slot map alone. */
static void connect_node(struct relay_sink *s, struct sink_node *n, int probe)
{
    n->s = s;
    n->ready = 0;
    n->setup_pending = 0;
    n->probe = probe;
    if (outbox_host_is_address(n->host)) {
        connect_node_to(s, n, n->host);
        return;
    }
    char why[400];
    n->lookup = relay_lookup_start(s->loop, n->host, on_node_resolved, n, why, sizeof(why));
    if (n->lookup == NULL)
        node_failed(s, "cannot connect", why);
}

/* The first connection of a connect: to the primary the Sentinels named (no
 * probe: Sentinel watches single primaries), or to the next seed node. */
static void connect_first(struct relay_sink *s, const char *host, int port, int probe)
{
    struct sink_node *n = &s->nodes[0];
    snprintf(n->host, sizeof(n->host), "%s", host);
    n->port = port;
    s->cluster = 0;
    s->nnodes = 1;
    s->nready = 0;
    s->state = probe ? SINK_PROBING : SINK_CONNECTING;
    connect_node(s, n, probe);
    if (s->state == SINK_PROBING || s->state == SINK_CONNECTING)
        timer_start(s, s->cfg->connect_timeout_ms);
}

static void ask_next_sentinel(struct relay_sink *s);

/* Ends the Sentinel question in flight, if any, without its callbacks. */
static void drop_sentinel(struct relay_sink *s)
{
    redisAsyncContext *ac = s->sentinel_ac;
    s->sentinel_ac = NULL;
    relay_lookup_cancel(s->sentinel_lookup);
    s->sentinel_lookup = NULL;
    if (ac != NULL)
        redisAsyncFree(ac);
}

/* The answer to AUTH, sent to the Sentinel ahead of the question. A refusal
 * is what the question's own error (NOAUTH) reports. */
static void on_sentinel_auth(redisAsyncContext *ac, void *reply, void *privdata)
{
    struct relay_sink *s = ac->data;
    const redisReply *r = reply;
    if (s == NULL || ac != s->sentinel_ac || r == NULL || r->type != REDIS_REPLY_ERROR)
        return;
    const struct outbox_sentinels *st = &s->cfg->redis_url.sentinels;
    int at = (int)(intptr_t)privdata;
    /* The server's text never contains the password. */
    snprintf(s->sentinel_error, sizeof(s->sentinel_error),
             "Sentinel %.100s:%d: Redis refused AUTH: %.100s%s", st->addr[at].host,
             st->addr[at].port, r->str, OUTBOX_SENTINEL_AUTH_HINT);
    s->sentinel_refused_auth = 1;
}

static void on_sentinel_reply(redisAsyncContext *ac, void *reply, void *privdata)
{
    struct relay_sink *s = ac->data;
    const redisReply *r = reply;
    if (s == NULL || ac != s->sentinel_ac || s->state != SINK_RESOLVING)
        return;
    const struct outbox_sentinels *st = &s->cfg->redis_url.sentinels;
    int at = (int)(intptr_t)privdata;
    if (r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
        r->element[0]->type == REDIS_REPLY_STRING && r->element[1]->type == REDIS_REPLY_STRING &&
        r->element[0]->len > 0 && r->element[0]->len < sizeof(s->primary_host)) {
        char *end = NULL;
        long port = strtol(r->element[1]->str, &end, 10);
        if (end != NULL && *end == '\0' && port >= 1 && port <= 65535) {
            int moved = strcmp(s->primary_host, r->element[0]->str) != 0 || s->primary_port != port;
            snprintf(s->primary_host, sizeof(s->primary_host), "%s", r->element[0]->str);
            s->primary_port = (int)port;
            describe(s);
            if (moved)
                relay_info(COMPONENT, "Sentinel %s:%d names %s:%ld as the primary of %s",
                           st->addr[at].host, st->addr[at].port, s->primary_host, port, st->master);
            /* hiredis closes the context once this callback returns. */
            s->sentinel_ac = NULL;
            redisAsyncDisconnect(ac);
            ev_timer_stop(s->loop, &s->timer);
            connect_first(s, s->primary_host, s->primary_port, 0);
            return;
        }
    }
    /* The refused AUTH explains a NOAUTH; any other answer speaks for itself
     * (a Sentinel without a password refuses AUTH and answers all the same). */
    int noauth = r != NULL && r->type == REDIS_REPLY_ERROR && strncmp(r->str, "NOAUTH", 6) == 0;
    char why[300];
    if (r == NULL &&
        tls_explains(s->sentinel_tls, st->addr[at].host, st->addr[at].port,
                     ac->errstr[0] ? ac->errstr : "closed the connection", 1, why, sizeof(why)))
        snprintf(s->sentinel_error, sizeof(s->sentinel_error), "Sentinel %.280s", why);
    else if (!(s->sentinel_refused_auth && noauth))
        outbox_sentinel_describe(s->sentinel_error, sizeof(s->sentinel_error), st->addr[at].host,
                                 st->addr[at].port, r,
                                 ac->errstr[0] ? ac->errstr : "closed the connection");
    s->sentinel_ac = NULL;
    if (r != NULL)
        redisAsyncDisconnect(ac);
    ev_timer_stop(s->loop, &s->timer);
    ask_next_sentinel(s);
}

static void on_sentinel_connect(const redisAsyncContext *ac, int status)
{
    struct relay_sink *s = ac->data;
    if (s == NULL || ac != s->sentinel_ac || status == REDIS_OK)
        return;
    /* hiredis frees the context after this callback. */
    const struct outbox_sentinels *st = &s->cfg->redis_url.sentinels;
    int at = s->sentinel_next - 1;
    char why[300];
    io_failure(s->sentinel_tls, st->addr[at].host, st->addr[at].port,
               ac->c.errstr[0] ? ac->c.errstr : "connect failed", 1, why, sizeof(why));
    snprintf(s->sentinel_error, sizeof(s->sentinel_error), "Sentinel %.280s", why);
    s->sentinel_ac = NULL;
    s->sentinel_addr_turn++; /* a named Sentinel's next address, next time */
    ev_timer_stop(s->loop, &s->timer);
    ask_next_sentinel(s);
}

static void on_sentinel_disconnect(const redisAsyncContext *ac, int status)
{
    struct relay_sink *s = ac->data;
    (void)status;
    if (s == NULL || ac != s->sentinel_ac)
        return;
    s->sentinel_ac = NULL;
    ev_timer_stop(s->loop, &s->timer);
    ask_next_sentinel(s);
}

static int ask_sentinel_at(struct relay_sink *s, int at, const char *addr);

static void on_sentinel_resolved(void *arg, int ok, const struct outbox_addrs *addrs,
                                 const char *why)
{
    struct relay_sink *s = arg;
    const struct outbox_sentinels *st = &s->cfg->redis_url.sentinels;
    int at = s->sentinel_next - 1;
    s->sentinel_lookup = NULL;
    ev_timer_stop(s->loop, &s->timer);
    if (!ok)
        snprintf(s->sentinel_error, sizeof(s->sentinel_error), "Sentinel %.100s:%d: %.170s",
                 st->addr[at].host, st->addr[at].port, why);
    if (!ok || ask_sentinel_at(s, at, addrs->addr[s->sentinel_addr_turn % (unsigned)addrs->n]))
        ask_next_sentinel(s);
}

/* Asks the next Sentinel of the list for the primary (after looking its
 * name up, on the loop); after the last one, the sink goes down and the
 * whole list is asked again after a backoff. */
static void ask_next_sentinel(struct relay_sink *s)
{
    const struct outbox_sentinels *st = &s->cfg->redis_url.sentinels;
    while (s->sentinel_next < st->n) {
        int at = s->sentinel_next++;
        if (!outbox_host_is_address(st->addr[at].host)) {
            char why[300];
            s->sentinel_lookup = relay_lookup_start(s->loop, st->addr[at].host,
                                                    on_sentinel_resolved, s, why, sizeof(why));
            if (s->sentinel_lookup == NULL) {
                snprintf(s->sentinel_error, sizeof(s->sentinel_error), "Sentinel %.100s:%d: %.170s",
                         st->addr[at].host, st->addr[at].port, why);
                continue;
            }
            s->state = SINK_RESOLVING;
            timer_start(s, s->cfg->connect_timeout_ms);
            return;
        }
        if (ask_sentinel_at(s, at, st->addr[at].host) == 0)
            return;
    }
    char msg[1000];
    snprintf(msg, sizeof(msg),
             "no Sentinel named the primary of master \"%.128s\" (%d asked; last: %s): check "
             "redis_sentinel and redis_master, and that the Sentinels are up",
             st->master, st->n, s->sentinel_error[0] ? s->sentinel_error : "out of memory");
    went_down(s, "cannot find the primary", msg);
}

/* Connects to Sentinel number at, at addr, and asks it for the primary: 0,
 * or -1 with sentinel_error set (out of memory leaves it as it was). */
static int ask_sentinel_at(struct relay_sink *s, int at, const char *addr)
{
    const struct outbox_sentinels *st = &s->cfg->redis_url.sentinels;
    redisAsyncContext *ac = redisAsyncConnect(addr, st->addr[at].port);
    if (ac == NULL)
        return -1;
    char why[300] = "";
    if (ac->err ||
        start_tls(s, ac, st->addr[at].host, st->addr[at].port, &s->sentinel_tls, why,
                  sizeof(why)) ||
        redisLibevAttach(s->loop, ac) != REDIS_OK) {
        snprintf(s->sentinel_error, sizeof(s->sentinel_error), "Sentinel %.100s:%d: %.170s",
                 st->addr[at].host, st->addr[at].port,
                 ac->err  ? ac->errstr
                 : why[0] ? why
                          : "cannot attach to the event loop");
        redisAsyncFree(ac);
        return -1;
    }
    ac->data = s;
    redisAsyncSetConnectCallback(ac, on_sentinel_connect);
    redisAsyncSetDisconnectCallback(ac, on_sentinel_disconnect);
    s->sentinel_ac = ac;
    s->state = SINK_RESOLVING;
    s->sentinel_refused_auth = 0;
    if (st->password[0] != '\0') {
        /* AUTH [user] password, pipelined ahead of the question. */
        const char *auth[3] = {"AUTH", st->user, st->password};
        size_t auth_lens[3] = {4, strlen(st->user), strlen(st->password)};
        int no_user = st->user[0] == '\0';
        if (no_user) {
            auth[1] = auth[2];
            auth_lens[1] = auth_lens[2];
        }
        redisAsyncCommandArgv(ac, on_sentinel_auth, (void *)(intptr_t)at, 3 - no_user, auth,
                              auth_lens);
    }
    const char *argv[3] = {"SENTINEL", "get-master-addr-by-name", st->master};
    size_t lens[3] = {8, 23, strlen(st->master)};
    redisAsyncCommandArgv(ac, on_sentinel_reply, (void *)(intptr_t)at, 3, argv, lens);
    timer_start(s, s->cfg->connect_timeout_ms);
    return 0;
}

static void start_connect(struct relay_sink *s)
{
    const struct outbox_redis_url *u = &s->cfg->redis_url;
    if (u->sentinels.n > 0) {
        s->sentinel_next = 0;
        s->sentinel_error[0] = '\0';
        ask_next_sentinel(s);
        return;
    }
    /* Each connect starts at the next seed node: one that is down costs
     * one backoff, not every connect. */
    int seeds = u->nseeds > 0 ? u->nseeds : 1;
    const struct outbox_addr *seed = &u->seeds[s->seed_next++ % seeds];
    if (u->nseeds == 0)
        connect_first(s, u->host, u->port, 1);
    else
        connect_first(s, seed->host, seed->port, 1);
}

static void on_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay_sink *s = w->data;
    (void)loop;
    (void)revents;
    if (s->state == SINK_DOWN) {
        start_connect(s);
    } else if (s->state == SINK_RESOLVING) {
        const struct outbox_sentinels *st = &s->cfg->redis_url.sentinels;
        int at = s->sentinel_next - 1;
        if (s->sentinel_lookup != NULL)
            snprintf(s->sentinel_error, sizeof(s->sentinel_error),
                     "Sentinel %.100s:%d: cannot resolve %.100s: " OUTBOX_NO_DNS_ANSWER,
                     st->addr[at].host, st->addr[at].port, st->addr[at].host,
                     s->cfg->connect_timeout_ms);
        else
            snprintf(s->sentinel_error, sizeof(s->sentinel_error),
                     "Sentinel %.100s:%d: no answer within connect_timeout (%u ms)",
                     st->addr[at].host, st->addr[at].port, s->cfg->connect_timeout_ms);
        drop_sentinel(s);
        ask_next_sentinel(s);
    } else if (s->state == SINK_PROBING || s->state == SINK_CONNECTING) {
        char msg[400];
        snprintf(msg, sizeof(msg), "not connected and set up within connect_timeout (%u ms)",
                 s->cfg->connect_timeout_ms);
        for (int i = 0; i < s->nnodes; i++) {
            /* The next address next time, for a node whose connect did
             * not finish; one still looking its name up tried none. */
            s->nodes[i].addr_turn += !s->nodes[i].ready && s->nodes[i].ac != NULL;
            if (s->nodes[i].lookup != NULL)
                snprintf(msg, sizeof(msg), "cannot resolve %.200s: " OUTBOX_NO_DNS_ANSWER,
                         s->nodes[i].host, s->cfg->connect_timeout_ms);
        }
        node_failed(s, "cannot connect", msg);
    }
}

struct relay_sink *relay_sink_new(struct ev_loop *loop, const struct relay_config *cfg,
                                  const struct relay_sink_hooks *hooks)
{
    struct relay_sink *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->loop = loop;
    s->cfg = cfg;
    if (hooks != NULL)
        s->hooks = *hooks;
    outbox_backoff_init(&s->backoff, cfg->reconnect_min_ms, cfg->reconnect_max_ms);
    ev_init(&s->timer, on_timer);
    s->timer.data = s;
    describe(s);
    start_connect(s);
    return s;
}

void relay_sink_free(struct relay_sink *s)
{
    if (s == NULL)
        return;
    ev_timer_stop(s->loop, &s->timer);
    s->hooks.on_down = NULL;
    s->hooks.on_ready = NULL;
    drop_sentinel(s);
    drop_nodes(s);
    free(s);
}
