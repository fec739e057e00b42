/*
 * outbox-email-consumer: the consumer pattern done right, as a small program.
 *
 * It reads the "orders" stream as group "email" with the consumer library and
 * "sends an email" per order by inserting a row into emails, in the same
 * PostgreSQL transaction as outbox_consumer.begin_message: a redelivered
 * message finds its processed row and does nothing. A payload that is not a
 * JSON order fails for good (it lands in the dead-letter stream at once); a
 * database that is down is a transient failure, retried with backoff.
 *
 * For demos and tests, a header "fail" on the message asks for a failure:
 * "permanent", "transient" (every delivery) or "transient:N" (the first N
 * deliveries); --fail-rate makes that share of first deliveries fail
 * transiently, like a flaky mail provider.
 *
 * It uses only what a service of its own would: <outbox/consumer.h>, libpq
 * and libc. The library prints nothing, so the program gives it a log hook
 * that writes one line per event to stderr, "<time> <LEVEL> consumer: <text>"
 * (or "<N>" priority prefixes when stderr is the journal).
 */
#ifndef _DEFAULT_SOURCE
#define _DEFAULT_SOURCE 1 /* random, strtok_r, gmtime_r */
#endif

#include <getopt.h>
#include <libpq-fe.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sysexits.h>
#include <time.h>
#include <unistd.h>

#include <outbox/consumer.h>

struct email_app {
    const char *conninfo;
    const char *group;
    PGconn *db;
    double fail_rate;
    uint32_t processed_horizon_ms; /* 0: never purge outbox_consumer.processed */
    time_t next_purge;
};

static struct outbox_consumer *the_consumer;

/* What the log hook prints: --log-level, and whether stderr is the journal. */
struct email_log {
    enum outbox_consumer_log_level min_level;
    int journal;
};

static const char *const level_names[] = {"DEBUG", "INFO", "WARNING", "ERROR"};

/* The library's log hook: one line per event on stderr. Under systemd the
 * journal stamps lines itself, so there a "<N>" priority replaces the time. */
static void log_line(enum outbox_consumer_log_level level, const char *message, void *arg)
{
    static const int syslog_priority[] = {7, 6, 4, 3}; /* debug info warning err */
    const struct email_log *lg = arg;
    if ((int)level < (int)lg->min_level || (int)level < 0 || (int)level > 3)
        return;
    if (lg->journal) {
        fprintf(stderr, "<%d>%s consumer: %s\n", syslog_priority[level], level_names[level],
                message);
    } else {
        char stamp[32] = "0000-00-00T00:00:00";
        struct timespec ts = {0, 0};
        struct tm tm;
        if (clock_gettime(CLOCK_REALTIME, &ts) == 0 && gmtime_r(&ts.tv_sec, &tm) != NULL)
            strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &tm);
        fprintf(stderr, "%s.%03ldZ %s consumer: %s\n", stamp, (long)(ts.tv_nsec / 1000000),
                level_names[level], message);
    }
    fflush(stderr);
}

/* "250ms", "5s", "2m", "1h", "7d" or a bare number of milliseconds; 0 or -1. */
static int parse_ms(const char *s, uint32_t *ms)
{
    static const struct {
        const char *unit;
        unsigned long long mult;
    } units[] = {{"", 1}, {"ms", 1}, {"s", 1000}, {"m", 60000}, {"h", 3600000}, {"d", 86400000}};
    char *end;
    if (s[0] < '0' || s[0] > '9')
        return -1;
    unsigned long long v = strtoull(s, &end, 10);
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++)
        if (strcmp(end, units[i].unit) == 0) {
            if (v > UINT32_MAX / units[i].mult)
                return -1;
            *ms = (uint32_t)(v * units[i].mult);
            return 0;
        }
    return -1;
}

static void on_signal(int sig)
{
    (void)sig;
    if (the_consumer != NULL)
        outbox_consumer_stop(the_consumer);
}

static int db_ready(struct email_app *app, char *err, size_t errlen)
{
    if (app->db != NULL && PQstatus(app->db) == CONNECTION_OK)
        return 0;
    if (app->db != NULL)
        PQfinish(app->db);
    const char *const keys[] = {"application_name", "connect_timeout", "options", "dbname", NULL};
    const char *const vals[] = {"outbox-email-consumer", "5", "-c statement_timeout=10000",
                                app->conninfo, NULL};
    app->db = PQconnectdbParams(keys, vals, 1);
    if (PQstatus(app->db) != CONNECTION_OK) {
        snprintf(err, errlen, "database unavailable: %s", PQerrorMessage(app->db));
        return -1;
    }
    return 0;
}

