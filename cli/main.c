/*
 * outbox-relay, the one executable: reads the command line, then runs the
 * daemon (relay/, in the order of start-up and shutdown) or one of the
 * operator commands (tools/). Everything else lives in the libraries of
 * those folders and of core/ and common/, which the tests link too.
 */
#include "common/compat.h"

#include <ev.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/common.h"
#include "core/config.h"
#include "relay/log.h"
#include "relay/relay.h"
#include "tools/tools.h"

extern char **environ;

static void usage(FILE *out)
{
    char keys[8192];
    relay_config_help(keys, sizeof(keys));
    fprintf(out,
            "Usage: outbox-relay [-c FILE] [--check-config | --print-config] [--KEY VALUE]...\n"
            "       outbox-relay [-c FILE] [--KEY VALUE]... failed list [--limit N]\n"
            "       outbox-relay [-c FILE] [--KEY VALUE]... failed retry ID... | --all\n"
            "       outbox-relay [-c FILE] [--KEY VALUE]... failed drop ID...\n"
            "       outbox-relay [-c FILE] [--KEY VALUE]... dlq list STREAM GROUP [--count N]\n"
            "       outbox-relay [-c FILE] [--KEY VALUE]... dlq show STREAM GROUP ID\n"
            "       outbox-relay [-c FILE] [--KEY VALUE]... dlq replay|purge STREAM GROUP\n"
            "                                               ID... | FROM-TO... | --all\n"
            "       outbox-relay [-c FILE] [--KEY VALUE]... dlq migrate STREAM GROUP\n"
            "       outbox-relay [-c FILE] [--KEY VALUE]... status [--json]\n"
            "       outbox-relay --help | --version\n"
            "\n"
            "Publishes committed rows of outbox.messages to Redis Streams, at least once.\n"
            "\n"
            "  -c, --config FILE   read settings from FILE (key = value lines)\n"
            "      --check-config  validate the configuration and exit, without connecting\n"
            "      --print-config  validate it, then print every key's effective value\n"
            "                      (passwords shown as ***) as a configuration file\n"
            "  -h, --help          show this help\n"
            "  -V, --version       show the version\n"
            "\n"
            "Commands:\n"
            "  failed list         show quarantined rows and their errors\n"
            "  failed retry        put quarantined rows back in line (ids, or --all)\n"
            "  dlq list            show a consumer group's dead letters ({STREAM}.GROUP.dlq)\n"
            "  dlq show            show every field of one dead letter\n"
            "  dlq replay          send dead letters back to that group only\n"
            "                      ({STREAM}.GROUP.replay), with their original fields\n"
            "  dlq purge           delete dead letters\n"
            "  dlq migrate         move a group's dead letters and replays from the names\n"
            "                      before 0.2 (STREAM.GROUP.dlq) to today's\n"
            "  status              queue age, lag, pending, dead letters and quarantined\n"
            "                      rows per stream and group; --json for scripts\n"
            "  (failed needs only the postgres setting, dlq only the redis setting;\n"
            "  COMMAND --help shows its usage; 'outbox-relay dlq --help' explains ids\n"
            "  and ranges)\n"
            "\n"
            "Every key can also be set with OUTBOX_RELAY_<KEY> in the environment or\n"
            "--<key-with-dashes> on the command line (command line > environment > file).\n"
            "\n"
            "Keys:\n%s\n"
            "Exit status: 0 after a clean shutdown, 64 for bad usage, 78 for a bad\n"
            "configuration; the commands: 65 when what they name does not exist, 69 when\n"
            "the server cannot be reached.\n",
            keys);
}

/* SIGTERM, SIGINT and SIGHUP wait, blocked, until the loop's watchers take
 * them: a stop request during start-up is then a clean drain, not a kill. */
static void block_signals(int how)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigprocmask(how, &set, NULL);
}

/* What the command line asks for. */
struct cmdline {
    const char *config_path;
    int check_only;
    int print_config; /* --print-config: check, then show the configuration */
    int tool_argc;    /* an operator command and its arguments, or 0 */
    char **tool_argv;
    char **overrides; /* "--key value" or "--key=value" settings, in order */
    int noverrides;
};

/* The program's own options, for "did you mean"; the keys' flags are the
 * configuration's (relay_config_nearest_flag). */
static const char *const own_options[] = {"--help", "--version", "--config", "--check-config",
                                          "--print-config"};

/* An option that is neither the program's nor a key's: bad usage, with the
 * nearest of them when one is near. */
static int unknown_option(const char *a)
{
    char near[128];
    int len = (int)strcspn(a, "=");
    if (relay_config_nearest_flag(a, own_options, OUTBOX_ARRAY_LEN(own_options), near,
                                  sizeof(near)) != NULL)
        fprintf(stderr, "outbox-relay: unknown option %.*s (did you mean %s?); see --help\n",
                len > 80 ? 80 : len, a, near);
    else
        fprintf(stderr, "outbox-relay: unknown option %.*s; see --help\n", len > 80 ? 80 : len, a);
    return OUTBOX_EX_USAGE;
}

