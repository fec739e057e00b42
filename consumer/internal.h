/*
 * What the files of the consumer library share: the object behind struct
 * outbox_consumer, and the steps each file offers the others.
 *
 *   consumer.c    the public API: options, accessors, run and stop
 *   policy.c      the names of a group's keys, the backoff schedule
 *   report.c      the log hook and the most recent failure
 *   connection.c  connections, the function library, groups, renamed keys
 *   messages.c    entries against the stream contract; dead letters
 *   unordered.c   the unordered mode: read, handle, reclaim
 *   ordered.c     the ordered mode: each partition's entries in hand, in order
 *   part.c        its partitions and the entries in hand (part.h)
 *   leases.c      its partitions' leases, members and parked keys (leases.h)
 *   order.c       its pure decisions (order.h)
 *
 * None of it leaves the shared library (consumer/outbox_consumer.map).
 */
#ifndef OUTBOX_CONSUMER_INTERNAL_H
#define OUTBOX_CONSUMER_INTERNAL_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "common/backoff.h"
#include "common/url.h"
#include "outbox/consumer.h"

struct redisContext;
struct redisReply;

/* Longest stream, group or consumer name (less what the key names add). */
#define NAME_MAX_LEN 512
/* The entries an ordered consumer holds in hand per partition, at most. */
#define ORDER_QUEUE_MAX 256
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
    uint32_t min_backoff_ms; /* the shortest backoff step */

    struct redisContext *rd; /* XREADGROUP BLOCK */
    struct redisContext *wr; /* everything else; in the ordered mode, one of node[] */
    /* The ordered mode's connections, one per primary its partitions are on
     * (node[0]: the primary of the topic's stream, for the members key). */
    struct redisContext *node[CONSUMER_NODES_MAX];
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

static inline long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The two modes (unordered.c, ordered.c): each runs until stop and returns
 * what outbox_consumer_run returns. */
int outbox_unordered_run(struct outbox_consumer *c);
int outbox_ordered_run(struct outbox_consumer *c);

/* ---- report.c ----------------------------------------------------------- */

/* Hands one event to the log hook, as one line. */
void outbox_report_emit(const struct outbox_consumer *c, enum outbox_consumer_log_level level,
                        const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Records the most recent failure for outbox_consumer_err/errstr, or clears it. */
void outbox_report_set_error(struct outbox_consumer *c, enum outbox_consumer_err kind,
                             const char *text);
void outbox_report_clear_error(struct outbox_consumer *c);

/* Records a problem that run retries, and logs it as an error once per
 * change of its text (a repeat is a debug line). */
void outbox_report_problem(struct outbox_consumer *c, enum outbox_consumer_err kind,
                           const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- connection.c ------------------------------------------------------- */

/* One command with the context's deadline. NULL when the connection failed. */
struct redisReply *outbox_conn_command(struct redisContext *ctx, int argc, const char **argv,
                                       const size_t *lens);

/* One command on c->wr, its arguments NULL-terminated (at most 15); NULL when
 * the connection failed (then logged and closed) or was lost before. */
struct redisReply *outbox_conn_call(struct outbox_consumer *c, const char **argv);

/* A connection for the commands of one stream (and the keys in its slot),
 * named "<consumer>:<role>"; NULL, with the problem recorded, when it cannot
 * be made. */
struct redisContext *outbox_conn_open(struct outbox_consumer *c, const char *stream,
                                      uint32_t timeout_ms, const char *role);

/* Closes every connection of c. */
void outbox_conn_close_all(struct outbox_consumer *c);

/* FUNCTION LOAD REPLACE of the consumers' function library on c->wr: 0, or
 * -1 with the problem recorded. */
int outbox_conn_load_functions(struct outbox_consumer *c);

/* XGROUP CREATE of c's group on stream at 0 with MKSTREAM: 0 (also when it
 * exists), or -1 with the problem recorded. */
int outbox_conn_ensure_group(struct outbox_consumer *c, const char *stream);

/* Renames a dead-letter (replay 0) or replay stream of stream from its name
 * before 0.2 to now, when that is free; a warning when both exist. */
void outbox_conn_migrate_name(struct outbox_consumer *c, const char *stream, const char *now,
                              int replay);

/* Sleeps ms, or less when stop is asked. */
void outbox_conn_sleep(struct outbox_consumer *c, uint32_t ms);

/* Closes the connections after a refusal that connecting again cures. */
void outbox_conn_reconnect_if_needed(struct outbox_consumer *c, const struct redisReply *r);

/* ---- messages.c --------------------------------------------------------- */

/* Checks the contract's fields of an entry and fills m (names, values and
 * vlens hold OUTBOX_HEADERS_MAX headers); NULL when fine, else what is
 * wrong. */
const char *outbox_msg_parse(const struct redisReply *fields, struct outbox_message *m,
                             const char **names, const char **values, size_t *vlens);

/* A field's value, and its length when len is not NULL. */
const struct redisReply *outbox_msg_field(const struct redisReply *fields, const char *name,
                                          size_t *len);

/* A stream entry's key, or NULL (no key, or no fields: deleted). */
const char *outbox_msg_key(const struct redisReply *entry, size_t *len);

/* In the ordered mode, the lease a call is made under: its key, its token,
 * and the partition's dead-letter stream. */
struct lease_ref {
    const char *key;
    const char *token;
    const char *dlq;
};

/* What outbox_msg_dead_letter returns when the lease it was made under is
 * lost. */
#define OUTBOX_LEASE_LOST (-2)

/*
 * Moves one entry to the dead-letter stream and acknowledges it, in one call
 * of the dead-letter function (under a lease: the leased one). fields may be
 * NULL (a lost entry). Returns 0, -1 when Redis refused or failed (nothing
 * was acknowledged: the entry stays pending and a later pass delivers it
 * again), or, under a lease, OUTBOX_LEASE_LOST.
 */
int outbox_msg_dead_letter(struct outbox_consumer *c, const char *stream,
                           const struct lease_ref *lease, const char *entry_id,
                           const struct redisReply *fields, const char *reason, const char *error,
                           uint32_t deliveries);

/* Whether a reply is the lease functions' refusal (LEASELOST). */
int outbox_msg_lease_lost(const struct redisReply *r);

/* ---- policy.c ----------------------------------------------------------- */

/* The shortest backoff step of o (its own schedule, or the default one). */
uint32_t outbox_policy_min_backoff(const struct outbox_consumer_options *o);

#endif
