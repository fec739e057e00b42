/*
 * The HTTP endpoint of relay/metrics.h.
 *
 * Deliberately small: HTTP/1.0-style, one request per connection, the
 * response written in full and the socket closed. A request is at most
 * 8 KiB and must be complete within REQUEST_DEADLINE of the accept (in all,
 * not per read, so a byte a second does not keep it alive); the response
 * then has RESPONSE_DEADLINE to be sent. Nothing a client does can hold the
 * relay's loop.
 *
 * Idle clients must not lock out the ones that matter: a liveness probe
 * that gets no answer restarts a healthy relay. So when CLIENTS_MAX are
 * open, a new connection closes the oldest client that has not sent a
 * complete request yet; clients are kept in two lists, oldest first, for
 * that. Only when every client is being answered is a new one turned away.
 * Clients never take the relay's last SPARE_FDS file descriptors, which its
 * own reconnects to PostgreSQL and Redis need: a connection accepted onto one
 * of them closes the oldest idle client and moves to the descriptor that
 * frees (descriptors are handed out lowest first, so one that high means few
 * are left). Should accept still run out (an idle client is closed, or
 * accepting pauses for ACCEPT_PAUSE), the loop never spins on a listening
 * socket that stays readable.
 */
#include "common/compat.h"

#include "relay/metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <ev.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/common.h"
#include "relay/log.h"
#include "core/text.h"

#define COMPONENT "metrics"
#define CLIENTS_MAX 256
#define SPARE_FDS 16          /* descriptors below the open-files limit left to the relay */
#define REQUEST_DEADLINE 2.0  /* seconds from accept to a complete request */
#define RESPONSE_DEADLINE 5.0 /* seconds to send the response */
#define ACCEPT_PAUSE 0.1      /* out of descriptors with nobody to close */
#define EVICT_LOG_EVERY 60.0  /* seconds between two logs of evictions */

struct client;

/* Clients, oldest first. */
struct client_list {
    struct client *head, *tail;
};

struct client {
    struct relay_metrics *m;
    int fd;
    int answering; /* in m->answering once the request is complete, else in m->reading */
    ev_io io;
    ev_timer deadline;
    char req[RELAY_METRICS_REQUEST_MAX];
    size_t reqlen;
    char *resp;
    size_t resplen, sent;
    struct client *prev, *next;
};

struct relay_metrics {
    struct ev_loop *loop;
    struct relay_metrics_hooks hooks;
    int fd;
    int spare_from; /* an accepted descriptor this high is among the last SPARE_FDS */
    ev_io accept_io;
    ev_timer accept_pause;
    struct client_list reading;   /* no complete request yet: the first to go when full */
    struct client_list answering; /* a response being sent */
    int nclients;
    unsigned long evicted;  /* idle clients closed to admit new ones, not yet logged */
    double evict_logged_at; /* ev_now of that log; 0 before the first */
};

static void list_push(struct client_list *l, struct client *c)
{
    c->next = NULL;
    c->prev = l->tail;
    if (l->tail != NULL)
        l->tail->next = c;
    else
        l->head = c;
    l->tail = c;
}

static void list_remove(struct client_list *l, struct client *c)
{
    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        l->head = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    else
        l->tail = c->prev;
    c->prev = c->next = NULL;
}

static void client_close(struct client *c)
{
    struct relay_metrics *m = c->m;
    ev_io_stop(m->loop, &c->io);
    ev_timer_stop(m->loop, &c->deadline);
    close(c->fd);
    list_remove(c->answering ? &m->answering : &m->reading, c);
    m->nclients--;
    free(c->resp);
    free(c);
}

/* Closes the oldest client that has not sent a complete request, to make
 * room for a new one. 0, or -1 when every client is being answered. */
