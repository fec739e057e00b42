/*
 * Host names resolved without blocking (common/resolve.c), with c-ares: the
 * lookup of one name on a channel of its own, driven by whoever waits on its
 * sockets (the daemon's event loop: relay/lookup.c), and the blocking lookup
 * with a deadline and a stop that the library, the tools and the
 * observation thread use.
 *
 * A lookup reads /etc/resolv.conf and /etc/hosts when it starts, so each
 * connect sees the resolver configuration of the moment.
 */
#ifndef OUTBOX_RESOLVE_H
#define OUTBOX_RESOLVE_H

#include <stddef.h>

/* Addresses kept per name: a connect tries them in turn. */
#define OUTBOX_ADDRS_MAX 8
/* Room for an IPv6 address in text, with its NUL. */
#define OUTBOX_ADDR_LEN 46

/* Why a connect gave up on a lookup: a format with connect_timeout's ms. */
#define OUTBOX_NO_DNS_ANSWER                                                                       \
    "no answer from the name servers in /etc/resolv.conf within connect_timeout (%u ms): check "   \
    "that they are reachable, or give an address"

struct outbox_addrs {
    int n;
    char addr[OUTBOX_ADDRS_MAX][OUTBOX_ADDR_LEN];
};

/* 1 when host needs no lookup: an IPv4 or IPv6 address, empty, or a Unix
 * socket's path (starting with '/' or '@', as libpq takes it). */
int outbox_host_is_address(const char *host);

/* The addresses of a host that needs no lookup (outbox_host_is_address):
 * the host itself, cut to OUTBOX_ADDR_LEN - 1 bytes. */
void outbox_addrs_of_address(struct outbox_addrs *out, const char *host);

struct outbox_lookup;

/* Told of each socket the lookup opens, and again when its interest changes;
 * readable and writable both 0: stop watching fd. */
typedef void outbox_lookup_watch_fn(void *arg, int fd, int readable, int writable);

/* Starts resolving host (IPv4 and IPv6). NULL, with why in err, when c-ares
 * cannot start (out of memory; an unreadable resolver configuration). */
struct outbox_lookup *outbox_lookup_start(const char *host, outbox_lookup_watch_fn *watch,
                                          void *arg, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/* Lets the lookup read read_fd and write write_fd (-1: none), and run its
 * own timeouts: call it when a socket is ready and when timeout_ms passed. */
void outbox_lookup_process(struct outbox_lookup *l, int read_fd, int write_fd);

/* Milliseconds until the lookup wants outbox_lookup_process for its own
 * timeouts (it resends, or tries the next name server); -1: none pending. */
long outbox_lookup_timeout_ms(struct outbox_lookup *l);

/* 0 while pending; 1 when resolved, with the addresses in out; -1 when it
 * failed, with why in err (the name unknown, no answer, ...). */
int outbox_lookup_result(const struct outbox_lookup *l, struct outbox_addrs *out, char *err,
                         size_t errlen);

/* Ends the lookup (pending or not) and closes its sockets; NULL is fine.
 * The watch hook may be called for sockets it closes. */
void outbox_lookup_free(struct outbox_lookup *l);

/*
 * Resolves host, blocking for at most timeout_ms, and ending early when
 * stop_fd (-1: none) becomes readable. 0 with the addresses in out (an
 * address given as host is its own single result), or -1 with why in err.
 */
int outbox_resolve(const char *host, unsigned timeout_ms, int stop_fd, struct outbox_addrs *out,
                   char *err, size_t errlen) __attribute__((warn_unused_result));

#endif
