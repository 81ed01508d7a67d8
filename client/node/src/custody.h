/* custody.h: what the four files of a custody on the event loop share (PROTOCOL.md 10.2).
 * custody.c is the call queue (one call at a time, off the main thread) and the calls from
 * JS; custody_watch.c is the watcher (the custody's fd, the resume on a timer, 'lapsed' and
 * 'protected'); custody_reads.c is the sessions the custody holds and their reads ('data',
 * 'end'); custody_record.c is what the app read itself, recorded. Only the queue starts and
 * stops the watcher and the reads, and flushes the records: while a call runs, none of them
 * touches the custody.
 */
#ifndef ESCROW_NODE_CUSTODY_H
#define ESCROW_NODE_CUSTODY_H

#include "addon.h"

#include <sys/stat.h>

/* A session this custody holds, as the app sees it: its master, and whether it is read. */
typedef struct escrow__node_held {
    char id[ESCROW_NAME_MAX + 1];
    int fd;
    int journal;
    int reading;         /* the app asked for 'data' */
    uv_poll_t *poll;     /* on the master, started while reading and the custody is idle */
    dev_t dev;           /* the master's file, to tell it from another on the same number */
    ino_t ino;
    int ended;           /* an errno: 'end' is due (the app closed its master) */
    escrow__node_custody *custody;
} escrow__node_held;

typedef struct escrow__node_chunk escrow__node_chunk; /* custody_record.c */

struct escrow__node_custody {
    napi_env env;
    escrow_client client;
    escrow_custody cu;
    int opened, closing, closed, busy;
    int lapsed;                     /* 'lapsed' emitted, 'protected' not yet: mirrors
                                       !escrow_custody_protected after each call and check */
    escrow__node_op *head, *tail;   /* the queue; the one running is not in it */
    napi_ref self, emit;
    napi_async_context context;
    uv_loop_t *loop;
    uv_poll_t *watch;               /* on escrow_custody_fd */
    int watch_fd;
    uv_timer_t *timer;              /* the next resume */
    escrow__node_held **sessions;
    size_t n, cap;
    uv_timer_t *ends;               /* 'end' for a master closed under a paused read */
    escrow__node_chunk *records, *records_tail; /* record()s made while a call ran */
};

/* ---- custody.c: the queue --------------------------------------------------------------- */

/* Append op and run the queue (a uv callback opens a handle scope around it). */
void escrow__node_custody_enqueue(escrow__node_custody *c, escrow__node_op *op);
/* The custody's listener: emit(event, ...args) in JS; a listener's throw is fatal, as any
 * callback's. */
void escrow__node_custody_emit(escrow__node_custody *c, const char *event, size_t argc,
                               napi_value *args);
void escrow__node_free_handle(uv_handle_t *h);

/* ---- custody_watch.c: the watcher ------------------------------------------------------- */

void escrow__node_watch_start(escrow__node_custody *c); /* the queue is empty */
void escrow__node_watch_pause(escrow__node_custody *c); /* a call starts */
/* A call or a check is done: lapse where escrow_custody_protected is 0 (a resume later),
 * 'protected' where it is 1 again after a lapse. */
void escrow__node_watch_after(escrow__node_custody *c, const escrow_error *why);
void escrow__node_watch_close(escrow__node_custody *c); /* the watch and the timer */
/* 1: the connection is open and a call is owed its answer (escrow.h's escrow_custody.owed):
 * the watch on its fd brings that answer, or the hang-up; no resume is needed for it. */
int escrow__node_watch_owed(const escrow__node_custody *c);

/* ---- custody_reads.c: the sessions and their reads -------------------------------------- */

escrow__node_held *escrow__node_session_find(escrow__node_custody *c, const char *id);
/* The app holds `fd` for `id` now (a deposit, a retrieve into custody, a reclaim). */
void escrow__node_session_add(escrow__node_custody *c, const char *id, int fd);
void escrow__node_session_remove(escrow__node_custody *c, const char *id);
/* After a call or a check: a session the C custody no longer keeps leaves (its poll
 * closed), and each one's journal is what the C custody maps now. */
void escrow__node_sessions_sync(escrow__node_custody *c);
/* startReading / stopReading: 0, or -1 with a JS error thrown. */
int escrow__node_session_read(escrow__node_custody *c, escrow__node_held *s, int start);
void escrow__node_reads_start(escrow__node_custody *c); /* the queue is empty */
void escrow__node_reads_pause(escrow__node_custody *c); /* a call starts */
void escrow__node_reads_close(escrow__node_custody *c); /* the custody is closed */

/* ---- custody_record.c: what the app read itself --------------------------------------- */

/* escrow_custody_record now, or queued behind a running call (or chunks still waiting):
 * 0, or -1 out of memory. */
int escrow__node_record(escrow__node_custody *c, const char *id, const void *data, size_t len);
/* A call is done (busy 0): the queued chunks, in order. */
void escrow__node_records_flush(escrow__node_custody *c);
void escrow__node_records_free(escrow__node_custody *c);

#endif
