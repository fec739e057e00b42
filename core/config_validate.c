/*
 * Validation of a configuration, the pass after every source was read
 * (core/config.h; pgagroal's pgagroal_validate_configuration): the keys that
 * must be set, the keys that only make sense together, and the fields derived
 * from them (the parsed Redis URL, the password read from its file). A value
 * that passes its own key's rule can still contradict another's; the message
 * then names both and says which to change. Every check runs and adds what it
 * finds, so one run names every contradiction; a check that needs another's
 * result (the Sentinels' list needs both of its keys) is left out when that
 * one failed.
 */
#include "common/compat.h"

#include "core/config.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "core/config_table.h"

/* Reads the first line of the password file into url->password. */
static int config_read_password(const char *path, struct outbox_redis_url *url, char *err,
                                size_t errlen) __attribute__((warn_unused_result));
static int config_read_password(const char *path, struct outbox_redis_url *url, char *err,
                                size_t errlen)
{
    char line[sizeof(url->password) + 2];
    char shown[CFG_SHOW_MAX + 8];
    size_t len;
    FILE *f;
    int rc = -1;

    relay_config_show(path, 0, shown, sizeof(shown));
    f = fopen(path, "r");
    if (f == NULL) {
        relay_config_err(err, errlen, "redis_password_file = \"%s\": cannot open: %s", shown,
                         strerror(errno));
        return -1;
    }
    errno = 0;
    if (fgets(line, sizeof(line), f) == NULL) {
        if (ferror(f))
            relay_config_err(err, errlen, "redis_password_file = \"%s\": cannot read: %s", shown,
                             strerror(errno ? errno : EIO));
        else
            relay_config_err(
                err, errlen,
                "redis_password_file = \"%s\": file is empty: put the Redis password on its "
                "first line",
                shown);
        goto out;
    }
    len = strlen(line);
    if (len > 0 && line[len - 1] == '\n')
        line[--len] = '\0';
    if (len > 0 && line[len - 1] == '\r')
        line[--len] = '\0';
    if (len >= sizeof(url->password)) {
        relay_config_err(
            err, errlen,
            "redis_password_file = \"%s\": first line is longer than %zu bytes: the Redis "
            "password must fit in %zu bytes",
            shown, sizeof(url->password) - 1, sizeof(url->password) - 1);
        goto out;
    }
    if (len == 0) {
        relay_config_err(
            err, errlen,
            "redis_password_file = \"%s\": first line is empty: put the Redis password on "
            "its first line",
            shown);
        goto out;
    }
    snprintf(url->password, sizeof(url->password), "%.*s", (int)len, line);
    rc = 0;
out:
    memset(line, 0, sizeof(line));
    fclose(f);
    return rc;
}

