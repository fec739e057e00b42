/*
 * The owner connection: which partitions of the partitioned topics this
 * relay publishes (docs/DESIGN.md, "Several relays";
 * migrations/012_partition_owners.sql). Any number of relays share one
 * database; PostgreSQL's session advisory locks divide the partitions:
 *
 *   member slot   each relay holds (MEMBER_NS, k) for the lowest free k;
 *                 the members are the slots held, read from pg_locks
 *   partition     the owner holds (UNIT_NS, key) on this connection; its
 *                 share is relay/ownership.c's round-robin over the members
 *
 * Each tick (RELAY_OWNER_TICK_MS, sooner while a partition is in passage)
 * reads the members and the partitioned topics, releases what is no longer
 * this relay's share and tries the locks of what is. A partition is
 * published as soon as its lock is held: ownership only divides the work.
 * Safety does not rest on it: a row's entry id is the same for every relay
 * (docs/DESIGN.md, "Batches from snapshots"), and Redis refuses an XADD at
 * or below a stream's last id, so two relays that both publish a partition
 * for a while (one frozen, or not yet aware it lost it) never append a row
 * twice or out of order.
 *
 * When a relay dies, its sessions end and with them its locks: the others
 * see one member fewer at their next tick and take its partitions. A relay
 * frozen or cut off behind a proxy stops speaking on this connection, and
 * the server ends the session after RELAY_OWNER_IDLE_MS
 * (idle_session_timeout).
 */
#include "common/compat.h"

#include <errno.h>
#include <ev.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/buf.h"
#include "core/config.h"
#include "relay/daemon.h"
#include "relay/log.h"
#include "relay/ownership_io.h"
#include "relay/ownership.h"
#include "relay/pgsrc.h"
#include "relay/sink.h"

#define COMPONENT "owner"

/* More relays than this against one database are refused a slot. */
#define MEMBER_SLOTS 1024
/* The most partitions the relays divide; outbox.set_partitions refuses more
 * (migrations/015_partition_total.sql). */
#define UNITS_MAX 4096
/* The tick while a partition is in passage: wanted but still held by
 * another relay, or held but no longer wanted. */
#define TICK_SOON_MS 200

/* A relay that cannot publish this long (Redis or its batch connection down,
 * or RELAY_FAILURES_NOT_READY batches failed in a row) steps back: it gives up its member slot and
 * its partitions, so that the others divide its share, until it can again. */
#define STEP_BACK_MS 3000

enum owner_step {
    STEP_NONE = 0,
    STEP_MEMBER,  /* taking a member slot */
    STEP_LOOK,    /* reading the members and the partitioned topics */
    STEP_LOCKS,   /* releasing and trying partition locks */
    STEP_RELEASE, /* stepping back: releasing every lock */
    STEP_PING,    /* stepped back: keeping the session alive */
};

struct relay_owner {
    struct relay *r;
    struct relay_owner_hooks hooks;
    struct relay_pgsrc *pg;
    ev_timer tick;
    enum owner_step step;
    int32_t slot; /* -1 until a member slot is held */
    long pid;     /* the owner session's backend */
    struct relay_unit *units, *plan;
    size_t nunits;
    size_t nmembers;
    long me;
    struct outbox_buf sql;
    size_t nready;
    unsigned long epoch; /* moves whenever the ready partitions or the members change */
    unsigned long long takeovers;
    char layout[160];    /* the last "member i of n" logged */
    double unable_since; /* since when the relay cannot publish, 0 when it can */
    int stepped_back;    /* holds no slot until it can publish again */
};

static void schedule(struct relay_owner *o, double ms)
{
    ev_timer_stop(o->r->loop, &o->tick);
    ev_timer_set(&o->tick, ms / 1000.0, 0.0);
    ev_timer_start(o->r->loop, &o->tick);
}

/* The partitions this relay publishes changed: counts them and moves the
 * epoch, and wakes the loop when there are more. */
