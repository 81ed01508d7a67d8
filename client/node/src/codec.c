/* codec.c: the C codec's encoders, for the test of this package against the protocol's
 * vectors (protocol-vectors/, PROTOCOL.md 7): encode(type, args) takes the words of the C
 * test driver's `encode` command (client/c/escrow-c.c), as strings, read by the same file
 * (client/c/vector_args.c), and gives the request frame in hex, so the suite runs every
 * request vector through the encoder this addon sends with. Not part of the package's API
 * (index.ts exports it as `_codec`).
 */
#define _GNU_SOURCE
#include "addon.h"
#include "vector_args.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ARGS 64

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
    int rc = ok ? escrow__vector_encode(&o, count, args, &err) : -2;
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
