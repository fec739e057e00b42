/*
 * The configuration's keys (core/config_table.h): the table, a row per key
 * with its type, bounds, default and rule, and how keys and values are
 * spelled: a key's name in the file, the environment and the command line,
 * durations, log levels and formats, and values in messages with their
 * secrets redacted. What reads values into a configuration (core/config.c),
 * checks one against another (core/config_validate.c) or shows them
 * (core/config_doc.c) builds on this.
 */
#include "common/compat.h"

#include "core/config_table.h"

#include <ctype.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/common.h"
#include "common/tls.h"
#include "core/text.h"

#define CFG_STREAM_PREFIX_MAX 64

/* "host:port" with a numeric port, or empty. */
static int cfg_check_listen(const char *value, char *rule, size_t rulelen)
{
    const char *colon = strrchr(value, ':');
    const char *end;
    uint64_t port;
    if (value[0] == '\0')
        return 0;
    if (colon == NULL || colon == value) {
        snprintf(rule, rulelen,
                 "must be host:port, e.g. 127.0.0.1:9479, or empty to switch "
                 "the endpoint off");
        return -1;
    }
    /* Digits only: strtoul would also take a sign and leading white space. */
    if (outbox_parse_digits(colon + 1, &port, &end) != 0 || *end != '\0' || port == 0 ||
        port > 65535) {
        snprintf(rule, rulelen, "port must be a number between 1 and 65535");
        return -1;
    }
    return 0;
}

/* "text" or "json" (relay/log.c). */
static int cfg_check_log_format(const char *value, char *rule, size_t rulelen)
{
    if (relay_config_parse_log_format(value) >= 0)
        return 0;
    snprintf(rule, rulelen,
             "must be text (one line of text per event) or json (one JSON object "
             "per line)");
    return -1;
}

/* A redis:// address, or empty. */
static int cfg_check_redis(const char *value, char *rule, size_t rulelen)
{
    struct outbox_redis_url u;

    if (value[0] == '\0')
        return 0; /* unset; validation reports it if it is still unset */
    if (outbox_url_parse_seeds(value, &u, rule, rulelen) != 0)
        return -1;
    /* rediss://: the CA, certificate and key files load. */
    return outbox_tls_check(&u, rule, rulelen);
}

/* What may stand in front of every stream name. */
static int cfg_check_stream_prefix(const char *value, char *rule, size_t rulelen)
{
    const char *p;

    for (p = value; *p; p++)
        if (!isalnum((unsigned char)*p) && strchr("._:-", *p) == NULL)
            break;
    if (*p != '\0' || p - value > CFG_STREAM_PREFIX_MAX) {
        snprintf(rule, rulelen, "must be at most %d characters from A-Z a-z 0-9 . _ : -",
                 CFG_STREAM_PREFIX_MAX);
        return -1;
    }
    return 0;
}

