/*
 * The ordered mode's partitions (consumer/part.h): freeing what an entry in
 * hand owns, and dropping a partition whose lease ended.
 */
#include "common/compat.h"

#include "consumer/part.h"

#include <hiredis/hiredis.h>
#include <stdlib.h>

void outbox_part_held_free(struct held *h)
{
    freeReplyObject(h->entry);
    free(h->dl_reason);
    free(h->dl_why);
    h->entry = NULL;
    h->dl_reason = h->dl_why = NULL;
}

void outbox_part_drop(struct part *pt)
{
    for (size_t i = 0; i < pt->nq; i++)
        outbox_part_held_free(&pt->q[i]);
    pt->nq = 0;
    pt->ready = 0;
    freeReplyObject(pt->parked);
    pt->parked = NULL;
    pt->token = 0;
    pt->token_s[0] = '\0';
    pt->valid_until = 0;
}
