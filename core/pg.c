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

#include "common/wait.h"
#include "core/config.h"

static void one_line(char *dst, size_t dstlen, const char *src)
{
    snprintf(dst, dstlen, "%s", src != NULL ? src : "unknown error");
    for (char *p = dst; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
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
    /* Our defaults come first so the user's conninfo (expanded in place of
     * dbname) overrides them; client_encoding comes after it, so that text is
     * read in UTF-8 whatever the database's encoding (relay/pgsrc.c). */
    const char *const keys[] = {"application_name",
                                "connect_timeout",
                                "keepalives",
                                "keepalives_idle",
                                "keepalives_interval",
                                "keepalives_count",
                                "tcp_user_timeout",
                                "options",
                                "dbname",
                                "client_encoding",
                                NULL};
    const char *const vals[] = {application_name,
                                timeout,
                                "1",
                                PG_KEEPALIVES_IDLE,
                                PG_KEEPALIVES_INTERVAL,
                                PG_KEEPALIVES_COUNT,
                                PG_TCP_USER_TIMEOUT,
                                options,
                                cfg->postgres,
                                "UTF8",
                                NULL};
    PGconn *c = PQconnectStartParams(keys, vals, 1);
    if (c == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    double deadline = outbox_mono_now() + cfg->connect_timeout_ms / 1000.0;
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