/* The one place a key is defined. docs/CONFIGURATION.md documents this table. */
const struct cfg_key relay_config_keys[] = {
    {"postgres", CFG_SECRET_STRING, CFG_OFF(postgres), 0, CFG_VALUE_MAX, "", CFG_REQUIRED, NULL,
     "PostgreSQL connection: a libpq conninfo string or a postgresql:// URI"},
    {"redis", CFG_SECRET_STRING, CFG_OFF(redis), 0, CFG_VALUE_MAX, "", CFG_REQUIRED,
     cfg_check_redis,
     "Redis address: redis://[user:password@]host[:port][/db][,host:port...] "
     "(more seed nodes of a Redis Cluster after the first); rediss:// for TLS, with the options "
     "ca_file, ca_dir, cert_file, key_file, server_name and verify after ?"},
    {"redis_password_file", CFG_STRING, CFG_OFF(redis_password_file), 0, CFG_VALUE_MAX, "", 0, NULL,
     "file whose first line is the Redis password; overrides the password in redis"},
    {"redis_sentinel", CFG_STRING, CFG_OFF(redis_sentinel), 0, CFG_VALUE_MAX, "", 0, NULL,
     "Redis Sentinels (host:port,...) that name the primary; redis then gives only the user, "
     "password and database"},
    {"redis_master", CFG_STRING, CFG_OFF(redis_master), 0, CFG_VALUE_MAX, "", 0, NULL,
     "the name of the master the Sentinels monitor"},
    {"redis_sentinel_user", CFG_STRING, CFG_OFF(redis_sentinel_user), 0, CFG_VALUE_MAX, "", 0, NULL,
     "the user the Sentinels know the relay as (their ACL); empty: their default user"},
    {"redis_sentinel_password", CFG_SECRET_STRING, CFG_OFF(redis_sentinel_password), 0,
     CFG_VALUE_MAX, "", CFG_OPAQUE, NULL,
     "the Sentinels' own password (their requirepass, or the user's), sent with AUTH before "
     "asking them for the primary; empty: none"},
    {"stream_prefix", CFG_STRING, CFG_OFF(stream_prefix), 0, CFG_VALUE_MAX, "", 0,
     cfg_check_stream_prefix, "text put in front of the topic to name the stream"},
    {"batch_size", CFG_UINT, CFG_OFF(batch_size), 1, 10000, "500", 0, NULL,
     "rows read per chunk of a batch; at most two chunks are in memory"},
    {"max_attempts", CFG_UINT, CFG_OFF(max_attempts), 1, 1000, "10", CFG_RETIRED, NULL,
     "no effect (accepted so that existing files keep working): a transient failure fails the "
     "whole batch, which is read again; only a row that can never be published is quarantined"},
    {"max_payload_bytes", CFG_UINT, CFG_OFF(max_payload_bytes), 1, 536870912, "1048576", 0, NULL,
     "larger payloads fail their row, which is quarantined at once"},
    {"listen", CFG_BOOL, CFG_OFF(listen), 0, 1, "on", 0, NULL,
     "wake up on NOTIFY outbox_relay; off relies on polling alone"},
    {"pipeline", CFG_BOOL, CFG_OFF(pipeline), 0, 1, "on", CFG_RETIRED, NULL,
     "no effect (accepted so that existing files keep working): the next chunk of a batch is "
     "always read while the one before is published"},
    {"poll_interval", CFG_DURATION, CFG_OFF(poll_interval_ms), 10, CFG_HOUR, "1s", 0, NULL,
     "fallback poll: a lost notification costs at most this much latency"},
    {"connect_timeout", CFG_DURATION, CFG_OFF(connect_timeout_ms), 100, 10 * CFG_MIN, "5s", 0, NULL,
     "deadline for connecting to either server"},
    {"publish_timeout", CFG_DURATION, CFG_OFF(publish_timeout_ms), 100, 10 * CFG_MIN, "5s", 0, NULL,
     "deadline for Redis to answer a chunk's calls; past it the batch is read again"},
    {"statement_timeout", CFG_DURATION, CFG_OFF(statement_timeout_ms), 100, CFG_HOUR, "30s", 0,
     NULL, "server-side deadline of each SQL statement"},
    {"reconnect_min", CFG_DURATION, CFG_OFF(reconnect_min_ms), 10, CFG_MIN, "100ms", 0, NULL,
     "first delay before reconnecting or retrying; doubles up to reconnect_max"},
    {"reconnect_max", CFG_DURATION, CFG_OFF(reconnect_max_ms), 100, CFG_HOUR, "30s", 0, NULL,
     "longest delay between reconnects or retries"},
    {"drain_timeout", CFG_DURATION, CFG_OFF(drain_timeout_ms), 100, 10 * CFG_MIN, "10s", 0, NULL,
     "on SIGTERM, how long to wait for the batch in flight"},
    {"dedup_ttl", CFG_DURATION, CFG_OFF(dedup_ttl_ms), CFG_SEC, 30 * CFG_DAY, "24h", CFG_RETIRED,
     NULL,
     "no effect (accepted so that existing files keep working): the relay keeps no record per "
     "message in Redis"},
    {"min_replicas", CFG_UINT, CFG_OFF(min_replicas), 0, 16, "0", 0, NULL,
     "replicas that must hold a chunk's writes (WAIT) before its batch is recorded; 0 = off"},
    {"replica_timeout", CFG_DURATION, CFG_OFF(replica_timeout_ms), 10, 10 * CFG_MIN, "1s", 0, NULL,
     "how long to wait for min_replicas replicas before the batch is read again"},
    {"log_level", CFG_LOGLEVEL, CFG_OFF(log_level), RELAY_LOG_DEBUG, RELAY_LOG_ERROR, "info",
     CFG_RELOADABLE, NULL, "least severe level logged: debug, info, warning or error"},
    {"log_format", CFG_STRING, CFG_OFF(log_format), 0, 16, "text", 0, cfg_check_log_format,
     "log lines as text, or json: one JSON object per line for log pipelines"},
    {"metrics_listen", CFG_STRING, CFG_OFF(metrics_listen), 0, 300, "127.0.0.1:9479", 0,
     cfg_check_listen, "address of /metrics, /healthz and /readyz (host:port); empty: off"},
    {"observe_interval", CFG_DURATION, CFG_OFF(observe_interval_ms), 100, 10 * CFG_MIN, "5s", 0,
     NULL, "how often queue age, lag and producer admission are read"},
    {"pause_lag_entries", CFG_UINT, CFG_OFF(pause_lag_entries), 0, 2000000000, "0", 0, NULL,
     "stop publishing to a stream when one of its groups lags this many entries; 0: never"},
    {"resume_lag_entries", CFG_UINT, CFG_OFF(resume_lag_entries), 0, 2000000000, "0", 0, NULL,
     "publish to a paused stream again when every group lags less than this"},
    {"pause_queue_age", CFG_DURATION, CFG_OFF(pause_queue_age_ms), 0, 30 * CFG_DAY, "0", 0, NULL,
     "stop publishing to a stream when a group's queue age reaches this; 0: never"},
    {"resume_queue_age", CFG_DURATION, CFG_OFF(resume_queue_age_ms), 0, 30 * CFG_DAY, "0", 0, NULL,
     "publish to a paused stream again when every group's queue age is below this"},
    {"sent_retention", CFG_DURATION, CFG_OFF(sent_retention_ms), 0, 30 * CFG_DAY, "15m", 0, NULL,
     "keep published rows this long (a Redis that lost entries is refilled from them); 0: delete "
     "them once every stream is past them"},
    {"stream_retention", CFG_DURATION, CFG_OFF(stream_retention_ms), 0, 30 * CFG_DAY, "24h", 0,
     NULL, "trim stream entries older than this that every group has acknowledged; 0: never"},
    {"stream_trim_max_hold", CFG_DURATION, CFG_OFF(stream_trim_max_hold_ms), 0, 30 * CFG_DAY, "0",
     0, NULL,
     "trim past a group's pending entries once older than this (never undelivered ones); 0: never"},
    {"allow_short_stream_retention", CFG_BOOL, CFG_OFF(allow_short_stream_retention), 0, 1, "off",
     CFG_RETIRED, NULL,
     "no effect (accepted so that existing files keep working): stream_retention is no longer "
     "held against dedup_ttl"},
    {"vacuum_dead_rows", CFG_UINT, CFG_OFF(vacuum_dead_rows), 0, 2000000000, "100000", 0, NULL,
     "VACUUM outbox.messages when it holds this many dead rows (needs its owner); 0: never"},
};

