/*
 * Configuration: one typed table with a row per key (pgbouncer's
 * bouncer_params[], redis's createIntConfig with bounds; core/config_table.c),
 * and small loaders here that feed it from a "key = value" file, then the
 * environment (OUTBOX_RELAY_<KEY>), then the command line (--key-name VALUE).
 * Every value
 * goes through the same conversion and bound checks whatever its source, so a
 * bad value gets the same rule text everywhere; only the origin in front of the
 * message changes:
 *
 *   relay.conf:12: batch_size = "0": must be between 1 and 10000
 *   environment: OUTBOX_RELAY_BATCH_SIZE = "0": must be between 1 and 10000
 *   command line: --batch-size = "0": must be between 1 and 10000
 *
 * Cross-key checks and derived fields (the parsed Redis URL, the password file)
 * are a separate pass, relay_config_validate, as in pgagroal
 * (core/config_validate.c); the dump and the documents of the table are
 * core/config_doc.c's. Nothing here connects anywhere, which is what
 * --check-config relies on. Values of secret keys only ever reach a message or
 * a dump through relay_config_redact.
 */
#include "common/compat.h"

#include "core/config.h"

#include "common/common.h"
#include "core/config_table.h"
#include "core/text.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define CFG_MUSTCHECK __attribute__((warn_unused_result))

/* A file line, after its newline is removed, may hold at most this many bytes. */
#define CFG_LINE_MAX 4096

/* File-local, reachable from tests/unit/test_config.c (OUTBOX_STATIC is empty there). */
OUTBOX_STATIC int config_parse_line(char *line, char **key, char **value, char *rule,
                                    size_t rulelen) CFG_MUSTCHECK;
OUTBOX_STATIC unsigned config_edit_distance(const char *a, const char *b);

static void *cfg_oom(void)
{
    /* Out of memory while a string value is stored: the process stops here,
     * with a message. This is the one place that does; everywhere else a
     * failed allocation is an error the caller handles. */
    fputs("outbox-relay: out of memory\n", stderr);
    abort();
}

static char *cfg_strdup(const char *s)
{
    char *p = strdup(s);

    if (p == NULL)
        return cfg_oom();
    return p;
}

/* ------------------------------------------------------------------------ */
/* Key lookup and the names a key has in each source.                        */

static const struct cfg_key *config_find(const char *name)
{
    size_t i;

    for (i = 0; i < relay_config_nkeys; i++)
        if (strcmp(relay_config_keys[i].name, name) == 0)
            return &relay_config_keys[i];
    return NULL;
}

/* Levenshtein distance, for "did you mean"; names are short, so O(n*m) is fine. */
OUTBOX_STATIC unsigned config_edit_distance(const char *a, const char *b)
{
    unsigned row[CFG_NAME_MAX + 1];
    size_t la = strlen(a), lb = strlen(b), i, j;

    if (lb > CFG_NAME_MAX || la > CFG_NAME_MAX)
        return (unsigned)-1;
    for (j = 0; j <= lb; j++)
        row[j] = (unsigned)j;
    for (i = 1; i <= la; i++) {
        unsigned diag = row[0]; /* row[i-1][j-1] */
        row[0] = (unsigned)i;
        for (j = 1; j <= lb; j++) {
            unsigned up = row[j]; /* row[i-1][j] */
            unsigned best = diag + (a[i - 1] == b[j - 1] ? 0u : 1u);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            diag = up;
            row[j] = best;
        }
    }
    return row[lb];
}

/* The key closest to name if it is within two edits (and not a wild guess). */
static const struct cfg_key *config_suggest(const char *name)
{
    const struct cfg_key *best = NULL;
    unsigned best_d = 3;
    size_t i;

    for (i = 0; i < relay_config_nkeys; i++) {
        unsigned d = config_edit_distance(name, relay_config_keys[i].name);
        if (d < best_d && d < strlen(name)) {
            best = &relay_config_keys[i];
            best_d = d;
        }
    }
    return best;
}

