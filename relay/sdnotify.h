/*
 * The systemd notification protocol (sd_notify(3)) without libsystemd: one
 * datagram to $NOTIFY_SOCKET. A no-op when the variable is not set.
 */
#ifndef RELAY_SDNOTIFY_H
#define RELAY_SDNOTIFY_H

/* Sends state, e.g. "READY=1" or "STATUS=...". 1 sent, 0 not under systemd,
 * -1 on error. */
int relay_sd_notify(const char *state);

#endif
