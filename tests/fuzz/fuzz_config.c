/*
 * The configuration file (core/config.c): the bytes are a relay.conf, read
 * line by line the way the daemon reads its -c FILE, then checked as a whole
 * (relay_config_validate) and shown again (relay_config_dump), as
 * "outbox-relay --print-config" does. A file that loads must also load again
 * from its own dump, and show the same dump (secrets stay redacted; see
 * skip_secrets).
 */
#include "common/compat.h"

#include "common/url.h"
#include "core/config.h"
#include "core/config_table.h" /* CFG_VALUE_MAX */

#include "fuzz.h"

/* File-local in core/config.c (OUTBOX_STATIC is empty in relay_unit). */
int config_load_stream(struct relay_config *cfg, FILE *f, const char *path,
                       struct relay_config_errors *errs);

/*
 * The dump after its first two lines, postgres and redis, the two secrets.
 * Their redaction hides the text after "password=" up to the end of the
 * value as libpq would read it, and a URL's password; shown again, a value
 * it already hid part of can lose more ("password=''x", a user name that
 * reads "password=..."): only ever more, never less.
 */
static const char *skip_secrets(const char *dump)
{
    const char *nl = strchr(dump, '\n');
    const char *nl2 = nl != NULL ? strchr(nl + 1, '\n') : NULL;
    if (strncmp(dump, "postgres = ", 11) != 0 || nl2 == NULL || strncmp(nl + 1, "redis = ", 8) != 0)
        fuzz_fail("the dump does not start with postgres and redis", dump);
    return nl2 + 1;
}

/*
 * Whether the redis URL is still one once redacted. Redaction may hide more
 * than the password on purpose (relay_config_redact: a user name that reads
 * "password=..." is hidden up to the next blank, host included); such a
 * dump cannot load again, and is not checked.
 */
static int redacts_to_url(const char *redis)
{
    char shown[CFG_VALUE_MAX + 1], err[256];
    struct outbox_redis_url u;
    relay_config_redact(redis, shown, sizeof(shown));
    return outbox_url_parse_seeds(shown, &u, err, sizeof(err)) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char dump[64 * 1024], again_dump[64 * 1024];
    static struct relay_config_errors errs; /* too big for a fuzzer's stack */
    char err[RELAY_CONFIG_ERR_MAX];
    struct relay_config cfg;
    FILE *f;

    if (size == 0)
        return 0;
    f = fmemopen((void *)(uintptr_t)data, size, "r");
    if (f == NULL)
        return 0;
    relay_config_init(&cfg);
    errs.count = 0;
    int rc = config_load_stream(&cfg, f, "fuzz.conf", &errs);
    if ((rc == 0) != (errs.count == 0))
        fuzz_fail("the file's result and its errors disagree", errs.count ? errs.msg[0] : "");
    fclose(f);
    if (rc == 0) {
        /* The password file is a path on this machine: not the input's. */
        free(cfg.redis_password_file);
        cfg.redis_password_file = NULL;
        if (relay_config_validate(&cfg, err, sizeof(err)) == 0 && redacts_to_url(cfg.redis)) {
            char diff[512];
            struct relay_config again;

            relay_config_dump(&cfg, dump, sizeof(dump));
            /* The dump is a configuration file of the same values. */
            relay_config_init(&again);
            f = fmemopen(dump, strlen(dump), "r");
            if (f == NULL)
                abort();
            errs.count = 0;
            if (config_load_stream(&again, f, "dump.conf", &errs) != 0 ||
                relay_config_validate(&again, err, sizeof(err)) != 0) {
                if (errs.count > 0)
                    snprintf(err, sizeof(err), "%s", errs.msg[0]);
                fprintf(stderr, "%s\n", dump);
                fuzz_fail("the dump does not load again", err);
            }
            fclose(f);
            relay_config_dump(&again, again_dump, sizeof(again_dump));
            if (strcmp(skip_secrets(dump), skip_secrets(again_dump)) != 0)
                fuzz_fail("the dump of the dump differs", again_dump);
            (void)relay_config_diff_restart(&cfg, &again, diff, sizeof(diff));
            relay_config_free(&again);
        }
    }
    relay_config_free(&cfg);
    return 0;
}
