/*
 * PostgreSQL side of the relay: one non-blocking libpq connection driven by
 * libev watchers. The relay keeps up to three: one that stays in LISTEN (and
 * holds the wake-up lock while the relay is busy), one that reads and
 * records batches (relay/loop_io.c), and the owner connection of the
 * partitions it claims (relay/ownership_io.c). Each connects, runs its session set-up,
 * reconnects with jittered backoff when it breaks, and runs one command at a
 * time with a client-side deadline. Nothing here ever blocks the loop.
 */
#ifndef RELAY_PGSRC_H
#define RELAY_PGSRC_H

#include "core/pg.h" /* RELAY_OWNER_*_NS */

#include <stddef.h>
#include <stdint.h>

#include "common/backoff.h"

struct ev_loop;
struct pg_conn;
struct pg_result;
struct relay_config;
struct relay_pgsrc;

enum relay_pgsrc_state {
    RELAY_PG_DOWN = 0,   /* waiting to (re)connect */
    RELAY_PG_CONNECTING, /* PQconnectPoll in progress */
    RELAY_PG_SETUP,      /* session set-up queries running */
    RELAY_PG_READY,      /* idle, can take a command */
    RELAY_PG_BUSY,       /* a command is in flight */
    RELAY_PG_CLOSED,     /* relay_pgsrc_close was called */
};

/* Called when a command finished. res is the last result that carried rows,
 * or NULL; err is NULL on success or the server's message. res belongs to the
 * connection, which frees it when the callback returns, unless the callback
 * takes it with relay_pgsrc_take_result (as hiredis frees a reply after its
 * callback). After a connection failure the callback runs with err set and
 * the connection is already being re-established. */
typedef void relay_pgsrc_done_fn(struct relay_pgsrc *pg, struct pg_result *res, const char *err,
                                 const char *sqlstate, void *arg);

struct relay_pgsrc_hooks {
    void *arg;
    /* The connection finished its set-up and is READY. */
    void (*on_ready)(struct relay_pgsrc *pg, void *arg);
    /* The connection broke or failed to connect (already rescheduled). */
    void (*on_down)(struct relay_pgsrc *pg, void *arg);
    /* A notification arrived (listen connections); called once per drain. */
    void (*on_notify)(struct relay_pgsrc *pg, void *arg);
};

enum relay_pgsrc_role {
    RELAY_PGSRC_CLAIM = 0,
    RELAY_PGSRC_LISTEN = 1,
    RELAY_PGSRC_OWNER = 2, /* holds the partitions this relay owns (relay/ownership_io.c) */
};

/* Creates a connection object and starts connecting at once. */
struct relay_pgsrc *relay_pgsrc_new(struct ev_loop *loop, const struct relay_config *cfg,
                                    enum relay_pgsrc_role role,
                                    const struct relay_pgsrc_hooks *hooks)
    __attribute__((warn_unused_result));

/* Inside a done callback: takes its result, which the caller then owns and
 * frees with PQclear. NULL when there is none. */
struct pg_result *relay_pgsrc_take_result(struct relay_pgsrc *pg)
    __attribute__((warn_unused_result));

/* Closes the connection (an open transaction is rolled back by the server)
 * and frees everything. Pending done callbacks are not called. */
void relay_pgsrc_free(struct relay_pgsrc *pg);

enum relay_pgsrc_state relay_pgsrc_state(const struct relay_pgsrc *pg);
/* 1 when the connection takes statements: ready, or running one. */
int relay_pgsrc_up(const struct relay_pgsrc *pg);

/*
 * Sends a command: sql with nparams text parameters (nparams 0 and a string of
 * several statements is allowed), binary results when binary is set. Returns
 * 0, or -1 if the connection is not READY. done runs exactly once.
 */
int relay_pgsrc_send(struct relay_pgsrc *pg, const char *sql, int nparams,
                     const char *const *params, int binary, relay_pgsrc_done_fn *done, void *arg)
    __attribute__((warn_unused_result));

/* Sends a statement prepared during set-up ("batch"). Same contract. */
int relay_pgsrc_send_prepared(struct relay_pgsrc *pg, const char *name, int nparams,
                              const char *const *params, int binary, relay_pgsrc_done_fn *done,
                              void *arg) __attribute__((warn_unused_result));

/*
 * Called when a connection finds that it does not keep one server session,
 * as behind a pooler in transaction mode (relay/pgsrc.c, SESSION_PROBE); why
 * is the whole message, which says what to do. The connection stops where it
 * is; the handler is expected to end the process. Without a handler such a
 * connection fails and reconnects like after any set-up error.
 */
typedef void relay_pgsrc_no_session_fn(void *arg, const char *why);
void relay_pgsrc_on_no_session(relay_pgsrc_no_session_fn *fn, void *arg);

/* Drops the connection now and reconnects after backoff (a stuck server). */
void relay_pgsrc_reset(struct relay_pgsrc *pg, const char *why);

/* Why the connection is not ready: its last failure as logged ("session
 * set-up failed: the outbox schema is at version ..."), or "" when it is
 * ready or has not failed. */
const char *relay_pgsrc_problem(const struct relay_pgsrc *pg);

/* "host=... port=... dbname=... user=..." of the target, without secrets. */
const char *relay_pgsrc_describe(const struct relay_pgsrc *pg);

/* The owner connection speaks every RELAY_OWNER_TICK_MS; the server ends it
 * after RELAY_OWNER_IDLE_MS of silence. */
#define RELAY_OWNER_TICK_MS 1000
#define RELAY_OWNER_IDLE_MS 3000

/*
 * Writes into out the statement that reads a chunk of a batch: $1 and $2 the
 * ticks around it, $3 and $4 the txid and id of the last row of the chunk
 * before ('0' and 0 for the first chunk), $5 the most rows, $6 and $7 the
 * ids and errors of rows the chunks before quarantined (recorded first). Its
 * rows have 11 columns for the entry: id, message_id, topic, partition_key,
 * payload, created_at, headers type, header names, header values, the
 * payload's size in bytes and the topic's partitions (the payload is NULL
 * when its size is over max_payload_bytes, which is never transferred); a
 * 12th, the txid (xid8, 8 bytes in binary), a 13th, the ms of the later tick
 * (int8), a 14th, the first quarantined row of its key before it in a
 * partitioned topic, or NULL, and a 15th, whether the row is in the
 * quarantine already; in id order. Returns the length, or -1
 * when it does not fit (RELAY_PGSRC_BATCH_SQL_MAX always does).
 */
#define RELAY_PGSRC_BATCH_SQL_MAX 8192
int relay_pgsrc_batch_sql(uint32_t max_payload_bytes, char *out, size_t outlen)
    __attribute__((warn_unused_result));

/* The other statement a claim connection prepares: the lowest and highest
 * row id of the batch between two ticks ($1, $2), as text. */
#define RELAY_PGSRC_BOUNDS "bounds"
#define RELAY_PGSRC_BOUNDS_SQL "SELECT lo, hi FROM outbox.batch_bounds($1::bigint, $2::bigint)"

#endif
