/*
 * Redis key names (common/keys.h): the one place that builds them.
 */
#include "common/compat.h"

#include "common/keys.h"
#include "common/common.h"

#include <stdio.h>
#include <string.h>

static int fits(int n, size_t outlen)
{
    return n >= 0 && (size_t)n < outlen ? n : -1;
}

static uint16_t crc16_xmodem(const char *data, size_t len)
{
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)((unsigned char)data[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = (uint16_t)(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    return crc;
}

unsigned outbox_key_slot(const char *key, size_t len)
{
    const char *open = memchr(key, '{', len);
    if (open != NULL) {
        size_t at = (size_t)(open - key) + 1;
        const char *close = memchr(key + at, '}', len - at);
        if (close != NULL && close > key + at) {
            key += at;
            len = (size_t)(close - key);
        }
    }
    return crc16_xmodem(key, len) & (OUTBOX_CLUSTER_SLOTS - 1);
}

int outbox_key_stream(const char *prefix, const char *topic, size_t topic_len, char *out,
                      size_t outlen)
{
    return fits(
        snprintf(out, outlen, "%s%.*s", prefix != NULL ? prefix : "", (int)topic_len, topic),
        outlen);
}

uint32_t outbox_partition_hash(const void *data, size_t len)
{
    const unsigned char *p = data;
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 16777619u;
    }
    return h;
}

uint32_t outbox_partition_of(const char *key, size_t key_len, int64_t id, uint32_t partitions)
{
    if (partitions <= 1)
        return 0;
    if (key == NULL)
        return (uint32_t)((uint64_t)id % partitions);
    return outbox_partition_hash(key, key_len) % partitions;
}

size_t outbox_key_partition_suffix(uint32_t partition, uint32_t partitions,
                                   char out[OUTBOX_PARTITION_SUFFIX_LEN])
{
    if (partitions <= 1)
        return 0;
    unsigned v = partition % OUTBOX_PARTITIONS_MAX;
    out[0] = ':';
    out[1] = (char)('0' + v / 100);
    out[2] = (char)('0' + v / 10 % 10);
    out[3] = (char)('0' + v % 10);
    return OUTBOX_PARTITION_SUFFIX_LEN;
}

int outbox_key_partition_stream(const char *prefix, const char *topic, size_t topic_len,
                                uint32_t partition, uint32_t partitions, char *out, size_t outlen)
{
    char suffix[OUTBOX_PARTITION_SUFFIX_LEN];
    size_t slen = outbox_key_partition_suffix(partition, partitions, suffix);
    return fits(snprintf(out, outlen, "%s%.*s%.*s", prefix != NULL ? prefix : "", (int)topic_len,
                         topic, (int)slen, suffix),
                outlen);
}

size_t outbox_key_stream_topic_len(const char *name, size_t name_len, int *partition)
{
    *partition = -1;
    if (name_len < OUTBOX_PARTITION_SUFFIX_LEN + 1)
        return name_len;
    const char *s = name + name_len - OUTBOX_PARTITION_SUFFIX_LEN;
    if (s[0] != ':')
        return name_len;
    int v = 0;
    for (int i = 1; i < OUTBOX_PARTITION_SUFFIX_LEN; i++) {
        if (s[i] < '0' || s[i] > '9')
            return name_len;
        v = v * 10 + (s[i] - '0');
    }
    *partition = v;
    return name_len - OUTBOX_PARTITION_SUFFIX_LEN;
}

int outbox_key_dedup(const char *stream, const char *message_id, size_t message_id_len, char *out,
                     size_t outlen)
{
    return fits(snprintf(out, outlen, "{%s}:dedup:%.*s", stream, (int)message_id_len, message_id),
                outlen);
}

/* "{<stream>}.<group><suffix>" (with braces, in the stream's hash slot) or
 * "<stream>.<group><suffix>" (without: the names before 0.2), with names of
 * any bytes but NUL. */
static int join_name(const char *stream, const char *group, const char *suffix, int tagged,
                     char *out, size_t outlen)
{
    size_t a = strlen(stream), b = strlen(group), c = strlen(suffix), t = tagged ? 2 : 0;
    if (a + t + 1 + b + c + 1 > outlen)
        return -1;
    char *p = out;
    if (tagged)
        *p++ = '{';
    memcpy(p, stream, a); // NOLINT(bugprone-not-null-terminated-result): the suffix's NUL ends it
    p += a;
    if (tagged)
        *p++ = '}';
    *p++ = '.';
    memcpy(p, group, b); // NOLINT(bugprone-not-null-terminated-result): the suffix's NUL ends it
    memcpy(p + b, suffix, c + 1);
    return (int)(a + t + 1 + b + c);
}

int outbox_key_dlq(const char *stream, const char *group, char *out, size_t outlen)
{
    return join_name(stream, group, ".dlq", 1, out, outlen);
}

int outbox_key_replay(const char *stream, const char *group, char *out, size_t outlen)
{
    return join_name(stream, group, ".replay", 1, out, outlen);
}

int outbox_key_dlq_old(const char *stream, const char *group, char *out, size_t outlen)
{
    return join_name(stream, group, ".dlq", 0, out, outlen);
}

int outbox_key_replay_old(const char *stream, const char *group, char *out, size_t outlen)
{
    return join_name(stream, group, ".replay", 0, out, outlen);
}

int outbox_key_lease(const char *stream, const char *group, const char *what, char *out,
                     size_t outlen)
{
    return fits(snprintf(out, outlen, "{%s}:%s:%s", stream, what, group), outlen);
}

int outbox_topic_valid(const char *topic, size_t len)
{
    if (topic == NULL || len == 0 || len > OUTBOX_TOPIC_MAX)
        return 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)topic[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                 c == '.' || c == '_' || c == '-';
        if (!ok)
            return 0;
    }
    return 1;
}
