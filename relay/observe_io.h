/*
 * The daemon's observation thread: runs relay_observe (blocking reads with
 * deadlines) every observe_interval, never on the event loop, and hands each
 * observation to the loop through an ev_async. The loop's callback gets a
 * copy it owns until the next one.
 */
#ifndef RELAY_OBSERVE_IO_H
#define RELAY_OBSERVE_IO_H

struct ev_loop;
struct relay_config;
struct relay_observation;
struct relay_observer;
struct relay_stream_seen;

/* Runs on the loop with each fresh observation. */
typedef void relay_observer_fn(void *arg, const struct relay_observation *o);

/* Starts the thread. seen hands it the streams the loop publishes to first
 * (relay/streamseen.h); it must outlive the thread. NULL when it cannot (out of memory, or
 * no thread): the relay then runs without queue age, lag or backpressure, and says so. */
struct relay_observer *relay_observe_io_start(struct ev_loop *loop, const struct relay_config *cfg,
                                              struct relay_stream_seen *seen,
                                              relay_observer_fn *fresh, void *arg)
    __attribute__((warn_unused_result));

/* Ends the thread's waits at once (a server may not be answering), joins it
 * and frees everything. NULL-safe. */
void relay_observe_io_stop(struct relay_observer *ob);

#endif
