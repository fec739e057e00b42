/*
 * The one Redis connect (common/redisconn.h).
 */
#include "common/compat.h"

#include "common/redisconn.h"

#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>

#include "common/keys.h"
#include "common/resolve.h"
#include "common/tls.h"
#include "common/url.h"
#include "common/wait.h"

/* Marks the context failed, as hiredis does, so the caller drops it. */
static void call_failed(redisContext *c, enum outbox_wait w, uint32_t timeout_ms)
{
    c->err = REDIS_ERR_IO;
    if (w == OUTBOX_WAIT_DEADLINE)
        snprintf(c->errstr, sizeof(c->errstr), "no answer within %u ms", timeout_ms);
    else
        snprintf(c->errstr, sizeof(c->errstr), "stopped");
}

static redisReply *vcall(redisContext *c, int stop_fd, uint32_t timeout_ms, const char *fmt,
                         va_list ap)
{
    if (c->err)
        return NULL;
    if (redisvAppendCommand(c, fmt, ap) != REDIS_OK)
        return NULL;
    double deadline = outbox_mono_now() + timeout_ms / 1000.0;
    enum outbox_wait w;
    int done = 0;
    for (;;) {
        if (redisBufferWrite(c, &done) != REDIS_OK)
            return NULL;
        if (done)
            break;
        if ((w = outbox_wait_fd(c->fd, POLLOUT, stop_fd, deadline)) != OUTBOX_WAIT_READY) {
            call_failed(c, w, timeout_ms);
            return NULL;
        }
    }
    for (;;) {
        void *reply = NULL;
        if (redisGetReplyFromReader(c, &reply) != REDIS_OK)
            return NULL;
        if (reply != NULL)
            return reply;
        if ((w = outbox_wait_fd(c->fd, POLLIN, stop_fd, deadline)) != OUTBOX_WAIT_READY) {
            call_failed(c, w, timeout_ms);
            return NULL;
        }
        if (redisBufferRead(c) != REDIS_OK)
            return NULL;
    }
}

redisReply *outbox_redis_call(redisContext *c, int stop_fd, uint32_t timeout_ms, const char *fmt,
                              ...)
{
    va_list ap;
    va_start(ap, fmt);
    redisReply *r = vcall(c, stop_fd, timeout_ms, fmt, ap);
    va_end(ap);
    return r;
}

static enum outbox_redis_fault io_fault(const redisContext *c)
{
    return strcmp(c->errstr, "stopped") == 0 ? OUTBOX_REDIS_STOPPED : OUTBOX_REDIS_IO;
}

/* Runs one set-up command; 0, or -1 with err and fault set. */
static int setup(redisContext *c, int stop_fd, uint32_t timeout_ms, const char *what,
                 const char *hint, char *err, size_t errlen, enum outbox_redis_fault *fault,
                 const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    redisReply *r = vcall(c, stop_fd, timeout_ms, fmt, ap);
    va_end(ap);
    if (r == NULL) {
        *fault = io_fault(c);
        snprintf(err, errlen, "%s: %s", what, c->errstr[0] ? c->errstr : "no reply");
        return -1;
    }
    int rc = 0;
    if (r->type == REDIS_REPLY_ERROR) {
        /* The server's text never contains the password. */
        *fault = OUTBOX_REDIS_REFUSED;
        snprintf(err, errlen, "Redis refused %s: %.200s%s", what, r->str, hint);
        rc = -1;
    }
    freeReplyObject(r);
    return rc;
}

/* A set-up command's connection lost: what TLS makes of it (with TLS 1.3 a
 * server that wants a client certificate ends the connection only after the
 * handshake, at the first command), in err. */
static void setup_lost(const struct ssl_st *session, const struct outbox_redis_url *u,
                       enum outbox_redis_fault fault, char *err, size_t errlen)
{
#if OUTBOX_TLS
    if (session == NULL || fault != OUTBOX_REDIS_IO)
        return;
    char text[256];
    snprintf(text, sizeof(text), "%s", err);
    (void)outbox_tls_failure(session, u->host, u->port, text, 1, err, errlen);
#else
    (void)session;
    (void)u;
    (void)fault;
    (void)err;
    (void)errlen;
#endif
}

