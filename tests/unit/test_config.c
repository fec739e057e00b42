/*
 * Unit tests for core/config.c, with no server anywhere. The bad-config
 * table lives in tests/data/config: each NAME.conf comes with NAME.err, the
 * lines relay_config_load_all must report for it, one per error in the order
 * found (pgbouncer's hba_test.rules/.eval idea): a file with one mistake gets
 * exactly one message. The group setup chdir()s into that folder and loads "NAME.conf", so
 * the messages read "NAME.conf:3: ...". Files under good/ must load.
 *
 * This file is compiled together with core/config.c built with OUTBOX_STATIC
 * empty, which is how it reaches the file-local helpers declared below.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "core/config.h"
#include "relay/log.h"

#ifndef RELAY_TEST_DATA
#error "RELAY_TEST_DATA must name tests/data"
#endif

/* File-local in core/config.c (OUTBOX_STATIC). */
int config_parse_line(char *line, char **key, char **value, char *rule, size_t rulelen);
unsigned config_edit_distance(const char *a, const char *b);

#define ERRLEN RELAY_CONFIG_ERR_MAX

/*
 * The API takes char *const * (like environ and main's argv), and
 * -Wwrite-strings makes string literals const, so tests pass heap copies:
 * strv("A=1", "B=2", NULL) is a NULL-terminated vector for strv_free.
 */
static char **strv(const char *first, ...)
{
    char **v = calloc(16, sizeof(*v));
    const char *s = first;
    size_t n = 0;
    va_list ap;

    assert_non_null(v);
    va_start(ap, first);
    while (s != NULL) {
        assert_true(n < 15);
        v[n] = strdup(s);
        assert_non_null(v[n]);
        n++;
        s = va_arg(ap, const char *);
    }
    va_end(ap);
    return v;
}

static int strv_len(char **v)
{
    int n = 0;

    while (v[n] != NULL)
        n++;
    return n;
}

static void strv_free(char **v)
{
    size_t i;

    for (i = 0; v != NULL && v[i] != NULL; i++)
        free(v[i]);
    free(v);
}

static int setup_chdir(void **state)
{
    (void)state;
    return chdir(RELAY_TEST_DATA "/config");
}

/* Loads path (may be NULL) with env and argv; returns the rc, err filled. */
static int load(struct relay_config *cfg, const char *path, char *const *envp, int argc,
                char *const *argv, char *err)
{
    err[0] = '\0';
    relay_config_init(cfg);
    return relay_config_load(cfg, path, envp, argc, argv, err, ERRLEN);
}

/* Loads like load, keeping every error in errs. */
static int load_all(struct relay_config *cfg, const char *path, char *const *envp, int argc,
                    char *const *argv, struct relay_config_errors *errs)
{
    memset(errs, 0x5a, sizeof(*errs));
    relay_config_init(cfg);
    return relay_config_load_all(cfg, path, envp, argc, argv, errs);
}

/* Expects loading to fail with exactly `want` and nothing else; frees the config. */
static void expect_load_error(const char *path, char **envp, char **argv, const char *want)
{
    static struct relay_config_errors errs;
    struct relay_config cfg;
    char err[ERRLEN];

    assert_int_equal(load(&cfg, path, envp, argv != NULL ? strv_len(argv) : 0, argv, err), -1);
    assert_string_equal(err, want);
    relay_config_free(&cfg);
    assert_int_equal(load_all(&cfg, path, envp, argv != NULL ? strv_len(argv) : 0, argv, &errs),
                     -1);
    assert_int_equal(errs.count, 1);
    assert_string_equal(errs.msg[0], want);
    relay_config_free(&cfg);
    strv_free(envp);
    strv_free(argv);
}

/* ------------------------------------------------------------------------ */

static void test_defaults(void **state)
{
    struct relay_config cfg;

    (void)state;
    relay_config_init(&cfg);
    assert_string_equal(cfg.postgres, "");
    assert_string_equal(cfg.redis, "");
    assert_string_equal(cfg.redis_password_file, "");
    assert_string_equal(cfg.stream_prefix, "");
    assert_int_equal(cfg.batch_size, 500);
    assert_int_equal(cfg.max_attempts, 10);
    assert_int_equal(cfg.max_payload_bytes, 1048576);
    assert_int_equal(cfg.listen, 1);
    assert_int_equal(cfg.poll_interval_ms, 1000);
    assert_int_equal(cfg.connect_timeout_ms, 5000);
    assert_int_equal(cfg.publish_timeout_ms, 5000);
    assert_int_equal(cfg.statement_timeout_ms, 30000);
    assert_int_equal(cfg.reconnect_min_ms, 100);
    assert_int_equal(cfg.reconnect_max_ms, 30000);
    assert_int_equal(cfg.drain_timeout_ms, 10000);
    assert_int_equal(cfg.dedup_ttl_ms, 24u * 3600u * 1000u);
    assert_int_equal(cfg.sent_retention_ms, 15u * 60000u);
    assert_int_equal(cfg.stream_retention_ms, 24u * 3600u * 1000u);
    assert_int_equal(cfg.stream_trim_max_hold_ms, 0);
    assert_int_equal(cfg.vacuum_dead_rows, 100000);
    assert_int_equal(cfg.log_level, RELAY_LOG_INFO);
    relay_config_free(&cfg);
}

