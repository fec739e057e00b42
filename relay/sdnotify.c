/*
 * sd_notify(3) from the stable datagram protocol: the state text goes as one
 * datagram to the AF_UNIX socket named by $NOTIFY_SOCKET ("@" for the
 * abstract namespace). Small enough that libsystemd is not worth a dependency.
 */
#include "common/compat.h"

#include "relay/sdnotify.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int relay_sd_notify(const char *state)
{
    const char *path = getenv("NOTIFY_SOCKET");
    if (path == NULL || path[0] == '\0')
        return 0;
    size_t len = strlen(path);
    struct sockaddr_un addr;
    if ((path[0] != '/' && path[0] != '@') || len >= sizeof(addr.sun_path))
        return -1;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, len);
    if (path[0] == '@')
        addr.sun_path[0] = '\0';

    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    socklen_t alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len);
    /* Never wait for the receiver: a full queue would stall the event loop.
     * A notification that does not fit now is dropped, and the next one
     * (STATUS= every 2 s, WATCHDOG=1 at half the watchdog period) follows. */
    ssize_t n = sendto(fd, state, strlen(state), MSG_NOSIGNAL | MSG_DONTWAIT,
                       (struct sockaddr *)&addr, alen);
    close(fd);
    return n < 0 ? -1 : 1;
}
