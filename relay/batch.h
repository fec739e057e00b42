/*
 * The pure half of a claim cycle: turning claimed rows into publish commands,
 * deciding which failures belong to one row and which to the whole batch, and
 * decoding PostgreSQL's binary result formats. No I/O happens here, so every
 * rule is unit-tested without a server (the model is hiredis read.c).
 */
#ifndef RELAY_BATCH_H
#define RELAY_BATCH_H

#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "common/common.h"
#include "relay/fail.h"

/* Name of the Redis function library and of the functions in it: those that
 * functions/outbox_relay.lua registers (its source: common/functions.h). */
#define RELAY_FUNCTION_LIBRARY "outbox_relay"
#define RELAY_FUNCTION_PUBLISH "outbox_relay_publish_v2"
#define RELAY_FUNCTION_PUBLISH_MANY "outbox_relay_publish_many_v1"
#define RELAY_FUNCTION_TRIM "outbox_relay_trim_v1"
#define RELAY_FUNCTION_RETIRE "outbox_relay_retire_v1"

/*
 * What a row's own failure means for it, chosen where the failure is found.
 * Permanent: the row as the producer wrote it breaks a rule (its topic, the
 * size of its payload, its key, its headers) and fails the same way on every
 * attempt, so it is quarantined at once with a message that says what to fix.
 * Transient: Redis refused it for a reason that can pass while the row waits
 * (WRONGTYPE: an operator renames the key that holds another type), so it is
 * retried with a growing delay and quarantined after max_attempts.
 */
enum relay_row_fault {
    RELAY_FAULT_NONE = 0, /* not failed; a failure of no stated kind counts as transient */
    RELAY_FAULT_TRANSIENT,
    RELAY_FAULT_PERMANENT,
};

/*
 * Whose a row's failure is, chosen with its fault where the failure is found:
 * it decides what the row's message tells the operator to do once the row is
 * quarantined. The row: what the producer wrote breaks a rule no setting
 * lifts (its topic, its key, its headers, a payload over the largest
 * max_payload_bytes), so the same row fails the same way whatever anyone
 * changes: it is dropped (outbox-relay failed drop) and written again by the
 * fixed producer, and re-queued as it is it would only be quarantined again.
 * The setup: something an operator can change so that the same row then
 * goes through (max_payload_bytes, stream_prefix, a Redis key that holds
 * another type, the row before it in its stream): changed, then re-queued
 * (outbox-relay failed retry).
 */
enum relay_row_cause {
    RELAY_CAUSE_NONE = 0, /* not failed */
    RELAY_CAUSE_ROW,
    RELAY_CAUSE_SETUP,
};

/* One claimed row. Every pointer points into the claim's PGresult, which the
 * batch keeps until the cycle ends: nothing is copied on the hot path. */
struct relay_row {
    int64_t id;
    int64_t held_by; /* a quarantined row of its key before it (0: none) */
    const char *message_id; /* 36-byte text UUID */
    size_t message_id_len;
    const char *topic;
    size_t topic_len;
    const char *key; /* NULL when partition_key IS NULL */
    size_t key_len;
    const char *payload;    /* NULL when over max_payload_bytes: never fetched */
    size_t payload_len;     /* its size in bytes, also when it was not fetched */
    const char *created_at; /* RFC 3339 UTC, formatted by the claim query */
    size_t created_at_len;
    const char *headers_type; /* jsonb_typeof(headers), NULL when headers IS NULL */
    const char *header_names; /* binary text[] or NULL */
    size_t header_names_len;
    const char *header_values; /* binary text[] or NULL */
    size_t header_values_len;
    int32_t attempts;
    uint32_t partitions; /* of its topic: 1 publishes to "<prefix><topic>" */
    uint32_t partition;  /* outbox_partition_of, when partitions > 1 */

    /* The row sent before it to the same stream in this batch, or NULL: its
     * publish names that row's dedup record and is refused while the record
     * is missing (functions/outbox_relay.lua), so that a command which
     * failed in the pipeline is never overtaken by a later one that did not. */
    const struct relay_row *after;
    /* Instead, the row before it in its stream was sent by the batch ahead,
     * still publishing (relay_cycle_ops.overlap): its publish names that row,
     * but the reply is read without it (that batch may have ended). */
    int after_ahead;

