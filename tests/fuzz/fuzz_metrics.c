/*
 * The HTTP requests of the metrics endpoint (relay/metrics.c): the bytes
 * arrive in pieces the way recv() hands them over (the first byte of each
 * piece says how long it is), into the endpoint's 8 KiB request buffer; once
 * the head is complete the request line is read, as handle_request does.
 * Also the label escaping of the text exposition (relay_metrics_label), which
 * shows topic and stream names that come from data.
 */
#include "common/compat.h"

#include "common/buf.h"
#include "relay/metrics.h"

#include "fuzz.h"

/* File-local in relay/metrics.c (OUTBOX_STATIC is empty in relay_unit). */
int metrics_parse_request(const char *req, int *head, const char **path);
int metrics_request_complete(const char *req);

static void check_request(const char *req)
{
    int head;
    const char *path;
    int status = metrics_parse_request(req, &head, &path);
    switch (status) {
    case 200:
        if (path == NULL || (strcmp(path, "/metrics") != 0 && strcmp(path, "/healthz") != 0 &&
                             strcmp(path, "/readyz") != 0))
            fuzz_fail("200 for an unknown path", req);
        break;
    case 400:
    case 404:
    case 405:
        break;
    default:
        fuzz_fail("unexpected status", req);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char req[RELAY_METRICS_REQUEST_MAX];
    size_t reqlen = 0, i = 0;
    int answered = 0;

    req[0] = '\0';
    while (i < size && !answered) {
        size_t piece = 1 + data[i++] % 64;
        size_t room = sizeof(req) - 1 - reqlen;
        if (piece > size - i)
            piece = size - i;
        if (piece > room)
            piece = room;
        memcpy(req + reqlen, data + i, piece);
        i += piece;
        reqlen += piece;
        req[reqlen] = '\0';
        if (metrics_request_complete(req)) {
            check_request(req);
            answered = 1;
        } else if (reqlen >= sizeof(req) - 1) {
            answered = 1; /* 431 Request Header Fields Too Large */
        }
    }

    /* The whole input as one label value. */
    char *s = fuzz_string(data, size);
    struct outbox_buf t;
    memset(&t, 0, sizeof(t));
    relay_metrics_label(&t, s);
    /* Inside the label's quotes: no raw newline or quote, and a backslash
     * only as \\, \" or \n. */
    for (size_t k = 0; !t.failed && k < t.len; k++) {
        if (t.data[k] == '\n' || t.data[k] == '"')
            fuzz_fail("an unescaped newline or quote in a label", t.data);
        if (t.data[k] == '\\') {
            if (k + 1 == t.len || strchr("\\\"n", t.data[k + 1]) == NULL)
                fuzz_fail("a bad escape in a label", t.data);
            k++;
        }
    }
    outbox_buf_free(&t);
    free(s);
    return 0;
}
