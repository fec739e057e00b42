/*
 * The partitions' leases of the ordered mode (consumer/leases.h): the
 * group's members and each one's share, taking a partition's lease, with the
 * entries other consumers left pending and the parked keys, renewing it, and
 * giving it up. Every lease function checks the caller's token first
 * (functions/outbox_consumer.lua), so a lease lost here is lost for good.
 */
#include "common/compat.h"

#include "consumer/leases.h"
#include "consumer/part.h"

#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "common/functions.h"
#include "consumer/order.h"

void outbox_lease_lost(struct outbox_consumer *c, struct part *pt, const char *why)
{
    if (pt->token == 0)
        return;
    c->stats.leases_lost++;
    outbox_report_emit(
        c, OUTBOX_CONSUMER_LOG_WARNING,
        "lost the lease of %s (%s): its %zu entries in hand are left to the next holder",
        pt->stream, why, pt->nq);
    outbox_part_drop(pt);
}

int outbox_lease_is_parked(const struct part *pt, const char *key, size_t len)
{
    for (size_t i = 0; key != NULL && pt->parked != NULL && i < pt->parked->elements; i++) {
        const redisReply *k = pt->parked->element[i];
        if (k->type == REDIS_REPLY_STRING && k->len == len && memcmp(k->str, key, len) == 0)
            return 1;
    }
    return 0;
}

/* The first key of the parked set read before that is not in the one read
 * now (SMEMBERS replies; NULL when none left or there was none before). Only
 * string members count: a reply of any other shape parks nothing. */
OUTBOX_STATIC const redisReply *parked_key_left(const redisReply *before, const redisReply *now);

OUTBOX_STATIC const redisReply *parked_key_left(const redisReply *before, const redisReply *now)
{
    if (before == NULL || before->type != REDIS_REPLY_ARRAY)
        return NULL;
    for (size_t i = 0; i < before->elements; i++) {
        const redisReply *k = before->element[i];
        if (k->type != REDIS_REPLY_STRING)
            continue;
        int still = 0;
        for (size_t j = 0;
             now != NULL && now->type == REDIS_REPLY_ARRAY && j < now->elements && !still; j++) {
            const redisReply *m = now->element[j];
            still = m->type == REDIS_REPLY_STRING && m->len == k->len &&
                    memcmp(m->str, k->str, k->len) == 0;
        }
        if (!still)
            return k;
    }
    return NULL;
}

/* A key that has left the parked set since the last read was unparked by an
 * operator: its messages, still pending, are read again from the start of
 * this consumer's pending list. */
int outbox_lease_load_parked(struct outbox_consumer *c, struct part *pt)
{
    if (!c->o.park_keys)
        return 0;
    redisReply *r = outbox_conn_call(c, (const char *[]){"SMEMBERS", pt->parked_key, NULL});
    if (r == NULL)
        return -1;
    if (r->type != REDIS_REPLY_ARRAY) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_REDIS, "reading the parked keys %s failed: %s",
                              pt->parked_key,
                              r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        freeReplyObject(r);
        return -1;
    }
    const redisReply *k = parked_key_left(pt->parked, r);
    int unparked = k != NULL;
    if (unparked)
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_INFO,
                           "%s: key %.*s unparked on %s; its messages go on", c->consumer,
                           (int)k->len, k->str, pt->stream);
    freeReplyObject(pt->parked);
    pt->parked = r;
    if (unparked)
        for (int s = 0; s < 2; s++) {
            pt->pel_done[s] = 0;
            snprintf(pt->pel_cursor[s], sizeof(pt->pel_cursor[s]), "0");
        }
    return 0;
}

/* Redis's clock in ms from a TIME reply; -1 when the reply is not one. */
OUTBOX_STATIC long long redis_time_ms(const redisReply *t);

OUTBOX_STATIC long long redis_time_ms(const redisReply *t)
{
    if (t->type != REDIS_REPLY_ARRAY || t->elements != 2)
        return -1;
    long long part[2];
    for (int i = 0; i < 2; i++) {
        const redisReply *e = t->element[i];
        char *end = NULL;
        if (e->type != REDIS_REPLY_STRING || e->len == 0 || e->len > 18 || e->str[0] < '0' ||
            e->str[0] > '9')
            return -1;
        part[i] = strtoll(e->str, &end, 10);
        if (end != e->str + e->len)
            return -1;
    }
    return part[0] * 1000 + part[1] / 1000;
}

