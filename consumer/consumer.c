/*
 * The consumer library (include/outbox/consumer.h): a consumer group reader
 * that gives handlers retries with backoff, dead letters and take-over of the
 * entries of consumers that died.
 *
 * Redis keeps everything that matters: an entry stays in the group's pending
 * list (PEL) until it is acknowledged, with its delivery count and the time
 * since its last delivery ("idle"). So a retry is simply "do not acknowledge":
 * the reclaim pass lists pending entries with XPENDING, and any entry whose
 * idle time has reached the backoff for its delivery count is taken with
 * XCLAIM (which re-checks the idle time on the server, so two consumers never
 * take the same entry, and counts one more delivery). A consumer that died
 * leaves its entries pending; the living ones take them over the same way.
 *
 * Dead letters go through a Redis function, loaded on every connect, that adds
 * the dead letter (XADD) and acknowledges the entry (XACK) only if the add
 * succeeded, so an entry is never both gone and not recorded. MULTI/EXEC
 * cannot promise that: Redis does not roll a transaction back, so an XADD
 * refused at EXEC (the dead-letter key holding a string) still let the XACK
 * run. A refused dead letter leaves the entry pending; a later pass delivers
 * it again and dead-letters it once the cause is fixed.
 *
 * XCLAIM in Redis 7.0 drops pending entries that were deleted or trimmed from
 * the stream instead of returning them; those are recorded as "lost".
 *
 * hiredis's blocking API is the right tool here: the library owns the thread
 * while it runs, every call has a socket deadline (redisSetTimeout), and the
 * blocking read lives on a connection of its own so acknowledgements and
 * claims are never queued behind it.
 *
 * Nothing here prints: events go to the caller's log hook (none: silent), and
 * the most recent failure stays in the object, in err and errstr, with its
 * kind decided where it happens.
 */
#include "common/compat.h"

#include "outbox/consumer.h"
#include "consumer/order.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "common/backoff.h"
#include "common/entry.h"
#include "common/functions.h"
#include "common/keys.h"
#include "common/redisconn.h"
#include "common/common.h"
#include "common/url.h"

#define RECLAIM_BATCH 64
/* The entries an ordered consumer holds in hand per partition, at most. */
#define ORDER_QUEUE_MAX 256
#define NAME_MAX_LEN 512
/* Longest line given to the log hook; longer text is cut and ends in "...". */
#define LOG_LINE_MAX 2048

static const uint32_t default_backoff[] = {1000, 10000, 100000, 1000000};

/* Most primaries of a cluster the ordered mode holds connections to. */
#define CONSUMER_NODES_MAX 32

struct outbox_consumer {
    struct outbox_consumer_options o;
    char stream[NAME_MAX_LEN];
    char group[NAME_MAX_LEN];
    char consumer[NAME_MAX_LEN];
    char dlq[2 * NAME_MAX_LEN + 16];
    char replay[2 * NAME_MAX_LEN + 16];
    struct outbox_redis_url url;
    outbox_consumer_handler_fn *handler;
    void *arg;

    redisContext *rd; /* XREADGROUP BLOCK */
    redisContext *wr; /* everything else; in the ordered mode, one of node[] */
    /* The ordered mode's connections, one per primary its partitions are on
     * (node[0]: the primary of the topic's stream, for the members key). */
    redisContext *node[CONSUMER_NODES_MAX];
    int nnodes;
    volatile sig_atomic_t stop;
    struct outbox_backoff reconnect;
    struct outbox_consumer_stats stats;
    long long last_reclaim_ms;
    char lease_ms_s[16];  /* the ordered mode's lease, as an argument */
    char last_error[512]; /* the last problem logged, to log each change once */
    enum outbox_consumer_err err;
    char errstr[512];
};

