/*
 * The redis:// URL parser (common/url.c), pure and shared: the daemon's
 * configuration and the consumer library both use it, so the two accept
 * exactly the same addresses with the same messages.
 */
#ifndef OUTBOX_URL_H
#define OUTBOX_URL_H

#include <stddef.h>
#include <stdint.h>

/* Highest database number a URL may select. */
#define OUTBOX_URL_DB_MAX 15

/* Most Sentinels, or cluster seed nodes, one list may name. */
#define OUTBOX_SENTINELS_MAX 8
#define OUTBOX_SEEDS_MAX 8

/* A host and a port. */
struct outbox_addr {
    char host[256];
    int port;
};

/* Redis Sentinels to ask for the primary of the master named `master`. */
struct outbox_sentinels {
    int n; /* 0: no Sentinel, connect to the URL's host and port */
    char master[128];
    struct outbox_addr addr[OUTBOX_SENTINELS_MAX]; /* port 26379 by default */
    /* Sent with AUTH to each Sentinel before the question; empty: none. */
    char user[128];
    char password[256];
};

/* Longest file name a TLS option may give. */
#define OUTBOX_TLS_PATH_MAX 512

/* TLS to Redis: a rediss:// URL and the options of its query,
 * "?ca_file=...&ca_dir=...&cert_file=...&key_file=...&server_name=...&verify=full|ca"
 * (common/tls.h). Every file name empty when not given. */
struct outbox_tls_options {
    int on;                              /* rediss:// */
    int verify_name;                     /* 1 (verify=full, the default); 0: verify=ca */
    char ca_file[OUTBOX_TLS_PATH_MAX];   /* PEM trust anchors; both empty: the system's */
    char ca_dir[OUTBOX_TLS_PATH_MAX];    /* a c_rehash'ed directory of them */
    char cert_file[OUTBOX_TLS_PATH_MAX]; /* client certificate (chain), for mutual TLS */
    char key_file[OUTBOX_TLS_PATH_MAX];  /* its private key */
    char server_name[256];               /* the name to check; empty: the host */
};

/* A parsed redis://[user:password@]host:port[/db] address. */
struct outbox_redis_url {
    char host[256];
    int port;           /* 1..65535, default 6379 */
    char user[128];     /* empty when absent */
    char password[256]; /* empty when absent */
    int db;             /* 0..OUTBOX_URL_DB_MAX, default 0 */
    /* With n > 0, host and port are the primary the Sentinels name, asked
     * for at every connect (outbox_sentinels_parse fills this in). */
    struct outbox_sentinels sentinels;
    /* More addresses after the first, for a Redis Cluster's seed nodes:
     * "redis://host:port,host:port,..." (outbox_url_parse_seeds). */
    int nseeds;
    struct outbox_addr seeds[OUTBOX_SEEDS_MAX]; /* seeds[0] is host:port */
    /* rediss://: every connection this URL leads to (the Sentinels, a
     * cluster's nodes) speaks TLS with these options. */
    struct outbox_tls_options tls;
};

/*
 * Parses "redis://[user:password@]host[:port][/db][,host[:port]...]" (or
 * rediss:// with TLS options, see struct outbox_tls_options): a
 * URL, then more seed nodes of the same cluster (at most OUTBOX_SEEDS_MAX in
 * all), each host[:port] or a redis:// URL without a user, password or
 * database of its own. 0, or -1 with err; out is untouched on failure.
 */
int outbox_url_parse_seeds(const char *list, struct outbox_redis_url *out, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/*
 * Parses a comma-separated list of Sentinel addresses, "host[:port]" each
 * (IPv6 in brackets, port 26379 when absent, spaces around commas allowed),
 * and the master's name (1 to 127 bytes of A-Z a-z 0-9 . _ -) into out.
 * 0, or -1 with a message in err that says what is wrong; out is untouched
 * on failure.
 */
int outbox_sentinels_parse(const char *list, const char *master, struct outbox_sentinels *out,
                           char *err, size_t errlen) __attribute__((warn_unused_result));

/*
 * Parses a redis:// or rediss:// URL into out. rediss:// is refused where
 * the build has no TLS (OUTBOX_TLS 0, common/tls.h). 0 on success, -1 with a message in err that
 * says which part is wrong (the password is never echoed); out is untouched
 * on failure.
 */
int outbox_url_parse(const char *url, struct outbox_redis_url *out, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/*
 * Parses a run of decimal digits at s (no sign, no space: strtoull would take
 * both), for the URL's port and database and the configuration's numbers.
 * Returns 0 and sets *out and *end (after the digits), -1 if s does not start
 * with a digit, -2 if the number does not fit in 64 bits.
 */
int outbox_parse_digits(const char *s, uint64_t *out, const char **end)
    __attribute__((warn_unused_result));

#endif