static void ready_changed(struct relay_owner *o)
{
    size_t n = 0;
    for (size_t i = 0; i < o->nunits; i++)
        n += o->units[i].ready != 0;
    int more = n > o->nready;
    o->nready = n;
    o->epoch++;
    if (more)
        relay_loop_want(&o->r->batch.loop);
}

/* Everything this session held is gone with it. */
static void forget_all(struct relay_owner *o, const char *why)
{
    size_t held = 0;
    for (size_t i = 0; i < o->nunits; i++)
        held += o->units[i].held != 0;
    if (held > 0)
        relay_warn(COMPONENT, "gave up %zu partitions: %s", held, why);
    o->nunits = 0;
    o->slot = -1;
    o->pid = 0;
    o->nmembers = 0;
    o->me = -1;
    o->layout[0] = '\0';
    o->step = STEP_NONE;
    ready_changed(o);
}

static void on_step(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                    void *arg);

static void send_step(struct relay_owner *o, enum owner_step step, const char *sql)
{
    o->step = step;
    if (relay_pgsrc_send(o->pg, sql, 0, NULL, 0, on_step, o) < 0) {
        o->step = STEP_NONE;
        schedule(o, RELAY_OWNER_TICK_MS);
    }
}

static void look(struct relay_owner *o)
{
    if (o->slot < 0) {
        outbox_buf_reset(&o->sql);
        outbox_buf_printf(&o->sql,
                          "SELECT pg_backend_pid(), (SELECT k FROM generate_series(0, %d) AS k"
                          " WHERE pg_try_advisory_lock(" RELAY_OWNER_MEMBER_NS ", k) LIMIT 1)",
                          MEMBER_SLOTS - 1);
        send_step(o, STEP_MEMBER, o->sql.data);
        return;
    }
    /* Kind 0: a member slot; kind 1: a partitioned topic and its count. */
    send_step(o, STEP_LOOK,
              "SELECT 0 AS kind, l.objid::int AS v, NULL::text COLLATE \"C\" AS topic"
              " FROM pg_locks AS l WHERE l.locktype = 'advisory'"
              " AND l.classid = " RELAY_OWNER_MEMBER_NS " AND l.objsubid = 2 AND l.granted"
              " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
              " UNION ALL SELECT 1, t.partitions, t.topic COLLATE \"C\" FROM outbox.topics AS t"
              " WHERE t.partitions > 1 ORDER BY kind, topic, v");
}

/* Whether the relay can publish now; if not, why. */
static int able_to_publish(const struct relay_owner *o, const char **why)
{
    const struct relay *r = o->r;
    if (!relay_pgsrc_up(r->batch.pg))
        *why = "its PostgreSQL batch connection is down";
    else if (!relay_sink_ready(r->sink))
        *why = "Redis is not connected";
    else if (r->batch.loop.failures_in_row >= RELAY_FAILURES_NOT_READY)
        *why = "its batches keep failing";
    else
        return 1;
    return 0;
}

static void on_tick(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay_owner *o = w->data;
    (void)loop;
    (void)revents;
    if (o->r->stopping || o->step != STEP_NONE)
        return;
    if (relay_pgsrc_state(o->pg) != RELAY_PG_READY) {
        schedule(o, RELAY_OWNER_TICK_MS);
        return;
    }
    const char *why = "";
    if (able_to_publish(o, &why)) {
        o->unable_since = 0;
        if (o->stepped_back) {
            o->stepped_back = 0;
            relay_info(COMPONENT, "this relay can publish again: it takes its share again");
        }
        look(o);
        return;
    }
    double now = relay_now();
    if (o->unable_since == 0)
        o->unable_since = now;
    if (!o->stepped_back && (now - o->unable_since) * 1000.0 >= STEP_BACK_MS) {
        o->stepped_back = 1;
        relay_warn(COMPONENT,
                   "this relay cannot publish (%s) for %.0f s: it gives up its member slot and"
                   " its partitions, so that the other relays take its share, until it can",
                   why, now - o->unable_since);
        send_step(o, STEP_RELEASE, "SELECT pg_advisory_unlock_all()");
        return;
    }
    if (o->stepped_back)
        send_step(o, STEP_PING, "SELECT 1");
    else
        look(o);
}

