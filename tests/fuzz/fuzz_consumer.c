/*
 * The consumer library's reading of stream entries (consumer/messages.c and
 * consumer/ordered.c): the bytes are up to three replies in the Redis
 * protocol, read by hiredis as the library reads them from a server. The first is what XREADGROUP
 * (or the ordered mode's read function) answered: each entry is checked and its fields parsed as
 * the library does before calling the handler (outbox_msg_parse), and the ordered mode takes the
 * entries into a partition's hand (keep_entries) with the second reply as XPENDING's delivery
 * counts and the third as the set of parked keys, then reads each entry's key (order_item).
 */
#include "common/compat.h"

#include <hiredis/hiredis.h>

#include "common/common.h"
#include "consumer/internal.h"
#include "consumer/order.h"
#include "consumer/part.h"

#include "fuzz.h"

/* File-local in consumer/ordered.c (OUTBOX_STATIC is empty in relay_unit). */
void order_item(const struct held *h, struct outbox_order_item *it);
int any_ready(const struct part *pt, long long now);
size_t keep_entries(struct part *pt, redisReply *r, int replay, const redisReply *counts,
                    char *last, size_t lastlen);

/* What a handler may read of a message: every byte of it. */
static size_t touch(const struct outbox_message *m)
{
    size_t sum = strlen(m->id) + strlen(m->topic) + strlen(m->created_at);
    for (size_t i = 0; i < m->payload_len; i++)
        sum += (unsigned char)m->payload[i];
    for (size_t i = 0; m->key != NULL && i < m->key_len; i++)
        sum += (unsigned char)m->key[i];
    for (size_t h = 0; h < m->nheaders; h++) {
        sum += strlen(m->header_names[h]);
        for (size_t i = 0; i < m->header_value_lens[h]; i++)
            sum += (unsigned char)m->header_values[h][i];
    }
    return sum;
}

/* The entries of an XREADGROUP reply, as read_once and handle take them. */
static void read_entries(const redisReply *r)
{
    if (r->type != REDIS_REPLY_ARRAY)
        return;
    for (size_t s = 0; s < r->elements; s++) {
        const redisReply *sr = r->element[s];
        if (sr->type != REDIS_REPLY_ARRAY || sr->elements != 2 ||
            sr->element[0]->type != REDIS_REPLY_STRING || sr->element[1]->type != REDIS_REPLY_ARRAY)
            continue;
        const redisReply *entries = sr->element[1];
        for (size_t i = 0; i < entries->elements; i++) {
            const redisReply *entry = entries->element[i];
            if (entry->type != REDIS_REPLY_ARRAY || entry->elements != 2 ||
                entry->element[0]->type != REDIS_REPLY_STRING)
                continue;
            const redisReply *fields = entry->element[1];
            if (fields->type == REDIS_REPLY_NIL)
                continue;
            struct outbox_message m;
            const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
            size_t vlens[OUTBOX_HEADERS_MAX];
            memset(&m, 0, sizeof(m));
            if (outbox_msg_parse(fields, &m, names, values, vlens) == NULL) {
                volatile size_t sum = touch(&m);
                (void)sum;
            }
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct part pt;
    redisReply *rs[3] = {NULL, NULL, NULL};
    char last[64];
    int n = fuzz_replies(data, size, rs, 3);
    if (n == 0)
        return 0;

    read_entries(rs[0]);

    memset(&pt, 0, sizeof(pt));
    pt.parked = n > 2 ? rs[2] : NULL;
    last[0] = '\0';
    size_t got = keep_entries(&pt, rs[0], 0, n > 1 ? rs[1] : NULL, last, sizeof(last));
    if (pt.nq > got || pt.nq > ORDER_QUEUE_MAX)
        fuzz_fail("more entries in hand than were read", last);
    for (size_t i = 0; i < pt.nq; i++) {
        struct outbox_order_item it;
        order_item(&pt.q[i], &it);
        if (it.has_key && it.key_len > 0 && it.key == NULL)
            fuzz_fail("a key without bytes", NULL);
    }
    (void)any_ready(&pt, 0);
    for (size_t i = 0; i < pt.nq; i++)
        outbox_part_held_free(&pt.q[i]);
    fuzz_replies_free(rs, n);
    return 0;
}
