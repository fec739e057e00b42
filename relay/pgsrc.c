/*
 * One non-blocking libpq connection on the libev loop.
 *
 * Connecting follows libpq's PQconnectPoll protocol; the socket may change
 * between polls (multi-host conninfo, SSL fallback), so the watcher is set
 * again on every step. libpq ignores connect_timeout in this mode, so a timer
 * of our own bounds the attempt. Once connected, the session is set up (server
 * timeouts, LISTEN or the prepared batch statement, the schema check) and the
 * connection becomes READY. Commands run one at a time; their results are read
 * only while PQisBusy() is false so the loop never blocks, and notifications
 * are drained after every pass because libpq may have buffered them while
 * reading a result. Any failure closes the connection and schedules a
 * reconnect with jittered backoff; the caller hears of it through its hooks.
 */
#include "common/compat.h"

#include "relay/pgsrc.h"
#include "core/pg.h"

#include <ev.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/config.h"
#include "common/resolve.h"
#include "relay/log.h"
#include "relay/lookup.h"

#define COMPONENT "pg"
#define NOTIFY_CHANNEL "outbox_relay"

/* The topics with more than one partition, computed once per statement (an
 * InitPlan): rows of other topics cost no lookup. */
#define PARTITIONED_TOPICS "ARRAY(SELECT t.topic FROM outbox.topics AS t WHERE t.partitions > 1)"

/* The batch's select list, in binary: headers come as two sorted text
 * arrays; message_id and created_at as their 16 and 8 bytes, which the relay
 * writes as text (relay_batch_format_uuid and relay_batch_format_timestamp:
 * uuid_out's form and RFC 3339 UTC) at a fraction of what uuid_out and
 * to_char cost PostgreSQL. A payload over max_payload_bytes (the %u) stays in the
 * database: the column is NULL and the last one carries its size, which
 * PostgreSQL knows without reading the value (octet_length of a stored bytea
 * reads only its header), so a row of any size costs the relay a few bytes
 * and fails with a message that names its size. */
#define CLAIM_SELECT                                                                               \
    "SELECT id, message_id, topic, partition_key,"                                                 \
    " CASE WHEN octet_length(payload) <= %u THEN payload END,"                                     \
    " created_at,"                                                                                 \
    " jsonb_typeof(headers),"                                                                      \
    " CASE WHEN jsonb_typeof(headers) = 'object' THEN"                                             \
    "  ARRAY(SELECT k FROM jsonb_object_keys(headers) AS k ORDER BY k) END,"                       \
    " CASE WHEN jsonb_typeof(headers) = 'object' THEN"                                             \
    "  ARRAY(SELECT CASE WHEN jsonb_typeof(headers -> k) = 'string' THEN headers ->> k"            \
    "   ELSE (headers -> k)::text END FROM jsonb_object_keys(headers) AS k ORDER BY k) END,"       \
    " octet_length(payload),"                                                                      \
    " CASE WHEN c.topic = ANY(" PARTITIONED_TOPICS ") THEN"                                        \
    "  (SELECT t.partitions FROM outbox.topics AS t WHERE t.topic = c.topic) ELSE 1 END"

/* A chunk of a batch (docs/DESIGN.md, "Batches from snapshots"): the select
 * list's columns and the writing transaction, from outbox.batch_rows: $1 and $2 the
 * ticks, $3 the id of the chunk before's last row (the batch's lowest id less
 * one for the first), $4 the batch's highest id (outbox.batch_bounds), $5
 * the chunk's size: rows in id order. Past the select list's columns: the txid,
 * the tick's ms, for a keyed row of a partitioned topic the first
 * quarantined row of its key before it, which holds it back (P8; one probe
 * of quarantine_key_idx), and whether the row is quarantined already (its
 * batch read again). $6 and $7 are rows the chunks before quarantined, and
 * why: copied into the quarantine first (a one-time filter), so that a batch
 * of many bad rows records them as it goes. */
#define BATCH_FROM                                                                                 \
    ", txid, (SELECT t.ms FROM outbox.ticks AS t WHERE t.tick_id = $2::bigint),"                   \
    " CASE WHEN c.partition_key IS NOT NULL AND c.topic = ANY(" PARTITIONED_TOPICS ") THEN"        \
    "  (SELECT min(q.id) FROM outbox.quarantine AS q WHERE q.topic = c.topic"                      \
    "   AND q.partition_key = c.partition_key AND q.id < c.id) END,"                               \
    " EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = c.id)"                               \
    " FROM outbox.batch_rows($1::bigint, $2::bigint, $3::bigint, $4::bigint, $5::integer)"         \
    " AS c WHERE (SELECT outbox.quarantine_rows($6::bigint[], $7::text[])) >= 0"                   \
    " ORDER BY id"

int relay_pgsrc_batch_sql(uint32_t max_payload_bytes, char *out, size_t outlen)
{
    int n = snprintf(out, outlen, CLAIM_SELECT BATCH_FROM, max_payload_bytes);
    return n < 0 || (size_t)n >= outlen ? -1 : n;
}

enum setup_step {
    SETUP_SESSION = 0, /* SETs, the schema check, the session check */
    SETUP_PREPARE,     /* claim connections: prepare "batch" */
    SETUP_BOUNDS,      /* claim connections: prepare "bounds" */
    SETUP_RECHECK,     /* the session check's second look (see SESSION_PROBE) */
    SETUP_DONE,
};

struct relay_pgsrc {
    struct ev_loop *loop;
    const struct relay_config *cfg;
    enum relay_pgsrc_role role;
    struct relay_pgsrc_hooks hooks;