/* Waits for the non-blocking connect: 0, or -1 with err and fault set. */
static int connected(redisContext *c, const struct outbox_redis_url *u, uint32_t timeout_ms,
                     int stop_fd, char *err, size_t errlen, enum outbox_redis_fault *fault)
{
    enum outbox_wait w =
        outbox_wait_fd(c->fd, POLLOUT, stop_fd, outbox_mono_now() + timeout_ms / 1000.0);
    int soerr = 0;
    socklen_t len = sizeof(soerr);
    if (w == OUTBOX_WAIT_READY && getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == 0 &&
        soerr == 0)
        return 0;
    *fault = w == OUTBOX_WAIT_STOPPED ? OUTBOX_REDIS_STOPPED : OUTBOX_REDIS_IO;
    if (w == OUTBOX_WAIT_DEADLINE)
        snprintf(err, errlen, "cannot connect to Redis at %.100s:%d: no connection within %u ms",
                 u->host, u->port, timeout_ms);
    else if (w == OUTBOX_WAIT_STOPPED)
        snprintf(err, errlen, "stopped");
    else
        snprintf(err, errlen, "cannot connect to Redis at %.100s:%d: %.100s", u->host, u->port,
                 strerror(soerr != 0 ? soerr : errno));
    return -1;
}

/* Turns the connected context into a blocking one whose commands wait at
 * most timeout_ms, as redisConnectWithTimeout leaves it once connected. */
static int make_blocking(redisContext *c, uint32_t timeout_ms)
{
    int fl = fcntl(c->fd, F_GETFL);
    if (fl < 0 || fcntl(c->fd, F_SETFL, fl & ~O_NONBLOCK) < 0)
        return -1;
    c->flags |= REDIS_BLOCK;
    struct timeval tv = {.tv_sec = timeout_ms / 1000,
                         .tv_usec = (suseconds_t)(timeout_ms % 1000) * 1000};
    return redisSetTimeout(c, tv) == REDIS_OK ? 0 : -1;
}

static int open_steps(redisContext *c, const struct outbox_redis_url *u,
                      uint32_t connect_timeout_ms, uint32_t command_timeout_ms, int stop_fd,
                      char *err, size_t errlen, enum outbox_redis_fault *fault, int *reached)
{
    if (connected(c, u, connect_timeout_ms, stop_fd, err, errlen, fault) < 0)
        return -1;
    *reached = 1;
    struct ssl_st *session = NULL;
#if OUTBOX_TLS
    if (u->tls.on) {
        if (outbox_tls_handshake(c, u, u->host, u->port,
                                 outbox_mono_now() + connect_timeout_ms / 1000.0, &session, err,
                                 errlen) != 0) {
            *fault = OUTBOX_REDIS_IO;
            return -1;
        }
    }
#endif
    (void)redisEnableKeepAlive(c); /* a dead peer is noticed between commands too */
    static const char auth_hint[] = " (check the user and password of the Redis URL)";
    if ((u->password[0] != '\0' &&
         (u->user[0] != '\0' ? setup(c, stop_fd, connect_timeout_ms, "AUTH", auth_hint, err, errlen,
                                     fault, "AUTH %s %s", u->user, u->password)
                             : setup(c, stop_fd, connect_timeout_ms, "AUTH", auth_hint, err, errlen,
                                     fault, "AUTH %s", u->password)) < 0) ||
        (u->db != 0 && setup(c, stop_fd, connect_timeout_ms, "SELECT", "", err, errlen, fault,
                             "SELECT %d", u->db) < 0)) {
        setup_lost(session, u, *fault, err, errlen);
        return -1;
    }
    if (stop_fd < 0 && make_blocking(c, command_timeout_ms) < 0) {
        *fault = OUTBOX_REDIS_IO;
        snprintf(err, errlen, "cannot set the command deadline: %s", strerror(errno));
        return -1;
    }
    return 0;
}

static redisContext *open_url(const struct outbox_redis_url *u, uint32_t connect_timeout_ms,
                              uint32_t command_timeout_ms, int stop_fd, char *err, size_t errlen,
                              enum outbox_redis_fault *fault);
static redisContext *open_address(const struct outbox_redis_url *u, const char *addr,
                                  uint32_t connect_timeout_ms, uint32_t command_timeout_ms,
                                  int stop_fd, char *err, size_t errlen,
                                  enum outbox_redis_fault *fault, int *reached);

