/*
 * The removals of dedup records that wait for their time (relay/retire.h).
 */
#include "common/compat.h"

#include "relay/retire.h"

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

/* A chunk's usual size; a command larger than a chunk gets one of its own. */
#define CHUNK_SIZE ((size_t)1 << 20)
/* Emptied chunks kept for reuse: a queue that turns over needs one or two. */
#define SPARES_MAX 2

struct relay_retire_chunk {
    struct relay_retire_chunk *next;
    size_t size;        /* of the mapping, this header included */
    size_t read, write; /* offsets of the next item to read and to write */
    _Alignas(8) char data[];
};

static size_t item_size(size_t len)
{
    return (sizeof(struct relay_retire_item) + len + 7) & ~(size_t)7;
}

static struct relay_retire_chunk *chunk_new(struct relay_retire_queue *q, size_t need)
{
    struct relay_retire_chunk *c;
    size_t size = sizeof(*c) + need;
    if (size <= CHUNK_SIZE && q->spare != NULL) {
        c = q->spare;
        q->spare = c->next;
        q->spares--;
    } else {
        if (size < CHUNK_SIZE)
            size = CHUNK_SIZE;
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return NULL;
        c = p;
        c->size = size;
    }
    c->next = NULL;
    c->read = c->write = 0;
    return c;
}

static void chunk_free(struct relay_retire_queue *q, struct relay_retire_chunk *c)
{
    if (c->size == CHUNK_SIZE && q->spares < SPARES_MAX) {
        c->next = q->spare;
        q->spare = c;
        q->spares++;
        return;
    }
    munmap(c, c->size);
}

int relay_retire_push(struct relay_retire_queue *q, double due, const char *cmd, size_t len)
{
    size_t need = item_size(len);
    struct relay_retire_chunk *c = q->tail;
    if (c == NULL || c->size - sizeof(*c) - c->write < need) {
        struct relay_retire_chunk *fresh = chunk_new(q, need);
        if (fresh == NULL)
            return -1;
        if (c != NULL && c->read == c->write) {
            /* The queue is empty and its one chunk too small: it is replaced,
             * never left before the new one, where the head would stop. */
            chunk_free(q, c);
            c = NULL;
        }
        if (c != NULL)
            c->next = fresh;
        else
            q->head = fresh;
        q->tail = c = fresh;
    }
    struct relay_retire_item *it = (struct relay_retire_item *)(void *)(c->data + c->write);
    if (q->items > 0 && due < q->last_due)
        due = q->last_due;
    it->due = q->last_due = due;
    it->len = len;
    memcpy(it->cmd, cmd, len);
    c->write += need;
    q->bytes += len;
    q->items++;
    return 0;
}

const struct relay_retire_item *relay_retire_head(const struct relay_retire_queue *q)
{
    const struct relay_retire_chunk *c = q->head;
    if (c == NULL || c->read == c->write)
        return NULL;
    return (const struct relay_retire_item *)(const void *)(c->data + c->read);
}

void relay_retire_pop(struct relay_retire_queue *q)
{
    struct relay_retire_chunk *c = q->head;
    const struct relay_retire_item *it = relay_retire_head(q);
    if (it == NULL)
        return;
    q->bytes -= it->len;
    q->items--;
    c->read += item_size(it->len);
    if (c->read < c->write)
        return;
    /* The chunk is read: the tail starts over in it, or the next one is read. */
    if (c == q->tail) {
        c->read = c->write = 0;
        return;
    }
    q->head = c->next;
    chunk_free(q, c);
}

void relay_retire_clear(struct relay_retire_queue *q)
{
    struct relay_retire_chunk *c, *next;
    for (c = q->head; c != NULL; c = next) {
        next = c->next;
        munmap(c, c->size);
    }
    for (c = q->spare; c != NULL; c = next) {
        next = c->next;
        munmap(c, c->size);
    }
    memset(q, 0, sizeof(*q));
}

unsigned relay_retire_ms_left(double due, double now)
{
    double ms = (due - now) * 1000.0;
    if (!(ms > 1.0))
        return 1;
    if (ms > 4e9)
        return 4000000000u;
    unsigned whole = (unsigned)ms;
    return whole < ms ? whole + 1 : whole;
}
