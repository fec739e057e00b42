/*
 * The pure half of publishing a batch (docs/DESIGN.md, "Batches from
 * snapshots"): whether a row can be published at all, and the MULTI / XADD
 * ... / EXEC of a stream's rows, with each row's entry id. A row that breaks
 * a rule fails on its own (it is quarantined, so it never blocks the rows
 * behind it); its failure has a cause: the row itself (dropped and written
 * again by the fixed producer) or the setup (changed, and the same row
 * re-queued), which decides the advice its message ends with. Both are set
 * where the failure is found, never read back from the message. Also the
 * decoding of PostgreSQL's binary result formats.
 */
#include "common/compat.h"

#include "relay/batch.h"

#include <arpa/inet.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/keys.h"

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

/* Writes v's decimal digits, at least width of them (zero-padded). */
static char *put_digits(char *p, uint64_t v, int width)
{
    char tmp[20];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v > 0);
    while (n < width)
        tmp[n++] = '0';
    while (n > 0)
        *p++ = tmp[--n];
    return p;
}

size_t relay_batch_format_timestamp(int64_t us, char *out)
{
    if (us == INT64_MIN || us == INT64_MAX) { /* -infinity, infinity */
        out[0] = '\0';
        return 0;
    }
    const int64_t day_us = INT64_C(86400000000);
    int64_t days = us / day_us;
    int64_t rem = us % day_us;
    if (rem < 0) {
        rem += day_us;
        days--;
    }
    /* The proleptic Gregorian date of a count of days since 1970-01-01 (the
     * civil-from-days algorithm, in eras of 400 years), as PostgreSQL's. */
    int64_t z = days + 10957 + 719468; /* 2000-01-01 is day 10957 */
    int64_t era = (z >= 0 ? z : z - 146096) / 146097;
    uint64_t doe = (uint64_t)(z - era * 146097);
    uint64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    uint64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    uint64_t mp = (5 * doy + 2) / 153;
    uint64_t day = doy - (153 * mp + 2) / 5 + 1;
    uint64_t month = mp < 10 ? mp + 3 : mp - 9;
    int64_t year = (int64_t)yoe + era * 400 + (month <= 2);
    /* Year 0 is 1 BC; to_char's YYYY writes a year BC as its number. */
    uint64_t shown = year > 0 ? (uint64_t)year : (uint64_t)(1 - year);

    uint64_t secs = (uint64_t)rem / 1000000, micros = (uint64_t)rem % 1000000;
    char *p = put_digits(out, shown, 4);
    *p++ = '-';
    p = put_digits(p, month, 2);
    *p++ = '-';
    p = put_digits(p, day, 2);
    *p++ = 'T';
    p = put_digits(p, secs / 3600, 2);
    *p++ = ':';
    p = put_digits(p, secs / 60 % 60, 2);
    *p++ = ':';
    p = put_digits(p, secs % 60, 2);
    *p++ = '.';
    p = put_digits(p, micros, 6);
    *p++ = 'Z';
    *p = '\0';
    return (size_t)(p - out);
}

void relay_batch_format_uuid(const unsigned char *in, char *out)
{
    static const char hex[] = "0123456789abcdef";
    char *p = out;
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10)
            *p++ = '-';
        *p++ = hex[in[i] >> 4];
        *p++ = hex[in[i] & 15];
    }
    *p = '\0';
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

/*
 * Ends a failed row's message in err with what to do once the row is
 * quarantined, as its cause calls for (enum relay_row_cause), and returns -1.
 * A row the producer wrote wrongly fails the same way when re-queued as it
 * is, so its advice is to drop it and write it again; a row refused by
 * something an operator can change goes through once that is changed, so
 * its advice is to re-queue it. The cause is chosen where the failure is
 * found, never read back from the text.
 */
static int add_advice(char *err, size_t errlen, enum relay_row_cause cause, int64_t id)
{
    size_t len = strnlen(err, errlen);
    if (len + 1 >= errlen)
        return -1;
    if (cause == RELAY_CAUSE_ROW)
        snprintf(err + len, errlen - len,
                 "; the row itself is wrong, so re-queued it fails again: drop it with "
                 "'outbox-relay failed drop %lld' and write it again from the fixed producer",
                 (long long)id);
    else
        snprintf(err + len, errlen - len,
                 ", then re-queue the row with 'outbox-relay failed retry %lld'", (long long)id);
    return -1;
}

