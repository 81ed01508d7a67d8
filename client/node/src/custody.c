/* custody.c: a custody on Node's event loop, its call queue and its calls from JS
 * (PROTOCOL.md 10.2).
 *
 * One call at a time: the C client lets one thread at a time use a custody, so its calls
 * (deposit, release, update, retrieve into custody, reclaim, close, and the watcher's resume)
 * wait in a queue, and each runs off the main thread only when the one before it is done.
 * While one runs, nothing on the main thread touches the custody: the watcher
 * (custody_watch.c) and the reads (custody_reads.c) are paused, and start again as soon as
 * the queue is empty. A call waits at most the client's timeout for the holder, so the
 * reads pause for no longer than that, plus the calls queued before it.
 *
 * The fds: the custody's own (its socket, the kept duplicates) are the C client's, closed by
 * escrow_custody_close; the masters are the app's.
 */
#define _GNU_SOURCE
#include "custody.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void escrow__node_free_handle(uv_handle_t *h) { free(h); }

void escrow__node_custody_emit(escrow__node_custody *c, const char *event, size_t argc,
                               napi_value *args) {
    napi_env env = c->env;
    napi_value fn, recv, argv[3], result;
    if (c->emit == NULL || napi_get_reference_value(env, c->emit, &fn) != napi_ok || fn == NULL)
        return;
    napi_create_string_utf8(env, event, NAPI_AUTO_LENGTH, &argv[0]);
    for (size_t i = 0; i < argc && i < 2; i++) argv[i + 1] = args[i];
    napi_get_global(env, &recv); /* napi_make_callback takes an object for `this` */
    if (napi_make_callback(env, c->context, recv, fn, argc + 1, argv, &result) != napi_ok) {
        napi_value exception;
        if (napi_get_and_clear_last_exception(env, &exception) == napi_ok)
            napi_fatal_exception(env, exception); /* a listener threw: as any callback's throw */
    }
}

/* The queue is empty: watch the custody's fd (a new one after a resume) and read again. */
static void idle(escrow__node_custody *c) {
    if (c->closing || !c->opened) return;
    escrow__node_watch_start(c);
    escrow__node_reads_start(c);
}

/* ---- the queue -------------------------------------------------------------------------- */

static void start_next(escrow__node_custody *c) {
    while (!c->busy && c->head != NULL) {
        escrow__node_op *op = c->head;
        c->head = op->next;
        if (c->head == NULL) c->tail = NULL;
        op->next = NULL;
        /* Closed meanwhile, or a call found the holder back, or a call is owed its answer on
         * an open connection (the watch brings it): a resume would only wait for it. */
        if ((op->kind == OP_RESUME &&
             (c->closing || !c->lapsed || escrow__node_watch_owed(c))) ||
            (op->kind == OP_CHECK && c->closing)) {
            escrow__node_op_free(op);
            continue;
        }
        c->busy = 1;
        escrow__node_watch_pause(c);
        escrow__node_reads_pause(c);
        if (escrow__node_op_queue(c->env, op) != 0) {
            c->busy = 0;
            escrow__fail(&op->err, op->rc = ESCROW_SYSTEM, 0, op->id, "napi_queue_async_work");
            escrow__node_custody_complete(c->env, op);
            return;
        }
    }
    if (!c->busy) idle(c);
}

void escrow__node_custody_enqueue(escrow__node_custody *c, escrow__node_op *op) {
    if (c->tail != NULL) c->tail->next = op;
    else c->head = op;
    c->tail = op;
    start_next(c);
}