    PGconn *conn;
    enum relay_pgsrc_state state;
    /* Connecting to names: their addresses, looked up one host at a time
     * on the loop, and why the last one that failed did. */
    struct relay_pg_hosts hosts;
    struct relay_lookup *lookup;
    int lookup_at;
    char lookup_why[400];
    ev_io io;
    ev_timer timer; /* connect deadline, command deadline, or reconnect wait */
    struct outbox_backoff backoff;
    enum setup_step setup;

    /* The command in flight. */
    int cmd_active;
    relay_pgsrc_done_fn *done;
    void *done_arg;
    PGresult *keep;
    PGresult *delivered; /* the result a done callback is reading */
    char err[512];
    char sqlstate[6];

    /* The session check: the token this connection set on its server
     * session, the backend that answered its set-up (0: not set up), and the
     * next connection of this process. */
    char token[48];
    long backend_pid;
    int first_check_over; /* passed the check once, or failed before it */
    int check_queued;     /* connected, its first check waiting for another's */
    struct relay_pgsrc *next_conn;

    /* Logging once per state change, not once per try. */
    int was_ready;
    char last_logged[1024];
    char describe[256];
};

static void on_io(struct ev_loop *loop, ev_io *w, int revents);
static void on_timer(struct ev_loop *loop, ev_timer *w, int revents);
static void start_connect(struct relay_pgsrc *pg);
static void run_setup(struct relay_pgsrc *pg);

static const char *role_name(const struct relay_pgsrc *pg)
{
    return pg->role == RELAY_PGSRC_LISTEN  ? "listen"
           : pg->role == RELAY_PGSRC_OWNER ? "owner"
                                           : "claim";
}

/*
 * The session check (docs/DESIGN.md, "Behind a connection pooler"). The relay
 * needs each connection to be one server session for as long as it lasts:
 * LISTEN, the session advisory locks, the prepared claims and the session
 * settings all live there. A pooler in transaction (or statement) mode hands
 * each transaction whichever server session is free, and says so nowhere in
 * the protocol. So each connection's set-up reads a custom setting and the
 * backend pid, then sets the setting to a token of its own; in the same
 * round trip, so the check costs no extra one. A session belongs to one
 * connection, so:
 *   - the set-up must not find the token of another connection of this
 *     process that is still open (its server session was handed on);
 *   - two open connections must not share a backend pid;
 *   - one more look after the set-up must find the same pid and its own
 *     token.
 * A breach ends the relay with OUTBOX_EX_CONFIG through the handler that
 * relay_pgsrc_on_no_session installed. Tokens of closed connections do not
 * count: a session-mode pool without a reset query may hand their sessions
 * on, which is harmless.
 *
 * A connection that passes alone proves little while the others are still
 * setting up: in transaction mode it may have had a server session to itself
 * so far, and the next connection's set-up is handed that very session. So
 * no connection is ready for work (become_ready) until every connection of
 * the process is past its first check: passed it, or failed before it (a
 * connection with no session shares none). And the first checks run one
 * at a time, each connection's set-up and second look before the next
 * connection's set-up: a pool in transaction mode hands the next set-up a
 * session an earlier connection has used (PgBouncer gives the session freed
 * last), whose token it finds, whereas set-ups that overlap could each be
 * handed a session of their own and all pass. Reconnects later are checked
 * each on its own and hold no one back.
 */
#define SESSION_PROBE "outbox_relay.session_probe"
#define SESSION_PROBE_READ "pg_backend_pid(), current_setting('" SESSION_PROBE "', true)"

static struct relay_pgsrc *session_conns;    /* every connection of this process */
static struct relay_pgsrc *session_checking; /* the one on its first check, or NULL */
static relay_pgsrc_no_session_fn *session_refuse;
static void *session_refuse_arg;

void relay_pgsrc_on_no_session(relay_pgsrc_no_session_fn *fn, void *arg)
{
    session_refuse = fn;
    session_refuse_arg = arg;
}

static void session_new_token(struct relay_pgsrc *pg)
{
    static unsigned long seq;
    snprintf(pg->token, sizeof(pg->token), "%08lx%08lx-%ld-%lu", (unsigned long)random(),
             (unsigned long)random(), (long)getpid(), ++seq);
    pg->backend_pid = 0;
}

/* Another open connection of this process whose token is value, or NULL. */
static struct relay_pgsrc *session_owner_of(const struct relay_pgsrc *pg, const char *value)
{
    for (struct relay_pgsrc *o = session_conns; o != NULL; o = o->next_conn)
        if (o != pg && o->conn != NULL && o->token[0] != '\0' && strcmp(o->token, value) == 0)
            return o;
    return NULL;
}

static struct relay_pgsrc *session_pid_sharer(const struct relay_pgsrc *pg, long pid)
{
    for (struct relay_pgsrc *o = session_conns; o != NULL; o = o->next_conn)
        if (o != pg && o->conn != NULL && o->backend_pid != 0 && o->backend_pid == pid)
            return o;
    return NULL;
}

static void fail(struct relay_pgsrc *pg, const char *what, const char *msg);
static void become_ready(struct relay_pgsrc *pg);

/* Whether a connection of this process is still on its first check. */
static int session_first_checks_pending(void)
{
    for (const struct relay_pgsrc *o = session_conns; o != NULL; o = o->next_conn)
        if (!o->first_check_over)
            return 1;
    return 0;
}

/* The first check of conn is over (passed or failed): the next connection
 * that waits for its own goes on with its set-up. */
static void session_check_over(const struct relay_pgsrc *pg)
{
    if (session_checking != pg)
        return;
    session_checking = NULL;
    for (struct relay_pgsrc *o = session_conns; o != NULL; o = o->next_conn)
        if (o->check_queued && o->conn != NULL) {
            o->check_queued = 0;
            run_setup(o);
            return;
        }
}

