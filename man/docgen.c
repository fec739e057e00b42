/*
 * relay-docgen: writes the generated documents of the configuration, so they
 * list exactly the keys of core/config.c's table. Run at build time:
 *
 *   relay-docgen roff|file TEMPLATE OUT
 *
 * copies TEMPLATE to OUT with the line "@RELAY_CONFIG_KEYS@" replaced by the
 * key table, as manual page entries (roff) or as a configuration file with
 * every key commented out at its default (file).
 */
#include "common/compat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"

#define DOCGEN_PLACEHOLDER "@RELAY_CONFIG_KEYS@"
#define DOCGEN_TABLE_MAX (256 * 1024)

int main(int argc, char **argv)
{
    enum relay_config_format format;
    char line[4096];
    char *table;
    FILE *in, *out;
    int placed = 0, rc = 0;

    if (argc != 4 || (strcmp(argv[1], "roff") != 0 && strcmp(argv[1], "file") != 0)) {
        fprintf(stderr, "usage: relay-docgen roff|file TEMPLATE OUT\n");
        return 64;
    }
    format = strcmp(argv[1], "roff") == 0 ? RELAY_CONFIG_FORMAT_ROFF : RELAY_CONFIG_FORMAT_FILE;
    table = malloc(DOCGEN_TABLE_MAX);
    if (table == NULL)
        return 71;
    relay_config_reference(format, table, DOCGEN_TABLE_MAX);
    if (strlen(table) + 1 >= DOCGEN_TABLE_MAX) {
        fprintf(stderr, "relay-docgen: the key table does not fit in %d bytes\n", DOCGEN_TABLE_MAX);
        free(table);
        return 70;
    }
    in = fopen(argv[2], "r");
    if (in == NULL) {
        perror(argv[2]);
        free(table);
        return 66;
    }
    out = fopen(argv[3], "w");
    if (out == NULL) {
        perror(argv[3]);
        fclose(in);
        free(table);
        return 73;
    }
    while (fgets(line, sizeof(line), in) != NULL) {
        if (strcmp(line, DOCGEN_PLACEHOLDER "\n") == 0) {
            fputs(table, out);
            placed++;
        } else {
            fputs(line, out);
        }
    }
    if (ferror(in) || placed != 1) {
        fprintf(stderr, "relay-docgen: %s: expected one line \"%s\"\n", argv[2],
                DOCGEN_PLACEHOLDER);
        rc = 65;
    }
    fclose(in);
    if (fclose(out) != 0) {
        perror(argv[3]);
        rc = 74;
    }
    if (rc != 0)
        remove(argv[3]);
    free(table);
    return rc;
}