static void log_layout(struct relay_owner *o)
{
    char text[160];
    size_t want = 0;
    for (size_t i = 0; i < o->nunits; i++)
        want += o->units[i].want != 0;
    if (o->me >= 0)
        snprintf(text, sizeof(text),
                 "relay %ld of %zu (member slot %d): its share is %zu of %zu"
                 " partitions",
                 o->me + 1, o->nmembers, (int)o->slot, want, o->nunits);
    else
        snprintf(text, sizeof(text), "member slot %d is not listed yet", (int)o->slot);
    if (strcmp(text, o->layout) != 0) {
        relay_info(COMPONENT, "%s", text);
        snprintf(o->layout, sizeof(o->layout), "%s", text);
    }
}

/* Reads the look's rows into the plan; returns -1 on a malformed answer. */
static int read_look(struct relay_owner *o, PGresult *res)
{
    int rows = PQntuples(res);
    int32_t *members = calloc((size_t)rows + 1, sizeof(*members));
    struct relay_topic_parts *topics = calloc((size_t)rows + 1, sizeof(*topics));
    size_t nm = 0, nt = 0, total = 0;
    int rc = 0;
    if (members == NULL || topics == NULL) {
        rc = -1;
        goto out;
    }
    for (int i = 0; i < rows && PQnfields(res) == 3; i++) {
        long kind = strtol(PQgetvalue(res, i, 0), NULL, 10);
        long v = strtol(PQgetvalue(res, i, 1), NULL, 10);
        if (kind == 0) {
            members[nm++] = (int32_t)v;
        } else if (v > 1 && v <= 1000 && PQgetlength(res, i, 2) <= OUTBOX_TOPIC_MAX &&
                   total + (size_t)v <= UNITS_MAX) {
            memcpy(topics[nt].topic, PQgetvalue(res, i, 2), (size_t)PQgetlength(res, i, 2));
            topics[nt].partitions = (uint32_t)v;
            total += (size_t)v;
            nt++;
        } else if (total + (size_t)v > UNITS_MAX) {
            relay_warn(COMPONENT,
                       "topic %s (%ld partitions) is not divided among relays and its rows stay "
                       "unsent: with it the partitions of all topics would pass %d; lower the "
                       "counts with outbox.set_partitions (which refuses such a count since "
                       "migrations/015_partition_total.sql)",
                       PQgetvalue(res, i, 2), v, UNITS_MAX);
        }
    }
    long me = relay_member_position(members, nm, o->slot);
    long n = relay_units_plan(o->units, o->nunits, topics, nt, nm, me, o->plan, UNITS_MAX);
    if (n < 0) {
        rc = -1;
        goto out;
    }
    int divided_anew = nm != o->nmembers || me != o->me;
    o->nmembers = nm;
    o->me = me;
    struct relay_unit *t = o->units;
    o->units = o->plan;
    o->plan = t;
    o->nunits = (size_t)n;
    if (divided_anew) {
        /* The unpartitioned topics are divided anew: each stream's owner is
         * looked at again (relay_ownership_io_owns_topic), once everything
         * above is in place, since the loop may look at once. */
        o->epoch++;
        relay_loop_want(&o->r->batch.loop);
    }
out:
    free(members);
    free(topics);
    return rc;
}

/* Releases what is no longer this relay's share and tries the locks of
 * what is; a released partition is no longer published from now on. */