/* Once no first check is pending, makes ready the connections that passed
 * theirs and waited for the others. */
static void session_release_waiting(void)
{
    if (session_first_checks_pending())
        return;
    struct relay_pgsrc *next;
    for (struct relay_pgsrc *o = session_conns; o != NULL; o = next) {
        next = o->next_conn;
        if (o->state == RELAY_PG_SETUP && o->setup == SETUP_DONE)
            become_ready(o);
    }
}

/* Reports a breach: the relay stops (exit code 78); without a handler the
 * connection fails like any set-up error. */
static void session_refused(struct relay_pgsrc *pg, const char *evidence)
{
    char msg[900];
    snprintf(msg, sizeof(msg),
             "PostgreSQL is reached through a connection pooler in transaction pooling mode (or "
             "statement pooling): %s. The relay needs each of its connections to keep one server "
             "session (LISTEN, session advisory locks, prepared statements and session settings "
             "live there): point the postgres setting at PostgreSQL directly, or at a pool in "
             "session mode (PgBouncer: pool_mode = session)",
             evidence);
    if (session_refuse == NULL) {
        fail(pg, "session set-up failed", msg);
        return;
    }
    ev_io_stop(pg->loop, &pg->io);
    ev_timer_stop(pg->loop, &pg->timer);
    session_refuse(session_refuse_arg, msg);
}

/* The set-up's look at the session: pid in column col, the setting found
 * before this connection set its own in col + 1. 0, or -1 after a breach. */
static int session_first_look(struct relay_pgsrc *pg, const PGresult *res, int col)
{
    char evidence[400];
    if (res == NULL || PQntuples(res) != 1 || PQnfields(res) < col + 2 ||
        PQgetisnull(res, 0, col)) {
        fail(pg, "session set-up failed", "the session check got no backend pid");
        return -1;
    }
    long pid = strtol(PQgetvalue(res, 0, col), NULL, 10);
    const char *found = PQgetisnull(res, 0, col + 1) ? "" : PQgetvalue(res, 0, col + 1);
    const struct relay_pgsrc *other = found[0] != '\0' ? session_owner_of(pg, found) : NULL;
    if (other != NULL) {
        snprintf(evidence, sizeof(evidence),
                 "the %s connection was handed the server session (backend pid %ld) that the "
                 "%s connection, still open, had set up",
                 role_name(pg), pid, role_name(other));
        session_refused(pg, evidence);
        return -1;
    }
    other = session_pid_sharer(pg, pid);
    if (other != NULL) {
        snprintf(evidence, sizeof(evidence),
                 "the %s and %s connections, both open, were served by the same backend "
                 "(pid %ld)",
                 role_name(pg), role_name(other), pid);
        session_refused(pg, evidence);
        return -1;
    }
    pg->backend_pid = pid;
    return 0;
}

/* The second look, one statement after the set-up: the same backend, and the
 * token this connection set. 0, or -1 after a breach. */
static int session_second_look(struct relay_pgsrc *pg, const PGresult *res)
{
    char evidence[400];
    if (res == NULL || PQntuples(res) != 1 || PQnfields(res) != 2 || PQgetisnull(res, 0, 0)) {
        fail(pg, "session set-up failed", "the session check got no backend pid");
        return -1;
    }
    long pid = strtol(PQgetvalue(res, 0, 0), NULL, 10);
    const char *found = PQgetisnull(res, 0, 1) ? "" : PQgetvalue(res, 0, 1);
    if (pid != pg->backend_pid || strcmp(found, pg->token) != 0) {
        snprintf(evidence, sizeof(evidence),
                 "the %s connection's next statement ran in another server session (backend "
                 "pid %ld, then %ld%s)",
                 role_name(pg), pg->backend_pid, pid,
                 pid == pg->backend_pid ? ", its own setting gone" : "");
        session_refused(pg, evidence);
        return -1;
    }
    return 0;
}

/* Describes the target from the conninfo, never including the password. */
static void describe_target(struct relay_pgsrc *pg)
{
    const char *host = NULL, *port = NULL, *db = NULL, *user = NULL;
    if (pg->conn != NULL && PQstatus(pg->conn) == CONNECTION_OK) {
        host = PQhost(pg->conn);
        port = PQport(pg->conn);
        db = PQdb(pg->conn);
        user = PQuser(pg->conn);
        snprintf(pg->describe, sizeof(pg->describe), "host=%s port=%s dbname=%s user=%s",
                 host != NULL ? host : "", port != NULL ? port : "", db != NULL ? db : "",
                 user != NULL ? user : "");
        return;
    }
    char *errmsg = NULL;
    PQconninfoOption *opts = PQconninfoParse(pg->cfg->postgres, &errmsg);
    if (opts == NULL) {
        PQfreemem(errmsg);
        snprintf(pg->describe, sizeof(pg->describe), "(unparsable conninfo)");
        return;
    }
    for (PQconninfoOption *o = opts; o->keyword != NULL; o++) {
        if (o->val == NULL)
            continue;
        if (strcmp(o->keyword, "host") == 0 ||
            (strcmp(o->keyword, "hostaddr") == 0 && host == NULL))
            host = o->val;
        else if (strcmp(o->keyword, "port") == 0)
            port = o->val;
        else if (strcmp(o->keyword, "dbname") == 0)
            db = o->val;
        else if (strcmp(o->keyword, "user") == 0)
            user = o->val;
    }
    snprintf(pg->describe, sizeof(pg->describe), "host=%s port=%s dbname=%s user=%s",
             host != NULL               ? host
             : getenv("PGHOST") != NULL ? getenv("PGHOST")
                                        : "(default)",
             port != NULL               ? port
             : getenv("PGPORT") != NULL ? getenv("PGPORT")
                                        : "(default)",
             db != NULL                     ? db
             : getenv("PGDATABASE") != NULL ? getenv("PGDATABASE")
                                            : "(default)",
             user != NULL               ? user
             : getenv("PGUSER") != NULL ? getenv("PGUSER")
                                        : "(default)");
    PQconninfoFree(opts);
}

