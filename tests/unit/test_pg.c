/* Unit tests of core/pg.c's schema advice: each version names the migration
 * file that brings it, and that file is in migrations/. */
#include "common/compat.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/pg.h"

#define MIGRATIONS RELAY_TEST_DATA "/../../migrations/"

/* The "NNN_name.sql" the advice names, copied into file. */
static void named_file(const char *advice, char *file, size_t len)
{
    const char *end = strstr(advice, ".sql");
    assert_non_null(end);
    const char *start = end;
    while (start > advice && start[-1] != ' ')
        start--;
    snprintf(file, len, "%.*s", (int)(end + 4 - start), start);
}

static void test_every_version_names_its_file(void **state)
{
    (void)state;
    char advice[600], file[128], path[512], number[8];
    for (int v = 1; v <= RELAY_SCHEMA_VERSION; v++) {
        assert_int_equal(relay_pg_schema_advice(v >= 5 ? v - 1 : 0, v, advice, sizeof(advice)), 1);
        named_file(advice, file, sizeof(file));
        snprintf(number, sizeof(number), "%03d_", v);
        assert_memory_equal(file, number, 4);
        snprintf(path, sizeof(path), MIGRATIONS "%s", file);
        if (access(path, R_OK) != 0)
            fail_msg("version %d names %s, which migrations/ lacks", v, file);
    }
    /* No migration newer than the version this build needs. */
    snprintf(number, sizeof(number), "%03d_", RELAY_SCHEMA_VERSION + 1);
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "ls " MIGRATIONS "%s*.sql >/dev/null 2>&1", number);
    assert_int_not_equal(system(cmd), 0);
}

static void test_what_the_advice_says(void **state)
{
    (void)state;
    char advice[600];
    assert_int_equal(relay_pg_schema_advice(15, 0, advice, sizeof(advice)), 0);
    assert_int_equal(relay_pg_schema_advice(10, 11, advice, sizeof(advice)), 1);
    assert_non_null(strstr(advice, "at version 10"));
    assert_non_null(strstr(advice, "version 11 is missing: apply 011_partitions.sql"));
    assert_non_null(strstr(advice, "/share/outbox-relay/migrations"));
    /* A table missing at set-up: the whole schema, or what came before 004. */
    assert_int_equal(
        relay_pg_schema_missing_advice("ERROR:  relation \"outbox.messages\" does not exist",
                                       advice, sizeof(advice)),
        1);
    assert_non_null(strstr(advice, "starting with 001_outbox_schema.sql"));
    assert_int_equal(
        relay_pg_schema_missing_advice("ERROR:  relation \"outbox.schema_version\" does not exist",
                                       advice, sizeof(advice)),
        1);
    assert_non_null(strstr(advice, "predates version 4"));
    assert_non_null(strstr(advice, "apply 004_schema_version.sql"));
    assert_int_equal(relay_pg_schema_missing_advice("ERROR:  relation \"orders\" does not exist",
                                                    advice, sizeof(advice)),
                     0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_version_names_its_file),
        cmocka_unit_test(test_what_the_advice_says),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
