/*
 * Retention (relay/retention.c): the observation thread drops published rows
 * before each observation and trims streams after it, on its own
 * connections, so that neither the outbox nor Redis grows without end
 * (docs/OPERATIONS.md, "Retention"; docs/DESIGN.md, "Retention").
 *
 *   Published rows: outbox.rotate (migrations/019) drops the table's
 *   partitions every stream's recorded position has passed since
 *   sent_retention, and creates those ahead of the transaction counter. In a
 *   partition that is due but kept for a stream behind it (a paused topic's),
 *   outbox.purge_sent deletes the rows whose stream's position passed them, a
 *   bounded slice per call (never a row outbox.unsent shows, never a
 *   quarantined one), each call its own short transaction, for at most a
 *   second per run: off the relay's publish path.
 *
 *   Vacuum: when the outbox holds vacuum_dead_rows dead row versions (rows
 *   deleted one at a time: the purge above, the quarantine tools, an
 *   operator; a tenth of that once nothing waits), a VACUUM runs on a
 *   connection of its own, without waiting for it: the batch reads walk the
 *   indexes, and the entries of deleted rows stay there until vacuum removes
 *   them. Autovacuum looks at a table once a minute at most. Only the
 *   table's owner may VACUUM it: a relay whose role is not is told once, and
 *   leaves it to autovacuum.
 *
 *   Streams: every stream of the relay's topics, and every replay stream, is
 *   trimmed by the relay's trim function in Redis to the entries younger than
 *   stream_retention (replay streams: 0) or not yet acknowledged by every
 *   group. Dead-letter streams are never trimmed.
 */
#ifndef RELAY_RETENTION_H
#define RELAY_RETENTION_H

#include "core/observe.h"

struct pg_conn;
struct redisContext;
struct relay_stream_list;
struct relay_config;

/* What the thread keeps between runs. Zero-initialise it. */
struct relay_retention {
    long long purge_after_id; /* the purge goes on from here */
    double purge_restart_at;  /* monotonic seconds: walk from the first row again */
    int purge_caught_up;      /* the last call reached the rows to keep */
    double oldest_sent_age;   /* oldest published row kept, from the last rotation; -1 none */
    double next_trim_at;      /* monotonic seconds */
    unsigned long long sent_deleted_total;
    unsigned long long partitions_dropped_total;
    unsigned long long stream_trimmed_total;
    unsigned long long errors_total;
    char last_error[512]; /* the last failure logged, so each is logged once */
    /* The VACUUM in flight, on a connection of its own. */
    struct pg_conn *vacuum_conn;
    double vacuum_started; /* monotonic seconds; 0 when none runs */
    int vacuum_not_owner;  /* 1: the role may not VACUUM; not tried again */
    unsigned long long vacuums_total;
    /* From the last trim: the streams a group holds back, and by whom. */
    size_t nheld;
    struct {
        char stream[OUTBOX_TOPIC_MAX + 80];
        char group[128];
        double held_back; /* seconds past stream_retention */
    } held[RELAY_OBS_TOPICS_MAX];
};

/*
 * The outbox's rows: its partitions rotated (and rows deleted in those a
 * stream keeps), on the observation's PostgreSQL connection (NULL or broken:
 * skipped), before the observation: an observation is handed on as soon as
 * it is taken (and its streams trimmed), not after a pass that may wait for
 * its locks.
 */
void relay_retention_rows(const struct relay_config *cfg, struct pg_conn **pg,
                          const struct relay_observe_stop *stop, struct relay_retention *st);

/*
 * The rest, after relay_observe filled o on the same Redis connection (NULL
 * or broken: skipped, the next run tries again), and listed the streams
 * the trim pass visits in streams. Copies the totals and, per topic, the
 * group that holds trimming back into o.
 */
void relay_retention_run(const struct relay_config *cfg, struct redisContext **rd,
                         const struct relay_observe_stop *stop, struct relay_stream_list *streams,
                         struct relay_retention *st, struct relay_observation *o);

/* Cancels a VACUUM in flight and closes its connection. */
void relay_retention_end(struct relay_retention *st);

#endif