enum cfg_source { SRC_FILE, SRC_ENV, SRC_CLI };

/* `<where>: unknown key "name"` plus a suggestion spelled the way the source spells keys. */
static void config_unknown(const char *where, const char *name, enum cfg_source src, char *err,
                           size_t errlen)
{
    const struct cfg_key *k = config_suggest(name);
    char spelled[CFG_NAME_MAX + 32];

    if (k == NULL) {
        relay_config_err(err, errlen, "%s: unknown key \"%.*s\"", where, CFG_NAME_MAX, name);
        return;
    }
    if (src == SRC_ENV)
        relay_config_env_name(k->name, spelled, sizeof(spelled));
    else if (src == SRC_CLI)
        relay_config_flag_name(k->name, spelled, sizeof(spelled));
    else
        snprintf(spelled, sizeof(spelled), "\"%s\"", k->name);
    relay_config_err(err, errlen, "%s: unknown key \"%.*s\" (did you mean %s?)", where,
                     CFG_NAME_MAX, name, spelled);
}

/* ------------------------------------------------------------------------ */
/* Values.                                                                   */

static int cfg_parse_bool(const char *s, int *out)
{
    static const char *const yes[] = {"on", "true", "yes", "1"};
    static const char *const no[] = {"off", "false", "no", "0"};
    size_t i;

    for (i = 0; i < OUTBOX_ARRAY_LEN(yes); i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *out = 1;
            return 0;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *out = 0;
            return 0;
        }
    }
    return -1;
}

static char **cfg_str_field(struct relay_config *cfg, const struct cfg_key *k)
{
    return (char **)(void *)((char *)cfg + k->off);
}

static uint32_t *cfg_u32_field(struct relay_config *cfg, const struct cfg_key *k)
{
    return (uint32_t *)(void *)((char *)cfg + k->off);
}

static int *cfg_int_field(struct relay_config *cfg, const struct cfg_key *k)
{
    return (int *)(void *)((char *)cfg + k->off);
}

/* Converts value for key k and stores it; -1 with the broken rule in rule. */
static int config_convert(struct relay_config *cfg, const struct cfg_key *k, const char *value,
                          char *rule, size_t rulelen)
{
    char lo[32], hi[32];
    uint64_t v;
    const char *end;
    uint32_t ms;
    int b, r;

    switch (k->type) {
    case CFG_STRING:
    case CFG_SECRET_STRING: {
        char **field = cfg_str_field(cfg, k);
        if (strlen(value) > k->max) {
            snprintf(rule, rulelen, "must be at most %lu bytes", (unsigned long)k->max);
            return -1;
        }
        if (k->check != NULL && k->check(value, rule, rulelen) != 0)
            return -1;
        free(*field);
        *field = cfg_strdup(value);
        return 0;
    }
    case CFG_UINT:
        r = outbox_parse_digits(value, &v, &end);
        if (r == -1 || (r == 0 && *end != '\0')) {
            snprintf(rule, rulelen, "must be a whole number between %lu and %lu",
                     (unsigned long)k->min, (unsigned long)k->max);
            return -1;
        }
        if (r == -2 || v < k->min || v > k->max) {
            snprintf(rule, rulelen, "must be between %lu and %lu", (unsigned long)k->min,
                     (unsigned long)k->max);
            return -1;
        }
        *cfg_u32_field(cfg, k) = (uint32_t)v;
        return 0;
    case CFG_DURATION:
        relay_config_format_duration((uint32_t)k->min, lo, sizeof(lo));
        relay_config_format_duration((uint32_t)k->max, hi, sizeof(hi));
        if (relay_config_parse_duration(value, &ms) != 0) {
            snprintf(rule, rulelen,
                     "must be a duration between %s and %s: a whole number with a unit ms, s, m, "
                     "h or d (e.g. 250ms, 5s, 2m); a bare number means milliseconds",
                     lo, hi);
            return -1;
        }
        if (ms < k->min || ms > k->max) {
            snprintf(rule, rulelen, "must be between %s and %s", lo, hi);
            return -1;
        }
        *cfg_u32_field(cfg, k) = ms;
        return 0;
    case CFG_BOOL:
        if (cfg_parse_bool(value, &b) != 0) {
            snprintf(rule, rulelen, "must be on or off (or true/false, yes/no, 1/0)");
            return -1;
        }
        *cfg_int_field(cfg, k) = b;
        return 0;
    case CFG_LOGLEVEL:
        b = relay_config_parse_log_level(value);
        if (b < 0) {
            snprintf(rule, rulelen, "must be one of debug, info, warning, error");
            return -1;
        }
        *cfg_int_field(cfg, k) = b;
        return 0;
    }
    snprintf(rule, rulelen, "has an unknown type (bug)");
    return -1;
}