/* The room a stream name is formatted into, its NUL included: a longer
 * stream_prefix makes a row fail as one of the setup. */
#define STREAM_NAME_SIZE ((size_t)256 + OUTBOX_TOPIC_MAX)

/* A row's headers, decoded from its two binary text[] columns. */
struct row_headers {
    int n;
    const char *names[OUTBOX_HEADERS_MAX], *values[OUTBOX_HEADERS_MAX];
    size_t name_lens[OUTBOX_HEADERS_MAX], value_lens[OUTBOX_HEADERS_MAX];
};

/* The row's headers, decoded into h: 0, or -1 with err set. */
static int check_headers(const struct relay_row *row, struct row_headers *h, char *err,
                         size_t errlen)
{
    if (strcmp(row->headers_type, "object") != 0)
        return set_error(err, errlen,
                         "headers must be a JSON object of name/value pairs, not a JSON %.*s; "
                         "fix the producer",
                         (int)strlen(row->headers_type), row->headers_type);
    h->n = relay_batch_decode_text_array(row->header_names, row->header_names_len, h->names,
                                         h->name_lens, OUTBOX_HEADERS_MAX);
    int nvalues = relay_batch_decode_text_array(row->header_values, row->header_values_len,
                                                h->values, h->value_lens, OUTBOX_HEADERS_MAX);
    if (h->n < 0 || nvalues != h->n) {
        h->n = 0;
        snprintf(err, errlen,
                 "headers cannot be encoded: at most %d headers are allowed; reduce them in "
                 "the producer",
                 OUTBOX_HEADERS_MAX);
        return -1;
    }
    for (int i = 0; i < h->n; i++) {
        if (h->name_lens[i] == 0 || h->name_lens[i] > OUTBOX_HEADER_NAME_MAX)
            return set_error(err, errlen,
                             "header name \"%.*s\" cannot be encoded: names are 1 to 128 "
                             "bytes; fix the producer",
                             (int)relay_batch_utf8_prefix(h->names[i], h->name_lens[i], 64),
                             h->names[i]);
        if (h->value_lens[i] > OUTBOX_HEADER_VALUE_MAX)
            return set_error(err, errlen,
                             "value of header \"%.*s\" exceeds 8192 bytes; shorten it in "
                             "the producer",
                             (int)relay_batch_utf8_prefix(h->names[i], h->name_lens[i], 64),
                             h->names[i]);
    }
    return 0;
}

/* The largest max_payload_bytes there is (core/config_table.c, and Redis's
 * default proto-max-bulk-len): a payload above it is the producer's to fix. */
#define RELAY_PAYLOAD_LIMIT_MAX 536870912u

/*
 * Every rule a row must pass before it can be published, in the order they
 * are reported. Fills h and the length of the stream name; -1 with a message in err
 * when the row cannot be published, the kind of failure in *fault and whose
 * it is in *cause (the message's advice follows it).
 */
