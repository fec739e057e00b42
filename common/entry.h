/*
 * A stream entry's fields (common/entry.c): the one lookup the consumer
 * library and the dlq commands share.
 */
#ifndef OUTBOX_ENTRY_H
#define OUTBOX_ENTRY_H

struct redisReply;

/*
 * The value of the field called name in fields, a flat array of names and
 * values as XRANGE and XREADGROUP return them; NULL when there is none, or
 * when fields is not an array. Names compare as bytes; a name or value that
 * is not a string does not count.
 */
const struct redisReply *outbox_entry_field(const struct redisReply *fields, const char *name);

#endif
