/*
 * The one blocking Redis connect (common/redisconn.c), for every part that
 * talks to Redis with blocking calls: the consumer library and the dlq
 * commands. It connects within a deadline, gives every later command a
 * deadline of its own, turns TCP keepalive on, authenticates (the ACL form
 * AUTH user password when the URL names a user) and selects the database.
 * The daemon's event loop uses hiredis's async API instead (relay/sink.c),
 * and its observation thread a stoppable variant (relay/observe.c).
 */
#ifndef RELAY_REDISCONN_H
#define RELAY_REDISCONN_H

#include <stddef.h>
#include <stdint.h>

struct redisContext;
struct relay_redis_url;

enum relay_redis_fault {
    RELAY_REDIS_OK = 0,
    RELAY_REDIS_NOMEM,   /* out of memory */
    RELAY_REDIS_IO,      /* cannot connect, or no answer within the deadline */
    RELAY_REDIS_REFUSED, /* Redis answered with an error (AUTH, SELECT) */
};

/*
 * The connection, or NULL with *fault set and a message in err that says what
 * to do (the password is never in it). command_timeout_ms bounds every
 * command's reply from then on (hiredis's redisSetTimeout).
 */
struct redisContext *relay_redis_open(const struct relay_redis_url *u, uint32_t connect_timeout_ms,
                                      uint32_t command_timeout_ms, char *err, size_t errlen,
                                      enum relay_redis_fault *fault)
    __attribute__((warn_unused_result));

#endif
