/*
 * Configuration: one "key = value" file, every key overridable from the
 * environment (OUTBOX_RELAY_<KEY>) and the command line (--key-with-dashes VALUE
 * or --key-with-dashes=VALUE), in that order of precedence. Parsing and
 * validation are pure: no connection is made here, which is what
 * --check-config relies on.
 */
#ifndef RELAY_CONFIG_H
#define RELAY_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "common/url.h" /* struct outbox_redis_url, outbox_url_parse */

/* The log levels that log_level names; the daemon logs at them (relay/log.h). */
enum relay_log_level {
    RELAY_LOG_DEBUG = 0,
    RELAY_LOG_INFO = 1,
    RELAY_LOG_WARNING = 2,
    RELAY_LOG_ERROR = 3,
};

/* Parses a log_format: "text" 0, "json" 1, anything else -1. */
int relay_config_parse_log_format(const char *name) __attribute__((warn_unused_result));

/* Parses "debug", "info", "warning" or "error"; returns -1 on anything else. */
int relay_config_parse_log_level(const char *name) __attribute__((warn_unused_result));

#define RELAY_CONFIG_ERR_MAX 512

struct relay_config {
    /* Connections. postgres is a libpq conninfo string or URI; libpq's PG*
     * environment variables fill in what it leaves out. Both strings may hold
     * secrets and are never printed as they are (see relay_config_redact). */
    char *postgres;
    char *redis;
    char *redis_password_file;         /* optional; its first line overrides the URL's password */
    char *redis_sentinel;              /* optional: Sentinels "host:port,..." to find the primary */
    char *redis_master;                /* the master's name at those Sentinels */
    char *redis_sentinel_user;         /* optional: the user the Sentinels know (ACL) */
    char *redis_sentinel_password;     /* optional: the Sentinels' own password */
    struct outbox_redis_url redis_url; /* derived from redis (+ password file) */

    /* Streams. */
    char *stream_prefix; /* put in front of the topic to name the stream; may be "" */

    /* Work. */
    uint32_t batch_size;        /* rows per claim, 1..10000 */
    uint32_t max_attempts;      /* no effect (relay_config_retired) */
    uint32_t max_payload_bytes; /* 1..536870912 */
    int listen;                 /* 1: LISTEN for wake-ups; 0: poll only */
    int pipeline;               /* no effect (relay_config_retired) */

    /* Time, all in milliseconds. */
    uint32_t poll_interval_ms;
    uint32_t connect_timeout_ms;
    uint32_t publish_timeout_ms;
    uint32_t statement_timeout_ms;
    uint32_t reconnect_min_ms;
    uint32_t reconnect_max_ms;
    uint32_t drain_timeout_ms;
    uint32_t dedup_ttl_ms; /* no effect (relay_config_retired) */

    /* Replica acknowledgement (docs/REDIS.md, "Redis replicas", "Redis Sentinel"). */
    uint32_t min_replicas;       /* replicas that must hold a batch before its mark; 0 = off */
    uint32_t replica_timeout_ms; /* how long WAIT waits for them */

    int log_level;    /* enum relay_log_level */
    char *log_format; /* "text" or "json": the daemon's log lines (relay/log.c) */

    /* Operations. */
    char *metrics_listen;         /* "host:port" of /metrics, /healthz, /readyz; "" = off */
    uint32_t observe_interval_ms; /* how often queue age, lag and admission are read */
    uint32_t pause_lag_entries;   /* pause a stream when a group lags this much; 0 = off */
    uint32_t resume_lag_entries;  /* ... and resume below this */
    uint32_t pause_queue_age_ms;  /* pause a stream at this queue age; 0 = off */
    uint32_t resume_queue_age_ms; /* ... and resume below this */

    /* Retention (docs/OPERATIONS.md, "Retention"). */
    uint32_t sent_retention_ms;       /* delete sent rows older than this; 0 = at publish */
    uint32_t stream_retention_ms;     /* trim acknowledged entries older than this; 0 = never */
    uint32_t stream_trim_max_hold_ms; /* trim past a group this far behind; 0 = never */
    int allow_short_stream_retention; /* no effect (relay_config_retired) */
    uint32_t vacuum_dead_rows;        /* VACUUM outbox.messages at this many dead rows; 0 = never */

    /* The keys without an effect that a source set: bit i for
     * relay_config_retired's i-th key (core/config.c sets them). */
    unsigned retired_set;
};

/* Fills every key with its documented default; strings are heap copies. */
void relay_config_init(struct relay_config *cfg);

/* Frees the strings; the struct can be initialised again afterwards. */
void relay_config_free(struct relay_config *cfg);

/* The messages one load keeps; past them, only the count goes on. */
#define RELAY_CONFIG_ERRORS_MAX 20

/* Every error of one load, in the order found. */
struct relay_config_errors {
    unsigned count; /* errors found; msg holds the first RELAY_CONFIG_ERRORS_MAX */
    char msg[RELAY_CONFIG_ERRORS_MAX][RELAY_CONFIG_ERR_MAX];
};

/*
 * Loads the file (if path is not NULL), then the environment (envp, a
 * NULL-terminated "NAME=value" array such as environ; NULL means none), then the
 * command-line overrides (argv[0..argc-1], already stripped of -c FILE and of
 * the program's own flags), then validates. Returns 0 on success; on failure
 * returns -1 with every error in errs, each one message such as
 *   relay.conf:12: batch_size = "0": must be between 1 and 10000
 * A bad line or value does not stop the reading: every source is read to its
 * end. The checks between keys (relay_config_validate_all) run only when
 * every value was read, since a refused value leaves its key as it was.
 * Values of secret keys are redacted in messages. errs is overwritten.
 */
