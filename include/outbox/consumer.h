/*
 * The consumer library (liboutbox_consumer.a, built from consumer/ and
 * common/), and the only header a service includes: <outbox/consumer.h>. It
 * reads a relay stream through a Redis consumer group and turns at-least-once
 * delivery into one effect per message.
 *
 * The caller's handler gets every field of the stream contract and answers
 * done, retry later or failed for good. Done is acknowledged (the handler has
 * committed its own transaction, with the message recorded in the processed
 * table, before it returns). Retry leaves the entry pending: it is delivered
 * again once it has been idle for the backoff of its delivery count (default
 * 1 s, 10 s, 100 s, 1000 s), to this consumer or any other of the group, so
 * the entries of a consumer that died are taken over the same way. Failed for
 * good, or a retry at the last allowed delivery, moves the entry to the
 * dead-letter stream with the error, atomically with its XACK: one call of the
 * Redis function below, which acknowledges only once the dead letter is in.
 *
 * Take-over is decided by idle time alone: an entry whose handler runs longer
 * than the first backoff step may be delivered to another consumer meanwhile.
 * The processed table keeps the effect single; size the first step above the
 * handler's usual run time.
 *
 * Each group also reads its own replay stream "{<stream>}.<group>.replay": that
 * is where "outbox-relay dlq replay" puts dead letters back, so a replay
 * reaches only the group that failed. The library uses hiredis's blocking API
 * on two connections of its own (one for XREADGROUP BLOCK, one for XACK,
 * XPENDING, XCLAIM and dead letters), each call with a deadline; it runs in
 * the caller's thread until outbox_consumer_stop.
 *
 * The library never prints. It reports what happens through the log hook of
 * the options (NULL: silent), and keeps the most recent failure in the object
 * (outbox_consumer_err and outbox_consumer_errstr, like hiredis's c->err and
 * c->errstr) for a health check to read.
 *
 * Building against the installed library: cc app.c $(pkg-config --cflags
 * --libs outbox-consumer) links liboutbox_consumer.so.1 (add --static, and
 * -static, for the static library); CMake: find_package(OutboxConsumer) and
 * the target OutboxConsumer::outbox_consumer. The shared library exports the
 * functions of this header, nothing else.
 */
#ifndef OUTBOX_CONSUMER_H
#define OUTBOX_CONSUMER_H

#include <stddef.h>
#include <stdint.h>

#define OUTBOX_CONSUMER_BACKOFF_MAX 16

#if defined(__GNUC__) || defined(__clang__)
#define OUTBOX_CONSUMER_MUSTCHECK __attribute__((warn_unused_result))
#else
#define OUTBOX_CONSUMER_MUSTCHECK
#endif

/* One message, as the handler sees it. Pointers are valid during the call. */
struct outbox_message {
    const char *stream;   /* the stream it was read from (main or replay) */
    const char *entry_id; /* Redis entry id */
    const char *id;       /* message_id: the idempotency key */
    const char *topic;
    const char *key; /* NULL when the row had no partition key */
    size_t key_len;
    const char *payload; /* verbatim bytes */
    size_t payload_len;
    const char *created_at; /* RFC 3339 UTC */
    long long outbox_id;
    size_t nheaders; /* header names without the "h." prefix */
    const char *const *header_names;
    const char *const *header_values;
    const size_t *header_value_lens;
    uint32_t deliveries; /* 1 on the first delivery */
};

enum outbox_handled {
    OUTBOX_HANDLED_DONE = 0,  /* effect committed: acknowledge */
    OUTBOX_HANDLED_RETRY = 1, /* transient failure: deliver again after backoff */
    OUTBOX_HANDLED_FAIL = 2,  /* permanent failure: dead-letter now */
};

/* The handler. On RETRY or FAIL it writes why into err (kept in the dead letter). */
typedef enum outbox_handled outbox_consumer_handler_fn(const struct outbox_message *m, void *arg,
                                                       char *err, size_t errlen);

/* The level of a line given to the log hook. */
enum outbox_consumer_log_level {
    OUTBOX_CONSUMER_LOG_DEBUG = 0,   /* a connection problem repeated while retrying */
    OUTBOX_CONSUMER_LOG_INFO = 1,    /* connected, a retry scheduled, stopped with totals */
    OUTBOX_CONSUMER_LOG_WARNING = 2, /* a message dead-lettered */
    OUTBOX_CONSUMER_LOG_ERROR = 3,   /* a failure (also kept in outbox_consumer_errstr) */
};