/* Reads a "host, port" pair of strings into primary's host and port: 0, or -1. */
static int take_address(const redisReply *r, struct outbox_redis_url *primary)
{
    if (r == NULL || r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
        r->element[0]->type != REDIS_REPLY_STRING || r->element[1]->type != REDIS_REPLY_STRING ||
        r->element[0]->len == 0 || r->element[0]->len >= sizeof(primary->host))
        return -1;
    uint64_t port;
    const char *end;
    if (outbox_parse_digits(r->element[1]->str, &port, &end) != 0 || *end != '\0' || port < 1 ||
        port > 65535)
        return -1;
    memcpy(primary->host, r->element[0]->str, r->element[0]->len + 1);
    primary->port = (int)port;
    return 0;
}

void outbox_sentinel_describe(char *out, size_t outlen, const char *host, int port,
                              const redisReply *r, const char *lost)
{
    int error = r != NULL && r->type == REDIS_REPLY_ERROR;
    snprintf(out, outlen, "Sentinel %.100s:%d %.110s%s", host, port,
             r == NULL                    ? lost
             : error                      ? r->str
             : r->type == REDIS_REPLY_NIL ? "knows no master of that name"
                                          : "gave an unexpected reply",
             error && strncmp(r->str, "NOAUTH", 6) == 0 ? OUTBOX_SENTINEL_AUTH_HINT : "");
}

/* AUTH on a Sentinel, when they have a password: 0, or -1 with err and fault. */
static int sentinel_auth(redisContext *c, const struct outbox_sentinels *st, int stop_fd,
                         uint32_t timeout_ms, char *err, size_t errlen,
                         enum outbox_redis_fault *fault)
{
    if (st->password[0] == '\0')
        return 0;
    if (st->user[0] != '\0')
        return setup(c, stop_fd, timeout_ms, "AUTH", OUTBOX_SENTINEL_AUTH_HINT, err, errlen, fault,
                     "AUTH %s %s", st->user, st->password);
    return setup(c, stop_fd, timeout_ms, "AUTH", OUTBOX_SENTINEL_AUTH_HINT, err, errlen, fault,
                 "AUTH %s", st->password);
}

/*
 * Asks each Sentinel in turn for the primary of u's master: primary becomes u
 * with that host and port and no Sentinel. 0, or -1 with err and fault.
 */
static int ask_sentinels(const struct outbox_redis_url *u, uint32_t connect_timeout_ms, int stop_fd,
                         struct outbox_redis_url *primary, char *err, size_t errlen,
                         enum outbox_redis_fault *fault)
{
    char last[300] = "";
    for (int i = 0; i < u->sentinels.n; i++) {
        struct outbox_redis_url at;
        memset(&at, 0, sizeof(at));
        at.tls = u->tls; /* rediss://: the Sentinels speak TLS too */
        snprintf(at.host, sizeof(at.host), "%s", u->sentinels.addr[i].host);
        at.port = u->sentinels.addr[i].port;
        char why[256];
        redisContext *c =
            open_url(&at, connect_timeout_ms, connect_timeout_ms, stop_fd, why, sizeof(why), fault);
        if (c == NULL) {
            if (*fault == OUTBOX_REDIS_STOPPED || *fault == OUTBOX_REDIS_NOMEM) {
                snprintf(err, errlen, "%s", why);
                return -1;
            }
            snprintf(last, sizeof(last), "%s", why);
            continue;
        }
        /* A refused AUTH is reported if the question fails with NOAUTH; a
         * Sentinel without a password refuses it and answers all the same. */
        int refused = 0;
        if (sentinel_auth(c, &u->sentinels, stop_fd, connect_timeout_ms, why, sizeof(why), fault) !=
            0) {
            if (*fault != OUTBOX_REDIS_REFUSED) {
                redisFree(c);
                if (*fault == OUTBOX_REDIS_STOPPED || *fault == OUTBOX_REDIS_NOMEM) {
                    snprintf(err, errlen, "%s", why);
                    return -1;
                }
                snprintf(last, sizeof(last), "Sentinel %.100s:%d: %.180s", at.host, at.port, why);
                continue;
            }
            refused = 1;
        }
        redisReply *r =
            outbox_redis_call(c, stop_fd, connect_timeout_ms, "SENTINEL get-master-addr-by-name %s",
                              u->sentinels.master);
        *primary = *u;
        primary->sentinels.n = 0;
        int ok = take_address(r, primary) == 0;
        int noauth = r != NULL && r->type == REDIS_REPLY_ERROR && strncmp(r->str, "NOAUTH", 6) == 0;
        if (!ok && refused && noauth)
            snprintf(last, sizeof(last), "Sentinel %.100s:%d: %.180s", at.host, at.port, why);
        else if (!ok)
            outbox_sentinel_describe(last, sizeof(last), at.host, at.port, r, c->errstr);
        if (r != NULL)
            freeReplyObject(r);
        redisFree(c);
        if (ok)
            return 0;
    }
    *fault = OUTBOX_REDIS_IO;
    snprintf(err, errlen,
             "no Sentinel named the primary of master \"%.128s\" (%d asked; last: %.300s): check "
             "redis_sentinel and redis_master, and that the Sentinels are up",
             u->sentinels.master, u->sentinels.n, last);
    return -1;
}