static int check_row(const struct relay_row *row, size_t prefix_len, uint32_t max_payload_bytes,
                     struct row_headers *h, size_t *stream_len, char *err, size_t errlen,
                     enum relay_row_fault *fault, enum relay_row_cause *cause)
{
    h->n = 0;
    /* Each rule below is about what the producer wrote, or about the limits
     * of this relay's configuration that it was checked against: the same row
     * fails the same way on every attempt until someone changes one of them,
     * so a retry cannot help. Which of the two must change is the cause. */
    *fault = RELAY_FAULT_PERMANENT;
    *cause = RELAY_CAUSE_ROW;
    if (!outbox_topic_valid(row->topic, row->topic_len)) {
        size_t shown = relay_batch_utf8_prefix(row->topic, row->topic_len, 64);
        set_error(err, errlen,
                  "topic \"%.*s\" is not allowed: a topic is 1 to 200 characters of "
                  "A-Z a-z 0-9 . _ -; fix the producer",
                  (int)shown, row->topic);
        return add_advice(err, errlen, *cause, row->id);
    }
    /* A payload the claim left in the database (payload NULL) is too large
     * by the same limit; its size came alone. Up to the largest limit there
     * is, the operator's max_payload_bytes decides, and raising it lets the
     * same row through; above it, only the producer can help. */
    if (row->payload_len > max_payload_bytes || row->payload == NULL) {
        if (row->payload_len > RELAY_PAYLOAD_LIMIT_MAX) {
            snprintf(err, errlen,
                     "payload of %zu bytes exceeds max_payload_bytes (%u) and the largest it can "
                     "be (%u); store large payloads elsewhere and send a reference",
                     row->payload_len, max_payload_bytes, RELAY_PAYLOAD_LIMIT_MAX);
            return add_advice(err, errlen, *cause, row->id);
        }
        *cause = RELAY_CAUSE_SETUP;
        snprintf(
            err, errlen,
            "payload of %zu bytes exceeds max_payload_bytes (%u); if payloads this large are "
            "meant to be published, raise max_payload_bytes to at least %zu (it takes a restart)",
            row->payload_len, max_payload_bytes, row->payload_len);
        add_advice(err, errlen, *cause, row->id);
        size_t len = strnlen(err, errlen);
        snprintf(err + len, errlen - len,
                 "; if not, the producer should store them elsewhere and send a reference: drop "
                 "the row with 'outbox-relay failed drop %lld' and write it again",
                 (long long)row->id);
        return -1;
    }
    if (row->key != NULL && row->key_len > OUTBOX_KEY_MAX) {
        snprintf(err, errlen,
                 "partition key of %zu bytes exceeds the limit of %d bytes; shorten it in the "
                 "producer",
                 row->key_len, OUTBOX_KEY_MAX);
        return add_advice(err, errlen, *cause, row->id);
    }

    if (row->headers_type != NULL && check_headers(row, h, err, errlen) < 0)
        return add_advice(err, errlen, *cause, row->id);

    /* "<prefix><topic>" must fit the room of a stream name. A topic that
     * passed its rule always fits behind a stream_prefix the configuration
     * allows: only a longer prefix can break this. */
    *stream_len =
        prefix_len + row->topic_len + (row->partitions > 1 ? OUTBOX_PARTITION_SUFFIX_LEN : 0);
    if (*stream_len >= STREAM_NAME_SIZE) {
        *cause = RELAY_CAUSE_SETUP;
        snprintf(err, errlen, "stream name too long for topic; shorten stream_prefix");
        return add_advice(err, errlen, *cause, row->id);
    }
    *fault = RELAY_FAULT_NONE;
    *cause = RELAY_CAUSE_NONE;
    return 0;
}

/* ---- commands in the Redis protocol, without printf ----------------------
 *
 * The relay spends most of its CPU turning rows into protocol: snprintf for
 * the numbers and keys, then hiredis's sds formatting, each with its own
 * allocations. The functions below write the same bytes as
 * redisFormatCommandArgv straight into one reused buffer: the size of a
 * command is computed first, the buffer grows once if at all, and the bytes
 * are copied in with memcpy. */

/* Makes room for need more bytes: 0, or OUTBOX_BUF_FULL past out->max. */
static int respbuf_reserve(struct outbox_buf *out, size_t need)
{
    int rc = outbox_buf_reserve(out, need);
    if (rc == OUTBOX_BUF_NOMEM) {
        /* The relay's policy for memory: no recovery. */
        fputs("outbox-relay: out of memory\n", stderr);
        abort();
    }
    return rc;
}

/* Decimal digits of v. */
static size_t count_digits(uint64_t v)
{
    size_t n = 1;
    while (v >= 10) {
        v /= 10;
        n++;
    }
    return n;
}

/* Writes v in decimal at p (count_digits(v) bytes); returns the end. */
static char *put_uint(char *p, uint64_t v)
{
    size_t n = count_digits(v);
    char *end = p + n;
    do {
        *--end = (char)('0' + v % 10);
        v /= 10;
    } while (v != 0);
    return p + n;
}

/* Bytes of one bulk string "$<len>\r\n<bytes>\r\n" holding len bytes. */
static size_t bulk_size(size_t len)
{
    return 1 + count_digits(len) + 2 + len + 2;
}

/* "*<argc>\r\n" */
static char *put_array(char *p, size_t argc)
{
    *p++ = '*';
    p = put_uint(p, argc);
    *p++ = '\r';
    *p++ = '\n';
    return p;
}

