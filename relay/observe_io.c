/*
 * The daemon's observation thread and its hand-off (relay/observe_io.h).
 * After each observation the thread also runs retention (relay/retention.c).
 * The thread writes into a buffer under a mutex and wakes the loop with an
 * ev_async; the loop copies it out under the same mutex and calls back.
 */
#include "common/compat.h"

#include "relay/observe_io.h"

#include <ev.h>
#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/config.h"
#include "core/observe.h"
#include "relay/retention.h"
#include "core/streamlist.h"
#include "relay/streamseen.h"

struct relay_observer {
    struct ev_loop *loop;
    const struct relay_config *cfg;
    struct relay_stream_seen *seen;
    relay_observer_fn *fresh_fn;
    void *arg;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int stop;                        /* under lock */
    int fresh;                       /* under lock */
    struct relay_observation *next;  /* written by the thread, under lock */
    struct relay_observation *taken; /* the loop's copy */
    struct relay_observe_stop *interrupt;
    ev_async async;
};

static void *observe_main(void *arg)
{
    struct relay_observer *ob = arg;
    struct relay_observation *o = malloc(sizeof(*o));
    PGconn *pg = NULL;
    redisContext *rd = NULL;
    struct relay_retention retention;
    struct relay_stream_list streams;
    memset(&retention, 0, sizeof(retention));
    memset(&streams, 0, sizeof(streams));
    if (o == NULL)
        return NULL;
    pthread_mutex_lock(&ob->lock);
    while (!ob->stop) {
        pthread_mutex_unlock(&ob->lock);
        char **fresh = NULL;
        int overflow = 0;
        size_t nfresh = ob->seen != NULL ? relay_stream_seen_take(ob->seen, &fresh, &overflow) : 0;
        relay_stream_list_round(&streams, fresh, nfresh, overflow);
        relay_retention_rows(ob->cfg, &pg, ob->interrupt, &retention);
        relay_observe(ob->cfg, &pg, &rd, 1, ob->interrupt, &streams, o);
        relay_retention_run(ob->cfg, &rd, ob->interrupt, &streams, &retention, o);
        pthread_mutex_lock(&ob->lock);
        memcpy(ob->next, o, sizeof(*o));
        ob->fresh = 1;
        ev_async_send(ob->loop, &ob->async);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        uint64_t ns = (uint64_t)until.tv_nsec + (uint64_t)ob->cfg->observe_interval_ms * 1000000u;
        until.tv_sec += (time_t)(ns / 1000000000u);
        until.tv_nsec = (long)(ns % 1000000000u);
        while (!ob->stop && pthread_cond_timedwait(&ob->cond, &ob->lock, &until) == 0)
            ;
    }
    pthread_mutex_unlock(&ob->lock);
    relay_retention_end(&retention);
    relay_stream_list_free(&streams);
    PQfinish(pg);
    if (rd != NULL)
        redisFree(rd);
    free(o);
    return NULL;
}

static void on_async(struct ev_loop *loop, ev_async *w, int revents)
{
    struct relay_observer *ob = w->data;
    (void)loop;
    (void)revents;
    pthread_mutex_lock(&ob->lock);
    int fresh = ob->fresh;
    if (fresh)
        memcpy(ob->taken, ob->next, sizeof(*ob->taken));
    ob->fresh = 0;
    pthread_mutex_unlock(&ob->lock);
    if (fresh)
        ob->fresh_fn(ob->arg, ob->taken);
}

struct relay_observer *relay_observe_io_start(struct ev_loop *loop, const struct relay_config *cfg,
                                              struct relay_stream_seen *seen,
                                              relay_observer_fn *fresh, void *arg)
{
    struct relay_observer *ob = calloc(1, sizeof(*ob));
    if (ob == NULL)
        return NULL;
    ob->loop = loop;
    ob->cfg = cfg;
    ob->seen = seen;
    ob->fresh_fn = fresh;
    ob->arg = arg;
    ob->next = calloc(1, sizeof(*ob->next));
    ob->taken = calloc(1, sizeof(*ob->taken));
    ob->interrupt = relay_observe_stop_new(); /* NULL: waits end at their deadlines */
    if (ob->next == NULL || ob->taken == NULL) {
        relay_observe_stop_free(ob->interrupt);
        free(ob->next);
        free(ob->taken);
        free(ob);
        return NULL;
    }
    pthread_mutex_init(&ob->lock, NULL);
    pthread_cond_init(&ob->cond, NULL);
    ev_async_init(&ob->async, on_async);
    ob->async.data = ob;
    ev_async_start(loop, &ob->async);
    if (pthread_create(&ob->thread, NULL, observe_main, ob) != 0) {
        ev_async_stop(loop, &ob->async);
        pthread_mutex_destroy(&ob->lock);
        pthread_cond_destroy(&ob->cond);
        relay_observe_stop_free(ob->interrupt);
        free(ob->next);
        free(ob->taken);
        free(ob);
        return NULL;
    }
    return ob;
}

void relay_observe_io_stop(struct relay_observer *ob)
{
    if (ob == NULL)
        return;
    pthread_mutex_lock(&ob->lock);
    ob->stop = 1;
    pthread_cond_signal(&ob->cond);
    pthread_mutex_unlock(&ob->lock);
    relay_observe_stop_trigger(ob->interrupt); /* a server may not be answering */
    pthread_join(ob->thread, NULL);
    pthread_mutex_destroy(&ob->lock);
    pthread_cond_destroy(&ob->cond);
    ev_async_stop(ob->loop, &ob->async);
    relay_observe_stop_free(ob->interrupt);
    free(ob->next);
    free(ob->taken);
    free(ob);
}
