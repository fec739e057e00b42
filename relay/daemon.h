/*
 * The daemon's parts and the one struct they share (docs/DESIGN.md, "Modules").
 * Not part of any library's interface: only the daemon's own files include it.
 *
 *   relay/relay.c         life cycle, timers, signals, drain, reload, watchdog
 *   relay/loop_io.c       the batch loop's ops on the claiming connection and Redis
 *   relay/wake_io.c       the wake-up protocol's ops on the LISTEN connection
 *   relay/ownership_io.c  the owner connection: the partitions this relay claims
 *   relay/observe_io.c    the observation thread and its hand-offs with the loop
 *   relay/render.c        /metrics text, /readyz and the stuck-loop check
 *
 * The decisions live in pure modules with unit tests: relay/loop.c,
 * relay/cursors.c, relay/wake.c, relay/ownership.c, relay/backpressure.c and
 * relay/batch.c. A machine X.c and the file that drives it on real
 * connections, X_io.c, sit side by side in a listing (Redis pairs ae.c with
 * ae_epoll.c the same way); relay/observe_io.c drives core/observe.c.
 */
#ifndef RELAY_DAEMON_H
#define RELAY_DAEMON_H

/* This header defines the struct that embeds the loop's watchers, so unlike
 * the public headers it includes libev's. */
#include <ev.h>
#include <stddef.h>
#include <time.h>

#include "core/config.h"
#include "relay/backpressure.h"
#include "relay/batch.h"
#include "relay/cursors.h"
#include "relay/loop.h"
#include "core/observe.h"
#include "core/streamlist.h"
#include "relay/streamseen.h"
#include "relay/wake.h"

struct pg_result;
struct relay_metrics;
struct relay_observer;
struct relay_owner;
struct relay_pgsrc;
struct relay_sink;

/* The phases of a recorded batch, for outbox_relay_batch_phase_seconds:
 * waiting for a chunk of its rows with nothing publishing (read); its calls
 * in flight, until the last reply and WAIT (publish); recording its
 * positions (record). They follow one another and add up to its duration. */
enum relay_batch_phase { RELAY_PHASE_READ, RELAY_PHASE_PUBLISH, RELAY_PHASE_RECORD, RELAY_PHASES };

/* A chunk of the batch being published (relay/loop_io.c). Rows point into res. */
struct relay_chunk {
    struct pg_result *res;
    struct relay_row *rows; /* batch_size of them */
    size_t nrows;
    uint32_t number; /* in its batch, from 0 */
    uint64_t gen;    /* the loop's generation it belongs to */
    uint64_t ms;     /* the time part of its rows' entry ids: its tick's */
    size_t pending;  /* calls in flight */
    int waited;      /* its WAIT for min_replicas was sent */
    int failed;
    enum relay_fail_kind kind;
    char error[512];
};

/* The most rows a batch quarantines, and the most streams it records. */
#define RELAY_QUARANTINE_MAX 1024

/* A key held behind a row quarantined in the batch being published. */
struct relay_held {
    char topic[OUTBOX_TOPIC_MAX + 1];
    char key[OUTBOX_KEY_MAX];
    size_t key_len;
    int64_t id; /* the quarantined row that holds it */
};

/* A list of streams for outbox.record_batch, as array literals. */
struct record_arrays {
    struct outbox_buf topics, partitions, ids;
    size_t n;
};

/* The batch loop and what it holds (relay/loop_io.c). */
struct relay_loop_io {
    struct relay_loop loop;
    struct relay_pgsrc *pg;        /* the claiming connection, in autocommit */
    uint64_t sent_gen;             /* the generation of its statement in flight */
    uint32_t read_number;          /* the chunk its read statement asks for */
    int64_t after_id;              /* the last row read: where the next chunk resumes */
    int64_t upto_id;               /* the batch's highest id (outbox.batch_bounds) */
    uint64_t read_prev, read_next; /* the batch being read */
    uint64_t min_ms;               /* the least ms of the next tick */
    /* The bounds of the batch (known_prev, known_prev + 1], which the tick
     * answered with (outbox.tick_bounds); known_prev 0: none. A batch is
     * fixed once its two ticks exist, so they stay true. */
    uint64_t known_prev;
    int64_t known_lo, known_hi;
    struct relay_chunk chunks[2]; /* the one publishing, and the one read ahead */
    struct relay_cursors cursors; /* each stream's rank and last id */
    struct relay_batch_streams streams;
    int slots_moved, not_primary;
    int64_t quarantined[RELAY_QUARANTINE_MAX];
    char quarantine_errors[RELAY_QUARANTINE_MAX][OUTBOX_ERROR_MAX];
    size_t nquarantined, quarantine_max;
    size_t nflushed; /* of those, sent with a chunk's read */
    struct relay_held held[RELAY_QUARANTINE_MAX];
    size_t nheld;
    /* outbox.record_batch's lists of streams: appended to, moved along,
     * met but not published (relay/loop_io.c) */
    struct record_arrays touched, advanced, met;
    double refreshed_at; /* when the streams following the lead were last moved */
    int reload;          /* streams taken over need their positions read */
    int verify;          /* Redis reconnected: read what each stream holds */
    int verifying;       /* the load in flight does */
    uint64_t loaded_lead;
    uint64_t checks_gen; /* the load the checks belong to */
    size_t checks_pending, nlost;
    uint64_t batch_serial;         /* counts the batches read, from their first chunk */
    double started_at, phase_mark; /* the batch's start, and its phase's */
    enum relay_batch_phase phase;
    double phase_s[RELAY_PHASES];      /* the batch's time in each phase so far */
    unsigned long long batch_appended; /* rows the batch appended */
    unsigned long long batch_read;     /* rows the batch read */
    double stage_at;                   /* when the loop's statement or chunk in flight was sent */
    struct outbox_buf partitions_text; /* " topic/p" of each partition it touched */
    unsigned long pause_epoch, pause_applied; /* the paused topics changed */
    unsigned long owners_applied;             /* the ownership epoch applied */
    struct outbox_buf sql;
};

