/* addon.h: what the addon's files share. The addon is the C client (client/c/) under Node-API
 * (version 8): addon.c registers the calls and runs each off the main thread; convert.c turns
 * JS values into the C client's arguments and its answers into JS values; custody.c is a
 * custody on the event loop, its call queue, with custody_watch.c its watcher and
 * custody_reads.c its sessions' reads (custody.h); codec.c
 * is the codec's test entry; pty.c opens a terminal for the example app.
 *
 * Every file of the C client's library is built in (build.js), and client/c/vector_args.c
 * for codec.c.
 *
 * Every external name here starts `escrow__node_`, as the C client's own start `escrow__`.
 */
#ifndef ESCROW_NODE_ADDON_H
#define ESCROW_NODE_ADDON_H

#include "escrow_internal.h"

#define NAPI_VERSION 8
#include <node_api.h>
#include <uv.h>

/* A failed napi_* call: throw what Node said, and leave the function with `ret`. */
#define NAPI_OK(env, call, ret)                                                               \
    do {                                                                                      \
        if ((call) != napi_ok) {                                                              \
            escrow__node_throw_napi(env);                                                     \
            return ret;                                                                       \
        }                                                                                     \
    } while (0)

/* ---- convert.c -------------------------------------------------------------------------- */

void escrow__node_throw_napi(napi_env env);
/* A JS Error carrying the escrow_error: message, code (its name), id (or null), errno. */
napi_value escrow__node_error(napi_env env, const escrow_error *e);
napi_value escrow__node_throw(napi_env env, escrow_code code, const char *fmt, ...);
/* Copy argument `v` into a string on the heap (NULL and a thrown TypeError if it is not a
 * string); `optional`: null or undefined give NULL without a throw (*present 0). */
char *escrow__node_string(napi_env env, napi_value v, int optional, int *present);
int escrow__node_int64(napi_env env, napi_value v, int64_t dflt, int64_t *out);
int escrow__node_double(napi_env env, napi_value v, double dflt, double *out);
int escrow__node_bool(napi_env env, napi_value v, int dflt, int *out);
napi_value escrow__node_get(napi_env env, napi_value object, const char *key);

/* Deposit options and meta maps, read into storage the op owns. */
typedef struct escrow__node_meta {
    escrow_meta entries[ESCROW_META_MAX];
    char *strings[2 * ESCROW_META_MAX];
    size_t count;
    int given; /* 0: null or undefined (unchanged) */
} escrow__node_meta;

int escrow__node_read_meta(napi_env env, napi_value v, escrow__node_meta *m);
void escrow__node_meta_free(escrow__node_meta *m);
int escrow__node_read_opts(napi_env env, napi_value v, escrow_deposit_opts *o, char **label,
                           escrow__node_meta *m);

napi_value escrow__node_session(napi_env env, const escrow_session *s);
napi_value escrow__node_sessions(napi_env env, const escrow_session *s, size_t n);
napi_value escrow__node_status(napi_env env, const escrow_status *s);
napi_value escrow__node_welcome(napi_env env, const escrow_welcome *w);
/* The replay is copied into a Buffer; `r` is freed by the caller. */
napi_value escrow__node_retrieved(napi_env env, const escrow_retrieved *r);
napi_value escrow__node_report(napi_env env, const escrow_reclaim_report *r);

/* ---- addon.c: calls off the main thread ------------------------------------------------- */

typedef struct escrow__node_custody escrow__node_custody;

typedef enum escrow__node_kind {
    OP_STATUS, OP_WELCOME, OP_LIST, OP_RELEASE, OP_UPDATE, OP_HAND_OFF, OP_RETRIEVE,
    OP_RECLAIM, OP_REPAINT,
    /* on a custody, one at a time (custody.c's queue) */
    OP_CUSTODY_OPEN, OP_DEPOSIT, OP_CUSTODY_RELEASE, OP_CUSTODY_UPDATE, OP_CUSTODY_RETRIEVE,
    OP_CUSTODY_RECLAIM, OP_CUSTODY_CLOSE,
    /* the watcher's own, never from JS */
    OP_RESUME, OP_CHECK
} escrow__node_kind;

typedef struct escrow__node_op {
    escrow__node_kind kind;
    escrow_client client;
    escrow__node_custody *custody;     /* the custody ops' */
    struct escrow__node_op *next;      /* in the custody's queue */
    napi_deferred deferred;            /* NULL: an op of the watcher's (resume) */
    napi_async_work work;
    /* in */
    char *id, *label;
    int fd, flag;
    int64_t cols, rows;
    double seconds;
    escrow__node_meta meta;
    escrow_deposit_opts opts;
    int was_kept;                      /* a deposit's id was held here before it ran */
    /* out */
    escrow_code rc;
    escrow_error err;
    union {
        escrow_status status;
        escrow_welcome welcome;
        struct { escrow_session *items; size_t n; } list;
        escrow_retrieved retrieved;
        escrow_reclaim_report report;
    } out;
} escrow__node_op;

escrow__node_op *escrow__node_op_new(escrow__node_kind kind);
void escrow__node_op_free(escrow__node_op *op);
/* Queue op's work (execute off the main thread, then complete on it). */
int escrow__node_op_queue(napi_env env, escrow__node_op *op);
/* The op's answer as a JS value (its error is handled by the caller). */
napi_value escrow__node_op_value(napi_env env, escrow__node_op *op);
/* The op's error as a JS Error (a failed reclaim's carries the report: its fds). */
napi_value escrow__node_op_error(napi_env env, escrow__node_op *op);

/* {owner, socket, timeout}: the client's settings, checked by escrow_client_init (0; else
 * -1, a JS error thrown). */
int escrow__node_read_client(napi_env env, napi_value v, escrow_client *c);

/* ---- custody.c: a custody on the event loop --------------------------------------------- */

napi_value escrow__node_custody_open(napi_env env, napi_callback_info info);
napi_value escrow__node_custody_call(napi_env env, napi_callback_info info);
napi_value escrow__node_custody_sync(napi_env env, napi_callback_info info);
void escrow__node_custody_execute(escrow__node_op *op);
void escrow__node_custody_complete(napi_env env, escrow__node_op *op);

/* ---- codec.c ---------------------------------------------------------------------------- */

napi_value escrow__node_encode(napi_env env, napi_callback_info info);

/* ---- pty.c ------------------------------------------------------------------------------ */

napi_value escrow__node_openpty(napi_env env, napi_callback_info info);

#endif
