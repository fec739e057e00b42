/*
 * The batch loop (relay/loop.h).
 */
#include "common/compat.h"

#include "relay/loop.h"

#include <string.h>

void relay_loop_init(struct relay_loop *l, const struct relay_loop_ops *ops, uint32_t chunk_rows,
                     uint32_t backoff_base_ms, uint32_t backoff_max_ms)
{
    memset(l, 0, sizeof(*l));
    l->ops = *ops;
    l->chunk_rows = chunk_rows > 0 ? chunk_rows : 1;
    outbox_backoff_init(&l->backoff, backoff_base_ms, backoff_max_ms);
}

void relay_loop_set_lead(struct relay_loop *l, uint64_t lead)
{
    l->loaded = 1;
    l->lead = lead;
    if (l->latest < lead)
        l->latest = lead;
}

static void look(struct relay_loop *l);

/* A statement could not be sent: its connection is down, and its return
 * calls relay_loop_want. */
static void not_sent(struct relay_loop *l)
{
    l->state = RELAY_LOOP_IDLE;
    l->wanted = 1;
    if (l->draining)
        l->ops.drained(l->ops.arg);
}

static void start_batch(struct relay_loop *l, uint64_t prev, int catching_up)
{
    l->gen++;
    l->prev = prev;
    l->next = prev + 1;
    l->catching_up = catching_up;
    l->reading = 1;
    l->read_chunk = 0;
    l->read_done = 0;
    l->publishing = 0;
    l->ahead = 0;
    l->state = RELAY_LOOP_READ;
    if (l->ops.read(l->ops.arg, l->gen, l->prev, l->next, 0) < 0)
        not_sent(l);
}

static void send_load(struct relay_loop *l)
{
    l->gen++;
    l->state = RELAY_LOOP_LOAD;
    if (l->ops.load(l->ops.arg, l->gen) < 0)
        not_sent(l);
}

static void send_tick(struct relay_loop *l)
{
    l->gen++;
    l->wanted = 0;
    l->state = RELAY_LOOP_TICK;
    if (l->ops.tick(l->ops.arg, l->gen) < 0)
        not_sent(l);
}

/* Free to start something: the next batch when one is known, else a tick. */
static void look(struct relay_loop *l)
{
    if (l->stopping)
        return;
    if (l->draining) {
        l->state = RELAY_LOOP_IDLE;
        l->ops.drained(l->ops.arg);
        return;
    }
    if (!l->ops.ready(l->ops.arg)) {
        l->state = RELAY_LOOP_IDLE;
        l->wanted = 1; /* a connection coming up calls relay_loop_want */
        return;
    }
    if (l->ops.prepare(l->ops.arg) || !l->loaded) {
        send_load(l);
        return;
    }
    uint64_t behind = l->ops.behind(l->ops.arg, l->lead);
    int lead_ready = l->latest > l->lead;
    if (behind < l->lead && (l->turn || !lead_ready)) {
        l->turn = 0;
        start_batch(l, behind, 1);
    } else if (lead_ready) {
        l->turn = behind < l->lead;
        start_batch(l, l->lead, 0);
    } else {
        send_tick(l);
    }
}

void relay_loop_loaded(struct relay_loop *l, uint64_t gen, uint64_t lead)
{
    if (l->stopping || l->state != RELAY_LOOP_LOAD || gen != l->gen)
        return;
    if (!l->loaded)
        relay_loop_set_lead(l, lead);
    l->state = RELAY_LOOP_IDLE;
    look(l);
}

void relay_loop_want(struct relay_loop *l)
{
    if (l->stopping)
        return;
    if (l->state == RELAY_LOOP_IDLE)
        look(l);
    else
        l->wanted = 1;
}

void relay_loop_ticked(struct relay_loop *l, uint64_t gen, uint64_t latest)
{
    if (l->stopping || l->state != RELAY_LOOP_TICK || gen != l->gen)
        return;
    if (latest > l->latest)
        l->latest = latest;
    if (l->latest > l->lead || l->draining || l->ops.behind(l->ops.arg, l->lead) < l->lead) {
        look(l);
    } else if (l->wanted) {
        /* Something committed after the tick's snapshot may have notified
         * meanwhile: look again. */
        send_tick(l);
    } else {
        l->state = RELAY_LOOP_IDLE;
        l->ops.idle(l->ops.arg);
    }
}

