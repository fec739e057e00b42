/*
 * The daemon: builds its parts on one libev loop and handles what is about
 * the whole process, signals, drain, reload and the systemd watchdog. The
 * batch loop runs in relay/loop_io.c, the wake-up protocol in relay/wake_io.c,
 * the observation thread in relay/observe_io.c and the metrics text in
 * relay/render.c; the decisions they act on are the pure machines of
 * relay/loop.c and relay/wake.c (docs/DESIGN.md, "Modules").
 */
#include "common/compat.h"

#include "relay/relay.h"

#include <ev.h>
#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/common.h"
#include "core/config.h"
#include "relay/daemon.h"
#include "relay/log.h"
#include "relay/metrics.h"
#include "relay/observe_io.h"
#include "relay/ownership_io.h"
#include "relay/pgsrc.h"
#include "relay/sdnotify.h"
#include "relay/sink.h"

#define COMPONENT "relay"

extern char **environ;

/* ---- observation and backpressure -------------------------------------- */

/* Logs what an observation could not read, once per change: without it,
 * queue age, producer admission and backpressure stand still. */
static void log_observation_problem(struct relay *r, int which, int ok, const char *error)
{
    static const char *const servers[2] = {"PostgreSQL", "Redis"};
    const char *now = ok ? "" : error;
    if (strcmp(now, r->obs_problem[which]) == 0)
        return;
    if (ok)
        relay_info("observe", "reading %s again", servers[which]);
    else
        relay_warn("observe",
                   "cannot read %s (%s): queue age, %s wait for it; the relay "
                   "itself goes on",
                   servers[which], error,
                   which == 0 ? "producer admission and the outbox gauges"
                              : "consumer-group lag and stream backpressure");
    snprintf(r->obs_problem[which], sizeof(r->obs_problem[which]), "%s", now);
}

/* A fresh observation: keep it for /metrics and apply stream backpressure. */
static void on_observation(void *arg, const struct relay_observation *o)
{
    struct relay *r = arg;
    struct relay_bp_change changes[RELAY_OBS_TOPICS_MAX];
    int resumed = 0;
    memcpy(r->obs, o, sizeof(*r->obs));
    log_observation_problem(r, 0, o->pg_ok, o->pg_error[0] ? o->pg_error : "unknown error");
    log_observation_problem(r, 1, o->redis_ok,
                            o->redis_error[0] ? o->redis_error : "unknown error");
    size_t n = relay_backpressure_apply(&r->paused, r->cfg, r->obs, changes, &resumed);
    if (n > 0 || resumed)
        r->batch.pause_epoch++; /* applied between batches (relay/loop_io.c) */
    for (size_t i = 0; i < n; i++)
        relay_log(changes[i].paused ? RELAY_LOG_WARNING : RELAY_LOG_INFO, COMPONENT,
                  "stream %s %s (backpressure: consumer groups %s)",
                  r->obs->topics[changes[i].topic].stream, changes[i].paused ? "paused" : "resumed",
                  changes[i].paused ? "lag beyond the high-water mark; its rows wait in the outbox"
                                    : "caught up below the low-water mark");
    /* The rows of a resumed stream wait in the outbox and nothing will
     * notify for them: claim now rather than at the next poll. */
    if (resumed)
        relay_loop_want(&r->batch.loop);
}

static void on_poll(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    relay_loop_want(&r->batch.loop);
    relay_wake_poll(&r->wake);
}

/* ---- supervision ------------------------------------------------------- */

/* The loop is healthy when it runs (this timer fires) and no cycle is stuck
 * beyond every deadline that should have ended it. */
static void on_watchdog(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    if (relay_healthy(r))
        relay_sd_notify("WATCHDOG=1");
    else
        relay_warn(COMPONENT, "a claim cycle is stuck past every deadline; not feeding the "
                              "systemd watchdog");
}

