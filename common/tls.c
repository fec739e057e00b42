/*
 * TLS to Redis (common/tls.h): OpenSSL sessions handed to hiredis_ssl.
 *
 * The sessions are made here rather than by hiredis_ssl's own context, for
 * two things it does not do: check the server's name (SSL_set1_host, or the
 * address when the name is an IP address), and say why a handshake failed
 * (the verification result, which hiredis reduces to a read error).
 */
#include "common/compat.h"

#include "common/tls.h"

#if OUTBOX_TLS

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <hiredis/hiredis_ssl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "common/url.h"
#include "common/wait.h"

static pthread_once_t tls_once = PTHREAD_ONCE_INIT;

static void tls_init(void)
{
    (void)redisInitOpenSSL();
}

/* The reason of OpenSSL's last error, and the queue emptied. */
static const char *ssl_reason(void)
{
    unsigned long e = ERR_peek_last_error();
    const char *r = e != 0 ? ERR_reason_error_string(e) : NULL;
    ERR_clear_error();
    return r != NULL ? r : "unknown error";
}

/* NULL when path names a readable file (a directory when dir), else why not. */
static const char *unreadable(const char *path, int dir)
{
    struct stat st;
    if (stat(path, &st) != 0 || access(path, R_OK) != 0)
        return strerror(errno);
    if (dir && !S_ISDIR(st.st_mode))
        return "not a directory";
    if (!dir && !S_ISREG(st.st_mode))
        return "not a regular file";
    return NULL;
}

/* A client context for the URL's options: 0, or -1 with err. */
static SSL_CTX *make_ctx(const struct outbox_tls_options *o, char *err, size_t errlen)
{
    const char *why;
    if (o->ca_file[0] != '\0' && (why = unreadable(o->ca_file, 0)) != NULL) {
        snprintf(err, errlen, "TLS option ca_file %.300s: %s: give a PEM file of CA certificates",
                 o->ca_file, why);
        return NULL;
    }
    if (o->ca_dir[0] != '\0' && (why = unreadable(o->ca_dir, 1)) != NULL) {
        snprintf(err, errlen,
                 "TLS option ca_dir %.300s: %s: give a directory of CA certificates named by "
                 "their hash (openssl rehash)",
                 o->ca_dir, why);
        return NULL;
    }
    if (o->cert_file[0] != '\0' && (why = unreadable(o->cert_file, 0)) != NULL) {
        snprintf(err, errlen, "TLS option cert_file %.300s: %s", o->cert_file, why);
        return NULL;
    }
    if (o->key_file[0] != '\0' && (why = unreadable(o->key_file, 0)) != NULL) {
        snprintf(err, errlen, "TLS option key_file %.300s: %s", o->key_file, why);
        return NULL;
    }
    (void)pthread_once(&tls_once, tls_init);
    ERR_clear_error();
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    if (ctx == NULL) {
        snprintf(err, errlen, "cannot start TLS: %s", ssl_reason());
        return NULL;
    }
    (void)SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    int ok = o->ca_file[0] != '\0' || o->ca_dir[0] != '\0'
                 ? SSL_CTX_load_verify_locations(ctx, o->ca_file[0] != '\0' ? o->ca_file : NULL,
                                                 o->ca_dir[0] != '\0' ? o->ca_dir : NULL)
                 : SSL_CTX_set_default_verify_paths(ctx);
    if (ok != 1) {
        snprintf(err, errlen,
                 "cannot load the TLS trust anchors (%.300s): %s: give ca_file a PEM file of CA "
                 "certificates",
                 o->ca_file[0] != '\0'  ? o->ca_file
                 : o->ca_dir[0] != '\0' ? o->ca_dir
                                        : "the system's",
                 ssl_reason());
        SSL_CTX_free(ctx);
        return NULL;
    }
    if (o->cert_file[0] != '\0') {
        if (SSL_CTX_use_certificate_chain_file(ctx, o->cert_file) != 1) {
            snprintf(err, errlen, "TLS option cert_file %.300s: %s: give a PEM certificate",
                     o->cert_file, ssl_reason());
            SSL_CTX_free(ctx);
            return NULL;
        }
        if (SSL_CTX_use_PrivateKey_file(ctx, o->key_file, SSL_FILETYPE_PEM) != 1) {
            snprintf(err, errlen,
                     "TLS option key_file %.300s: %s: give the private key of cert_file, in PEM, "
                     "without a passphrase",
                     o->key_file, ssl_reason());
            SSL_CTX_free(ctx);
            return NULL;
        }
        if (SSL_CTX_check_private_key(ctx) != 1) {
            snprintf(err, errlen, "TLS option key_file %.300s is not the key of cert_file %.300s",
                     o->key_file, o->cert_file);
            ERR_clear_error();
            SSL_CTX_free(ctx);
            return NULL;
        }
    }
    return ctx;
}