/* How relay_config_show shows a value of k. */
static int key_secrecy(const struct cfg_key *k)
{
    if (k->flags & CFG_OPAQUE)
        return CFG_SHOW_OPAQUE;
    return k->type == CFG_SECRET_STRING;
}

/* Sets k from value; a failure reads `<label> = "<value>": <rule>`. */
static int config_apply(struct relay_config *cfg, const struct cfg_key *k, const char *label,
                        const char *value, char *err, size_t errlen)
{
    char rule[RELAY_CONFIG_ERR_MAX];
    char shown[CFG_SHOW_MAX + 8];

    if (config_convert(cfg, k, value, rule, sizeof(rule)) == 0) {
        cfg->retired_set |= relay_config_retired_bit(k);
        return 0;
    }
    relay_config_show(value, key_secrecy(k), shown, sizeof(shown));
    relay_config_err(err, errlen, "%s = \"%s\": %s", label, shown, rule);
    return -1;
}

/* Does origin already end with a spelling of k ("environment: OUTBOX_RELAY_X")? */
static int config_origin_names(const char *origin, const struct cfg_key *k)
{
    char names[3][CFG_NAME_MAX + 32];
    size_t lo = strlen(origin), i;

    snprintf(names[0], sizeof(names[0]), "%s", k->name);
    relay_config_env_name(k->name, names[1], sizeof(names[1]));
    relay_config_flag_name(k->name, names[2], sizeof(names[2]));
    for (i = 0; i < 3; i++) {
        size_t ln = strlen(names[i]);
        if (ln <= lo && strcmp(origin + lo - ln, names[i]) == 0 &&
            (ln == lo || origin[lo - ln - 1] == ' '))
            return 1;
    }
    return 0;
}

int relay_config_set(struct relay_config *cfg, const char *origin, const char *key,
                     const char *value, char *err, size_t errlen)
{
    const struct cfg_key *k = config_find(key);
    char label[RELAY_CONFIG_ERR_MAX];

    if (k == NULL) {
        config_unknown(origin, key, SRC_FILE, err, errlen);
        return -1;
    }
    if (config_origin_names(origin, k))
        snprintf(label, sizeof(label), "%s", origin);
    else
        snprintf(label, sizeof(label), "%s: %s", origin, k->name);
    return config_apply(cfg, k, label, value, err, errlen);
}

/* ------------------------------------------------------------------------ */
/* Life cycle.                                                               */

void relay_config_init(struct relay_config *cfg)
{
    char err[RELAY_CONFIG_ERR_MAX];
    size_t i;

    memset(cfg, 0, sizeof(*cfg));
    for (i = 0; i < relay_config_nkeys; i++) {
        const struct cfg_key *k = &relay_config_keys[i];
        if (config_apply(cfg, k, k->name, k->defval, err, sizeof(err)) != 0) {
            /* A default that fails its own rule is a bug in the table above. */
            fprintf(stderr, "outbox-relay: bad built-in default: %s\n", err);
            abort();
        }
    }
    cfg->retired_set = 0; /* the defaults set no key */
}

