/*
 * The wake-up protocol's state machine (docs/DESIGN.md, "The wake-up
 * protocol"), pure like the claim cycle's: events in, effects out through
 * ops. Producers notify only while no relay holds the wake-up lock; a busy
 * relay holds it on its LISTEN connection and claims on its own until a claim
 * comes back empty, then releases it, waits for the outbox writers that were
 * open at the release (they alone can have skipped their notification) while
 * claiming on, claims once more and sleeps until a notification or the poll.
 */
#ifndef RELAY_WAKE_H
#define RELAY_WAKE_H

enum relay_wake_mode {
    RELAY_WAKE_BUSY = 0, /* claims on its own until a claim comes back empty */
    RELAY_WAKE_IDLE,     /* declared idle: notifications wake it */
};

enum relay_wake_lock {
    RELAY_LOCK_FREE = 0, /* not held: producers notify */
    RELAY_LOCK_TAKING,   /* requested; new producers already skip their notification */
    RELAY_LOCK_HELD,     /* held: producers skip their notification */
};

/* Commands go to the LISTEN connection; 0 when sent, -1 when it cannot take
 * one now. Their answers come back as events. */
struct relay_wake_ops {
    void *arg;
    double (*now)(void *arg); /* monotonic seconds */
    int (*take_lock)(void *arg);
    int (*declare_idle)(void *arg); /* release the lock and list the open writers */
    int (*settle_check)(void *arg); /* how many of those writers still run */
    void (*arm_settle)(void *arg, double delay);
    void (*want_claim)(void *arg, double delay);
    void (*check_holder)(void *arg); /* who else holds the lock, if anyone */
};

struct relay_wake {
    struct relay_wake_ops ops;
    int enabled; /* listen = on; with it off the machine does nothing */
    double poll_s;
    enum relay_wake_mode mode;
    enum relay_wake_lock lock;
    int idle_wanted; /* a claim came back empty while the lock was being taken */
    int settling;    /* declared idle; waiting for writers that may not have notified */
    int draining;    /* no settle waits during a drain */
    double settle_started;
};

void relay_wake_init(struct relay_wake *w, const struct relay_wake_ops *ops, int enabled,
                     double poll_s);

/* The relay found rows (a batch published or committed, or a claiming
 * connection came up and catches up): it is busy; take the lock when free. */
void relay_wake_busy(struct relay_wake *w);
/* The answer to take_lock. */
void relay_wake_lock_taken(struct relay_wake *w, int ok);
/* A claim came back empty with nothing else in flight, while busy. */
void relay_wake_empty(struct relay_wake *w);
/* The answer to declare_idle: ok, and how many writers were open. */
void relay_wake_declared(struct relay_wake *w, int ok, long writers);
/* The answer to settle_check: writers still running, -1 when unknown. */
void relay_wake_settle_checked(struct relay_wake *w, long running);
/* The settle timer fired. */
void relay_wake_settle_due(struct relay_wake *w);
/* The lock was given up while busy (another relay joined): producers
 * notify again. */
void relay_wake_released(struct relay_wake *w);
/* The LISTEN connection broke: the server released the lock with it. */
void relay_wake_listen_down(struct relay_wake *w);
/* The poll timer fired. */
void relay_wake_poll(struct relay_wake *w);

/* 1 while the relay must claim on its own (busy and producers skip notifying). */
int relay_wake_self_driven(const struct relay_wake *w);

#endif