    /* Rows of one stream go to Redis together, up to RELAY_CALL_ROWS in a
     * call (relay_batch_append_publish_call): the next row of its stream in
     * the batch (an index into it, -1 for none); in a call's first row, how
     * many rows the call holds; and, once checked (relay_batch_check_publish;
     * 0 before), the bytes and the number of fields of its entry in a call. */
    int32_t next;
    uint32_t call_rows;
    size_t call_bytes;
    uint32_t call_fields;

    /* Its rank among the rows of its stream in its batch, counting those
     * that were not published: with its tick's ms, its entry id
     * (relay_batch_entry_id), the same for every relay and after any crash
     * (docs/DESIGN.md, "Batches from snapshots"). */
    uint64_t seq;

    /* Outcome of this cycle. */
    int state;                  /* enum relay_row_state */
    enum relay_row_fault fault; /* when state is RELAY_ROW_FAILED */
    enum relay_row_cause cause; /* when state is RELAY_ROW_FAILED */
    char error[OUTBOX_ERROR_MAX];
};

enum relay_row_state {
    RELAY_ROW_CLAIMED = 0,
    RELAY_ROW_PUBLISHING,
    RELAY_ROW_PUBLISHED,
    RELAY_ROW_FAILED, /* a failure of its own; counts an attempt */
    RELAY_ROW_SKIPPED, /* its stream is not published in this batch by this relay */
};

/* Whether an error reply concerns one row or the whole batch. */
enum relay_error_scope {
    RELAY_ERROR_BATCH = 0,
    RELAY_ERROR_ROW = 1,
};

/* Maximum arguments of one FCALL: fixed part plus two per header. */
#define RELAY_PUBLISH_ARGV_MAX (20 + 2 * OUTBOX_HEADERS_MAX)

/* The argv of one publish command, with scratch space for the parts that are
 * built rather than pointed to. */
struct relay_publish_cmd {
    int argc;
    const char *argv[RELAY_PUBLISH_ARGV_MAX];
    size_t argvlen[RELAY_PUBLISH_ARGV_MAX];
    char stream[256 + OUTBOX_TOPIC_MAX];
    char dedup_key[300 + OUTBOX_TOPIC_MAX];
    char after_key[300 + OUTBOX_TOPIC_MAX]; /* the dedup record of row->after */
    char ttl[16];
    char not_after[24];
    char outbox_id[24];
    char header_fields[OUTBOX_HEADERS_MAX][OUTBOX_HEADER_NAME_MAX + 3];
};

/* The longest prefix of s, at most max bytes, that does not cut a UTF-8
 * character in two (messages quote data, and PostgreSQL rejects half a character). */
size_t relay_batch_utf8_prefix(const char *s, size_t len, size_t max);

/*
 * Builds the FCALL for row; not_after_ms is the validity deadline on the
 * server's clock (relay_sink_deadline_ms). On a failure of the row's own (bad topic, payload
 * too large, headers that cannot be encoded) returns -1 and writes a message
 * that says what is wrong and what to do into err, ending with the
 * command for the row's id that its cause calls for (enum relay_row_cause:
 * failed drop, or failed retry once the setup is changed). Every such
 * failure is permanent (relay_batch_check_publish reports the kind and the
 * cause).
 */
int relay_batch_build_publish(const struct relay_row *row, const char *stream_prefix,
                              uint32_t max_payload_bytes, uint32_t dedup_ttl_ms,
                              uint64_t not_after_ms, struct relay_publish_cmd *cmd, char *err,
                              size_t errlen) __attribute__((warn_unused_result));

/* The two functions below write the Redis protocol (RESP) into a
 * struct outbox_buf (common/buf.h) meant to live as long as the relay
 * and be reset, not freed, between commands and batches: its memory only
 * grows to the largest thing ever put in it, and the hot path does not
 * allocate. When a command would take the buffer past its max they return
 * OUTBOX_BUF_FULL and append nothing: send or reset the buffer and try
 * again. */

/*
 * The publish call of several rows (RELAY_FUNCTION_PUBLISH_MANY): at most
 * RELAY_CALL_ROWS rows, and no more than RELAY_CALL_BYTES of their entries
 * unless the call holds one row. Redis parses, dispatches and answers one
 * command for them all and starts the function once, which costs it less
 * per message than a call each (docs/PERFORMANCE.md, "One publish call for
 * a stream's rows").
 */
#define RELAY_CALL_ROWS 64
#define RELAY_CALL_BYTES ((size_t)256 * 1024)

