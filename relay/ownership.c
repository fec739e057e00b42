/*
 * The assignment of partitions to relays (include/relay/ownership.h).
 */
#include "relay/compat.h"

#include "relay/ownership.h"

#include <string.h>

#include "relay/keys.h"

int32_t relay_unit_key(const char *topic, size_t topic_len, uint32_t partition)
{
    return (int32_t)((relay_partition_hash(topic, topic_len) + partition) & 0x7fffffffu);
}

long relay_member_position(const int32_t *members, size_t nmembers, int32_t slot)
{
    for (size_t i = 0; i < nmembers; i++)
        if (members[i] == slot)
            return (long)i;
    return -1;
}

static const struct relay_unit *find(const struct relay_unit *units, size_t n, const char *topic,
                                     uint32_t partition)
{
    for (size_t i = 0; i < n; i++)
        if (units[i].partition == partition && strcmp(units[i].topic, topic) == 0)
            return &units[i];
    return NULL;
}

long relay_units_plan(const struct relay_unit *old, size_t nold,
                      const struct relay_topic_parts *topics, size_t ntopics, size_t nmembers,
                      long me, struct relay_unit *out, size_t cap)
{
    size_t n = 0, flat = 0;
    for (size_t t = 0; t < ntopics; t++) {
        for (uint32_t p = 0; p < topics[t].partitions; p++, flat++) {
            if (n == cap)
                return -1;
            struct relay_unit *u = &out[n++];
            const struct relay_unit *was = find(old, nold, topics[t].topic, p);
            if (was != NULL) {
                *u = *was;
            } else {
                memset(u, 0, sizeof(*u));
                memcpy(u->topic, topics[t].topic, sizeof(u->topic));
                u->partition = p;
                u->key = relay_unit_key(u->topic, strlen(u->topic), p);
            }
            u->want = me >= 0 && nmembers > 0 && flat % nmembers == (size_t)me;
        }
    }
    /* Held partitions that no longer exist (the topic went back to one
     * partition): kept, unwanted, so that they are released. */
    for (size_t i = 0; i < nold; i++) {
        if (!old[i].held || find(out, n, old[i].topic, old[i].partition) != NULL)
            continue;
        if (n == cap)
            return -1;
        out[n] = old[i];
        out[n].want = 0;
        n++;
    }
    return (long)n;
}