static void on_status(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    char text[256];
    (void)loop;
    (void)revents;
    snprintf(text, sizeof(text),
             "STATUS=%llu published, %llu quarantined; PostgreSQL %s, Redis %s%s",
             r->fig.published_total, r->fig.quarantined_total, relay_postgres_up(r) ? "up" : "down",
             relay_sink_ready(r->sink) ? "up" : "down",
             r->batch.loop.state == RELAY_LOOP_BACKOFF ? "; retrying a batch" : "");
    if (strcmp(text, r->status_text) == 0)
        return;
    snprintf(r->status_text, sizeof(r->status_text), "%s", text);
    relay_sd_notify(text);
}

/* Starts the watchdog timer when systemd asked for one (sd_watchdog_enabled). */
static void start_watchdog(struct relay *r)
{
    const char *usec = getenv("WATCHDOG_USEC");
    const char *pid = getenv("WATCHDOG_PID");
    if (usec == NULL || usec[0] == '\0')
        return;
    if (pid != NULL && pid[0] != '\0' && strtol(pid, NULL, 10) != (long)getpid())
        return;
    char *end;
    unsigned long long us = strtoull(usec, &end, 10);
    if (*end != '\0' || us == 0)
        return;
    double every = us / 2e6;
    ev_timer_init(&r->watchdog, on_watchdog, every, every);
    r->watchdog.data = r;
    ev_timer_start(r->loop, &r->watchdog);
    relay_info(COMPONENT, "systemd watchdog: feeding it every %.3f s while healthy", every);
}

/* ---- drain and signals ------------------------------------------------- */

/* Draining is over once no batch is in flight: the loop says so. */
static void on_drain_deadline(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)revents;
    (void)w;
    relay_warn(COMPONENT, "drain_timeout reached with a batch in flight; exiting (the batch is "
                          "rolled back and will be published by the next run)");
    ev_break(loop, EVBREAK_ALL);
}

static void on_term(struct ev_loop *loop, ev_signal *w, int revents)
{
    struct relay *r = w->data;
    (void)revents;
    if (r->batch.loop.draining) {
        relay_warn(COMPONENT, "second signal: exiting now (the batch in flight is rolled back)");
        ev_break(loop, EVBREAK_ALL);
        return;
    }
    relay_sd_notify("STOPPING=1");
    ev_timer_stop(loop, &r->poll_timer);
    ev_timer_stop(loop, &r->retry_timer);
    r->wake.draining = 1;
    relay_info(COMPONENT, "signal %d: finishing what is in flight (at most %u ms)", w->signum,
               r->cfg->drain_timeout_ms);
    ev_timer_set(&r->drain_timer, r->cfg->drain_timeout_ms / 1000.0, 0.0);
    ev_timer_start(loop, &r->drain_timer);
    relay_loop_drain(&r->batch.loop); /* leaves at once when nothing is in flight */
}

static void on_hup(struct ev_loop *loop, ev_signal *w, int revents)
{
    struct relay *r = w->data;
    struct relay_config fresh;
    struct relay_config_errors errs; /* every mistake of the new file, logged */
    (void)loop;
    (void)revents;

    /* RELOADING=1 must carry the monotonic time of the reload (systemd 253+). */
    struct timespec now;
    char reloading[64];
    clock_gettime(CLOCK_MONOTONIC, &now);
    snprintf(reloading, sizeof(reloading), "RELOADING=1\nMONOTONIC_USEC=%llu",
             (unsigned long long)now.tv_sec * 1000000ull + (unsigned long long)now.tv_nsec / 1000);
    relay_sd_notify(reloading);
    relay_config_init(&fresh);
    if (relay_config_load_all(&fresh, r->reload.config_path, environ, r->reload.argc,
                              r->reload.argv, &errs) < 0) {
        unsigned shown =
            errs.count < RELAY_CONFIG_ERRORS_MAX ? errs.count : RELAY_CONFIG_ERRORS_MAX;
        for (unsigned i = 0; i < shown; i++)
            relay_error("config", "reload failed, keeping the running configuration: %s",
                        errs.msg[i]);
        if (errs.count > shown)
            relay_error("config",
                        "reload failed, keeping the running configuration: and %u "
                        "more errors",
                        errs.count - shown);
    } else {
        char changed[512];
        r->cfg->log_level = fresh.log_level;
        relay_log_set_level((enum relay_log_level)fresh.log_level);
        if (relay_config_diff_restart(r->cfg, &fresh, changed, sizeof(changed)) > 0)
            relay_warn("config", "reloaded log_level; changed keys that need a restart: %s",
                       changed);
        else
            relay_info("config", "reloaded: log_level applied");
    }
    relay_config_free(&fresh);
    relay_sd_notify("READY=1");
}

