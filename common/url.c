/*
 * The redis:// URL parser, one for the whole tree: the daemon's configuration
 * (core/config.c) and the consumer library both parse their Redis address
 * here. Pure: no I/O, no logging; every problem comes back as a message in err
 * that says which part of the URL is wrong and never echoes the user name or
 * password.
 */
#include "common/compat.h"

#include "common/url.h"

#include "common/tls.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static void url_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void url_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;

    if (err == NULL || errlen == 0)
        return;
    va_start(ap, fmt);
    if (vsnprintf(err, errlen, fmt, ap) < 0)
        err[0] = '\0';
    va_end(ap);
}

int outbox_parse_digits(const char *s, uint64_t *out, const char **end)
{
    char *e;
    unsigned long long v;

    if (!isdigit((unsigned char)s[0]))
        return -1;
    errno = 0;
    v = strtoull(s, &e, 10);
    if (errno == ERANGE)
        return -2;
    *out = (uint64_t)v;
    *end = e;
    return 0;
}

static int url_hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Percent-decodes s[0..n) into out (cap bytes with the NUL). */
static int url_pct_decode(const char *s, size_t n, char *out, size_t cap)
{
    size_t i, o = 0;

    for (i = 0; i < n; i++) {
        char c = s[i];
        if (c == '%') {
            int hi = i + 2 < n ? url_hexval(s[i + 1]) : -1;
            int lo = i + 2 < n ? url_hexval(s[i + 2]) : -1;
            if (hi < 0 || lo < 0 || (hi == 0 && lo == 0))
                return -1;
            c = (char)(hi * 16 + lo);
            i += 2;
        }
        if (o + 1 >= cap)
            return -2;
        out[o++] = c;
    }
    out[o] = '\0';
    return 0;
}

static const char url_shape[] = "use redis://[user:password@]host[:port][/db]";

/*
 * The userinfo at p, if the URL has one: it ends at the last '@' (a raw '@'
 * in a password is a common slip). It must not contain a character that ends
 * the authority, or the URL means something else than it seems: ask for
 * percent-encoding instead. No message here ever echoes the userinfo.
 * Returns where the host starts, or NULL with err set.
 */
static const char *url_userinfo(const char *p, struct outbox_redis_url *u, char *err, size_t errlen)
{
    /* The last '@' before the query, whose file names may hold one. */
    const char *at = NULL;
    for (const char *q = p; *q != '\0' && *q != '?'; q++)
        if (*q == '@')
            at = q;
    if (at == NULL)
        return p;
    const char *colon = memchr(p, ':', (size_t)(at - p));
    const char *uend = colon != NULL ? colon : at;
    for (const char *q = p; q < at; q++) {
        /* Control characters (DEL too) and spaces: the URL would not read
         * back the same once shown, where they become '?'. */
        if (strchr("/?#[]@", *q) != NULL || (unsigned char)*q <= ' ' || *q == 0x7f) {
            url_err(err, errlen,
                    "the user name or password has a character that must be "
                    "percent-encoded (e.g. %%40 for @, %%2F for /)");
            return NULL;
        }
    }
    int r = url_pct_decode(p, (size_t)(uend - p), u->user, sizeof(u->user));
    if (r == -2) {
        url_err(err, errlen, "the user name is longer than %zu bytes", sizeof(u->user) - 1);
        return NULL;
    }
    if (r == 0 && colon != NULL) {
        r = url_pct_decode(colon + 1, (size_t)(at - colon - 1), u->password, sizeof(u->password));
        if (r == -2) {
            url_err(err, errlen, "the password is longer than %zu bytes", sizeof(u->password) - 1);
            return NULL;
        }
    }
    if (r != 0) {
        url_err(err, errlen,
                "bad percent-escape in the user name or password: write %%XX with two hex "
                "digits (not %%00)");
        return NULL;
    }
    return at + 1;
}

/* The host at p: a name or IPv4 address, or an IPv6 address in brackets.
 * Returns what follows it, or NULL with err set. */
