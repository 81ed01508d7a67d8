/* custody.c: a custody on Node's event loop (PROTOCOL.md 10.2, 10.4, 10.6).
 *
 * One call at a time: the C client lets one thread at a time use a custody, so its calls
 * (deposit, release, update, retrieve into custody, reclaim, close, and the watcher's resume)
 * wait in a queue, and each runs off the main thread only when the one before it is done.
 * While one runs, nothing on the main thread touches the custody: the watcher and the reads
 * below are stopped, and start again when the queue is empty.
 *
 * The watcher: a uv_poll on escrow_custody_fd. It turns readable only when the holder goes
 * away (a crash, an upgrade); escrow_custody_check then says whether protection lapsed, and
 * if it did the custody emits 'lapsed' (with the error), and tries escrow_custody_resume
 * (off the main thread, as any call) after escrow_custody_retry_ms on a uv timer, again and
 * again with the C client's back-off, until it is protected again: 'protected'. A call that
 * lost the connection lapses protection the same way. The fd changes with every resume: the
 * poll is made again on the new one.
 *
 * Reading: the app reads a session through the custody, so that what it reads is recorded in
 * the session's journal (10.6) before the app can lose it: startReading(id) polls the master
 * and emits 'data' (id, Buffer) for each escrow_custody_read, 'end' (id) once the terminal
 * hung up (EIO). The master is made non-blocking, and the app must not read it itself.
 *
 * The fds: the custody's own (its socket, the kept duplicates) are the C client's; the
 * masters it reads are the app's (numbers the app got from a deposit, a retrieve or a
 * reclaim), never closed here. The polls are closed with the custody.
 */
#define _GNU_SOURCE
#include "addon.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A session this custody holds, as the app sees it: its master, and whether it is read. */
typedef struct session {
    char id[ESCROW_NAME_MAX + 1];
    int fd;
    int journal;
    int reading;         /* the app asked for 'data' */
    uv_poll_t *poll;     /* on the master, started while reading and the custody is idle */
    escrow__node_custody *custody;
} session;

struct escrow__node_custody {
    napi_env env;
    escrow_client client;
    escrow_custody cu;
    int opened, closing, closed, busy;
    int lapsed;                     /* 'lapsed' emitted, 'protected' not yet */
    escrow__node_op *head, *tail;   /* the queue; the one running is not in it */
    napi_ref self, emit;
    napi_async_context context;
    uv_loop_t *loop;
    uv_poll_t *watch;               /* on escrow_custody_fd */
    int watch_fd;
    uv_timer_t *timer;              /* the next resume */
    session **sessions;
    size_t n, cap;
};

static void start_next(escrow__node_custody *c);

/* ---- events ----------------------------------------------------------------------------- */

static void emit(escrow__node_custody *c, const char *event, size_t argc, napi_value *args) {
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


/* ---- the sessions ----------------------------------------------------------------------- */

static void free_handle(uv_handle_t *h) { free(h); }

static session *find(escrow__node_custody *c, const char *id) {
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->sessions[i]->id, id) == 0) return c->sessions[i];
    return NULL;
}

static void remove_session(escrow__node_custody *c, const char *id) {
    for (size_t i = 0; i < c->n; i++) {
        session *s = c->sessions[i];
        if (strcmp(s->id, id) != 0) continue;
        if (s->poll != NULL) uv_close((uv_handle_t *)s->poll, free_handle);
        free(s);
        c->sessions[i] = c->sessions[--c->n];
        return;
    }
}

/* The app holds `fd` for `id` now (a deposit, a retrieve into custody, a reclaim). */
static void add_session(escrow__node_custody *c, const char *id, int fd) {
    session *s = find(c, id);
    if (s != NULL && s->fd != fd) remove_session(c, id), s = NULL;
    if (s == NULL) {
        if (c->n == c->cap) {
            size_t cap = c->cap ? 2 * c->cap : 8;
            session **grown = realloc(c->sessions, cap * sizeof *grown);
            if (grown == NULL) return;
            c->sessions = grown;
            c->cap = cap;
        }
        if ((s = calloc(1, sizeof *s)) == NULL) return;
        snprintf(s->id, sizeof s->id, "%s", id);
        s->fd = fd;
        s->custody = c;
        c->sessions[c->n++] = s;
    }
#if defined(ESCROW_NODE_HAVE_CUSTODY)
    s->journal = escrow_custody_journaled(&c->cu, id);
#endif
}

