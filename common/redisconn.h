/*
 * The one Redis connect (common/redisconn.c), for every part that talks to
 * Redis with blocking calls: the consumer library, the dlq commands and the
 * daemon's observation thread. It connects within a deadline, turns TCP
 * keepalive on, authenticates (the ACL form AUTH user password when the URL
 * names a user) and selects the database, each step within the deadline
 * too. The daemon's event loop uses hiredis's async API instead
 * (relay/sink.c), and shares the few helpers at the end that need no
 * connection.
 */
#ifndef OUTBOX_REDISCONN_H
#define OUTBOX_REDISCONN_H

#include <stddef.h>
#include <stdint.h>

struct redisContext;
struct redisReply;
struct outbox_redis_url;

enum outbox_redis_fault {
    OUTBOX_REDIS_OK = 0,
    OUTBOX_REDIS_NOMEM,   /* out of memory */
    OUTBOX_REDIS_IO,      /* cannot connect, or no answer within the deadline */
    OUTBOX_REDIS_REFUSED, /* Redis answered with an error (AUTH, SELECT) */
    OUTBOX_REDIS_STOPPED, /* stop_fd became readable */
};

/*
 * The connection, or NULL with *fault set and a message in err that says what
 * to do (the password is never in it). Connecting and each set-up command
 * have connect_timeout_ms.
 *
 * stop_fd < 0: the context comes back blocking, and command_timeout_ms
 * bounds every command's reply from then on (hiredis's redisSetTimeout).
 * stop_fd >= 0: every wait also ends at once when stop_fd becomes readable,
 * and the context comes back non-blocking: send its commands with
 * outbox_redis_call (command_timeout_ms is then the caller's to pass).
 */
struct redisContext *outbox_redis_open(const struct outbox_redis_url *u,
                                       uint32_t connect_timeout_ms, uint32_t command_timeout_ms,
                                       int stop_fd, char *err, size_t errlen,
                                       enum outbox_redis_fault *fault)
    __attribute__((warn_unused_result));

/*
 * One command on a context from outbox_redis_open, of either kind: the reply (the caller frees it),
 * or NULL with c->err and c->errstr set, as hiredis does; then the context is done for and the
 * caller frees it. timeout_ms bounds sending the command and reading its reply; stop_fd (-1: none)
 * ends the wait at once.
 */
struct redisReply *outbox_redis_call(struct redisContext *c, int stop_fd, uint32_t timeout_ms,
                                     const char *fmt, ...) __attribute__((warn_unused_result))
__attribute__((format(printf, 4, 5)));

/* What a Sentinel's refusal of AUTH, or its NOAUTH, should make the operator check. */
#define OUTBOX_SENTINEL_AUTH_HINT " (check redis_sentinel_user and redis_sentinel_password)"

/*
 * Writes into out why a Sentinel at host:port named no primary, from its
 * answer r to SENTINEL get-master-addr-by-name ("Sentinel host:port knows no
 * master of that name"); lost is the text when no answer came (r NULL).
 */
void outbox_sentinel_describe(char *out, size_t outlen, const char *host, int port,
                              const struct redisReply *r, const char *lost);

/* A slot no primary serves, in outbox_cluster_slots_parse's map. */
#define OUTBOX_SLOT_UNCOVERED 0xff

/*
 * Reads a CLUSTER SLOTS reply: each distinct primary once into primaries (at
 * most max; an empty or "?" host is default_host, the node that was asked),
 * and, when slot_node is not NULL, each of the OUTBOX_CLUSTER_SLOTS slots'
 * primary as an index into primaries (OUTBOX_SLOT_UNCOVERED for none).
 * Returns the number of primaries, -1 when there are more than max, or -2
 * when r is not a slot map (a server without cluster support answers with an
 * error).
 */
struct outbox_addr;
int outbox_cluster_slots_parse(const struct redisReply *r, const char *default_host,
                               struct outbox_addr *primaries, int max, uint8_t *slot_node);

/*
 * outbox_redis_open for the commands of one key (a stream and the keys in its
 * hash slot): with Sentinels as outbox_redis_open; else the seed nodes of u in
 * turn until one connects, and when that node is one of a Redis Cluster, the
 * primary of the key's slot (CLUSTER SLOTS). A server that is not a cluster
 * node is used as it is.
 */
struct redisContext *outbox_redis_open_for_key(const struct outbox_redis_url *u, const char *key,
                                               uint32_t connect_timeout_ms,
                                               uint32_t command_timeout_ms, int stop_fd, char *err,
                                               size_t errlen, enum outbox_redis_fault *fault)
    __attribute__((warn_unused_result));

/*
 * Runs fn on every primary of the Redis Cluster that c is a node of, each on
 * a connection of its own opened with u's user and password (and freed
 * after), or on c itself when c's server is not a cluster node (CLUSTER
 * SLOTS answers with an error). Every key of one stream shares its hash slot
 * (docs/DESIGN.md, "Redis Cluster"), so what fn does with the streams it
 * finds on a node (SCAN) stays on that node. Returns the first nonzero value
 * fn returned, 0, or -1 with err when the slot map or a primary could not be
 * reached (c->err set when c failed).
 */
int outbox_redis_each_primary(struct redisContext *c, const struct outbox_redis_url *u,
                              uint32_t connect_timeout_ms, uint32_t command_timeout_ms, int stop_fd,
                              int (*fn)(struct redisContext *node, void *arg), void *arg, char *err,
                              size_t errlen) __attribute__((warn_unused_result));

/*
 * The hash slot of a command formatted in the Redis protocol, by the key it
 * names first: an FCALL's first key (after the function and the key count),
 * else the first argument; 0 when it names no key. In a cluster the slot
 * picks the primary the command goes to.
 */
unsigned outbox_redis_command_slot(const char *cmd, size_t len);

/* A deep copy of r, for a reply kept after its callback returns (hiredis
 * frees the reply then); the caller frees it with freeReplyObject. NULL when
 * out of memory, or nested deeper than any reply the relay reads. */
struct redisReply *outbox_redis_reply_copy(const struct redisReply *r)
    __attribute__((warn_unused_result));

#endif