/* The group's members, by the beat of each: rank and count. -1 when the
 * connection failed. */
static int beat(struct outbox_consumer *c, struct ordered *od)
{
    redisReply *t = outbox_conn_call(c, (const char *[]){"TIME", NULL});
    if (t == NULL)
        return -1;
    long long ms = redis_time_ms(t);
    freeReplyObject(t);
    if (ms < 0) {
        outbox_report_problem(
            c, OUTBOX_CONSUMER_ERR_REDIS,
            "%s: unexpected reply to TIME; is this a Redis server? The group's members are "
            "counted again at the next upkeep",
            c->consumer);
        return -1;
    }
    char now[32], cutoff[32];
    snprintf(now, sizeof(now), "%lld", ms);
    snprintf(cutoff, sizeof(cutoff), "(%lld", ms - (long long)c->o.lease_ms);
    redisReply *r =
        outbox_conn_call(c, (const char *[]){"ZADD", od->members_key, now, c->consumer, NULL});
    if (r == NULL)
        return -1;
    freeReplyObject(r);
    r = outbox_conn_call(
        c, (const char *[]){"ZREMRANGEBYSCORE", od->members_key, "-inf", cutoff, NULL});
    if (r == NULL)
        return -1;
    freeReplyObject(r);
    r = outbox_conn_call(c, (const char *[]){"ZRANGE", od->members_key, "0", "-1", NULL});
    if (r == NULL)
        return -1;
    uint32_t rank = 0, members = 0;
    int found = 0;
    if (r->type == REDIS_REPLY_ARRAY) {
        for (size_t i = 0; i < r->elements; i++) {
            if (r->element[i]->type != REDIS_REPLY_STRING)
                continue;
            members++;
            int cmp = strcmp(r->element[i]->str, c->consumer);
            if (cmp == 0)
                found = 1;
            else if (cmp < 0)
                rank++;
        }
    }
    freeReplyObject(r);
    if (!found) { /* our beat was just written: only a clock step can lose it */
        members++;
    }
    if (members != od->members || rank != od->rank)
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_INFO, "%s: consumer %u of %u of group %s on %s",
                           c->consumer, rank + 1, members, c->group, c->stream);
    od->members = members;
    od->rank = rank;
    return 0;
}

/* Takes the other consumers' pending entries of a partition just taken;
 * those deleted from the stream meanwhile are dead-lettered as lost. */
static int take_pending(struct outbox_consumer *c, struct part *pt, int replay)
{
    const char *stream = replay ? pt->replay : pt->stream;
    for (int round = 0; round < 1000 && c->wr != NULL; round++) {
        redisReply *r = outbox_conn_call(
            c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_TAKE, "2", stream, pt->lease,
                                c->group, c->consumer, pt->token_s, "100", NULL});
        if (r == NULL)
            return -1;
        if (outbox_msg_lease_lost(r)) {
            freeReplyObject(r);
            outbox_lease_lost(c, pt, "taken by another consumer while taking its entries over");
            return -1;
        }
        if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
            r->element[0]->type != REDIS_REPLY_ARRAY || r->element[1]->type != REDIS_REPLY_ARRAY) {
            outbox_report_problem(c, OUTBOX_CONSUMER_ERR_REDIS,
                                  "taking over the entries of %s failed: %s", stream,
                                  r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
            freeReplyObject(r);
            return -1;
        }
        const redisReply *asked = r->element[0], *got = r->element[1];
        size_t n = asked->elements;
        c->stats.reclaimed += got->elements;
        struct lease_ref lr = {pt->lease, pt->token_s, pt->dlq};
        for (size_t i = 0; i < n && c->wr != NULL; i++) {
            const char *id = asked->element[i]->str;
            int present = 0;
            for (size_t j = 0; j < got->elements && !present; j++)
                present = got->element[j]->type == REDIS_REPLY_ARRAY &&
                          got->element[j]->elements == 2 &&
                          strcmp(got->element[j]->element[0]->str, id) == 0;
            if (!present) {
                c->stats.lost++;
                outbox_msg_dead_letter(
                    c, stream, &lr, id, NULL, "lost",
                    "the entry was deleted or trimmed from the stream while pending", 1);
            }
        }
        freeReplyObject(r);
        if (n < 100)
            return 0;
    }
    return 0;
}