void relay_config_free(struct relay_config *cfg)
{
    size_t i;

    if (cfg == NULL)
        return;
    for (i = 0; i < relay_config_nkeys; i++) {
        const struct cfg_key *k = &relay_config_keys[i];
        if (k->type == CFG_STRING || k->type == CFG_SECRET_STRING) {
            char **field = cfg_str_field(cfg, k);
            free(*field);
            *field = NULL;
        }
    }
    /* Also wipes the derived password. */
    memset(cfg, 0, sizeof(*cfg));
}

/* ------------------------------------------------------------------------ */
/* Sources.                                                                  */

/*
 * Splits one file line in place. Returns 1 with key and value pointing into
 * line, 0 for a blank or comment line, -1 with a message (without the
 * "file:line: " origin) in rule.
 */
OUTBOX_STATIC int config_parse_line(char *line, char **key, char **value, char *rule,
                                    size_t rulelen)
{
    char *p = line, *eq, *kend, *v, *w;

    while (isspace((unsigned char)*p))
        p++;
    if (*p == '\0' || *p == '#' || *p == ';')
        return 0;

    eq = strchr(p, '=');
    if (eq == NULL) {
        char shown[CFG_SHOW_MAX + 8];
        char *e = p + strlen(p);
        while (e > p && isspace((unsigned char)e[-1]))
            *--e = '\0';
        relay_config_show(p, 1, shown, sizeof(shown));
        snprintf(rule, rulelen, "missing \"=\" in \"%s\": write key = value", shown);
        return -1;
    }
    kend = eq;
    while (kend > p && isspace((unsigned char)kend[-1]))
        kend--;
    if (kend == p) {
        snprintf(rule, rulelen, "missing key before \"=\": write key = value");
        return -1;
    }
    *kend = '\0';

    v = eq + 1;
    while (isspace((unsigned char)*v))
        v++;
    if (*v == '"') {
        /* Unescape in place: the output never runs ahead of the input. */
        char *r = v + 1, *after;
        w = v;
        for (;;) {
            if (*r == '\0') {
                snprintf(rule, rulelen,
                         "%.*s: quoted value has no closing double quote: end it with \"",
                         CFG_NAME_MAX, p);
                return -1;
            }
            if (*r == '"')
                break;
            if (*r == '\\') {
                if (r[1] == '"' || r[1] == '\\') {
                    *w++ = r[1];
                    r += 2;
                    continue;
                }
                snprintf(rule, rulelen,
                         "%.*s: unknown escape in quoted value: only \\\" and \\\\ are allowed",
                         CFG_NAME_MAX, p);
                return -1;
            }
            *w++ = *r++;
        }
        after = r + 1;
        *w = '\0';
        while (isspace((unsigned char)*after))
            after++;
        if (*after != '\0' && *after != '#') {
            snprintf(rule, rulelen,
                     "%.*s: unexpected text after the closing quote: only a # comment may follow",
                     CFG_NAME_MAX, p);
            return -1;
        }
    } else {
        /* An unquoted '#' starts a comment at the start or after a blank. */
        for (w = v; *w; w++) {
            if (*w == '#' && (w == v || isspace((unsigned char)w[-1]))) {
                *w = '\0';
                break;
            }
        }
        w = v + strlen(v);
        while (w > v && isspace((unsigned char)w[-1]))
            *--w = '\0';
    }
    *key = p;
    *value = v;
    return 1;
}

/*
 * Reads the configuration text of f, named path in messages, line by line
 * into cfg, adding an error to errs for each line that is wrong and going on
 * with the next, so that one run reports every mistake of the file: 0, or -1
 * when any line was wrong. The file loader below opens the file for it.
 */
OUTBOX_STATIC int config_load_stream(struct relay_config *cfg, FILE *f, const char *path,
                                     struct relay_config_errors *errs);
