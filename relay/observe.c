/*
 * Observation of the outbox and the streams (include/relay/observe.h).
 *
 * Every read is bounded: the outbox figures come from the two ends of the
 * pending indexes (never a count of pending rows), the per-topic figures from
 * the (topic, id) pending index, and the Redis figures from XINFO GROUPS,
 * the XPENDING summary and single-entry XRANGEs. The cost does not grow with
 * the backlog. The blocking calls have deadlines: libpq's connect_timeout
 * and statement_timeout, and hiredis socket timeouts.
 */
#include "relay/compat.h"

#include "relay/observe.h"

#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#include "relay/batch.h"
#include "relay/config.h"
#include "relay/tools.h"

double relay_observe_parse_time(const char *s)
{
    struct tm tm;
    int us = 0, n = 0;
    memset(&tm, 0, sizeof(tm));
    if (s == NULL || sscanf(s, "%4d-%2d-%2dT%2d:%2d:%2d%n", &tm.tm_year, &tm.tm_mon, &tm.tm_mday,
                            &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &n) != 6)
        return -1;
    const char *p = s + n;
    if (*p == '.') {
        int digits = 0;
        for (p++; *p >= '0' && *p <= '9'; p++, digits++)
            if (digits < 6)
                us = us * 10 + (*p - '0');
        for (; digits < 6; digits++)
            us *= 10;
    }
    if (*p != 'Z')
        return -1;
    tm.tm_year -= 1900;
    tm.tm_mon -= 1;
    time_t t = timegm(&tm);
    return (double)t + us / 1e6;
}

