/*
 * A wall-clock step for one process, as an NTP step or a VM resume makes it:
 * loaded with LD_PRELOAD, it adds a number of milliseconds to CLOCK_REALTIME
 * (and to gettimeofday and time) and leaves CLOCK_MONOTONIC alone, as the
 * kernel does. The step is read from the file named by OUTBOX_CLOCKSTEP_FILE
 * (a signed integer, in ms; missing or empty means 0) at most every 20 ms of
 * monotonic time, so a test steps the clock of a running process by writing
 * that file.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int clock_gettime_fn(clockid_t, struct timespec *);

static clock_gettime_fn *real_clock_gettime(void)
{
    static clock_gettime_fn *fn;
    if (fn == NULL)
        fn = (clock_gettime_fn *)dlsym(RTLD_NEXT, "clock_gettime");
    return fn;
}

static long long step_ms(void)
{
    static long long cached;
    static struct timespec read_at;
    struct timespec now;
    if (real_clock_gettime()(CLOCK_MONOTONIC, &now) != 0)
        return cached;
    long long since =
        (now.tv_sec - read_at.tv_sec) * 1000LL + (now.tv_nsec - read_at.tv_nsec) / 1000000;
    if (read_at.tv_sec != 0 && since < 20)
        return cached;
    read_at = now;
    const char *path = getenv("OUTBOX_CLOCKSTEP_FILE");
    if (path == NULL)
        return cached = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return cached = 0;
    char buf[32];
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return cached = 0;
    buf[n] = '\0';
    cached = strtoll(buf, NULL, 10);
    return cached;
}

static void shift(struct timespec *ts, long long ms)
{
    long long ns = (long long)ts->tv_nsec + (ms % 1000) * 1000000LL;
    ts->tv_sec += (time_t)(ms / 1000);
    while (ns < 0) {
        ns += 1000000000LL;
        ts->tv_sec--;
    }
    while (ns >= 1000000000LL) {
        ns -= 1000000000LL;
        ts->tv_sec++;
    }
    ts->tv_nsec = (long)ns;
}

int clock_gettime(clockid_t id, struct timespec *ts)
{
    int rc = real_clock_gettime()(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE))
        shift(ts, step_ms());
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz)
{
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return -1;
    if (tv != NULL) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *out)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return (time_t)-1;
    if (out != NULL)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