const size_t relay_config_nkeys = OUTBOX_ARRAY_LEN(relay_config_keys);
_Static_assert(OUTBOX_ARRAY_LEN(relay_config_keys) <= CFG_KEYS_MAX,
               "raise CFG_KEYS_MAX to the number of keys");

/* The keys that no longer have an effect, in the order of their bits in
 * cfg->retired_set, and why each can go. */
static const struct {
    const char *name;
    const char *warning;
} cfg_retired[RELAY_CONFIG_RETIRED_KEYS] = {
    {"pipeline", "pipeline no longer has an effect: the next chunk of a batch is always read "
                 "while the one before is published; remove it"},
    {"max_attempts", "max_attempts no longer has an effect: a transient failure fails the whole "
                     "batch, which is read again, and only a row that can never be published is "
                     "quarantined; remove it"},
    {"dedup_ttl", "dedup_ttl no longer has an effect: the relay keeps no record per message; "
                  "remove it"},
    {"allow_short_stream_retention",
     "allow_short_stream_retention no longer has an effect: stream_retention is no longer held "
     "against dedup_ttl; remove it"},
};

unsigned relay_config_retired_bit(const struct cfg_key *k)
{
    if (!(k->flags & CFG_RETIRED))
        return 0;
    for (unsigned i = 0; i < RELAY_CONFIG_RETIRED_KEYS; i++)
        if (strcmp(cfg_retired[i].name, k->name) == 0)
            return 1u << i;
    return 0;
}