/* ---- life cycle -------------------------------------------------------- */

/* A PostgreSQL connection does not keep its server session (a pooler in
 * transaction mode): nothing the relay does would be safe, so it stops with
 * the exit code of a bad configuration. */
static void on_no_session(void *arg, const char *why)
{
    struct relay *r = arg;
    if (r->exit_code != 0)
        return;
    relay_error(COMPONENT, "%s", why);
    r->exit_code = OUTBOX_EX_CONFIG;
    r->stopping = 1;
    ev_break(r->loop, EVBREAK_ALL);
}

static void start_signals(struct relay *r)
{
    ev_signal_init(&r->sigterm, on_term, SIGTERM);
    r->sigterm.data = r;
    ev_signal_init(&r->sigint, on_term, SIGINT);
    r->sigint.data = r;
    ev_signal_init(&r->sighup, on_hup, SIGHUP);
    r->sighup.data = r;
    ev_signal_start(r->loop, &r->sigterm);
    ev_signal_start(r->loop, &r->sigint);
    ev_signal_start(r->loop, &r->sighup);
}

static void on_shared(void *arg)
{
    relay_wake_io_share(arg);
}

/* A chunk's buffers (its rows from libpq, the Redis calls hiredis gathers)
 * run to a few hundred KB and are freed at every chunk. Past glibc's mmap
 * threshold each was mapped, faulted in page by page and unmapped again: a
 * quarter of the relay's CPU in a drain. Below these bounds they come from the
 * heap and stay mapped between chunks (at most TRIM_BYTES kept free). */
#define MMAP_THRESHOLD_BYTES (4 << 20)
#define TRIM_BYTES (16 << 20)

static void tune_malloc(void)
{
#if defined(__GLIBC__)
    (void)mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
    (void)mallopt(M_TRIM_THRESHOLD, TRIM_BYTES);
#endif
}

struct relay *relay_new(struct ev_loop *loop, struct relay_config *cfg,
                        const struct relay_config_source *reload)
{
    tune_malloc();
    struct relay *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return NULL;
    r->loop = loop;
    r->cfg = cfg;
    if (reload != NULL)
        r->reload = *reload;
    relay_paused_init(&r->paused);
    relay_stream_seen_init(&r->streams_seen);
    r->obs = calloc(1, sizeof(*r->obs));
    ev_init(&r->drain_timer, on_drain_deadline);
    r->drain_timer.data = r;
    double poll = cfg->poll_interval_ms / 1000.0;
    ev_timer_init(&r->poll_timer, on_poll, poll, poll);
    r->poll_timer.data = r;
    ev_timer_start(loop, &r->poll_timer);
    start_signals(r);
    relay_pgsrc_on_no_session(on_no_session, r);
    /* The wake-up machine first: the lanes ask it whether they claim alone. */
    if (r->obs == NULL || relay_wake_io_start(r) < 0 || relay_loop_io_start(r) < 0) {
        relay_free(r);
        return NULL;
    }
    /* Another relay joined: producers must notify again. */
    struct relay_owner_hooks owner_hooks = {.arg = r, .shared = on_shared};
    r->owner = relay_ownership_io_start(r, &owner_hooks);
    if (r->owner == NULL) {
        relay_free(r);
        return NULL;
    }
    r->observer = relay_observe_io_start(loop, cfg, &r->streams_seen, on_observation, r);
    if (r->observer == NULL)
        relay_warn(COMPONENT, "cannot start the observation thread: no queue age, lag or "
                              "backpressure");
    if (cfg->metrics_listen != NULL && cfg->metrics_listen[0] != '\0') {
        char err[300];
        struct relay_metrics_hooks mh = {r, relay_render_metrics, relay_is_ready};
        r->metrics = relay_metrics_new(loop, cfg->metrics_listen, &mh, err, sizeof(err));
        if (r->metrics == NULL)
            relay_warn("metrics", "%s", err);
    }
    return r;
}

