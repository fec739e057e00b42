/* A stream entry's fields (common/entry.h). */
#include "common/compat.h"

#include "common/entry.h"

#include <hiredis/hiredis.h>
#include <string.h>

const redisReply *outbox_entry_field(const redisReply *fields, const char *name)
{
    if (fields == NULL || fields->type != REDIS_REPLY_ARRAY)
        return NULL;
    size_t n = strlen(name);
    for (size_t i = 0; i + 1 < fields->elements; i += 2) {
        const redisReply *k = fields->element[i], *v = fields->element[i + 1];
        if (k->type == REDIS_REPLY_STRING && k->len == n && memcmp(k->str, name, n) == 0 &&
            v->type == REDIS_REPLY_STRING)
            return v;
    }
    return NULL;
}
