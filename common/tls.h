/*
 * TLS to Redis (common/tls.c), for rediss:// URLs: one OpenSSL client session
 * per connection, its trust anchors, client certificate and expected server
 * name taken from the URL's options (common/url.h). Used by the blocking
 * connect (common/redisconn.c: the consumer library, the tools, the daemon's
 * observation thread) and by the daemon's event loop (relay/sink.c).
 *
 * Built only where hiredis has SSL (hiredis 1.x and its hiredis_ssl library:
 * OUTBOX_TLS is 1). Elsewhere the URL parser refuses rediss:// and only
 * outbox_tls_check is compiled, which then has nothing to check.
 */
#ifndef OUTBOX_TLS_H
#define OUTBOX_TLS_H

#include <stddef.h>

#ifndef OUTBOX_TLS
#define OUTBOX_TLS 0
#endif

struct redisContext;
struct ssl_st;
struct outbox_redis_url;

/*
 * Checks that the URL's TLS files load: the CA file or directory (or the
 * system's trust store when neither is given), and the client certificate
 * with its key. 0, or -1 with a message in err that names the file and what
 * to do. For the configuration's validation (--check-config).
 */
int outbox_tls_check(const struct outbox_redis_url *u, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/*
 * Starts TLS on c, whose TCP connection to host is made or being made (the
 * context non-blocking): a session that verifies the server's certificate
 * against the URL's CA and, unless the URL says verify=ca, its name
 * (server_name, else host); port is for messages. hiredis then carries the handshake on with the
 * first reads and writes, and frees the session with c.
 * Returns the session, for outbox_tls_failure once a read or write failed,
 * or NULL with err set (c unchanged).
 */
struct ssl_st *outbox_tls_start(struct redisContext *c, const struct outbox_redis_url *u,
                                const char *host, int port, char *err, size_t errlen)
    __attribute__((warn_unused_result));

/*
 * Makes the TLS handshake on c (connected, non-blocking, and left so) by
 * deadline (outbox_mono_now's clock), blocking meanwhile: a stop request
 * waits for it. Then c talks TLS, and *session is its session (c's, for
 * outbox_tls_failure once a command failed). 0, or -1 with err set.
 */
int outbox_tls_handshake(struct redisContext *c, const struct outbox_redis_url *u, const char *host,
                         int port, double deadline, struct ssl_st **session, char *err,
                         size_t errlen) __attribute__((warn_unused_result));

/*
 * What to check when a server ends a TLS connection that carries no client
 * certificate while it is being set up: with TLS 1.3 a server that wants one
 * says so only after the handshake, as an alert or by closing.
 */
#define OUTBOX_TLS_CLIENT_CERT_HINT                                                                \
    "if it asks for client certificates (tls-auth-clients), give the URL's cert_file and key_file"

/*
 * Whether TLS explains why a session's connection failed, and how: when the
 * server's certificate was refused, writes "the certificate of Redis at
 * host:port was refused: <reason>" and what to check into out; when the
 * handshake did not finish and io_text (what the read or write said) is not
 * NULL, "TLS handshake with Redis at host:port failed (io_text)" and what to
 * check; when it did but setting_up (the connection's set-up commands had
 * not all been answered) and the session has no client certificate, that the
 * server ended the connection and OUTBOX_TLS_CLIENT_CERT_HINT. Returns 1
 * then, else 0 (ssl may be NULL: 0).
 */
int outbox_tls_failure(const struct ssl_st *ssl, const char *host, int port, const char *io_text,
                       int setting_up, char *out, size_t outlen);

#endif
