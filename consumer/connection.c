/*
 * The consumer library's connections to Redis (consumer/internal.h).
 *
 * hiredis's blocking API is the right tool here: the library owns the thread
 * while it runs, every call has a socket deadline (redisSetTimeout), and the
 * blocking read lives on a connection of its own so acknowledgements and
 * claims are never queued behind it. Every connect loads the function
 * library and creates the groups that are missing, so whatever a server lost
 * or an operator deleted meanwhile comes back with the connection.
 */
#include "common/compat.h"

#include "consumer/internal.h"

#include <hiredis/hiredis.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/functions.h"
#include "common/keys.h"
#include "common/redisconn.h"

void outbox_conn_close_all(struct outbox_consumer *c)
{
    if (c->rd != NULL)
        redisFree(c->rd);
    if (c->nnodes == 0 && c->wr != NULL)
        redisFree(c->wr);
    for (int i = 0; i < c->nnodes; i++)
        redisFree(c->node[i]);
    c->nnodes = 0;
    c->rd = c->wr = NULL;
}

redisReply *outbox_conn_command(redisContext *ctx, int argc, const char **argv, const size_t *lens)
{
    return redisCommandArgv(ctx, argc, argv, lens);
}

redisContext *outbox_conn_open(struct outbox_consumer *c, const char *stream, uint32_t timeout_ms,
                               const char *role)
{
    char err[512];
    enum outbox_redis_fault fault;
    /* In a cluster, the primary of the stream's slot, where its replay and
     * dead-letter streams are too; found again at every connect, so a
     * failover or a resharding is followed (with seed nodes in the URL). */
    redisContext *ctx = outbox_redis_open_for_key(&c->url, stream, c->o.command_timeout_ms,
                                                  timeout_ms, -1, err, sizeof(err), &fault);
    if (ctx == NULL) {
        outbox_report_problem(c,
                              fault == OUTBOX_REDIS_NOMEM     ? OUTBOX_CONSUMER_ERR_OOM
                              : fault == OUTBOX_REDIS_REFUSED ? OUTBOX_CONSUMER_ERR_REDIS
                                                              : OUTBOX_CONSUMER_ERR_IO,
                              "%s", err);
        return NULL;
    }
    redisReply *r;
    char name[NAME_MAX_LEN + 16];
    snprintf(name, sizeof(name), "%s:%s", c->consumer, role);
    for (char *p = name; *p; p++)
        if (*p == ' ')
            *p = '_';
    const char *argv[3] = {"CLIENT", "SETNAME", name};
    size_t lens[3] = {6, 7, strlen(name)};
    r = outbox_conn_command(ctx, 3, argv, lens);
    if (r != NULL)
        freeReplyObject(r);
    return ctx;
}

/* At 0 with MKSTREAM: nothing published before the group existed is missed. */
int outbox_conn_ensure_group(struct outbox_consumer *c, const char *stream)
{
    const char *argv[6] = {"XGROUP", "CREATE", stream, c->group, "0", "MKSTREAM"};
    size_t lens[6] = {6, 6, strlen(stream), strlen(c->group), 1, 8};
    redisReply *r = outbox_conn_command(c->wr, 6, argv, lens);
    if (r == NULL) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s",
                              c->wr->errstr);
        return -1;
    }
    int ok = r->type != REDIS_REPLY_ERROR || strncmp(r->str, "BUSYGROUP", 9) == 0;
    if (!ok)
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_REDIS, "cannot create the consumer group: %s",
                              r->str);
    freeReplyObject(r);
    return ok ? 0 : -1;
}

/*
 * FUNCTION LOAD REPLACE of functions/outbox_consumer.lua (the dead-letter
 * function and the others), on the write connection. It is persisted and
 * replicated, unlike the script cache; REPLACE makes a reconnect after an
 * upgrade load the new body.
 */
