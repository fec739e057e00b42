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

/* Most Sentinels, or cluster seed nodes, one list may name. */
#define RELAY_SENTINELS_MAX 8
#define RELAY_SEEDS_MAX 8

/* A host and a port. */
struct relay_addr {
    char host[256];
    int port;
};

/* Redis Sentinels to ask for the primary of the master named `master`. */
struct relay_sentinels {
    int n; /* 0: no Sentinel, connect to the URL's host and port */
    char master[128];
    struct relay_addr addr[RELAY_SENTINELS_MAX]; /* port 26379 by default */
    /* Sent with AUTH to each Sentinel before the question; empty: none. */
    char user[128];
    char password[256];
};

/* A parsed redis://[user:password@]host:port[/db] address. */
struct relay_redis_url {
    char host[256];
    int port;           /* 1..65535, default 6379 */
    char user[128];     /* empty when absent */
    char password[256]; /* empty when absent */
    int db;             /* 0..RELAY_URL_DB_MAX, default 0 */
    /* With n > 0, host and port are the primary the Sentinels name, asked
     * for at every connect (relay_sentinels_parse fills this in). */
    struct relay_sentinels sentinels;
    /* More addresses after the first, for a Redis Cluster's seed nodes:
     * "redis://host:port,host:port,..." (relay_url_parse_seeds). */
    int nseeds;
    struct relay_addr seeds[RELAY_SEEDS_MAX]; /* seeds[0] is host:port */
};

/*
 * Parses "redis://[user:password@]host[:port][/db][,host[:port]...]": a
 * URL, then more seed nodes of the same cluster (at most RELAY_SEEDS_MAX in
 * all), each host[:port] or a redis:// URL without a user, password or
 * database of its own. 0, or -1 with err; out is untouched on failure.
 */
int relay_url_parse_seeds(const char *list, struct relay_redis_url *out, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/*
 * Parses a comma-separated list of Sentinel addresses, "host[:port]" each
 * (IPv6 in brackets, port 26379 when absent, spaces around commas allowed),
 * and the master's name (1 to 127 bytes of A-Z a-z 0-9 . _ -) into out.
 * 0, or -1 with a message in err that says what is wrong; out is untouched
 * on failure.
 */
int relay_sentinels_parse(const char *list, const char *master, struct relay_sentinels *out,
                          char *err, size_t errlen) __attribute__((warn_unused_result));

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
