/*
 * PostgreSQL as the daemon's observation thread and the operator commands
 * use it (core/pg.c): a blocking connection whose every wait has a deadline
 * and ends at once when a stop descriptor becomes readable, and the pieces
 * that the claiming connections share with them. The daemon's event loop
 * never calls the blocking ones (relay/pgsrc.c is its own, non-blocking).
 */
#ifndef RELAY_PG_H
#define RELAY_PG_H

#include <stddef.h>

#include "common/common.h"  /* OUTBOX_TOPIC_MAX */
#include "common/resolve.h" /* struct outbox_addrs */

struct outbox_buf;
struct pg_conn;
struct pg_result;
struct relay_config;

/* Hosts of one conninfo, as many as libpq's list may hold here. */
#define RELAY_PG_HOSTS_MAX 8

/*
 * The hosts a conninfo connects to, for looking their names up without
 * libpq, which would block (getaddrinfo): libpq then gets each address in
 * hostaddr, with the name kept in host for TLS's verify-full and the
 * password file.
 */
struct relay_pg_hosts {
    int n; /* hosts listed */
    char host[RELAY_PG_HOSTS_MAX][256];
    int nports; /* 0 (libpq's default), 1 (for every host) or n */
    char port[RELAY_PG_HOSTS_MAX][16];
    /* Each host's addresses, which the caller fills: a name's found, an
     * address's or a socket's own (outbox_host_is_address); none: a name
     * that did not resolve, left out. */
    struct outbox_addrs addrs[RELAY_PG_HOSTS_MAX];
};

/*
 * 1 when a host of conninfo (or of PGHOST, when it names none) is a name to
 * look up, with the list in h; 0 when none is (addresses, Unix sockets, a
 * hostaddr already given, a service file, a conninfo libpq will refuse):
 * libpq then connects as it stands.
 */
int relay_pg_hosts(const char *conninfo, struct relay_pg_hosts *h);

/* 1 when h->host[i] is a name to look up. */
int relay_pg_host_is_name(const struct relay_pg_hosts *h, int i);

/*
 * host, hostaddr and port for libpq listing every address found, a host
 * that resolved to several once per address, in order: libpq tries each in
 * turn. -1 when no host has an address, or the lists do not fit.
 */
int relay_pg_hosts_params(const struct relay_pg_hosts *h, char *host, size_t hostlen,
                          char *hostaddr, size_t addrlen, char *port, size_t portlen)
    __attribute__((warn_unused_result));

/* Puts host, hostaddr and port (when not empty), from relay_pg_hosts_params,
 * in keys and vals from index at on: where they override the conninfo
 * before them. The arrays must have room for three more and a NULL. */
void relay_pg_hosts_keys(const char **keys, const char **vals, int at, const char *host,
                         const char *hostaddr, const char *port);

/*
 * The one blocking PostgreSQL connect: within connect_timeout (stop_fd, which
 * may be -1, ends the wait at once when it becomes readable), with TCP
 * keepalives and tcp_user_timeout on both ends, the server's
 * statement_timeout set, and application_name as given. The connection comes
 * back in nonblocking mode (PQexec still blocks; relay_pg_exec adds a
 * client-side deadline). NULL with a message in err.
 */
struct pg_conn *relay_pg_open(const struct relay_config *cfg, const char *application_name,
                              int stop_fd, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/*
 * One statement on a connection from relay_pg_open, within
 * statement_timeout + connect_timeout, ended at once by stop_fd (may be -1).
 * The result (the caller clears it, and checks its status), or NULL with err
 * set; then the connection was closed and *pg is NULL.
 */
struct pg_result *relay_pg_exec(struct pg_conn **pg, const struct relay_config *cfg, int stop_fd,
                                const char *sql, int nparams, const char *const *params, char *err,
                                size_t errlen) __attribute__((warn_unused_result));

/* 1 when r (from relay_pg_exec) holds rows; else 0, with its error on one
 * line in err and r cleared (a NULL r leaves err as relay_pg_exec set it). */
int relay_pg_rows(struct pg_result *r, char *err, size_t errlen);

/* What to do about a connection libpq refused for TLS or a password (it says
 * what failed, not where to look): text to append to its message, "" when
 * there is nothing to add. */
const char *relay_pg_connect_hint(const char *libpq_message);

/*
 * Writes the text[] literal of items, each element double-quoted with its
 * backslashes and quotes escaped, so that no name can break out of its
 * element. 0, or -1 when out is too small.
 */
int relay_pg_text_array(char *out, size_t outlen, const char (*items)[OUTBOX_TOPIC_MAX + 1],
                        size_t n) __attribute__((warn_unused_result));

/* Appends s to the array literal being built in b as one element, after a
 * comma unless first: in quotes with backslashes and quotes escaped, or
 * unquoted NULL when s is NULL. The caller writes the braces; b->failed
 * says whether it all fit. */
void relay_pg_array_element(struct outbox_buf *b, int first, const char *s);

/* The outbox schema version this build needs (migrations/: every file from
 * 004 on records its own number in outbox.schema_version). */
#define RELAY_SCHEMA_VERSION 22
/* The same number in SQL text, made from it so that the two cannot differ. */
#define RELAY_PG_TEXT_(n) #n
#define RELAY_PG_TEXT(n) RELAY_PG_TEXT_(n)
#define RELAY_SCHEMA_VERSION_TEXT RELAY_PG_TEXT(RELAY_SCHEMA_VERSION)

/* The columns that read the schema's state from outbox.schema_version: the
 * newest version recorded, and the lowest this build needs that is not
 * (NULL when none is missing). */
#define RELAY_PG_SCHEMA_COLUMNS                                                                    \
    "coalesce(max(version), 0), (SELECT min(v) FROM generate_series(4, " RELAY_SCHEMA_VERSION_TEXT \
    ") AS v WHERE v NOT IN (SELECT version FROM outbox.schema_version))"

/*
 * What to apply to a schema that is behind: missing is the first version
 * this build needs that the database lacks (1: no outbox schema at all; 4:
 * one made before outbox.schema_version existed), version the newest it has.
 * Names the file and where an install keeps it. 1 with the advice in out, 0
 * when missing is 0 (nothing to apply).
 */
int relay_pg_schema_advice(int version, int missing, char *out, size_t outlen);

/*
 * The same for a set-up that failed with undefined_table (42P01) on
 * outbox.messages (no schema) or outbox.schema_version (made before 004):
 * 1 with the advice in out, 0 when the error names neither.
 */
int relay_pg_schema_missing_advice(const char *err, char *out, size_t outlen);

/*
 * Reads the schema's state on a connection from relay_pg_open: 1 with the
 * advice in out when a version this build needs is missing, 0 when none is,
 * -1 with the error in out when it cannot tell.
 */
int relay_pg_schema_check(struct pg_conn **pg, const struct relay_config *cfg, int stop_fd,
                          char *out, size_t outlen);

/* The first keys of the relays' two-key advisory locks
 * (migrations/012_partition_owners.sql, docs/DESIGN.md "Several relays"). */
#define RELAY_OWNER_MEMBER_NS "1869770093" /* a member slot, one per relay */
#define RELAY_OWNER_UNIT_NS "1869770100"   /* a partition, held by its owner */
#define RELAY_OWNER_FENCE_NS "1869770086"  /* shared by claims, alone at takeover */

#endif