static const char *url_host(const char *p, struct outbox_redis_url *u, char *err, size_t errlen)
{
    const char *host, *hend;
    if (*p == '[') {
        host = p + 1;
        hend = strchr(host, ']');
        if (hend == NULL) {
            url_err(err, errlen,
                    "IPv6 address has no closing \"]\": write it as redis://[::1]:6379");
            return NULL;
        }
        for (const char *q = host; q < hend; q++) {
            if (!isxdigit((unsigned char)*q) && *q != ':' && *q != '.') {
                url_err(err, errlen,
                        "IPv6 address \"%.*s\" has a character that is not allowed: use hex "
                        "digits, ':' and '.'",
                        (int)((size_t)(hend - host) > 64 ? 64 : (size_t)(hend - host)), host);
                return NULL;
            }
        }
        p = hend + 1;
        if (*p != '\0' && *p != ':' && *p != '/' && *p != '?') {
            url_err(err, errlen, "unexpected text after \"]\": %s", url_shape);
            return NULL;
        }
    } else {
        host = p;
        hend = host + strcspn(host, ":/?#");
        for (const char *q = host; q < hend; q++) {
            if (!isalnum((unsigned char)*q) && *q != '-' && *q != '.' && *q != '_') {
                url_err(err, errlen,
                        "host has a character that is not allowed: use a host name, an IPv4 "
                        "address or an IPv6 address in [brackets]");
                return NULL;
            }
        }
        p = hend;
    }
    size_t hlen = (size_t)(hend - host);
    if (hlen == 0) {
        url_err(err, errlen, "host is missing: %s", url_shape);
        return NULL;
    }
    if (hlen >= sizeof(u->host)) {
        url_err(err, errlen, "host is longer than %zu bytes", sizeof(u->host) - 1);
        return NULL;
    }
    snprintf(u->host, sizeof(u->host), "%.*s", (int)hlen, host);
    return p;
}

/* The TLS options of the query at p (after '?'): name=value pairs joined by
 * '&', each name once, values percent-decoded. 0, or -1 with err set. */
static int url_options(const char *p, struct outbox_redis_url *u, char *err, size_t errlen)
{
    static const char names[] = "ca_file, ca_dir, cert_file, key_file, server_name and verify";
    unsigned seen = 0;
    while (*p != '\0') {
        const char *end = p + strcspn(p, "&");
        const char *eq = memchr(p, '=', (size_t)(end - p));
        int nlen = (int)((size_t)((eq != NULL ? eq : end) - p) > 32
                             ? 32
                             : (size_t)((eq != NULL ? eq : end) - p));
        if (eq == NULL || eq == p) {
            url_err(err, errlen, "option \"%.*s\" has no value: write name=value (%s)", nlen, p,
                    names);
            return -1;
        }
        struct {
            const char *name;
            char *out;
            size_t cap;
        } opts[] = {
            {"ca_file", u->tls.ca_file, sizeof(u->tls.ca_file)},
            {"ca_dir", u->tls.ca_dir, sizeof(u->tls.ca_dir)},
            {"cert_file", u->tls.cert_file, sizeof(u->tls.cert_file)},
            {"key_file", u->tls.key_file, sizeof(u->tls.key_file)},
            {"server_name", u->tls.server_name, sizeof(u->tls.server_name)},
            {"verify", NULL, 0},
        };
        unsigned i = 0, n = sizeof(opts) / sizeof(opts[0]);
        while (i < n && !(strlen(opts[i].name) == (size_t)(eq - p) &&
                          strncmp(opts[i].name, p, (size_t)(eq - p)) == 0))
            i++;
        if (i == n) {
            url_err(err, errlen, "unknown option \"%.*s\": the options of a rediss:// URL are %s",
                    nlen, p, names);
            return -1;
        }
        if (seen & (1u << i)) {
            url_err(err, errlen, "option %s is given twice: keep one", opts[i].name);
            return -1;
        }
        seen |= 1u << i;
        char value[OUTBOX_TLS_PATH_MAX];
        int r = url_pct_decode(eq + 1, (size_t)(end - eq - 1), value,
                               opts[i].out != NULL ? opts[i].cap : sizeof(value));
        if (r == -2) {
            url_err(err, errlen, "option %s is longer than %zu bytes", opts[i].name,
                    (opts[i].out != NULL ? opts[i].cap : sizeof(value)) - 1);
            return -1;
        }
        if (r != 0) {
            url_err(err, errlen,
                    "bad percent-escape in option %s: write %%XX with two hex digits (not %%00)",
                    opts[i].name);
            return -1;
        }
        if (value[0] == '\0') {
            url_err(err, errlen, "option %s is empty: give a value or leave the option out",
                    opts[i].name);
            return -1;
        }
        if (opts[i].out != NULL) {
            memcpy(opts[i].out, value, strlen(value) + 1);
        } else if (strcmp(value, "full") == 0 || strcmp(value, "ca") == 0) {
            u->tls.verify_name = value[0] == 'f';
        } else {
            url_err(err, errlen,
                    "option verify must be full (the CA and the server's name, the default) or ca "
                    "(the CA only)");
            return -1;
        }
        p = *end == '&' ? end + 1 : end;
    }
    if ((u->tls.cert_file[0] != '\0') != (u->tls.key_file[0] != '\0')) {
        url_err(err, errlen,
                "cert_file and key_file go together: give both for a client certificate, or "
                "neither");
        return -1;
    }
    return 0;
}