/* Hands one event to the log hook, as one line. */
static void emit(const struct outbox_consumer *c, enum outbox_consumer_log_level level,
                 const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void emit(const struct outbox_consumer *c, enum outbox_consumer_log_level level,
                 const char *fmt, ...)
{
    char text[LOG_LINE_MAX];
    va_list ap;
    int n;

    if (c->o.log == NULL)
        return;
    va_start(ap, fmt);
    n = vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (n < 0)
        snprintf(text, sizeof(text), "(log message could not be formatted)");
    else if ((size_t)n >= sizeof(text))
        memcpy(text + sizeof(text) - 4, "...", 4);
    for (char *p = text; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            *p = ' '; /* a server's multi-line error is still one line */
    c->o.log(level, text, c->o.log_arg);
}

/* Records the most recent failure for outbox_consumer_err/errstr. */
static void set_error(struct outbox_consumer *c, enum outbox_consumer_err kind, const char *text)
{
    c->err = kind;
    snprintf(c->errstr, sizeof(c->errstr), "%s", text);
}

static void clear_error(struct outbox_consumer *c)
{
    c->err = OUTBOX_CONSUMER_ERR_NONE;
    c->errstr[0] = '\0';
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int outbox_consumer_dlq_name(const char *stream, const char *group, char *out, size_t outlen)
{
    return outbox_key_dlq(stream, group, out, outlen);
}

int outbox_consumer_replay_name(const char *stream, const char *group, char *out, size_t outlen)
{
    return outbox_key_replay(stream, group, out, outlen);
}

int outbox_consumer_lease_names(const char *stream, const char *group, char *lease, char *token,
                                size_t outlen)
{
    /* The counter's name is the longer: when it fits, both do. */
    if (strlen(stream) + strlen(group) + sizeof("{}:lease-token:") > outlen)
        return -1;
    if (outbox_key_lease(stream, group, "lease-token", token, outlen) < 0)
        return -1;
    return outbox_key_lease(stream, group, "lease", lease, outlen);
}

uint32_t outbox_consumer_backoff_ms(const struct outbox_consumer_options *opts, uint32_t deliveries)
{
    const uint32_t *b = opts->nbackoff ? opts->backoff_ms : default_backoff;
    uint32_t n = opts->nbackoff ? opts->nbackoff : OUTBOX_ARRAY_LEN(default_backoff);
    uint32_t i = deliveries == 0 ? 0 : deliveries - 1;
    return b[i < n ? i : n - 1];
}

uint64_t outbox_consumer_redelivery_horizon_ms(const struct outbox_consumer_options *opts)
{
    uint32_t deliveries = opts->max_deliveries ? opts->max_deliveries : 5;
    uint32_t reclaim = opts->reclaim_interval_ms ? opts->reclaim_interval_ms : 250;
    uint64_t ms = 0;
    for (uint32_t d = 1; d < deliveries; d++)
        ms += (uint64_t)outbox_consumer_backoff_ms(opts, d) + reclaim;
    return ms;
}

static uint32_t min_backoff(const struct outbox_consumer_options *o)
{
    uint32_t n = o->nbackoff ? o->nbackoff : OUTBOX_ARRAY_LEN(default_backoff);
    uint32_t m = UINT32_MAX;
    for (uint32_t d = 1; d <= n; d++) {
        uint32_t b = outbox_consumer_backoff_ms(o, d);
        if (b < m)
            m = b;
    }
    return m;
}

static int copy_name(char *dst, const char *src, const char *what, char *err, size_t errlen)
{
    if (src == NULL || src[0] == '\0') {
        snprintf(err, errlen, "%s is required", what);
        return -1;
    }
    if (strlen(src) >= NAME_MAX_LEN - 32) {
        snprintf(err, errlen, "%s is too long (at most %d bytes)", what, NAME_MAX_LEN - 32);
        return -1;
    }
    snprintf(dst, NAME_MAX_LEN, "%s", src);
    return 0;
}

/* A processed-table horizon must outlive every redelivery: 0, or -1 with
 * err, unless the options allow a shorter one. */
static int check_horizon(const struct outbox_consumer_options *o, char *err, size_t errlen)
{
    uint64_t horizon = outbox_consumer_redelivery_horizon_ms(o);
    if (o->processed_horizon_ms == 0 || o->processed_horizon_ms >= horizon ||
        o->allow_short_processed_horizon)
        return 0;
    snprintf(err, errlen,
             "the processed-table horizon (%llu ms) is shorter than the redelivery horizon "
             "(%llu ms: every backoff step over max_deliveries): a message delivered again "
             "after its processed row was purged would be handled twice; keep processed "
             "rows longer, or set allow_short_processed_horizon to accept it",
             (unsigned long long)o->processed_horizon_ms, (unsigned long long)horizon);
    return -1;
}

struct outbox_consumer *outbox_consumer_new(const struct outbox_consumer_options *opts,
                                            outbox_consumer_handler_fn *handler, void *arg,
                                            char *err, size_t errlen)
{
    if (opts == NULL || handler == NULL) {
        snprintf(err, errlen, "options and handler are required");
        return NULL;
    }
    struct outbox_consumer *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    c->o = *opts;
    c->handler = handler;
    c->arg = arg;
    if (c->o.max_deliveries == 0)
        c->o.max_deliveries = 5;
    if (c->o.nbackoff > OUTBOX_CONSUMER_BACKOFF_MAX) {
        snprintf(err, errlen, "at most %d backoff steps", OUTBOX_CONSUMER_BACKOFF_MAX);
        goto fail;
    }
    for (uint32_t i = 0; i < c->o.nbackoff; i++)
        if (c->o.backoff_ms[i] == 0) {
            snprintf(err, errlen, "backoff steps must be at least 1 ms");
            goto fail;
        }
    if (check_horizon(&c->o, err, errlen) < 0)
        goto fail;
    if (c->o.block_ms == 0)
        c->o.block_ms = 1000;
    if (c->o.command_timeout_ms == 0)
        c->o.command_timeout_ms = 5000;
    if (c->o.count == 0)
        c->o.count = 16;
    if (c->o.reclaim_interval_ms == 0)
        c->o.reclaim_interval_ms = 250;
    if (c->o.reconnect_min_ms == 0)
        c->o.reconnect_min_ms = 100;
    if (c->o.reconnect_max_ms == 0)
        c->o.reconnect_max_ms = 10000;
    if (c->o.partitions == 1 || c->o.partitions > OUTBOX_PARTITIONS_MAX) {
        snprintf(err, errlen,
                 "partitions is the number of partitions of a partitioned topic, 2 to %d (0: the "
                 "unordered mode)",
                 OUTBOX_PARTITIONS_MAX);
        goto fail;
    }
    if (c->o.lease_ms == 0)
        c->o.lease_ms = 10000;
    if (c->o.partitions > 1 && (c->o.lease_ms < 300 || c->o.lease_ms > 600000)) {
        snprintf(err, errlen, "lease_ms is 300 to 600000");
        goto fail;
    }
    snprintf(c->lease_ms_s, sizeof(c->lease_ms_s), "%u", c->o.lease_ms);
    if (c->o.partitions > 1 && c->o.count > ORDER_QUEUE_MAX) {
        snprintf(err, errlen, "count is at most %d in the ordered mode", ORDER_QUEUE_MAX);
        goto fail;
    }
    if (c->o.park_keys && c->o.partitions <= 1) {
        snprintf(err, errlen, "park_keys needs the ordered mode (partitions)");
        goto fail;
    }
    if (c->o.partitions > 1 && opts->dlq != NULL && opts->dlq[0] != '\0') {
        snprintf(err, errlen,
                 "dlq is not set in the ordered mode: each partition has its own dead-letter "
                 "stream, {<partition stream>}.<group>.dlq");
        goto fail;
    }
    if (copy_name(c->stream, opts->stream, "stream", err, errlen) < 0 ||
        copy_name(c->group, opts->group, "group", err, errlen) < 0)
        goto fail;
    if (opts->consumer != NULL && opts->consumer[0] != '\0') {
        if (copy_name(c->consumer, opts->consumer, "consumer", err, errlen) < 0)
            goto fail;
    } else {
        char host[256] = "consumer";
        gethostname(host, sizeof(host) - 1);
        host[sizeof(host) - 1] = '\0';
        snprintf(c->consumer, sizeof(c->consumer), "%s-%ld", host, (long)getpid());
    }
    if (opts->dlq != NULL && opts->dlq[0] != '\0') {
        if (copy_name(c->dlq, opts->dlq, "dlq", err, errlen) < 0)
            goto fail;
    } else {
        if (outbox_consumer_dlq_name(c->stream, c->group, c->dlq, sizeof(c->dlq)) < 0) {
            snprintf(err, errlen, "stream and group names are too long together");
            goto fail;
        }
    }
    if (outbox_consumer_replay_name(c->stream, c->group, c->replay, sizeof(c->replay)) < 0) {
        snprintf(err, errlen, "stream and group names are too long together");
        goto fail;
    }
    if (outbox_url_parse_seeds(opts->redis_url != NULL ? opts->redis_url : "", &c->url, err,
                               errlen) < 0)
        goto fail;
    /* The strings of the copied options point to the caller's memory. */
    c->o.stream = c->stream;
    c->o.group = c->group;
    c->o.consumer = c->consumer;
    c->o.dlq = c->dlq;
    c->o.redis_url = NULL; /* parsed into c->url */
    outbox_backoff_init(&c->reconnect, c->o.reconnect_min_ms, c->o.reconnect_max_ms);
    return c;
fail:
    free(c);
    return NULL;
}

void outbox_consumer_stop(struct outbox_consumer *c)
{
    c->stop = 1;
}

const struct outbox_consumer_stats *outbox_consumer_stats(const struct outbox_consumer *c)
{
    return &c->stats;
}

const char *outbox_consumer_name(const struct outbox_consumer *c)
{
    return c->consumer;
}

const char *outbox_consumer_dlq(const struct outbox_consumer *c)
{
    return c->dlq;
}

enum outbox_consumer_err outbox_consumer_err(const struct outbox_consumer *c)
{
    return c->err;
}

const char *outbox_consumer_errstr(const struct outbox_consumer *c)
{
    return c->errstr;
}

static void disconnect(struct outbox_consumer *c)
{
    if (c->rd != NULL)
        redisFree(c->rd);
    if (c->nnodes == 0 && c->wr != NULL)
        redisFree(c->wr);
    for (int i = 0; i < c->nnodes; i++)
        redisFree(c->node[i]);
    c->nnodes = 0;
    c->rd = c->wr = NULL;
}

void outbox_consumer_free(struct outbox_consumer *c)
{
    if (c == NULL)
        return;
    disconnect(c);
    free(c);
}

/* One command with the context's deadline. NULL when the connection failed. */
static redisReply *command(redisContext *ctx, int argc, const char **argv, const size_t *lens)
{
    return redisCommandArgv(ctx, argc, argv, lens);
}

/* Records a problem that run retries, and logs it as an error once per
 * change of its text (a repeat is a debug line). */
OUTBOX_STATIC void problem(struct outbox_consumer *c, enum outbox_consumer_err kind,
                           const char *fmt, ...) __attribute__((format(printf, 3, 4)));

OUTBOX_STATIC void problem(struct outbox_consumer *c, enum outbox_consumer_err kind,
                           const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    set_error(c, kind, text);
    if (strcmp(text, c->last_error) == 0) {
        emit(c, OUTBOX_CONSUMER_LOG_DEBUG, "%s", text);
        return;
    }
    snprintf(c->last_error, sizeof(c->last_error), "%s", text);
    emit(c, OUTBOX_CONSUMER_LOG_ERROR, "%s; retrying with backoff", text);
}

/* A connection for the commands of one stream (and the keys in its slot). */
static redisContext *open_conn_for(struct outbox_consumer *c, const char *stream,
                                   uint32_t timeout_ms, const char *role)
{
    char err[512];
    enum outbox_redis_fault fault;
    /* In a cluster, the primary of the stream's slot, where its replay and
     * dead-letter streams are too; found again at every connect, so a
     * failover or a resharding is followed (with seed nodes in the URL). */
    redisContext *ctx = outbox_redis_open_for_key(&c->url, stream, c->o.command_timeout_ms,
                                                  timeout_ms, -1, err, sizeof(err), &fault);
    if (ctx == NULL) {
        problem(c,
                fault == OUTBOX_REDIS_NOMEM     ? OUTBOX_CONSUMER_ERR_OOM
                : fault == OUTBOX_REDIS_REFUSED ? OUTBOX_CONSUMER_ERR_REDIS
                                                : OUTBOX_CONSUMER_ERR_IO,
                "%s", err);
        return NULL;
    }
    redisReply *r;
    char name[NAME_MAX_LEN + 16];
    snprintf(name, sizeof(name), "%s:%s", c->consumer, role);
    for (char *p = name; *p; p++)
        if (*p == ' ')
            *p = '_';
    const char *argv[3] = {"CLIENT", "SETNAME", name};
    size_t lens[3] = {6, 7, strlen(name)};
    r = command(ctx, 3, argv, lens);
    if (r != NULL)
        freeReplyObject(r);
    return ctx;
}

static redisContext *open_conn(struct outbox_consumer *c, uint32_t timeout_ms, const char *role)
{
    return open_conn_for(c, c->stream, timeout_ms, role);
}

/* XGROUP CREATE at 0 with MKSTREAM: nothing published before the group existed is missed. */
static int ensure_group(struct outbox_consumer *c, const char *stream)
{
    const char *argv[6] = {"XGROUP", "CREATE", stream, c->group, "0", "MKSTREAM"};
    size_t lens[6] = {6, 6, strlen(stream), strlen(c->group), 1, 8};
    redisReply *r = command(c->wr, 6, argv, lens);
    if (r == NULL) {
        problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s", c->wr->errstr);
        return -1;
    }
    int ok = r->type != REDIS_REPLY_ERROR || strncmp(r->str, "BUSYGROUP", 9) == 0;
    if (!ok)
        problem(c, OUTBOX_CONSUMER_ERR_REDIS, "cannot create the consumer group: %s", r->str);
    freeReplyObject(r);
    return ok ? 0 : -1;
}

/*
 * FUNCTION LOAD REPLACE of the dead-letter function, on the write connection.
 * It is persisted and replicated, unlike the script cache; REPLACE makes a
 * reconnect after an upgrade load the new body.
 */
static int load_function(struct outbox_consumer *c)
{
    const char *argv[4] = {"FUNCTION", "LOAD", "REPLACE", outbox_functions_consumer_source};
    size_t lens[4] = {8, 4, 7, strlen(outbox_functions_consumer_source)};
    redisReply *r = command(c->wr, 4, argv, lens);
    if (r == NULL) {
        problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s", c->wr->errstr);
        return -1;
    }
    int ok = r->type != REDIS_REPLY_ERROR;
    if (!ok)
        problem(c, OUTBOX_CONSUMER_ERR_REDIS,
                "FUNCTION LOAD of library %s (the dead-letter function) failed: %s%s",
                OUTBOX_CONSUMER_FUNCTION_LIBRARY, r->str,
                strncmp(r->str, "NOPERM", 6) == 0
                    ? "; the consumer's Redis user needs the ACL permissions +function|load "
                      "and +fcall"
                    : "");
    freeReplyObject(r);
    return ok ? 0 : -1;
}

static void sleep_ms_interruptible(struct outbox_consumer *c, uint32_t ms)
{
    while (ms > 0 && !c->stop) {
        uint32_t step = ms > 50 ? 50 : ms;
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)step * 1000000L};
        nanosleep(&ts, NULL);
        ms -= step;
    }
}

/*
 * A dead-letter or replay stream under its name before 0.2 ("<stream>.<group>
 * .dlq" and ".replay", outside the stream's hash slot) is renamed to its name
 * now when that is free; when both exist, a warning says how to merge them
 * (outbox-relay dlq migrate). Failures are warnings: consuming goes on.
 */
static void migrate_name(struct outbox_consumer *c, const char *stream, const char *now, int replay)
{
    char old[sizeof(c->dlq)];
    if ((replay ? outbox_key_replay_old(stream, c->group, old, sizeof(old))
                : outbox_key_dlq_old(stream, c->group, old, sizeof(old))) < 0)
        return;
    const char *argv[3] = {"RENAMENX", old, now};
    size_t lens[3] = {8, strlen(old), strlen(now)};
    redisReply *r = command(c->wr, 3, argv, lens);
    if (r == NULL)
        return;
    if (r->type == REDIS_REPLY_INTEGER && r->integer == 1)
        emit(c, OUTBOX_CONSUMER_LOG_INFO, "%s: renamed %s to %s (the name before 0.2)", c->consumer,
             old, now);
    else if (r->type == REDIS_REPLY_INTEGER && r->integer == 0)
        emit(c, OUTBOX_CONSUMER_LOG_WARNING,
             "%s: both %s (the name before 0.2) and %s exist: run 'outbox-relay dlq migrate %s "
             "%s' to move the old entries",
             c->consumer, old, now, stream, c->group);
    /* An error: the old key is absent (ERR no such key), or a cluster refused
     * a rename across slots, where no deployment before 0.2 ran. */
    freeReplyObject(r);
}

static int connect_all(struct outbox_consumer *c)
{
    disconnect(c);
    c->wr = open_conn(c, c->o.command_timeout_ms, "ack");
    if (c->wr != NULL)
        c->rd = open_conn(c, c->o.block_ms + c->o.command_timeout_ms, "read");
    if (c->rd == NULL || load_function(c) < 0) {
        disconnect(c);
        return -1;
    }
    char default_dlq[sizeof(c->dlq)];
    if (outbox_consumer_dlq_name(c->stream, c->group, default_dlq, sizeof(default_dlq)) > 0 &&
        strcmp(default_dlq, c->dlq) == 0)
        migrate_name(c, c->stream, c->dlq, 0); /* a dlq of the caller's own keeps its name */
    migrate_name(c, c->stream, c->replay, 1);
    if (ensure_group(c, c->stream) < 0 || ensure_group(c, c->replay) < 0) {
        disconnect(c);
        return -1;
    }
    if (c->last_error[0] != '\0')
        emit(c, OUTBOX_CONSUMER_LOG_INFO, "%s: connected again, reading %s and %s as group %s",
             c->consumer, c->stream, c->replay, c->group);
    else
        emit(c, OUTBOX_CONSUMER_LOG_INFO, "%s: reading %s and %s as group %s, dead letters to %s",
             c->consumer, c->stream, c->replay, c->group, c->dlq);
    c->last_error[0] = '\0';
    clear_error(c);
    outbox_backoff_reset(&c->reconnect);
    return 0;
}

/* A field's value, and its length when len is not NULL. */
static const redisReply *field(const redisReply *fields, const char *name, size_t *len)
{
    const redisReply *v = outbox_entry_field(fields, name);
    if (v != NULL && len != NULL)
        *len = v->len;
    return v;
}

static void rfc3339_now(char *out, size_t outlen)
{
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    char base[32];
    strftime(base, sizeof(base), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, outlen, "%.19s.%06dZ", base, (int)(ts.tv_nsec / 1000));
}

/*
 * Moves one entry to the dead-letter stream and acknowledges it, in one call
 * of the dead-letter function. fields may be NULL (a lost entry). Returns 0,
 * or -1 when Redis refused or failed (nothing was acknowledged: the entry
 * stays pending and a later pass delivers it again). A lost entry is no
 * longer pending, so a refused "lost" record is not tried again.
 */
/* In the ordered mode, the lease a call is made under: its key, its token,
 * and the partition's dead-letter stream. */
struct lease_ref {
    const char *key;
    const char *token;
    const char *dlq;
};

/* Whether a reply is the lease functions' refusal. */
static int lease_lost_reply(const redisReply *r)
{
    return r != NULL && r->type == REDIS_REPLY_ERROR && strncmp(r->str, "LEASELOST", 9) == 0;
}

/* A command's arguments as it is built. */
struct argv_buf {
    const char **argv;
    size_t *lens;
    int argc;
};

static void arg_add(struct argv_buf *a, const char *s, size_t len)
{
    a->argv[a->argc] = s;
    a->lens[a->argc] = len;
    a->argc++;
}

static void arg_str(struct argv_buf *a, const char *s)
{
    arg_add(a, s, strlen(s));
}

/* FCALL of the dead-letter function for one entry: the entry's own fields
 * (not its "dlq." ones), then the dead-letter fields. count and when are the
 * caller's buffers, alive until the command is sent. a has room for
 * 7 + the fields + 16 arguments. */
static void dead_letter_args(struct argv_buf *a, const struct outbox_consumer *c,
                             const char *stream, const struct lease_ref *lease,
                             const char *entry_id, const redisReply *fields, size_t nf,
                             const char *reason, const char *error, const char *count,
                             const char *when)
{
    arg_str(a, "FCALL");
    if (lease != NULL) {
        arg_str(a, OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER_LEASED);
        arg_str(a, "3");
        arg_str(a, lease->dlq);
        arg_str(a, stream);
        arg_str(a, lease->key);
        arg_str(a, c->group);
        arg_str(a, lease->token);
    } else {
        arg_str(a, OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER);
        arg_str(a, "2");
        arg_str(a, c->dlq);
        arg_str(a, stream);
        arg_str(a, c->group);
    }
    arg_str(a, entry_id);
    for (size_t i = 0; i + 1 < nf; i += 2) {
        const redisReply *k = fields->element[i], *v = fields->element[i + 1];
        if (k->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING)
            continue;
        if (strncmp(k->str, "dlq.", 4) == 0)
            continue; /* a replayed entry carries none, but never copy them twice */
        arg_add(a, k->str, k->len);
        arg_add(a, v->str, v->len);
    }
    const char *const tail[] = {
        OUTBOX_DLQ_FIELD_STREAM,     stream,      OUTBOX_DLQ_FIELD_GROUP,  c->group,
        OUTBOX_DLQ_FIELD_CONSUMER,   c->consumer, OUTBOX_DLQ_FIELD_ENTRY,  entry_id,
        OUTBOX_DLQ_FIELD_DELIVERIES, count,       OUTBOX_DLQ_FIELD_REASON, reason,
        OUTBOX_DLQ_FIELD_ERROR,      error,       OUTBOX_DLQ_FIELD_TIME,   when,
    };
    for (size_t i = 0; i < sizeof(tail) / sizeof(tail[0]); i++)
        arg_str(a, tail[i]);
}

/* 0, -1 (refused or failed: the entry stays pending) or, under a lease,
 * RELAY_LEASE_LOST. */
#define RELAY_LEASE_LOST (-2)
static int dead_letter_under(struct outbox_consumer *c, const char *stream,
                             const struct lease_ref *lease, const char *entry_id,
                             const redisReply *fields, const char *reason, const char *error,
                             uint32_t deliveries)
{
    if (c->wr == NULL)
        return -1;
    size_t nf = fields != NULL && fields->type == REDIS_REPLY_ARRAY ? fields->elements : 0;
    size_t argc_max = 9 + nf + 16;
    struct argv_buf a = {calloc(argc_max, sizeof(*a.argv)), calloc(argc_max, sizeof(*a.lens)), 0};
    int rc = -1;
    if (a.argv == NULL || a.lens == NULL) {
        set_error(c, OUTBOX_CONSUMER_ERR_OOM, "out of memory for a dead letter");
        emit(c, OUTBOX_CONSUMER_LOG_ERROR,
             "dead-lettering %s %s failed: out of memory; the entry stays pending", stream,
             entry_id);
        goto out;
    }
    char count[16], when[40];
    snprintf(count, sizeof(count), "%u", deliveries);
    rfc3339_now(when, sizeof(when));
    dead_letter_args(&a, c, stream, lease, entry_id, fields, nf, reason, error, count, when);
    redisReply *r = command(c->wr, a.argc, a.argv, a.lens);
    if (r == NULL) {
        problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost while dead-lettering %s %s: %s",
                stream, entry_id, c->wr->errstr);
        disconnect(c);
        goto out;
    }
    if (r->type == REDIS_REPLY_STRING) {
        c->stats.dead_lettered++;
        clear_error(c);
        emit(c, OUTBOX_CONSUMER_LOG_WARNING, "%s %s -> %s (%s after %u deliveries): %s", stream,
             entry_id, lease != NULL ? lease->dlq : c->dlq, reason, deliveries, error);
        rc = 0;
    } else if (lease != NULL && lease_lost_reply(r)) {
        rc = RELAY_LEASE_LOST;
    } else {
        /* "Function not found": someone ran FUNCTION FLUSH or DELETE since
         * the connect; connecting again loads it. */
        int missing = r->type == REDIS_REPLY_ERROR && strstr(r->str, "Function not found") != NULL;
        char text[512];
        snprintf(text, sizeof(text), "dead-lettering %s %s failed: %s", stream, entry_id,
                 r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        set_error(c, OUTBOX_CONSUMER_ERR_REDIS, text);
        emit(c, OUTBOX_CONSUMER_LOG_ERROR,
             "%s; the entry stays pending and a later pass tries again%s", text,
             missing ? " (reconnecting to load the function)" : "");
        if (missing)
            disconnect(c);
    }
    freeReplyObject(r);
out:
    free(a.argv);
    free(a.lens);
    return rc;
}

static int dead_letter(struct outbox_consumer *c, const char *stream, const char *entry_id,
                       const redisReply *fields, const char *reason, const char *error,
                       uint32_t deliveries)
{
    return dead_letter_under(c, stream, NULL, entry_id, fields, reason, error, deliveries);
}

static int ack(struct outbox_consumer *c, const char *stream, const char *entry_id)
{
    const char *argv[4] = {"XACK", stream, c->group, entry_id};
    size_t lens[4] = {4, strlen(stream), strlen(c->group), strlen(entry_id)};
    redisReply *r = command(c->wr, 4, argv, lens);
    if (r == NULL) {
        problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost while acknowledging: %s",
                c->wr->errstr);
        disconnect(c);
        return -1;
    }
    int ok = r->type == REDIS_REPLY_INTEGER;
    if (ok) {
        clear_error(c);
    } else {
        char text[512];
        snprintf(text, sizeof(text), "acknowledging %s %s failed: %s", stream, entry_id,
                 r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        set_error(c, OUTBOX_CONSUMER_ERR_REDIS, text);
        emit(c, OUTBOX_CONSUMER_LOG_ERROR, "%s; the entry stays pending", text);
    }
    freeReplyObject(r);
    return ok ? 0 : -1;
}

/* Checks the contract's fields; NULL when fine, else what is missing. */
OUTBOX_STATIC const char *parse_message(const redisReply *fields, struct outbox_message *m,
                                        const char **names, const char **values, size_t *vlens);

OUTBOX_STATIC const char *parse_message(const redisReply *fields, struct outbox_message *m,
                                        const char **names, const char **values, size_t *vlens)
{
    size_t len;
    const redisReply *v;
    if (fields == NULL || fields->type != REDIS_REPLY_ARRAY || fields->elements % 2 != 0)
        return "the entry has no field list";
    if ((v = field(fields, "id", &len)) == NULL || len == 0)
        return "the entry has no \"id\" field (it was not written by outbox-relay)";
    m->id = v->str;
    if ((v = field(fields, "topic", NULL)) == NULL)
        return "the entry has no \"topic\" field";
    m->topic = v->str;
    if ((v = field(fields, "payload", &len)) == NULL)
        return "the entry has no \"payload\" field";
    m->payload = v->str;
    m->payload_len = len;
    if ((v = field(fields, "created_at", NULL)) == NULL)
        return "the entry has no \"created_at\" field";
    m->created_at = v->str;
    if ((v = field(fields, "outbox_id", NULL)) == NULL)
        return "the entry has no \"outbox_id\" field";
    char *end;
    errno = 0;
    m->outbox_id = strtoll(v->str, &end, 10);
    if (errno != 0 || *end != '\0' || end == v->str)
        return "the \"outbox_id\" field is not a number";
    if ((v = field(fields, "key", &len)) != NULL) {
        m->key = v->str;
        m->key_len = len;
    }
    size_t nh = 0;
    for (size_t i = 0; i + 1 < fields->elements; i += 2) {
        const redisReply *k = fields->element[i], *val = fields->element[i + 1];
        if (k->type != REDIS_REPLY_STRING || val->type != REDIS_REPLY_STRING ||
            strncmp(k->str, "h.", 2) != 0)
            continue;
        if (nh == OUTBOX_HEADERS_MAX)
            return "the entry has more headers than the contract allows";
        names[nh] = k->str + 2;
        values[nh] = val->str;
        vlens[nh] = val->len;
        nh++;
    }
    m->nheaders = nh;
    m->header_names = names;
    m->header_values = values;
    m->header_value_lens = vlens;
    return NULL;
}

/* Handles one delivered entry. */
static void handle(struct outbox_consumer *c, const char *stream, const redisReply *entry,
                   uint32_t deliveries)
{
    if (entry->type != REDIS_REPLY_ARRAY || entry->elements != 2 ||
        entry->element[0]->type != REDIS_REPLY_STRING)
        return;
    const char *entry_id = entry->element[0]->str;
    const redisReply *fields = entry->element[1];

    if (fields->type == REDIS_REPLY_NIL) {
        /* Delivered from the PEL after it was deleted: nothing left to handle. */
        c->stats.lost++;
        dead_letter(c, stream, entry_id, NULL, "lost",
                    "the entry was deleted or trimmed from the stream while pending", deliveries);
        return;
    }
    struct outbox_message m;
    const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
    size_t vlens[OUTBOX_HEADERS_MAX];
    memset(&m, 0, sizeof(m));
    const char *bad = parse_message(fields, &m, names, values, vlens);
    if (bad != NULL) {
        c->stats.malformed++;
        char why[300];
        snprintf(why, sizeof(why), "malformed: %s", bad);
        dead_letter(c, stream, entry_id, fields, "malformed", why, deliveries);
        return;
    }
    if (deliveries > c->o.max_deliveries) {
        char why[200];
        snprintf(why, sizeof(why),
                 "delivered %u times (max_deliveries %u): the consumer of the last delivery did "
                 "not finish it",
                 deliveries, c->o.max_deliveries);
        dead_letter(c, stream, entry_id, fields, "exhausted", why, deliveries);
        return;
    }
    m.stream = stream;
    m.entry_id = entry_id;
    m.deliveries = deliveries;

    char err[512] = "";
    c->stats.delivered++;
    enum outbox_handled result = c->handler(&m, c->arg, err, sizeof(err));
    if (err[0] == '\0')
        snprintf(err, sizeof(err), "the handler gave no reason");
    switch (result) {
    case OUTBOX_HANDLED_DONE:
        if (ack(c, stream, entry_id) == 0)
            c->stats.done++;
        break;
    case OUTBOX_HANDLED_FAIL:
        dead_letter(c, stream, entry_id, fields, "permanent", err, deliveries);
        break;
    case OUTBOX_HANDLED_RETRY:
    default:
        if (deliveries >= c->o.max_deliveries) {
            dead_letter(c, stream, entry_id, fields, "exhausted", err, deliveries);
        } else {
            c->stats.retried++;
            emit(c, OUTBOX_CONSUMER_LOG_INFO,
                 "%s %s (message %s) will be retried in %u ms (delivery %u of %u): %s", stream,
                 entry_id, m.id, outbox_consumer_backoff_ms(&c->o, deliveries), deliveries,
                 c->o.max_deliveries, err);
        }
        break;
    }
}

/* Has the entry been deleted from the stream? 1 yes, 0 no, -1 unknown. */
static int entry_gone(struct outbox_consumer *c, const char *stream, const char *id)
{
    const char *argv[6] = {"XRANGE", stream, id, id, "COUNT", "1"};
    size_t lens[6] = {6, strlen(stream), strlen(id), strlen(id), 5, 1};
    redisReply *r = command(c->wr, 6, argv, lens);
    if (r == NULL)
        return -1;
    int gone = r->type == REDIS_REPLY_ARRAY && r->elements == 0;
    freeReplyObject(r);
    return gone;
}

/* Takes over one pending entry whose backoff has passed. */
static void take_over(struct outbox_consumer *c, const char *stream, const char *id,
                      uint32_t deliveries, uint32_t due)
{
    char min_idle[16];
    snprintf(min_idle, sizeof(min_idle), "%u", due);
    const char *cargv[6] = {"XCLAIM", stream, c->group, c->consumer, min_idle, id};
    size_t clens[6] = {
        6, strlen(stream), strlen(c->group), strlen(c->consumer), strlen(min_idle), strlen(id)};
    redisReply *cl = command(c->wr, 6, cargv, clens);
    if (cl == NULL) {
        problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s", c->wr->errstr);
        disconnect(c);
        return;
    }
    if (cl->type == REDIS_REPLY_ARRAY && cl->elements == 1) {
        c->stats.reclaimed++;
        handle(c, stream, cl->element[0], deliveries + 1);
    } else if (cl->type == REDIS_REPLY_ARRAY && cl->elements == 0) {
        /* Either another consumer took it first, or Redis 7.0 dropped it from
         * the PEL because the entry no longer exists. */
        if (entry_gone(c, stream, id) == 1) {
            c->stats.lost++;
            dead_letter(c, stream, id, NULL, "lost",
                        "the entry was deleted or trimmed from the stream while pending",
                        deliveries);
        }
    }
    freeReplyObject(cl);
}

/*
 * Takes over pending entries whose backoff has passed, of any consumer. The
 * scan pages through the pending list (oldest first) so that entries waiting
 * out a long backoff never hide due ones behind them; one pass looks at no
 * more than RECLAIM_PAGES pages.
 */
#define RECLAIM_PAGES 16
static void reclaim_stream(struct outbox_consumer *c, const char *stream)
{
    char idle[16], cnt[16], start[64] = "-";
    snprintf(idle, sizeof(idle), "%u", min_backoff(&c->o));
    snprintf(cnt, sizeof(cnt), "%d", RECLAIM_BATCH);
    for (int page = 0; page < RECLAIM_PAGES && !c->stop && c->wr != NULL; page++) {
        const char *argv[8] = {"XPENDING", stream, c->group, "IDLE", idle, start, "+", cnt};
        size_t lens[8] = {8, strlen(stream), strlen(c->group), 4, strlen(idle), strlen(start),
                          1, strlen(cnt)};
        redisReply *p = command(c->wr, 8, argv, lens);
        if (p == NULL) {
            problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s", c->wr->errstr);
            disconnect(c);
            return;
        }
        size_t n = p->type == REDIS_REPLY_ARRAY ? p->elements : 0;
        for (size_t i = 0; i < n && !c->stop && c->wr != NULL; i++) {
            const redisReply *e = p->element[i];
            if (e->type != REDIS_REPLY_ARRAY || e->elements != 4 ||
                e->element[0]->type != REDIS_REPLY_STRING ||
                e->element[2]->type != REDIS_REPLY_INTEGER ||
                e->element[3]->type != REDIS_REPLY_INTEGER)
                continue;
            uint32_t deliveries = (uint32_t)e->element[3]->integer;
            uint32_t due = outbox_consumer_backoff_ms(&c->o, deliveries);
            if (i + 1 == n)
                snprintf(start, sizeof(start), "(%s", e->element[0]->str);
            if (e->element[2]->integer >= (long long)due)
                take_over(c, stream, e->element[0]->str, deliveries, due);
        }
        freeReplyObject(p);
        if (n < RECLAIM_BATCH)
            return;
    }
}

/* Resets the idle time of entries[from..] (ours, not yet handled) with
 * XCLAIM ... JUSTID, which does not count a delivery. */
static void touch_entries(struct outbox_consumer *c, const char *stream, const redisReply *entries,
                          size_t from)
{
    size_t n = entries->elements - from;
    const char **argv = calloc(n + 6, sizeof(*argv));
    size_t *lens = calloc(n + 6, sizeof(*lens));
    if (argv == NULL || lens == NULL) {
        /* Not fatal: the entries may be taken over by another consumer. */
        set_error(c, OUTBOX_CONSUMER_ERR_OOM, "out of memory for XCLAIM JUSTID");
        goto out;
    }
    size_t argc = 0;
    argv[argc++] = "XCLAIM";
    argv[argc++] = stream;
    argv[argc++] = c->group;
    argv[argc++] = c->consumer;
    argv[argc++] = "0";
    for (size_t i = from; i < entries->elements; i++) {
        const redisReply *e = entries->element[i];
        if (e->type == REDIS_REPLY_ARRAY && e->elements == 2 &&
            e->element[0]->type == REDIS_REPLY_STRING)
            argv[argc++] = e->element[0]->str;
    }
    argv[argc++] = "JUSTID";
    for (size_t i = 0; i < argc; i++)
        lens[i] = strlen(argv[i]);
    redisReply *r = command(c->wr, (int)argc, argv, lens);
    if (r == NULL) {
        problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s", c->wr->errstr);
        disconnect(c);
    } else {
        freeReplyObject(r);
    }
out:
    free(argv);
    free(lens);
}

static void read_once(struct outbox_consumer *c)
{
    char count[16], block[16];
    /* Block no longer than until the next reclaim pass is due, so retries and
     * take-overs are not held back by an idle read. */
    long long until_reclaim = c->last_reclaim_ms + c->o.reclaim_interval_ms - now_ms();
    uint32_t block_ms = c->o.block_ms;
    if (until_reclaim < (long long)block_ms)
        block_ms = until_reclaim < 1 ? 1 : (uint32_t)until_reclaim;
    snprintf(count, sizeof(count), "%u", c->o.count);
    snprintf(block, sizeof(block), "%u", block_ms);
    const char *argv[11] = {"XREADGROUP", "GROUP", c->group,  c->consumer, "COUNT",  count,
                            "BLOCK",      block,   "STREAMS", c->stream,   c->replay};
    size_t lens[13];
    const char *full[13];
    memcpy(full, argv, sizeof(argv));
    full[11] = ">";
    full[12] = ">";
    for (int i = 0; i < 13; i++)
        lens[i] = strlen(full[i]);
    redisReply *r = command(c->rd, 13, full, lens);
    if (r == NULL) {
        problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost while reading: %s",
                c->rd->errstr);
        disconnect(c);
        return;
    }
    if (r->type == REDIS_REPLY_ERROR) {
        /* NOGROUP: the stream or group was deleted; create them again. */
        problem(c, OUTBOX_CONSUMER_ERR_REDIS, "XREADGROUP failed: %s", r->str);
        freeReplyObject(r);
        disconnect(c);
        return;
    }
    if (r->type == REDIS_REPLY_ARRAY) {
        for (size_t s = 0; s < r->elements && c->wr != NULL; s++) {
            const redisReply *sr = r->element[s];
            if (sr->type != REDIS_REPLY_ARRAY || sr->elements != 2 ||
                sr->element[0]->type != REDIS_REPLY_STRING ||
                sr->element[1]->type != REDIS_REPLY_ARRAY)
                continue;
            const char *stream = sr->element[0]->str;
            const redisReply *entries = sr->element[1];
            /* The message in hand is finished on stop; the rest stay pending
             * and are taken over after their backoff. */
            long long read_at = now_ms();
            for (size_t i = 0; i < entries->elements && !c->stop && c->wr != NULL; i++) {
                /* Entries still waiting in this batch age from the read: keep
                 * them ours before another consumer counts them as abandoned. */
                if (i > 0 && now_ms() - read_at > min_backoff(&c->o) / 2) {
                    touch_entries(c, stream, entries, i);
                    read_at = now_ms();
                }
                handle(c, stream, entries->element[i], 1);
            }
        }
    }
    freeReplyObject(r);
}

