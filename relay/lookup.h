/*
 * Host names resolved on the event loop (relay/lookup.c): a c-ares lookup
 * (common/resolve.h) whose sockets and timeouts are libev watchers, so that
 * a name server that does not answer holds up nothing but the connect that
 * waits for it.
 */
#ifndef RELAY_LOOKUP_H
#define RELAY_LOOKUP_H

#include <ev.h>

#include "common/resolve.h"

struct relay_lookup;

/* The lookup's end: addrs when it resolved (ok 1), else why (ok 0). The
 * lookup is gone when this is called: forget its pointer first. */
typedef void relay_lookup_fn(void *arg, int ok, const struct outbox_addrs *addrs, const char *why);

/*
 * Starts resolving host; done is called once, from the loop, never from
 * here (even when host is an address or in /etc/hosts). NULL, with why in
 * err, when the lookup cannot start.
 */
struct relay_lookup *relay_lookup_start(struct ev_loop *loop, const char *host,
                                        relay_lookup_fn *done, void *arg, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/* Ends a pending lookup without calling done; NULL is fine. */
void relay_lookup_cancel(struct relay_lookup *l);

#endif
