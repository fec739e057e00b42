/*
 * Host names resolved without blocking (common/resolve.h).
 *
 * getaddrinfo() blocks for as long as the name servers take, whatever our
 * deadlines: a resolver that does not answer holds it for its own timeouts
 * and tries (about 10 s by glibc's defaults), and a thread cannot be stopped
 * in it. Each lookup here is a c-ares channel of its own: it reads the
 * resolver configuration when it starts, sends its queries on sockets the
 * caller waits on, and ends (its sockets closed, its query abandoned) when
 * freed. One channel per lookup costs a read of /etc/resolv.conf per
 * connect, which is rare; it makes cancelling one lookup simple, since
 * c-ares cancels only a whole channel.
 */
#include "common/compat.h"

#include "common/resolve.h"

#include <ares.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/wait.h"

/* Sockets one lookup can have open: c-ares opens one per name server (three
 * at most in resolv.conf) and per protocol. */
#define LOOKUP_SOCKETS 16

struct lookup_socket {
    int fd;
    int readable;
    int writable;
};

struct outbox_lookup {
    ares_channel channel;
    outbox_lookup_watch_fn *watch;
    void *arg;
    struct lookup_socket sockets[LOOKUP_SOCKETS];
    int nsockets;
    int state; /* 0 pending, 1 resolved, -1 failed */
    int status;
    struct outbox_addrs addrs;
    char host[256];
};

int outbox_host_is_address(const char *host)
{
    unsigned char buf[sizeof(struct in6_addr)];
    if (host == NULL || host[0] == '\0' || host[0] == '/' || host[0] == '@')
        return 1;
    return inet_pton(AF_INET, host, buf) == 1 || inet_pton(AF_INET6, host, buf) == 1;
}

void outbox_addrs_of_address(struct outbox_addrs *out, const char *host)
{
    size_t len = strnlen(host, sizeof(out->addr[0]) - 1);
    memcpy(out->addr[0], host, len);
    out->addr[0][len] = '\0';
    out->n = 1;
}

static pthread_once_t library_once = PTHREAD_ONCE_INIT;
static int library_status = ARES_SUCCESS;

static void library_init(void)
{
    library_status = ares_library_init(ARES_LIB_INIT_ALL);
}

static void on_socket(void *data, ares_socket_t fd, int readable, int writable)
{
    struct outbox_lookup *l = data;
    int at = -1;
    for (int i = 0; i < l->nsockets; i++)
        if (l->sockets[i].fd == fd)
            at = i;
    if (!readable && !writable) {
        if (at >= 0)
            l->sockets[at] = l->sockets[--l->nsockets];
    } else if (at >= 0) {
        l->sockets[at].readable = readable;
        l->sockets[at].writable = writable;
    } else if (l->nsockets < LOOKUP_SOCKETS) {
        l->sockets[l->nsockets++] = (struct lookup_socket){fd, readable, writable};
    }
    if (l->watch != NULL)
        l->watch(l->arg, fd, readable, writable);
}

static void on_result(void *data, int status, int timeouts, struct ares_addrinfo *res)
{
    struct outbox_lookup *l = data;
    (void)timeouts;
    l->status = status;
    /* IPv4 addresses first, then IPv6, each in the resolver's order, as
     * hiredis and libpq's getaddrinfo would try them: a server bound to
     * 127.0.0.1 alone is reached by "localhost" even where ::1 sorts first. */
    for (int family = 0; family < 2 && status == ARES_SUCCESS && res != NULL; family++) {
        for (struct ares_addrinfo_node *n = res->nodes; n != NULL; n = n->ai_next) {
            if (l->addrs.n == OUTBOX_ADDRS_MAX)
                break;
            if (n->ai_family != (family == 0 ? AF_INET : AF_INET6))
                continue;
            char text[OUTBOX_ADDR_LEN];
            const void *raw = NULL;
            if (n->ai_family == AF_INET)
                raw = &((const struct sockaddr_in *)(const void *)n->ai_addr)->sin_addr;
            else if (n->ai_family == AF_INET6)
                raw = &((const struct sockaddr_in6 *)(const void *)n->ai_addr)->sin6_addr;
            if (raw == NULL || inet_ntop(n->ai_family, raw, text, sizeof(text)) == NULL)
                continue;
            int seen = 0;
            for (int i = 0; i < l->addrs.n; i++)
                seen |= strcmp(l->addrs.addr[i], text) == 0;
            if (!seen)
                memcpy(l->addrs.addr[l->addrs.n++], text, sizeof(text));
        }
    }
    if (res != NULL)
        ares_freeaddrinfo(res);
    /* Called with ARES_EDESTRUCTION from outbox_lookup_free: nobody asks
     * for the result then. */
    l->state = l->addrs.n > 0 ? 1 : -1;
    if (status == ARES_SUCCESS && l->addrs.n == 0)
        l->status = ARES_ENODATA;
}

