/*
 * Redis key names (include/relay/keys.h): the one place that builds them.
 */
#include "relay/compat.h"

#include "relay/keys.h"

#include <stdio.h>
#include <string.h>

static int fits(int n, size_t outlen)
{
    return n >= 0 && (size_t)n < outlen ? n : -1;
}

int relay_key_stream(const char *prefix, const char *topic, size_t topic_len, char *out,
                     size_t outlen)
{
    return fits(
        snprintf(out, outlen, "%s%.*s", prefix != NULL ? prefix : "", (int)topic_len, topic),
        outlen);
}

int relay_key_dedup(const char *stream, const char *message_id, size_t message_id_len, char *out,
                    size_t outlen)
{
    return fits(snprintf(out, outlen, "{%s}:dedup:%.*s", stream, (int)message_id_len, message_id),
                outlen);
}

/* "<stream>.<group><suffix>", with names of any bytes but NUL. */
static int join_name(const char *stream, const char *group, const char *suffix, char *out,
                     size_t outlen)
{
    size_t a = strlen(stream), b = strlen(group), c = strlen(suffix);
    if (a + 1 + b + c + 1 > outlen)
        return -1;
    memcpy(out, stream, a);
    out[a] = '.';
    memcpy(out + a + 1, group, b);
    memcpy(out + a + 1 + b, suffix, c + 1);
    return (int)(a + 1 + b + c);
}

int relay_key_dlq(const char *stream, const char *group, char *out, size_t outlen)
{
    return join_name(stream, group, ".dlq", out, outlen);
}

int relay_key_replay(const char *stream, const char *group, char *out, size_t outlen)
{
    return join_name(stream, group, ".replay", out, outlen);
}
