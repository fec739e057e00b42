/*
 * The wake-up protocol's state machine (relay/wake.h).
 */
#include "common/compat.h"

#include "relay/wake.h"

#include <string.h>

void relay_wake_init(struct relay_wake *w, const struct relay_wake_ops *ops, int enabled,
                     double poll_s)
{
    memset(w, 0, sizeof(*w));
    w->ops = *ops;
    w->enabled = enabled;
    w->poll_s = poll_s;
    w->mode = RELAY_WAKE_BUSY; /* the catch-up claim runs before sleeping */
}

int relay_wake_self_driven(const struct relay_wake *w)
{
    return w->enabled && w->mode == RELAY_WAKE_BUSY;
}

static void take_lock(struct relay_wake *w)
{
    if (!w->enabled || w->lock != RELAY_LOCK_FREE || w->settling)
        return;
    if (w->ops.take_lock(w->ops.arg) == 0)
        w->lock = RELAY_LOCK_TAKING;
}

void relay_wake_busy(struct relay_wake *w)
{
    if (!w->enabled)
        return;
    w->mode = RELAY_WAKE_BUSY;
    take_lock(w); /* again, if an earlier attempt timed out */
}

void relay_wake_lock_taken(struct relay_wake *w, int ok)
{
    /* Not taken is typically lock_timeout: a notifying producer has not
     * committed yet. Producers keep notifying meanwhile, which costs them. */
    w->lock = ok ? RELAY_LOCK_HELD : RELAY_LOCK_FREE;
    if (w->idle_wanted) {
        w->idle_wanted = 0;
        w->ops.want_claim(w->ops.arg, 0.0);
    }
}

void relay_wake_empty(struct relay_wake *w)
{
    if (!w->enabled || w->mode != RELAY_WAKE_BUSY || w->settling)
        return; /* while settling, the settle's end claims once more */
    if (w->lock == RELAY_LOCK_TAKING) {
        /* Producers already skip their notifications: keep claiming on a
         * short timer until the lock request ends, then declare. */
        w->idle_wanted = 1;
        w->ops.want_claim(w->ops.arg, 0.002);
        return;
    }
    if (w->ops.declare_idle(w->ops.arg) == 0)
        w->settling = 1;
    /* else the LISTEN connection is busy or down: the poll keeps it going */
}

static void settle_ended(struct relay_wake *w)
{
    w->settling = 0;
    /* The last claim before sleeping: anything those writers wrote. */
    w->ops.want_claim(w->ops.arg, 0.0);
    w->ops.check_holder(w->ops.arg);
}

void relay_wake_declared(struct relay_wake *w, int ok, long writers)
{
    /* Released or not, the next busy spell takes the lock afresh. */
    w->lock = RELAY_LOCK_FREE;
    if (!ok) {
        w->settling = 0;
        return;
    }
    w->mode = RELAY_WAKE_IDLE;
    w->settle_started = w->ops.now(w->ops.arg);
    if (writers <= 0 || w->ops.settle_check(w->ops.arg) < 0)
        settle_ended(w); /* no writer was open: nobody can have skipped a notification */
}

void relay_wake_settle_checked(struct relay_wake *w, long running)
{
    if (!w->settling)
        return;
    double waited = w->ops.now(w->ops.arg) - w->settle_started;
    if (running > 0 && waited < w->poll_s && !w->draining) {
        /* 1 ms at first (a producer's commit is that close), backing off to
         * 50 ms behind a long transaction; the poll covers what is left. */
        w->ops.arm_settle(w->ops.arg, waited < 0.010 ? 0.001 : waited < 0.100 ? 0.010 : 0.050);
        return;
    }
    settle_ended(w);
}

void relay_wake_settle_due(struct relay_wake *w)
{
    if (w->settling && w->ops.settle_check(w->ops.arg) < 0)
        settle_ended(w);
}

void relay_wake_released(struct relay_wake *w)
{
    if (w->lock == RELAY_LOCK_HELD)
        w->lock = RELAY_LOCK_FREE;
}

void relay_wake_listen_down(struct relay_wake *w)
{
    if (w->lock == RELAY_LOCK_HELD)
        w->lock = RELAY_LOCK_FREE;
}

void relay_wake_poll(struct relay_wake *w)
{
    if (w->enabled && w->mode == RELAY_WAKE_IDLE && !w->settling)
        w->ops.check_holder(w->ops.arg);
}