int outbox_cluster_slots_parse(const redisReply *r, const char *default_host,
                               struct outbox_addr *primaries, int max, uint8_t *slot_node)
{
    if (r == NULL || r->type != REDIS_REPLY_ARRAY)
        return -2;
    if (slot_node != NULL)
        memset(slot_node, OUTBOX_SLOT_UNCOVERED, OUTBOX_CLUSTER_SLOTS);
    int count = 0;
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
            e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
            e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
            continue;
        long long lo = e->element[0]->integer, hi = e->element[1]->integer;
        const char *host = e->element[2]->element[0]->str;
        long long port = e->element[2]->element[1]->integer;
        if (lo < 0 || hi >= OUTBOX_CLUSTER_SLOTS || lo > hi || port < 1 || port > 65535)
            continue;
        /* An empty or "?" host: the node asked reaches it at its own address. */
        if (host[0] == '\0' || strcmp(host, "?") == 0)
            host = default_host;
        int at = 0;
        while (at < count && !(primaries[at].port == port && strcmp(primaries[at].host, host) == 0))
            at++;
        if (at == count) {
            if (count == max)
                return -1;
            snprintf(primaries[count].host, sizeof(primaries[count].host), "%s", host);
            primaries[count].port = (int)port;
            count++;
        }
        if (slot_node != NULL)
            memset(slot_node + lo, at, (size_t)(hi - lo + 1));
    }
    return count;
}

/* Most primaries the blocking helpers below take from a slot map. */
#define PRIMARIES_MAX 64

/* c, connected to at, or (c freed) a connection to the primary of key's
 * slot when at is a node of a cluster whose map puts the slot elsewhere. */
static redisContext *relay_redis_route(redisContext *c, struct outbox_redis_url *at,
                                       const char *key, uint32_t connect_timeout_ms,
                                       uint32_t command_timeout_ms, int stop_fd, char *err,
                                       size_t errlen, enum outbox_redis_fault *fault)
{
    redisReply *r = outbox_redis_call(c, stop_fd, connect_timeout_ms, "CLUSTER SLOTS");
    struct outbox_addr *primaries = calloc(PRIMARIES_MAX, sizeof(*primaries));
    uint8_t *slot_node = malloc(OUTBOX_CLUSTER_SLOTS);
    int n = primaries != NULL && slot_node != NULL
                ? outbox_cluster_slots_parse(r, at->host, primaries, PRIMARIES_MAX, slot_node)
                : -2;
    unsigned node = n > 0 ? slot_node[outbox_key_slot(key, strlen(key))] : OUTBOX_SLOT_UNCOVERED;
    int elsewhere = node != OUTBOX_SLOT_UNCOVERED && !(primaries[node].port == at->port &&
                                                       strcmp(primaries[node].host, at->host) == 0);
    if (elsewhere) {
        snprintf(at->host, sizeof(at->host), "%s", primaries[node].host);
        at->port = primaries[node].port;
    }
    if (r != NULL)
        freeReplyObject(r);
    free(primaries);
    free(slot_node);
    /* Not a cluster, or the slot is here (or uncovered: the first command
     * will say so). */
    if (!elsewhere)
        return c;
    redisFree(c);
    return open_url(at, connect_timeout_ms, command_timeout_ms, stop_fd, err, errlen, fault);
}

redisContext *outbox_redis_open_for_key(const struct outbox_redis_url *u, const char *key,
                                        uint32_t connect_timeout_ms, uint32_t command_timeout_ms,
                                        int stop_fd, char *err, size_t errlen,
                                        enum outbox_redis_fault *fault)
{
    if (u->sentinels.n > 0) /* Sentinel watches single primaries */
        return outbox_redis_open(u, connect_timeout_ms, command_timeout_ms, stop_fd, err, errlen,
                                 fault);
    redisContext *c = NULL;
    struct outbox_redis_url at = *u;
    for (int i = 0; i < u->nseeds && c == NULL; i++) {
        snprintf(at.host, sizeof(at.host), "%s", u->seeds[i].host);
        at.port = u->seeds[i].port;
        c = open_url(&at, connect_timeout_ms, command_timeout_ms, stop_fd, err, errlen, fault);
        if (c == NULL && (*fault == OUTBOX_REDIS_STOPPED || *fault == OUTBOX_REDIS_NOMEM))
            return NULL;
    }
    if (c == NULL)
        return NULL;
    return relay_redis_route(c, &at, key, connect_timeout_ms, command_timeout_ms, stop_fd, err,
                             errlen, fault);
}