static const char *header(const struct outbox_message *m, const char *name)
{
    for (size_t i = 0; i < m->nheaders; i++)
        if (strcmp(m->header_names[i], name) == 0)
            return m->header_values[i];
    return NULL;
}

static enum outbox_handled fail_from_sql(struct email_app *app, PGresult *res, char *err,
                                         size_t errlen)
{
    char state[6] = "";
    const char *s = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    snprintf(state, sizeof(state), "%s", s != NULL ? s : ""); /* res is freed below */
    snprintf(err, errlen, "%s", PQresultErrorMessage(res));
    for (char *p = err; *p; p++)
        if (*p == '\n')
            *p = ' ';
    PQclear(res);
    PQclear(PQexec(app->db, "ROLLBACK"));
    /* Class 22 (data exception: not JSON, not a number) never gets better. */
    if (strncmp(state, "22", 2) == 0)
        return OUTBOX_HANDLED_FAIL;
    return OUTBOX_HANDLED_RETRY;
}

/* With --processed-horizon: deletes processed rows older than that, one
 * batch at most every few seconds, after a message's own transaction. A
 * failure is left for the next time. */
static void purge_processed(struct email_app *app)
{
    time_t now = time(NULL);
    if (app->processed_horizon_ms == 0 || now < app->next_purge)
        return;
    uint32_t every = app->processed_horizon_ms / 10000; /* a tenth of it, in s */
    app->next_purge = now + (every < 1 ? 1 : every > 60 ? 60 : every);
    char ms[16];
    snprintf(ms, sizeof(ms), "%u", app->processed_horizon_ms);
    const char *p[1] = {ms};
    PQclear(PQexecParams(app->db,
                         "SELECT outbox_consumer.purge_processed($1::bigint * interval '1 ms')", 1,
                         NULL, p, NULL, NULL, 0));
}

static enum outbox_handled send_email(const struct outbox_message *m, void *arg, char *err,
                                      size_t errlen)
{
    struct email_app *app = arg;
    const char *fail = header(m, "fail");
    if (fail != NULL && strcmp(fail, "permanent") == 0) {
        snprintf(err, errlen, "the message asked for a permanent failure");
        return OUTBOX_HANDLED_FAIL;
    }
    if (fail != NULL && strncmp(fail, "transient", 9) == 0) {
        long upto = fail[9] == ':' ? strtol(fail + 10, NULL, 10) : -1;
        if (upto < 0 || (long)m->deliveries <= upto) {
            snprintf(err, errlen, "the message asked for a transient failure");
            return OUTBOX_HANDLED_RETRY;
        }
    }
    if (app->fail_rate > 0 && m->deliveries == 1 && (double)random() / RAND_MAX < app->fail_rate) {
        snprintf(err, errlen, "mail provider timed out (simulated)");
        return OUTBOX_HANDLED_RETRY;
    }
    if (db_ready(app, err, errlen) < 0)
        return OUTBOX_HANDLED_RETRY;

    PGresult *res = PQexec(app->db, "BEGIN");
    if (PQresultStatus(res) != PGRES_COMMAND_OK)
        return fail_from_sql(app, res, err, errlen);
    PQclear(res);

    const char *p1[2] = {app->group, m->id};
    res = PQexecParams(app->db, "SELECT outbox_consumer.begin_message($1, $2::uuid)", 2, NULL, p1,
                       NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK)
        return fail_from_sql(app, res, err, errlen);
    int is_new = strcmp(PQgetvalue(res, 0, 0), "t") == 0;
    PQclear(res);

    if (is_new) {
        const char *p2[3] = {m->id, m->payload, app->group};
        int lens[3] = {0, (int)m->payload_len, 0};
        int formats[3] = {0, 1, 0};
        res = PQexecParams(app->db,
                           "INSERT INTO emails (message_id, order_id, customer, consumer)"
                           " SELECT $1::uuid, (p ->> 'order')::bigint, p ->> 'customer', $3"
                           " FROM (SELECT convert_from($2::bytea, 'UTF8')::jsonb AS p) AS s",
                           3, NULL, p2, lens, formats, 0);
        if (PQresultStatus(res) != PGRES_COMMAND_OK)
            return fail_from_sql(app, res, err, errlen);
        PQclear(res);
    }
    res = PQexec(app->db, "COMMIT");
    if (PQresultStatus(res) != PGRES_COMMAND_OK)
        return fail_from_sql(app, res, err, errlen);
    PQclear(res);
    purge_processed(app);
    return OUTBOX_HANDLED_DONE;
}