const char *relay_config_retired(const struct relay_config *cfg, unsigned i)
{
    if (i >= RELAY_CONFIG_RETIRED_KEYS || !(cfg->retired_set & (1u << i)))
        return NULL;
    return cfg_retired[i].warning;
}

void relay_config_errors_add(struct relay_config_errors *errs, const char *msg)
{
    if (errs->count < RELAY_CONFIG_ERRORS_MAX)
        snprintf(errs->msg[errs->count], sizeof(errs->msg[0]), "%s", msg);
    if (errs->count < UINT_MAX)
        errs->count++;
}

void relay_config_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;

    if (err == NULL || errlen == 0)
        return;
    va_start(ap, fmt);
    if (vsnprintf(err, errlen, fmt, ap) < 0)
        err[0] = '\0';
    va_end(ap);
}

/* ------------------------------------------------------------------------ */
/* The names a key has in each source.                                       */

void relay_config_env_name(const char *key, char *out, size_t outlen)
{
    struct relay_text_out o;
    const char *p;

    relay_text_out_init(&o, out, outlen);
    relay_text_out_puts(&o, CFG_ENV_PREFIX);
    for (p = key; *p; p++) {
        char c = (char)toupper((unsigned char)*p);
        relay_text_out_putn(&o, &c, 1);
    }
}

void relay_config_flag_name(const char *key, char *out, size_t outlen)
{
    struct relay_text_out o;
    const char *p;

    relay_text_out_init(&o, out, outlen);
    relay_text_out_puts(&o, "--");
    for (p = key; *p; p++)
        relay_text_out_putn(&o, *p == '_' ? "-" : p, 1);
}

/* ------------------------------------------------------------------------ */
/* Redaction and showing values in messages.                                 */

static int cfg_is_password_word(const char *p)
{
    return strncasecmp(p, "password", 8) == 0;
}

void relay_config_redact(const char *s, char *out, size_t outlen)
{
    struct relay_text_out o;
    const char *uri, *pw_from = NULL, *pw_to = NULL, *p;

    relay_text_out_init(&o, out, outlen);
    if (s == NULL)
        return;

    /*
     * In a URI, the password is between the first ':' of the userinfo and the
     * last '@' before any whitespace. Taking the last '@' over-redacts when an
     * '@' appears later (in a query), which is the safe way to be wrong: a
     * password with a raw '@' or '/' in it is still hidden.
     */
    uri = strstr(s, "://");
    if (uri != NULL) {
        const char *a = uri + 3, *end = a + strcspn(a, " \t\r\n"), *at = NULL, *q;

        for (q = a; q < end; q++)
            if (*q == '@')
                at = q;
        if (at != NULL) {
            const char *colon = memchr(a, ':', (size_t)(at - a));
            if (colon != NULL) {
                pw_from = colon + 1;
                pw_to = at;
            }
        }
    }

    for (p = s; *p;) {
        if (p == pw_from) {
            relay_text_out_puts(&o, "***");
            p = pw_to;
            pw_from = NULL; /* hidden once: an empty password ends where it starts */
            continue;
        }
        /* password=value, in a conninfo string or a URI query; also 'quoted'. */
        if (cfg_is_password_word(p)) {
            const char *q = p + 8;
            while (*q == ' ' || *q == '\t')
                q++;
            if (*q == '=') {
                q++;
                while (*q == ' ' || *q == '\t')
                    q++;
                relay_text_out_putn(&o, p, (size_t)(q - p));
                relay_text_out_puts(&o, "***");
                if (*q == '\'') {
                    for (q++; *q && *q != '\''; q++)
                        if (*q == '\\' && q[1])
                            q++;
                    if (*q)
                        q++;
                } else {
                    while (*q && !isspace((unsigned char)*q) &&
                           !(uri != NULL && (*q == '&' || *q == '#')))
                        q++;
                }
                if (pw_from != NULL && pw_from >= p && pw_from < q)
                    pw_from = NULL; /* already hidden inside this value */
                p = q;
                continue;
            }
        }
        relay_text_out_putn(&o, p, 1);
        p++;
    }
}