/* ---- the ordered mode (docs/CONSUMERS.md, "Ordered consumers") ---------- */

/*
 * The consumers of a group divide the partition streams of a topic through
 * the lease functions (functions/outbox_consumer.lua), and each handles its partitions' entries one
 * key at a time, in id order (consumer/order.c decides which entry is next).
 * Every call that touches a partition carries the lease's token, so once a
 * lease is lost (this process was frozen past it, or its connection was
 * slow) nothing more of that partition is read, acknowledged or
 * dead-lettered; the entries in hand are dropped unacknowledged, and the next
 * holder takes them over first.
 *
 * The members of the group beat in a sorted set "{<stream>}:lease-members:
 * <group>" (scored by Redis's clock); each member's share is the partitions p
 * with p % members == its rank in name order (outbox_order_mine). A member
 * gives up what is no longer its share and takes what is, as leases allow.
 */

struct held {
    redisReply *entry; /* [id, fields], owned */
    int replayed;      /* read from the partition's replay stream */
    uint32_t deliveries;
    long long retry_at;
    int done;
    int dropped;     /* its key was parked: left pending, out of hand */
    char *dl_reason; /* a dead letter Redis refused, to write again */
    char *dl_why;
};

static void held_free(struct held *h)
{
    freeReplyObject(h->entry);
    free(h->dl_reason);
    free(h->dl_why);
    h->entry = NULL;
    h->dl_reason = h->dl_why = NULL;
}

