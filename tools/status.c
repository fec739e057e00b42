/*
 * "outbox-relay status": the operator's view, for a human or (--json) a
 * script. It reads PostgreSQL and Redis itself (core/observe.c), so it works
 * whether or not a relay is running, and exits 69 (EX_UNAVAILABLE) naming the
 * server it could not reach.
 *
 * For humans, names and errors are shown in the escaped form of core/text.c;
 * for scripts, every name is exact, as JSON escapes, but for bytes that are
 * not UTF-8, which come out as U+FFFD.
 */
#include "common/compat.h"

#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "core/observe.h"
#include "core/text.h"
#include "tools/tools.h"

static void age_text(char *out, size_t outlen, double s)
{
    if (s < 0)
        snprintf(out, outlen, "-");
    else if (s < 60)
        snprintf(out, outlen, "%.1fs", s);
    else if (s < 3600)
        snprintf(out, outlen, "%dm%02ds", (int)s / 60, (int)s % 60);
    else
        snprintf(out, outlen, "%dh%02dm", (int)s / 3600, ((int)s % 3600) / 60);
}

/* Text from the servers or from Redis keys, for a terminal (core/text.c):
 * escaped, cut to maxcols columns (0: not cut) and padded to width. */
static void put_shown(struct relay_text_out *b, const char *s, size_t width, size_t maxcols)
{
    char shown[RELAY_ESCAPED_SIZE(512)];
    size_t cols = relay_text_escape(shown, sizeof(shown), s, strlen(s), maxcols, 0);
    relay_text_out_printf(b, "%s%*s", shown, cols < width ? (int)(width - cols) : 0, "");
}

/* The ADMIT column: producer admission of the stream's topic. */
static const char *admit_text(const struct relay_topic_obs *t)
{
    if (t == NULL || t->admitting < 0)
        return "-";
    return t->admitting ? "yes" : "NO";
}

static void status_text(const struct relay_observation *o, char *outbuf, size_t outlen)
{
    struct relay_text_out b;
    char a1[32], a2[32];
    relay_text_out_init(&b, outbuf, outlen);
    relay_text_out_printf(&b, "PostgreSQL  %s\n",
                          o->pg_ok              ? "up"
                          : o->pg_schema_behind ? "up, but its outbox schema is behind"
                                                : "DOWN");
    if (!o->pg_ok) {
        relay_text_out_printf(&b, "            ");
        put_shown(&b, o->pg_error, 0, 0);
        relay_text_out_printf(&b, "\n");
    }
    relay_text_out_printf(&b, "Redis       %s", o->redis_ok ? "up" : "DOWN");
    if (o->redis_ok) {
        relay_text_out_printf(&b, " (");
        put_shown(&b, o->durability, 0, 0);
        relay_text_out_printf(&b, ")");
    }
    relay_text_out_printf(&b, "\n");
    if (!o->redis_ok) {
        relay_text_out_printf(&b, "            ");
        put_shown(&b, o->redis_error, 0, 0);
        relay_text_out_printf(&b, "\n");
    }
    if (o->pg_ok) {
        age_text(a1, sizeof(a1), o->outbox_oldest_age);
        relay_text_out_printf(&b, "Outbox      ~%lld pending, oldest %s, %lld quarantined\n",
                              o->outbox_pending, a1, o->quarantined);
        if (o->partitions > 0 || o->relays > 1)
            relay_text_out_printf(&b, "Relays      %lld running; %lld of %lld partitions owned\n",
                                  o->relays, o->partitions_owned, o->partitions);
        if (o->blocked_keys > 0)
            relay_text_out_printf(&b,
                                  "Keys        %lld held back behind a quarantined or retrying row"
                                  " (outbox-relay failed list)\n",
                                  o->blocked_keys);
        if (o->admission_topics > 0)
            relay_text_out_printf(&b, "Admission   %lld topics with limits, %lld refused\n",
                                  o->admission_topics, o->admission_refused);
    }
    if (o->ngroups == 0 && o->ntopics == 0) {
        relay_text_out_printf(&b, "\nNo streams yet.\n");
        return;
    }
    relay_text_out_printf(&b, "\n%-24s %-16s %10s %8s %8s %10s %12s %6s\n", "STREAM", "GROUP",
                          "QUEUE AGE", "LAG", "PENDING", "DEAD", "OUTBOX WAIT", "ADMIT");
    for (size_t i = 0; i < o->ngroups; i++) {
        const struct relay_group_obs *g = &o->groups[i];
        const struct relay_topic_obs *t = g->topic >= 0 ? &o->topics[g->topic] : NULL;
        age_text(a1, sizeof(a1), g->queue_age);
        char lag[24];
        if (g->lag < 0)
            snprintf(lag, sizeof(lag), "?");
        else
            snprintf(lag, sizeof(lag), "%lld", g->lag);
        if (t != NULL)
            snprintf(a2, sizeof(a2), "%lld", t->pending);
        else
            snprintf(a2, sizeof(a2), "-");
        /* Stream and group names may be any bytes (XGROUP CREATE takes any). */
        put_shown(&b, g->stream, 24, 24);
        relay_text_out_printf(&b, " ");
        put_shown(&b, g->group, 16, 16);
        relay_text_out_printf(&b, " %10s %8s %8lld %10lld %12s %6s\n", a1, lag, g->pending,
                              g->dead_letters, a2, admit_text(t));
    }
    /* Every stream of the relay's topics, as --json lists them: a new topic,
     * or the partition streams of a newly partitioned one, before anyone
     * reads them. */
    for (size_t ti = 0; ti < o->ntopics; ti++) {
        const struct relay_topic_obs *t = &o->topics[ti];
        size_t i = 0;
        while (i < o->ngroups && o->groups[i].topic != (int)ti)
            i++;
        if (i < o->ngroups)
            continue;
        age_text(a1, sizeof(a1), t->oldest_pending_age);
        snprintf(a2, sizeof(a2), "%lld", t->pending);
        put_shown(&b, t->stream, 24, 24);
        relay_text_out_printf(&b, " %-16s %10s %8s %8s %10s %12s %6s\n", "(no groups)", a1, "-",
                              "-", "-", a2, admit_text(t));
    }
}

