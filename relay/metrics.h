/*
 * A small HTTP endpoint on the relay's event loop: /metrics (Prometheus text
 * format), /healthz (the loop answers) and /readyz (connected to both servers
 * and not stalled). One request per connection, bounded in size, time and
 * number of clients, so a slow or half-open client cannot stall the loop,
 * and idle clients make way for new ones, so they cannot lock a probe out.
 */
#ifndef RELAY_METRICS_H
#define RELAY_METRICS_H

#include <stddef.h>

#include "common/buf.h"

/* The endpoint reads a request of at most this many bytes, head included. */
#define RELAY_METRICS_REQUEST_MAX 8192

struct ev_loop;
struct relay_metrics;

struct relay_metrics_hooks {
    void *arg;
    /* Writes the /metrics body into a buffer it allocates (*out, freed by the
     * server with free); returns its length or -1. */
    long (*render)(void *arg, char **out);
    /* 1 when ready; otherwise writes why into why. */
    int (*ready)(void *arg, char *why, size_t whylen);
};

/* Listens on "host:port" (numeric host). NULL with err on failure. */
struct relay_metrics *relay_metrics_new(struct ev_loop *loop, const char *listen_addr,
                                        const struct relay_metrics_hooks *hooks, char *err,
                                        size_t errlen) __attribute__((warn_unused_result));

/* Closes the listener and every client. NULL-safe. */
void relay_metrics_free(struct relay_metrics *m);

/* The largest page a render hook builds (struct outbox_buf's max). */
#define RELAY_METRICS_TEXT_MAX ((size_t)16 << 20)

/* Appends s as a label value of the Prometheus text format, without the
 * quotes: a backslash, a double quote and a newline escaped, and each byte
 * that is not part of valid UTF-8 replaced by U+FFFD. Names read from Redis
 * or PostgreSQL may hold any bytes; one unescaped quote would make the whole
 * scrape invalid. */
void relay_metrics_label(struct outbox_buf *t, const char *s);

#endif
