/* Unit tests of core/pg.c: the schema advice (each version names the
 * migration file that brings it, and that file is in migrations/), and the
 * host lists that the names looked up without libpq become. */
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

#include "common/buf.h"
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

/* Fills each host's addresses as a lookup would: a name's from found
 * (several separated by spaces, "" for a name that did not resolve), an
 * address's own. */
static void fill(struct relay_pg_hosts *h, const char *const *found)
{
    for (int i = 0; i < h->n; i++) {
        struct outbox_addrs *a = &h->addrs[i];
        a->n = 0;
        if (!relay_pg_host_is_name(h, i)) {
            size_t len = strnlen(h->host[i], sizeof(a->addr[0]) - 1);
            memcpy(a->addr[0], h->host[i], len);
            a->addr[0][len] = '\0';
            a->n = 1;
            continue;
        }
        char list[200];
        snprintf(list, sizeof(list), "%s", found[i]);
        for (char *save = NULL, *t = strtok_r(list, " ", &save); t != NULL;
             t = strtok_r(NULL, " ", &save))
            snprintf(a->addr[a->n++], sizeof(a->addr[0]), "%s", t);
    }
}

static void test_which_hosts_are_looked_up(void **state)
{
    (void)state;
    struct relay_pg_hosts h;
    unsetenv("PGHOST");
    unsetenv("PGHOSTADDR");
    unsetenv("PGPORT");
    assert_int_equal(relay_pg_hosts("host=db.example port=5433 dbname=app", &h), 1);
    assert_int_equal(h.n, 1);
    assert_string_equal(h.host[0], "db.example");
    assert_int_equal(h.nports, 1);
    assert_string_equal(h.port[0], "5433");
    assert_int_equal(relay_pg_hosts("postgresql://u@db.example:5433/app", &h), 1);
    assert_string_equal(h.host[0], "db.example");
    /* Nothing to look up: addresses, sockets, hostaddr given, a service,
     * no host at all, a conninfo libpq refuses. */
    assert_int_equal(relay_pg_hosts("host=127.0.0.1 dbname=app", &h), 0);
    assert_int_equal(relay_pg_hosts("host=::1 dbname=app", &h), 0);
    assert_int_equal(relay_pg_hosts("host=/var/run/postgresql dbname=app", &h), 0);
    assert_int_equal(relay_pg_hosts("host=db.example hostaddr=10.0.0.5", &h), 0);
    assert_int_equal(relay_pg_hosts("service=app", &h), 0);
    assert_int_equal(relay_pg_hosts("dbname=app", &h), 0);
    assert_int_equal(relay_pg_hosts("host='unterminated", &h), 0);
    assert_int_equal(relay_pg_hosts("host=a.example,b.example port=1,2,3", &h), 0);
    /* PGHOST when the conninfo names no host; PGHOSTADDR means addressed. */
    setenv("PGHOST", "env.example", 1);
    assert_int_equal(relay_pg_hosts("dbname=app", &h), 1);
    assert_string_equal(h.host[0], "env.example");
    setenv("PGHOSTADDR", "10.0.0.5", 1);
    assert_int_equal(relay_pg_hosts("dbname=app", &h), 0);
    unsetenv("PGHOSTADDR");
    unsetenv("PGHOST");
}

