/*
 * The wake-up protocol on the LISTEN connection: the ops of relay/wake.c's
 * machine and the callbacks that turn their answers into its events
 * (docs/DESIGN.md, "The wake-up protocol"; migrations/007_wakeup_lock.sql).
 *
 * A busy relay holds advisory lock WAKEUP_LOCK on this connection, so
 * producers skip their notifications. Going idle, it releases the lock and,
 * in the same round trip, lists the transactions that hold a RowExclusiveLock
 * on outbox.messages: only those can have skipped their notification (a
 * producer's insert takes that lock before its trigger checks the advisory
 * lock, and keeps it until it ends). It waits for them alone, claiming
 * meanwhile, then claims once more.
 */
#include "common/compat.h"

#include <ev.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"
#include "relay/daemon.h"
#include "relay/log.h"
#include "relay/ownership_io.h"
#include "relay/pgsrc.h"
#include "core/text.h"

#define COMPONENT "relay"

/* The advisory lock key of migrations/007: "outbox" in ASCII. */
#define WAKEUP_LOCK "122550254464888"
/* How long a busy relay waits for notifying producers to commit before it
 * gives up taking the lock for this batch. */
#define WAKEUP_LOCK_TIMEOUT_MS "250"

/* The writers of outbox.messages in this database, other than this session. */
#define OUTBOX_WRITERS                                                                             \
    " FROM pg_locks WHERE locktype = 'relation' AND mode = 'RowExclusiveLock'"                     \
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"             \
    " AND relation = 'outbox.messages'::regclass AND pid <> pg_backend_pid()"

static int listen_ready(const struct relay *r)
{
    return r->listen != NULL && relay_pgsrc_state(r->listen) == RELAY_PG_READY;
}

/* The settle is over: forget the writers it waited for. */
static void after_event(struct relay *r)
{
    if (!r->wake.settling && r->settle_writers != NULL) {
        free(r->settle_writers);
        r->settle_writers = NULL;
    }
}

static double op_now(void *arg)
{
    (void)arg;
    return relay_now();
}

static void on_lock_taken(struct relay_pgsrc *pg, PGresult *res, const char *err,
                          const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    (void)res;
    (void)sqlstate;
    if (r->stopping)
        return;
    if (err != NULL)
        relay_debug(COMPONENT, "wake-up lock not taken (%s); retrying after the next batch", err);
    else
        relay_debug(COMPONENT, "busy: holding the wake-up lock; producers stop notifying");
    relay_wake_lock_taken(&r->wake, err == NULL);
}

/* Runs on the LISTEN connection, which has nothing else to do while busy.
 * With several relays against the database none takes the lock: a busy
 * relay cannot tell whether the others are busy too, and an idle one must
 * hear of the rows of its partitions at once, so producers always notify
 * (docs/DESIGN.md, "Several relays"). A relay that held the lock when
 * another joined releases it the next time it is idle. */
static int op_take_lock(void *arg)
{
    struct relay *r = arg;
    struct relay_owner_figures owners;
    relay_ownership_io_figures(r->owner, &owners);
    if (!listen_ready(r) || owners.members > 1)
        return -1;
    return relay_pgsrc_send(r->listen,
                            "SET lock_timeout = " WAKEUP_LOCK_TIMEOUT_MS ";"
                            " SELECT pg_advisory_lock(" WAKEUP_LOCK ")",
                            0, NULL, 0, on_lock_taken, r);
}

static void on_lock_given_up(struct relay_pgsrc *pg, PGresult *res, const char *err,
                             const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    (void)res;
    (void)sqlstate;
    if (r->stopping || err != NULL)
        return;
    relay_debug(COMPONENT, "another relay runs: wake-up lock released; producers notify again");
    relay_wake_released(&r->wake);
}

void relay_wake_io_share(struct relay *r)
{
    if (r->wake.lock != RELAY_LOCK_HELD || r->wake.settling || !listen_ready(r))
        return;
    if (relay_pgsrc_send(r->listen, "SELECT pg_advisory_unlock_all()", 0, NULL, 0, on_lock_given_up,
                         r) < 0)
        relay_debug(COMPONENT, "cannot release the wake-up lock now; it goes when idle");
}