struct part {
    uint32_t p;
    int node; /* its primary's connection: c->node[node] */
    char stream[NAME_MAX_LEN];
    char replay[2 * NAME_MAX_LEN + 16];
    char dlq[2 * NAME_MAX_LEN + 16];
    char lease[2 * NAME_MAX_LEN + 32];
    char tokens[2 * NAME_MAX_LEN + 32];
    long long token; /* 0: not held */
    char token_s[24];
    long long valid_until; /* ms: the lease's end at the latest, on our clock */
    int ready;             /* taken over in full: the others' pending entries, the
                              parked keys; only then is anything read or handled */
    int pel_done[2];       /* own pending entries read (main, replay) */
    char pel_cursor[2][64];
    char last_id[2][64]; /* what XREAD waits after (main, replay); "" unknown */
    struct held q[ORDER_QUEUE_MAX];
    size_t nq;
    char parked_key[2 * NAME_MAX_LEN + 32];
    redisReply *parked; /* SMEMBERS of parked_key, with park_keys */
};

struct ordered {
    struct part *parts;
    uint32_t n;
    char members_key[2 * NAME_MAX_LEN + 32];
    uint32_t rank, members;
    long long next_upkeep;
    uint32_t rr; /* where the next handling round starts */
    int poll;    /* the partitions span hash slots of a cluster: no single XREAD
                    can wait on them, so the loop reads again every
                    ORDER_POLL_MS */
};