OUTBOX_STATIC int config_load_stream(struct relay_config *cfg, FILE *f, const char *path,
                                     struct relay_config_errors *errs)
{
    char line[CFG_LINE_MAX + 2]; /* the line, its newline and the NUL */
    char rule[RELAY_CONFIG_ERR_MAX];
    char where[RELAY_CONFIG_ERR_MAX];
    char label[RELAY_CONFIG_ERR_MAX + CFG_NAME_MAX + 8];
    char shown[CFG_SHOW_MAX + 8];
    char err[RELAY_CONFIG_ERR_MAX];
    unsigned seen[CFG_KEYS_MAX] = {0}; /* line of each key's first setting */
    unsigned lineno = 0, before = errs->count;

    for (;;) {
        const struct cfg_key *k;
        char *key, *value;
        size_t len;
        int r;

        errno = 0;
        if (fgets(line, sizeof(line), f) == NULL)
            break;
        lineno++;
        len = strlen(line);
        if (len > 0 && line[len - 1] == '\n')
            line[--len] = '\0';
        if (len > CFG_LINE_MAX) {
            int c;
            relay_config_err(err, sizeof(err), "%s:%u: line is longer than %d bytes: shorten it",
                             path, lineno, CFG_LINE_MAX);
            relay_config_errors_add(errs, err);
            /* The rest of the line is not a line of its own. */
            while ((c = getc(f)) != EOF && c != '\n')
                ;
            continue;
        }
        snprintf(where, sizeof(where), "%s:%u", path, lineno);
        r = config_parse_line(line, &key, &value, rule, sizeof(rule));
        if (r < 0) {
            relay_config_err(err, sizeof(err), "%s: %s", where, rule);
            relay_config_errors_add(errs, err);
            continue;
        }
        if (r == 0)
            continue;
        k = config_find(key);
        if (k == NULL) {
            config_unknown(where, key, SRC_FILE, err, sizeof(err));
            relay_config_errors_add(errs, err);
            continue;
        }
        snprintf(label, sizeof(label), "%s: %.64s", where, k->name);
        if (seen[k - relay_config_keys]) {
            relay_config_show(value, key_secrecy(k), shown, sizeof(shown));
            relay_config_err(err, sizeof(err),
                             "%s = \"%s\": already set on line %u: set each key only once", label,
                             shown, seen[k - relay_config_keys]);
            relay_config_errors_add(errs, err);
            continue;
        }
        seen[k - relay_config_keys] = lineno;
        if (config_apply(cfg, k, label, value, err, sizeof(err)) != 0)
            relay_config_errors_add(errs, err);
    }
    if (ferror(f)) {
        relay_config_err(err, sizeof(err), "%s: cannot read the config file: %s", path,
                         strerror(errno ? errno : EIO));
        relay_config_errors_add(errs, err);
    }
    return errs->count == before ? 0 : -1;
}

/* The file at path into cfg; an error for each bad line, or for a file
 * that cannot be read. */
static void config_load_file(struct relay_config *cfg, const char *path,
                             struct relay_config_errors *errs)
{
    char err[RELAY_CONFIG_ERR_MAX];
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        relay_config_err(err, sizeof(err), "%s: cannot open the config file: %s", path,
                         strerror(errno));
        relay_config_errors_add(errs, err);
        return;
    }
    (void)config_load_stream(cfg, f, path, errs); /* its errors are in errs */
    fclose(f);
}

/* Each OUTBOX_RELAY_* variable of envp into cfg; an error for each bad one. */
static void config_load_env(struct relay_config *cfg, char *const *envp,
                            struct relay_config_errors *errs)
{
    const size_t plen = sizeof(CFG_ENV_PREFIX) - 1;
    char key[CFG_NAME_MAX + 1];
    char where[CFG_NAME_MAX + sizeof(CFG_ENV_PREFIX) + 32];
    char err[RELAY_CONFIG_ERR_MAX];
    size_t i;