static void on_idle_declared(struct relay_pgsrc *pg, PGresult *res, const char *err,
                             const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    (void)sqlstate;
    if (r->stopping)
        return;
    if (err != NULL || res == NULL || PQntuples(res) != 1 || PQnfields(res) != 2) {
        if (err != NULL)
            relay_warn(COMPONENT, "cannot declare the relay idle (%s); the poll keeps it going",
                       err);
        relay_wake_declared(&r->wake, 0, 0);
        return;
    }
    long writers = strtol(PQgetvalue(res, 0, 0), NULL, 10);
    free(r->settle_writers);
    r->settle_writers = writers > 0 ? strdup(PQgetvalue(res, 0, 1)) : NULL;
    relay_wake_declared(&r->wake, 1, r->settle_writers != NULL ? writers : 0);
    after_event(r);
}

/* Releases the lock, so producers notify again, and lists the writers that
 * may have skipped their notification. */
static int op_declare_idle(void *arg)
{
    struct relay *r = arg;
    if (!listen_ready(r))
        return -1;
    return relay_pgsrc_send(
        r->listen,
        "SELECT pg_advisory_unlock_all();"
        " SELECT count(*), coalesce(array_agg(virtualtransaction), '{}')::text" OUTBOX_WRITERS,
        0, NULL, 0, on_idle_declared, r);
}

static void on_settle_checked(struct relay_pgsrc *pg, PGresult *res, const char *err,
                              const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    (void)sqlstate;
    if (r->stopping)
        return;
    long running = err == NULL && res != NULL && PQntuples(res) == 1
                       ? strtol(PQgetvalue(res, 0, 0), NULL, 10)
                       : -1;
    double started = r->wake.settle_started;
    relay_wake_settle_checked(&r->wake, running);
    if (!r->wake.settling)
        relay_debug(COMPONENT,
                    "idle: waited %.1f ms for outbox writers that may not have "
                    "notified; claiming once more",
                    (relay_now() - started) * 1000.0);
    after_event(r);
}

static int op_settle_check(void *arg)
{
    struct relay *r = arg;
    if (!listen_ready(r) || r->settle_writers == NULL)
        return -1;
    const char *params[1] = {r->settle_writers};
    return relay_pgsrc_send(
        r->listen, "SELECT count(*)" OUTBOX_WRITERS " AND virtualtransaction = ANY ($1::text[])", 1,
        params, 0, on_settle_checked, r);
}

static void op_arm_settle(void *arg, double delay)
{
    struct relay *r = arg;
    ev_timer_stop(r->loop, &r->settle_timer);
    ev_timer_set(&r->settle_timer, delay, 0.0);
    ev_timer_start(r->loop, &r->settle_timer);
}

static void op_want_claim(void *arg, double delay)
{
    struct relay *r = arg;
    if (delay <= 0.0) {
        relay_loop_want(&r->batch.loop);
        return;
    }
    /* Producers already skip their notifications: look again shortly. */
    if (!ev_is_active(&r->kick)) {
        ev_timer_set(&r->kick, delay, 0.0);
        ev_timer_start(r->loop, &r->kick);
    }
}

/* Who else holds the wake-up lock: while someone does, producers skip their
 * notifications and an idle relay hears of new rows only at its poll. A
 * busy relay elsewhere is expected; a stray session is not (a relay host
 * that vanished keeps its session until TCP gives up on it, or anyone with
 * access to pg_advisory_lock). Logged once per holder and exported. */
static void on_lock_holder(struct relay_pgsrc *pg, PGresult *res, const char *err,
                           const char *sqlstate, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    (void)sqlstate;
    r->holder_check = 0;
    if (r->stopping || err != NULL || res == NULL)
        return;
    long pid = PQntuples(res) == 1 ? strtol(PQgetvalue(res, 0, 0), NULL, 10) : 0;
    if (pid != 0 && pid != r->foreign_pid) {
        snprintf(r->foreign_app, sizeof(r->foreign_app), "%s", PQgetvalue(res, 0, 1));
        snprintf(r->foreign_addr, sizeof(r->foreign_addr), "%s", PQgetvalue(res, 0, 2));
        char app[RELAY_ESCAPED_SIZE(sizeof(r->foreign_app))];
        relay_text_escape(app, sizeof(app), r->foreign_app, strlen(r->foreign_app), 0, 0);
        relay_warn(COMPONENT,
                   "producers skip their notifications: the wake-up lock " WAKEUP_LOCK
                   " is held by pid %ld (application_name \"%s\", client %s); if that is "
                   "not a busy outbox-relay, end it with SELECT pg_terminate_backend(%ld); "
                   "meanwhile new rows wait for the poll (%u ms)",
                   pid, app, r->foreign_addr, pid, r->cfg->poll_interval_ms);
    } else if (pid == 0 && r->foreign_pid != 0) {
        relay_info(COMPONENT,
                   "the wake-up lock is no longer held by pid %ld; producers notify again",
                   r->foreign_pid);
    }
    r->foreign_pid = pid;
}

