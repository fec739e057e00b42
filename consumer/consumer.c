/*
 * The consumer library (include/outbox/consumer.h): its public face. The
 * options, checked and copied by outbox_consumer_new, and run, which hands over to the
 * unordered mode (consumer/unordered.c) or the ordered one
 * (consumer/ordered.c) until stop. consumer/internal.h lists the other files.
 *
 * Nothing here prints: events go to the caller's log hook (none: silent), and
 * the most recent failure stays in the object (consumer/report.c).
 */
#include "common/compat.h"

#include "consumer/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/backoff.h"
#include "common/common.h"
#include "common/keys.h"
#include "common/url.h"

static int copy_name(char *dst, const char *src, const char *what, char *err, size_t errlen)
{
    if (src == NULL || src[0] == '\0') {
        snprintf(err, errlen, "%s is required", what);
        return -1;
    }
    if (strlen(src) >= NAME_MAX_LEN - 32) {
        snprintf(err, errlen, "%s is too long (at most %d bytes)", what, NAME_MAX_LEN - 32);
        return -1;
    }
    snprintf(dst, NAME_MAX_LEN, "%s", src);
    return 0;
}

/* A processed-table horizon must outlive every redelivery: 0, or -1 with
 * err, unless the options allow a shorter one. */
static int check_horizon(const struct outbox_consumer_options *o, char *err, size_t errlen)
{
    uint64_t horizon = outbox_consumer_redelivery_horizon_ms(o);
    if (o->processed_horizon_ms == 0 || o->processed_horizon_ms >= horizon ||
        o->allow_short_processed_horizon)
        return 0;
    snprintf(err, errlen,
             "the processed-table horizon (%llu ms) is shorter than the redelivery horizon "
             "(%llu ms: every backoff step over max_deliveries): a message delivered again "
             "after its processed row was purged would be handled twice; keep processed "
             "rows longer, or set allow_short_processed_horizon to accept it",
             (unsigned long long)o->processed_horizon_ms, (unsigned long long)horizon);
    return -1;
}

/* Fills in the defaults of the options left 0. */
static void apply_defaults(struct outbox_consumer_options *o)
{
    if (o->max_deliveries == 0)
        o->max_deliveries = 5;
    if (o->block_ms == 0)
        o->block_ms = 1000;
    if (o->command_timeout_ms == 0)
        o->command_timeout_ms = 5000;
    if (o->count == 0)
        o->count = 16;
    if (o->reclaim_interval_ms == 0)
        o->reclaim_interval_ms = 250;
    if (o->reconnect_min_ms == 0)
        o->reconnect_min_ms = 100;
    if (o->reconnect_max_ms == 0)
        o->reconnect_max_ms = 10000;
    if (o->lease_ms == 0)
        o->lease_ms = 10000;
}

/* Checks the options (their defaults filled in) but the names: 0, or -1
 * with err. */
static int check_options(const struct outbox_consumer_options *o, char *err, size_t errlen)
{
    if (o->nbackoff > OUTBOX_CONSUMER_BACKOFF_MAX) {
        snprintf(err, errlen, "at most %d backoff steps", OUTBOX_CONSUMER_BACKOFF_MAX);
        return -1;
    }
    for (uint32_t i = 0; i < o->nbackoff; i++)
        if (o->backoff_ms[i] == 0) {
            snprintf(err, errlen, "backoff steps must be at least 1 ms");
            return -1;
        }
    if (check_horizon(o, err, errlen) < 0)
        return -1;
    if (o->partitions == 1 || o->partitions > OUTBOX_PARTITIONS_MAX) {
        snprintf(err, errlen,
                 "partitions is the number of partitions of a partitioned topic, 2 to %d (0: the "
                 "unordered mode)",
                 OUTBOX_PARTITIONS_MAX);
        return -1;
    }
    if (o->partitions > 1 && (o->lease_ms < 300 || o->lease_ms > 600000)) {
        snprintf(err, errlen, "lease_ms is 300 to 600000");
        return -1;
    }
    if (o->partitions > 1 && o->count > ORDER_QUEUE_MAX) {
        snprintf(err, errlen, "count is at most %d in the ordered mode", ORDER_QUEUE_MAX);
        return -1;
    }
    if (o->park_keys && o->partitions <= 1) {
        snprintf(err, errlen, "park_keys needs the ordered mode (partitions)");
        return -1;
    }
    if (o->partitions > 1 && o->dlq != NULL && o->dlq[0] != '\0') {
        snprintf(err, errlen,
                 "dlq is not set in the ordered mode: each partition has its own dead-letter "
                 "stream, {<partition stream>}.<group>.dlq");
        return -1;
    }
    return 0;
}

/* Copies the names of the options into c, the consumer's own ("<hostname>-
 * <pid>" when not given) and the dead-letter and replay streams' too: 0, or
 * -1 with err. */