int outbox_tls_check(const struct outbox_redis_url *u, char *err, size_t errlen)
{
    if (!u->tls.on)
        return 0;
    SSL_CTX *ctx = make_ctx(&u->tls, err, errlen);
    if (ctx == NULL)
        return -1;
    SSL_CTX_free(ctx);
    return 0;
}

/* A session for host that checks what the options ask: NULL with err. */
static SSL *make_session(const struct outbox_redis_url *u, const char *host, char *err,
                         size_t errlen)
{
    SSL_CTX *ctx = make_ctx(&u->tls, err, errlen);
    if (ctx == NULL)
        return NULL;
    SSL *ssl = SSL_new(ctx);
    SSL_CTX_free(ctx); /* the session holds its own reference */
    if (ssl == NULL) {
        snprintf(err, errlen, "cannot start TLS: %s", ssl_reason());
        return NULL;
    }
    const char *name = u->tls.server_name[0] != '\0' ? u->tls.server_name : host;
    unsigned char addr[16];
    int ip = inet_pton(AF_INET, name, addr) == 1 || inet_pton(AF_INET6, name, addr) == 1;
    int ok = 1;
    if (ip) {
        /* No SNI for an address (RFC 6066); the certificate must carry it. */
        if (u->tls.verify_name)
            ok = X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), name) == 1;
    } else {
        ok = SSL_set_tlsext_host_name(ssl, name) == 1;
        if (ok && u->tls.verify_name) {
            SSL_set_hostflags(ssl, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
            ok = SSL_set1_host(ssl, name) == 1;
        }
    }
    if (!ok) {
        snprintf(err, errlen, "cannot check the server's name \"%.200s\": %s", name, ssl_reason());
        SSL_free(ssl);
        return NULL;
    }
    return ssl;
}

struct ssl_st *outbox_tls_start(struct redisContext *c, const struct outbox_redis_url *u,
                                const char *host, int port, char *err, size_t errlen)
{
    SSL *ssl = make_session(u, host, err, errlen);
    if (ssl == NULL)
        return NULL;
    if (redisInitiateSSL(c, ssl) != REDIS_OK) {
        if (!outbox_tls_failure(ssl, host, port, c->errstr, 1, err, errlen))
            snprintf(err, errlen, "cannot start TLS: %s", c->errstr);
        SSL_free(ssl);
        return NULL;
    }
    return ssl;
}