const char *relay_pgsrc_describe(const struct relay_pgsrc *pg)
{
    return pg->describe;
}

int relay_pgsrc_up(const struct relay_pgsrc *pg)
{
    return pg->state == RELAY_PG_READY || pg->state == RELAY_PG_BUSY;
}

const char *relay_pgsrc_problem(const struct relay_pgsrc *pg)
{
    return relay_pgsrc_up(pg) ? "" : pg->last_logged;
}

enum relay_pgsrc_state relay_pgsrc_state(const struct relay_pgsrc *pg)
{
    return pg->state;
}

/* libpq messages end in a newline and may hold several lines: one line each. */
static void one_line(char *dst, size_t dstlen, const char *src)
{
    snprintf(dst, dstlen, "%s", src != NULL ? src : "unknown error");
    for (char *p = dst; *p; p++)
        if (*p == '\n' || *p == '\r' || *p == '\t')
            *p = ' ';
    size_t n = strlen(dst);
    while (n > 0 && dst[n - 1] == ' ')
        dst[--n] = '\0';
}

static void watch(struct relay_pgsrc *pg, int events)
{
    ev_io_stop(pg->loop, &pg->io);
    int fd = PQsocket(pg->conn);
    if (fd < 0)
        return;
    ev_io_set(&pg->io, fd, events);
    ev_io_start(pg->loop, &pg->io);
}

static void timer_start(struct relay_pgsrc *pg, uint32_t ms)
{
    ev_timer_stop(pg->loop, &pg->timer);
    ev_timer_set(&pg->timer, ms / 1000.0, 0.0);
    ev_timer_start(pg->loop, &pg->timer);
}

/* Logs a failure unless it repeats the last one (once per state change). */
static void log_failure(struct relay_pgsrc *pg, const char *what, const char *msg,
                        uint32_t delay_ms)
{
    char line[1024];
    snprintf(line, sizeof(line), "%.100s: %.800s", what, msg);
    if (strcmp(line, pg->last_logged) == 0) {
        relay_debug(COMPONENT, "%s connection to %s: %s; retrying in %u ms", role_name(pg),
                    pg->describe, line, delay_ms);
        return;
    }
    snprintf(pg->last_logged, sizeof(pg->last_logged), "%s", line);
    relay_error(COMPONENT, "%s connection to %s: %s; retrying with backoff (first retry in %u ms)",
                role_name(pg), pg->describe, line, delay_ms);
}

/* Closes the connection, schedules a reconnect and tells the owner. */
static void fail(struct relay_pgsrc *pg, const char *what, const char *msg)
{
    char text[800];
    one_line(text, sizeof(text), msg);
    if (strcmp(what, "cannot connect") == 0) {
        size_t len = strlen(text);
        snprintf(text + len, sizeof(text) - len, "%s", relay_pg_connect_hint(text));
    }

    ev_io_stop(pg->loop, &pg->io);
    ev_timer_stop(pg->loop, &pg->timer);
    relay_lookup_cancel(pg->lookup);
    pg->lookup = NULL;
    if (pg->conn != NULL) {
        PQfinish(pg->conn);
        pg->conn = NULL;
    }
    if (pg->keep != NULL) {
        PQclear(pg->keep);
        pg->keep = NULL;
    }
    int first_check_ends = !pg->first_check_over;
    pg->first_check_over = 1;
    pg->check_queued = 0;
    int was_ready = pg->was_ready;
    pg->was_ready = 0;
    pg->state = RELAY_PG_DOWN;
    pg->backend_pid = 0;

    uint32_t delay = outbox_backoff_next(&pg->backoff, outbox_backoff_random());
    if (was_ready)
        pg->last_logged[0] = '\0';
    log_failure(pg, what, text, delay);
    timer_start(pg, delay);

    relay_pgsrc_done_fn *done = pg->done;
    void *done_arg = pg->done_arg;
    int had_cmd = pg->cmd_active;
    pg->cmd_active = 0;
    pg->done = NULL;

    if (pg->hooks.on_down != NULL)
        pg->hooks.on_down(pg, pg->hooks.arg);
    if (had_cmd && done != NULL)
        done(pg, NULL, text, "08006", done_arg);
    session_check_over(pg);
    if (first_check_ends)
        session_release_waiting();
}

static void notice_receiver(void *arg, const PGresult *res)
{
    struct relay_pgsrc *pg = arg;
    char text[512];
    one_line(text, sizeof(text), PQresultErrorMessage(res));
    relay_debug(COMPONENT, "%s connection: server notice: %s", role_name(pg), text);
}

