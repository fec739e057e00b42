/*
 * PostgreSQL pieces that the daemon and the operator commands share: the hint
 * added to a failed connection's message, and topics as a text[] literal for
 * a query parameter.
 */
#include "common/compat.h"

#include "core/pg.h"

#include <stdio.h>
#include <string.h>

const char *relay_pg_connect_hint(const char *msg)
{
    if (strstr(msg, "certificate verify failed") != NULL)
        return "; the server's certificate is not signed by a CA that sslrootcert names: point "
               "sslrootcert in postgres at the CA that signed it";
    if (strstr(msg, "does not match host name") != NULL)
        return "; with sslmode=verify-full, host in postgres must be a name (or address) the "
               "server's certificate lists";
    if (strstr(msg, "password authentication failed") != NULL)
        return "; check the user and password in postgres (or PGPASSWORD, ~/.pgpass)";
    return "";
}

int relay_pg_text_array(char *out, size_t outlen, const char (*items)[OUTBOX_TOPIC_MAX + 1],
                        size_t n)
{
    size_t len = 0;
    if (outlen < 3)
        return -1;
    out[len++] = '{';
    for (size_t i = 0; i < n; i++) {
        /* Room for a separator, the quotes and the closing brace is checked
         * as we go; an element never writes past outlen - 2. */
        if (i && len < outlen)
            out[len++] = ',';
        if (len < outlen)
            out[len++] = '"';
        for (const char *c = items[i]; *c != '\0' && len < outlen; c++) {
            if ((*c == '"' || *c == '\\') && len + 1 < outlen)
                out[len++] = '\\';
            if (len < outlen)
                out[len++] = *c;
        }
        if (len < outlen)
            out[len++] = '"';
    }
    if (len + 2 > outlen)
        return -1;
    out[len++] = '}';
    out[len] = '\0';
    return 0;
}
