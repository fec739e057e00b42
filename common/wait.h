/*
 * Waiting on one descriptor with a deadline and a way to stop
 * (common/wait.c): what every blocking call of the observer, the tools and
 * the consumer library is built on.
 */
#ifndef OUTBOX_WAIT_H
#define OUTBOX_WAIT_H

enum outbox_wait { OUTBOX_WAIT_READY, OUTBOX_WAIT_DEADLINE, OUTBOX_WAIT_STOPPED };

/* Seconds on the monotonic clock. */
double outbox_mono_now(void);

/*
 * Waits until fd is ready for events (POLLIN, POLLOUT; or in error: the
 * caller's library finds out which), the monotonic deadline passes, or
 * stop_fd (-1: none) becomes readable. A poll that fails for any reason but
 * EINTR counts as stopped: the caller gives up rather than spin.
 */
enum outbox_wait outbox_wait_fd(int fd, short events, int stop_fd, double deadline)
    __attribute__((warn_unused_result));

#endif
