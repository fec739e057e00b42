/*
 * Key names and their hash slots (common/keys.c): the bytes are a key (a
 * stream name, from a topic and a prefix, or a name a user gave the consumer
 * library). Its slot must be in range, and a key with a {hash tag} must be in
 * the slot of the tag, the rule that keeps a stream and its dedup records,
 * dead letters and leases on one node of a cluster.
 */
#include "common/compat.h"

#include "common/keys.h"

#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char out[4 * 4096];
    const char *key = (const char *)data;
    unsigned slot = outbox_key_slot(key, size);
    if (slot >= OUTBOX_CLUSTER_SLOTS)
        fuzz_fail("a slot out of range", NULL);

    /* The cluster specification's rule, spelled out again. */
    const uint8_t *open = memchr(data, '{', size);
    if (open != NULL) {
        size_t at = (size_t)(open - data) + 1;
        const uint8_t *close = memchr(data + at, '}', size - at);
        if (close != NULL && close > data + at &&
            outbox_key_slot(key + at, (size_t)(close - data) - at) != slot)
            fuzz_fail("a key outside its hash tag's slot", NULL);
    }

    /* Names built from the bytes as a stream name stay in its slot. */
    char *stream = fuzz_string(data, size);
    size_t len = strlen(stream);
    int plain = len > 0 && strpbrk(stream, "{}") == NULL; /* no tag of its own */
    int n = outbox_key_dedup(stream, "0190f0a4-0000-7000-8000-000000000000", 36, out, sizeof(out));
    if (n >= 0 && outbox_key_slot(out, (size_t)n) != outbox_key_slot(stream, len) && plain)
        fuzz_fail("a dedup key outside its stream's slot", out);
    n = outbox_key_dlq(stream, "workers", out, sizeof(out));
    if (n >= 0 && (size_t)n != strlen(out))
        fuzz_fail("a dead-letter name of the wrong length", out);
    if (n >= 0 && outbox_key_slot(out, (size_t)n) != outbox_key_slot(stream, len) && plain)
        fuzz_fail("a dead-letter stream outside its stream's slot", out);
    n = outbox_key_lease(stream, "workers", "lease", out, sizeof(out));
    if (n >= 0 && outbox_key_slot(out, (size_t)n) != outbox_key_slot(stream, len) && plain)
        fuzz_fail("a lease outside its stream's slot", out);

    int partition;
    size_t topic_len = outbox_key_stream_topic_len(stream, len, &partition);
    if (topic_len > len || partition < -1 || partition > 999)
        fuzz_fail("a partition suffix read wrong", stream);
    if (partition >= 0) {
        char name[8192];
        n = outbox_key_partition_stream("", stream, topic_len, (uint32_t)partition,
                                        OUTBOX_PARTITIONS_MAX, name, sizeof(name));
        if (partition < OUTBOX_PARTITIONS_MAX && n >= 0 &&
            ((size_t)n != len || memcmp(name, stream, len) != 0))
            fuzz_fail("a partition stream's name does not read back", name);
    }
    uint32_t p = outbox_partition_of(key, size, 7, 16);
    if (p >= 16)
        fuzz_fail("a partition out of range", NULL);
    free(stream);
    return 0;
}