static int run_tool(const struct cmdline *cl, const struct relay_config *cfg);

/* An operator command's whole command line, checked before any configuration
 * is read, so that bad usage is 64 whatever the configuration: its words,
 * then its other arguments, which each command checks with no configuration
 * and connecting to nothing. */
static int check_tool(const struct cmdline *cl)
{
    if (relay_tool_check_usage(cl->tool_argc, cl->tool_argv, stderr) != OUTBOX_EX_OK)
        return OUTBOX_EX_USAGE;
    return run_tool(cl, NULL);
}

/* Reads the options into cl (whose overrides holds argc entries). Returns -1
 * to go on, or the exit code to leave with at once. */
static int parse_args(int argc, char **argv, struct cmdline *cl)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return OUTBOX_EX_OK;
        } else if (strcmp(a, "-V") == 0 || strcmp(a, "--version") == 0) {
            printf("outbox-relay %s\nhiredis %d.%d.%d, %s\n", RELAY_VERSION, HIREDIS_MAJOR,
                   HIREDIS_MINOR, HIREDIS_PATCH,
                   OUTBOX_TLS
                       ? "with TLS to Redis (rediss://)"
                       : "without TLS to Redis (rediss:// needs hiredis 1.x with hiredis_ssl)");
            return OUTBOX_EX_OK;
        } else if (strcmp(a, "--check-config") == 0) {
            cl->check_only = 1;
        } else if (strcmp(a, "--print-config") == 0) {
            cl->check_only = 1;
            cl->print_config = 1;
        } else if (strcmp(a, "-c") == 0 || strcmp(a, "--config") == 0) {
            if (i + 1 >= argc) {
                fprintf(stderr, "outbox-relay: %s needs a file name; see --help\n", a);
                return OUTBOX_EX_USAGE;
            }
            cl->config_path = argv[++i];
        } else if (strncmp(a, "--config=", 9) == 0) {
            cl->config_path = a + 9;
        } else if (strncmp(a, "--", 2) == 0 && a[2] != '\0') {
            /* A mistyped option must not be taken for a key and eat the
             * next argument as its value. */
            if (!relay_config_is_flag(a))
                return unknown_option(a);
            cl->overrides[cl->noverrides++] = argv[i];
            /* "--key value": the value goes along unless the flag holds '='. */
            if (strchr(a, '=') == NULL && i + 1 < argc)
                cl->overrides[cl->noverrides++] = argv[++i];
        } else if (relay_tool_is_command(a)) {
            cl->tool_argc = argc - i;
            cl->tool_argv = argv + i;
            if (cl->tool_argc >= 2 && relay_tool_is_help(cl->tool_argv[1]))
                return run_tool(cl, NULL); /* its usage, with no configuration */
            int rc = check_tool(cl);
            return rc == OUTBOX_EX_OK ? -1 : rc;
        } else {
            const char *near = relay_tool_nearest_command(a);
            if (near != NULL)
                fprintf(stderr,
                        "outbox-relay: unexpected argument \"%s\" (did you mean %s?); see --help\n",
                        a, near);
            else
                fprintf(stderr, "outbox-relay: unexpected argument \"%s\"; see --help\n", a);
            return OUTBOX_EX_USAGE;
        }
    }
    return -1;
}

/* Loads the configuration the command line names into cfg: 0, or the exit
 * code. Each operator command talks to one server: "failed" to PostgreSQL,
 * "dlq" to Redis; the other setting gets a placeholder so it is not
 * demanded. */
static int load_config(const struct cmdline *cl, struct relay_config *cfg)
{
    char err[RELAY_CONFIG_ERR_MAX];
    const char *tool = cl->tool_argv != NULL ? cl->tool_argv[0] : NULL;
    if (tool != NULL && strcmp(tool, "status") != 0) {
        int is_dlq = strcmp(tool, "dlq") == 0;
        if (relay_config_set(cfg, "default", is_dlq ? "postgres" : "redis",
                             is_dlq ? "dbname=unused-by-dlq" : "redis://127.0.0.1:6379", err,
                             sizeof(err)) < 0)
            return OUTBOX_EX_SOFTWARE;
    }
    /* Every mistake at once, so that fixing a file takes one run, not one
     * run per mistake. */
    struct relay_config_errors *errs = malloc(sizeof(*errs));
    if (errs == NULL)
        return OUTBOX_EX_OSERR;
    int rc = 0;
    if (relay_config_load_all(cfg, cl->config_path, environ, cl->noverrides, cl->overrides, errs) <
        0) {
        unsigned shown =
            errs->count < RELAY_CONFIG_ERRORS_MAX ? errs->count : RELAY_CONFIG_ERRORS_MAX;
        for (unsigned i = 0; i < shown; i++)
            fprintf(stderr, "outbox-relay: %s\n", errs->msg[i]);
        if (errs->count > shown)
            fprintf(stderr, "outbox-relay: and %u more errors\n", errs->count - shown);
        rc = OUTBOX_EX_CONFIG;
    }
    free(errs);
    return rc;
}