    for (i = 0; envp != NULL && envp[i] != NULL; i++) {
        const char *e = envp[i], *eq = strchr(e, '=');
        const struct cfg_key *k = NULL;
        size_t nlen, j;

        if (eq == NULL || strncmp(e, CFG_ENV_PREFIX, plen) != 0)
            continue;
        nlen = (size_t)(eq - e);
        snprintf(where, sizeof(where), "environment: %.*s",
                 (int)(nlen - plen > CFG_NAME_MAX ? CFG_NAME_MAX + plen : nlen), e);
        if (nlen - plen <= CFG_NAME_MAX) {
            for (j = 0; j < nlen - plen; j++)
                key[j] = (char)tolower((unsigned char)e[plen + j]);
            key[j] = '\0';
            k = config_find(key);
        } else {
            snprintf(key, sizeof(key), "%.*s", CFG_NAME_MAX, e + plen);
        }
        if (k == NULL) {
            config_unknown(where, key, SRC_ENV, err, sizeof(err));
            relay_config_errors_add(errs, err);
            continue;
        }
        if (config_apply(cfg, k, where, eq + 1, err, sizeof(err)) != 0)
            relay_config_errors_add(errs, err);
    }
}

/* The "--key value" and "--key=value" overrides into cfg; an error for each
 * bad one. */
static void config_load_argv(struct relay_config *cfg, int argc, char *const *argv,
                             struct relay_config_errors *errs)
{
    char key[CFG_NAME_MAX + 1];
    char where[CFG_NAME_MAX + 32];
    char shown[CFG_SHOW_MAX + 8];
    char err[RELAY_CONFIG_ERR_MAX];
    int i;

    for (i = 0; i < argc; i++) {
        const char *a = argv[i], *name, *eq, *value;
        const struct cfg_key *k = NULL;
        size_t nlen, j;

        if (strncmp(a, "--", 2) != 0 || a[2] == '\0') {
            relay_config_show(a, 1, shown, sizeof(shown));
            relay_config_err(
                err, sizeof(err),
                "command line: \"%s\": unexpected argument: write --key=value or --key value",
                shown);
            relay_config_errors_add(errs, err);
            continue;
        }
        name = a + 2;
        eq = strchr(name, '=');
        nlen = eq != NULL ? (size_t)(eq - name) : strlen(name);
        snprintf(where, sizeof(where), "command line: --%.*s",
                 (int)(nlen > CFG_NAME_MAX ? CFG_NAME_MAX : nlen), name);
        if (nlen <= CFG_NAME_MAX) {
            for (j = 0; j < nlen; j++)
                key[j] = name[j] == '-' ? '_' : name[j];
            key[j] = '\0';
            k = config_find(key);
        } else {
            snprintf(key, sizeof(key), "%.*s", CFG_NAME_MAX, name);
        }
        if (eq != NULL) {
            value = eq + 1;
        } else if (i + 1 < argc) {
            value = argv[++i]; /* an unknown key's value goes with it */
        } else if (k != NULL) {
            relay_config_err(err, sizeof(err),
                             "%s: missing value: write --%.*s=VALUE or --%.*s VALUE", where,
                             (int)nlen, name, (int)nlen, name);
            relay_config_errors_add(errs, err);
            continue;
        } else {
            value = NULL;
        }
        if (k == NULL) {
            config_unknown(where, key, SRC_CLI, err, sizeof(err));
            relay_config_errors_add(errs, err);
            continue;
        }
        if (config_apply(cfg, k, where, value, err, sizeof(err)) != 0)
            relay_config_errors_add(errs, err);
    }
}

int relay_config_load_all(struct relay_config *cfg, const char *path, char *const *envp, int argc,
                          char *const *argv, struct relay_config_errors *errs)
{
    errs->count = 0;
    if (path != NULL)
        config_load_file(cfg, path, errs);
    config_load_env(cfg, envp, errs);
    config_load_argv(cfg, argc, argv, errs);
    /* A refused value leaves its key at the default or at an earlier
     * source's value, so the checks between keys would judge values nobody
     * chose ("postgres is not set" after a broken postgres line): they run
     * once every value reads. */
    if (errs->count > 0)
        return -1;
    return relay_config_validate_all(cfg, errs);
}

