/* custody_watch.c: a custody's watcher on the event loop, that takes custody back when the
 * holder goes away (PROTOCOL.md 10.4).
 *
 * A uv_poll on escrow_custody_fd: it turns readable only when the holder goes away (a crash,
 * an upgrade); escrow_custody_check then says whether protection lapsed, and if it did the
 * custody emits 'lapsed' (with the error), and tries escrow_custody_resume (through the
 * queue, off the main thread, as any call) after escrow_custody_retry_ms on a uv timer,
 * again and again with the C client's back-off, until it is protected again: 'protected'. A
 * call that lost the connection lapses protection the same way. Whether it is protected is
 * escrow_custody_protected's answer after every call and check, never a guess from the fd:
 * a resume that a holder refused for one session has a connection and is still lapsed. The fd changes with every
 * resume: the poll is made again on the new one.
 *
 * A call that timed out leaves the connection open, owed its answer: then no resume is
 * tried (it would only wait for that answer, pausing every read up to the timeout, again
 * and again while a holder is stopped): the poll brings the late answer, or the hang-up,
 * and escrow_custody_check reads it off the main thread, through the queue, since reading
 * an answer that is only half there waits up to the timeout. On the main thread the check
 * runs only when nothing is owed, where it never waits. A resume runs when there is no
 * connection, or a holder refused a session (nothing owed: the answer came).
 *
 * While protected, neither the poll nor the timer keeps the app running (uv_unref): a
 * custody alone is no reason for a process to stay. While protection has lapsed they do
 * (uv_ref): an app awaiting 'protected' is not ended mid-await. Both are closed with the
 * custody.
 */
#define _GNU_SOURCE
#include "custody.h"

#include <stdlib.h>
#include <string.h>

static void stop_watch(escrow__node_custody *c) {
    if (c->watch != NULL) uv_close((uv_handle_t *)c->watch, escrow__node_free_handle);
    c->watch = NULL;
    c->watch_fd = -1;
}

int escrow__node_watch_owed(const escrow__node_custody *c) {
    return escrow_custody_fd(&c->cu) >= 0 && c->cu.owed != 0;
}

/* The loop stays alive for the watcher only while protection has lapsed. */
static void hold_loop(escrow__node_custody *c) {
    uv_handle_t *handles[2] = {(uv_handle_t *)c->timer, (uv_handle_t *)c->watch};
    for (size_t i = 0; i < 2; i++) {
        if (handles[i] == NULL) continue;
        if (c->lapsed) uv_ref(handles[i]);
        else uv_unref(handles[i]);
    }
}

static void queue_own(escrow__node_custody *c, escrow__node_kind kind) {
    escrow__node_op *op = escrow__node_op_new(kind);
    if (op == NULL) return;
    op->custody = c;
    napi_handle_scope scope; /* a uv callback: queueing the work makes JS values */
    napi_open_handle_scope(c->env, &scope);
    escrow__node_custody_enqueue(c, op);
    napi_close_handle_scope(c->env, scope);
}

static void on_resume_time(uv_timer_t *t) {
    escrow__node_custody *c = t->data;
    if (c->closing) return;
    queue_own(c, OP_RESUME);
}

static void resume_later(escrow__node_custody *c) {
    if (c->closing) return;
    if (c->timer == NULL) {
        if ((c->timer = malloc(sizeof *c->timer)) == NULL) return;
        uv_timer_init(c->loop, c->timer);
        c->timer->data = c;
    }
    if (uv_is_active((uv_handle_t *)c->timer)) return; /* a resume is due already */
    int ms = escrow_custody_retry_ms(&c->cu);
    uv_timer_start(c->timer, on_resume_time, (uint64_t)(ms > 0 ? ms : 100), 0);
}

/* Emitted last: a listener's call may start on the pool at once, and from then on nothing
 * here may touch the custody. */
static void lapse(escrow__node_custody *c, const escrow_error *why) {
    escrow_error e;
    if (why == NULL || why->code == ESCROW_OK) {
        memset(&e, 0, sizeof e);
        escrow__fail(&e, ESCROW_UNAVAILABLE, 0, NULL,
                     "custody is not protected: a session held here is not escrowed");
        why = &e;
    }
    napi_value error = escrow__node_error(c->env, why);
    escrow__node_custody_emit(c, "lapsed", 1, &error);
}

static void on_custody_fd(uv_poll_t *h, int status, int events) {
    (void)status, (void)events;
    escrow__node_custody *c = h->data;
    if (c->busy || c->closing) return;
    if (escrow__node_watch_owed(c)) {
        queue_own(c, OP_CHECK); /* the late answer, or the hang-up: read off the main thread */
        return;
    }
    escrow_error e;
    memset(&e, 0, sizeof e);
    escrow_code rc = escrow_custody_check(&c->cu, &e); /* nothing owed: never waits */
    if (rc == ESCROW_OK && escrow_custody_protected(&c->cu) == !c->lapsed) return; /* as was */
    escrow__node_sessions_sync(c);
    napi_handle_scope scope;
    napi_open_handle_scope(c->env, &scope);
    escrow__node_watch_after(c, &e);
    napi_close_handle_scope(c->env, scope);
}

void escrow__node_watch_start(escrow__node_custody *c) {
    int fd = escrow_custody_fd(&c->cu);
    if (fd != c->watch_fd) stop_watch(c);
    if (fd >= 0 && c->watch == NULL && (c->watch = malloc(sizeof *c->watch)) != NULL) {
        if (uv_poll_init(c->loop, c->watch, fd) != 0) {
            free(c->watch);
            c->watch = NULL;
        } else {
            c->watch->data = c;
            c->watch_fd = fd;
            hold_loop(c);
        }
    }
    if (c->watch != NULL) uv_poll_start(c->watch, UV_READABLE | UV_DISCONNECT, on_custody_fd);
}

void escrow__node_watch_pause(escrow__node_custody *c) {
    if (c->watch != NULL) uv_poll_stop(c->watch);
}

void escrow__node_watch_after(escrow__node_custody *c, const escrow_error *why) {
    /* The C custody says, never its fd: a resume a holder refused keeps its new connection,
     * and a session held but not kept leaves the connection as it was. */
    if (!escrow_custody_protected(&c->cu)) {
        int was = c->lapsed;
        c->lapsed = 1;
        if (escrow_custody_fd(&c->cu) != c->watch_fd) stop_watch(c); /* closed or new */
        if (!escrow__node_watch_owed(c)) resume_later(c);
        else if (c->timer != NULL) uv_timer_stop(c->timer); /* the watch brings the answer */
        hold_loop(c);
        if (!was) lapse(c, why);
    } else if (c->lapsed) {
        c->lapsed = 0;
        stop_watch(c); /* a new connection: watch_start watches its fd */
        if (c->timer != NULL) uv_timer_stop(c->timer);
        hold_loop(c);
        escrow__node_custody_emit(c, "protected", 0, NULL);
    }
}

void escrow__node_watch_close(escrow__node_custody *c) {
    stop_watch(c);
    if (c->timer != NULL) uv_close((uv_handle_t *)c->timer, escrow__node_free_handle);
    c->timer = NULL;
}