static int send_locks(struct relay_owner *o)
{
    size_t n = 0;
    outbox_buf_reset(&o->sql);
    outbox_buf_puts(
        &o->sql, "SELECT v.k, CASE WHEN v.w THEN pg_try_advisory_lock(" RELAY_OWNER_UNIT_NS
                 ", v.k) ELSE pg_advisory_unlock(" RELAY_OWNER_UNIT_NS ", v.k) END FROM (VALUES ");
    int dropped = 0;
    for (size_t i = 0; i < o->nunits; i++) {
        struct relay_unit *u = &o->units[i];
        if (u->held == u->want)
            continue;
        if (u->held && u->ready) {
            u->ready = 0;
            dropped = 1;
        }
        outbox_buf_printf(&o->sql, "%s(%d, %s)", n ? ", " : "", (int)u->key,
                          u->want ? "true" : "false");
        n++;
    }
    if (dropped)
        ready_changed(o);
    if (n == 0)
        return 0;
    outbox_buf_puts(&o->sql, ") AS v(k, w) ORDER BY v.w, v.k");
    send_step(o, STEP_LOCKS, o->sql.data);
    return 1;
}

/* Reads which locks were taken and released: 1 when the partitions this
 * relay publishes changed. */
static int read_locks(struct relay_owner *o, PGresult *res)
{
    double now = relay_now();
    int changed = 0;
    for (int i = 0; i < PQntuples(res); i++) {
        int32_t key = (int32_t)strtol(PQgetvalue(res, i, 0), NULL, 10);
        int ok = PQgetvalue(res, i, 1)[0] == 't';
        /* Every unit with this key changes together: they share a lock. */
        for (size_t j = 0; j < o->nunits; j++) {
            struct relay_unit *u = &o->units[j];
            if (u->key != key || u->held == u->want)
                continue;
            if (u->want && ok) {
                u->held = 1;
                u->ready = 1;
                u->since = now;
                o->takeovers++;
                changed = 1;
                relay_info(COMPONENT, "took %s/%u: relay %ld of %zu", u->topic, u->partition,
                           o->me + 1, o->nmembers);
            } else if (!u->want) {
                changed |= u->ready;
                u->held = 0;
                u->ready = 0;
                u->since = now;
                relay_info(COMPONENT, "released %s/%u to rebalance: relay %ld of %zu", u->topic,
                           u->partition, o->me + 1, o->nmembers);
            }
        }
    }
    return changed;
}

/* The next step after one ended, or the next tick. */
static void advance(struct relay_owner *o, enum owner_step done)
{
    o->step = STEP_NONE;
    if (done == STEP_MEMBER) {
        look(o);
        return;
    }
    if (done == STEP_LOOK && send_locks(o))
        return;
    int passage = 0;
    for (size_t i = 0; i < o->nunits; i++)
        if (o->units[i].want != o->units[i].ready)
            passage = 1;
    schedule(o, passage ? TICK_SOON_MS : RELAY_OWNER_TICK_MS);
}

static void on_step(struct relay_pgsrc *pg, PGresult *res, const char *err, const char *sqlstate,
                    void *arg)
{
    struct relay_owner *o = arg;
    enum owner_step step = o->step;
    (void)pg;
    if (o->r->stopping)
        return;
    if (err != NULL) {
        o->step = STEP_NONE;
        if (sqlstate != NULL && strcmp(sqlstate, "08006") == 0)
            return; /* on_down has forgotten everything */
        /* Which locks the statement took before it failed is unknown: start
         * again from a new session, which holds none. */
        relay_warn(COMPONENT, "%s; reconnecting the owner connection", err);
        relay_pgsrc_reset(o->pg, "an ownership step failed");
        return;
    }
    if (step == STEP_RELEASE || step == STEP_PING) {
        if (step == STEP_RELEASE)
            forget_all(o, "this relay cannot publish"); /* the locks are released */
        o->step = STEP_NONE;
        schedule(o, RELAY_OWNER_TICK_MS);
        return;
    }
    if (step == STEP_MEMBER) {
        if (res == NULL || PQntuples(res) != 1 || PQgetisnull(res, 0, 1)) {
            o->step = STEP_NONE;
            relay_error(COMPONENT,
                        "no member slot is free: %d relays or more run against this database;"
                        " stop some of them",
                        MEMBER_SLOTS);
            schedule(o, RELAY_OWNER_TICK_MS * 5.0);
            return;
        }
        o->pid = strtol(PQgetvalue(res, 0, 0), NULL, 10);
        o->slot = (int32_t)strtol(PQgetvalue(res, 0, 1), NULL, 10);
    } else if (step == STEP_LOOK) {
        if (res == NULL || read_look(o, res) < 0) {
            o->step = STEP_NONE;
            relay_warn(COMPONENT, "cannot divide the partitions (out of memory); retrying");
            schedule(o, RELAY_OWNER_TICK_MS);
            return;
        }
        log_layout(o);
        if (o->nmembers > 1 && o->hooks.shared != NULL)
            o->hooks.shared(o->hooks.arg);
    } else if (step == STEP_LOCKS && res != NULL) {
        if (read_locks(o, res))
            ready_changed(o);
    }
    advance(o, step);
}