/* "1s,10s,100ms" into opts->backoff_ms. */
static int parse_backoff(const char *s, struct outbox_consumer_options *o)
{
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", s);
    o->nbackoff = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        uint32_t ms;
        if (o->nbackoff == OUTBOX_CONSUMER_BACKOFF_MAX || parse_ms(tok, &ms) < 0 || ms == 0)
            return -1;
        o->backoff_ms[o->nbackoff++] = ms;
    }
    return o->nbackoff > 0 ? 0 : -1;
}

static void usage(FILE *f)
{
    fprintf(f, "Usage: outbox-email-consumer --redis URL --postgres CONNINFO [options]\n"
               "  --stream NAME          stream to read (orders)\n"
               "  --group NAME           consumer group (email)\n"
               "  --consumer NAME        this consumer's name (host-pid)\n"
               "  --max-deliveries N     deliveries before dead-lettering (5)\n"
               "  --backoff LIST         delays between deliveries (1s,10s,100s,1000s)\n"
               "  --block DURATION       XREADGROUP BLOCK time (1s)\n"
               "  --fail-rate R          share of first deliveries that fail transiently (0)\n"
               "  --log-level LEVEL      debug, info, warning or error (info)\n"
               "  --processed-horizon DURATION\n"
               "                         purge processed rows older than this (0: never)\n"
               "  --allow-short-processed-horizon\n"
               "                         accept a horizon shorter than the redelivery horizon\n"
               "  --ordered PARTITIONS   the stream's topic has PARTITIONS partitions: share\n"
               "                         them with the group's other consumers and handle\n"
               "                         each key's messages in order\n"
               "  --lease DURATION       with --ordered, how long a silent consumer keeps its\n"
               "                         partitions (10s)\n"
               "  --park-after-dead-letter\n"
               "                         with --ordered, hold a key's later messages once one\n"
               "                         of its messages is dead-lettered\n");
}

/* What the command line sets. */
struct email_args {
    struct outbox_consumer_options o;
    struct email_app app;
    struct email_log lg;
    const char *redis;
};

