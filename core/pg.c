/*
 * PostgreSQL for the observation, retention and the operator commands
 * (core/pg.h): one connection at a time, blocking, with a deadline of our
 * own on every wait. libpq's blocking calls would wait as long as the kernel
 * keeps a silent connection open; each wait here is a poll() on the
 * connection's socket and the caller's stop descriptor (common/wait.c), so
 * a network partition costs a deadline, and a stop ends the wait at once.
 */
#include "common/compat.h"

#include "core/pg.h"

#include <libpq-fe.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/buf.h"
#include "common/wait.h"
#include "core/config.h"

static void one_line(char *dst, size_t dstlen, const char *src)
{
    snprintf(dst, dstlen, "%s", src != NULL ? src : "unknown error");
    for (char *p = dst; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
}

/* Splits a comma-separated list of libpq's into items of len bytes: their
 * count, or -1 when there are more than max or one is too long. */
static int split_list(const char *list, char *items, size_t len, int max)
{
    int n = 0;
    const char *p = list;
    for (;;) {
        const char *end = strchr(p, ',');
        size_t l = end != NULL ? (size_t)(end - p) : strlen(p);
        if (n == max || l >= len)
            return -1;
        memcpy(items + (size_t)n * len, p, l);
        items[(size_t)n * len + l] = '\0';
        n++;
        if (end == NULL)
            return n;
        p = end + 1;
    }
}

int relay_pg_hosts(const char *conninfo, struct relay_pg_hosts *h)
{
    memset(h, 0, sizeof(*h));
    char *errmsg = NULL;
    PQconninfoOption *opts = PQconninfoParse(conninfo, &errmsg);
    if (opts == NULL) {
        PQfreemem(errmsg);
        return 0;
    }
    const char *host = getenv("PGHOST"), *port = getenv("PGPORT"), *env_addr = getenv("PGHOSTADDR");
    int addressed = env_addr != NULL && env_addr[0] != '\0';
    for (PQconninfoOption *o = opts; o->keyword != NULL; o++) {
        if (o->val == NULL)
            continue;
        if (strcmp(o->keyword, "host") == 0)
            host = o->val;
        else if (strcmp(o->keyword, "port") == 0)
            port = o->val;
        else if (strcmp(o->keyword, "hostaddr") == 0 || strcmp(o->keyword, "service") == 0)
            addressed |= o->val[0] != '\0';
    }
    int names = 0;
    if (!addressed && host != NULL && host[0] != '\0') {
        h->n = split_list(host, &h->host[0][0], sizeof(h->host[0]), RELAY_PG_HOSTS_MAX);
        h->nports = port != NULL && port[0] != '\0'
                        ? split_list(port, &h->port[0][0], sizeof(h->port[0]), RELAY_PG_HOSTS_MAX)
                        : 0;
        /* A list libpq refuses (port lists of another length) stays its to
         * explain. */
        if (h->n > 0 && (h->nports == 0 || h->nports == 1 || h->nports == h->n))
            for (int i = 0; i < h->n; i++)
                names += relay_pg_host_is_name(h, i);
    }
    PQconninfoFree(opts);
    if (names == 0)
        memset(h, 0, sizeof(*h));
    return names > 0;
}

int relay_pg_host_is_name(const struct relay_pg_hosts *h, int i)
{
    return h->host[i][0] != '\0' && !outbox_host_is_address(h->host[i]);
}

/* Appends item to the comma-separated list out, as its first item or not:
 * 0, or -1 when full. */
static int list_add(char *out, size_t len, const char *item, int first)
{
    size_t at = strlen(out);
    int n = snprintf(out + at, len - at, "%s%s", first ? "" : ",", item);
    return n < 0 || (size_t)n >= len - at ? -1 : 0;
}

int relay_pg_hosts_params(const struct relay_pg_hosts *h, char *host, size_t hostlen,
                          char *hostaddr, size_t addrlen, char *port, size_t portlen)
{
    host[0] = hostaddr[0] = port[0] = '\0';
    int entries = 0;
    for (int i = 0; i < h->n; i++) {
        const char *p = h->nports == 0 ? "" : h->port[h->nports == 1 ? 0 : i];
        for (int a = 0; a < h->addrs[i].n; a++) {
            /* A socket's path takes an empty hostaddr: libpq then uses the
             * host as it stands. */
            const char *addr =
                h->host[i][0] == '/' || h->host[i][0] == '@' ? "" : h->addrs[i].addr[a];
            if (list_add(host, hostlen, h->host[i], entries == 0) ||
                list_add(hostaddr, addrlen, addr, entries == 0) ||
                (h->nports > 0 && list_add(port, portlen, p, entries == 0)))
                return -1;
            entries++;
        }
    }
    return entries > 0 ? 0 : -1;
}

void relay_pg_hosts_keys(const char **keys, const char **vals, int at, const char *host,
                         const char *hostaddr, const char *port)
{
    keys[at] = "host";
    vals[at] = host;
    keys[at + 1] = "hostaddr";
    vals[at + 1] = hostaddr;
    keys[at + 2] = port[0] != '\0' ? "port" : NULL;
    vals[at + 2] = port;
    keys[at + 3] = NULL;
    vals[at + 3] = NULL;
}

const char *relay_pg_connect_hint(const char *msg)
{
    if (strstr(msg, "certificate verify failed") != NULL)
        return "; the server's certificate is not signed by a CA that sslrootcert names: point "
               "sslrootcert in postgres at the CA that signed it";
    if (strstr(msg, "does not match host name") != NULL)
        return "; with sslmode=verify-full, host in postgres must be a name (or address) the "
               "server's certificate lists";
    if (strstr(msg, "password authentication failed") != NULL)
        return "; check the user and password in postgres (or PGPASSWORD, ~/.pgpass)";
    return "";
}

int relay_pg_text_array(char *out, size_t outlen, const char (*items)[OUTBOX_TOPIC_MAX + 1],
                        size_t n)
{
    size_t len = 0;
    if (outlen < 3)
        return -1;
    out[len++] = '{';
    for (size_t i = 0; i < n; i++) {
        /* Room for a separator, the quotes and the closing brace is checked
         * as we go; an element never writes past outlen - 2. */
        if (i && len < outlen)
            out[len++] = ',';
        if (len < outlen)
            out[len++] = '"';
        for (const char *c = items[i]; *c != '\0' && len < outlen; c++) {
            if ((*c == '"' || *c == '\\') && len + 1 < outlen)
                out[len++] = '\\';
            if (len < outlen)
                out[len++] = *c;
        }
        if (len < outlen)
            out[len++] = '"';
    }
    if (len + 2 > outlen)
        return -1;
    out[len++] = '}';
    out[len] = '\0';
    return 0;
}

void relay_pg_array_element(struct outbox_buf *b, int first, const char *s)
{
    if (!first)
        outbox_buf_append(b, ",", 1);
    if (s == NULL) {
        outbox_buf_puts(b, "NULL");
        return;
    }
    outbox_buf_append(b, "\"", 1);
    for (const char *c = s; *c != '\0'; c++) {
        if (*c == '"' || *c == '\\')
            outbox_buf_append(b, "\\", 1);
        outbox_buf_append(b, c, 1);
    }
    outbox_buf_append(b, "\"", 1);
}

/* A dead peer is noticed within about 25 s whether the connection is idle
 * (keepalives: 10 s idle, then 3 probes 5 s apart) or has data in flight
 * (tcp_user_timeout), the same keepalives as the claiming connections. */
#define PG_KEEPALIVES_IDLE "10"
#define PG_KEEPALIVES_INTERVAL "5"
#define PG_KEEPALIVES_COUNT "3"
#define PG_TCP_USER_TIMEOUT "25000"

PGconn *relay_pg_open(const struct relay_config *cfg, const char *application_name, int stop_fd,
                      char *err, size_t errlen)
{
    char timeout[16], options[256];
    /* connect_timeout is libpq's record of the setting: PQconnectPoll does not
     * enforce it, the deadline below does. */
    snprintf(timeout, sizeof(timeout), "%u", (cfg->connect_timeout_ms + 999) / 1000);
    /* The server's side of the keepalives too, as the relay's own sessions
     * set them: a vanished host's session then ends within about 30 s. No
     * JIT: these statements are short, and compiling one whose estimate
     * passes jit_above_cost on a large outbox costs 15-25 ms of CPU each
     * time (7 % of the machine's CPU in a drain, before). */
    snprintf(options, sizeof(options),
             "-c statement_timeout=%u -c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5"
             " -c tcp_keepalives_count=3 -c tcp_user_timeout=30000 -c jit=off",
             cfg->statement_timeout_ms);
    /* Names are looked up here, within connect_timeout and ended by the
     * stop, not by libpq (getaddrinfo blocks for the resolver's timeouts). */
    double deadline = outbox_mono_now() + cfg->connect_timeout_ms / 1000.0;
    struct relay_pg_hosts hosts;
    char host[2048], hostaddr[1024], port[256];
    int addressed = relay_pg_hosts(cfg->postgres, &hosts);
    if (addressed) {
        char why[400] = "";
        for (int i = 0; i < hosts.n; i++) {
            double left = deadline - outbox_mono_now();
            if (left <= 0 || outbox_resolve(hosts.host[i], (unsigned)(left * 1000.0), stop_fd,
                                            &hosts.addrs[i], why, sizeof(why)) != 0)
                hosts.addrs[i].n = 0;
            if (strcmp(why, "stopped") == 0) {
                snprintf(err, errlen, "stopped");
                return NULL;
            }
        }
        if (relay_pg_hosts_params(&hosts, host, sizeof(host), hostaddr, sizeof(hostaddr), port,
                                  sizeof(port)) != 0) {
            snprintf(err, errlen, "%s",
                     why[0] ? why : "the host list has too many addresses: give fewer hosts");
            return NULL;
        }
    }
    /* Our defaults come first so the user's conninfo (expanded in place of
     * dbname) overrides them; the addresses looked up and client_encoding
     * come after it, so that nothing overrides them: text is read in UTF-8
     * whatever the database's encoding (relay/pgsrc.c). */
    const char *keys[] = {"application_name",
                          "connect_timeout",
                          "keepalives",
                          "keepalives_idle",
                          "keepalives_interval",
                          "keepalives_count",
                          "tcp_user_timeout",
                          "options",
                          "dbname",
                          "client_encoding",
                          NULL,
                          NULL,
                          NULL,
                          NULL};
    const char *vals[] = {application_name,
                          timeout,
                          "1",
                          PG_KEEPALIVES_IDLE,
                          PG_KEEPALIVES_INTERVAL,
                          PG_KEEPALIVES_COUNT,
                          PG_TCP_USER_TIMEOUT,
                          options,
                          cfg->postgres,
                          "UTF8",
                          NULL,
                          NULL,
                          NULL,
                          NULL};
    if (addressed)
        relay_pg_hosts_keys(keys, vals, 10, host, hostaddr, port);
    PGconn *c = PQconnectStartParams(keys, vals, 1);
    if (c == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    PostgresPollingStatusType st = PGRES_POLLING_WRITING;
    while (PQstatus(c) != CONNECTION_BAD && st != PGRES_POLLING_OK && st != PGRES_POLLING_FAILED) {
        enum outbox_wait w = outbox_wait_fd(
            PQsocket(c), st == PGRES_POLLING_READING ? POLLIN : POLLOUT, stop_fd, deadline);
        if (w != OUTBOX_WAIT_READY) {
            if (w == OUTBOX_WAIT_DEADLINE)
                snprintf(err, errlen, "no connection within connect_timeout (%u ms)",
                         cfg->connect_timeout_ms);
            else
                snprintf(err, errlen, "stopped");
            PQfinish(c);
            return NULL;
        }
        st = PQconnectPoll(c);
    }
    if (PQstatus(c) != CONNECTION_OK || PQsetnonblocking(c, 1) != 0) {
        one_line(err, errlen, PQerrorMessage(c));
        size_t len = strlen(err);
        snprintf(err + len, errlen - len, "%s", relay_pg_connect_hint(err));
        PQfinish(c);
        return NULL;
    }
    return c;
}

/*
 * Runs one statement on *pg: its result (the caller clears it; it may be an
 * error result), or NULL with err set when the connection failed, gave no
 * answer within statement_timeout + connect_timeout, or the stop fired.
 * The connection is then closed and *pg set to NULL.
 */
PGresult *relay_pg_exec(PGconn **pg, const struct relay_config *cfg, int stop_fd, const char *sql,
                        int nparams, const char *const *params, char *err, size_t errlen)
{
    PGconn *c = *pg;
    uint32_t limit_ms = cfg->statement_timeout_ms + cfg->connect_timeout_ms;
    double deadline = outbox_mono_now() + limit_ms / 1000.0;
    enum outbox_wait w = OUTBOX_WAIT_READY;
    PGresult *res = NULL;
    int flushed;

    if (!PQsendQueryParams(c, sql, nparams, NULL, params, NULL, NULL, 0))
        goto lost;
    /* A server that sends while we write must be read, or both wait. */
    while ((flushed = PQflush(c)) == 1) {
        if ((w = outbox_wait_fd(PQsocket(c), POLLOUT | POLLIN, stop_fd, deadline)) !=
            OUTBOX_WAIT_READY)
            goto waited;
        if (!PQconsumeInput(c))
            goto lost;
    }
    if (flushed < 0)
        goto lost;
    for (;;) {
        while (PQisBusy(c)) {
            if ((w = outbox_wait_fd(PQsocket(c), POLLIN, stop_fd, deadline)) != OUTBOX_WAIT_READY)
                goto waited;
            if (!PQconsumeInput(c))
                goto lost;
        }
        PGresult *r = PQgetResult(c);
        if (r == NULL)
            break;
        if (res == NULL)
            res = r;
        else
            PQclear(r);
    }
    if (res != NULL)
        return res;
lost:
    one_line(err, errlen, PQerrorMessage(c));
    goto drop;
waited:
    if (w == OUTBOX_WAIT_DEADLINE)
        snprintf(err, errlen, "no answer within %u ms (statement_timeout + connect_timeout)",
                 limit_ms);
    else
        snprintf(err, errlen, "stopped");
drop:
    PQclear(res);
    PQfinish(c);
    *pg = NULL;
    return NULL;
}

int relay_pg_rows(PGresult *r, char *err, size_t errlen)
{
    if (r == NULL)
        return 0; /* relay_pg_exec said why */
    if (PQresultStatus(r) == PGRES_TUPLES_OK)
        return 1;
    one_line(err, errlen, PQresultErrorMessage(r));
    PQclear(r);
    return 0;
}

/* Migration files by the version they bring, to name the one to apply. */
static const char *const migration_files[RELAY_SCHEMA_VERSION + 1] = {
    NULL,
    "001_outbox_schema.sql",
    "002_enqueue_and_wakeup.sql",
    "003_roles.sql",
    "004_schema_version.sql",
    "005_backpressure.sql",
    "006_wakeup_when_idle.sql",
    "007_wakeup_lock.sql",
    "008_queue_vacuum.sql",
    "009_producer_grants.sql",
    "010_retention.sql",
    "011_partitions.sql",
    "012_partition_owners.sql",
    "013_pinned_plans.sql",
    "014_cached_finish.sql",
    "015_partition_total.sql",
    "016_batches.sql",
    "017_quarantine_tools.sql",
    "018_one_index_less.sql",
    "019_rotation.sql",
    "020_tick_bounds.sql",
    "021_inline_runs.sql",
    "022_no_topic_index.sql",
};

#ifndef RELAY_MIGRATIONS_DIR
#define RELAY_MIGRATIONS_DIR "/usr/local/share/outbox-relay/migrations"
#endif

/* Where the files are: the source tree's migrations/ or the installed copy. */
#define WHERE " (from migrations/ of the source, or " RELAY_MIGRATIONS_DIR " once installed)"

int relay_pg_schema_advice(int version, int missing, char *out, size_t outlen)
{
    if (missing <= 0 || missing > RELAY_SCHEMA_VERSION)
        return 0;
    if (missing == 1)
        snprintf(out, outlen,
                 "the outbox schema is missing in this database: apply every migration in name "
                 "order, starting with %s" WHERE,
                 migration_files[1]);
    else if (version < 4)
        snprintf(out, outlen,
                 "the outbox schema predates version 4 (it has no outbox.schema_version) and this "
                 "relay needs version %d: apply %s and the files after it in name order" WHERE,
                 RELAY_SCHEMA_VERSION, migration_files[missing]);
    else
        snprintf(out, outlen,
                 "the outbox schema is at version %d but this relay needs version %d, and version "
                 "%d is missing: apply %s and the files after it in name order" WHERE,
                 version, RELAY_SCHEMA_VERSION, missing, migration_files[missing]);
    return 1;
}

int relay_pg_schema_missing_advice(const char *err, char *out, size_t outlen)
{
    if (err == NULL)
        return 0;
    if (strstr(err, "outbox.messages") != NULL)
        return relay_pg_schema_advice(0, 1, out, outlen);
    if (strstr(err, "outbox.schema_version") != NULL)
        return relay_pg_schema_advice(0, 4, out, outlen);
    return 0;
}

int relay_pg_schema_check(struct pg_conn **pg, const struct relay_config *cfg, int stop_fd,
                          char *out, size_t outlen)
{
    PGresult *r = relay_pg_exec(pg, cfg, stop_fd,
                                "SELECT to_regclass('outbox.messages') IS NOT NULL,"
                                " to_regclass('outbox.schema_version') IS NOT NULL",
                                0, NULL, out, outlen);
    if (!relay_pg_rows(r, out, outlen))
        return -1;
    int messages = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    int versions = PQntuples(r) == 1 && strcmp(PQgetvalue(r, 0, 1), "t") == 0;
    PQclear(r);
    if (!messages)
        return relay_pg_schema_advice(0, 1, out, outlen);
    if (!versions)
        return relay_pg_schema_advice(0, 4, out, outlen);
    r = relay_pg_exec(pg, cfg, stop_fd,
                      "SELECT " RELAY_PG_SCHEMA_COLUMNS " FROM outbox.schema_version", 0, NULL, out,
                      outlen);
    if (!relay_pg_rows(r, out, outlen))
        return -1;
    int version = (int)strtol(PQgetvalue(r, 0, 0), NULL, 10);
    int missing = PQgetisnull(r, 0, 1) ? 0 : (int)strtol(PQgetvalue(r, 0, 1), NULL, 10);
    PQclear(r);
    return relay_pg_schema_advice(version, missing, out, outlen);
}
