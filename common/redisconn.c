/*
 * The one blocking Redis connect (include/relay/redisconn.h).
 */
#include "relay/compat.h"

#include "relay/redisconn.h"

#include <hiredis/hiredis.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>

#include "relay/url.h"

static struct timeval tv_ms(uint32_t ms)
{
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (suseconds_t)(ms % 1000) * 1000};
    return tv;
}

/* Runs one set-up command; 0, or -1 with err and fault set. */
static int setup(redisContext *c, int argc, const char **argv, const char *what, const char *hint,
                 char *err, size_t errlen, enum relay_redis_fault *fault)
{
    redisReply *r = redisCommandArgv(c, argc, argv, NULL);
    if (r == NULL) {
        *fault = RELAY_REDIS_IO;
        snprintf(err, errlen, "%s: %s", what, c->errstr[0] ? c->errstr : "no reply");
        return -1;
    }
    int rc = 0;
    if (r->type == REDIS_REPLY_ERROR) {
        /* The server's text never contains the password. */
        *fault = RELAY_REDIS_REFUSED;
        snprintf(err, errlen, "Redis refused %s: %s%s", what, r->str, hint);
        rc = -1;
    }
    freeReplyObject(r);
    return rc;
}

redisContext *relay_redis_open(const struct relay_redis_url *u, uint32_t connect_timeout_ms,
                               uint32_t command_timeout_ms, char *err, size_t errlen,
                               enum relay_redis_fault *fault)
{
    *fault = RELAY_REDIS_OK;
    redisContext *c = redisConnectWithTimeout(u->host, u->port, tv_ms(connect_timeout_ms));
    if (c == NULL) {
        *fault = RELAY_REDIS_NOMEM;
        snprintf(err, errlen, "cannot connect to Redis: out of memory");
        return NULL;
    }
    if (c->err) {
        *fault = RELAY_REDIS_IO;
        snprintf(err, errlen, "cannot connect to Redis: %s", c->errstr);
        redisFree(c);
        return NULL;
    }
    if (redisSetTimeout(c, tv_ms(command_timeout_ms)) != REDIS_OK) {
        *fault = RELAY_REDIS_IO;
        snprintf(err, errlen, "cannot set the command deadline: %s", c->errstr);
        redisFree(c);
        return NULL;
    }
    (void)redisEnableKeepAlive(c); /* a dead peer is noticed between commands too */
    if (u->password[0] != '\0') {
        const char *argv[3] = {"AUTH", u->user, u->password};
        if (u->user[0] == '\0')
            argv[1] = u->password;
        if (setup(c, u->user[0] ? 3 : 2, argv, "AUTH",
                  " (check the user and password of the Redis URL)", err, errlen, fault) < 0) {
            redisFree(c);
            return NULL;
        }
    }
    if (u->db != 0) {
        char db[16];
        snprintf(db, sizeof(db), "%d", u->db);
        const char *argv[2] = {"SELECT", db};
        if (setup(c, 2, argv, "SELECT", "", err, errlen, fault) < 0) {
            redisFree(c);
            return NULL;
        }
    }
    return c;
}