int outbox_conn_load_functions(struct outbox_consumer *c)
{
    const char *argv[4] = {"FUNCTION", "LOAD", "REPLACE", outbox_functions_consumer_source};
    size_t lens[4] = {8, 4, 7, strlen(outbox_functions_consumer_source)};
    redisReply *r = outbox_conn_command(c->wr, 4, argv, lens);
    if (r == NULL) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s",
                              c->wr->errstr);
        return -1;
    }
    int ok = r->type != REDIS_REPLY_ERROR;
    if (!ok)
        outbox_report_problem(
            c, OUTBOX_CONSUMER_ERR_REDIS,
            "FUNCTION LOAD of library %s (the dead-letter function) failed: %s%s",
            OUTBOX_CONSUMER_FUNCTION_LIBRARY, r->str,
            strncmp(r->str, "NOPERM", 6) == 0
                ? "; the consumer's Redis user needs the ACL permissions +function|load "
                  "and +fcall"
                : "");
    freeReplyObject(r);
    return ok ? 0 : -1;
}

void outbox_conn_sleep(struct outbox_consumer *c, uint32_t ms)
{
    while (ms > 0 && !c->stop) {
        uint32_t step = ms > 50 ? 50 : ms;
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)step * 1000000L};
        nanosleep(&ts, NULL);
        ms -= step;
    }
}

/*
 * A dead-letter or replay stream under its name before 0.2 ("<stream>.<group>
 * .dlq" and ".replay", outside the stream's hash slot) is renamed to its name
 * now when that is free; when both exist, a warning says how to merge them
 * (outbox-relay dlq migrate). Failures are warnings: consuming goes on.
 */
void outbox_conn_migrate_name(struct outbox_consumer *c, const char *stream, const char *now,
                              int replay)
{
    char old[sizeof(c->dlq)];
    if ((replay ? outbox_key_replay_old(stream, c->group, old, sizeof(old))
                : outbox_key_dlq_old(stream, c->group, old, sizeof(old))) < 0)
        return;
    const char *argv[3] = {"RENAMENX", old, now};
    size_t lens[3] = {8, strlen(old), strlen(now)};
    redisReply *r = outbox_conn_command(c->wr, 3, argv, lens);
    if (r == NULL)
        return;
    if (r->type == REDIS_REPLY_INTEGER && r->integer == 1)
        outbox_report_emit(c, OUTBOX_CONSUMER_LOG_INFO,
                           "%s: renamed %s to %s (the name before 0.2)", c->consumer, old, now);
    else if (r->type == REDIS_REPLY_INTEGER && r->integer == 0)
        outbox_report_emit(
            c, OUTBOX_CONSUMER_LOG_WARNING,
            "%s: both %s (the name before 0.2) and %s exist: run 'outbox-relay dlq migrate %s "
            "%s' to move the old entries",
            c->consumer, old, now, stream, c->group);
    /* An error: the old key is absent (ERR no such key), or a cluster refused
     * a rename across slots, where no deployment before 0.2 ran. */
    freeReplyObject(r);
}

/* A refusal that connecting again cures: the library flushed or deleted
 * (connecting loads it), the group or stream deleted (connecting creates
 * them again), the stream's slot moved to another primary of a cluster, or
 * the primary became a replica (connecting finds the primary). */
void outbox_conn_reconnect_if_needed(struct outbox_consumer *c, const redisReply *r)
{
    if (r != NULL && r->type == REDIS_REPLY_ERROR &&
        (strstr(r->str, "Function not found") != NULL || strncmp(r->str, "NOGROUP", 7) == 0 ||
         strncmp(r->str, "MOVED ", 6) == 0 || strncmp(r->str, "READONLY", 8) == 0))
        outbox_conn_close_all(c);
}

redisReply *outbox_conn_call(struct outbox_consumer *c, const char **argv)
{
    if (c->wr == NULL)
        return NULL; /* lost earlier in this step: the loop reconnects */
    size_t lens[16];
    int argc = 0;
    while (argc < 15 && argv[argc] != NULL) {
        lens[argc] = strlen(argv[argc]);
        argc++;
    }
    redisReply *r = outbox_conn_command(c->wr, argc, argv, lens);
    if (r == NULL) {
        outbox_report_problem(c, OUTBOX_CONSUMER_ERR_IO, "Redis connection lost: %s",
                              c->wr->errstr);
        outbox_conn_close_all(c);
    }
    return r;
}