/* How often an ordered consumer in a Redis Cluster reads its partitions
 * again when nothing is in hand (docs/CONSUMERS.md, "Limits"). */
#define ORDER_POLL_MS 50

/* Commands of this partition go to its primary from here on. */
static void use_part(struct outbox_consumer *c, const struct part *pt)
{
    if (pt->node < c->nnodes)
        c->wr = c->node[pt->node];
}

/* Commands of the topic's own keys (the members key) go to its primary. */
static void use_base(struct outbox_consumer *c)
{
    if (c->nnodes > 0)
        c->wr = c->node[0];
}

/* A refusal that connecting again cures: the library flushed or deleted
 * (connecting loads it), the group or stream deleted (connecting creates
 * them again), the stream's slot moved to another primary of a cluster, or
 * the primary became a replica (connecting finds the primary). */
static void reconnect_if_needed(struct outbox_consumer *c, const redisReply *r)
{
    if (r != NULL && r->type == REDIS_REPLY_ERROR &&
        (strstr(r->str, "Function not found") != NULL || strncmp(r->str, "NOGROUP", 7) == 0 ||
         strncmp(r->str, "MOVED ", 6) == 0 || strncmp(r->str, "READONLY", 8) == 0))
        disconnect(c);
}

static void part_drop(struct part *pt)
{
    for (size_t i = 0; i < pt->nq; i++)
        held_free(&pt->q[i]);
    pt->nq = 0;
    pt->ready = 0;
    freeReplyObject(pt->parked);
    pt->parked = NULL;
    pt->token = 0;
    pt->token_s[0] = '\0';
    pt->valid_until = 0;
}

static void part_lost(struct outbox_consumer *c, struct part *pt, const char *why)
{
    if (pt->token == 0)
        return;
    c->stats.leases_lost++;
    emit(c, OUTBOX_CONSUMER_LOG_WARNING,
         "lost the lease of %s (%s): its %zu entries in hand are left to the next holder",
         pt->stream, why, pt->nq);
    part_drop(pt);
}

/* One command, its arguments NULL-terminated (at most 15); NULL when the
 * connection failed (then logged and disconnected). */
static redisReply *fcall(struct outbox_consumer *c, const char **argv)
{
    if (c->wr == NULL)
        return NULL; /* lost earlier in this step: the loop reconnects */
    size_t lens[16];
    int argc = 0;
    while (argc < 15 && argv[argc] != NULL) {
        lens[argc] = strlen(argv[argc]);
        argc++;
    }
    redisReply *r = command(c->wr, argc, argv, lens);
    if (r == NULL) {
        problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s", c->wr->errstr);
        disconnect(c);
    }
    return r;
}

/* A stream entry's key, or NULL (no key, or no fields: deleted). */
static const char *entry_key(const redisReply *entry, size_t *len)
{
    const redisReply *fields = entry->element[1];
    if (fields->type != REDIS_REPLY_ARRAY)
        return NULL;
    const redisReply *k = field(fields, "key", len);
    return k != NULL ? k->str : NULL;
}

static int is_parked(const struct part *pt, const char *key, size_t len)
{
    for (size_t i = 0; key != NULL && pt->parked != NULL && i < pt->parked->elements; i++) {
        const redisReply *k = pt->parked->element[i];
        if (k->type == REDIS_REPLY_STRING && k->len == len && memcmp(k->str, key, len) == 0)
            return 1;
    }
    return 0;
}

/* The first key of the parked set read before that is not in the one read
 * now (SMEMBERS replies; NULL when none left or there was none before). Only
 * string members count: a reply of any other shape parks nothing. */
OUTBOX_STATIC const redisReply *parked_key_left(const redisReply *before, const redisReply *now);

OUTBOX_STATIC const redisReply *parked_key_left(const redisReply *before, const redisReply *now)
{
    if (before == NULL || before->type != REDIS_REPLY_ARRAY)
        return NULL;
    for (size_t i = 0; i < before->elements; i++) {
        const redisReply *k = before->element[i];
        if (k->type != REDIS_REPLY_STRING)
            continue;
        int still = 0;
        for (size_t j = 0;
             now != NULL && now->type == REDIS_REPLY_ARRAY && j < now->elements && !still; j++) {
            const redisReply *m = now->element[j];
            still = m->type == REDIS_REPLY_STRING && m->len == k->len &&
                    memcmp(m->str, k->str, k->len) == 0;
        }
        if (!still)
            return k;
    }
    return NULL;
}

/* Reads a partition's parked keys (park_keys). A key that has left the set
 * since the last read was unparked by an operator: its messages, still
 * pending, are read again from the start of this consumer's pending list. */
static int load_parked(struct outbox_consumer *c, struct part *pt)
{
    if (!c->o.park_keys)
        return 0;
    redisReply *r = fcall(c, (const char *[]){"SMEMBERS", pt->parked_key, NULL});
    if (r == NULL)
        return -1;
    if (r->type != REDIS_REPLY_ARRAY) {
        problem(c, OUTBOX_CONSUMER_ERR_REDIS, "reading the parked keys %s failed: %s",
                pt->parked_key, r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        freeReplyObject(r);
        return -1;
    }
    const redisReply *k = parked_key_left(pt->parked, r);
    int unparked = k != NULL;
    if (unparked)
        emit(c, OUTBOX_CONSUMER_LOG_INFO, "%s: key %.*s unparked on %s; its messages go on",
             c->consumer, (int)k->len, k->str, pt->stream);
    freeReplyObject(pt->parked);
    pt->parked = r;
    if (unparked)
        for (int s = 0; s < 2; s++) {
            pt->pel_done[s] = 0;
            snprintf(pt->pel_cursor[s], sizeof(pt->pel_cursor[s]), "0");
        }
    return 0;
}

/* Redis's clock in ms from a TIME reply; -1 when the reply is not one. */
OUTBOX_STATIC long long redis_time_ms(const redisReply *t);

OUTBOX_STATIC long long redis_time_ms(const redisReply *t)
{
    if (t->type != REDIS_REPLY_ARRAY || t->elements != 2)
        return -1;
    long long part[2];
    for (int i = 0; i < 2; i++) {
        const redisReply *e = t->element[i];
        char *end = NULL;
        if (e->type != REDIS_REPLY_STRING || e->len == 0 || e->len > 18 || e->str[0] < '0' ||
            e->str[0] > '9')
            return -1;
        part[i] = strtoll(e->str, &end, 10);
        if (end != e->str + e->len)
            return -1;
    }
    return part[0] * 1000 + part[1] / 1000;
}

/* The group's members, by the beat of each: rank and count. -1 when the
 * connection failed. */
static int beat(struct outbox_consumer *c, struct ordered *od)
{
    redisReply *t = fcall(c, (const char *[]){"TIME", NULL});
    if (t == NULL)
        return -1;
    long long ms = redis_time_ms(t);
    freeReplyObject(t);
    if (ms < 0) {
        problem(c, OUTBOX_CONSUMER_ERR_REDIS,
                "%s: unexpected reply to TIME; is this a Redis server? The group's members are "
                "counted again at the next upkeep",
                c->consumer);
        return -1;
    }
    char now[32], cutoff[32];
    snprintf(now, sizeof(now), "%lld", ms);
    snprintf(cutoff, sizeof(cutoff), "(%lld", ms - (long long)c->o.lease_ms);
    redisReply *r = fcall(c, (const char *[]){"ZADD", od->members_key, now, c->consumer, NULL});
    if (r == NULL)
        return -1;
    freeReplyObject(r);
    r = fcall(c, (const char *[]){"ZREMRANGEBYSCORE", od->members_key, "-inf", cutoff, NULL});
    if (r == NULL)
        return -1;
    freeReplyObject(r);
    r = fcall(c, (const char *[]){"ZRANGE", od->members_key, "0", "-1", NULL});
    if (r == NULL)
        return -1;
    uint32_t rank = 0, members = 0;
    int found = 0;
    if (r->type == REDIS_REPLY_ARRAY) {
        for (size_t i = 0; i < r->elements; i++) {
            if (r->element[i]->type != REDIS_REPLY_STRING)
                continue;
            members++;
            int cmp = strcmp(r->element[i]->str, c->consumer);
            if (cmp == 0)
                found = 1;
            else if (cmp < 0)
                rank++;
        }
    }
    freeReplyObject(r);
    if (!found) { /* our beat was just written: only a clock step can lose it */
        members++;
    }
    if (members != od->members || rank != od->rank)
        emit(c, OUTBOX_CONSUMER_LOG_INFO, "%s: consumer %u of %u of group %s on %s", c->consumer,
             rank + 1, members, c->group, c->stream);
    od->members = members;
    od->rank = rank;
    return 0;
}

/* Takes the other consumers' pending entries of a partition just taken;
 * those deleted from the stream meanwhile are dead-lettered as lost. */
static int take_pending(struct outbox_consumer *c, struct part *pt, int replay)
{
    const char *stream = replay ? pt->replay : pt->stream;
    for (int round = 0; round < 1000 && c->wr != NULL; round++) {
        redisReply *r =
            fcall(c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_TAKE, "2", stream,
                                      pt->lease, c->group, c->consumer, pt->token_s, "100", NULL});
        if (r == NULL)
            return -1;
        if (lease_lost_reply(r)) {
            freeReplyObject(r);
            part_lost(c, pt, "taken by another consumer while taking its entries over");
            return -1;
        }
        if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
            r->element[0]->type != REDIS_REPLY_ARRAY || r->element[1]->type != REDIS_REPLY_ARRAY) {
            problem(c, OUTBOX_CONSUMER_ERR_REDIS, "taking over the entries of %s failed: %s",
                    stream, r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
            freeReplyObject(r);
            return -1;
        }
        const redisReply *asked = r->element[0], *got = r->element[1];
        size_t n = asked->elements;
        c->stats.reclaimed += got->elements;
        struct lease_ref lr = {pt->lease, pt->token_s, pt->dlq};
        for (size_t i = 0; i < n && c->wr != NULL; i++) {
            const char *id = asked->element[i]->str;
            int present = 0;
            for (size_t j = 0; j < got->elements && !present; j++)
                present = got->element[j]->type == REDIS_REPLY_ARRAY &&
                          got->element[j]->elements == 2 &&
                          strcmp(got->element[j]->element[0]->str, id) == 0;
            if (!present) {
                c->stats.lost++;
                dead_letter_under(c, stream, &lr, id, NULL, "lost",
                                  "the entry was deleted or trimmed from the stream while pending",
                                  1);
            }
        }
        freeReplyObject(r);
        if (n < 100)
            return 0;
    }
    return 0;
}