static void test_free_is_null_safe_and_repeatable(void **state)
{
    struct relay_config cfg;

    (void)state;
    relay_config_free(NULL);
    relay_config_init(&cfg);
    relay_config_free(&cfg);
    relay_config_free(&cfg);
    assert_null(cfg.postgres);
    relay_config_init(&cfg);
    assert_string_equal(cfg.stream_prefix, "");
    relay_config_free(&cfg);
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Reads the whole of a small file; the caller frees. */
static char *slurp(const char *path)
{
    char buf[4 * ERRLEN];
    size_t n;
    FILE *f = fopen(path, "r");

    if (f == NULL)
        return NULL;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strdup(buf);
}

/* The table: every NAME.conf in tests/data/config fails with the errors
 * of NAME.err, one a line, and with no other. */
static void test_bad_config_table(void **state)
{
    static struct relay_config_errors errs;
    char *names[256];
    size_t count = 0, i;
    int failures = 0;
    struct dirent *de;
    DIR *d;

    (void)state;
    d = opendir(".");
    assert_non_null(d);
    while ((de = readdir(d)) != NULL) {
        size_t len = strlen(de->d_name);
        if (len > 5 && strcmp(de->d_name + len - 5, ".conf") == 0) {
            assert_true(count < OUTBOX_ARRAY_LEN(names));
            names[count++] = strdup(de->d_name);
        }
    }
    closedir(d);
    qsort(names, count, sizeof(names[0]), cmp_names);
    assert_true(count >= 15);

    for (i = 0; i < count; i++) {
        struct relay_config cfg;
        char err[ERRLEN], errpath[300], *want, *line, *nl;
        unsigned nwant = 0, j;
        int rc;

        snprintf(errpath, sizeof(errpath), "%.*s.err", (int)(strlen(names[i]) - 5), names[i]);
        want = slurp(errpath);
        if (want == NULL) {
            print_error("%s: no %s next to it\n", names[i], errpath);
            failures++;
            free(names[i]);
            continue;
        }
        if (want[0] == '\0' || want[strlen(want) - 1] != '\n') {
            print_error("%s: must hold one error a line, each ending in a newline\n", errpath);
            failures++;
        }
        rc = load_all(&cfg, names[i], NULL, 0, NULL, &errs);
        for (line = want, j = 0; *line != '\0'; line = nl + 1, j++) {
            nl = strchr(line, '\n');
            if (nl == NULL)
                break;
            *nl = '\0';
            nwant++;
            if (j >= errs.count || strcmp(errs.msg[j], line) != 0) {
                print_error("%s: error %u\n  want: %s\n  got:  %s\n", names[i], j + 1, line,
                            j < errs.count ? errs.msg[j] : "(none)");
                failures++;
            }
        }
        if (rc != -1 || errs.count != nwant) {
            print_error("%s: rc %d, %u errors, want %u\n", names[i], rc, errs.count, nwant);
            failures++;
        }
        /* Whatever went wrong, a password never reaches a message. */
        for (j = 0; j < errs.count && j < RELAY_CONFIG_ERRORS_MAX; j++) {
            if (strstr(errs.msg[j], "hunter2") != NULL || strstr(errs.msg[j], "secret") != NULL) {
                print_error("%s: message leaks a password: %s\n", names[i], errs.msg[j]);
                failures++;
            }
        }
        relay_config_free(&cfg);
        /* relay_config_load gives the first of them. */
        rc = load(&cfg, names[i], NULL, 0, NULL, err);
        if (rc != -1 || strcmp(err, want) != 0) {
            print_error("%s: relay_config_load: rc %d, got %s\n", names[i], rc, err);
            failures++;
        }
        relay_config_free(&cfg);
        free(want);
        free(names[i]);
    }
    assert_int_equal(failures, 0);
}

/* Past RELAY_CONFIG_ERRORS_MAX messages, the errors are still counted. */
static void test_errors_are_capped_and_counted(void **state)
{
    static struct relay_config_errors errs;
    char path[] = "/tmp/outbox-config-test-XXXXXX";
    struct relay_config cfg;
    int fd = mkstemp(path);
    FILE *f;
    unsigned i;

    (void)state;
    assert_true(fd >= 0);
    f = fdopen(fd, "w");
    assert_non_null(f);
    for (i = 1; i <= RELAY_CONFIG_ERRORS_MAX + 5; i++)
        fprintf(f, "no_such_key_%u = 1\n", i);
    fclose(f);
    char **envp = strv("OUTBOX_RELAY_BATCH_SIZE=0", NULL);
    char **argv = strv("--listen", "maybe", NULL);
    assert_int_equal(load_all(&cfg, path, envp, strv_len(argv), argv, &errs), -1);
    unlink(path);
    /* The file's, then the environment's, then the command line's. */
    assert_int_equal(errs.count, RELAY_CONFIG_ERRORS_MAX + 7);
    assert_non_null(strstr(errs.msg[0], ":1: unknown key \"no_such_key_1\""));
    assert_non_null(
        strstr(errs.msg[RELAY_CONFIG_ERRORS_MAX - 1], ":20: unknown key \"no_such_key_20\""));
    relay_config_free(&cfg);
    strv_free(envp);
    strv_free(argv);

    /* Every source is read to its end, the checks between keys wait. */
    envp = strv("OUTBOX_RELAY_BATCH_SIZE=0", "OUTBOX_RELAY_LOG_LEVEL=loud", NULL);
    argv = strv("--batchsize", "5", "--poll-interval", "1ms", NULL);
    assert_int_equal(load_all(&cfg, NULL, envp, strv_len(argv), argv, &errs), -1);
    assert_int_equal(errs.count, 4);
    assert_string_equal(
        errs.msg[0], "environment: OUTBOX_RELAY_BATCH_SIZE = \"0\": must be between 1 and 10000");
    assert_string_equal(errs.msg[1], "environment: OUTBOX_RELAY_LOG_LEVEL = \"loud\": must be one "
                                     "of debug, info, warning, error");
    assert_string_equal(errs.msg[2], "command line: --batchsize: unknown key \"batchsize\" (did "
                                     "you mean --batch-size?)");
    assert_non_null(strstr(errs.msg[3], "command line: --poll-interval = \"1ms\": "));
    relay_config_free(&cfg);
    strv_free(envp);
    strv_free(argv);

    /* The required keys, all of them. */
    assert_int_equal(load_all(&cfg, NULL, NULL, 0, NULL, &errs), -1);
    assert_int_equal(errs.count, 2);
    assert_string_equal(errs.msg[0], "postgres is not set: set it in the config file, "
                                     "OUTBOX_RELAY_POSTGRES or --postgres");
    assert_string_equal(
        errs.msg[1], "redis is not set: set it in the config file, OUTBOX_RELAY_REDIS or --redis");
    relay_config_free(&cfg);
}

/* The command line's "did you mean", among the program's options and the keys. */
static void test_nearest_flag(void **state)
{
    static const char *const options[] = {"--help", "--check-config", "--print-config"};
    static const char *const words[] = {"failed", "dlq", "status"};
    char out[128];

    (void)state;
    assert_string_equal(relay_config_nearest_flag("--check-confg", options, 3, out, sizeof(out)),
                        "--check-config");
    assert_string_equal(relay_config_nearest_flag("--batchsize=5", options, 3, out, sizeof(out)),
                        "--batch-size");
    assert_string_equal(relay_config_nearest_flag("--hlep", options, 3, out, sizeof(out)),
                        "--help");
    assert_null(relay_config_nearest_flag("--frobnicate", options, 3, out, sizeof(out)));
    assert_true(relay_config_is_flag("--batch-size"));
    assert_true(relay_config_is_flag("--batch-size=5"));
    assert_false(relay_config_is_flag("--check-config"));
    assert_false(relay_config_is_flag("--"));
    assert_false(relay_config_is_flag("batch-size"));
    assert_string_equal(relay_config_nearest("staus", words, 3), "status");
    assert_string_equal(relay_config_nearest("faild", words, 3), "failed");
    assert_null(relay_config_nearest("xy", words, 3));
}

static void test_good_file_every_form(void **state)
{
    struct relay_config cfg;
    char err[ERRLEN];

    (void)state;
    assert_int_equal(load(&cfg, "good/full.conf", NULL, 0, NULL, err), 0);
    assert_string_equal(err, "");
    assert_string_equal(cfg.postgres, "host=db.internal dbname=app application_name=\"relay\" "
                                      "password='s3 cr3t #1' sslmode=disable");
    assert_string_equal(cfg.redis, "redis://relay:p%40ss@[::1]:6380/2");
    assert_string_equal(cfg.redis_url.host, "::1");
    assert_int_equal(cfg.redis_url.port, 6380);
    assert_int_equal(cfg.redis_url.db, 2);
    assert_string_equal(cfg.redis_url.user, "relay");
    assert_string_equal(cfg.redis_url.password, "p@ss");
    assert_string_equal(cfg.stream_prefix, "orders.v1:");
    assert_int_equal(cfg.batch_size, 250);
    assert_int_equal(cfg.max_attempts, 7);
    assert_int_equal(cfg.max_payload_bytes, 2097152);
    assert_int_equal(cfg.listen, 0);
    assert_int_equal(cfg.poll_interval_ms, 250);
    assert_int_equal(cfg.connect_timeout_ms, 2000);
    assert_int_equal(cfg.publish_timeout_ms, 3000);
    assert_int_equal(cfg.statement_timeout_ms, 60000);
    assert_int_equal(cfg.reconnect_min_ms, 50);
    assert_int_equal(cfg.reconnect_max_ms, 3600000);
    assert_int_equal(cfg.drain_timeout_ms, 15000);
    assert_int_equal(cfg.dedup_ttl_ms, 2u * 86400000u);
    assert_int_equal(cfg.sent_retention_ms, 90u * 60000u);
    assert_int_equal(cfg.stream_retention_ms, 36u * 3600000u);
    assert_int_equal(cfg.stream_trim_max_hold_ms, 7u * 86400000u);
    assert_int_equal(cfg.allow_short_stream_retention, 1);
    assert_int_equal(cfg.vacuum_dead_rows, 5000);
    assert_false(relay_config_short_stream_retention(&cfg));
    assert_int_equal(cfg.log_level, RELAY_LOG_WARNING);
    relay_config_free(&cfg);
}

/* pipeline, max_attempts, dedup_ttl and allow_short_stream_retention are
 * accepted with no effect: a warning for each one a source sets, none for
 * the defaults, and no rule against other keys (dedup_ttl below
 * publish_timeout, stream_retention below dedup_ttl). */
static void test_retired_keys_warn(void **state)
{
    struct relay_config cfg;
    char err[ERRLEN];
    unsigned i, n = 0;

    (void)state;
    assert_int_equal(load(&cfg, "good/minimal.conf", NULL, 0, NULL, err), 0);
    for (i = 0; i < RELAY_CONFIG_RETIRED_KEYS + 2; i++)
        assert_null(relay_config_retired(&cfg, i));
    relay_config_free(&cfg);

    char **envp = strv("OUTBOX_RELAY_PIPELINE=off", NULL);
    char **argv =
        strv("--dedup-ttl", "1s", "--publish-timeout", "10m", "--stream-retention", "1h", NULL);
    assert_int_equal(load(&cfg, "good/minimal.conf", envp, strv_len(argv), argv, err), 0);
    strv_free(envp);
    strv_free(argv);
    assert_string_equal(err, "");
    for (i = 0; i < RELAY_CONFIG_RETIRED_KEYS; i++) {
        const char *w = relay_config_retired(&cfg, i);
        if (w == NULL)
            continue;
        n++;
        assert_true(strncmp(w, "pipeline no longer has an effect", 32) == 0 ||
                    strncmp(w, "dedup_ttl no longer has an effect", 33) == 0);
        assert_non_null(strstr(w, "remove it"));
    }
    assert_int_equal(n, 2);
    assert_null(relay_config_retired(&cfg, RELAY_CONFIG_RETIRED_KEYS));
    relay_config_free(&cfg);

    /* full.conf sets max_attempts, dedup_ttl and allow_short_stream_retention. */
    assert_int_equal(load(&cfg, "good/full.conf", NULL, 0, NULL, err), 0);
    for (i = 0, n = 0; i < RELAY_CONFIG_RETIRED_KEYS; i++)
        n += relay_config_retired(&cfg, i) != NULL;
    assert_int_equal(n, 3);
    relay_config_free(&cfg);
}

static void test_missing_file(void **state)
{
    (void)state;
    expect_load_error("no-such.conf", NULL, NULL,
                      "no-such.conf: cannot open the config file: No such file or directory");
}

static void test_env_overrides_file(void **state)
{
    char **envp = strv("PATH=/usr/bin", "OUTBOX_RELAY_BATCH_SIZE=7",
                       "OUTBOX_RELAY_STREAM_PREFIX=env:", "OUTBOX_RELAY_LISTEN=no",
                       "OUTBOXRELAY_IGNORED=1", "OUTBOX_RELAY_NO_EQUALS_SIGN", NULL);
    struct relay_config cfg;
    char err[ERRLEN];

    (void)state;
    assert_int_equal(load(&cfg, "good/full.conf", envp, 0, NULL, err), 0);
    assert_int_equal(cfg.batch_size, 7);
    assert_string_equal(cfg.stream_prefix, "env:");
    assert_int_equal(cfg.listen, 0);
    assert_int_equal(cfg.max_attempts, 7); /* from the file, untouched */
    relay_config_free(&cfg);
    strv_free(envp);
}

static void test_cli_overrides_env(void **state)
{
    char **envp = strv("OUTBOX_RELAY_BATCH_SIZE=7", "OUTBOX_RELAY_LOG_LEVEL=debug",
                       "OUTBOX_RELAY_STREAM_PREFIX=env", NULL);
    char **argv1 = strv("--batch-size=9", "--listen", "off", NULL);
    char **argv2 = strv("--batch-size", "11", "--poll-interval=2m", "--stream-prefix=", NULL);
    struct relay_config cfg;
    char err[ERRLEN];

    (void)state;
    assert_int_equal(load(&cfg, "good/minimal.conf", envp, strv_len(argv1), argv1, err), 0);
    assert_int_equal(cfg.batch_size, 9);
    assert_int_equal(cfg.listen, 0);
    assert_int_equal(cfg.log_level, RELAY_LOG_DEBUG);
    assert_string_equal(cfg.stream_prefix, "env");
    relay_config_free(&cfg);

    assert_int_equal(load(&cfg, "good/minimal.conf", envp, strv_len(argv2), argv2, err), 0);
    assert_int_equal(cfg.batch_size, 11);
    assert_int_equal(cfg.poll_interval_ms, 120000);
    assert_string_equal(cfg.stream_prefix, "");
    assert_string_equal(cfg.redis_url.host, "localhost");
    relay_config_free(&cfg);
    strv_free(envp);
    strv_free(argv1);
    strv_free(argv2);
}

static void test_env_and_cli_without_file(void **state)
{
    char **envp = strv("OUTBOX_RELAY_POSTGRES=host=/run/postgresql password=secret",
                       "OUTBOX_RELAY_REDIS=redis://127.0.0.1:6399", NULL);
    struct relay_config cfg;
    char err[ERRLEN];

    (void)state;
    assert_int_equal(load(&cfg, NULL, envp, 0, NULL, err), 0);
    assert_string_equal(cfg.postgres, "host=/run/postgresql password=secret");
    assert_string_equal(cfg.redis_url.host, "127.0.0.1");
    assert_int_equal(cfg.redis_url.port, 6399);
    relay_config_free(&cfg);
    strv_free(envp);
}

static void test_env_errors(void **state)
{
    (void)state;
    expect_load_error(NULL, strv("OUTBOX_RELAY_BATCHSIZE=5", NULL), NULL,
                      "environment: OUTBOX_RELAY_BATCHSIZE: unknown key \"batchsize\" "
                      "(did you mean OUTBOX_RELAY_BATCH_SIZE?)");
    expect_load_error(NULL, strv("OUTBOX_RELAY_BIN=/usr/bin/outbox-relay", NULL), NULL,
                      "environment: OUTBOX_RELAY_BIN: unknown key \"bin\"");
    expect_load_error(NULL, strv("OUTBOX_RELAY_BATCH_SIZE=0", NULL), NULL,
                      "environment: OUTBOX_RELAY_BATCH_SIZE = \"0\": must be between 1 and 10000");
    expect_load_error(NULL, strv("OUTBOX_RELAY_REDIS=redis://app:hunter2@cache:99999", NULL), NULL,
                      "environment: OUTBOX_RELAY_REDIS = \"redis://app:***@cache:99999\": "
                      "port \"99999\" must be a number between 1 and 65535");
    expect_load_error(NULL, strv("OUTBOX_RELAY_LOG_LEVEL=info\nerror", NULL), NULL,
                      "environment: OUTBOX_RELAY_LOG_LEVEL = \"info?error\": "
                      "must be one of debug, info, warning, error");
}

static void test_cli_errors(void **state)
{
    (void)state;
    expect_load_error(NULL, NULL, strv("--batchsize=5", NULL),
                      "command line: --batchsize: unknown key \"batchsize\" "
                      "(did you mean --batch-size?)");
    expect_load_error(NULL, NULL, strv("--batch-size=5", "--listen", NULL),
                      "command line: --listen: missing value: write --listen=VALUE or "
                      "--listen VALUE");
    expect_load_error(NULL, NULL, strv("relay.conf", NULL),
                      "command line: \"relay.conf\": unexpected argument: write --key=value or "
                      "--key value");
    expect_load_error(NULL, NULL, strv("--batch-size", "0", NULL),
                      "command line: --batch-size = \"0\": must be between 1 and 10000");
    expect_load_error(
        NULL, NULL,
        strv("--postgres=host=db password=hunter2", "--redis", "redis://:hunter2@", NULL),
        "command line: --redis = \"redis://:***@\": host is missing: use "
        "redis://[user:password@]host[:port][/db]");
}

static void test_set_names_origin_once(void **state)
{
    struct relay_config cfg;
    char err[ERRLEN];

    (void)state;
    relay_config_init(&cfg);
    assert_int_equal(relay_config_set(&cfg, "relay.conf:12", "batch_size", "0", err, sizeof(err)),
                     -1);
    assert_string_equal(err, "relay.conf:12: batch_size = \"0\": must be between 1 and 10000");
    assert_int_equal(relay_config_set(&cfg, "environment: OUTBOX_RELAY_BATCH_SIZE", "batch_size",
                                      "0", err, sizeof(err)),
                     -1);
    assert_string_equal(
        err, "environment: OUTBOX_RELAY_BATCH_SIZE = \"0\": must be between 1 and 10000");
    assert_int_equal(
        relay_config_set(&cfg, "command line: --batch-size", "batch_size", "0", err, sizeof(err)),
        -1);
    assert_string_equal(err, "command line: --batch-size = \"0\": must be between 1 and 10000");
    assert_int_equal(relay_config_set(&cfg, "reload", "batchsize", "5", err, sizeof(err)), -1);
    assert_string_equal(err, "reload: unknown key \"batchsize\" (did you mean \"batch_size\"?)");

    /* Setting a string twice frees the first copy (ASan's leak check sees it). */
    assert_int_equal(relay_config_set(&cfg, "t", "stream_prefix", "a", err, sizeof(err)), 0);
    assert_int_equal(relay_config_set(&cfg, "t", "stream_prefix", "b", err, sizeof(err)), 0);
    assert_string_equal(cfg.stream_prefix, "b");
    assert_int_equal(relay_config_set(&cfg, "t", "log_level", "Error", err, sizeof(err)), 0);
    assert_int_equal(cfg.log_level, RELAY_LOG_ERROR);

    /* A failed set leaves the old value in place. */
    assert_int_equal(relay_config_set(&cfg, "t", "stream_prefix", "a b", err, sizeof(err)), -1);
    assert_string_equal(cfg.stream_prefix, "b");
    relay_config_free(&cfg);
}

static void test_durations(void **state)
{
    static const struct {
        const char *text;
        uint32_t ms;
    } good[] = {
        {"0", 0},
        {"250", 250},
        {"250ms", 250},
        {"5s", 5000},
        {"2m", 120000},
        {"1h", 3600000},
        {"1d", 86400000},
        {"007s", 7000},
        {"49d", 4233600000u},
        {"4294967295", 4294967295u},
        {"4294967ms", 4294967},
    };
    static const char *const bad[] = {
        "",
        "ms",
        "s",
        "-1s",
        "+1s",
        " 1s",
        "1s ",
        "1 s",
        "1.5s",
        "1S",
        "1sec",
        "1ms5",
        "50d",
        "4294967296",
        "99999999999999999999",
        "99999999999999999999ms",
        "1w",
        "0x10",
    };
    uint32_t ms;
    size_t i;

    (void)state;
    for (i = 0; i < OUTBOX_ARRAY_LEN(good); i++) {
        ms = 12345;
        assert_int_equal(relay_config_parse_duration(good[i].text, &ms), 0);
        assert_int_equal(ms, good[i].ms);
    }
    for (i = 0; i < OUTBOX_ARRAY_LEN(bad); i++) {
        ms = 12345;
        if (relay_config_parse_duration(bad[i], &ms) != -1)
            fail_msg("duration \"%s\" was accepted", bad[i]);
        assert_int_equal(ms, 12345);
    }
    assert_int_equal(relay_config_parse_duration(NULL, &ms), -1);
}

static void test_format_duration(void **state)
{
    char buf[32];

    (void)state;
    relay_config_format_duration(0, buf, sizeof(buf));
    assert_string_equal(buf, "0ms");
    relay_config_format_duration(1500, buf, sizeof(buf));
    assert_string_equal(buf, "1500ms");
    relay_config_format_duration(60000, buf, sizeof(buf));
    assert_string_equal(buf, "1m");
    relay_config_format_duration(90000, buf, sizeof(buf));
    assert_string_equal(buf, "90s");
    relay_config_format_duration(30u * 86400000u, buf, sizeof(buf));
    assert_string_equal(buf, "30d");
    relay_config_format_duration(7200000, buf, sizeof(buf));
    assert_string_equal(buf, "2h");
}

static void test_parse_line(void **state)
{
    static const struct {
        const char *line;
        int rc;
        const char *key, *value; /* or the rule when rc is -1 */
    } cases[] = {
        {"", 0, NULL, NULL},
        {"   \t ", 0, NULL, NULL},
        {"# comment = 1", 0, NULL, NULL},
        {"  ; comment = 1", 0, NULL, NULL},
        {"a=b", 1, "a", "b"},
        {"  a  =  b c  ", 1, "a", "b c"},
        {"a = b\r", 1, "a", "b"},
        {"a = b # comment", 1, "a", "b"},
        {"a = b\t# comment", 1, "a", "b"},
        {"a = b#not-a-comment", 1, "a", "b#not-a-comment"},
        {"a = # all comment", 1, "a", ""},
        {"a =", 1, "a", ""},
        {"a = x=y z=w", 1, "a", "x=y z=w"},
        {"a = \"\"", 1, "a", ""},
        {"a = \" spaced # kept \"", 1, "a", " spaced # kept "},
        {"a = \"q\\\"uote \\\\ back\"  # c", 1, "a", "q\"uote \\ back"},
        {"a = \"x\"\r", 1, "a", "x"},
        {"a b = c", 1, "a b", "c"},
        {"no equals here", -1, NULL, "missing \"=\" in \"no equals here\": write key = value"},
        {" = v", -1, NULL, "missing key before \"=\": write key = value"},
        {"a = \"open", -1, NULL, "a: quoted value has no closing double quote: end it with \""},
        {"a = \"ends in backslash\\", -1, NULL,
         "a: unknown escape in quoted value: only \\\" and \\\\ are allowed"},
        {"a = \"x\" y", -1, NULL,
         "a: unexpected text after the closing quote: only a # comment may follow"},
    };
    size_t i;

    (void)state;
    for (i = 0; i < OUTBOX_ARRAY_LEN(cases); i++) {
        char line[256], rule[ERRLEN];
        char *key = NULL, *value = NULL;
        int rc;

        snprintf(line, sizeof(line), "%s", cases[i].line);
        rule[0] = '\0';
        rc = config_parse_line(line, &key, &value, rule, sizeof(rule));
        if (rc != cases[i].rc)
            fail_msg("line \"%s\": rc %d, want %d (%s)", cases[i].line, rc, cases[i].rc, rule);
        if (rc == 1) {
            assert_string_equal(key, cases[i].key);
            assert_string_equal(value, cases[i].value);
        } else if (rc == -1) {
            assert_string_equal(rule, cases[i].value);
        }
    }
}

static void test_redact(void **state)
{
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"host=db password=secret dbname=app", "host=db password=*** dbname=app"},
        {"password = 'a b\\' c' host=db", "password = *** host=db"},
        {"PASSWORD=secret", "PASSWORD=***"},
        {"host=db", "host=db"},
        {"postgresql://u:secret@h/db", "postgresql://u:***@h/db"},
        {"postgresql://u@h/db?password=secret&sslmode=require",
         "postgresql://u@h/db?password=***&sslmode=require"},
        {"postgresql://h/db", "postgresql://h/db"},
        {"redis://u:secret@h:1/0", "redis://u:***@h:1/0"},
        {"redis://:secret@h", "redis://:***@h"},
        {"redis://user@h", "redis://user@h"},
        {"redis://u:se@cr/et@h:1", "redis://u:***@h:1"},
        {"redis://u:secret@[::1]:6380/2", "redis://u:***@[::1]:6380/2"},
        /* An empty password is hidden too, and the text after it shown once. */
        {"redis://u:@h:1/0", "redis://u:***@h:1/0"},
        {"redis://:@h", "redis://:***@h"},
        {"redic://s:@ca", "redic://s:***@ca"},
        {"", ""},
    };
    char out[128];
    size_t i;

    (void)state;
    for (i = 0; i < OUTBOX_ARRAY_LEN(cases); i++) {
        relay_config_redact(cases[i].in, out, sizeof(out));
        assert_string_equal(out, cases[i].out);
    }
    /* Truncation keeps the NUL and never shows what was cut off. */
    relay_config_redact("redis://u:secret@h:1/0", out, 12);
    assert_string_equal(out, "redis://u:*");
    relay_config_redact("password=secret", out, 1);
    assert_string_equal(out, "");
    relay_config_redact(NULL, out, sizeof(out));
    assert_string_equal(out, "");
}