/* Connects, with the addresses looked up when addressed. */
static void connect_now(struct relay_pgsrc *pg, int addressed)
{
    char host[2048], hostaddr[1024], port[256];
    if (addressed && relay_pg_hosts_params(&pg->hosts, host, sizeof(host), hostaddr,
                                           sizeof(hostaddr), port, sizeof(port)) != 0) {
        fail(pg, "cannot connect",
             pg->lookup_why[0] ? pg->lookup_why
                               : "the host list has too many addresses: give fewer hosts");
        return;
    }
    const char *app = pg->role == RELAY_PGSRC_LISTEN  ? "outbox-relay listen"
                      : pg->role == RELAY_PGSRC_OWNER ? "outbox-relay owner"
                                                      : "outbox-relay";
    /* Our defaults come first so the user's conninfo (expanded in place of
     * dbname) overrides them; libpq's PG* variables fill in what is left.
     * The addresses looked up and client_encoding come after it, so that
     * nothing overrides them: keys, topics and headers are read in UTF-8
     * whatever the database's encoding, which is what the partition trigger
     * hashes (convert_to(key, 'UTF8')) and what consumers read. */
    const char *keys[] = {"application_name",
                          "keepalives",
                          "keepalives_idle",
                          "keepalives_interval",
                          "keepalives_count",
                          "tcp_user_timeout",
                          "dbname",
                          "client_encoding",
                          NULL,
                          NULL,
                          NULL,
                          NULL};
    const char *vals[] = {app,    "1",  "10", "5",  "3", "30000", pg->cfg->postgres,
                          "UTF8", NULL, NULL, NULL, NULL};
    if (addressed)
        relay_pg_hosts_keys(keys, vals, 8, host, hostaddr, port);

    pg->conn = PQconnectStartParams(keys, vals, 1);
    if (pg->conn == NULL) {
        fail(pg, "cannot connect", "out of memory");
        return;
    }
    if (PQstatus(pg->conn) == CONNECTION_BAD) {
        fail(pg, "cannot connect", PQerrorMessage(pg->conn));
        return;
    }
    watch(pg, EV_WRITE);
}

static void lookup_next(struct relay_pgsrc *pg);

static void on_resolved(void *arg, int ok, const struct outbox_addrs *addrs, const char *why)
{
    struct relay_pgsrc *pg = arg;
    pg->lookup = NULL;
    if (ok)
        pg->hosts.addrs[pg->lookup_at] = *addrs;
    else
        snprintf(pg->lookup_why, sizeof(pg->lookup_why), "%s", why);
    lookup_next(pg);
}

/* Looks up the next host that is a name, on the loop; after the last,
 * connects to every address found. */
static void lookup_next(struct relay_pgsrc *pg)
{
    while (++pg->lookup_at < pg->hosts.n) {
        int i = pg->lookup_at;
        if (!relay_pg_host_is_name(&pg->hosts, i)) {
            /* An address is its own; a socket's path takes none. */
            outbox_addrs_of_address(&pg->hosts.addrs[i], pg->hosts.host[i]);
            continue;
        }
        pg->lookup = relay_lookup_start(pg->loop, pg->hosts.host[i], on_resolved, pg,
                                        pg->lookup_why, sizeof(pg->lookup_why));
        if (pg->lookup != NULL)
            return;
    }
    connect_now(pg, 1);
}

/* Connects within connect_timeout: at once when every host is an address,
 * else after looking the names up (relay/lookup.h), which libpq would do
 * with getaddrinfo, blocking the loop. */
static void start_connect(struct relay_pgsrc *pg)
{
    describe_target(pg);
    session_new_token(pg);
    pg->state = RELAY_PG_CONNECTING;
    timer_start(pg, pg->cfg->connect_timeout_ms);
    if (relay_pg_hosts(pg->cfg->postgres, &pg->hosts)) {
        pg->lookup_at = -1;
        pg->lookup_why[0] = '\0';
        lookup_next(pg);
        return;
    }
    connect_now(pg, 0);
}

static void connect_step(struct relay_pgsrc *pg)
{
    switch (PQconnectPoll(pg->conn)) {
    case PGRES_POLLING_READING:
        watch(pg, EV_READ);
        return;
    case PGRES_POLLING_WRITING:
        watch(pg, EV_WRITE);
        return;
    case PGRES_POLLING_OK:
        break;
    default:
        fail(pg, "cannot connect", PQerrorMessage(pg->conn));
        return;
    }
    ev_timer_stop(pg->loop, &pg->timer);
    if (PQsetnonblocking(pg->conn, 1) != 0) {
        fail(pg, "cannot connect", PQerrorMessage(pg->conn));
        return;
    }
    PQsetNoticeReceiver(pg->conn, notice_receiver, pg);
    watch(pg, EV_READ);
    pg->state = RELAY_PG_SETUP;
    pg->setup = SETUP_SESSION;
    describe_target(pg);
    run_setup(pg);
}

/* Flushes the output; watches for writability while libpq has data queued. */
static int flush(struct relay_pgsrc *pg)
{
    int r = PQflush(pg->conn);
    if (r < 0) {
        fail(pg, "connection lost", PQerrorMessage(pg->conn));
        return -1;
    }
    watch(pg, r == 1 ? EV_READ | EV_WRITE : EV_READ);
    return 0;
}

static int begin_command(struct relay_pgsrc *pg, relay_pgsrc_done_fn *done, void *arg)
{
    pg->cmd_active = 1;
    pg->done = done;
    pg->done_arg = arg;
    pg->err[0] = '\0';
    pg->sqlstate[0] = '\0';
    /* A deadline of our own in case the server never answers (a hung host
     * that keepalives have not caught yet); statement_timeout fires first. */
    timer_start(pg, pg->cfg->statement_timeout_ms + pg->cfg->connect_timeout_ms);
    return flush(pg);
}

struct pg_result *relay_pgsrc_take_result(struct relay_pgsrc *pg)
{
    PGresult *res = pg->delivered;
    pg->delivered = NULL;
    return res;
}