static double now_unix(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void one_line(char *dst, size_t dstlen, const char *src)
{
    snprintf(dst, dstlen, "%s", src ? src : "unknown error");
    for (char *p = dst; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
}

/* ---- PostgreSQL ------------------------------------------------------ */

static PGconn *pg_open(const struct relay_config *cfg, char *err, size_t errlen)
{
    char timeout[16], options[96];
    snprintf(timeout, sizeof(timeout), "%u", (cfg->connect_timeout_ms + 999) / 1000);
    snprintf(options, sizeof(options), "-c statement_timeout=%u", cfg->statement_timeout_ms);
    const char *const keys[] = {"application_name", "connect_timeout", "options", "dbname", NULL};
    const char *const vals[] = {"outbox-relay observe", timeout, options, cfg->postgres, NULL};
    PGconn *c = PQconnectdbParams(keys, vals, 1);
    if (PQstatus(c) != CONNECTION_OK) {
        one_line(err, errlen, PQerrorMessage(c));
        PQfinish(c);
        return NULL;
    }
    return c;
}

static const char outbox_sql[] =
    "SELECT (SELECT max(id) - min(id) + 1 FROM (SELECT id FROM outbox.messages"
    "   WHERE sent_at IS NULL AND failed_at IS NULL ORDER BY id LIMIT 1) a"
    "   FULL JOIN (SELECT id FROM outbox.messages WHERE sent_at IS NULL AND failed_at IS NULL"
    "   ORDER BY id DESC LIMIT 1) b USING (id)),"
    " (SELECT extract(epoch FROM clock_timestamp() - created_at) FROM outbox.messages"
    "   WHERE sent_at IS NULL AND failed_at IS NULL ORDER BY id LIMIT 1),"
    " (SELECT count(*) FROM outbox.messages WHERE failed_at IS NOT NULL AND sent_at IS NULL)";

/* Per topic, from the (topic, id) pending index: the span of pending ids and
 * the age of the oldest; with $2, also the admission verdict. */
static const char topics_sql[] =
    "SELECT t,"
    " (SELECT max(id) - min(id) + 1 FROM ("
    "   (SELECT id FROM outbox.messages WHERE topic = t AND sent_at IS NULL AND failed_at IS NULL"
    "    ORDER BY id LIMIT 1) UNION ALL"
    "   (SELECT id FROM outbox.messages WHERE topic = t AND sent_at IS NULL AND failed_at IS NULL"
    "    ORDER BY id DESC LIMIT 1)) e),"
    " o.created_at, extract(epoch FROM clock_timestamp() - o.created_at)"
    " FROM unnest($1::text[]) AS t LEFT JOIN LATERAL"
    "  (SELECT created_at FROM outbox.messages WHERE topic = t AND sent_at IS NULL"
    "   AND failed_at IS NULL ORDER BY id LIMIT 1) AS o ON true";

static int pg_observe(const struct relay_config *cfg, PGconn *c, int update_admission,
                      struct relay_observation *o)
{
    PGresult *r = PQexec(c, outbox_sql);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        one_line(o->pg_error, sizeof(o->pg_error), PQresultErrorMessage(r));
        PQclear(r);
        return -1;
    }
    o->outbox_pending = PQgetisnull(r, 0, 0) ? 0 : strtoll(PQgetvalue(r, 0, 0), NULL, 10);
    o->outbox_oldest_age = PQgetisnull(r, 0, 1) ? -1 : strtod(PQgetvalue(r, 0, 1), NULL);
    o->quarantined = strtoll(PQgetvalue(r, 0, 2), NULL, 10);
    PQclear(r);
    (void)cfg;

    if (o->ntopics == 0)
        return 0;
    /* '{"a","b"}': topics are [A-Za-z0-9._-], nothing to escape. */
    char arr[RELAY_OBS_TOPICS_MAX * (RELAY_TOPIC_MAX + 4) + 4];
    size_t len = 0;
    arr[len++] = '{';
    for (size_t i = 0; i < o->ntopics; i++)
        len += (size_t)snprintf(arr + len, sizeof(arr) - len, "%s\"%s\"", i ? "," : "",
                                o->topics[i].topic);
    snprintf(arr + len, sizeof(arr) - len, "}");
    const char *params[1] = {arr};
    r = PQexecParams(c, topics_sql, 1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        one_line(o->pg_error, sizeof(o->pg_error), PQresultErrorMessage(r));
        PQclear(r);
        return -1;
    }
    for (int i = 0; i < PQntuples(r) && (size_t)i < o->ntopics; i++) {
        struct relay_topic_obs *t = &o->topics[i];
        t->pending = PQgetisnull(r, i, 1) ? 0 : strtoll(PQgetvalue(r, i, 1), NULL, 10);
        t->oldest_pending_age = PQgetisnull(r, i, 3) ? -1 : strtod(PQgetvalue(r, i, 3), NULL);
        if (update_admission) {
            char pending[32];
            snprintf(pending, sizeof(pending), "%lld", t->pending);
            const char *p3[3] = {t->topic, pending,
                                 PQgetisnull(r, i, 2) ? NULL : PQgetvalue(r, i, 2)};
            PGresult *a = PQexecParams(c, "SELECT outbox.observe_topic($1, $2, $3)", 3, NULL, p3,
                                       NULL, NULL, 0);
            t->admitting = PQresultStatus(a) == PGRES_TUPLES_OK
                               ? strcmp(PQgetvalue(a, 0, 0), "t") == 0
                               : -1;
            PQclear(a);
        } else {
            const char *p1[1] = {t->topic};
            PGresult *a = PQexecParams(c, "SELECT admitting FROM outbox.topic_state WHERE topic = $1",
                                       1, NULL, p1, NULL, NULL, 0);
            t->admitting = PQresultStatus(a) == PGRES_TUPLES_OK && PQntuples(a) == 1
                               ? strcmp(PQgetvalue(a, 0, 0), "t") == 0
                               : -1;
            PQclear(a);
        }
    }
    PQclear(r);
    return 0;
}

/* ---- Redis ----------------------------------------------------------- */

static redisReply *cmd(redisContext *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    redisReply *r = redisvCommand(c, fmt, ap);
    va_end(ap);
    return r;
}

static redisContext *redis_open(const struct relay_config *cfg, char *err, size_t errlen)
{
    struct timeval tv = {.tv_sec = cfg->connect_timeout_ms / 1000,
                         .tv_usec = (suseconds_t)(cfg->connect_timeout_ms % 1000) * 1000};
    const struct relay_redis_url *u = &cfg->redis_url;
    redisContext *c = redisConnectWithTimeout(u->host, u->port, tv);
    if (c == NULL || c->err) {
        snprintf(err, errlen, "cannot connect to %.100s:%d: %.100s", u->host, u->port,
                 c ? c->errstr : "out of memory");
        redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, tv);
    redisReply *r = NULL;
    if (u->password[0] != '\0')
        r = u->user[0] ? cmd(c, "AUTH %s %s", u->user, u->password)
                       : cmd(c, "AUTH %s", u->password);
    if (r != NULL && r->type == REDIS_REPLY_ERROR) {
        snprintf(err, errlen, "AUTH failed: %s (check the user and password)", r->str);
        freeReplyObject(r);
        redisFree(c);
        return NULL;
    }
    if (r)
        freeReplyObject(r);
    if (u->db != 0) {
        r = cmd(c, "SELECT %d", u->db);
        if (r)
            freeReplyObject(r);
    }
    return c;
}

static const redisReply *map_get(const redisReply *m, const char *key)
{
    if (m == NULL || m->type != REDIS_REPLY_ARRAY)
        return NULL;
    for (size_t i = 0; i + 1 < m->elements; i += 2)
        if (m->element[i]->type == REDIS_REPLY_STRING && strcmp(m->element[i]->str, key) == 0)
            return m->element[i + 1];
    return NULL;
}

/* created_at of one entry (or the ms part of its id when it has none). */
static double entry_time(redisContext *c, const char *stream, const char *id, int exclusive)
{
    redisReply *r = exclusive ? cmd(c, "XRANGE %s (%s + COUNT 1", stream, id)
                              : cmd(c, "XRANGE %s %s %s COUNT 1", stream, id, id);
    double t = -1;
    if (r && r->type == REDIS_REPLY_ARRAY && r->elements == 1) {
        const redisReply *e = r->element[0];
        const redisReply *f = e->elements == 2 ? map_get(e->element[1], "created_at") : NULL;
        if (f && f->type == REDIS_REPLY_STRING)
            t = relay_observe_parse_time(f->str);
        if (t < 0 && e->element[0]->type == REDIS_REPLY_STRING)
            t = strtod(e->element[0]->str, NULL) / 1000.0;
    } else if (r && r->type == REDIS_REPLY_ARRAY && r->elements == 0 && !exclusive) {
        t = strtod(id, NULL) / 1000.0; /* deleted entry: its id still dates it */
    }
    if (r)
        freeReplyObject(r);
    return t;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static int redis_observe(const struct relay_config *cfg, redisContext *c,
                         struct relay_observation *o)
{
    redisReply *r = cmd(c, "CONFIG GET appendonly");
    redisReply *r2 = cmd(c, "CONFIG GET appendfsync");
    if (r == NULL || r2 == NULL) {
        snprintf(o->redis_error, sizeof(o->redis_error), "%s", c->errstr);
        if (r)
            freeReplyObject(r);
        return -1;
    }
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 2 && r2->type == REDIS_REPLY_ARRAY &&
        r2->elements == 2)
        snprintf(o->durability, sizeof(o->durability), "appendonly %s, appendfsync %s",
                 r->element[1]->str, r2->element[1]->str);
    else
        snprintf(o->durability, sizeof(o->durability), "unknown (CONFIG not permitted)");
    freeReplyObject(r);
    freeReplyObject(r2);

    /* Streams: every stream key the relay could publish to, "<prefix><topic>"
     * with a valid topic, that is not a dead-letter or replay stream. Other
     * keys are someone else's, and their names may be any bytes: a name that
     * is not UTF-8 would make the topics query below fail as a whole. */
    const char *prefix = cfg->stream_prefix ? cfg->stream_prefix : "";
    size_t plen = strlen(prefix);
    char cursor[32] = "0";
    int rounds = 0;
    do {
        r = cmd(c, "SCAN %s TYPE stream COUNT 1000", cursor);
        if (r == NULL || r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
            snprintf(o->redis_error, sizeof(o->redis_error), "SCAN failed: %s",
                     r && r->type == REDIS_REPLY_ERROR ? r->str : c->errstr);
            if (r)
                freeReplyObject(r);
            return -1;
        }
        snprintf(cursor, sizeof(cursor), "%s", r->element[0]->str);
        const redisReply *keys = r->element[1];
        for (size_t i = 0; i < keys->elements && o->ntopics < RELAY_OBS_TOPICS_MAX; i++) {
            const char *k = keys->element[i]->str;
            size_t klen = keys->element[i]->len;
            if (klen < plen || strncmp(k, prefix, plen) != 0 ||
                !relay_batch_topic_valid(k + plen, klen - plen) || ends_with(k, ".dlq") ||
                ends_with(k, ".replay"))
                continue;
            struct relay_topic_obs *t = &o->topics[o->ntopics++];
            snprintf(t->stream, sizeof(t->stream), "%s", k);
            snprintf(t->topic, sizeof(t->topic), "%s", k + plen);
            t->oldest_pending_age = -1;
            t->admitting = -1;
        }
        freeReplyObject(r);
    } while (strcmp(cursor, "0") != 0 && ++rounds < 10000);

    for (size_t ti = 0; ti < o->ntopics; ti++) {
        const char *stream = o->topics[ti].stream;
        r = cmd(c, "XINFO GROUPS %s", stream);
        if (r == NULL) {
            snprintf(o->redis_error, sizeof(o->redis_error), "%s", c->errstr);
            return -1;
        }
        for (size_t g = 0; r->type == REDIS_REPLY_ARRAY && g < r->elements &&
                           o->ngroups < RELAY_OBS_GROUPS_MAX;
             g++) {
            const redisReply *info = r->element[g];
            const redisReply *name = map_get(info, "name");
            if (name == NULL || name->type != REDIS_REPLY_STRING)
                continue;
            struct relay_group_obs *go = &o->groups[o->ngroups++];
            memset(go, 0, sizeof(*go));
            snprintf(go->stream, sizeof(go->stream), "%s", stream);
            snprintf(go->group, sizeof(go->group), "%s", name->str);
            go->topic = (int)ti;
            const redisReply *v;
            go->consumers = (v = map_get(info, "consumers")) && v->type == REDIS_REPLY_INTEGER
                                ? v->integer
                                : 0;
            go->pending = (v = map_get(info, "pending")) && v->type == REDIS_REPLY_INTEGER
                              ? v->integer
                              : 0;
            go->lag = (v = map_get(info, "lag")) && v->type == REDIS_REPLY_INTEGER ? v->integer
                                                                                    : -1;
            go->oldest_pending_age = go->oldest_undelivered_age = -1;
            double now = now_unix();
            if (go->pending > 0) {
                redisReply *p = cmd(c, "XPENDING %s %s", stream, go->group);
                if (p && p->type == REDIS_REPLY_ARRAY && p->elements >= 2 &&
                    p->element[1]->type == REDIS_REPLY_STRING) {
                    double t = entry_time(c, stream, p->element[1]->str, 0);
                    if (t > 0)
                        go->oldest_pending_age = now - t;
                }
                if (p)
                    freeReplyObject(p);
            }
            const redisReply *last = map_get(info, "last-delivered-id");
            if (last && last->type == REDIS_REPLY_STRING) {
                double t = entry_time(c, stream, last->str, 1);
                if (t > 0)
                    go->oldest_undelivered_age = now - t;
            }
            char dlq[RELAY_TOPIC_MAX + 300];
            snprintf(dlq, sizeof(dlq), "%s.%s.dlq", stream, go->group);
            redisReply *d = cmd(c, "XLEN %s", dlq);
            go->dead_letters = d && d->type == REDIS_REPLY_INTEGER ? d->integer : 0;
            if (d)
                freeReplyObject(d);
        }
        freeReplyObject(r);
    }
    return 0;
}

static void finish_queue_ages(struct relay_observation *o)
{
    for (size_t i = 0; i < o->ngroups; i++) {
        struct relay_group_obs *g = &o->groups[i];
        double age = 0;
        if (g->oldest_pending_age > age)
            age = g->oldest_pending_age;
        if (g->oldest_undelivered_age > age)
            age = g->oldest_undelivered_age;
        if (g->topic >= 0 && o->topics[g->topic].oldest_pending_age > age)
            age = o->topics[g->topic].oldest_pending_age;
        g->queue_age = age;
    }
}

int relay_observe(const struct relay_config *cfg, PGconn **pg, redisContext **rd,
                  int update_admission, struct relay_observation *o)
{
    memset(o, 0, sizeof(*o));
    o->taken_at = now_unix();
    o->outbox_oldest_age = -1;

    if (*rd != NULL && (*rd)->err) {
        redisFree(*rd);
        *rd = NULL;
    }
    if (*rd == NULL)
        *rd = redis_open(cfg, o->redis_error, sizeof(o->redis_error));
    if (*rd != NULL) {
        o->redis_ok = redis_observe(cfg, *rd, o) == 0;
        if (!o->redis_ok && (*rd)->err) {
            redisFree(*rd);
            *rd = NULL;
        }
    }

    if (*pg != NULL && PQstatus(*pg) != CONNECTION_OK) {
        PQfinish(*pg);
        *pg = NULL;
    }
    if (*pg == NULL)
        *pg = pg_open(cfg, o->pg_error, sizeof(o->pg_error));
    if (*pg != NULL)
        o->pg_ok = pg_observe(cfg, *pg, update_admission, o) == 0;
    finish_queue_ages(o);
    return o->pg_ok && o->redis_ok ? 0 : -1;
}

/* ---- rendering ------------------------------------------------------- */

struct out {
    char *buf;
    size_t len, cap;
};

static void put(struct out *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(struct out *b, const char *fmt, ...)
{
    if (b->len + 1 >= b->cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->buf + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n > 0)
        b->len = b->len + (size_t)n >= b->cap ? b->cap - 1 : b->len + (size_t)n;
}

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

/* Text from the servers or from Redis keys, for a terminal (relay/tools.c):
 * escaped, cut to maxcols columns (0: not cut) and padded to width. */
static void put_shown(struct out *b, const char *s, size_t width, size_t maxcols)
{
    char shown[RELAY_ESCAPED_SIZE(512)];
    size_t cols = relay_tools_escape(shown, sizeof(shown), s, strlen(s), maxcols, 0);
    put(b, "%s%*s", shown, cols < width ? (int)(width - cols) : 0, "");
}

void relay_observe_text(const struct relay_observation *o, char *outbuf, size_t outlen)
{
    struct out b = {outbuf, 0, outlen};
    char a1[32], a2[32];
    outbuf[0] = '\0';
    put(&b, "PostgreSQL  %s\n", o->pg_ok ? "up" : "DOWN");
    if (!o->pg_ok) {
        put(&b, "            ");
        put_shown(&b, o->pg_error, 0, 0);
        put(&b, "\n");
    }
    put(&b, "Redis       %s", o->redis_ok ? "up" : "DOWN");
    if (o->redis_ok) {
        put(&b, " (");
        put_shown(&b, o->durability, 0, 0);
        put(&b, ")");
    }
    put(&b, "\n");
    if (!o->redis_ok) {
        put(&b, "            ");
        put_shown(&b, o->redis_error, 0, 0);
        put(&b, "\n");
    }
    if (o->pg_ok) {
        age_text(a1, sizeof(a1), o->outbox_oldest_age);
        put(&b, "Outbox      ~%lld pending, oldest %s, %lld quarantined\n", o->outbox_pending, a1,
            o->quarantined);
    }
    if (o->ngroups == 0) {
        put(&b, "\nNo consumer groups yet.\n");
        return;
    }
    put(&b, "\n%-24s %-16s %10s %8s %8s %10s %12s %6s\n", "STREAM", "GROUP", "QUEUE AGE", "LAG",
        "PENDING", "DEAD", "OUTBOX WAIT", "ADMIT");
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
        put(&b, " ");
        put_shown(&b, g->group, 16, 16);
        put(&b, " %10s %8s %8lld %10lld %12s %6s\n", a1, lag, g->pending, g->dead_letters, a2,
            t == NULL || t->admitting < 0 ? "-" : t->admitting ? "yes" : "NO");
    }
}

/*
 * A JSON string with s exactly: the controls of relay_tools_control_char as
 * \u escapes (so the output cannot act on a terminal either), other UTF-8 as
 * it is. JSON text is UTF-8 (RFC 8259), so a byte that is not part of valid
 * UTF-8, which no JSON string can carry, is U+FFFD.
 */
static void json_string(struct out *b, const char *s)
{
    size_t len = strlen(s);
    put(b, "\"");
    for (size_t i = 0; i < len;) {
        unsigned long cp;
        size_t n = relay_tools_utf8_char(s + i, len - i, &cp);
        if (n == 0) {
            put(b, "\\ufffd");
            n = 1;
        } else if (cp == '"' || cp == '\\') {
            put(b, "\\%c", (char)cp);
        } else if (relay_tools_control_char(cp)) {
            put(b, "\\u%04lx", cp);
        } else {
            put(b, "%.*s", (int)n, s + i);
        }
        i += n;
    }
    put(b, "\"");
}

void relay_observe_json(const struct relay_observation *o, char *outbuf, size_t outlen)
{
    struct out b = {outbuf, 0, outlen};
    outbuf[0] = '\0';
    put(&b, "{\"taken_at\":%.3f,\"postgres\":{\"up\":%s,\"error\":", o->taken_at,
        o->pg_ok ? "true" : "false");
    json_string(&b, o->pg_ok ? "" : o->pg_error);
    put(&b, "},\"redis\":{\"up\":%s,\"durability\":", o->redis_ok ? "true" : "false");
    json_string(&b, o->durability);
    put(&b, ",\"error\":");
    json_string(&b, o->redis_ok ? "" : o->redis_error);
    put(&b, "},\"outbox\":{\"pending_estimate\":%lld,\"oldest_pending_age_seconds\":%.3f,"
            "\"quarantined\":%lld},\"topics\":[",
        o->outbox_pending, o->outbox_oldest_age, o->quarantined);
    for (size_t i = 0; i < o->ntopics; i++) {
        const struct relay_topic_obs *t = &o->topics[i];
        put(&b, "%s{\"topic\":", i ? "," : "");
        json_string(&b, t->topic);
        put(&b, ",\"stream\":");
        json_string(&b, t->stream);
        put(&b, ",\"outbox_pending\":%lld,\"outbox_oldest_age_seconds\":%.3f,\"admitting\":%s}",
            t->pending, t->oldest_pending_age,
            t->admitting < 0 ? "null" : t->admitting ? "true" : "false");
    }
    put(&b, "],\"groups\":[");
    for (size_t i = 0; i < o->ngroups; i++) {
        const struct relay_group_obs *g = &o->groups[i];
        put(&b, "%s{\"stream\":", i ? "," : "");
        json_string(&b, g->stream);
        put(&b, ",\"group\":");
        json_string(&b, g->group);
        put(&b, ",\"consumers\":%lld,\"lag\":", g->consumers);
        if (g->lag < 0)
            put(&b, "null");
        else
            put(&b, "%lld", g->lag);
        put(&b, ",\"pending\":%lld,\"dead_letters\":%lld,\"oldest_pending_age_seconds\":%.3f,"
                "\"oldest_undelivered_age_seconds\":%.3f,\"queue_age_seconds\":%.3f}",
            g->pending, g->dead_letters, g->oldest_pending_age, g->oldest_undelivered_age,
            g->queue_age);
    }
    put(&b, "]}\n");
}
