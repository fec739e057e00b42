/*
 * Stream backpressure decisions (relay/backpressure.h).
 */
#include "common/compat.h"
#include "core/pg.h"

#include "relay/backpressure.h"

#include <stdio.h>
#include <string.h>

#include "core/config.h"

void relay_paused_init(struct relay_paused *p)
{
    p->n = 0;
    snprintf(p->param, sizeof(p->param), "{}");
}

int relay_paused_has(const struct relay_paused *p, const char *topic)
{
    for (size_t i = 0; i < p->n; i++)
        if (strcmp(p->topics[i], topic) == 0)
            return 1;
    return 0;
}

/* Stream-side age of a group: what waits in Redis, not in the outbox (a paused
 * stream's outbox wait must not keep it paused). */
static double stream_age(const struct relay_group_obs *g)
{
    return g->oldest_pending_age > g->oldest_undelivered_age ? g->oldest_pending_age
                                                             : g->oldest_undelivered_age;
}

size_t relay_backpressure_apply(struct relay_paused *p, const struct relay_config *cfg,
                                const struct relay_observation *o, struct relay_bp_change *changes,
                                int *resumed)
{
    char next[RELAY_OBS_TOPICS_MAX][OUTBOX_TOPIC_MAX + 1];
    size_t nnext = 0, nchanges = 0;
    *resumed = 0;
    if (o->redis_ok && (cfg->pause_lag_entries != 0 || cfg->pause_queue_age_ms != 0)) {
        for (size_t t = 0; t < o->ntopics; t++) {
            const char *topic = o->topics[t].topic;
            if (!relay_observe_first_of_topic(o, t))
                continue; /* a partitioned topic: decided at its first stream */
            int was = relay_paused_has(p, topic), over = 0, under = 1;
            for (size_t g = 0; g < o->ngroups; g++) {
                const struct relay_group_obs *go = &o->groups[g];
                if (go->topic < 0 || (size_t)go->topic >= o->ntopics ||
                    strcmp(o->topics[go->topic].topic, topic) != 0)
                    continue;
                double age_ms = stream_age(go) * 1000.0;
                if (cfg->pause_lag_entries && go->lag >= (long long)cfg->pause_lag_entries)
                    over = 1;
                if (cfg->pause_queue_age_ms && age_ms >= cfg->pause_queue_age_ms)
                    over = 1;
                if ((cfg->pause_lag_entries && go->lag > (long long)cfg->resume_lag_entries) ||
                    (cfg->pause_queue_age_ms && age_ms > cfg->resume_queue_age_ms))
                    under = 0;
            }
            int paused = was ? !under : over;
            if (paused != was && nchanges < RELAY_OBS_TOPICS_MAX) {
                changes[nchanges].topic = t;
                changes[nchanges++].paused = paused;
            }
            if (paused && nnext < RELAY_OBS_TOPICS_MAX)
                snprintf(next[nnext++], sizeof(next[0]), "%s", topic);
            if (was && !paused)
                *resumed = 1;
        }
    }
    if (p->n > nnext)
        *resumed = 1; /* also when Redis went away or pausing was switched off */
    p->n = nnext;
    // cppcheck-suppress legacyUninitvar ; next[0 .. nnext) were written above
    memcpy(p->topics, next, nnext * sizeof(next[0]));
    if (relay_pg_text_array(p->param, sizeof(p->param), (const char(*)[OUTBOX_TOPIC_MAX + 1]) next,
                            nnext) < 0) {
        /* Cannot happen with the sizes above; claim everything rather than
         * send a value that would fail every claim. */
        relay_paused_init(p);
    }
    return nchanges;
}