int relay_pgsrc_send(struct relay_pgsrc *pg, const char *sql, int nparams,
                     const char *const *params, int binary, relay_pgsrc_done_fn *done, void *arg)
{
    if (pg->state != RELAY_PG_READY && !(pg->state == RELAY_PG_SETUP && !pg->cmd_active))
        return -1;
    int ok = nparams == 0 && !binary
                 ? PQsendQuery(pg->conn, sql)
                 : PQsendQueryParams(pg->conn, sql, nparams, NULL, params, NULL, NULL, binary);
    if (!ok) {
        fail(pg, "cannot send a command", PQerrorMessage(pg->conn));
        return -1;
    }
    if (pg->state == RELAY_PG_READY)
        pg->state = RELAY_PG_BUSY;
    return begin_command(pg, done, arg);
}

int relay_pgsrc_send_prepared(struct relay_pgsrc *pg, const char *name, int nparams,
                              const char *const *params, int binary, relay_pgsrc_done_fn *done,
                              void *arg)
{
    if (pg->state != RELAY_PG_READY)
        return -1;
    if (!PQsendQueryPrepared(pg->conn, name, nparams, params, NULL, NULL, binary)) {
        fail(pg, "cannot send a command", PQerrorMessage(pg->conn));
        return -1;
    }
    pg->state = RELAY_PG_BUSY;
    return begin_command(pg, done, arg);
}

/* Reads what has arrived without blocking; completes the command at its end. */
static void collect(struct relay_pgsrc *pg)
{
    while (pg->conn != NULL && pg->cmd_active && !PQisBusy(pg->conn)) {
        PGresult *res = PQgetResult(pg->conn);
        if (res == NULL) {
            relay_pgsrc_done_fn *done = pg->done;
            void *arg = pg->done_arg;
            PGresult *keep = pg->keep;
            pg->keep = NULL;
            pg->cmd_active = 0;
            pg->done = NULL;
            ev_timer_stop(pg->loop, &pg->timer);
            if (pg->state == RELAY_PG_BUSY)
                pg->state = RELAY_PG_READY;
            if (pg->err[0] != '\0' && keep != NULL) {
                PQclear(keep);
                keep = NULL;
            }
            /* The result is the callback's to read and ours to free once it
             * returns, unless it takes it (relay_pgsrc_take_result). */
            pg->delivered = keep;
            if (done != NULL)
                done(pg, keep, pg->err[0] ? pg->err : NULL, pg->sqlstate, arg);
            if (pg->delivered != NULL) {
                PQclear(pg->delivered);
                pg->delivered = NULL;
            }
            return;
        }
        switch (PQresultStatus(res)) {
        case PGRES_TUPLES_OK:
            if (pg->keep != NULL)
                PQclear(pg->keep);
            pg->keep = res;
            break;
        case PGRES_COMMAND_OK:
        case PGRES_EMPTY_QUERY:
            PQclear(res);
            break;
        default:
            if (pg->err[0] == '\0') {
                const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
                one_line(pg->err, sizeof(pg->err), PQresultErrorMessage(res));
                snprintf(pg->sqlstate, sizeof(pg->sqlstate), "%s", state != NULL ? state : "");
            }
            PQclear(res);
            break;
        }
    }
}

static void drain_notifies(struct relay_pgsrc *pg)
{
    int got = 0;
    PGnotify *n;
    while (pg->conn != NULL && (n = PQnotifies(pg->conn)) != NULL) {
        PQfreemem(n);
        got++;
    }
    if (got > 0 && pg->hooks.on_notify != NULL)
        pg->hooks.on_notify(pg, pg->hooks.arg);
}

static void on_io(struct ev_loop *loop, ev_io *w, int revents)
{
    struct relay_pgsrc *pg = w->data;
    (void)loop;

    if (pg->state == RELAY_PG_CONNECTING) {
        connect_step(pg);
        return;
    }
    if (revents & EV_READ) {
        if (!PQconsumeInput(pg->conn)) {
            fail(pg, pg->was_ready ? "connection lost" : "set-up failed", PQerrorMessage(pg->conn));
            return;
        }
    }
    if (flush(pg) < 0)
        return;
    collect(pg);
    if (pg->conn != NULL && PQstatus(pg->conn) == CONNECTION_BAD) {
        fail(pg, "connection lost", PQerrorMessage(pg->conn));
        return;
    }
    drain_notifies(pg);
}

static void on_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay_pgsrc *pg = w->data;
    (void)loop;
    (void)revents;
    char msg[400];

    switch (pg->state) {
    case RELAY_PG_DOWN:
        start_connect(pg);
        break;
    case RELAY_PG_CONNECTING:
        if (pg->lookup != NULL)
            snprintf(msg, sizeof(msg), "cannot resolve %.100s: " OUTBOX_NO_DNS_ANSWER,
                     pg->hosts.host[pg->lookup_at], pg->cfg->connect_timeout_ms);
        else
            snprintf(msg, sizeof(msg), "no connection within connect_timeout (%u ms)",
                     pg->cfg->connect_timeout_ms);
        fail(pg, "cannot connect", msg);
        break;
    case RELAY_PG_SETUP:
    case RELAY_PG_BUSY:
        snprintf(msg, sizeof(msg), "no answer within %u ms (statement_timeout + connect_timeout)",
                 pg->cfg->statement_timeout_ms + pg->cfg->connect_timeout_ms);
        fail(pg, "server not answering", msg);
        break;
    default:
        break;
    }
}

static void setup_failed(struct relay_pgsrc *pg, const char *msg)
{
    fail(pg, "session set-up failed", msg);
}