/* "$<len>\r\n", the head of a bulk string whose bytes the caller writes. */
static char *put_bulk_head(char *p, size_t len)
{
    *p++ = '$';
    p = put_uint(p, len);
    *p++ = '\r';
    *p++ = '\n';
    return p;
}

static char *put_mem(char *p, const char *s, size_t len)
{
    memcpy(p, s, len);
    return p + len;
}

static char *put_crlf(char *p)
{
    *p++ = '\r';
    *p++ = '\n';
    return p;
}

static char *put_bulk(char *p, const char *s, size_t len)
{
    return put_crlf(put_mem(put_bulk_head(p, len), s, len));
}

/* A constant of the protocol, without its NUL. */
#define PUT_LIT(p, lit) put_mem((p), (lit), sizeof(lit) - 1)

/* A signed integer as "%lld" writes it, into buf (at least 21 bytes). */
static size_t format_int64(char *buf, int64_t v)
{
    char *p = buf;
    uint64_t u = (uint64_t)v;
    if (v < 0) {
        *p++ = '-';
        u = 0 - u;
    }
    return (size_t)(put_uint(p, u) - buf);
}

static size_t partition_suffix(const struct relay_row *row, char out[OUTBOX_PARTITION_SUFFIX_LEN])
{
    return outbox_key_partition_suffix(row->partition, row->partitions, out);
}

/* The entry's fields of row: their bytes as bulk strings, and their number
 * in *argc. */
static size_t fields_size(const struct relay_row *row, const struct row_headers *h,
                          size_t outbox_id_len, size_t *argc)
{
    size_t need = bulk_size(2) + bulk_size(row->message_id_len) + bulk_size(5) +
                  bulk_size(row->topic_len) + bulk_size(7) + bulk_size(row->payload_len) +
                  bulk_size(10) + bulk_size(row->created_at_len) + bulk_size(9) +
                  bulk_size(outbox_id_len);
    *argc = 10 + (row->key != NULL ? 2 : 0) + 2 * (size_t)h->n;
    if (row->key != NULL)
        need += bulk_size(3) + bulk_size(row->key_len);
    for (int i = 0; i < h->n; i++)
        need += bulk_size(2 + h->name_lens[i]) + bulk_size(h->value_lens[i]);
    return need;
}

/* Writes the fields fields_size counted. */
static char *put_fields(char *p, const struct relay_row *row, const struct row_headers *h,
                        const char *outbox_id, size_t outbox_id_len)
{
    p = PUT_LIT(p, "$2\r\nid\r\n");
    p = put_bulk(p, row->message_id, row->message_id_len);
    p = PUT_LIT(p, "$5\r\ntopic\r\n");
    p = put_bulk(p, row->topic, row->topic_len);
    if (row->key != NULL) {
        p = PUT_LIT(p, "$3\r\nkey\r\n");
        p = put_bulk(p, row->key, row->key_len);
    }
    p = PUT_LIT(p, "$7\r\npayload\r\n");
    p = put_bulk(p, row->payload, row->payload_len);
    p = PUT_LIT(p, "$10\r\ncreated_at\r\n");
    p = put_bulk(p, row->created_at, row->created_at_len);
    p = PUT_LIT(p, "$9\r\noutbox_id\r\n");
    p = put_bulk(p, outbox_id, outbox_id_len);
    for (int i = 0; i < h->n; i++) {
        p = PUT_LIT(put_bulk_head(p, 2 + h->name_lens[i]), "h.");
        p = put_crlf(put_mem(p, h->names[i], h->name_lens[i]));
        p = put_bulk(p, h->values[i], h->value_lens[i]);
    }
    return p;
}

/* "<prefix><topic><partition suffix>", row's stream, as a bulk string. */
static char *put_stream(char *p, const char *stream_prefix, size_t prefix_len,
                        const struct relay_row *row, const char *suffix, size_t suffix_len,
                        size_t stream_len)
{
    p = put_bulk_head(p, stream_len);
    p = put_mem(p, stream_prefix, prefix_len);
    p = put_mem(p, row->topic, row->topic_len);
    return put_crlf(put_mem(p, suffix, suffix_len));
}

/* Checks row and sizes its entry in a publish call (the count of its fields,
 * then the fields): the entry's bytes, with h, *nfields and outbox_id
 * filled in for put_fields; 0 with err and *fault set when the row breaks
 * a rule (then *nfields and *outbox_id_len are 0). */