static int evict_idle(struct relay_metrics *m)
{
    if (m->reading.head == NULL)
        return -1;
    /* client_close frees the client, never m. */
    client_close(m->reading.head); // NOLINT(clang-analyzer-unix.Malloc)
    m->evicted++;                  // NOLINT(clang-analyzer-unix.Malloc)
    double now = ev_now(m->loop);
    if (m->evict_logged_at == 0 || now - m->evict_logged_at >= EVICT_LOG_EVERY) {
        relay_warn(COMPONENT,
                   "closed %lu client(s) that sent no complete request, to admit new ones (at "
                   "most %d connections at once, and the last %d of the open-files limit kept "
                   "for the relay): something connects and sends nothing",
                   m->evicted, CLIENTS_MAX, SPARE_FDS);
        m->evicted = 0;
        m->evict_logged_at = now;
    }
    return 0;
}

static void on_client_write(struct ev_loop *loop, ev_io *w, int revents);

static void respond(struct client *c, int status, const char *reason, const char *ctype,
                    const char *extra_headers, const char *body, size_t bodylen, int head)
{
    char hdr[512];
    int n = snprintf(hdr, sizeof(hdr),
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                     "Connection: close\r\n\r\n",
                     status, reason, ctype, bodylen, extra_headers != NULL ? extra_headers : "");
    size_t total = (size_t)n + (head ? 0 : bodylen);
    c->resp = malloc(total);
    if (c->resp == NULL) {
        client_close(c);
        return;
    }
    memcpy(c->resp, hdr, (size_t)n);
    if (!head)
        memcpy(c->resp + n, body, bodylen);
    c->resplen = total;
    c->sent = 0;
    /* Answering now: no longer idle, and a deadline of its own. */
    list_remove(&c->m->reading, c);
    list_push(&c->m->answering, c);
    c->answering = 1;
    ev_timer_stop(c->m->loop, &c->deadline);
    ev_timer_set(&c->deadline, RESPONSE_DEADLINE, 0.0);
    ev_timer_start(c->m->loop, &c->deadline);
    ev_io_stop(c->m->loop, &c->io);
    ev_io_init(&c->io, on_client_write, c->fd, EV_WRITE);
    c->io.data = c;
    ev_io_start(c->m->loop, &c->io);
}

static void respond_text(struct client *c, int status, const char *reason, const char *body,
                         const char *extra, int head)
{
    respond(c, status, reason, "text/plain; charset=utf-8", extra, body, strlen(body), head);
}

/*
 * Reads a complete request's line: the status to answer with (400 when the
 * line is not "METHOD PATH ...", 404 for an unknown path, 405 for a method
 * other than GET and HEAD, else 200 with *path the endpoint, one of
 * "/metrics", "/healthz" and "/readyz"), and in *head whether it is a HEAD.
 */
OUTBOX_STATIC int metrics_parse_request(const char *req, int *head, const char **path);
OUTBOX_STATIC int metrics_parse_request(const char *req, int *head, const char **path)
{
    static const char *const known[] = {"/metrics", "/healthz", "/readyz"};
    char method[16], target[256];
    *head = 0;
    *path = NULL;
    if (sscanf(req, "%15s %255s", method, target) != 2)
        return 400;
    *head = strcmp(method, "HEAD") == 0;
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        if (strcmp(target, known[i]) == 0)
            *path = known[i];
    if (*path == NULL)
        return 404;
    if (strcmp(method, "GET") != 0 && !*head)
        return 405;
    return 200;
}

/* Whether the bytes read so far (NUL-terminated) end the request's head. */
OUTBOX_STATIC int metrics_request_complete(const char *req);
OUTBOX_STATIC int metrics_request_complete(const char *req)
{
    return strstr(req, "\r\n\r\n") != NULL || strstr(req, "\n\n") != NULL;
}

