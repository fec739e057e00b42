/*
 * The CLUSTER SLOTS reply (common/redisconn.c outbox_cluster_slots_parse):
 * the bytes are the reply in the Redis protocol, read by hiredis as the
 * relay, the tools and the consumer library read it from a cluster node.
 * The map must name only primaries that were counted, each with a port in
 * range.
 */
#include "common/compat.h"

#include "common/keys.h"
#include "common/redisconn.h"
#include "common/url.h"

#include "fuzz.h"

/* As the callers size them (PRIMARIES_MAX in common/redisconn.c). */
#define PRIMARIES 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uint8_t slot_node[OUTBOX_CLUSTER_SLOTS];
    static struct outbox_addr primaries[PRIMARIES];
    redisReply *r = NULL;
    if (fuzz_replies(data, size, &r, 1) != 1)
        return 0;
    int n = outbox_cluster_slots_parse(r, "10.0.0.1", primaries, PRIMARIES, slot_node);
    if (n < -2 || n > PRIMARIES)
        fuzz_fail("a count out of range", NULL);
    for (int i = 0; i < n; i++)
        if (primaries[i].port < 1 || primaries[i].port > 65535 || primaries[i].host[0] == '\0')
            fuzz_fail("a primary without a host or with a port out of range", primaries[i].host);
    if (n >= 0)
        for (int s = 0; s < OUTBOX_CLUSTER_SLOTS; s++)
            if (slot_node[s] != OUTBOX_SLOT_UNCOVERED && slot_node[s] >= n)
                fuzz_fail("a slot served by a primary that was not counted", NULL);
    if (outbox_cluster_slots_parse(r, "10.0.0.1", primaries, PRIMARIES, NULL) != n)
        fuzz_fail("the count depends on whether the map is asked for", NULL);
    freeReplyObject(r);
    return 0;
}
