/* Waiting on one descriptor (common/wait.h). */
#include "common/compat.h"

#include "common/wait.h"

#include <errno.h>
#include <poll.h>
#include <time.h>

double outbox_mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

enum outbox_wait outbox_wait_fd(int fd, short events, int stop_fd, double deadline)
{
    for (;;) {
        struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = stop_fd, .events = POLLIN}};
        double left = deadline - outbox_mono_now();
        if (left <= 0)
            return OUTBOX_WAIT_DEADLINE;
        int n = poll(p, 2, left > 3600.0 ? 3600 * 1000 : (int)(left * 1000.0) + 1);
        if (n < 0 && errno != EINTR)
            return OUTBOX_WAIT_STOPPED;
        if (n > 0 && p[1].revents != 0)
            return OUTBOX_WAIT_STOPPED;
        if (n > 0 && p[0].revents != 0)
            return OUTBOX_WAIT_READY;
    }
}
