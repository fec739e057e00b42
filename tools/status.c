/*
 * "outbox-relay status": the operator's view, for a human or (--json) a
 * script. It reads PostgreSQL and Redis itself, so it works whether or not a
 * relay is running, and exits 69 (EX_UNAVAILABLE) naming the server it could
 * not reach.
 */
#include "common/compat.h"

#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "core/observe.h"
#include "tools/tools.h"

/* "status [--json]": 0 with *json set, or -1 after saying why. */
static int parse_status_args(int argc, char **argv, FILE *errout, int *json)
{
    *json = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            *json = 1;
        } else {
            fprintf(errout,
                    "outbox-relay: status: unexpected \"%s\"\n"
                    "Usage: outbox-relay [-c FILE] status [--json]\n",
                    argv[i]);
            return -1;
        }
    }
    return 0;
}

int relay_tool_status(const struct relay_config *cfg, int argc, char **argv, FILE *out,
                      FILE *errout)
{
    int json;
    if (parse_status_args(argc, argv, errout, &json) < 0)
        return OUTBOX_EX_USAGE;
    struct relay_observation *o = malloc(sizeof(*o));
    char *text = malloc(256 * 1024);
    if (o == NULL || text == NULL) {
        free(o);
        free(text);
        return OUTBOX_EX_OSERR;
    }
    PGconn *pg = NULL;
    redisContext *rd = NULL;
    int rc = relay_observe(cfg, &pg, &rd, 0, NULL, NULL, o);
    if (json)
        relay_observe_json(o, text, 256 * 1024);
    else
        relay_observe_text(o, text, 256 * 1024);
    fputs(text, out);
    if (rc < 0) {
        if (!o->pg_ok)
            fprintf(errout, "outbox-relay: PostgreSQL unreachable or failing: %s\n", o->pg_error);
        if (!o->redis_ok)
            fprintf(errout, "outbox-relay: Redis unreachable or failing: %s\n", o->redis_error);
    }
    PQfinish(pg);
    if (rd != NULL)
        redisFree(rd);
    free(o);
    free(text);
    return rc < 0 ? OUTBOX_EX_UNAVAILABLE : OUTBOX_EX_OK;
}