static size_t row_entry(const struct relay_row *row, size_t prefix_len, uint32_t max_payload_bytes,
                        struct row_headers *h, size_t *nfields, char outbox_id[24],
                        size_t *outbox_id_len, char *err, size_t errlen,
                        enum relay_row_fault *fault, enum relay_row_cause *cause)
{
    size_t stream_len = 0;
    *nfields = 0;
    *outbox_id_len = 0;
    if (check_row(row, prefix_len, max_payload_bytes, h, &stream_len, err, errlen, fault, cause) !=
        0)
        return 0;
    *outbox_id_len = format_int64(outbox_id, row->id);
    size_t fields = fields_size(row, h, *outbox_id_len, nfields);
    return bulk_size(count_digits(*nfields)) + fields;
}

int relay_batch_check_publish(struct relay_row *row, const char *stream_prefix,
                              uint32_t max_payload_bytes, char *err, size_t errlen,
                              enum relay_row_fault *fault)
{
    struct row_headers h;
    size_t nfields = 0, outbox_id_len;
    char outbox_id[24];
    row->call_bytes =
        row_entry(row, stream_prefix != NULL ? strlen(stream_prefix) : 0, max_payload_bytes, &h,
                  &nfields, outbox_id, &outbox_id_len, err, errlen, fault, &row->cause);
    row->call_fields = (uint32_t)nfields;
    return row->call_bytes > 0 ? 0 : -1;
}

size_t relay_batch_entry_id(uint64_t ms, uint64_t seq, char out[RELAY_ENTRY_ID_MAX])
{
    char *p = put_uint(out, ms);
    *p++ = '-';
    p = put_uint(p, seq);
    *p = '\0';
    return (size_t)(p - out);
}

static int parse_u64(const char *s, size_t len, uint64_t *v)
{
    if (len == 0 || len > 20)
        return -1;
    uint64_t x = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        unsigned d = (unsigned)(s[i] - '0');
        if (x > (UINT64_MAX - d) / 10)
            return -1;
        x = x * 10 + d;
    }
    *v = x;
    return 0;
}

int relay_batch_parse_entry_id(const char *s, size_t len, uint64_t *ms, uint64_t *seq)
{
    const char *dash = memchr(s, '-', len);
    if (dash == NULL)
        return -1;
    size_t ms_len = (size_t)(dash - s);
    return parse_u64(s, ms_len, ms) == 0 && parse_u64(dash + 1, len - ms_len - 1, seq) == 0 ? 0
                                                                                            : -1;
}

static const char multi_cmd[] = "*1\r\n$5\r\nMULTI\r\n";
static const char exec_cmd[] = "*1\r\n$4\r\nEXEC\r\n";

int relay_batch_append_xadd_call(const struct relay_row *const *rows, size_t n,
                                 const char *stream_prefix, uint32_t max_payload_bytes, uint64_t ms,
                                 struct outbox_buf *out, size_t *ends)
{
    if (n == 0)
        return -1;
    if (stream_prefix == NULL)
        stream_prefix = "";
    size_t prefix_len = strlen(stream_prefix);
    const struct relay_row *lead = rows[0];
    char suffix[OUTBOX_PARTITION_SUFFIX_LEN];
    size_t suffix_len = partition_suffix(lead, suffix);
    size_t stream_len = prefix_len + lead->topic_len + suffix_len;

    /* Sized from each row's check; each entry is checked again, and its size
     * compared, before it is written. A row's call_bytes counts its fields'
     * count as a bulk string (the publish function's form), which XADD does
     * not send: it is taken off again. */
    size_t need = sizeof(multi_cmd) - 1 + sizeof(exec_cmd) - 1;
    for (size_t i = 0; i < n; i++) {
        const struct relay_row *r = rows[i];
        if (r->call_bytes == 0 || !relay_batch_same_stream(r, lead))
            return -1;
        char id[RELAY_ENTRY_ID_MAX];
        size_t id_len = relay_batch_entry_id(ms, r->seq, id);
        size_t fields = r->call_bytes - bulk_size(count_digits(r->call_fields));
        need += 1 + count_digits(3 + r->call_fields) + 2 + bulk_size(4) + bulk_size(stream_len) +
                bulk_size(id_len) + fields;
    }
    if (respbuf_reserve(out, need) != 0)
        return OUTBOX_BUF_FULL;