static void handle_request(struct client *c)
{
    int head;
    const char *path;
    int status = metrics_parse_request(c->req, &head, &path);
    if (status == 400) {
        respond_text(c, 400, "Bad Request", "bad request\n", NULL, 0);
        return;
    }
    if (status == 404) {
        respond_text(c, 404, "Not Found", "not found: try /metrics, /healthz or /readyz\n", NULL,
                     head);
        return;
    }
    if (status == 405) {
        respond_text(c, 405, "Method Not Allowed", "method not allowed\n", "Allow: GET, HEAD\r\n",
                     0);
        return;
    }
    if (strcmp(path, "/healthz") == 0) {
        respond_text(c, 200, "OK", "ok\n", NULL, head);
    } else if (strcmp(path, "/readyz") == 0) {
        char why[1100] = "";
        if (c->m->hooks.ready == NULL || c->m->hooks.ready(c->m->hooks.arg, why, sizeof(why))) {
            respond_text(c, 200, "OK", "ready\n", NULL, head);
        } else {
            char body[1200];
            snprintf(body, sizeof(body), "not ready: %s\n", why);
            respond_text(c, 503, "Service Unavailable", body, NULL, head);
        }
    } else {
        char *body = NULL;
        long len = c->m->hooks.render != NULL ? c->m->hooks.render(c->m->hooks.arg, &body) : -1;
        if (len < 0) {
            respond_text(c, 500, "Internal Server Error", "cannot render metrics\n", NULL, head);
        } else {
            respond(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", NULL, body,
                    (size_t)len, head);
        }
        free(body);
    }
}

static void on_client_write(struct ev_loop *loop, ev_io *w, int revents)
{
    struct client *c = w->data;
    (void)loop;
    (void)revents;
    while (c->sent < c->resplen) {
        ssize_t n = send(c->fd, c->resp + c->sent, c->resplen - c->sent, MSG_NOSIGNAL);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (n <= 0) {
            client_close(c);
            return;
        }
        c->sent += (size_t)n;
    }
    client_close(c);
}

