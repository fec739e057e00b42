/*
 * The streams the claim cycle has published to, handed over to the
 * observation thread (docs/DESIGN.md, "Finding the streams"). A stream the
 * cycle publishes to for the first time (a new topic, or a new partition of
 * one) needs no scan of Redis: the loop notes every row's stream here, and
 * the names of the new ones go to the observer, which lists each on the node
 * that has it (core/streamlist.h, relay_stream_list_round).
 */
#ifndef RELAY_STREAMSEEN_H
#define RELAY_STREAMSEEN_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

struct relay_row;

/* The most names the claim cycle hands over between two observations; past
 * it, the observer scans instead. */
#define RELAY_STREAM_FRESH_MAX 1024

/*
 * The streams published to, as 64-bit hashes of topic and partition (the
 * loop's alone), and the names of the new ones, which the observation thread
 * takes under the lock.
 */
struct relay_stream_seen {
    uint64_t *hashes; /* open addressing; 0 is an empty slot */
    size_t mask, n;
    pthread_mutex_t lock; /* guards what follows */
    char **fresh;
    size_t nfresh;
    int overflow; /* names were dropped: the observer scans */
};

void relay_stream_seen_init(struct relay_stream_seen *s);
/* Notes row's stream, "<prefix><topic>[:<ppp>]"; hands its name over when
 * it is new. Past RELAY_STREAM_LIST_MAX streams it forgets them all (topics
 * come and go) and tells the observer to scan once; out of memory, it tells
 * the observer to scan. */
void relay_stream_seen_note(struct relay_stream_seen *s, const char *prefix,
                            const struct relay_row *row);
/* The names handed over since the last call, for the caller to free with
 * the array, and their count; *overflow set when some were dropped. */
size_t relay_stream_seen_take(struct relay_stream_seen *s, char ***names, int *overflow);
void relay_stream_seen_free(struct relay_stream_seen *s);

#endif
