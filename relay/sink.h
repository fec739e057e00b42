/*
 * Redis side of the relay: hiredis async connections on the libev adapter,
 * one to a single server or one to each primary of a Redis Cluster (every
 * command goes to the primary of its key's hash slot). It connects with a
 * deadline, authenticates, selects the database, loads the function
 * libraries (the relay's trim function, and the consumers' functions),
 * checks what an acknowledged write is worth on this Redis, and reconnects
 * with jittered backoff when anything breaks. hiredis 0.14 has
 * no command timeouts, so the relay arms a deadline per chunk and the sink
 * drops the whole connection when it expires (all pending replies then
 * arrive as NULL).
 */
#ifndef RELAY_SINK_H
#define RELAY_SINK_H

#include <stddef.h>
#include <stdint.h>

struct ev_loop;
struct redisAsyncContext;
struct relay_config;
struct relay_sink;

/* Called once per command with hiredis's own callback signature (a single
 * server needs no wrapper per command; a cluster's commands carry one to
 * follow ASK): reply is a redisReply *, NULL when the
 * connection failed or was dropped, and freed by hiredis after the callback
 * returns. relay_sink_owner(ac) gives back the hooks' arg. */
typedef void relay_sink_reply_fn(struct redisAsyncContext *ac, void *reply, void *arg);

struct relay_sink_hooks {
    void *arg;
    void (*on_ready)(struct relay_sink *s, void *arg);
    void (*on_down)(struct relay_sink *s, void *arg);
};

struct relay_sink *relay_sink_new(struct ev_loop *loop, const struct relay_config *cfg,
                                  const struct relay_sink_hooks *hooks)
    __attribute__((warn_unused_result));

/* Disconnects now; pending callbacks run with NULL replies first. */
void relay_sink_free(struct relay_sink *s);

/* 1 when connected, authenticated and the function is loaded. */
int relay_sink_ready(const struct relay_sink *s);

/*
 * Queues one command already in the Redis protocol with its callback;
 * nothing is formatted here:
 * hiredis copies the bytes into its output buffer, so cmd may be reused as
 * soon as this returns.
 *
 * cmd[0 .. len) must hold exactly one complete command ("*<argc>\r\n" and
 * argc bulk strings). hiredis 0.14 queues one callback per call and cannot
 * tell how many commands the bytes hold: a second command's reply would find
 * no callback and hiredis would abort the process (or, for an error reply,
 * drop the connection), and every later reply would reach the wrong callback.
 * 0, or -1 when not ready or when cmd does not start like a command.
 */
int relay_sink_formatted(struct relay_sink *s, const char *cmd, size_t len, relay_sink_reply_fn *cb,
                         void *arg) __attribute__((warn_unused_result));

/*
 * Queues a transaction already in the Redis protocol: cmds[0 .. ends[n-1]),
 * n >= 3 commands, MULTI first and EXEC last (relay_batch_append_xadd_call),
 * command i ending at ends[i]. It goes to the node of its second command's
 * key (in a cluster), and cb runs once, with EXEC's reply, or, when a
 * command was refused while queued (memory full, MOVED, ASK), with that
 * command's error in place of EXEC's EXECABORT, or NULL when the connection
 * failed. In a cluster an ASK is followed: the whole transaction goes again
 * to the importing primary behind an ASKING, which holds through MULTI. 0, or
 * -1 when not ready or when nothing could be queued.
 */
int relay_sink_transaction(struct relay_sink *s, const char *cmds, const size_t *ends, size_t n,
                           relay_sink_reply_fn *cb, void *arg) __attribute__((warn_unused_result));

/* How many ASK replies (a slot in migration) the sink followed with ASKING. */
uint64_t relay_sink_asks_followed(const struct relay_sink *s);

/* Forgets which connections were written to (relay_sink_wait's set). */
void relay_sink_written_reset(struct relay_sink *s);
/* Counts every connection as written to: the next relay_sink_wait asks them
 * all (rows found in a stream already may not be on its replicas yet). */
void relay_sink_written_all(struct relay_sink *s);

/*
 * Sends WAIT replicas timeout_ms to every connection written to since the
 * last relay_sink_wait or relay_sink_written_reset, each with cb; returns
 * how many were sent (each answers once), or -1 when not ready.
 */
int relay_sink_wait(struct relay_sink *s, unsigned replicas, uint32_t timeout_ms,
                    relay_sink_reply_fn *cb, void *arg) __attribute__((warn_unused_result));

/* Drops the connection (pending callbacks get NULL) and reconnects after
 * backoff. why is logged. */
void relay_sink_abort(struct relay_sink *s, const char *why);

/* The hooks' arg of the sink that owns ac (for reply callbacks). */
void *relay_sink_owner(const struct redisAsyncContext *ac);

/* "redis://user:***@host:port/db" */
const char *relay_sink_describe(const struct relay_sink *s);

#endif