static void become_ready(struct relay_pgsrc *pg)
{
    pg->state = RELAY_PG_READY;
    pg->was_ready = 1;
    outbox_backoff_reset(&pg->backoff);
    if (pg->last_logged[0] != '\0')
        relay_info(COMPONENT, "%s connection to %s is back", role_name(pg), pg->describe);
    else
        relay_info(COMPONENT, "%s connection to %s ready", role_name(pg), pg->describe);
    pg->last_logged[0] = '\0';
    if (pg->hooks.on_ready != NULL)
        pg->hooks.on_ready(pg, pg->hooks.arg);
}

static void on_setup_done(struct relay_pgsrc *pg, PGresult *res, const char *err,
                          const char *sqlstate, void *arg)
{
    (void)arg;
    char msg[600];

    if (pg->setup == SETUP_SESSION) {
        /* Every connection checks the schema at set-up, so each one that
         * finds it behind says what to apply, once, and backs off. */
        int version = -1, missing = 0;
        if (err == NULL && res != NULL && PQntuples(res) == 1 && PQnfields(res) == 4 &&
            !PQgetisnull(res, 0, 0)) {
            version = (int)strtol(PQgetvalue(res, 0, 0), NULL, 10); /* server-formatted */
            if (!PQgetisnull(res, 0, 1))
                missing = (int)strtol(PQgetvalue(res, 0, 1), NULL, 10);
        }
        if (err != NULL && sqlstate != NULL && strcmp(sqlstate, "42P01") == 0 &&
            relay_pg_schema_missing_advice(err, msg, sizeof(msg))) {
            setup_failed(pg, msg);
            return;
        }
        if (err == NULL && relay_pg_schema_advice(version, missing, msg, sizeof(msg))) {
            setup_failed(pg, msg);
            return;
        }
        if (err == NULL) {
            if (session_first_look(pg, res, 2) < 0)
                return;
            pg->setup = pg->role == RELAY_PGSRC_CLAIM ? SETUP_PREPARE : SETUP_RECHECK;
            run_setup(pg);
            return;
        }
    }
    if (err != NULL) {
        if (sqlstate != NULL && strcmp(sqlstate, "42501") == 0) {
            snprintf(msg, sizeof(msg),
                     "%s: grant the role outbox_relay (migrations/003_roles.sql) to the relay's "
                     "database user",
                     err);
            setup_failed(pg, msg);
        } else {
            setup_failed(pg, err);
        }
        return;
    }
    if (pg->setup == SETUP_PREPARE || pg->setup == SETUP_BOUNDS) {
        pg->setup = pg->setup == SETUP_PREPARE ? SETUP_BOUNDS : SETUP_RECHECK;
        run_setup(pg);
        return;
    }
    if (session_second_look(pg, res) < 0)
        return;
    pg->setup = SETUP_DONE;
    session_check_over(pg);
    if (pg->first_check_over && !session_first_checks_pending()) {
        become_ready(pg); /* a reconnect: checked on its own */
        return;
    }
    pg->first_check_over = 1;
    if (session_first_checks_pending())
        relay_debug(COMPONENT,
                    "%s connection: session checked; waiting for the other connections' checks",
                    role_name(pg));
    session_release_waiting();
}

/*
 * The server's side of the same keepalives. Without them a relay host that
 * vanishes (power loss, a partition) leaves its sessions, their row locks and
 * the wake-up lock in place until the server's TCP gives up, hours by
 * default: with them the server ends the sessions within about 30 s. They are
 * ordinary settings any role may change, and ignored on a Unix socket.
 */
#define SERVER_KEEPALIVES                                                                          \
    "SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5;"                               \
    " SET tcp_keepalives_count = 3; SET tcp_user_timeout = 30000; "

/* Ends each connection's session set-up: the session check's first look,
 * then its token (see SESSION_PROBE). */
#define SESSION_PROBE_SET "; SET " SESSION_PROBE " = '%s'"

/* Ends every connection's session set-up: READ COMMITTED whatever the
 * role's or database's default (outbox.tick() must take its snapshot after
 * its lock, which a transaction snapshot taken at the statement's start
 * would not), the schema's state (outbox.messages is read first, so that an
 * undefined_table error names it when the schema is missing altogether, and
 * outbox.schema_version when the schema predates it), then the session
 * check's first look and its token. */
#define SCHEMA_AND_SESSION                                                                         \
    "SET default_transaction_isolation = 'read committed';"                                        \
    " SELECT FROM outbox.messages LIMIT 0; SELECT " RELAY_PG_SCHEMA_COLUMNS                        \
    ", " SESSION_PROBE_READ " FROM outbox.schema_version" SESSION_PROBE_SET