/* ":port" and "/db" at p, each optional, then TLS options after '?' in a
 * rediss:// URL, and nothing else. 0, or -1 with err set. */
static int url_port_db(const char *p, struct outbox_redis_url *u, char *err, size_t errlen)
{
    uint64_t v;
    const char *q;
    if (*p == ':') {
        const char *pend = p + 1 + strcspn(p + 1, "/?#");
        int plen = (int)((size_t)(pend - p - 1) > 16 ? 16 : (size_t)(pend - p - 1));
        if (outbox_parse_digits(p + 1, &v, &q) != 0 || q != pend || v < 1 || v > 65535) {
            url_err(err, errlen, "port \"%.*s\" must be a number between 1 and 65535", plen, p + 1);
            return -1;
        }
        u->port = (int)v;
        p = pend;
    }
    if (*p == '/') {
        const char *dend = p + 1 + strcspn(p + 1, "?#");
        int dlen = (int)((size_t)(dend - p - 1) > 16 ? 16 : (size_t)(dend - p - 1));
        if (dend != p + 1) { /* "redis://host/" means database 0 */
            if (outbox_parse_digits(p + 1, &v, &q) != 0 || q != dend || v > OUTBOX_URL_DB_MAX) {
                url_err(err, errlen, "database \"%.*s\" must be a number between 0 and %d", dlen,
                        p + 1, OUTBOX_URL_DB_MAX);
                return -1;
            }
            u->db = (int)v;
        }
        p = dend;
    }
    if (*p == '?' && u->tls.on)
        return url_options(p + 1, u, err, errlen);
    if (*p == '?') {
        url_err(err, errlen,
                "options after \"?\" are TLS options: use them with rediss://, or remove them");
        return -1;
    }
    if (*p == '#') {
        url_err(err, errlen, "a \"#\" fragment is not allowed: remove it and %s", url_shape);
        return -1;
    }
    if (*p != '\0') {
        url_err(err, errlen, "unexpected text after the host: %s", url_shape);
        return -1;
    }
    return 0;
}

/* Parses "host[:port][,host[:port]...]" into out (at most max, default_port
 * when a port is left out); items may start with "redis://" when
 * allow_scheme. 0, or -1 with err. */
static int parse_addrs(const char *list, int default_port, int allow_scheme, const char *what,
                       const char *rule, struct outbox_addr *out, int max, int *n, char *err,
                       size_t errlen)
{
    const char *p = list != NULL ? list : "";
    *n = 0;
    for (;;) {
        while (*p == ' ')
            p++;
        const char *end = p + strcspn(p, ",");
        const char *last = end;
        while (last > p && last[-1] == ' ')
            last--;
        if (last == p) {
            url_err(err, errlen, "an address is missing: write host:port[,host:port...]");
            return -1;
        }
        if (*n == max) {
            url_err(err, errlen, "more than %d %s: list at most %d", max, what, max);
            return -1;
        }
        char item[300];
        if ((size_t)(last - p) >= sizeof(item)) {
            url_err(err, errlen, "an address is longer than %zu bytes", sizeof(item) - 1);
            return -1;
        }
        memcpy(item, p, (size_t)(last - p));
        item[last - p] = '\0';
        const char *at = item;
        if (allow_scheme && strncasecmp(at, "redis://", 8) == 0)
            at += 8;
        else if (allow_scheme && strncasecmp(at, "rediss://", 9) == 0)
            at += 9;
        if (strpbrk(at, "@/?#") != NULL) {
            url_err(err, errlen, "\"%.64s\" is not host[:port]: %s", item, rule);
            return -1;
        }
        struct outbox_redis_url u;
        memset(&u, 0, sizeof(u));
        u.port = default_port;
        const char *q = url_host(at, &u, err, errlen);
        if (q == NULL || url_port_db(q, &u, err, errlen) != 0)
            return -1;
        snprintf(out[*n].host, sizeof(out[*n].host), "%s", u.host);
        out[*n].port = u.port;
        (*n)++;
        if (*end == '\0')
            return 0;
        p = end + 1;
    }
}

