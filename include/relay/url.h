/*
 * The redis:// URL parser (common/url.c), pure and shared: the daemon's
 * configuration and the consumer library both use it, so the two accept
 * exactly the same addresses with the same messages.
 */
#ifndef RELAY_URL_H
#define RELAY_URL_H

#include <stddef.h>
#include <stdint.h>

/* Highest database number a URL may select. */
#define RELAY_URL_DB_MAX 15

/* A parsed redis://[user:password@]host:port[/db] address. */
struct relay_redis_url {
    char host[256];
    int port;           /* 1..65535, default 6379 */
    char user[128];     /* empty when absent */
    char password[256]; /* empty when absent */
    int db;             /* 0..RELAY_URL_DB_MAX, default 0 */
};

/*
 * Parses a redis:// URL into out. 0 on success, -1 with a message in err that
 * says which part is wrong (the password is never echoed); out is untouched
 * on failure.
 */
int relay_url_parse(const char *url, struct relay_redis_url *out, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/*
 * Parses a run of decimal digits at s (no sign, no space: strtoull would take
 * both), for the URL's port and database and the configuration's numbers.
 * Returns 0 and sets *out and *end (after the digits), -1 if s does not start
 * with a digit, -2 if the number does not fit in 64 bits.
 */
int relay_parse_digits(const char *s, uint64_t *out, const char **end)
    __attribute__((warn_unused_result));

#endif