static void on_master(uv_poll_t *h, int status, int events) {
    (void)status, (void)events;
    session *s = h->data;
    escrow__node_custody *c = s->custody;
    if (c->busy || !s->reading) return;
    unsigned char buf[65536];
#if defined(ESCROW_NODE_HAVE_CUSTODY)
    long n = escrow_custody_read(&c->cu, s->id, buf, sizeof buf); /* recorded in its journal */
#else
    long n = (long)read(s->fd, buf, sizeof buf);
#endif
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    napi_handle_scope scope;
    napi_open_handle_scope(c->env, &scope);
    napi_value args[2];
    napi_create_string_utf8(c->env, s->id, NAPI_AUTO_LENGTH, &args[0]);
    if (n > 0) {
        void *data;
        napi_create_buffer_copy(c->env, (size_t)n, buf, &data, &args[1]);
        emit(c, "data", 2, args); /* `s` may be gone after this */
    } else {
        /* EIO: the terminal hung up; anything else (ENOENT: not held here): no more reads. */
        s->reading = 0;
        uv_poll_stop(h);
        napi_create_int32(c->env, n == 0 ? 0 : errno, &args[1]);
        emit(c, "end", 2, args);
    }
    napi_close_handle_scope(c->env, scope);
}

/* ---- the watcher ------------------------------------------------------------------------ */

static void stop_watch(escrow__node_custody *c) {
    if (c->watch != NULL) uv_close((uv_handle_t *)c->watch, free_handle);
    c->watch = NULL;
    c->watch_fd = -1;
}

#if defined(ESCROW_NODE_HAVE_CUSTODY)
static void on_resume_time(uv_timer_t *t) {
    escrow__node_custody *c = t->data;
    if (c->closing) return;
    escrow__node_op *op = escrow__node_op_new(OP_RESUME);
    if (op == NULL) return;
    op->custody = c;
    if (c->tail != NULL) c->tail->next = op;
    else c->head = op;
    c->tail = op;
    napi_handle_scope scope; /* a uv callback: queueing the work makes JS values */
    napi_open_handle_scope(c->env, &scope);
    start_next(c);
    napi_close_handle_scope(c->env, scope);
}

static void resume_later(escrow__node_custody *c) {
    if (c->closing) return;
    if (c->timer == NULL) {
        if ((c->timer = malloc(sizeof *c->timer)) == NULL) return;
        uv_timer_init(c->loop, c->timer);
        c->timer->data = c;
        uv_unref((uv_handle_t *)c->timer); /* custody alone keeps no app running */
    }
    int ms = escrow_custody_retry_ms(&c->cu);
    uv_timer_start(c->timer, on_resume_time, (uint64_t)(ms > 0 ? ms : 100), 0);
}

static void lapse(escrow__node_custody *c, const escrow_error *why) {
    if (c->lapsed) return;
    c->lapsed = 1;
    escrow_error e;
    if (why == NULL || why->code == ESCROW_OK) {
        memset(&e, 0, sizeof e);
        escrow__fail(&e, ESCROW_UNAVAILABLE, 0, NULL, "the holder went away");
        why = &e;
    }
    napi_value error = escrow__node_error(c->env, why);
    emit(c, "lapsed", 1, &error);
}

static void on_custody_fd(uv_poll_t *h, int status, int events) {
    (void)status, (void)events;
    escrow__node_custody *c = h->data;
    if (c->busy || c->closing) return;
    escrow_error e;
    memset(&e, 0, sizeof e);
    if (escrow_custody_check(&c->cu, &e) == ESCROW_OK) return; /* still there */
    stop_watch(c);
    napi_handle_scope scope;
    napi_open_handle_scope(c->env, &scope);
    lapse(c, &e);
    napi_close_handle_scope(c->env, scope);
    resume_later(c);
}
#endif

/* The queue is empty: watch the custody's fd (a new one after a resume) and read again. */
static void idle(escrow__node_custody *c) {
    if (c->closing || !c->opened) return;
#if defined(ESCROW_NODE_HAVE_CUSTODY)
    int fd = escrow_custody_fd(&c->cu);
    if (fd != c->watch_fd) stop_watch(c);
    if (fd >= 0 && c->watch == NULL && (c->watch = malloc(sizeof *c->watch)) != NULL) {
        if (uv_poll_init(c->loop, c->watch, fd) != 0) {
            free(c->watch);
            c->watch = NULL;
        } else {
            c->watch->data = c;
            c->watch_fd = fd;
            uv_unref((uv_handle_t *)c->watch);
        }
    }
    if (c->watch != NULL) uv_poll_start(c->watch, UV_READABLE | UV_DISCONNECT, on_custody_fd);
#endif
    for (size_t i = 0; i < c->n; i++) {
        session *s = c->sessions[i];
        if (s->reading && s->poll != NULL) uv_poll_start(s->poll, UV_READABLE, on_master);
    }
}

