/* custody_reads.c: the sessions a custody holds, and the app's reads of them (PROTOCOL.md
 * 10.6).
 *
 * The app reads a session through the custody, so that what it reads is recorded in the
 * session's journal before the app can lose it: startReading(id) polls the master and emits
 * 'data' (id, Buffer) for each escrow_custody_read, 'end' (id, errno) once the terminal hung
 * up (EIO) or cannot be read. The master is made non-blocking, and the app must not read it
 * itself.
 *
 * Reads pause while a custody call runs (the C client lets one thread at a time use a
 * custody, and the call runs on another): the queue stops every poll before it starts a
 * call, and starts them again as soon as it is empty. The polls are level-triggered, so a
 * master that turned readable during the call is read on the loop's next turn, without
 * waiting for more output.
 *
 * The fds: the masters are the app's (numbers it got from a deposit, a retrieve or a
 * reclaim), never closed here; a session's poll is closed when it leaves the custody. An
 * app that closes a master it still holds here has made a mistake the custody survives:
 * before a poll starts again (after every call) the master is checked, and one closed (or
 * whose number is another file's now) is read no more, 'end' with EBADF, where libuv would
 * abort the process polling it; EIO is the terminal's own hang-up.
 */
#define _GNU_SOURCE
#include "custody.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

escrow__node_held *escrow__node_session_find(escrow__node_custody *c, const char *id) {
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->sessions[i]->id, id) == 0) return c->sessions[i];
    return NULL;
}

void escrow__node_session_remove(escrow__node_custody *c, const char *id) {
    for (size_t i = 0; i < c->n; i++) {
        escrow__node_held *s = c->sessions[i];
        if (strcmp(s->id, id) != 0) continue;
        if (s->poll != NULL) uv_close((uv_handle_t *)s->poll, escrow__node_free_handle);
        free(s);
        c->sessions[i] = c->sessions[--c->n];
        return;
    }
}

void escrow__node_session_add(escrow__node_custody *c, const char *id, int fd) {
    escrow__node_held *s = escrow__node_session_find(c, id);
    if (s != NULL && s->fd != fd) escrow__node_session_remove(c, id), s = NULL;
    if (s == NULL) {
        if (c->n == c->cap) {
            size_t cap = c->cap ? 2 * c->cap : 8;
            escrow__node_held **grown = realloc(c->sessions, cap * sizeof *grown);
            if (grown == NULL) return;
            c->sessions = grown;
            c->cap = cap;
        }
        if ((s = calloc(1, sizeof *s)) == NULL) return;
        snprintf(s->id, sizeof s->id, "%s", id);
        s->fd = fd;
        s->custody = c;
        struct stat st;
        if (fstat(fd, &st) == 0) s->dev = st.st_dev, s->ino = st.st_ino;
        c->sessions[c->n++] = s;
    }
    s->journal = escrow_custody_journaled(&c->cu, id);
}

void escrow__node_sessions_sync(escrow__node_custody *c) {
    for (size_t i = 0; i < c->n;) {
        escrow__node_held *s = c->sessions[i];
        if (!escrow__custody_keeps(&c->cu, s->id)) {
            escrow__node_session_remove(c, s->id); /* the last one takes its place */
            continue;
        }
        s->journal = escrow_custody_journaled(&c->cu, s->id);
        i++;
    }
}

static void on_master(uv_poll_t *h, int status, int events) {
    (void)status, (void)events;
    escrow__node_held *s = h->data;
    escrow__node_custody *c = s->custody;
    if (c->busy || !s->reading) return;
    unsigned char buf[65536];
    long n = escrow_custody_read(&c->cu, s->id, buf, sizeof buf); /* recorded in its journal */
    if (n < 0 && errno == EBADF) {
        /* Held, but no duplicate of it could be kept (the fd limit): the master is the fd
         * the app was given, read here and recorded, never an 'end' of a live terminal. */
        n = read(s->fd, buf, sizeof buf);
        if (n > 0) (void)escrow_custody_record(&c->cu, s->id, buf, (size_t)n);
    }
    int error = n < 0 ? errno : 0; /* before any napi call can change errno */
    if (n < 0 && (error == EAGAIN || error == EWOULDBLOCK || error == EINTR)) return;
    napi_handle_scope scope;
    napi_open_handle_scope(c->env, &scope);
    napi_value args[2];
    napi_create_string_utf8(c->env, s->id, NAPI_AUTO_LENGTH, &args[0]);
    if (n > 0) {
        void *data;
        napi_create_buffer_copy(c->env, (size_t)n, buf, &data, &args[1]);
        escrow__node_custody_emit(c, "data", 2, args); /* `s` may be gone after this */
    } else {
        /* EIO: the terminal hung up; anything else is not the terminal's doing (EBADF: the
         * app closed its master; ENOENT: not held here): no more reads, and the errno says
         * which. */
        s->reading = 0;
        uv_poll_stop(h);
        napi_create_int32(c->env, error, &args[1]);
        escrow__node_custody_emit(c, "end", 2, args);
    }
    napi_close_handle_scope(c->env, scope);
}

