/*
 * Why a whole batch failed, chosen where the failure is found, never read
 * back from an error message: the batch loop (relay/loop.h) reports it, and
 * the metrics count it by kind.
 */
#ifndef RELAY_FAIL_H
#define RELAY_FAIL_H

/* Also the labels of outbox_relay_publish_errors_total. */
enum relay_fail_kind {
    RELAY_FAIL_REDIS_CONNECTION = 0, /* Redis unreachable or the connection dropped */
    RELAY_FAIL_REDIS_TIMEOUT,        /* no reply within publish_timeout */
    RELAY_FAIL_REDIS_ERROR,          /* an error reply about the server, not the row */
    RELAY_FAIL_REDIS_REPLY,          /* a reply of an unexpected type */
    RELAY_FAIL_REDIS_REPLICAS,       /* fewer than min_replicas replicas hold the batch */
    RELAY_FAIL_POSTGRES,             /* a statement of the batch failed */
    RELAY_FAIL_KINDS
};

/* The label of a failure kind in the metrics: "redis_connection", ... */
const char *relay_fail_kind_name(enum relay_fail_kind kind);

#endif