static void pause_all(escrow__node_custody *c) {
    if (c->watch != NULL) uv_poll_stop(c->watch);
    for (size_t i = 0; i < c->n; i++)
        if (c->sessions[i]->poll != NULL) uv_poll_stop(c->sessions[i]->poll);
}

/* ---- the queue -------------------------------------------------------------------------- */

static void start_next(escrow__node_custody *c) {
    while (!c->busy && c->head != NULL) {
        escrow__node_op *op = c->head;
        c->head = op->next;
        if (c->head == NULL) c->tail = NULL;
        op->next = NULL;
        if (op->kind == OP_RESUME && (c->closing || !c->lapsed)) {
            escrow__node_op_free(op); /* closed meanwhile, or a call found the holder back */
            continue;
        }
        c->busy = 1;
        pause_all(c);
        if (escrow__node_op_queue(c->env, op) != 0) {
            c->busy = 0;
            escrow__fail(&op->err, op->rc = ESCROW_SYSTEM, 0, op->id, "napi_queue_async_work");
            escrow__node_custody_complete(c->env, op);
            return;
        }
    }
    if (!c->busy) idle(c);
}

void escrow__node_custody_execute(escrow__node_op *op) {
    escrow__node_custody *c = op->custody;
    escrow_custody *cu = &c->cu;
    escrow_error *e = &op->err;
    switch (op->kind) {
    case OP_CUSTODY_OPEN: op->rc = escrow_custody_open(&c->client, cu, e); break;
    case OP_DEPOSIT: op->rc = escrow_deposit(cu, op->id, op->fd, &op->opts, e); break;
    case OP_CUSTODY_RELEASE: op->rc = escrow_custody_release(cu, op->id, e); break;
    case OP_CUSTODY_UPDATE:
        op->rc = escrow_custody_update(cu, op->id, op->cols, op->rows,
                                       op->meta.given ? op->meta.entries : NULL, op->meta.count,
                                       e);
        break;
    case OP_CUSTODY_CLOSE: escrow_custody_close(cu); break;
#if defined(ESCROW_NODE_HAVE_CUSTODY)
    case OP_CUSTODY_RETRIEVE:
        op->rc = escrow_custody_retrieve(cu, op->id, op->flag, &op->out.retrieved, e);
        break;
    case OP_RESUME: op->rc = escrow_custody_resume(cu, e); break;
#endif
#if defined(ESCROW_NODE_HAVE_RECLAIM)
    case OP_CUSTODY_RECLAIM:
        op->rc = escrow_custody_reclaim_all(cu, op->flag, op->seconds, &op->out.report, e);
        break;
#endif
    default: op->rc = escrow__fail(e, ESCROW_CONFIG, 0, NULL, "not a custody call"); break;
    }
}

static void closed(escrow__node_custody *c) {
    c->closed = c->closing = 1;
    stop_watch(c);
    if (c->timer != NULL) uv_close((uv_handle_t *)c->timer, free_handle);
    c->timer = NULL;
    while (c->n > 0) remove_session(c, c->sessions[0]->id);
    if (c->emit != NULL) napi_delete_reference(c->env, c->emit);
    c->emit = NULL;
    napi_async_destroy(c->env, c->context);
    c->context = NULL;
    napi_delete_reference(c->env, c->self); /* the handle may be collected from now on */
    c->self = NULL;
}