/*
 * Checks row against the rules of relay_batch_build_publish and sets
 * row->call_bytes and row->call_fields, the size of its entry in a publish
 * call (0 when it fails). 0, or -1 on a
 * failure of the row's own: err says what is wrong and what to do (the
 * messages of relay_batch_build_publish), *fault whether it is permanent or
 * transient, and row->cause whose it is (the advice at the end of err
 * follows it). A row whose payload the claim left in the database (payload
 * NULL) fails as too large, a permanent failure.
 */
int relay_batch_check_publish(struct relay_row *row, const char *stream_prefix,
                              uint32_t max_payload_bytes, char *err, size_t errlen,
                              enum relay_row_fault *fault) __attribute__((warn_unused_result));

/*
 * Appends to out one call of RELAY_FUNCTION_PUBLISH_MANY for rows[0..n), n
 * >= 1 rows of one stream in the order they are to be appended, each checked
 * by relay_batch_check_publish since it last changed (the call is sized from
 * that check, and each entry checked again as it is written). after is the
 * row sent to the stream just
 * before rows[0], or NULL: the call names its dedup record, and publishes
 * nothing while that record is missing. The reply is an array of n replies,
 * one per row, each the entry id or the error a call of its own
 * (RELAY_FUNCTION_PUBLISH, relay_batch_build_publish) would have answered;
 * or one error for the whole call. The bytes are what redisFormatCommandArgv
 * makes of the argv, written without printf or malloc (once out has grown).
 * Returns 0 when the call was appended (out->data[old len .. out->len), one
 * command for relay_sink_formatted), OUTBOX_BUF_FULL, or -1 when a row fails
 * its check or is of another stream; in both cases out is unchanged.
 */
int relay_batch_append_publish_call(const struct relay_row *const *rows, size_t n,
                                    const struct relay_row *after, const char *stream_prefix,
                                    uint32_t max_payload_bytes, uint32_t dedup_ttl_ms,
                                    uint64_t not_after_ms, struct outbox_buf *out)
    __attribute__((warn_unused_result));

/*
 * A row's entry id, "<ms>-<seq>", into out: its length. ms is its tick's
 * (outbox.ticks.ms), seq its rank (relay_row.seq).
 */
#define RELAY_ENTRY_ID_MAX 42
size_t relay_batch_entry_id(uint64_t ms, uint64_t seq, char out[RELAY_ENTRY_ID_MAX]);

/* Reads an entry id "<ms>-<seq>" (both parts decimal, 64-bit): 0, or -1 when
 * s is not one. */
int relay_batch_parse_entry_id(const char *s, size_t len, uint64_t *ms, uint64_t *seq)
    __attribute__((warn_unused_result));

/*
 * Appends to out the publish of rows[0..n), n >= 1 rows of one stream in
 * rank order, each checked by relay_batch_check_publish since it last
 * changed: MULTI, then per row "XADD <stream> <ms>-<seq> <fields>", then
 * EXEC, three or more commands that go to the stream's node together. A row
 * whose id is not above the stream's last entry is refused by its XADD
 * (relay_batch_xadd_present) and so never appended twice; a command that
 * cannot be queued (memory full, a slot that moved) aborts the EXEC, so none
 * of the rows lands behind a missing one. ends, room for n + 2, receives
 * where each command ends, counted from the call's first byte
 * (relay_sink_transaction). Returns 0 when appended (out->data[old len ..
 * out->len)), OUTBOX_BUF_FULL, or -1 when a row fails its check or is of
 * another stream; in both cases out is unchanged.
 */
int relay_batch_append_xadd_call(const struct relay_row *const *rows, size_t n,
                                 const char *stream_prefix, uint32_t max_payload_bytes, uint64_t ms,
                                 struct outbox_buf *out, size_t *ends)
    __attribute__((warn_unused_result));

/* 1 when err, an XADD's error reply, says that the id is not above the
 * stream's last: the entry, or a later one, is there already. */
int relay_batch_xadd_present(const char *err, size_t len);

/*
 * Appends to out the next "FCALL retire <n> <dedup key>... <ttl_ms>" that
 * leaves the dedup records of the published rows of a committed batch to
 * expire within ttl_ms (docs/DESIGN.md, "The publish deadline"), or with
 * ttl_ms 0 the next "UNLINK <dedup key>..." that removes them: one command
 * per stream (so each stays inside one hash slot), its keys in row order, as
 * outbox_key_dedup (common/keys.c) names them; cycle_io.c sends them. Rows are
 * not modified. *pos is the iteration state: start it at 0 and call again
 * until it returns 0.
 *
 * Returns 1 when one command was appended (out->data[old len .. out->len),
 * for one relay_sink_formatted call), 0 when no stream is left, or
 * OUTBOX_BUF_FULL (nothing appended, *pos unchanged: send what out holds,
 * reset it and call again).
 *
 * OUTBOX_BUF_FULL on an empty out means one command alone is over max: it
 * cannot happen with the default max and the limits the rows are checked
 * against, but a caller must not retry it forever.
 */