void relay_config_show(const char *value, int secret, char *out, size_t outlen)
{
    char red[CFG_SHOW_MAX * 4];
    const char *v = value;
    size_t n, i;
    struct relay_text_out o;

    if (secret == CFG_SHOW_OPAQUE) {
        snprintf(out, outlen, "%s", value[0] != '\0' ? "***" : "");
        return;
    }
    if (secret) {
        relay_config_redact(value, red, sizeof(red));
        v = red;
    }
    relay_text_out_init(&o, out, outlen);
    n = strlen(v);
    for (i = 0; i < n && i < CFG_SHOW_MAX; i++) {
        unsigned char c = (unsigned char)v[i];
        char ch = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
        relay_text_out_putn(&o, &ch, 1);
    }
    if (n > CFG_SHOW_MAX)
        relay_text_out_puts(&o, "...");
}

/* ------------------------------------------------------------------------ */
/* Durations, log levels and formats.                                        */

int relay_config_parse_duration(const char *s, uint32_t *ms)
{
    static const struct {
        const char *unit;
        uint64_t mult;
    } units[] = {{"", 1},        {"ms", 1},       {"s", CFG_SEC},
                 {"m", CFG_MIN}, {"h", CFG_HOUR}, {"d", CFG_DAY}};
    uint64_t v;
    const char *end;
    size_t i;

    if (s == NULL || outbox_parse_digits(s, &v, &end) != 0)
        return -1;
    for (i = 0; i < OUTBOX_ARRAY_LEN(units); i++) {
        if (strcmp(end, units[i].unit) != 0)
            continue;
        if (v > UINT32_MAX / units[i].mult)
            return -1;
        *ms = (uint32_t)(v * units[i].mult);
        return 0;
    }
    return -1;
}

/* The shortest exact spelling: 86400000 -> "1d", 1500 -> "1500ms". */
void relay_config_format_duration(uint32_t ms, char *out, size_t outlen)
{
    if (ms != 0 && ms % CFG_DAY == 0)
        snprintf(out, outlen, "%lud", (unsigned long)(ms / CFG_DAY));
    else if (ms != 0 && ms % CFG_HOUR == 0)
        snprintf(out, outlen, "%luh", (unsigned long)(ms / CFG_HOUR));
    else if (ms != 0 && ms % CFG_MIN == 0)
        snprintf(out, outlen, "%lum", (unsigned long)(ms / CFG_MIN));
    else if (ms != 0 && ms % CFG_SEC == 0)
        snprintf(out, outlen, "%lus", (unsigned long)(ms / CFG_SEC));
    else
        snprintf(out, outlen, "%lums", (unsigned long)ms);
}

int relay_config_parse_log_format(const char *name)
{
    if (name == NULL)
        return -1;
    if (strcmp(name, "text") == 0)
        return 0;
    if (strcmp(name, "json") == 0)
        return 1;
    return -1;
}

int relay_config_parse_log_level(const char *name)
{
    static const char *const names[] = {"debug", "info", "warning", "error"};
    size_t i;

    if (name == NULL)
        return -1;
    for (i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strcasecmp(name, names[i]) == 0)
            return (int)i;
    return -1;
}