void escrow__node_custody_execute(escrow__node_op *op) {
    escrow__node_custody *c = op->custody;
    escrow_custody *cu = &c->cu;
    escrow_error *e = &op->err;
    switch (op->kind) {
    case OP_CUSTODY_OPEN: op->rc = escrow_custody_open(&c->client, cu, e); break;
    case OP_DEPOSIT:
        op->was_kept = escrow__custody_keeps(cu, op->id);
        op->rc = escrow_deposit(cu, op->id, op->fd, &op->opts, e);
        break;
    case OP_CUSTODY_RELEASE: op->rc = escrow_custody_release(cu, op->id, e); break;
    case OP_CUSTODY_UPDATE:
        op->rc = escrow_custody_update(cu, op->id, op->cols, op->rows,
                                       op->meta.given ? op->meta.entries : NULL, op->meta.count,
                                       e);
        break;
    case OP_CUSTODY_CLOSE:
        /* Closed either way; a close that could not confirm it (a lapsed custody, no holder
         * that says it has each session) must not look like one that did. */
        if ((op->rc = escrow_custody_close(cu)) != ESCROW_OK)
            escrow__fail(e, op->rc, 0, NULL,
                         "custody ended unconfirmed: sessions may be held by nobody (no holder "
                         "confirmed within the timeout that each is draining)");
        break;
    case OP_CUSTODY_RETRIEVE:
        op->rc = escrow_custody_retrieve(cu, op->id, op->flag, &op->out.retrieved, e);
        break;
    case OP_RESUME: op->rc = escrow_custody_resume(cu, e); break;
    case OP_CHECK: op->rc = escrow_custody_check(cu, e); break; /* a late answer: may wait */
    case OP_CUSTODY_RECLAIM:
        op->rc = escrow_custody_reclaim_all(cu, op->flag, op->seconds, &op->out.report, e);
        break;
    default: op->rc = escrow__fail(e, ESCROW_CONFIG, 0, NULL, "not a custody call"); break;
    }
}

static void closed(escrow__node_custody *c) {
    c->closed = c->closing = 1;
    escrow__node_watch_close(c);
    while (c->n > 0) escrow__node_session_remove(c, c->sessions[0]->id);
    escrow__node_records_free(c);
    escrow__node_reads_close(c);
    if (c->emit != NULL) napi_delete_reference(c->env, c->emit);
    c->emit = NULL;
    napi_async_destroy(c->env, c->context);
    c->context = NULL;
    napi_delete_reference(c->env, c->self); /* the handle may be collected from now on */
    c->self = NULL;
}

/* A deposit that failed but is kept (no answer it could believe: whether the holder has it
 * is not known): 'indeterminate', as the Python client's DepositIndeterminate, with what the
 * C client said as `cause`. The next resume settles it; release gives it up. */
static napi_value indeterminate(napi_env env, escrow__node_op *op) {
    napi_value cause = escrow__node_error(env, &op->err), error;
    escrow_error e = op->err;
    snprintf(e.code_name, sizeof e.code_name, "indeterminate");
    snprintf(e.message, sizeof e.message,
             "the deposit of %.128s got no answer to believe: the custody keeps it and a "
             "resume settles it (%.200s)", op->id, op->err.message);
    error = escrow__node_error(env, &e);
    napi_set_named_property(env, error, "cause", cause);
    return error;
}

void escrow__node_custody_complete(napi_env env, escrow__node_op *op) {
    escrow__node_custody *c = op->custody;
    napi_handle_scope scope;
    napi_value value = NULL;
    napi_open_handle_scope(env, &scope);
    c->busy = 0;
    escrow__node_records_flush(c); /* before anything the call's end brings to JS */
    int ok = op->rc == ESCROW_OK;
    switch (op->kind) {
    case OP_CUSTODY_OPEN:
        c->opened = ok;
        if (ok) napi_get_reference_value(env, c->self, &value);
        break;
    /* A session is here exactly when the C custody keeps it, whatever the call answered: a
     * deposit with no answer is kept (a resume settles it), one refused before it was sent
     * is not, a retrieve whose duplicate could not be kept is the app's but not held. */
    case OP_DEPOSIT:
        /* An id held here before (under its first fd): the answer as it came, the table as
         * it was. */
        if (!op->was_kept && escrow__custody_keeps(&c->cu, op->id)) {
            escrow__node_session_add(c, op->id, op->fd);
            if (!ok) value = indeterminate(env, op);
        }
        break;
    case OP_CUSTODY_RETRIEVE:
        if (ok && escrow__custody_keeps(&c->cu, op->id))
            escrow__node_session_add(c, op->id, op->out.retrieved.fd);
        break;
    case OP_CUSTODY_RECLAIM:
        for (size_t i = 0; i < op->out.report.n_retrieved; i++) {
            const escrow_retrieved *r = &op->out.report.retrieved[i];
            if (escrow__custody_keeps(&c->cu, r->session.id))
                escrow__node_session_add(c, r->session.id, r->fd);
        }
        break;
    default: break;
    }
    if (c->opened) escrow__node_sessions_sync(c); /* a release, a resume: what left, journals */
    if (op->deferred != NULL) {
        if (!ok)
            napi_reject_deferred(env, op->deferred,
                                 value != NULL ? value : escrow__node_op_error(env, op));
        else napi_resolve_deferred(env, op->deferred,
                                   value != NULL ? value : escrow__node_op_value(env, op));
    }
    if (op->kind == OP_CUSTODY_CLOSE || (op->kind == OP_CUSTODY_OPEN && !ok)) {
        closed(c);
    } else if (c->opened && !c->closing) {
        escrow__node_watch_after(c, &op->err); /* protected or not: the C custody says */
    }
    napi_close_handle_scope(env, scope);
    escrow__node_op_free(op);
    if (!c->closed) start_next(c);
}