/*
 * The log hook: one event as one line of text (no newline, control characters
 * made spaces, at most 2047 bytes), valid during the call only. It is called
 * from the thread running outbox_consumer_run, with the log_arg of the options.
 * The text never holds the Redis password.
 */
typedef void outbox_consumer_log_fn(enum outbox_consumer_log_level level, const char *message,
                                    void *arg);

struct outbox_consumer_options {
    const char *redis_url; /* redis://[user:password@]host:port[/db], or rediss:// with TLS
                            * options where built with TLS (docs/REDIS.md) */
    const char *stream;
    const char *group;
    const char *consumer;                             /* NULL: "<hostname>-<pid>" */
    const char *dlq;                                  /* NULL: "{<stream>}.<group>.dlq" */
    uint32_t max_deliveries;                          /* 0: 5 */
    uint32_t backoff_ms[OUTBOX_CONSUMER_BACKOFF_MAX]; /* delay before delivery n+1 */
    uint32_t nbackoff; /* steps used in backoff_ms (the last repeats); 0: 1s, 10s, 100s, 1000s */
    uint32_t block_ms; /* 0: 1000; XREADGROUP BLOCK, also the stop latency */
    uint32_t command_timeout_ms;  /* 0: 5000; deadline of every other call */
    uint32_t count;               /* 0: 16; entries per read */
    uint32_t reclaim_interval_ms; /* 0: 250; how often pending entries are scanned */
    uint32_t reconnect_min_ms;    /* 0: 100 */
    uint32_t reconnect_max_ms;    /* 0: 10000 */
    outbox_consumer_log_fn *log;  /* NULL: silent */
    void *log_arg;                /* passed to log */
    /* How long the application keeps rows of outbox_consumer.processed (the
     * older_than it passes to outbox_consumer.purge_processed); 0: it does
     * not purge. Shorter than the redelivery horizon is refused by
     * outbox_consumer_new unless allow_short_processed_horizon is set, and
     * then logged as a warning when run starts. */
    uint64_t processed_horizon_ms;
    int allow_short_processed_horizon;
    /*
     * Ordered mode (docs/CONSUMERS.md, "Ordered consumers"). 0: the
     * unordered mode. Otherwise the number of partitions of the topic whose
     * stream is `stream` (2 to 1000): the consumers of the group divide its
     * partition streams "<stream>:000"... through leases in Redis, one
     * consumer per partition at a time, and each key's messages are handled
     * in order: a message to retry holds back the later ones of its key
     * (the other keys go on), until it is acknowledged or dead-lettered.
     * Dead letters go to each partition's "<partition stream>.<group>.dlq"
     * (dlq must be NULL), and the partition's replay stream is read too.
     */
    uint32_t partitions;
    uint32_t lease_ms; /* 0: 10000; a consumer silent this long loses its partitions */
    /* Ordered mode: once a message with a key is dead-lettered, park the key:
     * its later messages stay pending, unhandled, until an operator removes
     * the key from the set "{<partition stream>}:parked:<group>" (SREM). 0:
     * the key goes on with its next message. */
    int park_keys;
};

/* The kind of the most recent failure (outbox_consumer_err). */
enum outbox_consumer_err {
    OUTBOX_CONSUMER_ERR_NONE = 0,
    OUTBOX_CONSUMER_ERR_IO = 1,    /* cannot connect, or the connection was lost or timed out */
    OUTBOX_CONSUMER_ERR_REDIS = 2, /* Redis refused a command: AUTH, FUNCTION LOAD, XGROUP, a
                                     dead letter, XACK */
    OUTBOX_CONSUMER_ERR_OOM = 3,   /* out of memory for a command */
};

struct outbox_consumer_stats {
    unsigned long long delivered;     /* handler calls */
    unsigned long long done;          /* acknowledged */
    unsigned long long retried;       /* left pending for a later delivery */
    unsigned long long dead_lettered; /* moved to the dead-letter stream (all reasons) */
    unsigned long long malformed;     /* entries without the contract's fields */
    unsigned long long lost;          /* pending entries deleted from the stream */
    unsigned long long reclaimed;     /* deliveries taken over after backoff */
    unsigned long long leases_taken;  /* ordered mode: partitions taken */
    unsigned long long leases_lost;   /* ordered mode: partitions lost to another consumer */
};

struct outbox_consumer;

/* Validates the options and copies them (the strings too). No I/O. NULL with
 * the reason in err when an option is wrong or memory is short; free the
 * result with outbox_consumer_free. */
