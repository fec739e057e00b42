/*
 * The labels of the failure kinds (relay/fail.h).
 */
#include "common/compat.h"

#include "relay/fail.h"

static const char *const fail_kind_names[RELAY_FAIL_KINDS] = {"redis_connection", "redis_timeout",
                                                              "redis_error",      "redis_reply",
                                                              "redis_replicas",   "postgres"};

const char *relay_fail_kind_name(enum relay_fail_kind kind)
{
    return (unsigned)kind < RELAY_FAIL_KINDS ? fail_kind_names[kind] : "postgres";
}