    char *const start = out->data + out->len;
    char *p = PUT_LIT(start, multi_cmd);
    ends[0] = (size_t)(p - start);
    for (size_t i = 0; i < n; i++) {
        struct row_headers h;
        size_t nfields = 0, outbox_id_len;
        char outbox_id[24], err[8], id[RELAY_ENTRY_ID_MAX];
        enum relay_row_fault fault;
        enum relay_row_cause cause;
        if (row_entry(rows[i], prefix_len, max_payload_bytes, &h, &nfields, outbox_id,
                      &outbox_id_len, err, sizeof(err), &fault, &cause) != rows[i]->call_bytes ||
            nfields != rows[i]->call_fields)
            return -1;
        size_t id_len = relay_batch_entry_id(ms, rows[i]->seq, id);
        p = put_array(p, 3 + nfields);
        p = PUT_LIT(p, "$4\r\nXADD\r\n");
        p = put_stream(p, stream_prefix, prefix_len, lead, suffix, suffix_len, stream_len);
        p = put_bulk(p, id, id_len);
        p = put_fields(p, rows[i], &h, outbox_id, outbox_id_len);
        ends[i + 1] = (size_t)(p - start);
    }
    p = PUT_LIT(p, exec_cmd);
    ends[n + 1] = (size_t)(p - start);
    *p = '\0'; /* outbox_buf keeps data NUL-terminated */
    out->len = (size_t)(p - out->data);
    return 0;
}

int relay_batch_xadd_present(const char *err, size_t len)
{
    /* Redis 7 and Valkey 8: "ERR The ID specified in XADD is equal or
     * smaller than the target stream top item". */
    static const char said[] = "equal or smaller than the target stream top item";
    for (size_t i = 0; i + sizeof(said) - 1 <= len; i++)
        if (memcmp(err + i, said, sizeof(said) - 1) == 0)
            return 1;
    return 0;
}

/* Rows of one stream: one topic, one partition. */
int relay_batch_same_stream(const struct relay_row *a, const struct relay_row *b)
{
    return a->topic_len == b->topic_len && memcmp(a->topic, b->topic, a->topic_len) == 0 &&
           (a->partitions > 1) == (b->partitions > 1) &&
           (a->partitions <= 1 || a->partition == b->partition);
}

int relay_batch_streams_init(struct relay_batch_streams *x, size_t max_rows)
{
    size_t size = 16;
    while (size < 2 * max_rows)
        size *= 2;
    x->slots = calloc(size, sizeof(*x->slots));
    if (x->slots == NULL)
        return -1;
    x->mask = size - 1;
    x->batch = 0;
    relay_batch_streams_clear(x);
    return 0;
}

void relay_batch_streams_clear(struct relay_batch_streams *x)
{
    if (++x->batch == 0) {
        /* Once in 2^32 batches: no slot may look taken in this one. */
        memset(x->slots, 0, (x->mask + 1) * sizeof(*x->slots));
        x->batch = 1;
    }
}

/* FNV-1a over the topic, then the partition of a partitioned topic. */
static uint32_t stream_hash(const struct relay_row *row)
{
    uint32_t h = 2166136261u;
    for (size_t k = 0; k < row->topic_len; k++)
        h = (h ^ (unsigned char)row->topic[k]) * 16777619u;
    if (row->partitions > 1)
        h = (h ^ (row->partition + 1)) * 16777619u;
    return h;
}

int32_t *relay_batch_streams_slot(struct relay_batch_streams *x, const struct relay_row *rows,
                                  size_t i)
{
    const struct relay_row *row = &rows[i];
    for (size_t at = stream_hash(row) & x->mask;; at = (at + 1) & x->mask) {
        struct relay_stream_slot *e = &x->slots[at];
        if (e->batch != x->batch) {
            /* Empty in this batch: taken now, for the caller to store in. */
            e->batch = x->batch;
            e->row = -1;
        }
        if (e->row < 0 || relay_batch_same_stream(&rows[e->row], row))
            return &e->row;
    }
}

void relay_batch_streams_free(struct relay_batch_streams *x)
{
    free(x->slots);
    x->slots = NULL;
}