static void op_check_holder(void *arg)
{
    struct relay *r = arg;
    if (r->holder_check || !listen_ready(r))
        return;
    /* pg_advisory_lock(bigint) keeps the key's high half in classid and its
     * low half in objid, with objsubid 1. client_addr is NULL unless the
     * relay's role may read other sessions' details (pg_read_all_stats). */
    if (relay_pgsrc_send(r->listen,
                         "SELECT l.pid, coalesce(a.application_name, ''),"
                         " coalesce(host(a.client_addr), CASE WHEN a.pid IS NULL THEN 'unknown'"
                         " WHEN a.client_port = -1 THEN 'local socket'"
                         " ELSE 'not visible (grant pg_read_all_stats)' END)"
                         " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
                         " WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock'"
                         " AND l.database = (SELECT oid FROM pg_database"
                         "  WHERE datname = current_database())"
                         " AND l.classid = (" WAKEUP_LOCK "::bigint >> 32)::oid"
                         " AND l.objid = (" WAKEUP_LOCK "::bigint & 4294967295)::oid"
                         " AND l.objsubid = 1 AND l.pid <> pg_backend_pid()"
                         " ORDER BY l.pid LIMIT 1",
                         0, NULL, 0, on_lock_holder, r) == 0)
        r->holder_check = 1;
}

static void on_settle_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay *r = w->data;
    (void)loop;
    (void)revents;
    if (r->stopping)
        return;
    relay_wake_settle_due(&r->wake);
    after_event(r);
}

/* The LISTEN connection is up: notifications sent while it was away are
 * lost, so catch up. */
static void listen_ready_hook(struct relay_pgsrc *pg, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    relay_loop_want(&r->batch.loop);
}

/* The LISTEN connection broke: the server released the wake-up lock with it,
 * and any settle wait or holder check on it is void. */
static void listen_down(struct relay_pgsrc *pg, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    relay_wake_listen_down(&r->wake);
    r->holder_check = 0;
}

static void on_notify(struct relay_pgsrc *pg, void *arg)
{
    struct relay *r = arg;
    (void)pg;
    relay_loop_want(&r->batch.loop);
}

int relay_wake_io_start(struct relay *r)
{
    const struct relay_wake_ops ops = {
        .arg = r,
        .now = op_now,
        .take_lock = op_take_lock,
        .declare_idle = op_declare_idle,
        .settle_check = op_settle_check,
        .arm_settle = op_arm_settle,
        .want_claim = op_want_claim,
        .check_holder = op_check_holder,
    };
    relay_wake_init(&r->wake, &ops, r->cfg->listen, r->cfg->poll_interval_ms / 1000.0);
    ev_init(&r->settle_timer, on_settle_timer);
    r->settle_timer.data = r;
    if (!r->cfg->listen)
        return 0;
    struct relay_pgsrc_hooks hooks = {
        .arg = r, .on_ready = listen_ready_hook, .on_down = listen_down, .on_notify = on_notify};
    r->listen = relay_pgsrc_new(r->loop, r->cfg, RELAY_PGSRC_LISTEN, &hooks);
    return r->listen != NULL ? 0 : -1;
}

void relay_wake_io_stop(struct relay *r)
{
    if (r->loop != NULL)
        ev_timer_stop(r->loop, &r->settle_timer);
    relay_pgsrc_free(r->listen);
    r->listen = NULL;
    free(r->settle_writers);
    r->settle_writers = NULL;
}
