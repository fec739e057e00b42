/*
 * Stream backpressure, pure: which streams to hold back for their consumer
 * groups, decided from an observation and the pause and resume marks of the
 * configuration, with hysteresis (docs/OPERATIONS.md, "Producer
 * backpressure"). A paused topic's rows wait in the outbox; the claim skips
 * them through its second parameter, the text[] value built here.
 */
#ifndef RELAY_BACKPRESSURE_H
#define RELAY_BACKPRESSURE_H

#include <stddef.h>

#include "common/common.h"
#include "core/observe.h"

struct relay_config;

struct relay_paused {
    size_t n;
    char topics[RELAY_OBS_TOPICS_MAX][OUTBOX_TOPIC_MAX + 1];
    /* The claim's $2: every element quoted, a quote or backslash doubled at
     * most, so twice the topic's bytes and its quotes and comma. */
    char param[RELAY_OBS_TOPICS_MAX * (2 * OUTBOX_TOPIC_MAX + 3) + 3];
};

/* One stream that changed: the index of its topic in the observation. */
struct relay_bp_change {
    size_t topic;
    int paused; /* 1 paused now, 0 resumed */
};

/* Nothing paused, and the parameter "{}". */
void relay_paused_init(struct relay_paused *p);

/* 1 when topic is held back. */
int relay_paused_has(const struct relay_paused *p, const char *topic);

/*
 * Applies one observation: a stream pauses when one of its groups reaches
 * pause_lag_entries or pause_queue_age, and resumes once every group is at
 * or below the resume marks. Without Redis in the observation, or with both
 * pause marks off, nothing stays paused. Writes each change into changes
 * (room for RELAY_OBS_TOPICS_MAX) and returns their count; *resumed is 1 when
 * rows that were held back may be claimed now (their stream resumed, or
 * pausing ended for every stream): nothing notifies for them.
 */
size_t relay_backpressure_apply(struct relay_paused *p, const struct relay_config *cfg,
                                const struct relay_observation *o, struct relay_bp_change *changes,
                                int *resumed);

#endif