static void test_sentinels_parse(void **state)
{
    struct outbox_sentinels s;
    char err[256];
    (void)state;

    assert_int_equal(outbox_sentinels_parse("10.0.0.1:26379, sentinel-b ,[::1]:5000", "mymaster",
                                            &s, err, sizeof(err)),
                     0);
    assert_int_equal(s.n, 3);
    assert_string_equal(s.master, "mymaster");
    assert_string_equal(s.addr[0].host, "10.0.0.1");
    assert_int_equal(s.addr[0].port, 26379);
    assert_string_equal(s.addr[1].host, "sentinel-b");
    assert_int_equal(s.addr[1].port, 26379);
    assert_string_equal(s.addr[2].host, "::1");
    assert_int_equal(s.addr[2].port, 5000);

    static const struct {
        const char *list, *master, *err;
    } bad[] = {
        {"", "m", "an address is missing: write host:port[,host:port...]"},
        {"a:1,,b:2", "m", "an address is missing: write host:port[,host:port...]"},
        {"a:1,", "m", "an address is missing: write host:port[,host:port...]"},
        {"a:0", "m", "port \"0\" must be a number between 1 and 65535"},
        {"u:p@a:1", "m",
         "\"u:p@a:1\" is not host[:port]: a Sentinel address has no user, password or database"},
        {"a:1", "", "the master's name must be 1 to 127 bytes"},
        {"a:1", "my master",
         "the master's name has a character that is not allowed: use A-Z a-z "
         "0-9 . _ -"},
        {"a,b,c,d,e,f,g,h,i", "m", "more than 8 Sentinels: list at most 8"},
    };
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(bad); i++) {
        memset(&s, 0x5a, sizeof(s));
        assert_int_equal(outbox_sentinels_parse(bad[i].list, bad[i].master, &s, err, sizeof(err)),
                         -1);
        assert_string_equal(err, bad[i].err);
        assert_int_equal(s.n, 0x5a5a5a5a); /* untouched */
    }
}

