/*
 * The configuration's key table and how keys and values are spelled
 * (core/config_table.c), which the other files of the configuration share:
 * core/config.c reads values through the table into a struct relay_config,
 * core/config_validate.c checks the keys against each other, and
 * core/config_doc.c shows them (the dump, --help, the manual page and the
 * example file). Private to those files: the rest of the project knows
 * core/config.h alone.
 */
#ifndef RELAY_CONFIG_TABLE_H
#define RELAY_CONFIG_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "core/config.h"

/* No string value, from any source, may be longer than this. */
#define CFG_VALUE_MAX 4096
/* Messages show at most this many bytes of a value, so the rule still fits. */
#define CFG_SHOW_MAX 64
/* Longest key name we look up; longer names are unknown by definition. */
#define CFG_NAME_MAX 64
/* OUTBOX_RELAY_<KEY> in the environment. */
#define CFG_ENV_PREFIX "OUTBOX_RELAY_"

/* Milliseconds in the units of a duration. */
#define CFG_SEC 1000ull
#define CFG_MIN (60 * CFG_SEC)
#define CFG_HOUR (60 * CFG_MIN)
#define CFG_DAY (24 * CFG_HOUR)

enum cfg_type {
    CFG_STRING,
    CFG_SECRET_STRING, /* a string that may hold a password: always redacted */
    CFG_UINT,          /* uint32_t within [min, max] */
    CFG_DURATION,      /* uint32_t milliseconds within [min, max] */
    CFG_BOOL,          /* int 0 or 1 */
    CFG_LOGLEVEL,      /* int, enum relay_log_level */
};

#define CFG_REQUIRED 0x1u   /* validation fails while the value is empty */
#define CFG_RELOADABLE 0x2u /* a SIGHUP reload applies it; others need a restart */
#define CFG_OPAQUE 0x4u     /* a secret string that is a password as a whole: shown as *** */
#define CFG_RETIRED 0x8u    /* accepted, no effect: a warning when set (relay_config_retired) */

/*
 * Extra check for a string key, run after the length cap. Returns 0, or -1 with
 * the rule that was broken in rule (what is allowed, not just what is wrong).
 */
typedef int (*cfg_check_fn)(const char *value, char *rule, size_t rulelen);

struct cfg_key { // NOLINT(clang-analyzer-optin.performance.Padding): in reading order
    const char *name;
    enum cfg_type type;
    size_t off; /* offset of the field in struct relay_config */
    uint64_t min, max;
    const char *defval; /* parsed by the same code as any other value */
    unsigned flags;
    cfg_check_fn check;
    const char *help;
};

#define CFG_OFF(field) offsetof(struct relay_config, field)

/* The bit of cfg->retired_set for k, a CFG_RETIRED key; 0 for any other. */
unsigned relay_config_retired_bit(const struct cfg_key *k);

/* The one place a key is defined, in the order the documents list the keys:
 * relay_config_nkeys rows, at most CFG_KEYS_MAX. */
#define CFG_KEYS_MAX 64
extern const struct cfg_key relay_config_keys[];
extern const size_t relay_config_nkeys;

/* The field of cfg that k describes. */
static inline char *const *cfg_cstr_field(const struct relay_config *cfg, const struct cfg_key *k)
{
    return (char *const *)(const void *)((const char *)cfg + k->off);
}

static inline const uint32_t *cfg_cu32_field(const struct relay_config *cfg,
                                             const struct cfg_key *k)
{
    return (const uint32_t *)(const void *)((const char *)cfg + k->off);
}

static inline const int *cfg_cint_field(const struct relay_config *cfg, const struct cfg_key *k)
{
    return (const int *)(const void *)((const char *)cfg + k->off);
}

/* OUTBOX_RELAY_BATCH_SIZE for batch_size. */
void relay_config_env_name(const char *key, char *out, size_t outlen);
/* --batch-size for batch_size. */
void relay_config_flag_name(const char *key, char *out, size_t outlen);

/*
 * The value as a message shows it: redacted for secret keys (secret 1: the
 * passwords in a URI or conninfo; CFG_SHOW_OPAQUE: the whole value), cut to
 * CFG_SHOW_MAX bytes with "..." so the rule after it is not lost, and with
 * control characters replaced so the message stays one line.
 */
#define CFG_SHOW_OPAQUE 2
void relay_config_show(const char *value, int secret, char *out, size_t outlen);

/* Adds msg to errs: kept among the first RELAY_CONFIG_ERRORS_MAX, counted always. */
void relay_config_errors_add(struct relay_config_errors *errs, const char *msg);

/* Formats a message into err; nothing when err is NULL or errlen 0. */
void relay_config_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