static void on_client_read(struct ev_loop *loop, ev_io *w, int revents)
{
    struct client *c = w->data;
    (void)loop;
    (void)revents;
    ssize_t n = recv(c->fd, c->req + c->reqlen, sizeof(c->req) - 1 - c->reqlen, 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return;
    if (n <= 0) {
        client_close(c);
        return;
    }
    c->reqlen += (size_t)n;
    c->req[c->reqlen] = '\0';
    if (metrics_request_complete(c->req)) {
        handle_request(c);
        return;
    }
    if (c->reqlen >= sizeof(c->req) - 1)
        respond_text(c, 431, "Request Header Fields Too Large", "request too large\n", NULL, 0);
}

static void on_client_deadline(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    client_close(w->data);
}

static void on_accept_pause(struct ev_loop *loop, ev_timer *w, int revents)
{
    struct relay_metrics *m = w->data;
    (void)revents;
    ev_io_start(loop, &m->accept_io);
}

/* Moves a client's descriptor fd off the last SPARE_FDS, closing idle clients
 * to free a lower one; returns the descriptor to use. With nobody idle to
 * close it stays where it is, for as long as its answer takes. */
static int below_spare(struct relay_metrics *m, int fd)
{
    while (fd >= m->spare_from && evict_idle(m) == 0) {
        int low = fcntl(fd, F_DUPFD_CLOEXEC, 0); /* the lowest free descriptor */
        if (low < 0)
            break;
        if (low < fd) {
            close(fd);
            fd = low;
        } else {
            close(low);
        }
    }
    return fd;
}

static void on_accept(struct ev_loop *loop, ev_io *w, int revents)
{
    struct relay_metrics *m = w->data;
    (void)revents;
    for (;;) {
        int fd = accept(m->fd, NULL, NULL);
        if (fd < 0) {
            if (errno != EMFILE && errno != ENFILE && errno != ENOBUFS && errno != ENOMEM)
                return; /* EAGAIN, or a transient error: the next event retries */
            /* Out of descriptors or memory: the connection waits in the
             * backlog and the socket stays readable. Make room, or stop
             * listening for a moment rather than spin. */
            if (evict_idle(m) == 0)
                continue;
            ev_io_stop(loop, &m->accept_io);
            ev_timer_start(loop, &m->accept_pause);
            return;
        }
        if (fcntl(fd, F_SETFL, O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) {
            close(fd);
            continue;
        }
        if (m->nclients >= CLIENTS_MAX && evict_idle(m) < 0) {
            close(fd); /* every client is being answered: this one must retry */
            continue;
        }
        fd = below_spare(m, fd);
        struct client *c = calloc(1, sizeof(*c));
        if (c == NULL) {
            close(fd);
            continue;
        }
        c->m = m;
        c->fd = fd;
        list_push(&m->reading, c);
        m->nclients++;
        ev_io_init(&c->io, on_client_read, fd, EV_READ);
        c->io.data = c;
        ev_io_start(loop, &c->io);
        ev_timer_init(&c->deadline, on_client_deadline, REQUEST_DEADLINE, 0.0);
        c->deadline.data = c;
        ev_timer_start(loop, &c->deadline);
    }
}

/* The lowest descriptor among the last SPARE_FDS of the open-files limit. */
static int spare_from(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY ||
        rl.rlim_cur > (rlim_t)INT_MAX)
        return INT_MAX;
    return (int)rl.rlim_cur - SPARE_FDS;
}

struct relay_metrics *relay_metrics_new(struct ev_loop *loop, const char *listen_addr,
                                        const struct relay_metrics_hooks *hooks, char *err,
                                        size_t errlen)
{
    char host[256];
    const char *colon = strrchr(listen_addr, ':');
    if (colon == NULL || (size_t)(colon - listen_addr) >= sizeof(host)) {
        snprintf(err, errlen, "metrics_listen \"%s\" is not host:port", listen_addr);
        return NULL;
    }
    memcpy(host, listen_addr, (size_t)(colon - listen_addr));
    host[colon - listen_addr] = '\0';
    int port = (int)strtol(colon + 1, NULL, 10); /* validated by the configuration */
    struct sockaddr_in sin;
    memset(&sin, 0, sizeof(sin));
    sin.sin_family = AF_INET;
    sin.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, strcmp(host, "localhost") == 0 ? "127.0.0.1" : host, &sin.sin_addr) !=
        1) {
        snprintf(err, errlen, "metrics_listen host \"%s\" must be an IPv4 address", host);
        return NULL;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
        bind(fd, (struct sockaddr *)&sin, sizeof(sin)) < 0 || listen(fd, SOMAXCONN) < 0) {
        snprintf(err, errlen,
                 "cannot listen on %s: %s (change metrics_listen, or set it empty "
                 "to switch the endpoint off)",
                 listen_addr, strerror(errno));
        if (fd >= 0)
            close(fd);
        return NULL;
    }
    struct relay_metrics *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        close(fd);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    m->loop = loop;
    m->hooks = *hooks;
    m->fd = fd;
    m->spare_from = spare_from();
    ev_io_init(&m->accept_io, on_accept, fd, EV_READ);
    m->accept_io.data = m;
    ev_io_start(loop, &m->accept_io);
    ev_timer_init(&m->accept_pause, on_accept_pause, ACCEPT_PAUSE, 0.0);
    m->accept_pause.data = m;
    relay_info(COMPONENT, "serving /metrics, /healthz and /readyz on http://%s", listen_addr);
    return m;
}

void relay_metrics_free(struct relay_metrics *m)
{
    if (m == NULL)
        return;
    /* client_close frees the client and unlinks it from m. */
    while (m->reading.head != NULL)
        client_close(m->reading.head); // NOLINT(clang-analyzer-unix.Malloc)
    while (m->answering.head != NULL)
        client_close(m->answering.head); // NOLINT(clang-analyzer-unix.Malloc)
    ev_io_stop(m->loop, &m->accept_io);
    ev_timer_stop(m->loop, &m->accept_pause);
    close(m->fd);
    free(m);
}

void relay_metrics_label(struct outbox_buf *t, const char *s)
{
    size_t len = strlen(s);
    for (size_t i = 0; i < len && !t->failed;) {
        size_t n = relay_text_utf8_char(s + i, len - i, NULL);
        if (n == 0) {
            outbox_buf_printf(t, "\xef\xbf\xbd"); /* U+FFFD for a byte that is not UTF-8 */
            i++;
            continue;
        }
        if (s[i] == '\\')
            outbox_buf_printf(t, "\\\\");
        else if (s[i] == '"')
            outbox_buf_printf(t, "\\\"");
        else if (s[i] == '\n')
            outbox_buf_printf(t, "\\n");
        else
            outbox_buf_printf(t, "%.*s", (int)n, s + i);
        i += n;
    }
}