/* Sentinel keys come in pairs, and their errors name both. */
static void test_sentinel_keys(void **state)
{
    struct relay_config cfg;
    char err[ERRLEN];
    (void)state;

    expect_load_error(NULL,
                      strv("OUTBOX_RELAY_POSTGRES=dbname=app", "OUTBOX_RELAY_REDIS=redis://h:1/0",
                           "OUTBOX_RELAY_REDIS_SENTINEL=s1:26379", NULL),
                      NULL,
                      "redis_sentinel is set but redis_master is not: set both to find the "
                      "primary through Sentinel, or neither to connect to the address in redis");
    char **env =
        strv("OUTBOX_RELAY_POSTGRES=dbname=app", "OUTBOX_RELAY_REDIS=redis://:pw@h/2",
             "OUTBOX_RELAY_REDIS_SENTINEL=s1:26380,s2", "OUTBOX_RELAY_REDIS_MASTER=orders", NULL);
    assert_int_equal(load(&cfg, NULL, env, 0, NULL, err), 0);
    assert_int_equal(cfg.redis_url.sentinels.n, 2);
    assert_int_equal(cfg.redis_url.sentinels.addr[0].port, 26380);
    assert_string_equal(cfg.redis_url.sentinels.addr[1].host, "s2");
    assert_string_equal(cfg.redis_url.sentinels.master, "orders");
    assert_string_equal(cfg.redis_url.password, "pw");
    assert_int_equal(cfg.redis_url.db, 2);
    /* No password of the Sentinels' own unless given. */
    assert_string_equal(cfg.redis_url.sentinels.user, "");
    assert_string_equal(cfg.redis_url.sentinels.password, "");
    relay_config_free(&cfg);
    strv_free(env);

    /* The Sentinels' own user and password, apart from the primary's. */
    env = strv("OUTBOX_RELAY_POSTGRES=dbname=app", "OUTBOX_RELAY_REDIS=redis://:pw@h/2",
               "OUTBOX_RELAY_REDIS_SENTINEL=s1", "OUTBOX_RELAY_REDIS_MASTER=orders",
               "OUTBOX_RELAY_REDIS_SENTINEL_USER=watcher",
               "OUTBOX_RELAY_REDIS_SENTINEL_PASSWORD=s3cret-sentinel", NULL);
    assert_int_equal(load(&cfg, NULL, env, 0, NULL, err), 0);
    assert_string_equal(cfg.redis_url.sentinels.user, "watcher");
    assert_string_equal(cfg.redis_url.sentinels.password, "s3cret-sentinel");
    assert_string_equal(cfg.redis_url.password, "pw");
    relay_config_free(&cfg);
    strv_free(env);

    expect_load_error(NULL,
                      strv("OUTBOX_RELAY_POSTGRES=dbname=app", "OUTBOX_RELAY_REDIS=redis://h:1/0",
                           "OUTBOX_RELAY_REDIS_SENTINEL_PASSWORD=s3cret-sentinel", NULL),
                      NULL,
                      "redis_sentinel_password is set but redis_sentinel is not: it is sent to "
                      "the Sentinels only; set redis_sentinel and redis_master, or leave it out");
    expect_load_error(NULL,
                      strv("OUTBOX_RELAY_POSTGRES=dbname=app", "OUTBOX_RELAY_REDIS_SENTINEL=s1",
                           "OUTBOX_RELAY_REDIS_MASTER=orders",
                           "OUTBOX_RELAY_REDIS_SENTINEL_USER=watcher", NULL),
                      NULL,
                      "redis_sentinel_user is set but redis_sentinel_password is not: AUTH needs "
                      "the user's password");
}

