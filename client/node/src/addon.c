/* addon.c: the C client's calls as promises, each run off the main thread.
 *
 * Every call that talks to the holder becomes an op: its arguments copied on the main thread
 * (convert.c), the C call made on a thread of libuv's pool (napi_async_work, so the event
 * loop never waits on the holder: a call can take the whole timeout, 5 s by default), and its
 * answer turned into JS and the promise settled back on the main thread. The calls on a
 * fresh connection (status, list, release, update, hand-off, retrieve, reclaim) run side by
 * side; those on a custody go through its queue, one at a time (custody.c), as the C client
 * requires of one custody.
 *
 * The fds: an op takes none of the app's (a deposit's fd is the app's before and after) and
 * gives the app the masters of a retrieve or a reclaim as numbers in the answer. A promise
 * that rejects has left no fd behind: the C client closed what it opened.
 */
#define _GNU_SOURCE
#include "addon.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- ops -------------------------------------------------------------------------------- */

escrow__node_op *escrow__node_op_new(escrow__node_kind kind) {
    escrow__node_op *op = calloc(1, sizeof *op);
    if (op == NULL) return NULL;
    op->kind = kind;
    op->fd = -1;
    return op;
}

void escrow__node_op_free(escrow__node_op *op) {
    if (op == NULL) return;
    free(op->id);
    free(op->label);
    escrow__node_meta_free(&op->meta);
    if (op->rc == ESCROW_OK) {
        if (op->kind == OP_LIST) escrow_sessions_free(op->out.list.items, op->out.list.n);
        if (op->kind == OP_RETRIEVE || op->kind == OP_CUSTODY_RETRIEVE)
            escrow_retrieved_free(&op->out.retrieved);
    }
    if (op->kind == OP_RECLAIM || op->kind == OP_CUSTODY_RECLAIM)
        escrow_reclaim_report_free(&op->out.report);
    free(op);
}

static void execute(napi_env env, void *data) {
    (void)env;
    escrow__node_op *op = data;
    escrow_error *e = &op->err;
    switch (op->kind) {
    case OP_STATUS: op->rc = escrow_status_of(&op->client, &op->out.status, e); break;
    case OP_WELCOME: op->rc = escrow_welcome_of(&op->client, &op->out.welcome, e); break;
    case OP_LIST:
        op->rc = escrow_list(&op->client, op->flag, &op->out.list.items, &op->out.list.n, e);
        break;
    case OP_RELEASE: op->rc = escrow_release(&op->client, op->id, e); break;
    case OP_UPDATE:
        op->rc = escrow_update(&op->client, op->id, op->cols, op->rows,
                               op->meta.given ? op->meta.entries : NULL, op->meta.count, e);
        break;
    case OP_HAND_OFF: op->rc = escrow_hand_off(&op->client, op->id, op->fd, &op->opts, e); break;
    case OP_RETRIEVE: op->rc = escrow_retrieve(&op->client, op->id, &op->out.retrieved, e); break;
    case OP_RECLAIM:
        op->rc = escrow_reclaim_all(&op->client, op->seconds, &op->out.report, e);
        break;
    case OP_REPAINT: op->rc = escrow_repaint(op->fd, e); break;
    default: escrow__node_custody_execute(op); break;
    }
}

napi_value escrow__node_op_value(napi_env env, escrow__node_op *op) {
    napi_value v;
    switch (op->kind) {
    case OP_STATUS: return escrow__node_status(env, &op->out.status);
    case OP_WELCOME: return escrow__node_welcome(env, &op->out.welcome);
    case OP_LIST: return escrow__node_sessions(env, op->out.list.items, op->out.list.n);
    case OP_RETRIEVE:
    case OP_CUSTODY_RETRIEVE: return escrow__node_retrieved(env, &op->out.retrieved);
    case OP_RECLAIM:
    case OP_CUSTODY_RECLAIM: return escrow__node_report(env, &op->out.report);
    default: napi_get_undefined(env, &v); return v;
    }
}

napi_value escrow__node_op_error(napi_env env, escrow__node_op *op) {
    napi_value error = escrow__node_error(env, &op->err);
    /* A reclaim that failed part way still took some sessions: their fds are the app's. */
    if (op->kind == OP_RECLAIM || op->kind == OP_CUSTODY_RECLAIM)
        napi_set_named_property(env, error, "report", escrow__node_report(env, &op->out.report));
    return error;
}

static void complete(napi_env env, napi_status status, void *data) {
    escrow__node_op *op = data;
    napi_delete_async_work(env, op->work);
    op->work = NULL;
    if (status == napi_cancelled && op->rc == ESCROW_OK)
        escrow__fail(&op->err, op->rc = ESCROW_SYSTEM, 0, op->id, "the call was cancelled");
    if (op->custody != NULL) {
        escrow__node_custody_complete(env, op); /* settles it, frees it, runs the next */
        return;
    }
    napi_handle_scope scope;
    napi_open_handle_scope(env, &scope);
    if (op->rc == ESCROW_OK) napi_resolve_deferred(env, op->deferred, escrow__node_op_value(env, op));
    else napi_reject_deferred(env, op->deferred, escrow__node_op_error(env, op));
    napi_close_handle_scope(env, scope);
    escrow__node_op_free(op);
}

int escrow__node_op_queue(napi_env env, escrow__node_op *op) {
    napi_value name;
    napi_create_string_utf8(env, "escrow", NAPI_AUTO_LENGTH, &name);
    if (napi_create_async_work(env, NULL, name, execute, complete, op, &op->work) != napi_ok)
        return -1;
    if (napi_queue_async_work(env, op->work) != napi_ok) {
        napi_delete_async_work(env, op->work);
        op->work = NULL;
        return -1;
    }
    return 0;
}