/* Whole-batch failures in a row after which the relay is not ready (/readyz
 * red) and gives its share of the work to the other relays: one is a blip
 * that the retry absorbs, three in a row need someone to look. */
#define RELAY_FAILURES_NOT_READY 3

/* Buckets of the batch duration histogram, +Inf not counted. */
#define RELAY_BATCH_BUCKETS 13

/* What /metrics counts. */
struct relay_figures {
    unsigned long long published_total;
    unsigned long long quarantined_total;
    unsigned long long batches_total;
    unsigned long long batch_hist[RELAY_BATCH_BUCKETS + 1]; /* the last is +Inf; cumulated
                                                               when rendered */
    double batch_sum;
    unsigned long long phase_hist[RELAY_PHASES][RELAY_BATCH_BUCKETS + 1];
    double phase_sum[RELAY_PHASES];
    unsigned long long errors[RELAY_FAIL_KINDS];
    unsigned long long row_errors; /* rows that failed for reasons of their own */
    struct {
        char topic[OUTBOX_TOPIC_MAX + 1];
        unsigned long long published;
    } topics[RELAY_OBS_TOPICS_MAX];
    size_t ntopics;
    unsigned long long other_published; /* topics beyond the table */
    char last_batch_error[512];
};

struct relay {
    struct ev_loop *loop;
    struct relay_config *cfg;
    struct relay_config_source reload; /* what a SIGHUP reads again */
    int stopping;                      /* the loop is being left: callbacks do nothing */
    int exit_code; /* what relay_run returns: 0, or why the relay refused to go on */

    struct relay_loop_io batch; /* the batch loop (relay/loop_io.c) */
    struct relay_sink *sink;
    struct outbox_buf out; /* one Redis command, formatted; reused, grows only */
    ev_timer kick;         /* runs a wanted claim from the loop, not from a callback */
    ev_timer retry_timer;  /* backoff after a failed batch */
    ev_timer deadline;     /* publish_timeout of the chunk's calls in flight */
    ev_timer poll_timer;

    struct relay_wake wake;
    struct relay_pgsrc *listen;
    ev_timer settle_timer;
    char *settle_writers; /* text[] of the outbox writers open at the release */
    int holder_check;     /* a check for another holder of the wake-up lock runs */
    long foreign_pid;     /* who else holds the wake-up lock, 0 when nobody */
    char foreign_app[64];
    char foreign_addr[64];

    struct relay_owner *owner; /* the partitions this relay claims from */

    struct relay_observer *observer;
    struct relay_observation *obs; /* the loop's copy of the latest observation */
    struct relay_paused paused;    /* streams held back for their consumer groups */
    char obs_problem[2][640];      /* the last observation error logged, per server */

    struct relay_figures fig;
    struct relay_stream_seen streams_seen; /* for the observer's list of streams */
    struct relay_metrics *metrics;
    ev_timer drain_timer;
    ev_timer watchdog; /* WATCHDOG=1 at half of WatchdogSec, while healthy */
    ev_timer status;   /* STATUS= line for systemctl status */
    char status_text[256];
    ev_signal sigterm, sigint, sighup;
};

/* Monotonic seconds: libev's ev_now() follows the wall clock, which steps. */
static inline double relay_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Upper bounds of the batch duration histogram, in seconds (loop_io.c fills
 * it, render.c shows it). */
extern const double relay_batch_buckets[RELAY_BATCH_BUCKETS];

/* relay/loop_io.c: the claiming connection and Redis, and the batch loop on
 * them. 0, or -1 when out of memory. */
int relay_loop_io_start(struct relay *r) __attribute__((warn_unused_result));
void relay_loop_io_stop(struct relay *r);

/* relay/wake_io.c: the LISTEN connection and the wake-up protocol. */
int relay_wake_io_start(struct relay *r) __attribute__((warn_unused_result));
void relay_wake_io_stop(struct relay *r);
/* Another relay runs: give the wake-up lock up now if it is held. */
void relay_wake_io_share(struct relay *r);

/* relay/render.c */
int relay_healthy(const struct relay *r);
int relay_postgres_up(const struct relay *r);
int relay_is_ready(void *arg, char *why, size_t whylen);
long relay_render_metrics(void *arg, char **out);

#endif
