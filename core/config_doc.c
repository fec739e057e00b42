/*
 * The configuration shown: every key with its effective value
 * (--print-config's dump, which reads back as a configuration file), and the
 * key table itself, for --help and for the documents generated at build time
 * (man/docgen.c: the manual page outbox-relay.conf(5) and the example
 * configuration), so that they list exactly the keys there are.
 */
#include "common/compat.h"

#include "core/config.h"

#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "core/config_table.h"
#include "core/text.h"

static const char *const cfg_level_names[] = {"debug", "info", "warning", "error"};

/* A line of the dump: the name, " = ", the value quoted with every byte
 * escaped at worst, the newline. */
_Static_assert(RELAY_CONFIG_DUMP_MAX >= CFG_KEYS_MAX * (CFG_NAME_MAX + 2 * CFG_VALUE_MAX + 8),
               "RELAY_CONFIG_DUMP_MAX must hold the longest dump");

/* Appends s double-quoted, in the file syntax (\" and \\ escaped). */
static void out_quoted(struct relay_text_out *o, const char *s)
{
    relay_text_out_putn(o, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            relay_text_out_putn(o, "\\", 1);
        relay_text_out_putn(o, (c < 0x20 || c == 0x7f) ? "?" : s, 1);
    }
    relay_text_out_putn(o, "\"", 1);
}

/* The effective value of k as the file syntax would spell it. */
static void config_value_text(const struct relay_config *cfg, const struct cfg_key *k,
                              struct relay_text_out *o)
{
    char buf[CFG_VALUE_MAX + 1];
    int lvl;

    switch (k->type) {
    case CFG_STRING:
    case CFG_SECRET_STRING: {
        const char *s = *cfg_cstr_field(cfg, k);
        if (s == NULL)
            s = "";
        if (k->flags & CFG_OPAQUE)
            s = s[0] != '\0' ? "***" : "";
        else if (k->type == CFG_SECRET_STRING) {
            relay_config_redact(s, buf, sizeof(buf));
            s = buf;
        }
        out_quoted(o, s);
        return;
    }
    case CFG_UINT:
        relay_text_out_printf(o, "%lu", (unsigned long)*cfg_cu32_field(cfg, k));
        return;
    case CFG_DURATION:
        relay_config_format_duration(*cfg_cu32_field(cfg, k), buf, sizeof(buf));
        relay_text_out_puts(o, buf);
        return;
    case CFG_BOOL:
        relay_text_out_puts(o, *cfg_cint_field(cfg, k) ? "on" : "off");
        return;
    case CFG_LOGLEVEL:
        lvl = *cfg_cint_field(cfg, k);
        relay_text_out_puts(o, lvl >= 0 && (size_t)lvl < OUTBOX_ARRAY_LEN(cfg_level_names)
                                   ? cfg_level_names[lvl]
                                   : "?");
        return;
    }
}

void relay_config_dump(const struct relay_config *cfg, char *out, size_t outlen)
{
    struct relay_text_out o;
    size_t i;

    relay_text_out_init(&o, out, outlen);
    for (i = 0; i < relay_config_nkeys; i++) {
        relay_text_out_printf(&o, "%s = ", relay_config_keys[i].name);
        config_value_text(cfg, &relay_config_keys[i], &o);
        relay_text_out_puts(&o, "\n");
    }
}

void relay_config_help(char *out, size_t outlen)
{
    struct relay_text_out o;
    size_t i;

    relay_text_out_init(&o, out, outlen);
    for (i = 0; i < relay_config_nkeys; i++) {
        const struct cfg_key *k = &relay_config_keys[i];
        char env[CFG_NAME_MAX + 32], flag[CFG_NAME_MAX + 32], lo[32], hi[32];

        relay_config_env_name(k->name, env, sizeof(env));
        relay_config_flag_name(k->name, flag, sizeof(flag));
        relay_text_out_printf(&o, "  %s", k->name);
        switch (k->type) {
        case CFG_STRING:
        case CFG_SECRET_STRING:
            if (k->flags & CFG_REQUIRED)
                relay_text_out_puts(&o, " (required)");
            else
                relay_text_out_printf(&o, " (default \"%s\")", k->defval);
            break;
        case CFG_UINT:
            relay_text_out_printf(&o, " (default %s, %lu..%lu)", k->defval, (unsigned long)k->min,
                                  (unsigned long)k->max);
            break;
        case CFG_DURATION:
            relay_config_format_duration((uint32_t)k->min, lo, sizeof(lo));
            relay_config_format_duration((uint32_t)k->max, hi, sizeof(hi));
            relay_text_out_printf(&o, " (default %s, %s..%s)", k->defval, lo, hi);
            break;
        case CFG_BOOL:
            relay_text_out_printf(&o, " (default %s, on|off)", k->defval);
            break;
        case CFG_LOGLEVEL:
            relay_text_out_printf(&o, " (default %s, debug|info|warning|error)", k->defval);
            break;
        }
        relay_text_out_printf(&o, "\n      %s\n      %s, %s%s\n", k->help, env, flag,
                              (k->flags & CFG_RELOADABLE) ? "; reloaded on SIGHUP" : "");
    }
}

