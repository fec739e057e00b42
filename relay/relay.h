/*
 * The relay: ties the PostgreSQL connections, the Redis sink and the batch
 * loop together on one libev loop, and handles signals. main() only builds
 * the configuration, calls relay_new and runs the loop.
 */
#ifndef RELAY_RELAY_H
#define RELAY_RELAY_H

struct ev_loop;
struct relay;
struct relay_config;
struct relay_config_source;

/* Creates the relay and starts connecting. cfg must outlive the relay. */
struct relay *relay_new(struct ev_loop *loop, struct relay_config *cfg,
                        const struct relay_config_source *reload)
    __attribute__((warn_unused_result));

/* Runs the loop until shutdown; returns the process exit code. */
int relay_run(struct relay *r) __attribute__((warn_unused_result));

/* Closes every connection and frees the relay. */
void relay_free(struct relay *r);

#endif
