/*
 * Every Redis key name the project uses, built in one place (common/keys.c)
 * for the daemon, the tools and the consumer library (docs/DESIGN.md, "Key
 * layout"). Each writes a NUL-terminated name into out and returns its length,
 * or -1 when it does not fit in outlen bytes.
 */
#ifndef RELAY_KEYS_H
#define RELAY_KEYS_H

#include <stddef.h>

/* "<prefix><topic>": a topic's stream. prefix may be NULL. */
int relay_key_stream(const char *prefix, const char *topic, size_t topic_len, char *out,
                     size_t outlen) __attribute__((warn_unused_result));

/* "{<stream>}:dedup:<message id>": a message's dedup record, in its stream's
 * hash slot. The publish path writes the same bytes straight into the Redis
 * protocol (relay/batch.c); tests/unit/test_batch.c checks that they agree. */
int relay_key_dedup(const char *stream, const char *message_id, size_t message_id_len, char *out,
                    size_t outlen) __attribute__((warn_unused_result));

/* "<stream>.<group>.dlq": a consumer group's dead letters. */
int relay_key_dlq(const char *stream, const char *group, char *out, size_t outlen)
    __attribute__((warn_unused_result));

/* "<stream>.<group>.replay": the dead letters replayed to that group alone. */
int relay_key_replay(const char *stream, const char *group, char *out, size_t outlen)
    __attribute__((warn_unused_result));

#endif
