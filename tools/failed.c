/*
 * "outbox-relay failed": what operators do with quarantined rows.
 *
 * A row that cannot be published for a reason of its own carries failed_at and
 * its last error once the relay gave up on it (at once for a permanent failure
 * such as a bad topic or an oversized payload, after max_attempts for a
 * transient one, WRONGTYPE on its stream key), and the relay's claims skip it.
 * "failed list" shows those rows (and how many others are still being
 * retried); "failed retry" puts them back in line with a clean attempt count,
 * and wakes the relay with a notification; "failed drop" gives them up: they
 * are marked sent without being published (failed_at stays, so the row still
 * says what happened until retention deletes it), and in a partitioned topic
 * the later rows of their keys go on.
 */
#include "common/compat.h"

#include "core/text.h"
#include "tools/tools.h"

#include <errno.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "core/config.h"
#include "core/pg.h"

/* Columns of a topic in "failed list", at most. */
#define FAILED_TOPIC_COLS 40

static PGconn *connect_db(const struct relay_config *cfg, FILE *errout)
{
    char err[512];
    PGconn *conn = relay_pg_open(cfg, "outbox-relay failed", -1, err, sizeof(err));
    if (conn == NULL)
        fprintf(errout, "outbox-relay: cannot connect to PostgreSQL: %s\n", err);
    return conn;
}

OUTBOX_STATIC int parse_id(const char *s, long long *out);
OUTBOX_STATIC int parse_id(const char *s, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v <= 0)
        return -1;
    *out = v;
    return 0;
}

static int failed_list(PGconn *conn, long long limit, FILE *out, FILE *errout)
{
    char lim[24];
    snprintf(lim, sizeof(lim), "%lld", limit);
    const char *params[1] = {lim};
    PGresult *res =
        PQexecParams(conn,
                     "SELECT id, message_id, topic, attempts,"
                     " to_char(failed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),"
                     " coalesce(last_error, '')"
                     " FROM outbox.messages WHERE failed_at IS NOT NULL AND sent_at IS NULL"
                     " ORDER BY id LIMIT $1",
                     1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        fprintf(errout, "outbox-relay: cannot list failed rows: %s", PQresultErrorMessage(res));
        PQclear(res);
        return OUTBOX_EX_UNAVAILABLE;
    }
    int n = PQntuples(res);
    if (n == 0) {
        fprintf(out, "no quarantined rows\n");
    } else {
        fprintf(out, "%-10s %-36s %-20s %-8s %-20s %s\n", "ID", "MESSAGE_ID", "TOPIC", "ATTEMPTS",
                "FAILED_AT", "LAST_ERROR");
        /* The topic and the error come from producers: escaped, one row a line. */
        for (int i = 0; i < n; i++) {
            fprintf(out, "%-10s %-36s ", PQgetvalue(res, i, 0), PQgetvalue(res, i, 1));
            relay_text_put_column(out, PQgetvalue(res, i, 2), (size_t)PQgetlength(res, i, 2), 20,
                                  FAILED_TOPIC_COLS);
            fprintf(out, "%-8s %-20s ", PQgetvalue(res, i, 3), PQgetvalue(res, i, 4));
            relay_text_put_escaped(out, PQgetvalue(res, i, 5), (size_t)PQgetlength(res, i, 5), 0,
                                   0);
            fputc('\n', out);
        }
    }
    PQclear(res);

    res = PQexec(conn, "SELECT count(*) FILTER (WHERE failed_at IS NOT NULL),"
                       " count(*) FILTER (WHERE failed_at IS NULL AND attempts > 0)"
                       " FROM outbox.messages WHERE sent_at IS NULL AND"
                       " (failed_at IS NOT NULL OR attempts > 0)");
    if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1) {
        fprintf(out, "%s quarantined", PQgetvalue(res, 0, 0));
        if ((long long)n < strtoll(PQgetvalue(res, 0, 0), NULL, 10))
            fprintf(out, " (showing %d; use --limit)", n);
        fprintf(out, ", %s still being retried by the relay\n", PQgetvalue(res, 0, 1));
    }
    PQclear(res);
    return OUTBOX_EX_OK;
}

/* '{1,2,3}' from the ids, each checked to be one (the caller frees), or NULL
 * with *rc set. */
OUTBOX_STATIC char *id_array(int nids, char **ids, FILE *errout, int *rc);
OUTBOX_STATIC char *id_array(int nids, char **ids, FILE *errout, int *rc)
{
    size_t cap = (size_t)nids * 24 + 3;
    char *arr = malloc(cap);
    if (arr == NULL) {
        *rc = OUTBOX_EX_OSERR;
        return NULL;
    }
    size_t len = 0;
    arr[len++] = '{';
    for (int i = 0; i < nids; i++) {
        long long id;
        if (parse_id(ids[i], &id) < 0) {
            fprintf(errout,
                    "outbox-relay: \"%s\" is not a row id (a positive integer from "
                    "'outbox-relay failed list')\n",
                    ids[i]);
            free(arr);
            *rc = OUTBOX_EX_USAGE;
            return NULL;
        }
        len += (size_t)snprintf(arr + len, cap - len, "%s%lld", i ? "," : "", id);
    }
    arr[len++] = '}';
    arr[len] = '\0';
    return arr;
}

/*
 * Sets `set` (an SQL SET list of the file's own) on the quarantined rows,
 * every one with all, else those of ids; wakes the relay; prints how many
 * rows changed ("<done> N row(s)<tail>") and, as an error, the ids that were
 * not quarantined.
 */