struct outbox_consumer *outbox_consumer_new(const struct outbox_consumer_options *opts,
                                            outbox_consumer_handler_fn *handler, void *arg,
                                            char *err, size_t errlen) OUTBOX_CONSUMER_MUSTCHECK;

/* Runs until outbox_consumer_stop: connects (retrying with jittered backoff),
 * creates the group on the stream and on its replay stream when missing (at
 * id 0, creating the streams), then reads, handles and reclaims. Returns 0
 * after a stop; the message in hand is finished first. */
int outbox_consumer_run(struct outbox_consumer *c);

/* Asks run to return after the message in hand. Async-signal-safe. */
void outbox_consumer_stop(struct outbox_consumer *c);

/* The most recent failure while running, or OUTBOX_CONSUMER_ERR_NONE and "":
 * cleared once the consumer connects again or finishes an entry (acknowledged
 * or dead-lettered). Connection failures are retried by run itself; these say
 * what is wrong meanwhile. The string belongs to c and changes as run goes on:
 * read it from the thread that runs it, or copy it. */
enum outbox_consumer_err outbox_consumer_err(const struct outbox_consumer *c);
const char *outbox_consumer_errstr(const struct outbox_consumer *c);

const struct outbox_consumer_stats *outbox_consumer_stats(const struct outbox_consumer *c);
const char *outbox_consumer_name(const struct outbox_consumer *c);
const char *outbox_consumer_dlq(const struct outbox_consumer *c);

/* NULL-safe. */
void outbox_consumer_free(struct outbox_consumer *c);

/* The backoff before delivery number deliveries+1 (deliveries >= 1). */
uint32_t outbox_consumer_backoff_ms(const struct outbox_consumer_options *opts,
                                    uint32_t deliveries);

/* The redelivery horizon: the longest time from an entry's first delivery to
 * its last, over max_deliveries, with every backoff step and a reclaim
 * interval between deliveries. A processed row must outlive it. */
uint64_t outbox_consumer_redelivery_horizon_ms(const struct outbox_consumer_options *opts);

/* Names: "{<stream>}.<group>.dlq" and "{<stream>}.<group>.replay" into out. The
 * length written, or -1 when it does not fit (out is then untouched). */
int outbox_consumer_dlq_name(const char *stream, const char *group, char *out,
                             size_t outlen) OUTBOX_CONSUMER_MUSTCHECK;
int outbox_consumer_replay_name(const char *stream, const char *group, char *out,
                                size_t outlen) OUTBOX_CONSUMER_MUSTCHECK;

/*
 * The dead-letter function, in a Redis function library of its own (the
 * relay's library "outbox_relay" is left alone: FUNCTION LOAD REPLACE of it
 * would drop the relay's publish function). The library loads it with
 * FUNCTION LOAD REPLACE on every connect; consumers in other languages may
 * call it too (docs/CONSUMERS.md section 5):
 *
 *   FCALL outbox_consumer_dead_letter_v1 2 <dead-letter stream> <stream>
 *         <group> <entry id> <field> <value> [<field> <value> ...]
 *
 * It adds the fields to the dead-letter stream (XADD *) and only then, if that
 * succeeded, acknowledges the entry (XACK), and returns the dead letter's
 * entry id. A refused XADD (the dead-letter key holds another type, OOM)
 * returns the error and acknowledges nothing, so the entry stays pending. The
 * dead letter is added even when the entry is no longer pending (XACK 0).
 */
#define OUTBOX_CONSUMER_FUNCTION_LIBRARY "outbox_consumer"
#define OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER "outbox_consumer_dead_letter_v1"

/*
 * The replay function, in the same library; "outbox-relay dlq replay" loads
 * the library the same way and calls it once per dead letter
 * (docs/CONSUMERS.md section 5):
 *
 *   FCALL outbox_consumer_replay_v1 2 <dead-letter stream> <replay stream>
 *         <entry id>
 *
 * It reads the dead letter, adds its fields but the dlq.* ones, in order, to
 * the replay stream (XADD *) and only then, if that succeeded, deletes the
 * dead letter (XDEL); it returns the new entry id in the replay stream. nil
 * when there is no such dead letter (replayed already, purged, never there);
 * a NOTREPLAYABLE error when it has only dlq.* fields (a lost entry). A
 * refused XADD (OOM, a replay stream whose last id is the largest possible)
 * returns the error and deletes nothing. Usage errors and a key of another
 * type (WRONGTYPE) are reported before anything is written.
 */
#define OUTBOX_CONSUMER_FUNCTION_REPLAY "outbox_consumer_replay_v1"