/*
 * A JSON string with s exactly: the controls of relay_text_control_char as
 * \u escapes (so the output cannot act on a terminal either), other UTF-8 as
 * it is. JSON text is UTF-8 (RFC 8259), so a byte that is not part of valid
 * UTF-8, which no JSON string can carry, is U+FFFD.
 */
static void json_string(struct relay_text_out *b, const char *s)
{
    size_t len = strlen(s);
    relay_text_out_printf(b, "\"");
    for (size_t i = 0; i < len;) {
        unsigned long cp;
        size_t n = relay_text_utf8_char(s + i, len - i, &cp);
        if (n == 0) {
            relay_text_out_printf(b, "\\ufffd");
            n = 1;
        } else if (cp == '"' || cp == '\\') {
            relay_text_out_printf(b, "\\%c", (char)cp);
        } else if (relay_text_control_char(cp)) {
            relay_text_out_printf(b, "\\u%04lx", cp);
        } else {
            relay_text_out_printf(b, "%.*s", (int)n, s + i);
        }
        i += n;
    }
    relay_text_out_printf(b, "\"");
}

/* before, then "name":seconds, or null when there is none (a negative age). */
static void json_age(struct relay_text_out *b, const char *before, const char *name, double s)
{
    if (s < 0)
        relay_text_out_printf(b, "%s\"%s\":null", before, name);
    else
        relay_text_out_printf(b, "%s\"%s\":%.3f", before, name, s);
}

/* before, then "name":n, or null when n is not known (its server did not answer). */
static void json_count(struct relay_text_out *b, const char *before, const char *name, int known,
                       long long n)
{
    if (!known)
        relay_text_out_printf(b, "%s\"%s\":null", before, name);
    else
        relay_text_out_printf(b, "%s\"%s\":%lld", before, name, n);
}

/*
 * The document docs/OPERATIONS.md ("status --json") describes field by
 * field. null means none (no row or entry waits: an age) or not known (the
 * server it comes from did not answer, or Redis cannot tell the lag); a
 * script never has to tell a sentinel number from a real one.
 */
