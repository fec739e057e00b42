/*
 * PostgreSQL pieces that the daemon and the operator commands share (core/pg.c).
 */
#ifndef RELAY_PG_H
#define RELAY_PG_H

#include <stddef.h>

#include "common/common.h" /* OUTBOX_TOPIC_MAX */

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

/* The first keys of the relays' two-key advisory locks
 * (migrations/012_partition_owners.sql, docs/DESIGN.md "Several relays"). */
#define RELAY_OWNER_MEMBER_NS "1869770093" /* a member slot, one per relay */
#define RELAY_OWNER_UNIT_NS "1869770100"   /* a partition, held by its owner */
#define RELAY_OWNER_FENCE_NS "1869770086"  /* shared by claims, alone at takeover */

#endif