/* --print-config: the configuration in effect, as a file that reads back
 * (core/config_doc.c), passwords shown as ***. */
static int print_config(const struct relay_config *cfg)
{
    char *dump = malloc(RELAY_CONFIG_DUMP_MAX);
    if (dump == NULL)
        return OUTBOX_EX_OSERR;
    relay_config_dump(cfg, dump, RELAY_CONFIG_DUMP_MAX);
    fputs(dump, stdout);
    free(dump);
    return OUTBOX_EX_OK;
}

/* An operator command: its exit code. With cfg NULL, each command only
 * checks its arguments (check_tool), or prints its usage. */
static int run_tool(const struct cmdline *cl, const struct relay_config *cfg)
{
    const char *tool = cl->tool_argv[0];
    if (strcmp(tool, "dlq") == 0)
        return relay_tool_dlq(cfg, cl->tool_argc, cl->tool_argv, stdout, stderr);
    if (strcmp(tool, "status") == 0)
        return relay_tool_status(cfg, cl->tool_argc, cl->tool_argv, stdout, stderr);
    return relay_tool_failed(cfg, cl->tool_argc, cl->tool_argv, stdout, stderr);
}

/* The daemon, until it stops: its exit code. */
static int run_daemon(const struct cmdline *cl, struct relay_config *cfg)
{
    /* hiredis 0.14 writes with write(2): a closed peer must not kill us. */
    signal(SIGPIPE, SIG_IGN);
    srandom((unsigned)time(NULL) ^ ((unsigned)getpid() << 16));

    struct ev_loop *loop = ev_default_loop(EVFLAG_AUTO);
    if (loop == NULL) {
        fprintf(stderr, "outbox-relay: cannot start the event loop (libev)\n");
        return OUTBOX_EX_OSERR;
    }
    struct relay_config_source reload = {cl->config_path, cl->noverrides, cl->overrides};
    struct relay *r = relay_new(loop, cfg, &reload);
    if (r == NULL) {
        fprintf(stderr, "outbox-relay: out of memory at start-up\n");
        ev_loop_destroy(loop);
        return OUTBOX_EX_OSERR;
    }
    /* The loop's watchers are installed (as sigaction handlers: the loop is
     * not created with EVFLAG_SIGNALFD); what arrived while the signals were
     * blocked is delivered to them now. */
    block_signals(SIG_UNBLOCK);
    int rc = relay_run(r);
    relay_free(r);
    ev_loop_destroy(loop);
    return rc;
}

int main(int argc, char **argv)
{
    block_signals(SIG_BLOCK);
    struct cmdline cl = {0};
    cl.overrides = calloc((size_t)argc + 1, sizeof(*cl.overrides));
    if (cl.overrides == NULL)
        return OUTBOX_EX_OSERR;
    int rc = parse_args(argc, argv, &cl);
    if (rc >= 0) {
        free(cl.overrides);
        return rc;
    }

    struct relay_config cfg;
    relay_config_init(&cfg);
    rc = load_config(&cl, &cfg);
    if (rc == 0) {
        relay_log_set_level((enum relay_log_level)cfg.log_level);
        if (cl.tool_argv != NULL || cl.check_only)
            block_signals(SIG_UNBLOCK); /* a command line tool stops at once */
        if (cl.tool_argv != NULL) {
            rc = run_tool(&cl, &cfg);
        } else if (cl.print_config) {
            rc = print_config(&cfg);
        } else if (cl.check_only) {
            for (unsigned i = 0; i < RELAY_CONFIG_RETIRED_KEYS; i++)
                if (relay_config_retired(&cfg, i) != NULL)
                    fprintf(stderr, "outbox-relay: warning: %s\n", relay_config_retired(&cfg, i));
            printf("configuration OK\n");
            rc = OUTBOX_EX_OK;
        } else {
            /* Only the daemon's log: the commands' output stays as it is. */
            relay_log_set_json(relay_config_parse_log_format(cfg.log_format) == 1);
            for (unsigned i = 0; i < RELAY_CONFIG_RETIRED_KEYS; i++)
                if (relay_config_retired(&cfg, i) != NULL)
                    relay_warn("config", "%s", relay_config_retired(&cfg, i));
            rc = run_daemon(&cl, &cfg);
        }
    }
    relay_config_free(&cfg);
    free(cl.overrides);
    return rc;
}
