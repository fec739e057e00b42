/*
 * Host names resolved on the event loop (relay/lookup.h): the watchers of
 * one c-ares lookup. c-ares says which sockets to watch (the watch hook),
 * and when to run its own timeouts (resends, the next name server); the
 * lookup's end is handed over from a zero timer, so that done never runs
 * inside c-ares, nor inside relay_lookup_start.
 */
#include "common/compat.h"

#include "relay/lookup.h"

#include <stdio.h>
#include <stdlib.h>

#include "common/resolve.h"

/* The sockets of one lookup: one per name server and protocol. */
#define LOOKUP_WATCHERS 16

struct relay_lookup {
    struct ev_loop *loop;
    struct outbox_lookup *lookup;
    relay_lookup_fn *done;
    void *arg;
    ev_io io[LOOKUP_WATCHERS];
    int nio;
    ev_timer timer; /* c-ares's next timeout, or at once when it has ended */
};

static void on_io(struct ev_loop *loop, ev_io *w, int revents);

static void watch(void *arg, int fd, int readable, int writable)
{
    struct relay_lookup *l = arg;
    int at = -1;
    for (int i = 0; i < l->nio; i++)
        if (l->io[i].fd == fd)
            at = i;
    if (at >= 0)
        ev_io_stop(l->loop, &l->io[at]);
    if (!readable && !writable) {
        if (at >= 0 && at != --l->nio) {
            /* Move the last watcher into the gap (stopped, so it may be
             * copied), and start it again there. */
            int last_fd = l->io[l->nio].fd,
                last_events = l->io[l->nio].events & (EV_READ | EV_WRITE);
            ev_io_init(&l->io[at], on_io, last_fd, last_events);
            l->io[at].data = l;
            ev_io_stop(l->loop, &l->io[l->nio]);
            ev_io_start(l->loop, &l->io[at]);
        }
        return;
    }
    if (at < 0) {
        if (l->nio == LOOKUP_WATCHERS)
            return; /* c-ares's own timeouts still end the lookup */
        at = l->nio++;
    }
    ev_io_init(&l->io[at], on_io, fd, (readable ? EV_READ : 0) | (writable ? EV_WRITE : 0));
    l->io[at].data = l;
    ev_io_start(l->loop, &l->io[at]);
}

static void stop_all(struct relay_lookup *l)
{
    for (int i = 0; i < l->nio; i++)
        ev_io_stop(l->loop, &l->io[i]);
    ev_timer_stop(l->loop, &l->timer);
}

/* Arms the timer: at once when the lookup has ended, else at c-ares's next
 * timeout. */
static void schedule(struct relay_lookup *l)
{
    struct outbox_addrs addrs;
    char why[8];
    int state = outbox_lookup_result(l->lookup, &addrs, why, sizeof(why));
    ev_timer_stop(l->loop, &l->timer);
    long ms = state != 0 ? 0 : outbox_lookup_timeout_ms(l->lookup);
    if (ms < 0)
        return;
    ev_timer_set(&l->timer, (double)ms / 1000.0, 0.0);
    ev_timer_start(l->loop, &l->timer);
}

static void on_io(struct ev_loop *loop, ev_io *w, int revents)
{
    struct relay_lookup *l = w->data;
    int fd = w->fd;
    (void)loop;
    outbox_lookup_process(l->lookup, (revents & EV_READ) ? fd : -1, (revents & EV_WRITE) ? fd : -1);
    schedule(l);
}

static void on_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay_lookup *l = w->data;
    (void)loop;
    (void)revents;
    struct outbox_addrs addrs;
    char why[512];
    int state = outbox_lookup_result(l->lookup, &addrs, why, sizeof(why));
    if (state == 0) {
        outbox_lookup_process(l->lookup, -1, -1);
        state = outbox_lookup_result(l->lookup, &addrs, why, sizeof(why));
    }
    if (state == 0) {
        schedule(l);
        return;
    }
    relay_lookup_fn *done = l->done;
    void *arg = l->arg;
    relay_lookup_cancel(l);
    done(arg, state == 1, state == 1 ? &addrs : NULL, state == 1 ? NULL : why);
}

struct relay_lookup *relay_lookup_start(struct ev_loop *loop, const char *host,
                                        relay_lookup_fn *done, void *arg, char *err, size_t errlen)
{
    struct relay_lookup *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    l->loop = loop;
    l->done = done;
    l->arg = arg;
    ev_init(&l->timer, on_timer);
    l->timer.data = l;
    l->lookup = outbox_lookup_start(host, watch, l, err, errlen);
    if (l->lookup == NULL) {
        stop_all(l);
        free(l);
        return NULL;
    }
    schedule(l);
    return l;
}

void relay_lookup_cancel(struct relay_lookup *l)
{
    if (l == NULL)
        return;
    stop_all(l);
    /* Its sockets close here: the watch hook sees them go, and stops
     * watchers already stopped. */
    outbox_lookup_free(l->lookup);
    stop_all(l);
    free(l);
}