static void status_json(const struct relay_observation *o, char *outbuf, size_t outlen)
{
    struct relay_text_out b;
    int pg = o->pg_ok;
    relay_text_out_init(&b, outbuf, outlen);
    relay_text_out_printf(&b, "{\"taken_at\":%.3f,\"postgres\":{\"up\":%s,\"error\":", o->taken_at,
                          o->pg_ok ? "true" : "false");
    json_string(&b, o->pg_ok ? "" : o->pg_error);
    relay_text_out_printf(&b,
                          "},\"redis\":{\"up\":%s,\"durability\":", o->redis_ok ? "true" : "false");
    json_string(&b, o->durability);
    relay_text_out_printf(&b, ",\"error\":");
    json_string(&b, o->redis_ok ? "" : o->redis_error);
    json_count(&b, "},\"outbox\":{", "pending_estimate", pg, o->outbox_pending);
    json_age(&b, ",", "oldest_pending_age_seconds", pg ? o->outbox_oldest_age : -1);
    json_count(&b, ",", "quarantined", pg, o->quarantined);
    json_count(&b, ",", "blocked_keys", pg, o->blocked_keys);
    json_count(&b, "},\"relays\":{", "running", pg, o->relays);
    json_count(&b, ",", "partitions", pg, o->partitions);
    json_count(&b, ",", "partitions_owned", pg, o->partitions_owned);
    json_count(&b, "},\"admission\":{", "topics", pg, o->admission_topics);
    json_count(&b, ",", "refused", pg, o->admission_refused);
    relay_text_out_printf(&b, "},\"topics\":[");
    for (size_t i = 0; i < o->ntopics; i++) {
        const struct relay_topic_obs *t = &o->topics[i];
        relay_text_out_printf(&b, "%s{\"topic\":", i ? "," : "");
        json_string(&b, t->topic);
        relay_text_out_printf(&b, ",\"stream\":");
        json_string(&b, t->stream);
        if (t->partition >= 0)
            relay_text_out_printf(&b, ",\"partition\":%d", t->partition);
        else
            relay_text_out_printf(&b, ",\"partition\":null");
        json_count(&b, ",", "outbox_pending", pg, t->pending);
        json_age(&b, ",", "outbox_oldest_age_seconds", pg ? t->oldest_pending_age : -1);
        relay_text_out_printf(&b, ",\"admitting\":%s}",
                              t->admitting < 0 ? "null"
                              : t->admitting   ? "true"
                                               : "false");
    }
    relay_text_out_printf(&b, "],\"groups\":[");
    for (size_t i = 0; i < o->ngroups; i++) {
        const struct relay_group_obs *g = &o->groups[i];
        relay_text_out_printf(&b, "%s{\"stream\":", i ? "," : "");
        json_string(&b, g->stream);
        relay_text_out_printf(&b, ",\"group\":");
        json_string(&b, g->group);
        relay_text_out_printf(&b, ",\"consumers\":%lld", g->consumers);
        json_count(&b, ",", "lag", g->lag >= 0, g->lag); /* Redis may not tell */
        relay_text_out_printf(&b, ",\"pending\":%lld,\"dead_letters\":%lld", g->pending,
                              g->dead_letters);
        json_age(&b, ",", "oldest_pending_age_seconds", g->oldest_pending_age);
        json_age(&b, ",", "oldest_undelivered_age_seconds", g->oldest_undelivered_age);
        relay_text_out_printf(&b, ",\"queue_age_seconds\":%.3f}", g->queue_age);
    }
    relay_text_out_printf(&b, "]}\n");
}

/* "status [--json]": 0 with *json set, or -1 after saying why. */
static void status_usage(FILE *f)
{
    fprintf(f, "Usage: outbox-relay [-c FILE] status [--json]\n"
               "PostgreSQL, Redis, the outbox's backlog and each stream's consumer groups, as\n"
               "text or (--json) one JSON object. Exits 0, or 69 when PostgreSQL or Redis\n"
               "cannot be read.\n");
}

OUTBOX_STATIC int parse_status_args(int argc, char **argv, FILE *errout, int *json);
OUTBOX_STATIC int parse_status_args(int argc, char **argv, FILE *errout, int *json)
{
    *json = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            *json = 1;
        } else {
            relay_tool_unknown(errout, "status", argv[i]);
            status_usage(errout);
            return -1;
        }
    }
    return 0;
}

int relay_tool_status(const struct relay_config *cfg, int argc, char **argv, FILE *out,
                      FILE *errout)
{
    int json;
    if (argc >= 2 && relay_tool_is_help(argv[1])) {
        status_usage(out);
        return OUTBOX_EX_OK;
    }
    if (parse_status_args(argc, argv, errout, &json) < 0)
        return OUTBOX_EX_USAGE;
    if (cfg == NULL)
        return OUTBOX_EX_OK; /* its arguments only */
    struct relay_observation *o = malloc(sizeof(*o));
    char *text = malloc(256 * 1024);
    if (o == NULL || text == NULL) {
        free(o);
        free(text);
        return OUTBOX_EX_OSERR;
    }
    PGconn *pg = NULL;
    redisContext *rd = NULL;
    int rc = relay_observe(cfg, &pg, &rd, 0, NULL, NULL, o);
    if (json)
        status_json(o, text, 256 * 1024);
    else
        status_text(o, text, 256 * 1024);
    fputs(text, out);
    if (rc < 0) {
        if (!o->pg_ok)
            fprintf(errout, "outbox-relay: PostgreSQL unreachable or failing: %s\n", o->pg_error);
        if (!o->redis_ok)
            fprintf(errout, "outbox-relay: Redis unreachable or failing: %s\n", o->redis_error);
    }
    PQfinish(pg);
    if (rd != NULL)
        redisFree(rd);
    free(o);
    free(text);
    return rc < 0 ? OUTBOX_EX_UNAVAILABLE : OUTBOX_EX_OK;
}
