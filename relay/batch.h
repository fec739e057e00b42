/*
 * The pure half of publishing a batch: whether a row can be published, the
 * MULTI / XADD ... / EXEC of a stream's rows with their entry ids, and the
 * decoding of PostgreSQL's binary result formats. No I/O happens here, so
 * every rule is unit-tested without a server (the model is hiredis read.c).
 */
#ifndef RELAY_BATCH_H
#define RELAY_BATCH_H

#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "common/common.h"

/* Name of the Redis function library and of the functions in it: those that
 * functions/outbox_relay.lua registers (its source: common/functions.h).
 * The relay loads the library at connect and calls the trim function
 * (relay/retention.c); it publishes with XADD, not through a function. */
#define RELAY_FUNCTION_LIBRARY "outbox_relay"
#define RELAY_FUNCTION_TRIM "outbox_relay_trim_v1"

/*
 * What a row's own failure means for it, chosen where the failure is found.
 * Permanent: the row as the producer wrote it breaks a rule (its topic, the
 * size of its payload, its key, its headers) and fails the same way on every
 * attempt, so it is quarantined at once with a message that says what to fix.
 * Transient: a reason that can pass while the row waits.
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

/* The longest timestamp relay_batch_format_timestamp writes, with its NUL:
 * "294276-12-31T23:59:59.999999Z" is 29 characters. */
#define RELAY_TIMESTAMP_MAX 32
/* The text form of a uuid, as uuid_out writes it. */
#define RELAY_UUID_LEN 36

/* One row of a batch. Every pointer points into its chunk's PGresult, which
 * is kept until the chunk is published, or into the row itself (the two
 * columns written as text): no row is copied on the hot path. */
struct relay_row {
    int64_t id;
    int64_t held_by;        /* a quarantined row of its key before it (0: none) */
    int quarantined;        /* in the quarantine already (its batch read again) */
    const char *message_id; /* 36-byte text UUID: message_id_text */
    size_t message_id_len;
    const char *topic;
    size_t topic_len;
    const char *key; /* NULL when partition_key IS NULL */
    size_t key_len;
    const char *payload;    /* NULL when over max_payload_bytes: never fetched */
    size_t payload_len;     /* its size in bytes, also when it was not fetched */
    const char *created_at; /* RFC 3339 UTC: created_at_text */
    size_t created_at_len;
    const char *headers_type; /* jsonb_typeof(headers), NULL when headers IS NULL */
    const char *header_names; /* binary text[] or NULL */
    size_t header_names_len;
    const char *header_values; /* binary text[] or NULL */
    size_t header_values_len;
    uint32_t partitions; /* of its topic: 1 publishes to "<prefix><topic>" */
    uint32_t partition;  /* outbox_partition_of, when partitions > 1 */

    /* Rows of one stream go to Redis together, up to RELAY_CALL_ROWS in a
     * call (relay_batch_append_xadd_call): the next row of its stream in
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

    /* Outcome of this batch. */
    int state;                  /* enum relay_row_state */
    enum relay_row_fault fault; /* when state is RELAY_ROW_FAILED */
    enum relay_row_cause cause; /* when state is RELAY_ROW_FAILED */
    char error[OUTBOX_ERROR_MAX];

    /* The two columns PostgreSQL sends in binary and the relay writes as
     * text (relay_batch_format_timestamp, relay_batch_format_uuid). */
    char created_at_text[RELAY_TIMESTAMP_MAX];
    char message_id_text[RELAY_UUID_LEN + 1];
};

enum relay_row_state {
    RELAY_ROW_CLAIMED = 0,
    RELAY_ROW_PUBLISHING,
    RELAY_ROW_PUBLISHED,
    RELAY_ROW_FAILED,  /* a failure of its own */
    RELAY_ROW_SKIPPED, /* its stream is not published in this batch by this relay */
};

/* The longest prefix of s, at most max bytes, that does not cut a UTF-8
 * character in two (messages quote data, and PostgreSQL rejects half a character). */
size_t relay_batch_utf8_prefix(const char *s, size_t len, size_t max);

/* The write below puts the Redis protocol (RESP) into a struct outbox_buf
 * (common/buf.h) meant to live as long as the relay and be reset, not
 * freed, between commands and batches: its memory only grows to the largest
 * thing ever put in it, and the hot path does not allocate. When a command
 * would take the buffer past its max it returns OUTBOX_BUF_FULL and appends
 * nothing: send or reset the buffer and try again. */

/*
 * A stream's rows go in calls (relay_batch_append_xadd_call) of at most
 * RELAY_CALL_ROWS rows, and no more than RELAY_CALL_BYTES of their entries
 * unless the call holds one row.
 */
#define RELAY_CALL_ROWS 64
#define RELAY_CALL_BYTES ((size_t)256 * 1024)

/*
 * Checks row against every rule it must pass to be published (its topic,
 * the size of its payload, its key, its headers, the length of its stream's
 * name) and sets row->call_bytes and row->call_fields, the size of its entry
 * in a call (0 when it fails). 0, or -1 on a failure of the row's own: err
 * says what is wrong and what to do, ending with the command for the row's
 * id that its cause calls for (failed drop, or failed retry once the setup
 * is changed), *fault whether it is permanent or transient, and row->cause
 * whose it is. A row whose payload the query left in the database (payload
 * NULL) fails as too large, a permanent failure.
 */
int relay_batch_check_publish(struct relay_row *row, const char *stream_prefix,
                              uint32_t max_payload_bytes, char *err, size_t errlen,
                              enum relay_row_fault *fault) __attribute__((warn_unused_result));

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
 * Decodes a one-dimensional binary text[] (PostgreSQL array wire format).
 * Fills at most max items and returns their count, or -1 if the data is
 * malformed, multi-dimensional, holds NULLs or more than max items.
 */
int relay_batch_decode_text_array(const char *buf, size_t len, const char **items, size_t *lens,
                                  size_t max) __attribute__((warn_unused_result));

/* Big-endian integers as PostgreSQL sends them in binary results. */
int64_t relay_batch_decode_int8(const char *buf);
int32_t relay_batch_decode_int4(const char *buf);

/* A timestamptz in binary (microseconds since 2000-01-01 00:00 UTC) as
 * to_char(ts AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') writes
 * it: at least four digits of year (a year BC as its number, as to_char
 * writes it), and "" for infinity and -infinity, to_char's NULL. Writes the
 * text and a NUL into out (RELAY_TIMESTAMP_MAX bytes); returns its length. */
size_t relay_batch_format_timestamp(int64_t us, char *out);

/* A uuid in binary (16 bytes) as uuid_out writes it: lower-case hex in
 * groups of 8-4-4-4-12. Writes RELAY_UUID_LEN characters and a NUL. */
void relay_batch_format_uuid(const unsigned char *in, char *out);

/* One slot of struct relay_batch_streams' table. */
struct relay_stream_slot {
    uint32_t batch; /* the batch the slot was taken in: older ones are empty */
    int32_t row;    /* a row index, or -1 */
};

/*
 * The last row of a chunk each stream was given, for relay_row.next: an open
 * addressing table of row indexes, twice as large as a chunk, so that a
 * chunk of as many streams as rows costs one probe or a few per row.
 */
struct relay_batch_streams {
    struct relay_stream_slot *slots;
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
void relay_batch_streams_free(struct relay_batch_streams *x);
/* Whether two rows go to the same stream: same topic and, for a partitioned
 * topic, same partition. */
int relay_batch_same_stream(const struct relay_row *a, const struct relay_row *b);

#endif