/* The app closed the master (its number free, or another file's now): polling it again
 * would make libuv abort the process (epoll_ctl EBADF), so it is never polled again. */
static int master_closed(const escrow__node_held *s) {
    struct stat st;
    if (fstat(s->fd, &st) != 0) return errno == EBADF;
    return st.st_dev != s->dev || st.st_ino != s->ino;
}

static void on_ends(uv_timer_t *t) {
    escrow__node_custody *c = t->data;
    for (size_t i = 0; i < c->n; i++) {
        escrow__node_held *s = c->sessions[i];
        if (s->ended == 0) continue;
        napi_handle_scope scope;
        napi_open_handle_scope(c->env, &scope);
        napi_value args[2];
        napi_create_string_utf8(c->env, s->id, NAPI_AUTO_LENGTH, &args[0]);
        napi_create_int32(c->env, s->ended, &args[1]);
        s->ended = 0;
        escrow__node_custody_emit(c, "end", 2, args); /* the table may change: start over */
        napi_close_handle_scope(c->env, scope);
        i = (size_t)-1;
        if (c->closed) return;
    }
}

/* Stop reading a master the app closed, and say 'end' (EBADF) on the loop's next turn: this
 * runs inside whatever started the reads, a JS call among them. */
static void end_closed(escrow__node_custody *c, escrow__node_held *s) {
    s->reading = 0;
    s->ended = EBADF;
    if (s->poll != NULL) uv_close((uv_handle_t *)s->poll, escrow__node_free_handle);
    s->poll = NULL;
    if (c->ends == NULL) {
        if ((c->ends = malloc(sizeof *c->ends)) == NULL) return;
        uv_timer_init(c->loop, c->ends);
        uv_unref((uv_handle_t *)c->ends);
        c->ends->data = c;
    }
    uv_timer_start(c->ends, on_ends, 0, 0);
}

void escrow__node_reads_close(escrow__node_custody *c) {
    if (c->ends != NULL) uv_close((uv_handle_t *)c->ends, escrow__node_free_handle);
    c->ends = NULL;
}

int escrow__node_session_read(escrow__node_custody *c, escrow__node_held *s, int start) {
    if (start && master_closed(s)) {
        escrow_error e;
        memset(&e, 0, sizeof e);
        escrow__fail(&e, ESCROW_SYSTEM, EBADF, s->id,
                     "the master of %.128s was closed by the app (release a session before "
                     "closing its fd)", s->id);
        napi_throw(c->env, escrow__node_error(c->env, &e));
        return -1;
    }
    if (start && s->poll == NULL && (s->poll = malloc(sizeof *s->poll)) != NULL) {
        int flags = fcntl(s->fd, F_GETFL);
        if (flags >= 0) fcntl(s->fd, F_SETFL, flags | O_NONBLOCK); /* never blocks the loop */
        int rc = uv_poll_init(c->loop, s->poll, s->fd);
        if (rc != 0) {
            /* EEXIST: something else polls this fd already (a PTY library's libuv stream:
             * node-pty, tty.ReadStream): let it read, and record() each chunk. */
            escrow_error e;
            memset(&e, 0, sizeof e);
            escrow__fail(&e, ESCROW_SYSTEM, -rc, s->id,
                         "cannot poll the master of %.128s: %s%s", s->id, uv_strerror(rc),
                         rc == UV_EEXIST ? " (read by another stream: record() what it reads)"
                                         : "");
            free(s->poll);
            s->poll = NULL;
            napi_throw(c->env, escrow__node_error(c->env, &e));
            return -1;
        }
        s->poll->data = s;
    }
    s->reading = start;
    if (!start && s->poll != NULL) uv_poll_stop(s->poll);
    /* During a call the queue starts it once the call is done. */
    if (start && !c->busy && s->poll != NULL) uv_poll_start(s->poll, UV_READABLE, on_master);
    return 0;
}

void escrow__node_reads_start(escrow__node_custody *c) {
    for (size_t i = 0; i < c->n; i++) {
        escrow__node_held *s = c->sessions[i];
        if (!s->reading || s->poll == NULL) continue;
        if (master_closed(s)) end_closed(c, s);
        else uv_poll_start(s->poll, UV_READABLE, on_master);
    }
}

void escrow__node_reads_pause(escrow__node_custody *c) {
    for (size_t i = 0; i < c->n; i++)
        if (c->sessions[i]->poll != NULL) uv_poll_stop(c->sessions[i]->poll);
}