/* ---- the calls -------------------------------------------------------------------------- */

static void finalize(napi_env env, void *data, void *hint) {
    (void)env, (void)hint;
    escrow__node_custody *c = data;
    free(c->sessions);
    free(c);
}

/* custodyOpen(settings, emit) -> Promise<handle> */
napi_value escrow__node_custody_open(napi_env env, napi_callback_info info) {
    size_t argc = 2;
    napi_value argv[2] = {0}, handle, name, promise;
    NAPI_OK(env, napi_get_cb_info(env, info, &argc, argv, NULL, NULL), NULL);
    /* A worker's loop closes with the worker, while the custody's handles are on it and a
     * call may be running on the pool: a custody lives on the main thread only. */
    uv_loop_t *loop = NULL;
    NAPI_OK(env, napi_get_uv_event_loop(env, &loop), NULL);
    if (loop != uv_default_loop())
        return escrow__node_throw(env, ESCROW_CONFIG,
                                  "a custody is opened on the main thread only, not in a worker");
    escrow__node_custody *c = calloc(1, sizeof *c);
    if (c == NULL) return escrow__node_throw(env, ESCROW_SYSTEM, "out of memory");
    c->env = env;
    c->watch_fd = -1;
    c->cu.sock = -1;
    if (escrow__node_read_client(env, argv[0], &c->client) != 0) {
        free(c);
        return NULL;
    }
    escrow__node_op *op = escrow__node_op_new(OP_CUSTODY_OPEN);
    if (op == NULL) {
        free(c);
        return escrow__node_throw(env, ESCROW_SYSTEM, "out of memory");
    }
    op->custody = c;
    napi_create_object(env, &handle);
    napi_create_string_utf8(env, "escrow.custody", NAPI_AUTO_LENGTH, &name);
    if (napi_wrap(env, handle, c, finalize, NULL, NULL) != napi_ok) {
        free(c);
        escrow__node_op_free(op);
        escrow__node_throw_napi(env);
        return NULL;
    }
    /* From here on `c` is the handle's: its finalizer frees it. */
    napi_create_reference(env, handle, 1, &c->self);
    napi_create_reference(env, argv[1], 1, &c->emit);
    napi_async_init(env, handle, name, &c->context);
    c->loop = loop;
    napi_create_promise(env, &op->deferred, &promise);
    c->head = c->tail = op;
    start_next(c);
    return promise;
}

static escrow__node_custody *unwrap(napi_env env, napi_value handle) {
    void *data = NULL;
    if (napi_unwrap(env, handle, &data) != napi_ok || data == NULL) {
        napi_throw_type_error(env, NULL, "not a custody");
        return NULL;
    }
    return data;
}