int relay_batch_append_retire(const struct relay_row *rows, size_t n, const char *stream_prefix,
                              uint32_t ttl_ms, size_t *pos, struct outbox_buf *out)
    __attribute__((warn_unused_result));

/*
 * Appends to out the retire ("FCALL retire <n> <keys>... <ttl_ms>") of the
 * keys of an UNLINK that relay_batch_append_retire formatted: for records
 * whose removal is due later than the relay can wait for (at shutdown, or
 * when too many removals are waiting), so that Redis expires them then.
 * 0, or -1 when cmd is not such an UNLINK or ttl_ms is 0.
 */
int relay_batch_unlink_as_retire(const char *cmd, size_t len, uint32_t ttl_ms,
                                 struct outbox_buf *out) __attribute__((warn_unused_result));

/*
 * Decodes a one-dimensional binary text[] (PostgreSQL array wire format).
 * Fills at most max items and returns their count, or -1 if the data is
 * malformed, multi-dimensional, holds NULLs or more than max items.
 */
int relay_batch_decode_text_array(const char *buf, size_t len, const char **items, size_t *lens,
                                  size_t max) __attribute__((warn_unused_result));

/* Big-endian integers as PostgreSQL sends them in binary results. */
int64_t relay_batch_decode_int8(const char *buf);
int32_t relay_batch_decode_int4(const char *buf);

/*
 * Where a claim starts its walk of the pending index (docs/DESIGN.md, "The
 * claim cycle"). While every other lane holds a full batch in flight, a
 * backlog is being drained and the rows up to the highest id those batches
 * hold are locked by them or already deleted by the batches before: the claim
 * starts after it instead of stepping over them. A row below it that was not
 * claimed (committed after the claim that passed its id, released by a
 * rollback, due for retry) waits for the next full walk: the first claim that
 * finds a lane idle or holding a short batch, or every
 * RELAY_CLAIM_FULL_WALK_EVERY-th claim in a row. A relay that may claim rows
 * of partitioned topics (`ordered`) always walks the whole index, since a
 * key's later row must never pass an earlier one (P8).
 */
#define RELAY_CLAIM_FULL_WALK_EVERY 8

/*
 * The last row of a batch each stream was sent, for relay_row.after: an open
 * addressing table of row indexes, twice as large as a batch, so that a batch
 * of as many streams as rows costs one probe or a few per row.
 */
struct relay_batch_streams {
    struct relay_stream_slot {
        uint32_t batch; /* the batch the slot was taken in: older ones are empty */
        int32_t row;    /* a row index, or -1 */
    } * slots;
    size_t mask;    /* the table's size less one; the size is a power of two */
    uint32_t batch; /* counts the clears */
};

/* Sizes x for batches of up to max_rows rows: 0, or -1 out of memory. */
int relay_batch_streams_init(struct relay_batch_streams *x, size_t max_rows)
    __attribute__((warn_unused_result));
/* Forgets every stream: call before each batch. It counts a batch, so a
 * batch of 5 rows does not pay for the table of a batch_size of 10,000. */
void relay_batch_streams_clear(struct relay_batch_streams *x);
/* The slot of rows[i]'s stream: the index of the last row of that stream the
 * caller stored there since the clear, or -1. Store i in it once the row is sent. */
int32_t *relay_batch_streams_slot(struct relay_batch_streams *x, const struct relay_row *rows,
                                  size_t i);
/* The index of the last row of row's stream stored in x since its clear, x
 * being filled from rows (another batch's table and rows), or -1. */
int32_t relay_batch_streams_find(const struct relay_batch_streams *x, const struct relay_row *rows,
                                 const struct relay_row *row);
void relay_batch_streams_free(struct relay_batch_streams *x);
/* Whether two rows go to the same stream: same topic and, for a partitioned
 * topic, same partition. */
int relay_batch_same_stream(const struct relay_row *a, const struct relay_row *b);

struct relay_claim_lane {
    int in_flight;   /* holds a claimed batch: waiting to publish, publishing or finishing */
    size_t nrows;    /* rows of that batch */
    int64_t last_id; /* its highest id (the claim returns rows in id order) */
};