int relay_config_load(struct relay_config *cfg, const char *path, char *const *envp, int argc,
                      char *const *argv, char *err, size_t errlen)
{
    struct relay_config_errors errs;
    int rc = relay_config_load_all(cfg, path, envp, argc, argv, &errs);

    if (rc != 0)
        relay_config_err(err, errlen, "%s", errs.msg[0]);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Command lines.                                                            */

const char *relay_config_nearest(const char *word, const char *const *candidates, size_t n)
{
    const char *best = NULL;
    unsigned best_d = 3;
    size_t i;

    for (i = 0; i < n; i++) {
        unsigned d = config_edit_distance(word, candidates[i]);
        if (d < best_d && d < strlen(word)) {
            best = candidates[i];
            best_d = d;
        }
    }
    return best;
}

int relay_config_is_flag(const char *arg)
{
    char key[CFG_NAME_MAX + 1];
    size_t nlen, j;

    if (strncmp(arg, "--", 2) != 0)
        return 0;
    arg += 2;
    nlen = strcspn(arg, "=");
    if (nlen == 0 || nlen > CFG_NAME_MAX)
        return 0;
    for (j = 0; j < nlen; j++)
        key[j] = arg[j] == '-' ? '_' : arg[j];
    key[j] = '\0';
    return config_find(key) != NULL;
}

const char *relay_config_nearest_flag(const char *arg, const char *const *options, size_t noptions,
                                      char *out, size_t outlen)
{
    char name[CFG_NAME_MAX + 1], flag[CFG_NAME_MAX + 32];
    unsigned best_d = 3;
    int found = 0;
    size_t nlen = strcspn(arg, "="), i;

    if (nlen > CFG_NAME_MAX)
        return NULL;
    snprintf(name, sizeof(name), "%.*s", (int)nlen, arg);
    for (i = 0; i < noptions + relay_config_nkeys; i++) {
        unsigned d;
        if (i < noptions)
            snprintf(flag, sizeof(flag), "%s", options[i]);
        else
            relay_config_flag_name(relay_config_keys[i - noptions].name, flag, sizeof(flag));
        d = config_edit_distance(name, flag);
        if (d < best_d && d < nlen) {
            snprintf(out, outlen, "%s", flag);
            best_d = d;
            found = 1;
        }
    }
    return found ? out : NULL;
}

/* ------------------------------------------------------------------------ */
/* Reload.                                                                   */

static int config_key_differs(const struct relay_config *a, const struct relay_config *b,
                              const struct cfg_key *k)
{
    switch (k->type) {
    case CFG_STRING:
    case CFG_SECRET_STRING: {
        const char *x = *cfg_cstr_field(a, k), *y = *cfg_cstr_field(b, k);
        return strcmp(x != NULL ? x : "", y != NULL ? y : "") != 0;
    }
    case CFG_UINT:
    case CFG_DURATION:
        return *cfg_cu32_field(a, k) != *cfg_cu32_field(b, k);
    case CFG_BOOL:
    case CFG_LOGLEVEL:
        return *cfg_cint_field(a, k) != *cfg_cint_field(b, k);
    }
    return 1;
}

int relay_config_diff_restart(const struct relay_config *cur, const struct relay_config *next,
                              char *out, size_t outlen)
{
    struct relay_text_out o;
    int n = 0;
    size_t i;

    relay_text_out_init(&o, out, outlen);
    for (i = 0; i < relay_config_nkeys; i++) {
        const struct cfg_key *k = &relay_config_keys[i];
        int differs = config_key_differs(cur, next, k);

        /* Same path, new contents: the password changed all the same. */
        if (!differs && k->off == CFG_OFF(redis_password_file))
            differs = strcmp(cur->redis_url.password, next->redis_url.password) != 0;
        if (!differs || (k->flags & CFG_RELOADABLE))
            continue;
        relay_text_out_printf(&o, "%s%s", n ? ", " : "", k->name);
        n++;
    }
    return n;
}