/* Takes the others' pending entries over and reads the parked keys; until
 * both are done (a failure is tried again at the next upkeep), nothing of
 * the partition is read or handled. */
static void finish_take(struct outbox_consumer *c, struct part *pt)
{
    if (pt->token == 0 || pt->ready)
        return;
    if (take_pending(c, pt, 0) == 0 && pt->token != 0 && take_pending(c, pt, 1) == 0 &&
        pt->token != 0 && outbox_lease_load_parked(c, pt) == 0)
        pt->ready = 1;
}

static void take_part(struct outbox_consumer *c, struct part *pt, long long now)
{
    redisReply *r = outbox_conn_call(c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_LEASE,
                                                         "2", pt->lease, pt->tokens, c->consumer,
                                                         c->lease_ms_s, "0", NULL});
    if (r == NULL)
        return;
    long long token = 0;
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 3 &&
        r->element[0]->type == REDIS_REPLY_INTEGER)
        token = r->element[0]->integer;
    else if (r->type == REDIS_REPLY_ERROR)
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_REDIS, "taking the lease of %s failed: %s",
                              pt->stream, r->str);
    freeReplyObject(r);
    if (token <= 0)
        return;
    pt->token = token;
    snprintf(pt->token_s, sizeof(pt->token_s), "%lld", token);
    pt->valid_until = now + c->o.lease_ms;
    for (int s = 0; s < 2; s++) {
        pt->pel_done[s] = 0;
        snprintf(pt->pel_cursor[s], sizeof(pt->pel_cursor[s]), "0");
        pt->last_id[s][0] = '\0';
    }
    c->stats.leases_taken++;
    outbox_report_emit(c, OUTBOX_CONSUMER_LOG_INFO, "%s: took %s (lease token %lld)", c->consumer,
                       pt->stream, token);
    finish_take(c, pt);
}

void outbox_lease_release(struct outbox_consumer *c, struct part *pt, const char *why)
{
    if (pt->token == 0)
        return;
    redisReply *r = outbox_conn_call(c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_RELEASE,
                                                         "1", pt->lease, pt->token_s, NULL});
    if (r != NULL)
        freeReplyObject(r);
    outbox_report_emit(c, OUTBOX_CONSUMER_LOG_INFO, "%s: released %s (%s)", c->consumer, pt->stream,
                       why);
    outbox_part_drop(pt);
}

void outbox_lease_upkeep(struct outbox_consumer *c, struct ordered *od)
{
    use_base(c);
    if (beat(c, od) < 0)
        return;
    for (uint32_t i = 0; i < od->n && c->wr != NULL && !c->stop; i++) {
        struct part *pt = &od->parts[i];
        use_part(c, pt);
        long long now = now_ms();
        int mine = outbox_order_mine(pt->p, od->rank, od->members);
        if (pt->token != 0 && !mine) {
            outbox_lease_release(c, pt, "another consumer's share now");
        } else if (pt->token != 0) {
            redisReply *r = outbox_conn_call(
                c, (const char *[]){"FCALL", OUTBOX_CONSUMER_FUNCTION_LEASE, "2", pt->lease,
                                    pt->tokens, c->consumer, c->lease_ms_s, pt->token_s, NULL});
            if (r == NULL)
                return;
            if (r->type == REDIS_REPLY_ARRAY && r->elements == 3 &&
                r->element[0]->type == REDIS_REPLY_INTEGER && r->element[0]->integer == pt->token)
                pt->valid_until = now + c->o.lease_ms;
            else
                outbox_lease_lost(c, pt, "it expired before it was renewed");
            freeReplyObject(r);
            if (pt->token != 0 && !pt->ready)
                finish_take(c, pt);
            else if (pt->token != 0)
                outbox_lease_load_parked(c, pt);
        } else if (mine) {
            take_part(c, pt, now);
        }
    }
}
