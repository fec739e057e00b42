/*
 * Each stream's place in the publish order (relay/cursors.h).
 */
#include "common/compat.h"

#include "relay/cursors.h"

#include <stdlib.h>
#include <string.h>

#include "relay/batch.h"

void relay_cursors_init(struct relay_cursors *c)
{
    memset(c, 0, sizeof(*c));
}

void relay_cursors_free(struct relay_cursors *c)
{
    free(c->slots);
    memset(c, 0, sizeof(*c));
}

/* FNV-1a 64 over the topic, then the partition of a partitioned topic. */
static uint64_t stream_hash(const struct relay_row *row)
{
    uint64_t h = 14695981039346656037ull;
    for (size_t k = 0; k < row->topic_len; k++)
        h = (h ^ (unsigned char)row->topic[k]) * 1099511628211ull;
    if (row->partitions > 1)
        h = (h ^ (uint64_t)(row->partition + 1)) * 1099511628211ull;
    return h;
}

static int same_stream(const struct relay_cursor *cur, const struct relay_row *row)
{
    return strlen(cur->topic) == row->topic_len &&
           memcmp(cur->topic, row->topic, row->topic_len) == 0 &&
           cur->partitioned == (row->partitions > 1) &&
           (row->partitions <= 1 || cur->partition == row->partition);
}

static size_t slot_of(const struct relay_cursors *c, const struct relay_cursor *cur)
{
    struct relay_row row;
    memset(&row, 0, sizeof(row));
    row.topic = cur->topic;
    row.topic_len = strlen(cur->topic);
    row.partitions = cur->partitioned ? 2 : 1;
    row.partition = cur->partition;
    return (size_t)stream_hash(&row) & c->mask;
}

/* Doubles the table (or makes the first one), keeping every cursor. */
static int grow(struct relay_cursors *c)
{
    size_t size = c->slots != NULL ? 2 * (c->mask + 1) : 64;
    struct relay_cursor *slots = calloc(size, sizeof(*slots));
    if (slots == NULL)
        return -1;
    struct relay_cursors next = {slots, size - 1, c->n};
    for (size_t i = 0; c->slots != NULL && i <= c->mask; i++) {
        if (c->slots[i].topic[0] == '\0')
            continue;
        size_t at = slot_of(&next, &c->slots[i]);
        while (slots[at].topic[0] != '\0')
            at = (at + 1) & next.mask;
        slots[at] = c->slots[i];
    }
    free(c->slots);
    *c = next;
    return 0;
}

struct relay_cursor *relay_cursors_get(struct relay_cursors *c, const struct relay_row *row)
{
    if (row->topic_len == 0 || row->topic_len > OUTBOX_TOPIC_MAX)
        return NULL;
    uint64_t hash = stream_hash(row);
    if (c->slots != NULL) {
        for (size_t at = (size_t)hash & c->mask; c->slots[at].topic[0] != '\0';
             at = (at + 1) & c->mask)
            if (same_stream(&c->slots[at], row))
                return &c->slots[at];
    }
    if ((c->slots == NULL || (c->n + 1) * 2 > c->mask + 1) && grow(c) != 0)
        return NULL;
    if (c->slots == NULL)
        return NULL;
    size_t at = (size_t)hash & c->mask;
    while (c->slots[at].topic[0] != '\0')
        at = (at + 1) & c->mask;
    struct relay_cursor *cur = &c->slots[at];
    memset(cur, 0, sizeof(*cur));
    memcpy(cur->topic, row->topic, row->topic_len);
    cur->topic[row->topic_len] = '\0';
    cur->partitioned = row->partitions > 1;
    cur->partition = row->partitions > 1 ? row->partition : 0;
    /* A stream first met by its rows follows the lead: one with rows at or
     * below the lead has a recorded position, loaded before (record_batch). */
    cur->known = 1;
    cur->follows = 1;
    c->n++;
    return cur;
}

struct relay_cursor *relay_cursors_find(struct relay_cursors *c, const char *topic,
                                        int32_t partition)
{
    struct relay_row row;
    memset(&row, 0, sizeof(row));
    row.topic = topic;
    row.topic_len = strlen(topic);
    row.partitions = partition >= 0 ? 2 : 1;
    row.partition = partition >= 0 ? (uint32_t)partition : 0;
    return relay_cursors_get(c, &row);
}