static void test_url_parse_valid(void **state)
{
    static const struct {
        const char *url, *host, *user, *password;
        int port, db;
    } cases[] = {
        {"redis://host", "host", "", "", 6379, 0},
        {"redis://host:6380", "host", "", "", 6380, 0},
        {"redis://host/", "host", "", "", 6379, 0},
        {"REDIS://Cache.example.com:1/15", "Cache.example.com", "", "", 1, 15},
        {"redis://:pass@host:6381/3", "host", "", "pass", 6381, 3},
        {"redis://user:pass@[::1]:6380/2", "::1", "user", "pass", 6380, 2},
        {"redis://user@10.0.0.1", "10.0.0.1", "user", "", 6379, 0},
        {"redis://us%40er:p%40ss%3a%2F@host:65535", "host", "us@er", "p@ss:/", 65535, 0},
        {"redis://u:pa:ss@[fe80::1]", "fe80::1", "u", "pa:ss", 6379, 0},
        {"redis://@host", "host", "", "", 6379, 0},
    };
    struct outbox_redis_url u;
    char err[ERRLEN];
    size_t i;

    (void)state;
    for (i = 0; i < OUTBOX_ARRAY_LEN(cases); i++) {
        err[0] = '\0';
        if (outbox_url_parse(cases[i].url, &u, err, sizeof(err)) != 0)
            fail_msg("%s: %s", cases[i].url, err);
        assert_string_equal(u.host, cases[i].host);
        assert_string_equal(u.user, cases[i].user);
        assert_string_equal(u.password, cases[i].password);
        assert_int_equal(u.port, cases[i].port);
        assert_int_equal(u.db, cases[i].db);
    }
}