struct outbox_lookup *outbox_lookup_start(const char *host, outbox_lookup_watch_fn *watch,
                                          void *arg, char *err, size_t errlen)
{
    pthread_once(&library_once, library_init);
    if (library_status != ARES_SUCCESS) {
        snprintf(err, errlen, "cannot start the resolver (c-ares): %s",
                 ares_strerror(library_status));
        return NULL;
    }
    struct outbox_lookup *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    l->watch = watch;
    l->arg = arg;
    snprintf(l->host, sizeof(l->host), "%s", host);
    struct ares_options options;
    memset(&options, 0, sizeof(options));
    options.sock_state_cb = on_socket;
    options.sock_state_cb_data = l;
    int rc = ares_init_options(&l->channel, &options, ARES_OPT_SOCK_STATE_CB);
    if (rc != ARES_SUCCESS) {
        snprintf(err, errlen, "cannot start the resolver (c-ares): %s; check /etc/resolv.conf",
                 ares_strerror(rc));
        free(l);
        return NULL;
    }
    struct ares_addrinfo_hints hints;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    /* May answer at once (an address, /etc/hosts): state is then set. */
    ares_getaddrinfo(l->channel, l->host, NULL, &hints, on_result, l);
    return l;
}

void outbox_lookup_process(struct outbox_lookup *l, int read_fd, int write_fd)
{
    ares_process_fd(l->channel, read_fd < 0 ? ARES_SOCKET_BAD : read_fd,
                    write_fd < 0 ? ARES_SOCKET_BAD : write_fd);
}

long outbox_lookup_timeout_ms(struct outbox_lookup *l)
{
    if (l->state != 0)
        return -1;
    struct timeval tv;
    if (ares_timeout(l->channel, NULL, &tv) == NULL)
        return -1;
    return (long)tv.tv_sec * 1000 + (tv.tv_usec + 999) / 1000;
}

/* Why a lookup failed, with what to check. */
static const char *explain(int status)
{
    switch (status) {
    case ARES_ENOTFOUND:
        return "the name does not exist (not in /etc/hosts, and the name servers do not know "
               "it): check the host name";
    case ARES_ENODATA:
        return "the name has no IPv4 or IPv6 address: check the host name";
    case ARES_ETIMEOUT:
        return "no answer from the name servers in /etc/resolv.conf: check that they are "
               "reachable, or give an address";
    case ARES_ECONNREFUSED:
        return "the name servers in /etc/resolv.conf refused the query: check them";
    case ARES_ESERVFAIL:
    case ARES_EREFUSED:
        return "the name servers failed to answer (SERVFAIL or REFUSED): check their "
               "configuration";
    case ARES_ENOMEM:
        return "out of memory";
    default:
        return NULL;
    }
}

int outbox_lookup_result(const struct outbox_lookup *l, struct outbox_addrs *out, char *err,
                         size_t errlen)
{
    if (l->state == 1) {
        *out = l->addrs;
        return 1;
    }
    if (l->state == 0)
        return 0;
    const char *why = explain(l->status);
    if (why != NULL)
        snprintf(err, errlen, "cannot resolve %.200s: %s", l->host, why);
    else
        snprintf(err, errlen, "cannot resolve %.200s: %s", l->host, ares_strerror(l->status));
    return -1;
}

void outbox_lookup_free(struct outbox_lookup *l)
{
    if (l == NULL)
        return;
    ares_destroy(l->channel);
    free(l);
}

int outbox_resolve(const char *host, unsigned timeout_ms, int stop_fd, struct outbox_addrs *out,
                   char *err, size_t errlen)
{
    if (outbox_host_is_address(host)) {
        outbox_addrs_of_address(out, host);
        return 0;
    }
    struct outbox_lookup *l = outbox_lookup_start(host, NULL, NULL, err, errlen);
    if (l == NULL)
        return -1;
    double deadline = outbox_mono_now() + timeout_ms / 1000.0;
    int rc;
    while ((rc = outbox_lookup_result(l, out, err, errlen)) == 0) {
        double left = deadline - outbox_mono_now();
        if (left <= 0) {
            snprintf(err, errlen, "cannot resolve %.200s: " OUTBOX_NO_DNS_ANSWER, host, timeout_ms);
            break;
        }
        long wait_ms = (long)(left * 1000.0) + 1;
        long next = outbox_lookup_timeout_ms(l);
        if (next >= 0 && next < wait_ms)
            wait_ms = next;
        struct pollfd p[LOOKUP_SOCKETS + 1];
        int n = 0;
        for (int i = 0; i < l->nsockets; i++)
            p[n++] = (struct pollfd){.fd = l->sockets[i].fd,
                                     .events = (short)((l->sockets[i].readable ? POLLIN : 0) |
                                                       (l->sockets[i].writable ? POLLOUT : 0))};
        p[n++] = (struct pollfd){.fd = stop_fd, .events = POLLIN};
        int ready = poll(p, (nfds_t)n, (int)wait_ms);
        if (ready > 0 && p[n - 1].revents != 0) {
            snprintf(err, errlen, "stopped");
            break;
        }
        if (ready <= 0) {
            outbox_lookup_process(l, -1, -1);
            continue;
        }
        for (int i = 0; i < n - 1; i++)
            if (p[i].revents != 0)
                outbox_lookup_process(l,
                                      (p[i].revents & (POLLIN | POLLERR | POLLHUP)) ? p[i].fd : -1,
                                      (p[i].revents & POLLOUT) ? p[i].fd : -1);
    }
    outbox_lookup_free(l);
    return rc == 1 ? 0 : -1;
}