/* The group's last delivered id on a stream, for XREAD to wait after. */
static void last_delivered(struct outbox_consumer *c, const char *stream, char *out, size_t outlen)
{
    redisReply *r = fcall(c, (const char *[]){"XINFO", "GROUPS", stream, NULL});
    if (r == NULL)
        return;
    for (size_t i = 0; r->type == REDIS_REPLY_ARRAY && i < r->elements; i++) {
        const redisReply *g = r->element[i];
        const char *name = NULL, *last = NULL;
        for (size_t k = 0; g->type == REDIS_REPLY_ARRAY && k + 1 < g->elements; k += 2) {
            if (g->element[k]->type != REDIS_REPLY_STRING ||
                g->element[k + 1]->type != REDIS_REPLY_STRING)
                continue;
            if (strcmp(g->element[k]->str, "name") == 0)
                name = g->element[k + 1]->str;
            else if (strcmp(g->element[k]->str, "last-delivered-id") == 0)
                last = g->element[k + 1]->str;
        }
        if (name != NULL && last != NULL && strcmp(name, c->group) == 0)
            snprintf(out, outlen, "%s", last);
    }
    freeReplyObject(r);
}

/* Takes the others' pending entries over and reads the parked keys; until
 * both are done (a failure is tried again at the next upkeep), nothing of
 * the partition is read or handled. */
static void finish_take(struct outbox_consumer *c, struct part *pt)
{
    if (pt->token == 0 || pt->ready)
        return;
    if (take_pending(c, pt, 0) == 0 && pt->token != 0 && take_pending(c, pt, 1) == 0 &&
        pt->token != 0 && load_parked(c, pt) == 0)
        pt->ready = 1;
}

static void take_part(struct outbox_consumer *c, struct part *pt, long long now)
{
    redisReply *r =
        fcall(c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_LEASE, "2", pt->lease,
                                  pt->tokens, c->consumer, c->lease_ms_s, "0", NULL});
    if (r == NULL)
        return;
    long long token = 0;
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 3 &&
        r->element[0]->type == REDIS_REPLY_INTEGER)
        token = r->element[0]->integer;
    else if (r->type == REDIS_REPLY_ERROR)
        problem(c, OUTBOX_CONSUMER_ERR_REDIS, "taking the lease of %s failed: %s", pt->stream,
                r->str);
    freeReplyObject(r);
    if (token <= 0)
        return;
    pt->token = token;
    snprintf(pt->token_s, sizeof(pt->token_s), "%lld", token);
    pt->valid_until = now + c->o.lease_ms;
    for (int s = 0; s < 2; s++) {
        pt->pel_done[s] = 0;
        snprintf(pt->pel_cursor[s], sizeof(pt->pel_cursor[s]), "0");
        pt->last_id[s][0] = '\0';
    }
    c->stats.leases_taken++;
    emit(c, OUTBOX_CONSUMER_LOG_INFO, "%s: took %s (lease token %lld)", c->consumer, pt->stream,
         token);
    finish_take(c, pt);
}

static void release_part(struct outbox_consumer *c, struct part *pt, const char *why)
{
    if (pt->token == 0)
        return;
    redisReply *r = fcall(c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_RELEASE, "1",
                                              pt->lease, pt->token_s, NULL});
    if (r != NULL)
        freeReplyObject(r);
    emit(c, OUTBOX_CONSUMER_LOG_INFO, "%s: released %s (%s)", c->consumer, pt->stream, why);
    part_drop(pt);
}

/* Beats, renews, gives up what is not this consumer's share and takes what
 * is. */
static void upkeep(struct outbox_consumer *c, struct ordered *od)
{
    use_base(c);
    if (beat(c, od) < 0)
        return;
    for (uint32_t i = 0; i < od->n && c->wr != NULL && !c->stop; i++) {
        struct part *pt = &od->parts[i];
        use_part(c, pt);
        long long now = now_ms();
        int mine = outbox_order_mine(pt->p, od->rank, od->members);
        if (pt->token != 0 && !mine) {
            release_part(c, pt, "another consumer's share now");
        } else if (pt->token != 0) {
            redisReply *r = fcall(c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_LEASE, "2",
                                                      pt->lease, pt->tokens, c->consumer,
                                                      c->lease_ms_s, pt->token_s, NULL});
            if (r == NULL)
                return;
            if (r->type == REDIS_REPLY_ARRAY && r->elements == 3 &&
                r->element[0]->type == REDIS_REPLY_INTEGER && r->element[0]->integer == pt->token)
                pt->valid_until = now + c->o.lease_ms;
            else
                part_lost(c, pt, "it expired before it was renewed");
            freeReplyObject(r);
            if (pt->token != 0 && !pt->ready)
                finish_take(c, pt);
            else if (pt->token != 0)
                load_parked(c, pt);
        } else if (mine) {
            take_part(c, pt, now);
        }
    }
}

/* Appends a read's entries to a partition's hand; returns how many. */
static size_t keep_entries(struct part *pt, redisReply *r, int replay, const redisReply *counts,
                           char *last, size_t lastlen)
{
    size_t n = 0;
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 1)
        return 0;
    redisReply *sr = r->element[0];
    if (sr->type != REDIS_REPLY_ARRAY || sr->elements != 2 ||
        sr->element[1]->type != REDIS_REPLY_ARRAY)
        return 0;
    redisReply *entries = sr->element[1];
    for (size_t i = 0; i < entries->elements && pt->nq < ORDER_QUEUE_MAX; i++) {
        redisReply *e = entries->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements != 2 ||
            e->element[0]->type != REDIS_REPLY_STRING)
            continue;
        /* Read again after an unpark: what is in hand stays as it is. */
        int in_hand = 0;
        for (size_t k = 0; k < pt->nq && !in_hand; k++)
            in_hand = pt->q[k].replayed == replay &&
                      strcmp(pt->q[k].entry->element[0]->str, e->element[0]->str) == 0;
        size_t key_len = 0;
        const char *key = entry_key(e, &key_len);
        snprintf(last, lastlen, "%s", e->element[0]->str);
        n++;
        if (in_hand || is_parked(pt, key, key_len))
            continue; /* a parked key's messages stay pending, out of hand */
        uint32_t deliveries = 1;
        for (size_t k = 0; counts != NULL && k < counts->elements; k++) {
            const redisReply *pe = counts->element[k];
            /* [id, consumer, idle ms, deliveries]: skip an entry of any
             * other shape, as reclaim_stream does. */
            if (pe->type == REDIS_REPLY_ARRAY && pe->elements == 4 &&
                pe->element[0]->type == REDIS_REPLY_STRING &&
                pe->element[3]->type == REDIS_REPLY_INTEGER &&
                strcmp(pe->element[0]->str, e->element[0]->str) == 0)
                deliveries = (uint32_t)pe->element[3]->integer;
        }
        struct held *h = &pt->q[pt->nq++];
        h->entry = e;
        h->replayed = replay;
        h->deliveries = deliveries;
        h->retry_at = 0;
        h->done = 0;
        h->dropped = 0;
        h->dl_reason = h->dl_why = NULL;
        entries->element[i] = NULL; /* ours now: freeReplyObject skips NULL */
    }
    return n;
}

/* Reads into the partitions' hands: each partition's own pending entries
 * first (after a take-over or a restart), then new ones. Returns how many
 * entries came. */
static void order_item(const struct held *h, struct outbox_order_item *it);

/* Whether any entry in a partition's hand may be handled now. */
static int any_ready(const struct part *pt, long long now)
{
    struct outbox_order_item items[ORDER_QUEUE_MAX];
    for (size_t i = 0; i < pt->nq; i++)
        order_item(&pt->q[i], &items[i]);
    return outbox_order_next(items, pt->nq, now, NULL) >= 0;
}

static size_t fill(struct outbox_consumer *c, struct ordered *od)
{
    size_t got = 0;
    for (uint32_t i = 0; i < od->n && c->wr != NULL && !c->stop; i++) {
        struct part *pt = &od->parts[i];
        use_part(c, pt);
        /* count entries in hand; more, up to ORDER_QUEUE_MAX, while all of
         * them wait behind retries, so that the other keys go on. */
        size_t limit = any_ready(pt, now_ms()) ? c->o.count : ORDER_QUEUE_MAX;
        for (int s = 0; s < 2 && pt->token != 0 && pt->ready && c->wr != NULL; s++) {
            if (pt->nq >= limit)
                break;
            const char *stream = s ? pt->replay : pt->stream;
            char count[24];
            size_t room = limit - pt->nq;
            snprintf(count, sizeof(count), "%zu", room > c->o.count ? (size_t)c->o.count : room);
            const char *from = pt->pel_done[s] ? ">" : pt->pel_cursor[s];
            redisReply *counts = NULL;
            if (!pt->pel_done[s]) {
                /* The delivery counts of our own pending entries. */
                const char *start = strcmp(from, "0") == 0 ? "-" : from;
                char excl[80];
                if (strcmp(start, "-") != 0) {
                    snprintf(excl, sizeof(excl), "(%s", start);
                    start = excl;
                }
                counts = fcall(c, (const char *[]){"XPENDING", stream, c->group, start, "+", count,
                                                   c->consumer, NULL});
                if (counts == NULL)
                    return got;
            }
            redisReply *r = fcall(c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_READ, "2",
                                                      stream, pt->lease, c->group, c->consumer,
                                                      pt->token_s, count, from, NULL});
            if (r == NULL) {
                freeReplyObject(counts);
                return got;
            }
            if (lease_lost_reply(r)) {
                part_lost(c, pt, "another consumer holds it");
            } else if (r->type == REDIS_REPLY_ERROR) {
                problem(c, OUTBOX_CONSUMER_ERR_REDIS, "reading %s failed: %s", stream, r->str);
                reconnect_if_needed(c, r);
            } else {
                size_t want = (size_t)atoi(count);
                /* XREAD waits after the last entry delivered to the group:
                 * the last new one read, never one of our pending ones. */
                int pel = !pt->pel_done[s];
                size_t n = keep_entries(pt, r, s, counts, pel ? pt->pel_cursor[s] : pt->last_id[s],
                                        sizeof(pt->last_id[s]));
                got += n;
                if (pel) {
                    if (n < want)
                        pt->pel_done[s] = 1;
                } else if (n == 0 && pt->last_id[s][0] == '\0') {
                    last_delivered(c, stream, pt->last_id[s], sizeof(pt->last_id[s]));
                }
            }
            freeReplyObject(r);
            freeReplyObject(counts);
        }
    }
    return got;
}

