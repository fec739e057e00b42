/*
 * Observation: what an operator needs to know about the outbox and the
 * streams, read from PostgreSQL and Redis with short calls that each have a
 * deadline. "outbox-relay status" runs it once; the daemon runs it every few
 * seconds on a thread of its own (never on the event loop) for its metrics
 * and its backpressure decisions.
 *
 * Queue age, the number that matters: for each stream and consumer group,
 * the age of the oldest message that group has not yet acknowledged, counted
 * from its outbox row's created_at, whether the message still waits in the
 * outbox, sits undelivered in the stream, or is pending (delivered, not acked).
 *
 * Producer admission is decided from PostgreSQL alone: every topic with a row
 * in outbox.topic_limits or outbox.topic_state, whether or not it has a
 * stream and whether or not Redis answers.
 */
#ifndef RELAY_OBSERVE_H
#define RELAY_OBSERVE_H

#include <stddef.h>

#include "common/common.h"

struct pg_conn;
struct redisContext;
struct relay_stream_list;
struct relay_config;
struct relay_observe_stop;

/* Topics an observation lists: the streams, and the topics with limits or
 * state, refused ones first. Admission is decided for every topic with limits
 * or state, listed or not. */
#define RELAY_OBS_TOPICS_MAX 64
#define RELAY_OBS_GROUPS_MAX 128

/* One stream of a topic: a partitioned topic has one entry per partition
 * stream, each with the topic's outbox figures. */
struct relay_topic_obs {
    char topic[OUTBOX_TOPIC_MAX + 1];
    char stream[OUTBOX_TOPIC_MAX + 80];
    int partition;             /* of a partition stream "<topic>:<ppp>"; -1 for "<topic>" */
    long long pending;         /* rows not yet in their stream (outbox.unsent; estimate) */
    double oldest_pending_age; /* seconds; -1 when none wait */
    int admitting;             /* producer admission: 1, 0, or -1 unknown */
    long long memory_bytes;    /* the stream's memory in Redis (MEMORY USAGE); -1 unknown */
    /* Set by the last trim (relay/retention.c): the group that holds the
     * stream's oldest entry past stream_retention, and by how long. */
    char trim_holder[128];
    double trim_held_back; /* seconds; 0 when nothing is held */
};

struct relay_group_obs {
    char stream[OUTBOX_TOPIC_MAX + 80];
    char group[128];
    int topic; /* index into topics, -1 when the stream is not a relay topic */
    long long consumers;
    long long lag;     /* entries not yet delivered; -1 when Redis cannot tell */
    long long pending; /* delivered, not acknowledged */
    long long dead_letters;
    double oldest_pending_age;     /* seconds; -1 when none */
    double oldest_undelivered_age; /* seconds; -1 when none */
    double queue_age;              /* seconds; 0 when nothing waits */
};

struct relay_observation {
    double taken_at; /* Unix time */
    int pg_ok;
    char pg_error[600];
    int pg_schema_behind; /* PostgreSQL answered, but a migration is missing: pg_error names it */
    int redis_ok;
    char redis_error[512];
    long long outbox_pending;    /* rows not yet in their stream (outbox.backlog; estimate) */
    double outbox_oldest_age;    /* seconds; -1 when none */
    long long quarantined;       /* rows in outbox.quarantine */
    long long blocked_keys;      /* keys of partitioned topics held back by a quarantined row */
    long long relays;            /* relays holding a member slot in this database */
    long long partitions;        /* partitions of partitioned topics */
    long long partitions_owned;  /* of those, held by a relay */
    char durability[128];        /* "appendonly yes, appendfsync always" */
    long long admission_topics;  /* topics whose admission was decided (or read) */
    long long admission_refused; /* of those, refused */
    long long outbox_bytes;      /* outbox.messages with its indexes and TOAST; -1 unknown */
    long long outbox_dead_rows;  /* dead row versions not yet vacuumed; -1 unknown */
    long long redis_used_memory; /* INFO memory used_memory; -1 unknown */
    /* Retention (relay/retention.c), carried from run to run. */
    double oldest_sent_age; /* seconds since the oldest published row kept was written; -1 none */
    unsigned long long sent_deleted_total;
    unsigned long long partitions_dropped_total;
    unsigned long long stream_trimmed_total;
    unsigned long long retention_errors_total;
    unsigned long long vacuums_total; /* VACUUMs the relay ran and that finished */
    int vacuum_running;
    size_t ntopics;
    struct relay_topic_obs topics[RELAY_OBS_TOPICS_MAX];
    size_t ngroups;
    struct relay_group_obs groups[RELAY_OBS_GROUPS_MAX];
};

/* Whether topics[i] is the first entry of its topic: a partitioned topic has
 * one entry per partition stream, and what is per topic is done once. */
int relay_observe_first_of_topic(const struct relay_observation *o, size_t i);

/*
 * Lets another thread end relay_observe at once: a call that waits for a
 * server returns as soon as the stop is triggered, and a triggered stop
 * stays triggered (every later wait ends at once too). new returns NULL when
 * out of memory or descriptors; trigger is safe from any thread and
 * NULL-safe; free is NULL-safe and must not race with a relay_observe using it.
 */
struct relay_observe_stop *relay_observe_stop_new(void) __attribute__((warn_unused_result));
void relay_observe_stop_trigger(struct relay_observe_stop *s);
void relay_observe_stop_free(struct relay_observe_stop *s);
/* The descriptor that becomes readable once s is triggered, for the waits
 * of core/pg.h and common/redisconn.h; -1 for NULL. */
int relay_observe_stop_fd(const struct relay_observe_stop *s);

/*
 * Fills o. *pg and *rd are connections the caller keeps between calls: NULL
 * or broken ones are (re)opened here. Every wait has a deadline: connecting,
 * connect_timeout; a PostgreSQL statement, statement_timeout +
 * connect_timeout (the server's own statement_timeout fires first unless the
 * network is gone); a Redis command, connect_timeout. A connection that
 * misses its deadline is closed. stop (may be NULL) ends every wait at once.
 * The PostgreSQL connection has TCP keepalives and tcp_user_timeout, so a
 * dead peer is noticed between observations too.
 *
 * With update_admission set (the daemon), the producer admission of every
 * topic in outbox.topic_limits or outbox.topic_state is recomputed through
 * outbox.observe_topic, in one statement; without, the last decisions are
 * read. Neither depends on Redis. The streams are those of the list, which
 * scans the nodes when its round says so (core/streamlist.h);
 * with streams NULL, every node is scanned. Returns 0 when both servers
 * answered, -1 otherwise (o says which and why).
 */
int relay_observe(const struct relay_config *cfg, struct pg_conn **pg, struct redisContext **rd,
                  int update_admission, const struct relay_observe_stop *stop,
                  struct relay_stream_list *streams, struct relay_observation *o);

/* "2026-11-30T11:35:14.123456Z" -> Unix time; -1 if not that form. */
double relay_observe_parse_time(const char *s);

#endif
