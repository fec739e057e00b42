/*
 * The pure half of a claim cycle. The relay claims rows in one PostgreSQL
 * transaction and publishes each through the Redis function below; this file
 * decides what each row's command looks like, whether a row can be published
 * at all, and whether a failure belongs to one row (it is retried and in the
 * end quarantined, so it never blocks the rows behind it) or to the whole batch
 * (it is rolled back and retried later, and no row is blamed).
 */
#include "relay/compat.h"

#include "relay/batch.h"

#include <arpa/inet.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * The publish function. KEYS[1] is the stream, KEYS[2] the message's dedup
 * record; both share the stream's hash tag so the layout is Cluster-safe.
 * ARGV[1] is the record's time to live in ms, ARGV[2] the validity deadline
 * (Unix ms on the server's clock), ARGV[3..] the entry's fields.
 *
 * A message id already recorded returns the entry id of the first copy. A
 * call that runs after its deadline publishes nothing: the relay gave up on
 * it and will publish the row again, and by then it may have committed that
 * second publish and removed the record, so a late first copy would be a
 * duplicate. The record is written only after XADD succeeded: a function
 * body does not roll back, so recording first would turn a failed XADD into
 * a lost message.
 */
const char relay_batch_function_source[] =
    "#!lua name=" RELAY_FUNCTION_LIBRARY "\n"
    "local function publish(keys, args)\n"
    "  local seen = redis.call('GET', keys[2])\n"
    "  if seen then return seen end\n"
    "  local t = redis.call('TIME')\n"
    "  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
    "  if now > tonumber(args[2]) then\n"
    "    return redis.error_reply('EXPIRED publish deadline passed; the relay retries it')\n"
    "  end\n"
    "  local id = redis.call('XADD', keys[1], '*', unpack(args, 3))\n"
    "  redis.call('SET', keys[2], id, 'PX', args[1])\n"
    "  return id\n"
    "end\n"
    "redis.register_function('" RELAY_FUNCTION_PUBLISH "', publish)\n";

size_t relay_batch_utf8_prefix(const char *s, size_t len, size_t max)
{
    if (len <= max)
        return len;
    /* Back off continuation bytes (10xxxxxx) so the cut falls between characters. */
    size_t n = max;
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80)
        n--;
    return n;
}

int relay_batch_topic_valid(const char *topic, size_t len)
{
    if (topic == NULL || len == 0 || len > RELAY_TOPIC_MAX)
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

int relay_batch_stream_name(const char *prefix, const char *topic, size_t topic_len, char *out,
                            size_t outlen)
{
    int n = snprintf(out, outlen, "%s%.*s", prefix ? prefix : "", (int)topic_len, topic);
    if (n < 0 || (size_t)n >= outlen)
        return -1;
    return n;
}

int relay_batch_dedup_key(const char *stream, const char *message_id, size_t message_id_len,
                          char *out, size_t outlen)
{
    int n = snprintf(out, outlen, "{%s}:dedup:%.*s", stream, (int)message_id_len, message_id);
    if (n < 0 || (size_t)n >= outlen)
        return -1;
    return n;
}

int64_t relay_batch_decode_int8(const char *buf)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | (unsigned char)buf[i];
    return (int64_t)v;
}

int32_t relay_batch_decode_int4(const char *buf)
{
    uint32_t v;
    memcpy(&v, buf, 4);
    return (int32_t)ntohl(v);
}

/*
 * Binary array format: int32 ndim, int32 has-nulls flag, uint32 element type,
 * then per dimension int32 size and int32 lower bound, then per element an
 * int32 length (-1 for NULL) and that many bytes.
 */
int relay_batch_decode_text_array(const char *buf, size_t len, const char **items, size_t *lens,
                                  size_t max)
{
    if (buf == NULL || len < 12)
        return -1;
    int32_t ndim = relay_batch_decode_int4(buf);
    if (ndim == 0)
        return 0;
    if (ndim != 1 || len < 20)
        return -1;
    int32_t count = relay_batch_decode_int4(buf + 12);
    if (count < 0 || (size_t)count > max)
        return -1;
    size_t off = 20;
    for (int32_t i = 0; i < count; i++) {
        if (len - off < 4)
            return -1;
        int32_t n = relay_batch_decode_int4(buf + off);
        off += 4;
        if (n < 0 || (size_t)n > len - off)
            return -1;
        items[i] = buf + off;
        lens[i] = (size_t)n;
        off += (size_t)n;
    }
    return off == len ? count : -1;
}

