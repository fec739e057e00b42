/*
 * Every Redis key name the project uses, built in one place (common/keys.c)
 * for the daemon, the tools and the consumer library (docs/DESIGN.md, "Key
 * layout"). Each writes a NUL-terminated name into out and returns its length,
 * or -1 when it does not fit in outlen bytes.
 */
#ifndef OUTBOX_KEYS_H
#define OUTBOX_KEYS_H

#include <stddef.h>
#include <stdint.h>

/* Partitions of a topic: 1 (no suffix) to OUTBOX_PARTITIONS_MAX. */
#define OUTBOX_PARTITIONS_MAX 1000
/* ":<ppp>", what a partition adds to its topic's stream name. */
#define OUTBOX_PARTITION_SUFFIX_LEN 4

/* FNV-1a 32 of the bytes: the partition hash (docs/PARTITIONS.md, and
 * outbox.fnv1a32 in migrations/011_partitions.sql, which must agree). */
uint32_t outbox_partition_hash(const void *data, size_t len);

/* The partition of a row: the hash of its key mod partitions, or, for a row
 * without a key (key NULL), its id mod partitions. 0 when partitions <= 1. */
uint32_t outbox_partition_of(const char *key, size_t key_len, int64_t id, uint32_t partitions);

/* Hash slots of a Redis Cluster. */
#define OUTBOX_CLUSTER_SLOTS 16384

/* The Redis Cluster hash slot of a key: CRC16 (XMODEM) of the key, or of
 * the text between its first "{" and the next "}" when that is not empty,
 * mod 16384 (the cluster specification's HASH_SLOT). */
unsigned outbox_key_slot(const char *key, size_t len);

/* "<prefix><topic>": a topic's stream. prefix may be NULL. */
int outbox_key_stream(const char *prefix, const char *topic, size_t topic_len, char *out,
                      size_t outlen) __attribute__((warn_unused_result));

/* ":<ppp>" (partition in three digits) into out when partitions > 1, and its
 * length; 0 and nothing written for a topic of one partition. What follows
 * the topic in a partition stream's name. */
size_t outbox_key_partition_suffix(uint32_t partition, uint32_t partitions,
                                   char out[OUTBOX_PARTITION_SUFFIX_LEN]);

/* A partition's stream: "<prefix><topic>:<ppp>" (ppp: three digits) when
 * the topic has more than one partition, else "<prefix><topic>". */
int outbox_key_partition_stream(const char *prefix, const char *topic, size_t topic_len,
                                uint32_t partition, uint32_t partitions, char *out, size_t outlen)
    __attribute__((warn_unused_result));

/* The length of the topic in a stream name without its prefix: name_len, or
 * name_len - 4 when the name ends in ":<three digits>" (the partition, then
 * stored in *partition; -1 there when there is none). */
size_t outbox_key_stream_topic_len(const char *name, size_t name_len, int *partition);

/* "{<stream>}:dedup:<message id>": a message's dedup record, in its stream's
 * hash slot. The publish path writes the same bytes straight into the Redis
 * protocol (relay/batch.c); tests/unit/test_batch.c checks that they agree. */
int outbox_key_dedup(const char *stream, const char *message_id, size_t message_id_len, char *out,
                     size_t outlen) __attribute__((warn_unused_result));

/* "{<stream>}.<group>.dlq": a consumer group's dead letters, in the
 * stream's hash slot (a Redis Cluster keeps every key of a stream on one
 * primary). */
int outbox_key_dlq(const char *stream, const char *group, char *out, size_t outlen)
    __attribute__((warn_unused_result));

/* "{<stream>}.<group>.replay": the dead letters replayed to that group
 * alone, in the stream's hash slot. */
int outbox_key_replay(const char *stream, const char *group, char *out, size_t outlen)
    __attribute__((warn_unused_result));

/* The names before the hash tag, "<stream>.<group>.dlq" and
 * "<stream>.<group>.replay": what "outbox-relay dlq migrate" and the
 * consumer library rename (docs/CONSUMERS.md, "Key names before 0.2"). */
int outbox_key_dlq_old(const char *stream, const char *group, char *out, size_t outlen)
    __attribute__((warn_unused_result));
int outbox_key_replay_old(const char *stream, const char *group, char *out, size_t outlen)
    __attribute__((warn_unused_result));

/* "{<stream>}:<what>:<group>", the keys of an ordered consumer group
 * (docs/CONSUMERS.md, "Ordered consumers"), in the stream's hash slot: what
 * is "lease" (a partition stream's lease), "lease-token" (the counter its
 * tokens come from) or "lease-members" (the group's consumers, on the
 * topic's stream). */
int outbox_key_lease(const char *stream, const char *group, const char *what, char *out,
                     size_t outlen) __attribute__((warn_unused_result));

/* 1 when topic is 1..OUTBOX_TOPIC_MAX bytes of [A-Za-z0-9._-]. */
int outbox_topic_valid(const char *topic, size_t len);

#endif