static const struct option longopts[] = {
    {"redis", required_argument, NULL, 'r'},
    {"postgres", required_argument, NULL, 'p'},
    {"stream", required_argument, NULL, 's'},
    {"group", required_argument, NULL, 'g'},
    {"consumer", required_argument, NULL, 'c'},
    {"max-deliveries", required_argument, NULL, 'm'},
    {"backoff", required_argument, NULL, 'b'},
    {"block", required_argument, NULL, 'k'},
    {"fail-rate", required_argument, NULL, 'f'},
    {"log-level", required_argument, NULL, 'l'},
    {"processed-horizon", required_argument, NULL, 'P'},
    {"allow-short-processed-horizon", no_argument, NULL, 'A'},
    {"ordered", required_argument, NULL, 'O'},
    {"lease", required_argument, NULL, 'L'},
    {"park-after-dead-letter", no_argument, NULL, 'K'},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* Says what an option takes; the exit code of bad usage. */
static int bad(const char *what)
{
    fprintf(stderr, "outbox-email-consumer: %s\n", what);
    return EX_USAGE;
}

/* The options that take a number or a duration: 0, or an exit code. */
static int apply_value(int ch, const char *arg, struct email_args *a)
{
    char *end;
    uint32_t ms;
    switch (ch) {
    case 'm':
        a->o.max_deliveries = (uint32_t)strtoul(arg, &end, 10);
        if (*end != '\0' || a->o.max_deliveries == 0 || a->o.max_deliveries > 1000)
            return bad("--max-deliveries must be 1 to 1000");
        return 0;
    case 'b':
        if (parse_backoff(arg, &a->o) < 0)
            return bad("--backoff takes durations like 1s,10s,100s (at most 16, each at least "
                       "1ms)");
        return 0;
    case 'k':
        if (parse_ms(arg, &ms) < 0 || ms == 0)
            return bad("--block takes a duration like 1s");
        a->o.block_ms = ms;
        return 0;
    case 'f':
        a->app.fail_rate = strtod(arg, &end);
        if (*end != '\0' || a->app.fail_rate < 0 || a->app.fail_rate > 1)
            return bad("--fail-rate is between 0 and 1");
        return 0;
    case 'P':
        if (parse_ms(arg, &ms) < 0)
            return bad("--processed-horizon takes a duration like 7d");
        a->app.processed_horizon_ms = ms;
        a->o.processed_horizon_ms = ms;
        return 0;
    case 'O':
        a->o.partitions = (uint32_t)strtoul(arg, &end, 10);
        if (*end != '\0' || a->o.partitions < 2 || a->o.partitions > 1000)
            return bad("--ordered takes the topic's number of partitions, 2 to 1000 "
                       "(outbox.set_partitions)");
        return 0;
    case 'L':
        if (parse_ms(arg, &ms) < 0 || ms < 300 || ms > 600000)
            return bad("--lease takes a duration from 300ms to 10m");
        a->o.lease_ms = ms;
        return 0;
    default:
        usage(stderr);
        return EX_USAGE;
    }
}

/* One option: 0, or the exit code to leave with (--help: EX_OK). */
static int apply_option(int ch, const char *arg, struct email_args *a)
{
    int level = -1;
    switch (ch) {
    case 'r':
        a->redis = arg;
        return 0;
    case 'p':
        a->app.conninfo = arg;
        return 0;
    case 's':
        a->o.stream = arg;
        return 0;
    case 'g':
        a->app.group = arg;
        return 0;
    case 'c':
        a->o.consumer = arg;
        return 0;
    case 'l':
        for (int i = 0; i < 4; i++)
            if (strcasecmp(arg, level_names[i]) == 0)
                level = i;
        if (level < 0)
            return bad("--log-level is debug, info, warning or error");
        a->lg.min_level = (enum outbox_consumer_log_level)level;
        return 0;
    case 'A':
        a->o.allow_short_processed_horizon = 1;
        return 0;
    case 'K':
        a->o.park_keys = 1;
        return 0;
    case 'h':
        usage(stdout);
        return EX_OK;
    default:
        return apply_value(ch, arg, a);
    }
}

int main(int argc, char **argv)
{
    static struct email_args a;
    const char *js = getenv("JOURNAL_STREAM");
    a.app = (struct email_app){NULL, "email", NULL, 0.0, 0, 0};
    a.lg = (struct email_log){OUTBOX_CONSUMER_LOG_INFO, js != NULL && js[0] != '\0'};
    a.o.stream = "orders";
    a.o.log = log_line;
    a.o.log_arg = &a.lg;
    int ch;
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        int rc = apply_option(ch, optarg, &a);
        if (rc != 0 || ch == 'h')
            return rc;
    }
    if (a.redis == NULL || a.app.conninfo == NULL || optind != argc) {
        usage(stderr);
        return EX_USAGE;
    }
    a.o.group = a.app.group;
    a.o.redis_url = a.redis;
    char err[512];
    struct outbox_consumer *c = outbox_consumer_new(&a.o, send_email, &a.app, err, sizeof(err));
    if (c == NULL) {
        fprintf(stderr, "outbox-email-consumer: %s\n", err);
        return EX_CONFIG;
    }
    srandom((unsigned)time(NULL) ^ ((unsigned)getpid() << 16));
    signal(SIGPIPE, SIG_IGN);
    the_consumer = c;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    outbox_consumer_run(c);
    const struct outbox_consumer_stats *st = outbox_consumer_stats(c);
    printf("consumer %s: delivered=%llu done=%llu retried=%llu dead_lettered=%llu malformed=%llu "
           "lost=%llu reclaimed=%llu leases_taken=%llu leases_lost=%llu\n",
           outbox_consumer_name(c), st->delivered, st->done, st->retried, st->dead_lettered,
           st->malformed, st->lost, st->reclaimed, st->leases_taken, st->leases_lost);
    the_consumer = NULL;
    outbox_consumer_free(c);
    PQfinish(a.app.db);
    return EX_OK;
}
