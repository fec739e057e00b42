/*
 * The assignment of partitions to relays (relay/ownership.h).
 */
#include "common/compat.h"

#include "relay/ownership.h"

#include <stdlib.h>
#include <string.h>

#include "common/keys.h"

int32_t relay_unit_key(const char *topic, size_t topic_len, uint32_t partition)
{
    return (int32_t)((outbox_partition_hash(topic, topic_len) + partition) & 0x7fffffffu);
}

int relay_topic_wanted(const char *topic, size_t topic_len, size_t nmembers, long me)
{
    if (nmembers == 0 || me < 0)
        return 1;
    return outbox_partition_hash(topic, topic_len) % nmembers == (size_t)me;
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

struct keyed {
    int32_t key;
    uint32_t at; /* the unit's place in the plan */
};

static int by_key(const void *a, const void *b)
{
    const struct keyed *x = a, *y = b;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    return x->at < y->at ? -1 : x->at > y->at; /* plan order within a key */
}

/* Units whose keys collide take the want of the first of them in plan order:
 * one lock is one owner, and a relay told to take a key another relay holds
 * for a different partition would wait for it for ever. 0, or -1 when out of
 * memory. */
static int share_colliding_keys(struct relay_unit *units, size_t n)
{
    if (n < 2)
        return 0;
    struct keyed *order = malloc(n * sizeof(*order));
    if (order == NULL)
        return -1;
    for (size_t i = 0; i < n; i++)
        order[i] = (struct keyed){units[i].key, (uint32_t)i};
    qsort(order, n, sizeof(*order), by_key);
    for (size_t i = 1; i < n; i++)
        if (order[i].key == order[i - 1].key)
            units[order[i].at].want = units[order[i - 1].at].want;
    free(order);
    return 0;
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
    if (share_colliding_keys(out, n) != 0)
        return -1;
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