static void owner_ready(struct relay_pgsrc *pg, void *arg)
{
    struct relay_owner *o = arg;
    (void)pg;
    if (o->step == STEP_NONE)
        schedule(o, 0.0);
}

static void owner_down(struct relay_pgsrc *pg, void *arg)
{
    struct relay_owner *o = arg;
    (void)pg;
    forget_all(o, "the owner connection to PostgreSQL was lost; another relay may take them");
}

struct relay_owner *relay_ownership_io_start(struct relay *r, const struct relay_owner_hooks *hooks)
{
    struct relay_owner *o = calloc(1, sizeof(*o));
    if (o == NULL)
        return NULL;
    o->epoch = 1; /* a cursor never evaluated has epoch 0 */
    o->r = r;
    if (hooks != NULL)
        o->hooks = *hooks;
    o->slot = -1;
    o->me = -1;
    o->units = calloc(UNITS_MAX, sizeof(*o->units));
    o->plan = calloc(UNITS_MAX, sizeof(*o->plan));
    if (o->units == NULL || o->plan == NULL) {
        relay_ownership_io_stop(o);
        return NULL;
    }
    ev_init(&o->tick, on_tick);
    o->tick.data = o;
    ready_changed(o);
    struct relay_pgsrc_hooks pg_hooks = {.arg = o, .on_ready = owner_ready, .on_down = owner_down};
    o->pg = relay_pgsrc_new(r->loop, r->cfg, RELAY_PGSRC_OWNER, &pg_hooks);
    if (o->pg == NULL) {
        relay_ownership_io_stop(o);
        return NULL;
    }
    return o;
}

void relay_ownership_io_stop(struct relay_owner *o)
{
    if (o == NULL)
        return;
    ev_timer_stop(o->r->loop, &o->tick);
    relay_pgsrc_free(o->pg);
    free(o->units);
    free(o->plan);
    outbox_buf_free(&o->sql);
    free(o);
}

void relay_ownership_io_figures(const struct relay_owner *o, struct relay_owner_figures *f)
{
    memset(f, 0, sizeof(*f));
    if (o == NULL)
        return;
    f->members = o->nmembers;
    f->owned = o->nready;
    f->takeovers = o->takeovers;
    f->partitions = o->nunits;
}

int relay_ownership_io_owns_topic(const struct relay_owner *o, const char *topic)
{
    if (o == NULL)
        return 1;
    return relay_topic_wanted(topic, strlen(topic), o->nmembers, o->me);
}

unsigned long relay_ownership_io_epoch(const struct relay_owner *o)
{
    return o != NULL ? o->epoch : 1;
}

int relay_ownership_io_owns(const struct relay_owner *o, const char *topic, uint32_t partition)
{
    if (o == NULL)
        return 1;
    for (size_t i = 0; i < o->nunits; i++)
        if (o->units[i].ready && o->units[i].partition == partition &&
            strcmp(o->units[i].topic, topic) == 0)
            return 1;
    return 0;
}