void escrow__node_custody_complete(napi_env env, escrow__node_op *op) {
    escrow__node_custody *c = op->custody;
    napi_handle_scope scope;
    napi_value value = NULL;
    napi_open_handle_scope(env, &scope);
    c->busy = 0;
    int ok = op->rc == ESCROW_OK;
    switch (op->kind) {
    case OP_CUSTODY_OPEN:
        c->opened = ok;
        if (ok) napi_get_reference_value(env, c->self, &value);
        break;
    case OP_DEPOSIT:
        /* Unanswered, it may be escrowed: the C client keeps it and a resume settles it. */
        if (ok || op->rc == ESCROW_UNRESPONSIVE || op->rc == ESCROW_UNAVAILABLE)
            add_session(c, op->id, op->fd);
        break;
    case OP_CUSTODY_RELEASE:
        if (ok) remove_session(c, op->id);
        break;
    case OP_CUSTODY_RETRIEVE:
        if (ok) add_session(c, op->id, op->out.retrieved.fd);
        break;
    case OP_CUSTODY_RECLAIM:
        for (size_t i = 0; i < op->out.report.n_retrieved; i++)
            add_session(c, op->out.report.retrieved[i].session.id, op->out.report.retrieved[i].fd);
        break;
    default: break;
    }
    if (op->deferred != NULL) {
        if (!ok) napi_reject_deferred(env, op->deferred, escrow__node_op_error(env, op));
        else napi_resolve_deferred(env, op->deferred,
                                   value != NULL ? value : escrow__node_op_value(env, op));
    }
    if (op->kind == OP_CUSTODY_CLOSE || (op->kind == OP_CUSTODY_OPEN && !ok)) {
        closed(c);
    } else if (c->opened && !c->closing) {
#if defined(ESCROW_NODE_HAVE_CUSTODY)
        if (escrow_custody_fd(&c->cu) < 0) { /* lost the holder: lapsed, or still lapsed */
            lapse(c, &op->err);
            resume_later(c);
        } else if (c->lapsed) {
            c->lapsed = 0;
            stop_watch(c); /* a new connection: idle() watches its fd */
            emit(c, "protected", 0, NULL);
        }
#endif
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
    escrow__node_custody *c = calloc(1, sizeof *c);
    if (c == NULL) return escrow__node_throw(env, ESCROW_SYSTEM, "out of memory");
    c->env = env;
    c->watch_fd = -1;
    c->cu.sock = -1;
    escrow_error err;
    char *owner = escrow__node_string(env, escrow__node_get(env, argv[0], "owner"), 0, NULL);
    int has_socket = 0;
    double timeout = 0;
    char *socket = owner == NULL ? NULL
                                 : escrow__node_string(env, escrow__node_get(env, argv[0], "socket"),
                                                       1, &has_socket);
    bool pending = false;
    napi_is_exception_pending(env, &pending);
    escrow_code rc = ESCROW_CONFIG;
    if (!pending &&
        escrow__node_double(env, escrow__node_get(env, argv[0], "timeout"), 0, &timeout) == 0) {
        rc = escrow_client_init(&c->client, owner, socket, timeout, &err);
        if (rc != ESCROW_OK) napi_throw(env, escrow__node_error(env, &err));
    }
    free(owner);
    free(socket);
    if (rc != ESCROW_OK) {
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
    napi_get_uv_event_loop(env, &c->loop);
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
#if !defined(ESCROW_NODE_HAVE_CUSTODY)
    if (kind == OP_CUSTODY_RETRIEVE)
        return escrow__node_throw(env, ESCROW_OK, "this build has no retrieve into custody "
                                  "(escrow_custody.c)");
#endif
#if !defined(ESCROW_NODE_HAVE_RECLAIM)
    if (kind == OP_CUSTODY_RECLAIM)
        return escrow__node_throw(env, ESCROW_OK, "this build has no reclaim (escrow_reclaim.c)");
#endif
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
    if (c->tail != NULL) c->tail->next = op;
    else c->head = op;
    c->tail = op;
    start_next(c);
    return promise;
}

/* custodySync(handle, what, id?): what needs no holder, on the main thread. */
napi_value escrow__node_custody_sync(napi_env env, napi_callback_info info) {
    size_t argc = 3;
    napi_value argv[3] = {0}, result;
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
    session *s = find(c, id);
    if (strcmp(what, "journaled") == 0) {
        napi_get_boolean(env, s != NULL && s->journal, &result);
    } else if (strcmp(what, "fd") == 0) {
        napi_create_int32(env, s != NULL ? s->fd : -1, &result);
    } else if (strcmp(what, "startReading") == 0 || strcmp(what, "stopReading") == 0) {
        int start = what[2] == 'a';
        if (s == NULL) {
            escrow__node_throw(env, ESCROW_UNKNOWN, "no session %.128s in this custody", id);
            free(id);
            return NULL;
        }
        if (start && s->poll == NULL && (s->poll = malloc(sizeof *s->poll)) != NULL) {
            int flags = fcntl(s->fd, F_GETFL);
            if (flags >= 0) fcntl(s->fd, F_SETFL, flags | O_NONBLOCK); /* never blocks the loop */
            if (uv_poll_init(c->loop, s->poll, s->fd) != 0) {
                free(s->poll);
                s->poll = NULL;
                free(id);
                return escrow__node_throw(env, ESCROW_SYSTEM, "cannot poll the master of %.128s",
                                          s->id);
            }
            s->poll->data = s;
        }
        s->reading = start;
        if (!start && s->poll != NULL) uv_poll_stop(s->poll);
        if (start && !c->busy && s->poll != NULL) uv_poll_start(s->poll, UV_READABLE, on_master);
    } else {
        free(id);
        napi_throw_range_error(env, NULL, "not a custody question");
        return NULL;
    }
    free(id);
    return result;
}