int relay_config_load_all(struct relay_config *cfg, const char *path, char *const *envp, int argc,
                          char *const *argv, struct relay_config_errors *errs)
    __attribute__((warn_unused_result));

/* Where the configuration was read from: the file (NULL: none) and the
 * command line's overrides; a SIGHUP reads them again. */
struct relay_config_source {
    const char *config_path;
    int argc;
    char *const *argv;
};

/* relay_config_load_all with the first message only, in err. */
int relay_config_load(struct relay_config *cfg, const char *path, char *const *envp, int argc,
                      char *const *argv, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/*
 * Sets one key from a source: origin names the place for messages ("relay.conf:12",
 * "environment: OUTBOX_RELAY_BATCH_SIZE", "command line: --batch-size").
 * Returns 0 or -1 with a message in err.
 */
int relay_config_set(struct relay_config *cfg, const char *origin, const char *key,
                     const char *value, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/* Cross-key validation and derived fields (redis_url): 0, or -1 with every
 * broken rule added to errs (whose count it does not reset). */
int relay_config_validate_all(struct relay_config *cfg, struct relay_config_errors *errs)
    __attribute__((warn_unused_result));

/* relay_config_validate_all with the first message only, in err. */
int relay_config_validate(struct relay_config *cfg, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/*
 * For the command line's "did you mean": the candidate nearest to word, if
 * it is within two edits and the word is not shorter than the edits (no wild
 * guesses); NULL when none is.
 */
const char *relay_config_nearest(const char *word, const char *const *candidates, size_t n);

/* 1 when arg is "--key-with-dashes" or "--key-with-dashes=VALUE" of a key. */
int relay_config_is_flag(const char *arg);

/*
 * The option nearest to arg ("--check-confg", "--batchsize=5"), among the
 * program's own options[0..noptions-1] and every key's flag, as
 * relay_config_nearest judges: copied to out and returned, or NULL.
 */
const char *relay_config_nearest_flag(const char *arg, const char *const *options, size_t noptions,
                                      char *out, size_t outlen);

/* 0: stream_retention is no longer held against dedup_ttl, which has no
 * effect (there are no dedup records to outlive). */
int relay_config_short_stream_retention(const struct relay_config *cfg);

/*
 * Keys that are still accepted, so that deployed files keep working, but no
 * longer have an effect since the relay publishes by the batch (pipeline,
 * max_attempts, dedup_ttl, allow_short_stream_retention). For the i-th such
 * key that the file, the environment or the command line set, returns the
 * warning to log ("dedup_ttl no longer has an effect: ...; remove it"), and
 * NULL for one not set; NULL from i = RELAY_CONFIG_RETIRED_KEYS on.
 * --check-config prints these and the daemon logs them at start, one
 * WARNING per key.
 */
#define RELAY_CONFIG_RETIRED_KEYS 4
const char *relay_config_retired(const struct relay_config *cfg, unsigned i);

/*
 * Copies s into out with any password removed: "password=..." in a conninfo
 * string, and the password of user:password@ in a URI, become "***".
 * Always NUL-terminates; truncates to outlen.
 */
void relay_config_redact(const char *s, char *out, size_t outlen);

/* Parses a duration: "250ms", "5s", "2m", "1h" or a bare number of ms. */
int relay_config_parse_duration(const char *s, uint32_t *ms) __attribute__((warn_unused_result));
/* The shortest exact spelling of a duration, which parses back:
 * 86400000 -> "1d", 1500 -> "1500ms". */
void relay_config_format_duration(uint32_t ms, char *out, size_t outlen);

/* Writes every key with its effective value (secrets redacted), one per line,
 * as a configuration file that reads back. RELAY_CONFIG_DUMP_MAX bytes hold
 * any configuration's dump. */
#define RELAY_CONFIG_DUMP_MAX (64u * (2u * 4096u + 128u))
void relay_config_dump(const struct relay_config *cfg, char *out, size_t outlen);

/* Prints the key table (key, default, env variable, flag, meaning) for --help. */
void relay_config_help(char *out, size_t outlen);

/* The formats of relay_config_reference. */
enum relay_config_format {
    RELAY_CONFIG_FORMAT_ROFF, /* ".TP" entries for outbox-relay.conf(5) */
    RELAY_CONFIG_FORMAT_FILE, /* a configuration file with every key commented out */
};

/*
 * Writes the key table (meaning, default, values, environment variable, flag)
 * in the given format; the manual page and the example configuration are
 * generated from it at build time, so they list exactly the keys there are.
 */
void relay_config_reference(enum relay_config_format format, char *out, size_t outlen);

/*
 * For a reload (added with config.c): compares the running configuration cur
 * with a freshly loaded and validated next. Writes the names of the keys that
 * differ but are not reloadable (every key but log_level) to out, comma
 * separated ("batch_size, redis"), and returns how many there are; 0 means all
 * differences can be applied in place. A changed password file counts as a
 * change of redis_password_file.
 */
int relay_config_diff_restart(const struct relay_config *cur, const struct relay_config *next,
                              char *out, size_t outlen) __attribute__((warn_unused_result));

#endif