static void test_url_parse_invalid(void **state)
{
    static const struct {
        const char *url, *err;
    } cases[] = {
        {"", "is empty: use redis://[user:password@]host[:port][/db]"},
        {"redis://", "host is missing: use redis://[user:password@]host[:port][/db]"},
        {"redis://[]:1", "host is missing: use redis://[user:password@]host[:port][/db]"},
        {"redis://[::1]x",
         "unexpected text after \"]\": use redis://[user:password@]host[:port][/db]"},
        {"redis://[::g]",
         "IPv6 address \"::g\" has a character that is not allowed: use hex digits, "
         "':' and '.'"},
        {"redis://host:6379/0/1", "database \"0/1\" must be a number between 0 and 15"},
        {"redis://host:-1", "port \"-1\" must be a number between 1 and 65535"},
        {"redis://host:+80", "port \"+80\" must be a number between 1 and 65535"},
        {"redis://host:99999999999999999999", "port \"9999999999999999\" must be a number between "
                                              "1 and 65535"},
        {"redis://host#frag", "a \"#\" fragment is not allowed: remove it and use "
                              "redis://[user:password@]host[:port][/db]"},
        {"redis://host/0?ca_file=/ca.pem",
         "options after \"?\" are TLS options: use them with rediss://, or remove them"},
        {"redis://u:hunter2%00@host", "bad percent-escape in the user name or password: write "
                                      "%XX with two hex digits (not %00)"},
        {"redis://u:hunter2%4@host", "bad percent-escape in the user name or password: write "
                                     "%XX with two hex digits (not %00)"},
        {"redis://u:hunter2/x@host", "the user name or password has a character that must be "
                                     "percent-encoded (e.g. %40 for @, %2F for /)"},
        {"unix:///run/redis.sock", "must start with redis:// or rediss://: use "
                                   "redis://[user:password@]host[:port][/db]"},
    };
    struct outbox_redis_url u;
    char err[ERRLEN];
    size_t i;

    (void)state;
    for (i = 0; i < OUTBOX_ARRAY_LEN(cases); i++) {
        assert_int_equal(outbox_url_parse(cases[i].url, &u, err, sizeof(err)), -1);
        assert_string_equal(err, cases[i].err);
        assert_null(strstr(err, "hunter2"));
    }
}