/* Appends s as roff text: backslashes and hyphens escaped, and a line never
 * starts with a control character. */
static void out_roff(struct relay_text_out *o, const char *s)
{
    if (*s == '.' || *s == '\'')
        relay_text_out_puts(o, "\\&");
    for (; *s; s++) {
        if (*s == '\\')
            relay_text_out_puts(o, "\\e");
        else if (*s == '-')
            relay_text_out_puts(o, "\\-");
        else
            relay_text_out_putn(o, s, 1);
    }
}

/* Appends text as "# " comment lines of at most 78 columns, broken at spaces. */
static void out_comment(struct relay_text_out *o, const char *text)
{
    size_t col = 0;

    while (*text) {
        size_t n = strcspn(text, " ");
        if (col > 0 && col + 1 + n > 78) {
            relay_text_out_puts(o, "\n");
            col = 0;
        }
        relay_text_out_puts(o, col == 0 ? "# " : " ");
        relay_text_out_putn(o, text, n);
        col += (col == 0 ? 2 : 1) + n;
        text += n;
        text += strspn(text, " ");
    }
    relay_text_out_puts(o, "\n");
}

/* The values k accepts, as a phrase: "1 to 10000", "on or off". */
static void config_range_text(const struct cfg_key *k, char *out, size_t outlen)
{
    char lo[32], hi[32];

    switch (k->type) {
    case CFG_STRING:
    case CFG_SECRET_STRING:
        snprintf(out, outlen, "text");
        return;
    case CFG_UINT:
        snprintf(out, outlen, "%lu to %lu", (unsigned long)k->min, (unsigned long)k->max);
        return;
    case CFG_DURATION:
        relay_config_format_duration((uint32_t)k->min, lo, sizeof(lo));
        relay_config_format_duration((uint32_t)k->max, hi, sizeof(hi));
        snprintf(out, outlen, "a duration from %s to %s", lo, hi);
        return;
    case CFG_BOOL:
        snprintf(out, outlen, "on or off");
        return;
    case CFG_LOGLEVEL:
        snprintf(out, outlen, "debug, info, warning or error");
        return;
    }
    snprintf(out, outlen, "?");
}

void relay_config_reference(enum relay_config_format format, char *out, size_t outlen)
{
    struct relay_text_out o;
    size_t i;

    relay_text_out_init(&o, out, outlen);
    for (i = 0; i < relay_config_nkeys; i++) {
        const struct cfg_key *k = &relay_config_keys[i];
        int text = k->type == CFG_STRING || k->type == CFG_SECRET_STRING;
        int required = (k->flags & CFG_REQUIRED) != 0;
        int reload = (k->flags & CFG_RELOADABLE) != 0;
        char env[CFG_NAME_MAX + 32], flag[CFG_NAME_MAX + 32], range[96];

        relay_config_env_name(k->name, env, sizeof(env));
        relay_config_flag_name(k->name, flag, sizeof(flag));
        config_range_text(k, range, sizeof(range));
        if (format == RELAY_CONFIG_FORMAT_ROFF) {
            relay_text_out_puts(&o, ".TP\n.B ");
            out_roff(&o, k->name);
            relay_text_out_puts(&o, "\n");
            out_roff(&o, k->help);
            relay_text_out_puts(&o, ".\n.br\n");
            if (required)
                relay_text_out_puts(&o, "Required");
            else if (text && k->defval[0] == '\0')
                relay_text_out_puts(&o, "Default: empty");
            else {
                relay_text_out_puts(&o, "Default: ");
                out_roff(&o, k->defval);
            }
            relay_text_out_puts(&o, "; ");
            out_roff(&o, range);
            relay_text_out_puts(&o, ".\n.br\nEnvironment: ");
            out_roff(&o, env);
            relay_text_out_puts(&o, "; command line: ");
            out_roff(&o, flag);
            relay_text_out_puts(&o, reload ? "; reloaded on SIGHUP.\n" : ".\n");
        } else {
            char line[1024];
            snprintf(line, sizeof(line), "%s: %s.", k->name, k->help);
            relay_text_out_puts(&o, "\n");
            out_comment(&o, line);
            snprintf(line, sizeof(line), "%s%s; %s, %s%s.", required ? "Required; " : "", range,
                     env, flag, reload ? "; reloaded on SIGHUP" : "");
            out_comment(&o, line);
            if (text)
                relay_text_out_printf(&o, "#%s = \"%s\"\n", k->name, k->defval);
            else
                relay_text_out_printf(&o, "#%s = %s\n", k->name, k->defval);
        }
    }
}