static void run_setup(struct relay_pgsrc *pg)
{
    char sql[1536];
    const struct relay_config *cfg = pg->cfg;

    /* While first checks are pending, set-ups run one at a time: a first
     * check, and a reconnect of a connection that failed before its own. */
    if (pg->setup == SETUP_SESSION && session_first_checks_pending()) {
        if (session_checking != NULL && session_checking != pg) {
            pg->check_queued = 1; /* session_check_over goes on */
            return;
        }
        session_checking = pg;
    }
    if (pg->setup == SETUP_SESSION) {
        /* The idle-in-transaction limit frees whatever a hung or cut-off
         * process holds soon (the batch connection runs in autocommit; the
         * limit is a guard). The batch statement is
         * planned once: its generic plan is the one wanted for any
         * parameters, where a custom plan each time costs 0.4 ms, and JIT
         * would compile it (15-25 ms) whenever the generic estimate passes
         * jit_above_cost. Planned on an empty outbox, though, the cheapest
         * plan reads the whole table and sorts it, and it would stay cached
         * until an ANALYZE: 300 ms a claim once a burst of 300,000 rows
         * lands. Without sequential and bitmap scans, and with sorting
         * priced out, the one plan left walks the primary key in id
         * order, whatever the statistics say. synchronous_commit is on
         * whatever the database's or role's default: a tick must be on disk
         * before a row of its batch is published, or a crash of PostgreSQL
         * could take it back and the next tick cut the batch differently,
         * with other entry ids (the record alone opts out: relay/loop_io.c). */
        uint32_t idle_tx_ms = cfg->publish_timeout_ms * 2 + 2000;
        if (pg->role == RELAY_PGSRC_CLAIM)
            snprintf(sql, sizeof(sql),
                     SERVER_KEEPALIVES "SET statement_timeout = %u; SET lock_timeout = %u;"
                                       " SET idle_in_transaction_session_timeout = %u;"
                                       " SET jit = off; SET plan_cache_mode = force_generic_plan;"
                                       " SET synchronous_commit = on;"
                                       " SET enable_seqscan = off; SET enable_bitmapscan = off;"
                                       " SET enable_sort = off;"
                                       " SET idle_session_timeout = 0; " SCHEMA_AND_SESSION,
                     cfg->statement_timeout_ms, cfg->statement_timeout_ms, idle_tx_ms, pg->token);
        else if (pg->role == RELAY_PGSRC_OWNER)
            /* The owner connection holds the relay's partitions. It speaks
             * once a second (relay/ownership_io.c): a session silent for longer
             * than RELAY_OWNER_IDLE_MS, a relay frozen or cut off behind a
             * proxy that the server's keepalives cannot see through, is
             * ended by the server, and its partitions pass to the others. */
            snprintf(sql, sizeof(sql),
                     SERVER_KEEPALIVES
                     "SET statement_timeout = %u; SET idle_session_timeout = %u;"
                     " SET idle_in_transaction_session_timeout = %u; " SCHEMA_AND_SESSION,
                     cfg->statement_timeout_ms, (unsigned)RELAY_OWNER_IDLE_MS,
                     (unsigned)RELAY_OWNER_IDLE_MS, pg->token);
        else
            snprintf(sql, sizeof(sql),
                     SERVER_KEEPALIVES "SET statement_timeout = %u; SET idle_session_timeout = 0; "
                                       "LISTEN %s; " SCHEMA_AND_SESSION,
                     cfg->statement_timeout_ms, NOTIFY_CHANNEL, pg->token);
        if (relay_pgsrc_send(pg, sql, 0, NULL, 0, on_setup_done, NULL) < 0)
            return;
        return;
    }
    if (pg->setup == SETUP_RECHECK) {
        if (relay_pgsrc_send(pg, "SELECT " SESSION_PROBE_READ, 0, NULL, 0, on_setup_done, NULL) < 0)
            return;
        return;
    }
    if (pg->setup == SETUP_PREPARE) {
        /* max_payload_bytes needs a restart to change, so it is part of the
         * statement: the planner sees a constant. */
        char batch[RELAY_PGSRC_BATCH_SQL_MAX];
        if (relay_pgsrc_batch_sql(cfg->max_payload_bytes, batch, sizeof(batch)) < 0) {
            setup_failed(pg, "the batch statement does not fit its buffer");
            return;
        }
        if (!PQsendPrepare(pg->conn, "batch", batch, 7, NULL)) {
            setup_failed(pg, PQerrorMessage(pg->conn));
            return;
        }
        begin_command(pg, on_setup_done, NULL);
        return;
    }
    if (pg->setup == SETUP_BOUNDS) {
        /* Planned once as well: outbox.batch_bounds is a SQL function the
         * planner inlines, and planning it anew took 3.5 ms of each batch's
         * 4 ms read (its execution: 0.3 ms). */
        if (!PQsendPrepare(pg->conn, RELAY_PGSRC_BOUNDS, RELAY_PGSRC_BOUNDS_SQL, 2, NULL)) {
            setup_failed(pg, PQerrorMessage(pg->conn));
            return;
        }
        begin_command(pg, on_setup_done, NULL);
    }
}

struct relay_pgsrc *relay_pgsrc_new(struct ev_loop *loop, const struct relay_config *cfg,
                                    enum relay_pgsrc_role role,
                                    const struct relay_pgsrc_hooks *hooks)
{
    struct relay_pgsrc *pg = calloc(1, sizeof(*pg));
    if (pg == NULL)
        return NULL;
    pg->loop = loop;
    pg->cfg = cfg;
    pg->role = role;
    if (hooks != NULL)
        pg->hooks = *hooks;
    outbox_backoff_init(&pg->backoff, cfg->reconnect_min_ms, cfg->reconnect_max_ms);
    ev_init(&pg->io, on_io);
    pg->io.data = pg;
    ev_init(&pg->timer, on_timer);
    pg->timer.data = pg;
    pg->next_conn = session_conns;
    session_conns = pg;
    start_connect(pg);
    return pg;
}

void relay_pgsrc_reset(struct relay_pgsrc *pg, const char *why)
{
    if (pg->conn != NULL)
        fail(pg, "connection reset", why);
}

void relay_pgsrc_free(struct relay_pgsrc *pg)
{
    if (pg == NULL)
        return;
    for (struct relay_pgsrc **link = &session_conns; *link != NULL; link = &(*link)->next_conn)
        if (*link == pg) {
            *link = pg->next_conn;
            break;
        }
    session_check_over(pg);
    ev_io_stop(pg->loop, &pg->io);
    ev_timer_stop(pg->loop, &pg->timer);
    relay_lookup_cancel(pg->lookup);
    if (pg->keep != NULL)
        PQclear(pg->keep);
    if (pg->conn != NULL)
        PQfinish(pg->conn);
    free(pg);
}