/* rediss:// and its options where the build has TLS; refused, saying
 * why and what to do, where it has not. */
static void test_url_tls(void **state)
{
    struct outbox_redis_url u;
    char err[ERRLEN];

    (void)state;
    int rc = outbox_url_parse("rediss://u:hunter2@redis.example:6380/2?ca_file=/etc/ca%20x.pem&"
                              "cert_file=/c@1.pem&key_file=/k.pem&server_name=r.example&verify=ca",
                              &u, err, sizeof(err));
    if (!OUTBOX_TLS) {
        assert_int_equal(rc, -1);
        assert_non_null(
            strstr(err, "rediss:// (TLS) needs outbox-relay built against hiredis 1.x"));
        assert_non_null(strstr(err, "stunnel"));
        return;
    }
    assert_int_equal(rc, 0);
    assert_int_equal(u.tls.on, 1);
    assert_int_equal(u.tls.verify_name, 0);
    assert_string_equal(u.host, "redis.example");
    assert_string_equal(u.password, "hunter2");
    assert_int_equal(u.port, 6380);
    assert_int_equal(u.db, 2);
    assert_string_equal(u.tls.ca_file, "/etc/ca x.pem");
    assert_string_equal(u.tls.cert_file, "/c@1.pem");
    assert_string_equal(u.tls.key_file, "/k.pem");
    assert_string_equal(u.tls.server_name, "r.example");
    assert_int_equal(outbox_url_parse("REDISS://h", &u, err, sizeof(err)), 0);
    assert_int_equal(u.tls.on, 1);
    assert_int_equal(u.tls.verify_name, 1);
    assert_string_equal(u.tls.ca_file, "");
    /* The seeds after the first take its TLS options. */
    assert_int_equal(outbox_url_parse_seeds("rediss://a:1?ca_file=/ca.pem,b:2,rediss://c:3", &u,
                                            err, sizeof(err)),
                     0);
    assert_int_equal(u.nseeds, 3);
    assert_string_equal(u.seeds[2].host, "c");
    assert_string_equal(u.tls.ca_file, "/ca.pem");

    static const struct {
        const char *url, *err;
    } cases[] = {
        {"rediss://h?cafile=/x",
         "unknown option \"cafile\": the options of a rediss:// URL are ca_file, ca_dir, "
         "cert_file, key_file, server_name and verify"},
        {"rediss://h?ca_file", "option \"ca_file\" has no value: write name=value (ca_file, "
                               "ca_dir, cert_file, key_file, server_name and verify)"},
        {"rediss://h?ca_file=", "option ca_file is empty: give a value or leave the option out"},
        {"rediss://h?ca_file=/a&ca_file=/b", "option ca_file is given twice: keep one"},
        {"rediss://h?verify=none", "option verify must be full (the CA and the server's name, "
                                   "the default) or ca (the CA only)"},
        {"rediss://h?cert_file=/c.pem", "cert_file and key_file go together: give both for a "
                                        "client certificate, or neither"},
        {"rediss://h?ca_file=%zz", "bad percent-escape in option ca_file: write %XX with two hex "
                                   "digits (not %00)"},
    };
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(cases); i++) {
        assert_int_equal(outbox_url_parse(cases[i].url, &u, err, sizeof(err)), -1);
        assert_string_equal(err, cases[i].err);
    }
    char url[1024];
    snprintf(url, sizeof(url), "rediss://h?ca_file=/%0600d", 0);
    assert_int_equal(outbox_url_parse(url, &u, err, sizeof(err)), -1);
    assert_string_equal(err, "option ca_file is longer than 511 bytes");
}

static void test_url_size_caps(void **state)
{
    char url[1024], err[ERRLEN];
    struct outbox_redis_url u;

    (void)state;
    snprintf(url, sizeof(url), "redis://%0256d", 0);
    assert_int_equal(outbox_url_parse(url, &u, err, sizeof(err)), -1);
    assert_string_equal(err, "host is longer than 255 bytes");
    snprintf(url, sizeof(url), "redis://%0255d", 0);
    assert_int_equal(outbox_url_parse(url, &u, err, sizeof(err)), 0);
    assert_int_equal(strlen(u.host), 255);

    snprintf(url, sizeof(url), "redis://:%0256d@h", 0);
    assert_int_equal(outbox_url_parse(url, &u, err, sizeof(err)), -1);
    assert_string_equal(err, "the password is longer than 255 bytes");
    snprintf(url, sizeof(url), "redis://%0128d@h", 0);
    assert_int_equal(outbox_url_parse(url, &u, err, sizeof(err)), -1);
    assert_string_equal(err, "the user name is longer than 127 bytes");
}

static void test_password_file(void **state)
{
    struct relay_config cfg;
    char err[ERRLEN];

    (void)state;
    assert_int_equal(load(&cfg, "good/password.conf", NULL, 0, NULL, err), 0);
    assert_string_equal(cfg.redis_url.user, "relay");
    assert_string_equal(cfg.redis_url.password, "from file p@ss");
    /* Validating again starts from the URL and reads the file again. */
    assert_int_equal(relay_config_validate(&cfg, err, sizeof(err)), 0);
    assert_string_equal(cfg.redis_url.password, "from file p@ss");
    relay_config_free(&cfg);
}

/* A message about the Sentinels' password never shows it. */
static void test_opaque_secret_never_shown(void **state)
{
    (void)state;
    /* Set twice in a file: tests/data/config/sentinel-password-twice.conf. Too long: */
    char long_password[300];
    memset(long_password, 'p', sizeof(long_password) - 1);
    long_password[sizeof(long_password) - 1] = '\0';
    char setting[400];
    snprintf(setting, sizeof(setting), "OUTBOX_RELAY_REDIS_SENTINEL_PASSWORD=%s", long_password);
    struct relay_config cfg;
    char err[ERRLEN];
    char **env = strv("OUTBOX_RELAY_POSTGRES=dbname=app", "OUTBOX_RELAY_REDIS_SENTINEL=s1",
                      "OUTBOX_RELAY_REDIS_MASTER=m", setting, NULL);
    assert_int_equal(load(&cfg, NULL, env, 0, NULL, err), -1);
    assert_null(strstr(err, "ppp"));
    assert_non_null(strstr(err, "redis_sentinel_password"));
    relay_config_free(&cfg);
    strv_free(env);
}