static int set_error(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int set_error(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

static void add_arg(struct relay_publish_cmd *cmd, const char *s, size_t len)
{
    cmd->argv[cmd->argc] = s;
    cmd->argvlen[cmd->argc] = len;
    cmd->argc++;
}

int relay_batch_build_publish(const struct relay_row *row, const char *stream_prefix,
                              uint32_t max_payload_bytes, uint32_t dedup_ttl_ms,
                              uint64_t not_after_ms, struct relay_publish_cmd *cmd, char *err,
                              size_t errlen)
{
    cmd->argc = 0;

    if (!relay_batch_topic_valid(row->topic, row->topic_len)) {
        size_t shown = relay_batch_utf8_prefix(row->topic, row->topic_len, 64);
        return set_error(err, errlen,
                         "topic \"%.*s\" is not allowed: a topic is 1 to 200 characters of "
                         "A-Z a-z 0-9 . _ -; fix the producer, then re-queue the row with "
                         "outbox-relay failed retry",
                         (int)shown, row->topic);
    }
    if (row->payload_len > max_payload_bytes) {
        snprintf(err, errlen,
                 "payload of %zu bytes exceeds max_payload_bytes (%u); raise max_payload_bytes "
                 "or store large payloads elsewhere and send a reference, then re-queue the row",
                 row->payload_len, max_payload_bytes);
        return -1;
    }
    if (row->key != NULL && row->key_len > RELAY_KEY_MAX) {
        snprintf(err, errlen,
                 "partition key of %zu bytes exceeds the limit of %d bytes; shorten it in the "
                 "producer, then re-queue the row",
                 row->key_len, RELAY_KEY_MAX);
        return -1;
    }

    const char *names[RELAY_HEADERS_MAX], *values[RELAY_HEADERS_MAX];
    size_t name_lens[RELAY_HEADERS_MAX], value_lens[RELAY_HEADERS_MAX];
    int nheaders = 0;
    if (row->headers_type != NULL) {
        if (strcmp(row->headers_type, "object") != 0)
            return set_error(err, errlen,
                             "headers must be a JSON object of name/value pairs, not a JSON %.*s; "
                             "fix the producer, then re-queue the row",
                             (int)strlen(row->headers_type), row->headers_type);
        nheaders = relay_batch_decode_text_array(row->header_names, row->header_names_len, names,
                                                 name_lens, RELAY_HEADERS_MAX);
        int nvalues = relay_batch_decode_text_array(row->header_values, row->header_values_len,
                                                    values, value_lens, RELAY_HEADERS_MAX);
        if (nheaders < 0 || nvalues != nheaders) {
            snprintf(err, errlen,
                     "headers cannot be encoded: at most %d headers are allowed; reduce them in "
                     "the producer, then re-queue the row",
                     RELAY_HEADERS_MAX);
            return -1;
        }
        for (int i = 0; i < nheaders; i++) {
            if (name_lens[i] == 0 || name_lens[i] > RELAY_HEADER_NAME_MAX)
                return set_error(err, errlen,
                                 "header name \"%.*s\" cannot be encoded: names are 1 to 128 "
                                 "bytes; fix the producer, then re-queue the row",
                                 (int)relay_batch_utf8_prefix(names[i], name_lens[i], 64), names[i]);
            if (value_lens[i] > RELAY_HEADER_VALUE_MAX)
                return set_error(err, errlen,
                                 "value of header \"%.*s\" exceeds 8192 bytes; shorten it in "
                                 "the producer, then re-queue the row",
                                 (int)relay_batch_utf8_prefix(names[i], name_lens[i], 64), names[i]);
        }
    }

    int slen = relay_batch_stream_name(stream_prefix, row->topic, row->topic_len, cmd->stream,
                                       sizeof(cmd->stream));
    int dlen = relay_batch_dedup_key(cmd->stream, row->message_id, row->message_id_len,
                                     cmd->dedup_key, sizeof(cmd->dedup_key));
    int tlen = snprintf(cmd->ttl, sizeof(cmd->ttl), "%u", dedup_ttl_ms);
    int olen = snprintf(cmd->outbox_id, sizeof(cmd->outbox_id), "%lld", (long long)row->id);
    int nlen = snprintf(cmd->not_after, sizeof(cmd->not_after), "%llu",
                        (unsigned long long)not_after_ms);
    if (slen < 0 || dlen < 0 || tlen < 0 || olen < 0 || nlen < 0) {
        snprintf(err, errlen, "stream name too long for topic; shorten stream_prefix or topic");
        return -1;
    }

    add_arg(cmd, "FCALL", 5);
    add_arg(cmd, RELAY_FUNCTION_PUBLISH, sizeof(RELAY_FUNCTION_PUBLISH) - 1);
    add_arg(cmd, "2", 1);
    add_arg(cmd, cmd->stream, (size_t)slen);
    add_arg(cmd, cmd->dedup_key, (size_t)dlen);
    add_arg(cmd, cmd->ttl, (size_t)tlen);
    add_arg(cmd, cmd->not_after, (size_t)nlen);
    add_arg(cmd, "id", 2);
    add_arg(cmd, row->message_id, row->message_id_len);
    add_arg(cmd, "topic", 5);
    add_arg(cmd, row->topic, row->topic_len);
    if (row->key != NULL) {
        add_arg(cmd, "key", 3);
        add_arg(cmd, row->key, row->key_len);
    }
    add_arg(cmd, "payload", 7);
    add_arg(cmd, row->payload, row->payload_len);
    add_arg(cmd, "created_at", 10);
    add_arg(cmd, row->created_at, row->created_at_len);
    add_arg(cmd, "outbox_id", 9);
    add_arg(cmd, cmd->outbox_id, (size_t)olen);
    for (int i = 0; i < nheaders; i++) {
        int hl = snprintf(cmd->header_fields[i], sizeof(cmd->header_fields[i]), "h.%.*s",
                          (int)name_lens[i], names[i]);
        add_arg(cmd, cmd->header_fields[i], (size_t)hl);
        add_arg(cmd, values[i], value_lens[i]);
    }
    return 0;
}

/*
 * Only an error about the message's own stream key is the row's fault. Anything
 * else (OOM, MISCONF, READONLY, LOADING, BUSY, NOAUTH, NOPERM, a missing
 * function, an unknown reply) says the Redis side cannot take writes now: the
 * whole batch is retried and no row is blamed.
 */
enum relay_error_scope relay_batch_classify_error(const char *msg, size_t len)
{
    static const char wrongtype[] = "WRONGTYPE";
    if (msg != NULL && len >= sizeof(wrongtype) - 1 &&
        memcmp(msg, wrongtype, sizeof(wrongtype) - 1) == 0)
        return RELAY_ERROR_ROW;
    return RELAY_ERROR_BATCH;
}

uint32_t relay_batch_row_retry_ms(int32_t attempts, uint32_t base_ms, uint32_t max_ms)
{
    uint64_t d = base_ms;
    for (int32_t i = 1; i < attempts && d < max_ms; i++)
        d *= 2;
    return d > max_ms ? max_ms : (uint32_t)d;
}

static int contains(const char *s, size_t len, const char *needle)
{
    size_t n = strlen(needle);
    for (size_t i = 0; s != NULL && n <= len && i <= len - n; i++)
        if (memcmp(s + i, needle, n) == 0)
            return 1;
    return 0;
}

int relay_batch_apply_reply(struct relay_cycle *cycle, struct relay_row *row,
                            enum relay_reply_kind kind, const char *str, size_t len)
{
    if (cycle->pending == 0)
        return 0;
    cycle->pending--;
    switch (kind) {
    case RELAY_REPLY_ENTRY:
        row->state = RELAY_ROW_PUBLISHED;
        break;
    case RELAY_REPLY_ERROR:
        if (relay_batch_classify_error(str, len) == RELAY_ERROR_ROW) {
            row->state = RELAY_ROW_FAILED;
            snprintf(row->error, sizeof(row->error),
                     "Redis refused the entry: %.*s; the stream key for topic \"%.*s\" holds "
                     "another type: rename or delete that key, then re-queue the row",
                     (int)relay_batch_utf8_prefix(str, len, 200), str,
                     (int)relay_batch_utf8_prefix(row->topic, row->topic_len, 64), row->topic);
            break;
        }
        if (!cycle->failed) {
            cycle->failed = 1;
            snprintf(cycle->error, sizeof(cycle->error), "Redis answered: %.*s",
                     (int)relay_batch_utf8_prefix(str, len, 300), str ? str : "");
        }
        if (contains(str, len, "Function not found"))
            cycle->function_missing = 1;
        break;
    case RELAY_REPLY_OTHER:
        if (!cycle->failed) {
            cycle->failed = 1;
            snprintf(cycle->error, sizeof(cycle->error),
                     "unexpected reply type from the publish function (is this Redis 7 with the "
                     "outbox_relay library?)");
        }
        break;
    case RELAY_REPLY_LOST:
    default:
        if (!cycle->failed) {
            cycle->failed = 1;
            snprintf(cycle->error, sizeof(cycle->error), "Redis connection lost: %.*s",
                     (int)relay_batch_utf8_prefix(str, len, 200), str && len ? str : "dropped");
        }
        break;
    }
    return cycle->pending == 0;
}

void relay_sqlbuf_reset(struct relay_sqlbuf *b)
{
    b->len = 0;
    b->overflow = 0;
    if (b->data != NULL)
        b->data[0] = '\0';
}

void relay_sqlbuf_append(struct relay_sqlbuf *b, const char *s)
{
    size_t n = strlen(s);
    size_t max = b->max ? b->max : (64u << 20);
    if (b->overflow)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1)
            cap *= 2;
        if (cap > max) {
            b->overflow = 1;
            return;
        }
        char *p = realloc(b->data, cap);
        if (p == NULL) {
            b->overflow = 1;
            return;
        }
        b->data = p;
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n + 1);
    b->len += n;
}