/* custodyCall(handle, kind, ...args) -> Promise */
napi_value escrow__node_custody_call(napi_env env, napi_callback_info info) {
    size_t argc = 6;
    napi_value argv[6] = {0}, promise;
    int32_t kind;
    int64_t fd = -1;
    NAPI_OK(env, napi_get_cb_info(env, info, &argc, argv, NULL, NULL), NULL);
    escrow__node_custody *c = unwrap(env, argv[0]);
    if (c == NULL) return NULL;
    NAPI_OK(env, napi_get_value_int32(env, argv[1], &kind), NULL);
    if (kind <= OP_CUSTODY_OPEN || kind >= OP_RESUME) {
        napi_throw_range_error(env, NULL, "not a custody call");
        return NULL;
    }
    if (c->closing) return escrow__node_throw(env, ESCROW_CONFIG, "this custody is closed");
    escrow__node_op *op = escrow__node_op_new((escrow__node_kind)kind);
    if (op == NULL) return escrow__node_throw(env, ESCROW_SYSTEM, "out of memory");
    op->custody = c;
    int bad = 0;
    switch (kind) {
    case OP_DEPOSIT:
        bad = (op->id = escrow__node_string(env, argv[2], 0, NULL)) == NULL ||
              escrow__node_int64(env, argv[3], -1, &fd) != 0 ||
              escrow__node_read_opts(env, argv[4], &op->opts, &op->label, &op->meta) != 0;
        op->fd = (int)fd;
        break;
    case OP_CUSTODY_RELEASE:
        bad = (op->id = escrow__node_string(env, argv[2], 0, NULL)) == NULL;
        break;
    case OP_CUSTODY_UPDATE:
        bad = (op->id = escrow__node_string(env, argv[2], 0, NULL)) == NULL ||
              escrow__node_int64(env, argv[3], -1, &op->cols) != 0 ||
              escrow__node_int64(env, argv[4], -1, &op->rows) != 0 ||
              escrow__node_read_meta(env, argv[5], &op->meta) != 0;
        break;
    case OP_CUSTODY_RETRIEVE:
        bad = (op->id = escrow__node_string(env, argv[2], 0, NULL)) == NULL ||
              escrow__node_bool(env, argv[3], 0, &op->flag) != 0;
        break;
    case OP_CUSTODY_RECLAIM:
        bad = escrow__node_bool(env, argv[2], 0, &op->flag) != 0 ||
              escrow__node_double(env, argv[3], 8.0, &op->seconds) != 0;
        break;
    case OP_CUSTODY_CLOSE: c->closing = 1; break;
    default: break;
    }
    if (bad || napi_create_promise(env, &op->deferred, &promise) != napi_ok) {
        if (kind == OP_CUSTODY_CLOSE) c->closing = 0;
        escrow__node_op_free(op);
        return NULL;
    }
    if (kind == OP_CUSTODY_CLOSE && c->timer != NULL) uv_timer_stop(c->timer);
    escrow__node_custody_enqueue(c, op);
    return promise;
}

/* record(id, bytes): the session must be held here (else 'unknown'). */
static int record(napi_env env, escrow__node_custody *c, escrow__node_held *s, const char *id,
                  napi_value bytes) {
    void *data = NULL;
    size_t len = 0;
    bool is_buffer = false;
    if (napi_is_buffer(env, bytes, &is_buffer) != napi_ok || !is_buffer ||
        napi_get_buffer_info(env, bytes, &data, &len) != napi_ok) {
        napi_throw_type_error(env, NULL, "a Buffer was expected");
        return -1;
    }
    if (s == NULL) {
        escrow__node_throw(env, ESCROW_UNKNOWN, "no session %.128s in this custody", id);
        return -1;
    }
    if (escrow__node_record(c, id, data, len) != 0) {
        escrow__node_throw(env, ESCROW_SYSTEM, "out of memory");
        return -1;
    }
    return 0;
}

/* custodySync(handle, what, id?, bytes?): what needs no holder, on the main thread. */
napi_value escrow__node_custody_sync(napi_env env, napi_callback_info info) {
    size_t argc = 4;
    napi_value argv[4] = {0}, result;
    char what[32];
    NAPI_OK(env, napi_get_cb_info(env, info, &argc, argv, NULL, NULL), NULL);
    escrow__node_custody *c = unwrap(env, argv[0]);
    if (c == NULL) return NULL;
    NAPI_OK(env, napi_get_value_string_utf8(env, argv[1], what, sizeof what, NULL), NULL);
    napi_get_undefined(env, &result);
    if (strcmp(what, "protected") == 0) {
        napi_get_boolean(env, c->opened && !c->closing && !c->lapsed, &result);
        return result;
    }
    char *id = escrow__node_string(env, argv[2], 0, NULL);
    if (id == NULL) return NULL;
    escrow__node_held *s = escrow__node_session_find(c, id);
    if (strcmp(what, "record") == 0) {
        int failed = c->closing ? (escrow__node_throw(env, ESCROW_CONFIG,
                                                      "this custody is closed"), 1)
                                : record(env, c, s, id, argv[3]) != 0;
        if (failed) {
            free(id);
            return NULL;
        }
    } else if (strcmp(what, "journaled") == 0) {
        napi_get_boolean(env, s != NULL && s->journal, &result);
    } else if (strcmp(what, "fd") == 0) {
        napi_create_int32(env, s != NULL ? s->fd : -1, &result);
    } else if (strcmp(what, "startReading") == 0 || strcmp(what, "stopReading") == 0) {
        int failed = s == NULL || escrow__node_session_read(c, s, what[2] == 'a') != 0;
        if (s == NULL)
            escrow__node_throw(env, ESCROW_UNKNOWN, "no session %.128s in this custody", id);
        if (failed) {
            free(id);
            return NULL;
        }
    } else {
        free(id);
        napi_throw_range_error(env, NULL, "not a custody question");
        return NULL;
    }
    free(id);
    return result;
}