static int copy_names(struct outbox_consumer *c, const struct outbox_consumer_options *opts,
                      char *err, size_t errlen)
{
    if (copy_name(c->stream, opts->stream, "stream", err, errlen) < 0 ||
        copy_name(c->group, opts->group, "group", err, errlen) < 0)
        return -1;
    if (opts->consumer != NULL && opts->consumer[0] != '\0') {
        if (copy_name(c->consumer, opts->consumer, "consumer", err, errlen) < 0)
            return -1;
    } else {
        char host[256] = "consumer";
        gethostname(host, sizeof(host) - 1);
        host[sizeof(host) - 1] = '\0';
        snprintf(c->consumer, sizeof(c->consumer), "%s-%ld", host, (long)getpid());
    }
    if (opts->dlq != NULL && opts->dlq[0] != '\0') {
        if (copy_name(c->dlq, opts->dlq, "dlq", err, errlen) < 0)
            return -1;
    } else {
        if (outbox_consumer_dlq_name(c->stream, c->group, c->dlq, sizeof(c->dlq)) < 0) {
            snprintf(err, errlen, "stream and group names are too long together");
            return -1;
        }
    }
    if (outbox_consumer_replay_name(c->stream, c->group, c->replay, sizeof(c->replay)) < 0) {
        snprintf(err, errlen, "stream and group names are too long together");
        return -1;
    }
    return 0;
}

struct outbox_consumer *outbox_consumer_new(const struct outbox_consumer_options *opts,
                                            outbox_consumer_handler_fn *handler, void *arg,
                                            char *err, size_t errlen)
{
    if (opts == NULL || handler == NULL) {
        snprintf(err, errlen, "options and handler are required");
        return NULL;
    }
    struct outbox_consumer *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    c->o = *opts;
    c->handler = handler;
    c->arg = arg;
    apply_defaults(&c->o);
    if (check_options(&c->o, err, errlen) < 0 || copy_names(c, opts, err, errlen) < 0)
        goto fail;
    if (outbox_url_parse_seeds(opts->redis_url != NULL ? opts->redis_url : "", &c->url, err,
                               errlen) < 0)
        goto fail;
    snprintf(c->lease_ms_s, sizeof(c->lease_ms_s), "%u", c->o.lease_ms);
    c->min_backoff_ms = outbox_policy_min_backoff(&c->o);
    /* The strings of the copied options point to the caller's memory. */
    c->o.stream = c->stream;
    c->o.group = c->group;
    c->o.consumer = c->consumer;
    c->o.dlq = c->dlq;
    c->o.redis_url = NULL; /* parsed into c->url */
    outbox_backoff_init(&c->reconnect, c->o.reconnect_min_ms, c->o.reconnect_max_ms);
    return c;
fail:
    free(c);
    return NULL;
}

void outbox_consumer_stop(struct outbox_consumer *c)
{
    c->stop = 1;
}

const struct outbox_consumer_stats *outbox_consumer_stats(const struct outbox_consumer *c)
{
    return &c->stats;
}

const char *outbox_consumer_name(const struct outbox_consumer *c)
{
    return c->consumer;
}

const char *outbox_consumer_dlq(const struct outbox_consumer *c)
{
    return c->dlq;
}

enum outbox_consumer_err outbox_consumer_err(const struct outbox_consumer *c)
{
    return c->err;
}

const char *outbox_consumer_errstr(const struct outbox_consumer *c)
{
    return c->errstr;
}

void outbox_consumer_free(struct outbox_consumer *c)
{
    if (c == NULL)
        return;
    outbox_conn_close_all(c);
    free(c);
}

int outbox_consumer_run(struct outbox_consumer *c)
{
    uint64_t horizon = outbox_consumer_redelivery_horizon_ms(&c->o);
    if (c->o.processed_horizon_ms > 0 && c->o.processed_horizon_ms < horizon)
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_WARNING,
                           "the processed-table horizon (%llu ms) is shorter than the redelivery "
                           "horizon (%llu ms), as allow_short_processed_horizon allows: a message "
                           "delivered again after its processed row was purged is handled twice",
                           (unsigned long long)c->o.processed_horizon_ms,
                           (unsigned long long)horizon);
    int rc;
    if (c->o.partitions > 1) {
        rc = outbox_ordered_run(c);
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_INFO,
                           "%s stopped: %llu delivered, %llu done, %llu retried, %llu "
                           "dead-lettered (%llu malformed, %llu lost), %llu taken over; %llu "
                           "partitions taken, %llu lost",
                           c->consumer, c->stats.delivered, c->stats.done, c->stats.retried,
                           c->stats.dead_lettered, c->stats.malformed, c->stats.lost,
                           c->stats.reclaimed, c->stats.leases_taken, c->stats.leases_lost);
    } else {
        rc = outbox_unordered_run(c);
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_INFO,
                           "%s stopped: %llu delivered, %llu done, %llu retried, %llu "
                           "dead-lettered (%llu malformed, %llu lost), %llu taken over",
                           c->consumer, c->stats.delivered, c->stats.done, c->stats.retried,
                           c->stats.dead_lettered, c->stats.malformed, c->stats.lost,
                           c->stats.reclaimed);
    }
    outbox_conn_close_all(c);
    return rc;
}