int outbox_sentinels_parse(const char *list, const char *master, struct outbox_sentinels *out,
                           char *err, size_t errlen)
{
    struct outbox_sentinels s;
    memset(&s, 0, sizeof(s));
    size_t mlen = master != NULL ? strlen(master) : 0;
    if (mlen == 0 || mlen >= sizeof(s.master)) {
        url_err(err, errlen, "the master's name must be 1 to %zu bytes", sizeof(s.master) - 1);
        return -1;
    }
    for (size_t i = 0; i < mlen; i++) {
        unsigned char c = (unsigned char)master[i];
        if (!isalnum(c) && c != '.' && c != '_' && c != '-') {
            url_err(err, errlen,
                    "the master's name has a character that is not allowed: use A-Z a-z 0-9 . _ -");
            return -1;
        }
    }
    memcpy(s.master, master, mlen + 1);
    if (parse_addrs(list, 26379, 0, "Sentinels",
                    "a Sentinel address has no user, password or database", s.addr,
                    OUTBOX_SENTINELS_MAX, &s.n, err, errlen) != 0)
        return -1;
    *out = s;
    return 0;
}

int outbox_url_parse_seeds(const char *list, struct outbox_redis_url *out, char *err, size_t errlen)
{
    const char *comma = list != NULL ? strchr(list, ',') : NULL;
    char first[1024];
    if (comma == NULL)
        return outbox_url_parse(list, out, err, errlen);
    if ((size_t)(comma - list) >= sizeof(first)) {
        url_err(err, errlen, "the first address is longer than %zu bytes", sizeof(first) - 1);
        return -1;
    }
    memcpy(first, list, (size_t)(comma - list));
    first[comma - list] = '\0';
    struct outbox_redis_url u;
    int rc = outbox_url_parse(first, &u, err, errlen);
    memset(first, 0, sizeof(first)); /* it holds the password */
    if (rc != 0)
        return -1;
    int n = 0;
    if (parse_addrs(comma + 1, 6379, 1, "seed nodes",
                    "the seed nodes after the first take the first one's user, password and "
                    "database",
                    u.seeds + 1, OUTBOX_SEEDS_MAX - 1, &n, err, errlen) != 0)
        return -1;
    u.nseeds = n + 1;
    snprintf(u.seeds[0].host, sizeof(u.seeds[0].host), "%s", u.host);
    u.seeds[0].port = u.port;
    *out = u;
    return 0;
}

int outbox_url_parse(const char *url, struct outbox_redis_url *out, char *err, size_t errlen)
{
    struct outbox_redis_url u;
    memset(&u, 0, sizeof(u));
    u.port = 6379;
    if (url == NULL || url[0] == '\0') {
        url_err(err, errlen, "is empty: %s", url_shape);
        return -1;
    }
    size_t scheme = 8;
    if (strncasecmp(url, "rediss://", 9) == 0) {
        if (!OUTBOX_TLS) {
            url_err(err, errlen,
                    "rediss:// (TLS) needs outbox-relay built against hiredis 1.x with its SSL "
                    "library (hiredis_ssl: Debian 13's libhiredis-dev); this build's hiredis has "
                    "no TLS. Rebuild there, or connect with redis:// to a local stunnel that "
                    "speaks TLS to Redis (docs/REDIS.md, \"TLS to Redis\")");
            return -1;
        }
        u.tls.on = 1;
        u.tls.verify_name = 1;
        scheme = 9;
    } else if (strncasecmp(url, "redis://", 8) != 0) {
        url_err(err, errlen, "must start with redis:// or rediss://: %s", url_shape);
        return -1;
    }
    const char *p = url_userinfo(url + scheme, &u, err, errlen);
    if (p != NULL)
        p = url_host(p, &u, err, errlen);
    if (p == NULL || url_port_db(p, &u, err, errlen) != 0)
        return -1;
    u.nseeds = 1;
    snprintf(u.seeds[0].host, sizeof(u.seeds[0].host), "%s", u.host);
    u.seeds[0].port = u.port;
    *out = u;
    return 0;
}