static void test_dump_redacts(void **state)
{
    char **envp = strv("OUTBOX_RELAY_POSTGRES=host=db password=secret",
                       "OUTBOX_RELAY_REDIS=redis://u:secret@cache:6380/1",
                       "OUTBOX_RELAY_REDIS_SENTINEL=s1", "OUTBOX_RELAY_REDIS_MASTER=m",
                       "OUTBOX_RELAY_REDIS_SENTINEL_PASSWORD=secret-of-the-sentinels", NULL);
    struct relay_config cfg;
    char err[ERRLEN], out[4096];

    (void)state;
    assert_int_equal(load(&cfg, NULL, envp, 0, NULL, err), 0);
    relay_config_dump(&cfg, out, sizeof(out));
    assert_null(strstr(out, "secret"));
    assert_non_null(strstr(out, "postgres = \"host=db password=***\"\n"));
    assert_non_null(strstr(out, "redis = \"redis://u:***@cache:6380/1\"\n"));
    /* A password as a whole is hidden as a whole. */
    assert_non_null(strstr(out, "redis_sentinel_password = \"***\"\n"));
    assert_non_null(strstr(out, "batch_size = 500\n"));
    assert_non_null(strstr(out, "listen = on\n"));
    assert_non_null(strstr(out, "dedup_ttl = 1d\n"));
    assert_non_null(strstr(out, "reconnect_min = 100ms\n"));
    assert_non_null(strstr(out, "log_level = info\n"));
    assert_non_null(strstr(out, "stream_prefix = \"\"\n"));

    /* A small buffer is cut, still terminated. */
    relay_config_dump(&cfg, out, 10);
    assert_int_equal(strlen(out), 9);
    relay_config_free(&cfg);
    strv_free(envp);
}

static void test_help_lists_every_key(void **state)
{
    static const char *const want[] = {
        "postgres (required)",
        "OUTBOX_RELAY_POSTGRES, --postgres",
        "batch_size (default 500, 1..10000)",
        "OUTBOX_RELAY_BATCH_SIZE, --batch-size",
        "redis_password_file (default \"\")",
        "OUTBOX_RELAY_REDIS_PASSWORD_FILE, --redis-password-file",
        "poll_interval (default 1s, 10ms..1h)",
        "dedup_ttl (default 24h, 1s..30d)",
        "listen (default on, on|off)",
        "OUTBOX_RELAY_LOG_LEVEL, --log-level; reloaded on SIGHUP",
    };
    char out[8192];
    size_t i;

    (void)state;
    relay_config_help(out, sizeof(out));
    for (i = 0; i < OUTBOX_ARRAY_LEN(want); i++)
        if (strstr(out, want[i]) == NULL)
            fail_msg("help lacks \"%s\":\n%s", want[i], out);
    assert_true(strlen(out) < sizeof(out) - 1); /* nothing was cut */
}

static void test_edit_distance(void **state)
{
    (void)state;
    assert_int_equal(config_edit_distance("batch_size", "batch_size"), 0);
    assert_int_equal(config_edit_distance("batchsize", "batch_size"), 1);
    assert_int_equal(config_edit_distance("bacth_size", "batch_size"), 2);
    assert_int_equal(config_edit_distance("", "abc"), 3);
    assert_int_equal(config_edit_distance("kitten", "sitting"), 3);
}

static void test_diff_restart(void **state)
{
    char **envp = strv("OUTBOX_RELAY_POSTGRES=host=db", "OUTBOX_RELAY_REDIS=redis://cache", NULL);
    char **argv = strv("--log-level=debug", "--batch-size=5", "--redis=redis://cache2", NULL);
    struct relay_config a, b;
    char err[ERRLEN], out[256];

    (void)state;
    assert_int_equal(load(&a, NULL, envp, 0, NULL, err), 0);
    assert_int_equal(load(&b, NULL, envp, 0, NULL, err), 0);
    assert_int_equal(relay_config_diff_restart(&a, &b, out, sizeof(out)), 0);
    assert_string_equal(out, "");
    relay_config_free(&b);

    assert_int_equal(load(&b, NULL, envp, 1, argv, err), 0);
    assert_int_equal(relay_config_diff_restart(&a, &b, out, sizeof(out)), 0); /* log_level only */
    relay_config_free(&b);

    assert_int_equal(load(&b, NULL, envp, 3, argv, err), 0);
    assert_int_equal(relay_config_diff_restart(&a, &b, out, sizeof(out)), 2);
    assert_string_equal(out, "redis, batch_size");
    relay_config_free(&b);
    relay_config_free(&a);
    strv_free(envp);
    strv_free(argv);
}

static void test_log_level_names(void **state)
{
    (void)state;
    assert_int_equal(relay_config_parse_log_level("debug"), RELAY_LOG_DEBUG);
    assert_int_equal(relay_config_parse_log_level("info"), RELAY_LOG_INFO);
    assert_int_equal(relay_config_parse_log_level("WARNING"), RELAY_LOG_WARNING);
    assert_int_equal(relay_config_parse_log_level("error"), RELAY_LOG_ERROR);
    assert_int_equal(relay_config_parse_log_level("warn"), -1);
    assert_int_equal(relay_config_parse_log_level(""), -1);
    assert_int_equal(relay_config_parse_log_level(NULL), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_free_is_null_safe_and_repeatable),
        cmocka_unit_test(test_bad_config_table),
        cmocka_unit_test(test_errors_are_capped_and_counted),
        cmocka_unit_test(test_nearest_flag),
        cmocka_unit_test(test_good_file_every_form),
        cmocka_unit_test(test_retired_keys_warn),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_env_overrides_file),
        cmocka_unit_test(test_cli_overrides_env),
        cmocka_unit_test(test_env_and_cli_without_file),
        cmocka_unit_test(test_env_errors),
        cmocka_unit_test(test_cli_errors),
        cmocka_unit_test(test_set_names_origin_once),
        cmocka_unit_test(test_durations),
        cmocka_unit_test(test_format_duration),
        cmocka_unit_test(test_parse_line),
        cmocka_unit_test(test_redact),
        cmocka_unit_test(test_url_parse_valid),
        cmocka_unit_test(test_sentinels_parse),
        cmocka_unit_test(test_sentinel_keys),
        cmocka_unit_test(test_opaque_secret_never_shown),
        cmocka_unit_test(test_url_parse_invalid),
        cmocka_unit_test(test_url_tls),
        cmocka_unit_test(test_url_size_caps),
        cmocka_unit_test(test_password_file),
        cmocka_unit_test(test_dump_redacts),
        cmocka_unit_test(test_help_lists_every_key),
        cmocka_unit_test(test_edit_distance),
        cmocka_unit_test(test_diff_restart),
        cmocka_unit_test(test_log_level_names),
    };

    return cmocka_run_group_tests(tests, setup_chdir, NULL);
}