void relay_sqlbuf_free(struct relay_sqlbuf *b)
{
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* Failed rows wait 1 s, 2 s, 4 s ... between attempts, at most 5 minutes. */
#define ROW_RETRY_BASE_MS 1000u
#define ROW_RETRY_MAX_MS (5u * 60u * 1000u)

int relay_batch_finish_sql(const struct relay_row *rows, size_t n, uint32_t max_attempts,
                           const struct relay_sql_quoter *q, const char *before_commit,
                           struct relay_sqlbuf *out)
{
    char buf[160];
    int any = 0, quarantined = 0;

    relay_sqlbuf_reset(out);
    for (size_t i = 0; i < n; i++) {
        if (rows[i].state != RELAY_ROW_PUBLISHED)
            continue;
        relay_sqlbuf_append(out, any ? "," : "UPDATE outbox.messages SET sent_at = statement_timestamp() "
                                             "WHERE id = ANY('{");
        snprintf(buf, sizeof(buf), "%lld", (long long)rows[i].id);
        relay_sqlbuf_append(out, buf);
        any = 1;
    }
    if (any)
        relay_sqlbuf_append(out, "}'::bigint[]);");
    for (size_t i = 0; i < n; i++) {
        const struct relay_row *row = &rows[i];
        if (row->state != RELAY_ROW_FAILED)
            continue;
        int32_t attempts = row->attempts + 1;
        int quarantine = attempts > 0 && (uint32_t)attempts >= max_attempts;
        char *lit = q->quote(q->ctx, row->error, strlen(row->error));
        if (lit == NULL) {
            /* Text the server will not take (say, invalid in the database
             * encoding) must not hold up the batch: store a plain message. */
            static const char plain[] = "the row cannot be published; its error text could not "
                                        "be stored, see the relay log";
            lit = q->quote(q->ctx, plain, sizeof(plain) - 1);
            if (lit == NULL)
                return -1;
        }
        relay_sqlbuf_append(out, "UPDATE outbox.messages SET attempts = attempts + 1, "
                                 "last_error = ");
        relay_sqlbuf_append(out, lit);
        q->freefn(lit);
        snprintf(buf, sizeof(buf),
                 ", retry_at = statement_timestamp() + interval '%u milliseconds', failed_at = %s WHERE id = %lld;",
                 relay_batch_row_retry_ms(attempts, ROW_RETRY_BASE_MS, ROW_RETRY_MAX_MS),
                 quarantine ? "statement_timestamp()" : "NULL", (long long)row->id);
        relay_sqlbuf_append(out, buf);
        quarantined += quarantine;
    }
    if (before_commit != NULL)
        relay_sqlbuf_append(out, before_commit);
    relay_sqlbuf_append(out, "COMMIT");
    return out->overflow ? -1 : quarantined;
}
