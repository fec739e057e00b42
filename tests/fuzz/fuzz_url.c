/*
 * The Redis addresses (common/url.c): the bytes up to the first NUL are a
 * redis setting (a URL, or a URL and more cluster seed nodes) and a Sentinel
 * list; the bytes after it are the master's name. Every parse either fails
 * leaving its output untouched or gives addresses within their limits.
 */
#include "common/compat.h"

#include "common/url.h"

#include "fuzz.h"

/* The output of a parse that fails must not change: it starts as this. */
#define UNTOUCHED 0xa5

static void check_addr(const struct outbox_addr *a)
{
    if (a->port < 1 || a->port > 65535)
        fuzz_fail("port out of range", a->host);
    if (memchr(a->host, '\0', sizeof(a->host)) == NULL || a->host[0] == '\0')
        fuzz_fail("host empty or not terminated", NULL);
}

static void check_url(const struct outbox_redis_url *u)
{
    struct outbox_addr a;
    memcpy(a.host, u->host, sizeof(a.host));
    a.port = u->port;
    check_addr(&a);
    if (u->db < 0 || u->db > OUTBOX_URL_DB_MAX)
        fuzz_fail("database out of range", u->host);
    if (memchr(u->user, '\0', sizeof(u->user)) == NULL ||
        memchr(u->password, '\0', sizeof(u->password)) == NULL)
        fuzz_fail("user or password not terminated", NULL);
    if (u->nseeds < 1 || u->nseeds > OUTBOX_SEEDS_MAX)
        fuzz_fail("seed count out of range", u->host);
    for (int i = 0; i < u->nseeds; i++)
        check_addr(&u->seeds[i]);
    if (strcmp(u->seeds[0].host, u->host) != 0 || u->seeds[0].port != u->port)
        fuzz_fail("the first seed is not the URL's address", u->host);
}

static int untouched(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != UNTOUCHED)
            return 0;
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512];
    char *text = fuzz_string(data, size);
    size_t first = strlen(text);
    const char *master = first < size ? text + first + 1 : "mymaster";
    struct outbox_redis_url *u = malloc(sizeof(*u));
    struct outbox_sentinels *s = malloc(sizeof(*s));
    if (u == NULL || s == NULL)
        abort();

    memset(u, UNTOUCHED, sizeof(*u));
    if (outbox_url_parse(text, u, err, sizeof(err)) == 0) {
        check_url(u);
        if (u->nseeds != 1)
            fuzz_fail("a single URL with more than one seed", text);
    } else if (!untouched(u, sizeof(*u))) {
        fuzz_fail("outbox_url_parse changed its output on failure", err);
    }

    memset(u, UNTOUCHED, sizeof(*u));
    if (outbox_url_parse_seeds(text, u, err, sizeof(err)) == 0)
        check_url(u);
    else if (!untouched(u, sizeof(*u)))
        fuzz_fail("outbox_url_parse_seeds changed its output on failure", err);

    memset(s, UNTOUCHED, sizeof(*s));
    if (outbox_sentinels_parse(text, master, s, err, sizeof(err)) == 0) {
        if (s->n < 1 || s->n > OUTBOX_SENTINELS_MAX)
            fuzz_fail("Sentinel count out of range", text);
        if (strcmp(s->master, master) != 0)
            fuzz_fail("the master's name changed", master);
        for (int i = 0; i < s->n; i++)
            check_addr(&s->addr[i]);
    } else if (!untouched(s, sizeof(*s))) {
        fuzz_fail("outbox_sentinels_parse changed its output on failure", err);
    }

    uint64_t v;
    const char *end;
    if (outbox_parse_digits(text, &v, &end) == 0 && (end <= text || end > text + first))
        fuzz_fail("outbox_parse_digits ended outside the text", text);

    free(u);
    free(s);
    free(text);
    return 0;
}