static void record(struct relay_loop *l)
{
    l->state = RELAY_LOOP_RECORD;
    if (l->ops.record(l->ops.arg, l->gen, l->prev, l->next, !l->catching_up) < 0)
        relay_loop_failed(l, l->gen, RELAY_FAIL_POSTGRES,
                          "PostgreSQL connection lost before the batch was recorded");
}

/* Publishes chunk, and reads the next one meanwhile unless it was the last. */
static void publish(struct relay_loop *l, uint32_t chunk)
{
    uint64_t gen = l->gen;
    l->publishing = 1;
    l->publish_chunk = chunk;
    l->state = RELAY_LOOP_PUBLISH;
    if (!l->read_done) {
        l->reading = 1;
        l->read_chunk = chunk + 1;
        if (l->ops.read(l->ops.arg, gen, l->prev, l->next, chunk + 1) < 0) {
            relay_loop_failed(l, gen, RELAY_FAIL_POSTGRES,
                              "PostgreSQL connection lost before the next chunk was read");
            return;
        }
    }
    l->ops.publish(l->ops.arg, gen, chunk); /* may answer before it returns */
}

void relay_loop_chunk(struct relay_loop *l, uint64_t gen, uint32_t chunk, size_t n)
{
    if (l->stopping || gen != l->gen || !l->reading || chunk != l->read_chunk ||
        (l->state != RELAY_LOOP_READ && l->state != RELAY_LOOP_PUBLISH))
        return;
    l->reading = 0;
    if (n < l->chunk_rows)
        l->read_done = 1; /* a short chunk is the batch's last */
    if (n == 0) {
        if (!l->publishing)
            record(l);
        return;
    }
    if (l->publishing) {
        l->ahead = 1;
        l->ahead_chunk = chunk;
        return;
    }
    publish(l, chunk);
}

void relay_loop_published(struct relay_loop *l, uint64_t gen, uint32_t chunk)
{
    if (l->stopping || gen != l->gen || l->state != RELAY_LOOP_PUBLISH || !l->publishing ||
        chunk != l->publish_chunk)
        return;
    l->publishing = 0;
    if (l->ahead) {
        l->ahead = 0;
        publish(l, l->ahead_chunk);
    } else if (l->reading) {
        l->state = RELAY_LOOP_READ;
    } else {
        record(l);
    }
}

void relay_loop_recorded(struct relay_loop *l, uint64_t gen)
{
    if (l->stopping || gen != l->gen || l->state != RELAY_LOOP_RECORD)
        return;
    if (!l->catching_up)
        l->lead = l->next;
    l->batches++;
    l->failures_in_row = 0;
    outbox_backoff_reset(&l->backoff);
    l->state = RELAY_LOOP_IDLE;
    look(l);
}

void relay_loop_failed(struct relay_loop *l, uint64_t gen, enum relay_fail_kind kind,
                       const char *why)
{
    if (l->stopping || gen != l->gen || l->state == RELAY_LOOP_IDLE ||
        l->state == RELAY_LOOP_BACKOFF)
        return;
    l->gen++; /* whatever is still in flight answers an abandoned batch */
    l->reading = 0;
    l->publishing = 0;
    l->ahead = 0;
    l->ops.abandon(l->ops.arg);
    l->ops.failed(l->ops.arg, kind, why);
    l->failures_in_row++;
    if (l->draining) {
        l->state = RELAY_LOOP_IDLE;
        l->ops.drained(l->ops.arg);
        return;
    }
    l->state = RELAY_LOOP_BACKOFF;
    l->ops.arm_retry(l->ops.arg, outbox_backoff_next(&l->backoff, outbox_backoff_random()));
}

void relay_loop_retry(struct relay_loop *l)
{
    if (l->stopping || l->state != RELAY_LOOP_BACKOFF)
        return;
    l->state = RELAY_LOOP_IDLE;
    look(l);
}

void relay_loop_drain(struct relay_loop *l)
{
    if (l->stopping || l->draining)
        return;
    l->draining = 1;
    if (l->state == RELAY_LOOP_IDLE || l->state == RELAY_LOOP_BACKOFF) {
        l->state = RELAY_LOOP_IDLE;
        l->ops.drained(l->ops.arg);
    }
}

void relay_loop_stop(struct relay_loop *l)
{
    l->stopping = 1;
}