int outbox_tls_failure(const struct ssl_st *ssl, const char *host, int port, const char *io_text,
                       int setting_up, char *out, size_t outlen)
{
    if (ssl == NULL)
        return 0;
    long v = SSL_get_verify_result(ssl);
    if (v != X509_V_OK) {
        int name = v == X509_V_ERR_HOSTNAME_MISMATCH || v == X509_V_ERR_IP_ADDRESS_MISMATCH;
        snprintf(out, outlen, "the certificate of Redis at %.100s:%d was refused: %s (%s)", host,
                 port, X509_verify_cert_error_string(v),
                 name ? "it names another server: connect by a name it carries, or set the "
                        "URL's server_name"
                      : "check ca_file or ca_dir: they must hold the CA that signed the server's "
                        "certificate");
        return 1;
    }
    if (io_text == NULL)
        return 0;
    const char *text = io_text[0] != '\0' ? io_text : "connection closed";
    int anonymous = SSL_get_certificate(ssl) == NULL;
    if (!SSL_is_init_finished(ssl)) {
        snprintf(out, outlen,
                 "TLS handshake with Redis at %.100s:%d failed (%.100s): is that port TLS? %s",
                 host, port, text,
                 anonymous ? OUTBOX_TLS_CLIENT_CERT_HINT
                           : "does the server accept this client's certificate?");
        return 1;
    }
    if (setting_up && anonymous) {
        snprintf(out, outlen, "Redis at %.100s:%d ended the TLS connection (%.100s): %s", host,
                 port, text, OUTBOX_TLS_CLIENT_CERT_HINT);
        return 1;
    }
    return 0;
}

/* Sets fd's send and receive timeouts to ms (0: none). */
static int socket_timeouts(int fd, long ms)
{
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (suseconds_t)(ms % 1000) * 1000};
    return setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0 &&
                   setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) == 0
               ? 0
               : -1;
}

int outbox_tls_handshake(struct redisContext *c, const struct outbox_redis_url *u, const char *host,
                         int port, double deadline, struct ssl_st **session, char *err,
                         size_t errlen)
{
    *session = NULL;
    /* hiredis_ssl takes a session only before its handshake (it restarts
     * it), so hiredis makes it, on the socket made blocking for the while
     * with what is left until the deadline as its timeouts. */
    long ms = (long)((deadline - outbox_mono_now()) * 1000.0);
    if (ms < 1)
        ms = 1;
    SSL *ssl = make_session(u, host, err, errlen);
    if (ssl == NULL)
        return -1;
    int fl = fcntl(c->fd, F_GETFL);
    if (fl < 0 || fcntl(c->fd, F_SETFL, fl & ~O_NONBLOCK) < 0 || socket_timeouts(c->fd, ms) < 0) {
        snprintf(err, errlen, "cannot start TLS: %s", strerror(errno));
        SSL_free(ssl);
        return -1;
    }
    int block = c->flags & REDIS_BLOCK;
    c->flags |= REDIS_BLOCK;
    ERR_clear_error();
    int rc = redisInitiateSSL(c, ssl);
    int saved = errno;
    if (!block)
        c->flags &= ~REDIS_BLOCK;
    if (socket_timeouts(c->fd, 0) < 0 || fcntl(c->fd, F_SETFL, fl) < 0) {
        if (rc == REDIS_OK) {
            snprintf(err, errlen, "cannot start TLS: %s", strerror(errno));
            return -1; /* the session is c's now, freed with it */
        }
    }
    if (rc == REDIS_OK) {
        *session = ssl;
        return 0;
    }
    if (!outbox_tls_failure(ssl, host, port, NULL, 1, err, errlen)) {
        if (saved == EAGAIN || saved == EWOULDBLOCK)
            snprintf(err, errlen,
                     "no TLS handshake with Redis at %.100s:%d within %ld ms: is that port TLS?",
                     host, port, ms);
        else
            (void)outbox_tls_failure(ssl, host, port, c->errstr, 1, err, errlen);
    }
    ERR_clear_error();
    SSL_free(ssl); /* hiredis keeps a session only when the handshake starts */
    return -1;
}

#else

/* Built without TLS: the URL parser refuses rediss://, so nothing asks. */
int outbox_tls_check(const struct outbox_redis_url *u, char *err, size_t errlen)
{
    (void)u;
    (void)err;
    (void)errlen;
    return 0;
}

#endif