/*
 * The partition-lease functions, in the same library, for ordered consumers
 * (docs/CONSUMERS.md, "Ordered consumers"): the consumers of one group divide
 * the partition streams of a topic among themselves, one consumer per
 * partition at a time. Every key below is in the partition stream's hash
 * slot; outbox_consumer_lease_names gives the two lease keys.
 *
 *   FCALL outbox_consumer_lease_v1 2 <lease key> <token counter key>
 *         <consumer> <ttl ms> <token, or 0 to take>
 *
 * With token 0, takes a free lease (a new token, one more than the last ever
 * given for the partition); with a token, renews the caller's own (same
 * consumer and token). For ttl ms; replies {token, consumer, ttl ms}. A lease
 * that someone else holds, or that the caller held with another token, is
 * left alone: {0, its holder, ms left}; a renewal of a lease that ran out
 * takes nothing: {0, "", 0}.
 *
 *   FCALL outbox_consumer_release_v1 1 <lease key> <token>
 *
 * Gives the lease up when that token holds it: 1, else 0.
 *
 *   FCALL outbox_consumer_read_v1 2 <stream> <lease key> <group> <consumer>
 *         <token> <count> <">" or an id>
 *   FCALL outbox_consumer_take_v1 2 <stream> <lease key> <group> <consumer>
 *         <token> <count>
 *   FCALL outbox_consumer_ack_v1 2 <stream> <lease key> <group> <token>
 *         <entry id> [<entry id> ...]
 *   FCALL outbox_consumer_dead_letter_leased_v1 3 <dead-letter stream>
 *         <stream> <lease key> <group> <token> <entry id> <field> <value>
 *         [<field> <value> ...]
 *
 * Each first checks that the token holds the lease and otherwise answers an
 * error beginning "LEASELOST" and does nothing. Then: read with ">" is
 * XREADGROUP (COUNT, no BLOCK) of the stream; read with "0" or an id gives
 * the caller's own pending entries after it, in the same shape, without
 * counting a delivery ({id, nil} for one deleted from the stream); take
 * moves the first count pending entries of the group that other consumers
 * hold, from anywhere in the pending list, to this one (XCLAIM, min idle 0,
 * which counts a delivery) and replies {the ids it asked for, the entries
 * XCLAIM returned} (an id missing from the second was deleted from the
 * stream: lost); ack is XACK; dead_letter_leased is the dead-letter function
 * above.
 */
#define OUTBOX_CONSUMER_FUNCTION_LEASE "outbox_consumer_lease_v1"
#define OUTBOX_CONSUMER_FUNCTION_RELEASE "outbox_consumer_release_v1"
#define OUTBOX_CONSUMER_FUNCTION_READ "outbox_consumer_read_v1"
#define OUTBOX_CONSUMER_FUNCTION_TAKE "outbox_consumer_take_v1"
#define OUTBOX_CONSUMER_FUNCTION_ACK "outbox_consumer_ack_v1"
#define OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER_LEASED "outbox_consumer_dead_letter_leased_v1"

/* The lease key "{<stream>}:lease:<group>" and the token counter
 * "{<stream>}:lease-token:<group>" of a partition stream. The length written
 * into lease, or -1 when either does not fit (nothing is then written). */
int outbox_consumer_lease_names(const char *stream, const char *group, char *lease, char *token,
                                size_t outlen) OUTBOX_CONSUMER_MUSTCHECK;

/* The library (every function above) is functions/outbox_consumer.lua in the
 * source tree, installed in share/outbox-relay/functions/: load it by hand
 * with redis-cli -x FUNCTION LOAD REPLACE < outbox_consumer.lua
 * (docs/CONSUMERS.md, "The Redis functions"). */

/* Dead-letter entry fields added to the original ones. */
#define OUTBOX_DLQ_FIELD_STREAM "dlq.stream"
#define OUTBOX_DLQ_FIELD_GROUP "dlq.group"
#define OUTBOX_DLQ_FIELD_CONSUMER "dlq.consumer"
#define OUTBOX_DLQ_FIELD_ENTRY "dlq.entry_id"
#define OUTBOX_DLQ_FIELD_DELIVERIES "dlq.deliveries"
#define OUTBOX_DLQ_FIELD_REASON "dlq.reason" /* permanent, exhausted, malformed, lost */
#define OUTBOX_DLQ_FIELD_ERROR "dlq.error"
#define OUTBOX_DLQ_FIELD_TIME "dlq.failed_at"

#endif