/* What retention keeps, and a warning for a choice the operator forced. */
static void log_retention(const struct relay_config *cfg)
{
    relay_info("retention", "sent rows: %s; streams: %s",
               cfg->sent_retention_ms == 0 ? "deleted as they are published"
                                           : "deleted once sent_retention has passed",
               cfg->stream_retention_ms == 0 ? "never trimmed (stream_retention = 0)"
                                             : "trimmed past stream_retention once acknowledged");
    if (relay_config_short_stream_retention(cfg))
        relay_warn("retention",
                   "stream_retention (%u ms) is shorter than dedup_ttl (%u ms), as "
                   "allow_short_stream_retention allows: a message published again within "
                   "dedup_ttl may be answered with an entry that was already trimmed",
                   cfg->stream_retention_ms, cfg->dedup_ttl_ms);
}

int relay_run(struct relay *r)
{
    unsigned backend = ev_backend(r->loop);
    int pqv = PQlibVersion();
    relay_info(COMPONENT,
               "outbox-relay %s running (libpq %d.%d, hiredis %d.%d.%d, libev %d.%d %s): "
               "batch_size=%u poll_interval=%u ms listen=%s",
               RELAY_VERSION, pqv / 10000, pqv % 10000, HIREDIS_MAJOR, HIREDIS_MINOR, HIREDIS_PATCH,
               ev_version_major(), ev_version_minor(),
               backend == EVBACKEND_EPOLL    ? "epoll"
               : backend == EVBACKEND_POLL   ? "poll"
               : backend == EVBACKEND_SELECT ? "select"
                                             : "other",
               r->cfg->batch_size, r->cfg->poll_interval_ms, r->cfg->listen ? "on" : "off");
    log_retention(r->cfg);
    start_watchdog(r);
    ev_timer_init(&r->status, on_status, 0.0, 2.0);
    r->status.data = r;
    ev_timer_start(r->loop, &r->status);
    relay_sd_notify("READY=1");
    ev_run(r->loop, 0);
    r->stopping = 1;
    if (r->exit_code != 0) {
        relay_error(COMPONENT, "exiting with code %d: the configuration must change first",
                    r->exit_code);
        return r->exit_code;
    }
    relay_info(COMPONENT, "stopped: %llu messages published, %llu rows quarantined",
               r->fig.published_total, r->fig.quarantined_total);
    return 0;
}

void relay_free(struct relay *r)
{
    if (r == NULL)
        return;
    r->stopping = 1;
    ev_timer_stop(r->loop, &r->poll_timer);
    ev_timer_stop(r->loop, &r->drain_timer);
    ev_timer_stop(r->loop, &r->watchdog);
    ev_timer_stop(r->loop, &r->status);
    ev_signal_stop(r->loop, &r->sigterm);
    ev_signal_stop(r->loop, &r->sigint);
    ev_signal_stop(r->loop, &r->sighup);
    relay_observe_io_stop(r->observer);
    relay_metrics_free(r->metrics);
    relay_loop_io_stop(r);
    relay_ownership_io_stop(r->owner);
    relay_wake_io_stop(r);
    relay_pgsrc_on_no_session(NULL, NULL);
    relay_stream_seen_free(&r->streams_seen);
    free(r->obs);
    free(r);
}