/* Adds the formatted message to errs. */
static void fail(struct relay_config_errors *errs, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void fail(struct relay_config_errors *errs, const char *fmt, ...)
{
    char err[RELAY_CONFIG_ERR_MAX];
    va_list ap;

    va_start(ap, fmt);
    if (vsnprintf(err, sizeof(err), fmt, ap) < 0)
        err[0] = '\0';
    va_end(ap);
    relay_config_errors_add(errs, err);
}

/* The retention keys against each other. */
static void validate_retention(const struct relay_config *cfg, struct relay_config_errors *errs)
{
    char a[32], b[32];
    if (cfg->stream_trim_max_hold_ms > 0 && cfg->stream_retention_ms == 0) {
        relay_config_format_duration(cfg->stream_trim_max_hold_ms, a, sizeof(a));
        fail(errs,
             "stream_trim_max_hold = \"%s\": has no effect while stream_retention = 0 "
             "(streams are never trimmed); set stream_retention or remove it",
             a);
    } else if (cfg->stream_trim_max_hold_ms > 0 &&
               cfg->stream_trim_max_hold_ms < cfg->stream_retention_ms) {
        relay_config_format_duration(cfg->stream_trim_max_hold_ms, a, sizeof(a));
        relay_config_format_duration(cfg->stream_retention_ms, b, sizeof(b));
        fail(errs, "stream_trim_max_hold = \"%s\": must not be shorter than stream_retention (%s)",
             a, b);
    }
}

/* redis_sentinel_user and redis_sentinel_password, into the Sentinels' list. */
static void validate_sentinel_auth(struct relay_config *cfg, int sentinel,
                                   struct relay_config_errors *errs)
{
    struct outbox_sentinels *st = &cfg->redis_url.sentinels;
    const char *user = cfg->redis_sentinel_user != NULL ? cfg->redis_sentinel_user : "";
    const char *password = cfg->redis_sentinel_password != NULL ? cfg->redis_sentinel_password : "";
    unsigned before = errs->count;
    if ((user[0] != '\0' || password[0] != '\0') && !sentinel)
        fail(errs,
             "%s is set but redis_sentinel is not: it is sent to the Sentinels only; set "
             "redis_sentinel and redis_master, or leave it out",
             password[0] != '\0' ? "redis_sentinel_password" : "redis_sentinel_user");
    if (user[0] != '\0' && password[0] == '\0')
        fail(errs, "redis_sentinel_user is set but redis_sentinel_password is not: AUTH needs the "
                   "user's password");
    if (strlen(user) >= sizeof(st->user))
        fail(errs, "redis_sentinel_user: must be at most %zu bytes", sizeof(st->user) - 1);
    if (strlen(password) >= sizeof(st->password))
        fail(errs, "redis_sentinel_password: must be at most %zu bytes", sizeof(st->password) - 1);
    if (errs->count != before)
        return;
    memcpy(st->user, user, strlen(user) + 1);
    memcpy(st->password, password, strlen(password) + 1);
}

/* Every required key is set; each that is not is named with where to set it. */
static void validate_required(const struct relay_config *cfg, struct relay_config_errors *errs)
{
    size_t i;

    for (i = 0; i < relay_config_nkeys; i++) {
        const struct cfg_key *k = &relay_config_keys[i];
        char env[CFG_NAME_MAX + 32], flag[CFG_NAME_MAX + 32];
        char *const *field;

        if (!(k->flags & CFG_REQUIRED))
            continue;
        /* With Sentinels, redis only adds the user, password and database. */
        if (k->off == CFG_OFF(redis) && cfg->redis_sentinel != NULL &&
            cfg->redis_sentinel[0] != '\0')
            continue;
        field = cfg_cstr_field(cfg, k);
        if (*field != NULL && (*field)[0] != '\0')
            continue;
        relay_config_env_name(k->name, env, sizeof(env));
        relay_config_flag_name(k->name, flag, sizeof(flag));
        fail(errs, "%s is not set: set it in the config file, %s or %s", k->name, env, flag);
    }
}

/* The Redis keys into cfg->redis_url: the address, the password file, and
 * the Sentinels with their own credentials. */
static void validate_redis(struct relay_config *cfg, struct relay_config_errors *errs)
{
    char rule[RELAY_CONFIG_ERR_MAX];
    char err[RELAY_CONFIG_ERR_MAX];
    char shown[CFG_SHOW_MAX + 8];

    memset(&cfg->redis_url, 0, sizeof(cfg->redis_url));
    if ((cfg->redis != NULL && cfg->redis[0] != '\0') &&
        outbox_url_parse_seeds(cfg->redis, &cfg->redis_url, rule, sizeof(rule)) != 0) {
        relay_config_show(cfg->redis, 1, shown, sizeof(shown));
        fail(errs, "redis = \"%s\": %s", shown, rule);
    }
    if (cfg->redis_password_file != NULL && cfg->redis_password_file[0] != '\0' &&
        config_read_password(cfg->redis_password_file, &cfg->redis_url, err, sizeof(err)) != 0)
        relay_config_errors_add(errs, err);
    int sentinel = cfg->redis_sentinel != NULL && cfg->redis_sentinel[0] != '\0';
    int master = cfg->redis_master != NULL && cfg->redis_master[0] != '\0';
    if (sentinel != master)
        fail(errs,
             "%s is set but %s is not: set both to find the primary through "
             "Sentinel, or neither to connect to the address in redis",
             sentinel ? "redis_sentinel" : "redis_master",
             sentinel ? "redis_master" : "redis_sentinel");
    else if (sentinel &&
             outbox_sentinels_parse(cfg->redis_sentinel, cfg->redis_master,
                                    &cfg->redis_url.sentinels, rule, sizeof(rule)) != 0) {
        relay_config_show(cfg->redis_sentinel, 0, shown, sizeof(shown));
        fail(errs, "redis_sentinel = \"%s\", redis_master = \"%.128s\": %s", shown,
             cfg->redis_master, rule);
    }
    validate_sentinel_auth(cfg, sentinel, errs);
}

/* Each low-water mark below its high-water mark: the reconnect backoff, and
 * the hysteresis of backpressure. */
static void validate_marks(const struct relay_config *cfg, struct relay_config_errors *errs)
{
    char a[32], b[32];

    if (cfg->reconnect_min_ms > cfg->reconnect_max_ms) {
        relay_config_format_duration(cfg->reconnect_min_ms, a, sizeof(a));
        relay_config_format_duration(cfg->reconnect_max_ms, b, sizeof(b));
        fail(errs, "reconnect_min = \"%s\": must not be greater than reconnect_max (%s)", a, b);
    }
    /* Hysteresis: a low-water mark at or above its high-water mark would pause
     * and resume on every observation. */
    if (cfg->pause_lag_entries > 0 && cfg->resume_lag_entries >= cfg->pause_lag_entries)
        fail(errs,
             "resume_lag_entries = \"%u\": must be below pause_lag_entries (%u), the "
             "mark that pauses a stream",
             cfg->resume_lag_entries, cfg->pause_lag_entries);
    if (cfg->pause_queue_age_ms > 0 && cfg->resume_queue_age_ms >= cfg->pause_queue_age_ms) {
        relay_config_format_duration(cfg->resume_queue_age_ms, a, sizeof(a));
        relay_config_format_duration(cfg->pause_queue_age_ms, b, sizeof(b));
        fail(errs,
             "resume_queue_age = \"%s\": must be below pause_queue_age (%s), the mark "
             "that pauses a stream",
             a, b);
    }
}

int relay_config_validate_all(struct relay_config *cfg, struct relay_config_errors *errs)
{
    unsigned before = errs->count;

    validate_required(cfg, errs);
    validate_redis(cfg, errs);
    validate_marks(cfg, errs);
    validate_retention(cfg, errs);
    return errs->count == before ? 0 : -1;
}

int relay_config_validate(struct relay_config *cfg, char *err, size_t errlen)
{
    struct relay_config_errors errs;

    errs.count = 0;
    if (relay_config_validate_all(cfg, &errs) == 0)
        return 0;
    relay_config_err(err, errlen, "%s", errs.msg[0]);
    return -1;
}

int relay_config_short_stream_retention(const struct relay_config *cfg)
{
    (void)cfg;
    return 0;
}
