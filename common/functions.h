/*
 * The Redis function contract: the two Lua libraries of functions/, embedded
 * at build time (cmake/embed.cmake writes each file as a C string into the
 * build directory), and the names of the consumers' library that the
 * daemon, the operator commands and the consumer library all use.
 *
 *   functions/outbox_relay.lua     library outbox_relay: publish, trim and
 *                                  retire (their names: relay/batch.h)
 *   functions/outbox_consumer.lua  library outbox_consumer: dead letters,
 *                                  replay and partition leases (contract:
 *                                  include/outbox/consumer.h)
 *
 * Each file is loaded as it stands, with FUNCTION LOAD REPLACE, by the
 * programs here and by hand (docs/CONSUMERS.md, "The Redis functions").
 */
#ifndef OUTBOX_FUNCTIONS_H
#define OUTBOX_FUNCTIONS_H

/* The text of functions/outbox_relay.lua and functions/outbox_consumer.lua. */
extern const char outbox_functions_relay_source[];
extern const char outbox_functions_consumer_source[];

/*
 * The consumers' library and its functions, and the fields a dead letter
 * adds to the entry's own. They are public too, in include/outbox/consumer.h,
 * which must stand alone and so spells them out again: a file that includes
 * both headers (every file of consumer/) gets the compiler's check that the
 * two agree, since a macro may only be defined again with the same text.
 */
#define OUTBOX_CONSUMER_FUNCTION_LIBRARY "outbox_consumer"
#define OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER "outbox_consumer_dead_letter_v1"
#define OUTBOX_CONSUMER_FUNCTION_REPLAY "outbox_consumer_replay_v1"
#define OUTBOX_CONSUMER_FUNCTION_LEASE "outbox_consumer_lease_v1"
#define OUTBOX_CONSUMER_FUNCTION_RELEASE "outbox_consumer_release_v1"
#define OUTBOX_CONSUMER_FUNCTION_READ "outbox_consumer_read_v1"
#define OUTBOX_CONSUMER_FUNCTION_TAKE "outbox_consumer_take_v1"
#define OUTBOX_CONSUMER_FUNCTION_ACK "outbox_consumer_ack_v1"
#define OUTBOX_CONSUMER_FUNCTION_DEAD_LETTER_LEASED "outbox_consumer_dead_letter_leased_v1"

#define OUTBOX_DLQ_FIELD_STREAM "dlq.stream"
#define OUTBOX_DLQ_FIELD_GROUP "dlq.group"
#define OUTBOX_DLQ_FIELD_CONSUMER "dlq.consumer"
#define OUTBOX_DLQ_FIELD_ENTRY "dlq.entry_id"
#define OUTBOX_DLQ_FIELD_DELIVERIES "dlq.deliveries"
#define OUTBOX_DLQ_FIELD_REASON "dlq.reason" /* permanent, exhausted, malformed, lost */
#define OUTBOX_DLQ_FIELD_ERROR "dlq.error"
#define OUTBOX_DLQ_FIELD_TIME "dlq.failed_at"

#endif
