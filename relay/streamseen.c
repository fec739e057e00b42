/*
 * The streams the claim cycle has published to (relay/streamseen.h).
 */
#include "common/compat.h"

#include "relay/streamseen.h"

#include <stdlib.h>
#include <string.h>

#include "common/keys.h"
#include "core/streamlist.h"
#include "relay/batch.h"

void relay_stream_seen_init(struct relay_stream_seen *s)
{
    memset(s, 0, sizeof(*s));
    pthread_mutex_init(&s->lock, NULL);
}

/* FNV-1a 64 over the topic, then the partition of a partitioned topic; never 0. */
static uint64_t seen_hash(const struct relay_row *row)
{
    uint64_t h = 14695981039346656037ull;
    for (size_t k = 0; k < row->topic_len; k++)
        h = (h ^ (unsigned char)row->topic[k]) * 1099511628211ull;
    if (row->partitions > 1)
        h = (h ^ (uint64_t)(row->partition + 1)) * 1099511628211ull;
    return h != 0 ? h : 1;
}

static int seen_grow(struct relay_stream_seen *s)
{
    size_t size = s->hashes != NULL ? 2 * (s->mask + 1) : 64;
    uint64_t *h = calloc(size, sizeof(*h));
    if (h == NULL)
        return -1;
    for (size_t i = 0; s->hashes != NULL && i <= s->mask; i++) {
        if (s->hashes[i] == 0)
            continue;
        size_t at = s->hashes[i] & (size - 1);
        while (h[at] != 0)
            at = (at + 1) & (size - 1);
        h[at] = s->hashes[i];
    }
    free(s->hashes);
    s->hashes = h;
    s->mask = size - 1;
    return 0;
}

/* Hands name over (NULL: it could not be made), under the lock. */
static void hand_over(struct relay_stream_seen *s, char *name)
{
    pthread_mutex_lock(&s->lock);
    if (name == NULL || s->nfresh >= RELAY_STREAM_FRESH_MAX) {
        s->overflow = 1;
        free(name);
    } else {
        if (s->fresh == NULL)
            s->fresh = calloc(RELAY_STREAM_FRESH_MAX, sizeof(*s->fresh));
        if (s->fresh == NULL) {
            s->overflow = 1;
            free(name);
        } else {
            s->fresh[s->nfresh++] = name;
        }
    }
    pthread_mutex_unlock(&s->lock);
}

void relay_stream_seen_note(struct relay_stream_seen *s, const char *prefix,
                            const struct relay_row *row)
{
    uint64_t hash = seen_hash(row);
    if (s->hashes != NULL) {
        for (size_t at = hash & s->mask; s->hashes[at] != 0; at = (at + 1) & s->mask)
            if (s->hashes[at] == hash)
                return;
    }
    if (s->n >= RELAY_STREAM_LIST_MAX && s->hashes != NULL) {
        /* Streams come and go (short-lived topics): start again, and have
         * the observer scan once for the names not handed over. */
        memset(s->hashes, 0, (s->mask + 1) * sizeof(*s->hashes));
        s->n = 0;
        hand_over(s, NULL);
    }
    /* At most half full, so that every probe ends soon at an empty slot. */
    if ((s->hashes == NULL || 2 * (s->n + 1) > s->mask + 1) && seen_grow(s) < 0) {
        hand_over(s, NULL);
        return;
    }
    size_t at = hash & s->mask;
    while (s->hashes[at] != 0)
        at = (at + 1) & s->mask;
    s->hashes[at] = hash;
    s->n++;
    size_t size =
        (prefix != NULL ? strlen(prefix) : 0) + row->topic_len + OUTBOX_PARTITION_SUFFIX_LEN + 1;
    char *name = malloc(size);
    if (name != NULL &&
        outbox_key_partition_stream(prefix, row->topic, row->topic_len, row->partition,
                                    row->partitions, name, size) < 0) {
        free(name); /* cannot happen: sized for the longest */
        name = NULL;
    }
    hand_over(s, name);
}

size_t relay_stream_seen_take(struct relay_stream_seen *s, char ***names, int *overflow)
{
    pthread_mutex_lock(&s->lock);
    size_t n = s->nfresh;
    *names = s->fresh;
    *overflow = s->overflow;
    s->fresh = NULL;
    s->nfresh = 0;
    s->overflow = 0;
    pthread_mutex_unlock(&s->lock);
    return n;
}

void relay_stream_seen_free(struct relay_stream_seen *s)
{
    char **names;
    int overflow;
    size_t n = relay_stream_seen_take(s, &names, &overflow);
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    free(s->hashes);
    s->hashes = NULL;
    s->n = 0;
    pthread_mutex_destroy(&s->lock);
}