static void test_every_address_is_listed(void **state)
{
    (void)state;
    struct relay_pg_hosts h;
    char host[512], addr[512], port[128];
    /* One name, two addresses: the name twice, each address once. */
    assert_int_equal(relay_pg_hosts("host=db.example port=5433", &h), 1);
    fill(&h, (const char *const[]){"10.0.0.5 fd00::5"});
    assert_int_equal(
        relay_pg_hosts_params(&h, host, sizeof(host), addr, sizeof(addr), port, sizeof(port)), 0);
    assert_string_equal(host, "db.example,db.example");
    assert_string_equal(addr, "10.0.0.5,fd00::5");
    assert_string_equal(port, "5433,5433");
    /* A list: a name that did not resolve is left out, a socket takes no
     * hostaddr, ports stay with their hosts. */
    assert_int_equal(relay_pg_hosts("host=a.example,b.example,/tmp,10.0.0.9 port=1,2,3,4", &h), 1);
    fill(&h, (const char *const[]){"", "10.0.0.7", "", ""});
    assert_int_equal(
        relay_pg_hosts_params(&h, host, sizeof(host), addr, sizeof(addr), port, sizeof(port)), 0);
    assert_string_equal(host, "b.example,/tmp,10.0.0.9");
    assert_string_equal(addr, "10.0.0.7,,10.0.0.9");
    assert_string_equal(port, "2,3,4");
    /* No port given: none listed. */
    assert_int_equal(relay_pg_hosts("host=db.example", &h), 1);
    fill(&h, (const char *const[]){"10.0.0.5"});
    assert_int_equal(
        relay_pg_hosts_params(&h, host, sizeof(host), addr, sizeof(addr), port, sizeof(port)), 0);
    assert_string_equal(port, "");
    /* No address at all, or lists that do not fit: -1. */
    fill(&h, (const char *const[]){""});
    assert_int_equal(
        relay_pg_hosts_params(&h, host, sizeof(host), addr, sizeof(addr), port, sizeof(port)), -1);
    fill(&h, (const char *const[]){"10.0.0.1 10.0.0.2 10.0.0.3"});
    assert_int_equal(relay_pg_hosts_params(&h, host, 20, addr, sizeof(addr), port, sizeof(port)),
                     -1);
}

static void test_what_needs_no_lookup(void **state)
{
    (void)state;
    assert_true(outbox_host_is_address("127.0.0.1"));
    assert_true(outbox_host_is_address("::1"));
    assert_true(outbox_host_is_address("fd00::5"));
    assert_true(outbox_host_is_address(""));
    assert_true(outbox_host_is_address("/var/run/postgresql"));
    assert_true(outbox_host_is_address("@abstract"));
    assert_false(outbox_host_is_address("localhost"));
    assert_false(outbox_host_is_address("db.example"));
    assert_false(outbox_host_is_address("127.0.0.1.example"));
    assert_false(outbox_host_is_address("10.0.0"));
}

static void test_an_address_is_its_own(void **state)
{
    (void)state;
    struct outbox_addrs a;
    memset(&a, 'x', sizeof(a));
    outbox_addrs_of_address(&a, "fd00::5");
    assert_int_equal(a.n, 1);
    assert_string_equal(a.addr[0], "fd00::5");
    char path[2 * OUTBOX_ADDR_LEN];
    memset(path, 'p', sizeof(path) - 1);
    path[0] = '/';
    path[sizeof(path) - 1] = '\0';
    outbox_addrs_of_address(&a, path);
    assert_int_equal(a.n, 1);
    assert_int_equal(strlen(a.addr[0]), OUTBOX_ADDR_LEN - 1);
    assert_memory_equal(a.addr[0], path, OUTBOX_ADDR_LEN - 1);
}

/* Names, errors and timestamps go into statements as array literals: no
 * element can end its quotes early, and NULL stays a NULL. */
static void test_array_elements_are_quoted_and_escaped(void **state)
{
    (void)state;
    struct outbox_buf b;
    memset(&b, 0, sizeof(b));
    outbox_buf_puts(&b, "{");
    relay_pg_array_element(&b, 1, "plain");
    relay_pg_array_element(&b, 0, "a\"b\\c,d}");
    relay_pg_array_element(&b, 0, NULL);
    relay_pg_array_element(&b, 0, "");
    outbox_buf_puts(&b, "}");
    assert_false(b.failed);
    assert_string_equal(b.data, "{\"plain\",\"a\\\"b\\\\c,d}\",NULL,\"\"}");
    outbox_buf_free(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_version_names_its_file),
        cmocka_unit_test(test_what_the_advice_says),
        cmocka_unit_test(test_which_hosts_are_looked_up),
        cmocka_unit_test(test_every_address_is_listed),
        cmocka_unit_test(test_what_needs_no_lookup),
        cmocka_unit_test(test_an_address_is_its_own),
        cmocka_unit_test(test_array_elements_are_quoted_and_escaped),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
