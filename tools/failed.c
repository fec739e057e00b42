/*
 * "outbox-relay failed": what operators do with quarantined rows.
 *
 * A row that can never be published (a bad topic, an oversized payload, a
 * stream key that holds another type, or a later row of a partitioned key
 * held behind such a row) is copied by the relay into outbox.quarantine with
 * why, and its stream goes on past it. "failed list" shows those rows;
 * "failed retry" writes them again as new rows (same message_id, topic, key,
 * payload and headers, in their id order, in one transaction) which a later
 * batch publishes, and takes them out of the quarantine; "failed drop" gives
 * them up. In a partitioned topic the later quarantined rows of a key go
 * with the row named: retried with it, or retried when it is dropped, so the
 * key keeps its order (migrations/017_quarantine_tools.sql).
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

/* Columns of a topic and of a key in "failed list", at most. */
#define FAILED_TOPIC_COLS 40
#define FAILED_KEY_COLS 24

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
    PGresult *res = PQexecParams(conn,
                                 "SELECT id, message_id, topic, coalesce(partition_key, '-'),"
                                 " to_char(quarantined_at AT TIME ZONE 'UTC',"
                                 " 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), error"
                                 " FROM outbox.quarantine ORDER BY id LIMIT $1",
                                 1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        fprintf(errout, "outbox-relay: cannot list quarantined rows: %s",
                PQresultErrorMessage(res));
        PQclear(res);
        return OUTBOX_EX_UNAVAILABLE;
    }
    int n = PQntuples(res);
    if (n == 0) {
        fprintf(out, "no quarantined rows\n");
    } else {
        fprintf(out, "%-10s %-36s %-20s %-12s %-20s %s\n", "ID", "MESSAGE_ID", "TOPIC", "KEY",
                "QUARANTINED_AT", "ERROR");
        /* The topic, the key and the error come from producers: escaped, one
         * row a line. */
        for (int i = 0; i < n; i++) {
            fprintf(out, "%-10s %-36s ", PQgetvalue(res, i, 0), PQgetvalue(res, i, 1));
            relay_text_put_column(out, PQgetvalue(res, i, 2), (size_t)PQgetlength(res, i, 2), 20,
                                  FAILED_TOPIC_COLS);
            relay_text_put_column(out, PQgetvalue(res, i, 3), (size_t)PQgetlength(res, i, 3), 12,
                                  FAILED_KEY_COLS);
            fprintf(out, "%-20s ", PQgetvalue(res, i, 4));
            relay_text_put_escaped(out, PQgetvalue(res, i, 5), (size_t)PQgetlength(res, i, 5), 0,
                                   0);
            fputc('\n', out);
        }
    }
    PQclear(res);

    res = PQexec(conn, "SELECT count(*) FROM outbox.quarantine");
    if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1) {
        fprintf(out, "%s quarantined", PQgetvalue(res, 0, 0));
        if ((long long)n < strtoll(PQgetvalue(res, 0, 0), NULL, 10))
            fprintf(out, " (showing %d; use --limit)", n);
        fputc('\n', out);
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

/* Prints, as an error, the ids named that were not quarantined ('{...}' from
 * the statement), and returns the exit code. */
static int report_missing(const char *missing, FILE *errout)
{
    if (missing == NULL || strcmp(missing, "{}") == 0 || missing[0] == '\0')
        return OUTBOX_EX_OK;
    fprintf(errout,
            "outbox-relay: not quarantined (unknown, already retried or dropped, or never "
            "quarantined): %s\n",
            missing);
    return OUTBOX_EX_DATAERR;
}

/* Written again as new rows, which a later batch publishes; out of the
 * quarantine. One statement, one transaction. */
static int failed_retry(PGconn *conn, int all, int nids, char **ids, FILE *out, FILE *errout)
{
    int rc = OUTBOX_EX_OK;
    char *arr = id_array(nids, ids, errout, &rc);
    if (arr == NULL)
        return rc;
    const char *params[2] = {all ? "t" : "f", arr};
    PGresult *res = PQexecParams(conn,
                                 "SELECT retried, missing::text"
                                 " FROM outbox.quarantine_retry($1::boolean, $2::bigint[])",
                                 2, NULL, params, NULL, NULL, 0);
    free(arr);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        fprintf(errout, "outbox-relay: cannot retry rows: %s", PQresultErrorMessage(res));
        PQclear(res);
        return OUTBOX_EX_UNAVAILABLE;
    }
    fprintf(out, "re-queued %s row(s): written again as new rows, published by a later batch\n",
            PQgetvalue(res, 0, 0));
    rc = all ? OUTBOX_EX_OK : report_missing(PQgetvalue(res, 0, 1), errout);
    PQclear(res);
    return rc;
}

/* Given up: out of the quarantine and the outbox, never published; in a
 * partitioned topic the rows of the key held behind them go on. */
static int failed_drop(PGconn *conn, int nids, char **ids, FILE *out, FILE *errout)
{
    int rc = OUTBOX_EX_OK;
    char *arr = id_array(nids, ids, errout, &rc);
    if (arr == NULL)
        return rc;
    const char *params[1] = {arr};
    PGresult *res = PQexecParams(conn,
                                 "SELECT dropped, released, missing::text"
                                 " FROM outbox.quarantine_drop($1::bigint[])",
                                 1, NULL, params, NULL, NULL, 0);
    free(arr);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        fprintf(errout, "outbox-relay: cannot drop rows: %s", PQresultErrorMessage(res));
        PQclear(res);
        return OUTBOX_EX_UNAVAILABLE;
    }
    fprintf(out, "dropped %s row(s): never published; the rows behind them go on",
            PQgetvalue(res, 0, 0));
    if (strcmp(PQgetvalue(res, 0, 1), "0") != 0)
        fprintf(out, " (%s row(s) of their keys written again)", PQgetvalue(res, 0, 1));
    fputc('\n', out);
    rc = report_missing(PQgetvalue(res, 0, 2), errout);
    PQclear(res);
    return rc;
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
