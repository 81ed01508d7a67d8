/* codec.c: the C codec's encoders, for the test of this package against the protocol's
 * vectors (protocol-vectors/, PROTOCOL.md 7): encode(type, args) takes the arguments of the
 * C test driver's `encode` command (client/c/escrow-c.c), as strings, and gives the request
 * frame in hex, so the suite runs every request vector through the encoder this addon sends
 * with. Not part of the package's API (index.ts exports it as `_codec`).
 */
#define _GNU_SOURCE
#include "addon.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ARGS 64

static int parse_bool(const char *s, int *v) {
    if (strcmp(s, "true") == 0) return *v = 1, 0;
    if (strcmp(s, "false") == 0) return *v = 0, 0;
    return -1;
}

static int parse_dim(const char *s, int64_t *v) { /* a number, or "-": nil (-1) */
    char *end;
    if (strcmp(s, "-") == 0) return *v = -1, 0;
    errno = 0;
    long long n = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != 0 || n < 0) return -1;
    *v = n;
    return 0;
}

/* KEY=VALUE, split at the first '=' (in place). */
static int parse_pairs(int argc, char **argv, const char **keys, const char **values,
                       size_t max, size_t *count) {
    *count = 0;
    for (int i = 0; i < argc; i++) {
        char *eq = strchr(argv[i], '=');
        if (eq == NULL || *count == max) return -1;
        *eq = 0;
        keys[*count] = argv[i];
        values[(*count)++] = eq + 1;
    }
    return 0;
}

static int parse_meta(int argc, char **argv, escrow_meta *meta, size_t *count) {
    const char *keys[ESCROW_META_MAX], *values[ESCROW_META_MAX];
    if (parse_pairs(argc, argv, keys, values, ESCROW_META_MAX, count) != 0) return -1;
    for (size_t i = 0; i < *count; i++) meta[i] = (escrow_meta){keys[i], values[i]};
    return 0;
}

/* -1: not arguments the driver takes; else the encoder's code. */
static int encode(mp_out *o, int argc, char **argv, escrow_error *err) {
    const char *type = argv[0];
    int keep = 0, journal = 0, replay_file = 0;
    if (strcmp(type, "hello") == 0 && argc == 4) {
        escrow_client c;
        memset(&c, 0, sizeof c);
        snprintf(c.owner, sizeof c.owner, "%s", argv[1]);
        snprintf(c.client_name, sizeof c.client_name, "%s", argv[2]);
        c.timeout = atof(argv[3]);
        return (int)escrow__encode_hello(o, &c, err);
    }
    if (strcmp(type, "deposit") == 0 && argc >= 7) {
        escrow_meta meta[ESCROW_META_MAX];
        escrow_deposit_opts opts = {argv[2], atoll(argv[3]), atoll(argv[4]), atoll(argv[5]),
                                    meta, 0, 0};
        if (parse_bool(argv[6], &journal) != 0 ||
            parse_meta(argc - 7, argv + 7, meta, &opts.meta_count) != 0)
            return -1;
        return (int)escrow__encode_deposit(o, argv[1], &opts, journal, err);
    }
    if (strcmp(type, "release") == 0 && argc == 2) return (int)escrow__encode_id(o, type, argv[1], err);
    if (strcmp(type, "retrieve") == 0 && argc == 5) {
        if (parse_bool(argv[2], &keep) != 0 || parse_bool(argv[3], &journal) != 0 ||
            parse_bool(argv[4], &replay_file) != 0)
            return -1;
        return (int)escrow__encode_retrieve(o, argv[1], keep, journal, replay_file, err);
    }
    if (strcmp(type, "retrieve_many") == 0 && argc >= 5) {
        if (parse_bool(argv[1], &keep) != 0 || parse_bool(argv[2], &journal) != 0 ||
            parse_bool(argv[3], &replay_file) != 0)
            return -1;
        return (int)escrow__encode_retrieve_many(o, (const char *const *)argv + 4,
                                                 (size_t)argc - 4, keep, journal, replay_file,
                                                 err);
    }
    if (strcmp(type, "ack") == 0 && argc == 4) {
        if (parse_bool(argv[3], &keep) != 0) return -1;
        return (int)escrow__encode_ack(o, argv[1], argv[2], keep, err);
    }
    if (strcmp(type, "ack_many") == 0 && argc >= 3) {
        const char *ids[MAX_ARGS], *handoff_ids[MAX_ARGS];
        size_t n = 0;
        if (parse_bool(argv[1], &keep) != 0 ||
            parse_pairs(argc - 2, argv + 2, ids, handoff_ids, MAX_ARGS, &n) != 0)
            return -1;
        return (int)escrow__encode_ack_many(o, ids, handoff_ids, n, keep, err);
    }
    if (strcmp(type, "update") == 0 && argc >= 4) {
        int64_t cols, rows;
        escrow_meta meta[ESCROW_META_MAX];
        size_t count = 0;
        int given = argc > 4;
        if (parse_dim(argv[2], &cols) != 0 || parse_dim(argv[3], &rows) != 0) return -1;
        if (!(argc == 5 && strcmp(argv[4], "{}") == 0) &&
            parse_meta(argc - 4, argv + 4, meta, &count) != 0)
            return -1;
        return (int)escrow__encode_update(o, argv[1], cols, rows, given ? meta : NULL, count, err);
    }
    if (strcmp(type, "list") == 0 && argc == 2) {
        if (parse_bool(argv[1], &keep) != 0) return -1;
        return (int)escrow__encode_list(o, keep, err);
    }
    if (strcmp(type, "status") == 0 && argc == 1) return (int)escrow__encode_status(o, err);
    return -1;
}

/* encode(type, args: string[]) -> hex string */
napi_value escrow__node_encode(napi_env env, napi_callback_info info) {
    size_t argc = 2;
    napi_value argv[2] = {0}, result = NULL;
    uint32_t n = 0;
    char *args[MAX_ARGS + 1] = {0};
    NAPI_OK(env, napi_get_cb_info(env, info, &argc, argv, NULL, NULL), NULL);
    NAPI_OK(env, napi_get_array_length(env, argv[1], &n), NULL);
    if (n >= MAX_ARGS) {
        napi_throw_range_error(env, NULL, "too many arguments");
        return NULL;
    }
    int count = 0, ok = (args[count++] = escrow__node_string(env, argv[0], 0, NULL)) != NULL;
    for (uint32_t i = 0; ok && i < n; i++) {
        napi_value v;
        napi_get_element(env, argv[1], i, &v);
        ok = (args[count++] = escrow__node_string(env, v, 0, NULL)) != NULL;
    }
    mp_out o = {0};
    escrow_error err;
    memset(&err, 0, sizeof err);
    int rc = ok ? encode(&o, count, args, &err) : -2;
    if (rc == -1) {
        napi_throw_type_error(env, NULL, "not arguments escrow-c's encode takes");
    } else if (rc > 0) {
        napi_throw(env, escrow__node_error(env, &err));
    } else if (rc == 0) {
        char *hex = malloc(2 * o.len + 1);
        if (hex != NULL) {
            for (size_t i = 0; i < o.len; i++) snprintf(hex + 2 * i, 3, "%02x", o.data[i]);
            napi_create_string_utf8(env, hex, 2 * o.len, &result);
            free(hex);
        }
    }
    free(o.data);
    for (int i = 0; i < count; i++) free(args[i]);
    return result;
}