static int change_quarantined(PGconn *conn, const char *set, int all, int nids, char **ids,
                              const char *what, const char *done, const char *tail, FILE *out,
                              FILE *errout)
{
    int rc = OUTBOX_EX_OK;
    char *arr = id_array(nids, ids, errout, &rc);
    if (arr == NULL)
        return rc;
    char sql[1024];
    snprintf(
        sql, sizeof(sql),
        "WITH changed AS ("
        " UPDATE outbox.messages SET %s"
        " WHERE failed_at IS NOT NULL AND sent_at IS NULL AND ($1::boolean OR id = "
        "ANY($2::bigint[]))"
        " RETURNING id)"
        " SELECT (SELECT count(*) FROM changed),"
        "  ARRAY(SELECT x FROM unnest($2::bigint[]) AS x WHERE x NOT IN (SELECT id FROM changed)"
        "   ORDER BY x)::text,"
        "  pg_notify('outbox_relay', '')",
        set);
    const char *params[2] = {all ? "t" : "f", arr};
    PGresult *res = PQexecParams(conn, sql, 2, NULL, params, NULL, NULL, 0);
    free(arr);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        fprintf(errout, "outbox-relay: cannot %s rows: %s", what, PQresultErrorMessage(res));
        PQclear(res);
        return OUTBOX_EX_UNAVAILABLE;
    }
    fprintf(out, "%s %s row(s)%s\n", done, PQgetvalue(res, 0, 0), tail);
    if (!all && strcmp(PQgetvalue(res, 0, 1), "{}") != 0) {
        fprintf(errout,
                "outbox-relay: not quarantined (unknown, already sent or still retrying): %s\n",
                PQgetvalue(res, 0, 1));
        rc = OUTBOX_EX_DATAERR;
    }
    PQclear(res);
    return rc;
}

/* Back in line with a clean attempt count. */
static int failed_retry(PGconn *conn, int all, int nids, char **ids, FILE *out, FILE *errout)
{
    return change_quarantined(conn,
                              "failed_at = NULL, attempts = 0, retry_at = NULL, last_error = NULL",
                              all, nids, ids, "re-queue", "re-queued", "", out, errout);
}

/* Given up: marked sent, never published; failed_at stays. */
static int failed_drop(PGconn *conn, int nids, char **ids, FILE *out, FILE *errout)
{
    return change_quarantined(
        conn,
        "sent_at = statement_timestamp(), retry_at = NULL, last_error = left('dropped by an "
        "operator (outbox-relay failed drop); it failed with: ' || coalesce(last_error, ''), "
        "4000)",
        0, nids, ids, "drop", "dropped", ": never published; the rows behind them go on", out,
        errout);
}

static void failed_usage(FILE *f)
{
    fprintf(f, "Usage: outbox-relay [-c FILE] failed list [--limit N]\n"
               "       outbox-relay [-c FILE] failed retry ID... | --all\n"
               "       outbox-relay [-c FILE] failed drop ID...\n");
}

int relay_tool_failed(const struct relay_config *cfg, int argc, char **argv, FILE *out,
                      FILE *errout)
{
    if (argc < 2) {
        failed_usage(errout);
        return OUTBOX_EX_USAGE;
    }
    if (relay_tool_is_help(argv[1])) {
        failed_usage(out);
        return OUTBOX_EX_OK;
    }
    const char *verb = argv[1];
    long long limit = 100;
    int all = 0;
    if (strcmp(verb, "list") == 0) {
        for (int i = 2; i < argc; i++) {
            if (strcmp(argv[i], "--limit") == 0 && i + 1 < argc &&
                parse_id(argv[i + 1], &limit) == 0) {
                i++;
                continue;
            }
            fprintf(errout, "outbox-relay: failed list: unexpected \"%s\"\n", argv[i]);
            failed_usage(errout);
            return OUTBOX_EX_USAGE;
        }
    } else if (strcmp(verb, "retry") == 0) {
        if (argc == 3 && strcmp(argv[2], "--all") == 0) {
            all = 1;
        } else if (argc < 3) {
            fprintf(errout, "outbox-relay: failed retry needs row ids or --all\n");
            failed_usage(errout);
            return OUTBOX_EX_USAGE;
        }
    } else if (strcmp(verb, "drop") == 0) {
        if (argc < 3) {
            fprintf(errout, "outbox-relay: failed drop needs row ids\n");
            failed_usage(errout);
            return OUTBOX_EX_USAGE;
        }
    } else {
        relay_tool_unknown(errout, "failed", verb);
        failed_usage(errout);
        return OUTBOX_EX_USAGE;
    }
    int rc = OUTBOX_EX_OK;
    if (!all && strcmp(verb, "list") != 0) {
        char *ids = id_array(argc - 2, argv + 2, errout, &rc);
        if (ids == NULL)
            return rc;
        free(ids);
    }
    if (cfg == NULL) /* the arguments only (relay_tool_check_usage) */
        return OUTBOX_EX_OK;

    PGconn *conn = connect_db(cfg, errout);
    if (conn == NULL)
        return OUTBOX_EX_UNAVAILABLE;
    rc = strcmp(verb, "list") == 0 ? failed_list(conn, limit, out, errout)
         : strcmp(verb, "drop") == 0
             ? failed_drop(conn, argc - 2, argv + 2, out, errout)
             : failed_retry(conn, all, all ? 0 : argc - 2, argv + 2, out, errout);
    PQfinish(conn);
    return rc;
}