/* Handles one entry of a partition; the outcome is recorded in h. */
/* How long an entry waits after Redis refused its acknowledgement or its
 * dead letter (OOM, READONLY, a key of the wrong type) before it is tried
 * again. */
#define RETRY_AFTER_REFUSAL_MS 1000

/* Remembers a dead letter that could not be written, to write it again
 * later without calling the handler once more. */
static void keep_dead_letter(struct held *h, const char *reason, const char *why)
{
    if (h->dl_reason == NULL) {
        h->dl_reason = strdup(reason);
        h->dl_why = strdup(why);
    }
    h->retry_at = now_ms() + RETRY_AFTER_REFUSAL_MS;
}

static void handle_held(struct outbox_consumer *c, struct part *pt, struct held *h)
{
    const char *stream = h->replayed ? pt->replay : pt->stream;
    const char *entry_id = h->entry->element[0]->str;
    const redisReply *fields = h->entry->element[1];
    struct lease_ref lr = {pt->lease, pt->token_s, pt->dlq};
    const char *reason = NULL;
    char why[512] = "";

    struct outbox_message m;
    const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
    size_t vlens[OUTBOX_HEADERS_MAX];
    memset(&m, 0, sizeof(m));
    const char *bad =
        fields->type == REDIS_REPLY_NIL ? NULL : parse_message(fields, &m, names, values, vlens);
    if (fields->type == REDIS_REPLY_NIL)
        fields = NULL;
    if (h->dl_reason != NULL) {
        /* Its dead letter was refused before: write it again, without
         * calling the handler once more. */
        reason = h->dl_reason;
        snprintf(why, sizeof(why), "%s", h->dl_why != NULL ? h->dl_why : "");
    } else if (fields == NULL) {
        c->stats.lost++;
        reason = "lost";
        snprintf(why, sizeof(why),
                 "the entry was deleted or trimmed from the stream while pending");
    } else if (bad != NULL) {
        c->stats.malformed++;
        reason = "malformed";
        snprintf(why, sizeof(why), "malformed: %s", bad);
    } else if (h->deliveries > c->o.max_deliveries) {
        reason = "exhausted";
        snprintf(why, sizeof(why),
                 "delivered %u times (max_deliveries %u): the consumer of the last delivery did "
                 "not finish it",
                 h->deliveries, c->o.max_deliveries);
    } else {
        m.stream = stream;
        m.entry_id = entry_id;
        m.deliveries = h->deliveries;
        c->stats.delivered++;
        enum outbox_handled result = c->handler(&m, c->arg, why, sizeof(why));
        if (why[0] == '\0')
            snprintf(why, sizeof(why), "the handler gave no reason");
        if (result == OUTBOX_HANDLED_DONE) {
            redisReply *r =
                fcall(c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_ACK, "2", stream,
                                          pt->lease, c->group, pt->token_s, entry_id, NULL});
            if (r == NULL)
                return;
            if (r->type == REDIS_REPLY_INTEGER) {
                c->stats.done++;
                h->done = 1;
                clear_error(c);
            } else if (lease_lost_reply(r)) {
                freeReplyObject(r);
                part_lost(c, pt, "it ran out while a message was handled");
                return;
            } else {
                /* Handled again after a pause: the processed table makes the
                 * second call a no-op. */
                problem(c, OUTBOX_CONSUMER_ERR_REDIS, "acknowledging %s %s failed: %s", stream,
                        entry_id, r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
                h->retry_at = now_ms() + RETRY_AFTER_REFUSAL_MS;
                reconnect_if_needed(c, r);
            }
            freeReplyObject(r);
            return;
        }
        if (result == OUTBOX_HANDLED_FAIL) {
            reason = "permanent";
        } else if (h->deliveries >= c->o.max_deliveries) {
            reason = "exhausted";
        } else {
            uint32_t wait = outbox_consumer_backoff_ms(&c->o, h->deliveries);
            c->stats.retried++;
            emit(c, OUTBOX_CONSUMER_LOG_INFO,
                 "%s %s (message %s, key %.*s) will be retried in %u ms (delivery %u of %u); "
                 "later messages of its key wait: %s",
                 stream, entry_id, m.id, m.key != NULL ? (int)m.key_len : 6,
                 m.key != NULL ? m.key : "(none)", wait, h->deliveries, c->o.max_deliveries, why);
            h->retry_at = now_ms() + wait;
            h->deliveries++;
            return;
        }
    }
    size_t key_len = 0;
    const char *key = entry_key(h->entry, &key_len);
    if (c->o.park_keys && key != NULL && !is_parked(pt, key, key_len)) {
        /* Parked before the dead letter: should the dead letter fail, the
         * key is parked all the same, and nothing of it runs ahead. */
        const char *argv[] = {"SADD", pt->parked_key, key, NULL};
        size_t lens[3] = {4, strlen(pt->parked_key), key_len};
        redisReply *r = command(c->wr, 3, argv, lens);
        if (r == NULL) {
            problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s", c->wr->errstr);
            disconnect(c);
            return;
        }
        int parked = r->type == REDIS_REPLY_INTEGER;
        if (!parked)
            problem(c, OUTBOX_CONSUMER_ERR_REDIS,
                    "parking key %.*s in %s failed: %s; its dead letter waits until it can be"
                    " parked",
                    (int)key_len, key, pt->parked_key,
                    r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        freeReplyObject(r);
        if (!parked || load_parked(c, pt) < 0 || c->wr == NULL) {
            keep_dead_letter(h, reason, why);
            return;
        }
        emit(c, OUTBOX_CONSUMER_LOG_WARNING,
             "%s: key %.*s parked on %s: its later messages wait until an operator removes it "
             "from %s",
             c->consumer, (int)key_len, key, pt->stream, pt->parked_key);
    }
    int rc = dead_letter_under(c, stream, &lr, entry_id, fields, reason, why, h->deliveries);
    if (rc == 0)
        h->done = 1;
    else if (rc == RELAY_LEASE_LOST)
        part_lost(c, pt, "it ran out while a message was dead-lettered");
    else
        keep_dead_letter(h, reason, why);
    if (rc == 0 && c->o.park_keys && key != NULL)
        for (size_t i = 0; i < pt->nq; i++) {
            size_t len = 0;
            const char *k = entry_key(pt->q[i].entry, &len);
            if (&pt->q[i] != h && k != NULL && len == key_len && memcmp(k, key, len) == 0)
                pt->q[i].dropped = 1;
        }
}

/* The key of an entry in hand, for outbox_order_next. */
static void order_item(const struct held *h, struct outbox_order_item *it)
{
    memset(it, 0, sizeof(*it));
    it->retry_at = h->retry_at;
    it->done = h->done;
    const redisReply *fields = h->entry->element[1];
    if (fields->type == REDIS_REPLY_ARRAY) {
        size_t len = 0;
        const redisReply *k = field(fields, "key", &len);
        if (k != NULL) {
            it->key = k->str;
            it->key_len = len;
            it->has_key = 1;
        }
    }
}

/* Drops the entries that are done from a partition's hand. */
static void compact(struct part *pt)
{
    size_t w = 0;
    for (size_t i = 0; i < pt->nq; i++) {
        if (pt->q[i].done || pt->q[i].dropped)
            held_free(&pt->q[i]);
        else
            pt->q[w++] = pt->q[i];
    }
    pt->nq = w;
}

/* Handles the next entry of the next partition that has one ready; 1 when
 * it did, 0 when none is ready (*wake_at: the earliest backoff's end, or
 * -1). */
static int handle_next(struct outbox_consumer *c, struct ordered *od, long long *wake_at)
{
    long long now = now_ms();
    *wake_at = -1;
    for (uint32_t k = 0; k < od->n; k++) {
        struct part *pt = &od->parts[(od->rr + k) % od->n];
        if (pt->token == 0 || !pt->ready || pt->nq == 0)
            continue;
        if (now >= pt->valid_until) {
            part_lost(c, pt, "it was not renewed in time");
            continue;
        }
        struct outbox_order_item items[ORDER_QUEUE_MAX];
        for (size_t i = 0; i < pt->nq; i++)
            order_item(&pt->q[i], &items[i]);
        long long wake = -1;
        long next = outbox_order_next(items, pt->nq, now, &wake);
        if (next < 0) {
            if (wake >= 0 && (*wake_at < 0 || wake < *wake_at))
                *wake_at = wake;
            continue;
        }
        od->rr = (od->rr + k + 1) % od->n;
        use_part(c, pt);
        handle_held(c, pt, &pt->q[next]);
        compact(pt);
        return 1;
    }
    return 0;
}

/* Whether XREAD waits for new entries of a partition's stream (s 0) or
 * replay stream (s 1): held, taken over, read up to the group's last entry,
 * and room in hand (with a full hand, new entries would wake it for
 * nothing). */
static int waits_on(const struct part *pt, int s)
{
    return pt->token != 0 && pt->ready && pt->last_id[s][0] != '\0' && pt->nq < ORDER_QUEUE_MAX;
}

/* Waits for new entries on the held partitions (plain XREAD: it changes
 * nothing), a backoff's end or the next upkeep, whichever comes first. */
static void wait_for_entries(struct outbox_consumer *c, struct ordered *od, long long wake_at)
{
    long long now = now_ms();
    long long until = od->next_upkeep;
    if (wake_at >= 0 && wake_at < until)
        until = wake_at;
    long long ms = until - now;
    if (ms > (long long)c->o.block_ms)
        ms = c->o.block_ms;
    if (ms < 1)
        return;
    size_t n = 0;
    for (uint32_t i = 0; i < od->n; i++)
        for (int s = 0; s < 2; s++)
            n += waits_on(&od->parts[i], s);
    if (n == 0) {
        sleep_ms_interruptible(c, (uint32_t)ms);
        return;
    }
    if (od->poll) {
        sleep_ms_interruptible(c, ms > ORDER_POLL_MS ? ORDER_POLL_MS : (uint32_t)ms);
        return;
    }
    const char **argv = calloc(2 * n + 6, sizeof(*argv));
    size_t *lens = calloc(2 * n + 6, sizeof(*lens));
    if (argv == NULL || lens == NULL) {
        free(argv);
        free(lens);
        sleep_ms_interruptible(c, (uint32_t)ms);
        return;
    }
    char block[16];
    snprintf(block, sizeof(block), "%lld", ms);
    size_t argc = 0;
    argv[argc++] = "XREAD";
    argv[argc++] = "COUNT";
    argv[argc++] = "1";
    argv[argc++] = "BLOCK";
    argv[argc++] = block;
    argv[argc++] = "STREAMS";
    for (uint32_t i = 0; i < od->n; i++)
        for (int s = 0; s < 2; s++)
            if (waits_on(&od->parts[i], s))
                argv[argc++] = s ? od->parts[i].replay : od->parts[i].stream;
    for (uint32_t i = 0; i < od->n; i++)
        for (int s = 0; s < 2; s++)
            if (waits_on(&od->parts[i], s))
                argv[argc++] = od->parts[i].last_id[s];
    for (size_t i = 0; i < argc; i++)
        lens[i] = strlen(argv[i]);
    redisReply *r = command(c->rd, (int)argc, argv, lens);
    if (r == NULL) {
        problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost while waiting: %s",
                c->rd->errstr);
        disconnect(c);
    } else {
        if (r->type == REDIS_REPLY_ERROR &&
            (strncmp(r->str, "CROSSSLOT", 9) == 0 || strncmp(r->str, "MOVED ", 6) == 0)) {
            /* A cluster, even with a single primary: its partitions are in
             * different slots. */
            od->poll = 1;
            emit(c, OUTBOX_CONSUMER_LOG_INFO,
                 "%s: the partitions of %s are in different hash slots of a Redis Cluster: "
                 "reading them every %d ms",
                 c->consumer, c->stream, ORDER_POLL_MS);
        }
        freeReplyObject(r);
    }
    free(argv);
    free(lens);
}