int outbox_redis_each_primary(redisContext *c, const struct outbox_redis_url *u,
                              uint32_t connect_timeout_ms, uint32_t command_timeout_ms, int stop_fd,
                              int (*fn)(redisContext *node, void *arg), void *arg, char *err,
                              size_t errlen)
{
    redisReply *r = outbox_redis_call(c, stop_fd, command_timeout_ms, "CLUSTER SLOTS");
    if (r == NULL) {
        snprintf(err, errlen, "CLUSTER SLOTS: %s", c->errstr);
        return -1;
    }
    struct outbox_addr *primaries = calloc(PRIMARIES_MAX, sizeof(*primaries));
    if (primaries == NULL) {
        freeReplyObject(r);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int count = outbox_cluster_slots_parse(r, u->host, primaries, PRIMARIES_MAX, NULL);
    freeReplyObject(r);
    int rc = 0;
    if (count == -2) {
        rc = fn(c, arg); /* not a cluster */
    } else if (count < 0) {
        snprintf(err, errlen, "the cluster has more than %d primaries", PRIMARIES_MAX);
        rc = -1;
    }
    for (int i = 0; i < count && rc == 0; i++) {
        struct outbox_redis_url at = *u;
        memset(&at.sentinels, 0, sizeof(at.sentinels));
        snprintf(at.host, sizeof(at.host), "%s", primaries[i].host);
        at.port = primaries[i].port;
        enum outbox_redis_fault fault;
        redisContext *node =
            open_url(&at, connect_timeout_ms, command_timeout_ms, stop_fd, err, errlen, &fault);
        if (node == NULL) {
            rc = -1;
            break;
        }
        rc = fn(node, arg);
        redisFree(node);
    }
    free(primaries);
    return rc;
}

redisContext *outbox_redis_open(const struct outbox_redis_url *u, uint32_t connect_timeout_ms,
                                uint32_t command_timeout_ms, int stop_fd, char *err, size_t errlen,
                                enum outbox_redis_fault *fault)
{
    *fault = OUTBOX_REDIS_OK;
    if (u->sentinels.n == 0)
        return open_url(u, connect_timeout_ms, command_timeout_ms, stop_fd, err, errlen, fault);
    struct outbox_redis_url primary;
    if (ask_sentinels(u, connect_timeout_ms, stop_fd, &primary, err, errlen, fault) != 0)
        return NULL;
    redisContext *c =
        open_url(&primary, connect_timeout_ms, command_timeout_ms, stop_fd, err, errlen, fault);
    if (c == NULL)
        return NULL;
    /* Between a failover and the Sentinels' next answer, the address can
     * still be the old primary's, now a replica. */
    redisReply *r = outbox_redis_call(c, stop_fd, connect_timeout_ms, "ROLE");
    int primary_role = r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements > 0 &&
                       r->element[0]->type == REDIS_REPLY_STRING &&
                       strcmp(r->element[0]->str, "master") == 0;
    if (r != NULL)
        freeReplyObject(r);
    if (!primary_role) {
        *fault = OUTBOX_REDIS_IO;
        snprintf(err, errlen,
                 "%.100s:%d, which the Sentinels name as the primary of \"%.128s\", is not a "
                 "primary (yet): try again in a moment",
                 primary.host, primary.port, u->sentinels.master);
        redisFree(c);
        return NULL;
    }
    return c;
}

static redisContext *open_url(const struct outbox_redis_url *u, uint32_t connect_timeout_ms,
                              uint32_t command_timeout_ms, int stop_fd, char *err, size_t errlen,
                              enum outbox_redis_fault *fault)
{
    *fault = OUTBOX_REDIS_OK;
    /* The name is looked up here, within connect_timeout and ended by the
     * stop; hiredis would call getaddrinfo, which blocks for the resolver's
     * own timeouts. The rest of connect_timeout is the connect's. */
    double started = outbox_mono_now();
    struct outbox_addrs addrs;
    if (outbox_resolve(u->host, connect_timeout_ms, stop_fd, &addrs, err, errlen) != 0) {
        *fault = strcmp(err, "stopped") == 0 ? OUTBOX_REDIS_STOPPED : OUTBOX_REDIS_IO;
        return NULL;
    }
    /* Each address in turn (IPv4 first) while none accepts the connection:
     * past that, what failed (TLS, AUTH) is the server's answer. */
    redisContext *c = NULL;
    int reached = 0;
    for (int i = 0; i < addrs.n && c == NULL && !reached; i++) {
        uint32_t spent_ms = (uint32_t)((outbox_mono_now() - started) * 1000.0);
        if (i > 0 && (*fault != OUTBOX_REDIS_IO || spent_ms >= connect_timeout_ms))
            break;
        uint32_t left_ms = spent_ms < connect_timeout_ms ? connect_timeout_ms - spent_ms : 1;
        c = open_address(u, addrs.addr[i], left_ms, command_timeout_ms, stop_fd, err, errlen, fault,
                         &reached);
    }
    return c;
}

/* open_url's connect to one of the host's addresses. */
static redisContext *open_address(const struct outbox_redis_url *u, const char *addr,
                                  uint32_t connect_timeout_ms, uint32_t command_timeout_ms,
                                  int stop_fd, char *err, size_t errlen,
                                  enum outbox_redis_fault *fault, int *reached)
{
    *fault = OUTBOX_REDIS_OK;
    redisContext *c = redisConnectNonBlock(addr, u->port);
    if (c == NULL) {
        *fault = OUTBOX_REDIS_NOMEM;
        snprintf(err, errlen, "cannot connect to Redis: out of memory");
        return NULL;
    }
    if (c->err || open_steps(c, u, connect_timeout_ms, command_timeout_ms, stop_fd, err, errlen,
                             fault, reached) < 0) {
        if (c->err && *fault == OUTBOX_REDIS_OK) {
            *fault = OUTBOX_REDIS_IO;
            snprintf(err, errlen, "cannot connect to Redis at %.100s:%d: %s", u->host, u->port,
                     c->errstr);
        }
        redisFree(c);
        return NULL;
    }
    return c;
}

/* ---- commands and replies --------------------------------------------- */

unsigned outbox_redis_command_slot(const char *cmd, size_t len)
{
    const char *p = cmd, *end = cmd + len;
    const char *arg[4] = {NULL};
    size_t alen[4] = {0};
    /* "*<n>\r\n" */
    p = memchr(p, '\n', (size_t)(end - p));
    if (p == NULL)
        return 0;
    p++;
    for (int i = 0; i < 4 && p < end && *p == '$'; i++) {
        char *q;
        unsigned long n = strtoul(p + 1, &q, 10);
        if (q + 2 > end || q[0] != '\r' || n > (size_t)(end - q - 2))
            return 0;
        arg[i] = q + 2;
        alen[i] = n;
        p = q + 2 + n + 2;
    }
    if (arg[0] == NULL || arg[1] == NULL)
        return 0;
    if (alen[0] >= 5 && strncasecmp(arg[0], "FCALL", 5) == 0) {
        if (arg[3] == NULL || arg[2] == NULL || (alen[2] == 1 && arg[2][0] == '0'))
            return 0;
        return outbox_key_slot(arg[3], alen[3]);
    }
    return outbox_key_slot(arg[1], alen[1]);
}

static redisReply *reply_copy(const redisReply *r, int depth)
{
    redisReply *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->type = r->type;
    c->integer = r->integer;
    if (r->str != NULL) {
        c->str = malloc(r->len + 1);
        if (c->str == NULL) {
            free(c);
            return NULL;
        }
        memcpy(c->str, r->str, r->len);
        c->str[r->len] = '\0';
        c->len = r->len;
    }
    if (r->type == REDIS_REPLY_ARRAY && r->elements > 0) {
        /* An array of reply pointers. */
        c->element =
            calloc(r->elements, sizeof(redisReply *)); // NOLINT(bugprone-sizeof-expression)
        if (c->element == NULL || depth > 8) {
            freeReplyObject(c);
            return NULL;
        }
        c->elements = r->elements;
        for (size_t i = 0; i < r->elements; i++) {
            c->element[i] = reply_copy(r->element[i], depth + 1);
            if (c->element[i] == NULL) {
                freeReplyObject(c);
                return NULL;
            }
        }
    }
    return c;
}

redisReply *outbox_redis_reply_copy(const redisReply *r)
{
    return reply_copy(r, 0);
}