/* ---- the calls on a fresh connection ---------------------------------------------------- */

int escrow__node_read_client(napi_env env, napi_value v, escrow_client *c) {
    escrow_error err;
    int has_socket = 0;
    double timeout = 0;
    char *owner = escrow__node_string(env, escrow__node_get(env, v, "owner"), 0, NULL);
    if (owner == NULL) return -1;
    char *socket = escrow__node_string(env, escrow__node_get(env, v, "socket"), 1, &has_socket);
    bool pending = false;
    napi_is_exception_pending(env, &pending);
    if (pending || escrow__node_double(env, escrow__node_get(env, v, "timeout"), 0, &timeout) != 0) {
        free(owner);
        free(socket);
        return -1;
    }
    escrow_code rc = escrow_client_init(c, owner, socket, timeout, &err);
    free(owner);
    free(socket);
    if (rc != ESCROW_OK) {
        napi_throw(env, escrow__node_error(env, &err));
        return -1;
    }
    return 0;
}

/* client(settings): the settings as escrow_client_init takes them (the socket resolved). */
static napi_value check_client(napi_env env, napi_callback_info info) {
    size_t argc = 1;
    napi_value argv[1], o, v;
    escrow_client c;
    NAPI_OK(env, napi_get_cb_info(env, info, &argc, argv, NULL, NULL), NULL);
    if (escrow__node_read_client(env, argc > 0 ? argv[0] : NULL, &c) != 0) return NULL;
    napi_create_object(env, &o);
    napi_create_string_utf8(env, c.owner, NAPI_AUTO_LENGTH, &v);
    napi_set_named_property(env, o, "owner", v);
    napi_create_string_utf8(env, c.socket_path, NAPI_AUTO_LENGTH, &v);
    napi_set_named_property(env, o, "socket", v);
    napi_create_double(env, c.timeout, &v);
    napi_set_named_property(env, o, "timeout", v);
    return o;
}

/* call(kind, settings, ...args) -> Promise */
static napi_value call(napi_env env, napi_callback_info info) {
    size_t argc = 6;
    napi_value argv[6] = {0}, promise;
    int32_t kind;
    NAPI_OK(env, napi_get_cb_info(env, info, &argc, argv, NULL, NULL), NULL);
    NAPI_OK(env, napi_get_value_int32(env, argv[0], &kind), NULL);
    if (kind < OP_STATUS || kind > OP_REPAINT) {
        napi_throw_range_error(env, NULL, "not a call");
        return NULL;
    }
    escrow__node_op *op = escrow__node_op_new((escrow__node_kind)kind);
    if (op == NULL) return escrow__node_throw(env, ESCROW_SYSTEM, "out of memory");
    int bad = kind != OP_REPAINT && escrow__node_read_client(env, argv[1], &op->client) != 0;
    int64_t fd = -1;
    if (!bad) switch (kind) {
    case OP_LIST: bad = escrow__node_bool(env, argv[2], 0, &op->flag) != 0; break;
    case OP_RELEASE:
    case OP_RETRIEVE: bad = (op->id = escrow__node_string(env, argv[2], 0, NULL)) == NULL; break;
    case OP_UPDATE:
        bad = (op->id = escrow__node_string(env, argv[2], 0, NULL)) == NULL ||
              escrow__node_int64(env, argv[3], -1, &op->cols) != 0 ||
              escrow__node_int64(env, argv[4], -1, &op->rows) != 0 ||
              escrow__node_read_meta(env, argv[5], &op->meta) != 0;
        break;
    case OP_HAND_OFF:
        bad = (op->id = escrow__node_string(env, argv[2], 0, NULL)) == NULL ||
              escrow__node_int64(env, argv[3], -1, &fd) != 0 ||
              escrow__node_read_opts(env, argv[4], &op->opts, &op->label, &op->meta) != 0;
        op->fd = (int)fd;
        break;
    case OP_RECLAIM: bad = escrow__node_double(env, argv[2], 8.0, &op->seconds) != 0; break;
    case OP_REPAINT:
        bad = escrow__node_int64(env, argv[1], -1, &fd) != 0;
        op->fd = (int)fd;
        break;
    default: break;
    }
    if (bad || napi_create_promise(env, &op->deferred, &promise) != napi_ok ||
        escrow__node_op_queue(env, op) != 0) {
        escrow__node_op_free(op);
        return NULL;
    }
    return promise;
}

/* ---- the module ------------------------------------------------------------------------- */

static void set_fn(napi_env env, napi_value exports, const char *name, napi_callback fn) {
    napi_value f;
    napi_create_function(env, name, NAPI_AUTO_LENGTH, fn, NULL, &f);
    napi_set_named_property(env, exports, name, f);
}

static napi_value init(napi_env env, napi_value exports) {
    set_fn(env, exports, "client", check_client);
    set_fn(env, exports, "call", call);
    set_fn(env, exports, "custodyOpen", escrow__node_custody_open);
    set_fn(env, exports, "custodyCall", escrow__node_custody_call);
    set_fn(env, exports, "custodySync", escrow__node_custody_sync);
    set_fn(env, exports, "encode", escrow__node_encode);
    set_fn(env, exports, "openpty", escrow__node_openpty);
    return exports;
}

NAPI_MODULE(escrow, init)