/* Returns the id the claim starts after (0: the whole index) and counts the
 * claims in a row that did not walk the whole index in *bounded_in_row. */
int64_t relay_batch_claim_floor(const struct relay_claim_lane *others, size_t n,
                                uint32_t batch_size, int ordered, unsigned *bounded_in_row);

/* Classifies an error reply of the publish function. */
enum relay_error_scope relay_batch_classify_error(const char *msg, size_t len);

/* What came back for one publish command, reduced to what the cycle needs. */
enum relay_reply_kind {
    RELAY_REPLY_LOST = 0, /* no reply: the connection failed or was dropped */
    RELAY_REPLY_ENTRY,    /* a string or status: the entry id */
    RELAY_REPLY_ERROR,    /* an error reply */
    RELAY_REPLY_OTHER,    /* any other type: a malformed answer */
    RELAY_REPLY_COUNT,    /* an integer: WAIT's count of replicas */
};

/* The publishes of one batch so far, across all of its rows. */
struct relay_tally {
    size_t pending;            /* publish commands not answered yet */
    int failed;                /* the whole batch failed: roll back */
    enum relay_fail_kind kind; /* why, when failed (the first reason) */
    int function_missing;      /* the publish function must be loaded again */
    int not_primary;           /* READONLY: the server is a replica now; reconnect */
    int slots_moved;           /* MOVED: a cluster's slot map changed; read it again */
    size_t held;               /* rows held back behind a failed row of their key */
    size_t left;               /* rows refused behind the batch ahead: claimed again */
    char error[512];           /* why the batch failed (first reason), for the log */
};

/*
 * Applies one reply to its row and to the tally: an entry id publishes the
 * row; an error of the row's own fails only the row (with a message that says
 * what to do, as a transient fault of the setup: WRONGTYPE can be fixed while
 * the row waits), and so does ORDER when the row sent before it in its stream
 * failed that way; ORDER behind the batch ahead (relay_row.after_ahead), or behind a
 * row refused that way, leaves the row claimed for the next claim (counted in
 * tally.left); anything else fails the whole batch. Returns 1 when this was
 * the last reply the tally waited for.
 */
int relay_batch_apply_reply(struct relay_tally *tally, struct relay_row *row,
                            enum relay_reply_kind kind, const char *str, size_t len)
    __attribute__((warn_unused_result));

/*
 * Applies the reply to the WAIT that follows a batch's publishes when
 * min_replicas > 0 (RELAY_REPLY_COUNT with the number of replicas that hold
 * the batch's writes, or any other kind): fewer than `wanted` replicas, or
 * any other reply, fail the whole batch, which is rolled back and published
 * again (its dedup records answer the rows that are already in). Returns 1
 * when this was the last reply the tally waited for.
 */
int relay_batch_apply_wait(struct relay_tally *tally, enum relay_reply_kind kind,
                           long long replicas, const char *str, size_t len, uint32_t wanted,
                           uint32_t timeout_ms) __attribute__((warn_unused_result));

/* Quotes s as an SQL literal (the connection's rules); freed with freefn. */
struct relay_sql_quoter {
    char *(*quote)(void *ctx, const char *s, size_t len);
    void (*freefn)(void *p);
    void *ctx;
};

/*
 * 1 when a failed row is quarantined at the end of this cycle: its failure is
 * permanent, or this was its max_attempts-th attempt. 0 for rows that did not
 * fail.
 */
int relay_batch_row_quarantined(const struct relay_row *row, uint32_t max_attempts);

/*
 * Writes the statements that end a cycle: mark every published row sent (or,
 * with delete_sent, for sent_retention = 0, delete it through
 * outbox.delete_published),
 * count one attempt on every failed row (with its error and a retry delay
 * that grows with its attempts, quarantining it as
 * relay_batch_row_quarantined says), then COMMIT.
 * Returns the number of rows quarantined, or -1 when the buffer overflowed
 * or quoting failed.
 */
int relay_batch_finish_sql(const struct relay_row *rows, size_t n, uint32_t max_attempts,
                           int delete_sent, const struct relay_sql_quoter *q,
                           struct outbox_buf *out) __attribute__((warn_unused_result));

/*
 * Delay before a failed row is claimed again: grows with its attempts,
 * base_ms * 2^(attempts-1), capped at max_ms.
 */
uint32_t relay_batch_row_retry_ms(int32_t attempts, uint32_t base_ms, uint32_t max_ms);

#endif