uint64_t relay_cursor_position(const struct relay_cursor *cur, uint64_t lead)
{
    return cur->follows ? lead : cur->pos;
}

uint64_t relay_cursors_behind(const struct relay_cursors *c, uint64_t lead)
{
    uint64_t low = lead;
    for (size_t i = 0; c->slots != NULL && i <= c->mask; i++) {
        const struct relay_cursor *cur = &c->slots[i];
        if (cur->topic[0] != '\0' && cur->known && !cur->follows && cur->owned && !cur->paused &&
            cur->pos < low)
            low = cur->pos;
    }
    return low;
}

void relay_cursors_advance(struct relay_cursors *c, uint64_t prev, uint64_t lead)
{
    for (size_t i = 0; c->slots != NULL && i <= c->mask; i++) {
        struct relay_cursor *cur = &c->slots[i];
        if (cur->topic[0] == '\0' || !cur->known || cur->follows || !cur->owned || cur->paused ||
            cur->pos != prev)
            continue;
        cur->pos = prev + 1;
        if (cur->pos >= lead)
            cur->follows = 1;
    }
}

uint64_t relay_cursor_rank(struct relay_cursor *cur, uint64_t tick)
{
    if (cur->tick != tick) {
        cur->tick = tick;
        cur->next_seq = 0;
    }
    return cur->next_seq++;
}

int relay_cursor_present(const struct relay_cursor *cur, uint64_t ms, uint64_t seq)
{
    return cur->top_known && (ms < cur->top_ms || (ms == cur->top_ms && seq <= cur->top_seq));
}

void relay_cursor_appended(struct relay_cursor *cur, uint64_t ms, uint64_t seq)
{
    if (!cur->top_known || ms > cur->top_ms || (ms == cur->top_ms && seq > cur->top_seq))
        relay_cursor_set_top(cur, ms, seq);
}

void relay_cursor_set_top(struct relay_cursor *cur, uint64_t ms, uint64_t seq)
{
    cur->top_known = 1;
    cur->top_ms = ms;
    cur->top_seq = seq;
}

void relay_cursor_forget(struct relay_cursor *cur)
{
    cur->top_known = 0;
}

void relay_cursors_trim(struct relay_cursors *c, uint64_t tick)
{
    if (c->n <= RELAY_CURSORS_MAX)
        return;
    struct relay_cursors kept = {c->slots, c->mask, 0};
    struct relay_cursor *old = c->slots;
    size_t size = c->mask + 1;
    kept.slots = calloc(size, sizeof(*kept.slots));
    if (kept.slots == NULL)
        return; /* kept as it is: trimmed at the next batch's end */
    for (size_t i = 0; i < size; i++) {
        if (old[i].topic[0] == '\0' || (old[i].tick != tick && old[i].known && old[i].follows &&
                                        old[i].owned && !old[i].paused))
            continue;
        size_t at = slot_of(&kept, &old[i]);
        while (kept.slots[at].topic[0] != '\0')
            at = (at + 1) & kept.mask;
        kept.slots[at] = old[i];
        kept.n++;
    }
    free(old);
    *c = kept;
}

void relay_cursors_restart(struct relay_cursors *c, uint64_t tick)
{
    for (size_t i = 0; c->slots != NULL && i <= c->mask; i++)
        if (c->slots[i].topic[0] != '\0' && c->slots[i].tick == tick) {
            c->slots[i].tick = 0;
            c->slots[i].next_seq = 0;
            c->slots[i].touched = 0;
        }
}

void relay_cursors_untouch(struct relay_cursors *c)
{
    for (size_t i = 0; c->slots != NULL && i <= c->mask; i++)
        c->slots[i].touched = 0;
}

void relay_cursor_expect(struct relay_cursor *cur, uint64_t ms, uint64_t seq)
{
    if (ms > cur->expect_ms || (ms == cur->expect_ms && seq > cur->expect_seq)) {
        cur->expect_ms = ms;
        cur->expect_seq = seq;
    }
}

void relay_cursors_forget_all(struct relay_cursors *c)
{
    for (size_t i = 0; c->slots != NULL && i <= c->mask; i++) {
        struct relay_cursor *cur = &c->slots[i];
        if (cur->top_known)
            relay_cursor_expect(cur, cur->top_ms, cur->top_seq);
        cur->top_known = 0;
    }
}