static int same_server(const redisContext *a, const redisContext *b)
{
    return a->tcp.host != NULL && b->tcp.host != NULL && a->tcp.port == b->tcp.port &&
           strcmp(a->tcp.host, b->tcp.host) == 0;
}

/* Finds a partition's connection: the primary of its stream's slot, shared
 * by every partition there. A primary met for the first time gets the
 * functions loaded. */
static int attach_part(struct outbox_consumer *c, struct part *pt)
{
    redisContext *ctx = open_conn_for(c, pt->stream, c->o.command_timeout_ms, "ack");
    if (ctx == NULL)
        return -1;
    for (int i = 0; i < c->nnodes; i++) {
        if (same_server(c->node[i], ctx)) {
            redisFree(ctx);
            pt->node = i;
            return 0;
        }
    }
    if (c->nnodes == CONSUMER_NODES_MAX) {
        redisFree(ctx);
        problem(c, OUTBOX_CONSUMER_ERR_REDIS,
                "the partitions of %s are on more than %d primaries: use fewer partitions",
                c->stream, CONSUMER_NODES_MAX);
        return -1;
    }
    pt->node = c->nnodes;
    c->node[c->nnodes++] = ctx;
    c->wr = ctx;
    return load_function(c);
}

static int connect_ordered(struct outbox_consumer *c, struct ordered *od)
{
    disconnect(c);
    c->wr = open_conn(c, c->o.command_timeout_ms, "ack");
    if (c->wr == NULL)
        goto fail;
    c->node[0] = c->wr;
    c->nnodes = 1;
    if (load_function(c) < 0)
        goto fail;
    /* In a Redis Cluster the partition streams hash to different slots:
     * each partition's commands go to its own primary. A single server (its
     * CLUSTER SLOTS is an error) serves them all on this connection. */
    redisReply *slots = fcall(c, (const char *[]){"CLUSTER", "SLOTS", NULL});
    if (slots == NULL)
        goto fail;
    int cluster = slots->type == REDIS_REPLY_ARRAY;
    freeReplyObject(slots);
    for (uint32_t i = 0; i < od->n; i++) {
        od->parts[i].node = 0;
        if (cluster && attach_part(c, &od->parts[i]) < 0)
            goto fail;
    }
    od->poll = c->nnodes > 1;
    use_base(c);
    c->rd = open_conn(c, c->o.block_ms + c->o.command_timeout_ms, "read");
    if (c->rd == NULL)
        goto fail;
    for (uint32_t i = 0; i < od->n; i++) {
        use_part(c, &od->parts[i]);
        migrate_name(c, od->parts[i].stream, od->parts[i].dlq, 0);
        migrate_name(c, od->parts[i].stream, od->parts[i].replay, 1);
        if (ensure_group(c, od->parts[i].stream) < 0 || ensure_group(c, od->parts[i].replay) < 0)
            goto fail;
    }
    use_base(c);
    /* What was in hand may have been acknowledged with the reply lost: read
     * it again from the pending list, after taking over again what others
     * left. */
    for (uint32_t i = 0; i < od->n; i++) {
        struct part *pt = &od->parts[i];
        for (size_t k = 0; k < pt->nq; k++)
            held_free(&pt->q[k]);
        pt->nq = 0;
        pt->ready = 0;
        for (int s = 0; s < 2; s++) {
            pt->pel_done[s] = 0;
            snprintf(pt->pel_cursor[s], sizeof(pt->pel_cursor[s]), "0");
            pt->last_id[s][0] = '\0';
        }
    }
    emit(c, OUTBOX_CONSUMER_LOG_INFO,
         "%s: %s the %u partitions of %s as group %s, in order per key (leases of %u ms)",
         c->consumer, c->last_error[0] != '\0' ? "connected again, reading" : "reading", od->n,
         c->stream, c->group, c->o.lease_ms);
    c->last_error[0] = '\0';
    clear_error(c);
    outbox_backoff_reset(&c->reconnect);
    od->next_upkeep = 0;
    return 0;
fail:
    disconnect(c);
    return -1;
}

static int run_ordered(struct outbox_consumer *c)
{
    struct ordered od;
    memset(&od, 0, sizeof(od));
    od.n = c->o.partitions;
    od.parts = calloc(od.n, sizeof(*od.parts));
    if (od.parts == NULL || outbox_key_lease(c->stream, c->group, "lease-members", od.members_key,
                                             sizeof(od.members_key)) < 0) {
        free(od.parts);
        set_error(c, OUTBOX_CONSUMER_ERR_OOM, "out of memory for the partitions");
        return -1;
    }
    for (uint32_t i = 0; i < od.n; i++) {
        struct part *pt = &od.parts[i];
        pt->p = i;
        /* outbox_consumer_new checked that every name fits. */
        if (outbox_key_partition_stream(NULL, c->stream, strlen(c->stream), i, od.n, pt->stream,
                                        sizeof(pt->stream)) < 0 ||
            outbox_consumer_replay_name(pt->stream, c->group, pt->replay, sizeof(pt->replay)) < 0 ||
            outbox_consumer_dlq_name(pt->stream, c->group, pt->dlq, sizeof(pt->dlq)) < 0 ||
            outbox_consumer_lease_names(pt->stream, c->group, pt->lease, pt->tokens,
                                        sizeof(pt->lease)) < 0 ||
            outbox_key_lease(pt->stream, c->group, "parked", pt->parked_key,
                             sizeof(pt->parked_key)) < 0) {
            free(od.parts);
            set_error(c, OUTBOX_CONSUMER_ERR_OOM, "a partition's key names do not fit");
            return -1;
        }
    }
    while (!c->stop) {
        if (c->wr == NULL || c->rd == NULL) {
            if (connect_ordered(c, &od) < 0) {
                sleep_ms_interruptible(c,
                                       outbox_backoff_next(&c->reconnect, outbox_backoff_random()));
                continue;
            }
        }
        long long now = now_ms();
        if (now >= od.next_upkeep) {
            od.next_upkeep = now + c->o.lease_ms / 3;
            upkeep(c, &od);
            continue;
        }
        long long wake_at = -1;
        if (handle_next(c, &od, &wake_at))
            continue;
        if (c->wr == NULL || fill(c, &od) > 0 || c->wr == NULL)
            continue;
        wait_for_entries(c, &od, wake_at);
    }
    /* A clean stop gives the partitions up at once, rather than after the
     * leases run out, and leaves the members, so that the others count it
     * out at their next beat. */
    for (uint32_t i = 0; i < od.n; i++) {
        use_part(c, &od.parts[i]);
        if (c->wr != NULL)
            release_part(c, &od.parts[i], "stopping");
        part_drop(&od.parts[i]);
    }
    use_base(c);
    redisReply *r = fcall(c, (const char *[]){"ZREM", od.members_key, c->consumer, NULL});
    freeReplyObject(r);
    free(od.parts);
    return 0;
}

int outbox_consumer_run(struct outbox_consumer *c)
{
    uint64_t horizon = outbox_consumer_redelivery_horizon_ms(&c->o);
    if (c->o.processed_horizon_ms > 0 && c->o.processed_horizon_ms < horizon)
        emit(c, OUTBOX_CONSUMER_LOG_WARNING,
             "the processed-table horizon (%llu ms) is shorter than the redelivery horizon "
             "(%llu ms), as allow_short_processed_horizon allows: a message delivered again "
             "after its processed row was purged is handled twice",
             (unsigned long long)c->o.processed_horizon_ms, (unsigned long long)horizon);
    if (c->o.partitions > 1) {
        int rc = run_ordered(c);
        emit(c, OUTBOX_CONSUMER_LOG_INFO,
             "%s stopped: %llu delivered, %llu done, %llu retried, %llu dead-lettered "
             "(%llu malformed, %llu lost), %llu taken over; %llu partitions taken, %llu lost",
             c->consumer, c->stats.delivered, c->stats.done, c->stats.retried,
             c->stats.dead_lettered, c->stats.malformed, c->stats.lost, c->stats.reclaimed,
             c->stats.leases_taken, c->stats.leases_lost);
        disconnect(c);
        return rc;
    }
    while (!c->stop) {
        if (c->wr == NULL || c->rd == NULL) {
            if (connect_all(c) < 0) {
                sleep_ms_interruptible(c,
                                       outbox_backoff_next(&c->reconnect, outbox_backoff_random()));
                continue;
            }
        }
        long long now = now_ms();
        if (now - c->last_reclaim_ms >= (long long)c->o.reclaim_interval_ms) {
            c->last_reclaim_ms = now;
            reclaim_stream(c, c->stream);
            if (c->wr != NULL && !c->stop)
                reclaim_stream(c, c->replay);
            if (c->wr == NULL || c->stop)
                continue;
        }
        read_once(c);
    }
    emit(c, OUTBOX_CONSUMER_LOG_INFO,
         "%s stopped: %llu delivered, %llu done, %llu retried, %llu dead-lettered "
         "(%llu malformed, %llu lost), %llu taken over",
         c->consumer, c->stats.delivered, c->stats.done, c->stats.retried, c->stats.dead_lettered,
         c->stats.malformed, c->stats.lost, c->stats.reclaimed);
    disconnect(c);
    return 0;
}
