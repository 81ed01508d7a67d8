/* escrow_internal.h: what the files of the C client share with each other; no app includes it.
 *
 * The client's files have one concern each, read in this order; each uses only the files
 * above it, and every section in them names the PROTOCOL.md section it implements:
 *
 *   escrow_errors.c   errors and deadlines: the codes (section 9), and every wait a poll
 *                     bounded by the time left (sections 1.5 and 12.1)
 *   escrow_codec.c    MessagePack by hand (section 3), the messages (section 7), and how
 *                     many fds each message comes with (section 4's table)
 *   escrow_frames.c   frames, and the fds that ride on them (sections 2 and 4, and 1.4's
 *                     error read after EPIPE)
 *   escrow_connect.c  the socket's path, the trust checks, connect (section 1), hello and
 *                     welcome, one request at a time (section 5), the timeout invariant
 *                     (section 12.1)
 *   escrow_journal.c  the journal writer: the file's checks, its counters, the `reading`
 *                     mark (section 10.6)
 *   escrow_resume.c   the custody's connection kept in step (the answer a call that timed
 *                     out is owed), and taking custody back when the holder goes away: check,
 *                     resume, the back-off (sections 10.4 and 5)
 *   escrow_custody.c  custody: deposit, release, update, what a custody keeps of each
 *                     session, its journal (sections 10.2, 10.5, 10.6, 12.6)
 *   escrow_custody_end.c
 *                     the end of custody, confirmed by the holder's list whenever it held
 *                     sessions (sections 10.2, 10.4 and 11)
 *   escrow.c          the calls of escrow.h on fresh connections: the hand-off, list,
 *                     status, release, update, retrieve (sections 8, 11 and 12)
 *   escrow_retrieve_many.c
 *                     one exchange of retrieve or retrieve_many, its checks, ack or
 *                     ack_many, and a `done` that never came (sections 12.2, 12.3, 12.6,
 *                     12.7); retrieve into custody
 *   escrow_reclaim.c  every session at launch in rounds of those, with its report
 *                     (section 16)
 *   escrow_repaint.c  the program on a retrieved terminal made to redraw (section 12.5)
 *
 * A port reads them in that order; one whose language has MessagePack skips the first
 * section of escrow_codec.c.
 *
 * The fds: a socket is the connection's (`conn.sock`) from escrow__connect_greet until
 * escrow__conn_close; a received fd is its frame's (`frame.fds`) until escrow__frame_free
 * closes it, unless a call takes it out of the frame first (only escrow_retrieve does, for
 * the master it hands back). A function that fails has closed whatever it opened.
 *
 * Every function here has external linkage, so its name carries the prefix `escrow__`: an
 * app links these objects next to its own names, and none may clash. A function without the
 * prefix is escrow.h's, or static: private to its file. Include this header first: it sets
 * what the system headers must see before they are read.
 */
#ifndef ESCROW_INTERNAL_H
#define ESCROW_INTERNAL_H

#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* SOCK_CLOEXEC, MSG_CMSG_CLOEXEC, struct ucred for SO_PEERCRED */
#endif

#include "escrow.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#ifdef MSG_NOSIGNAL
#define SEND_FLAGS MSG_NOSIGNAL /* a holder that hung up gives EPIPE, not SIGPIPE */
#else
#define SEND_FLAGS 0 /* macOS: SO_NOSIGPIPE is set on the socket instead */
#endif
#ifdef MSG_CMSG_CLOEXEC
#define RECV_FLAGS MSG_CMSG_CLOEXEC /* received fds are close-on-exec from birth */
#else
#define RECV_FLAGS 0 /* macOS: FD_CLOEXEC is set right after recvmsg */
#endif

#define MAX_FDS_SEEN 8 /* room for more than one: too many are seen, and closed */

#ifdef __GNUC__
#define PRINTF_LIKE(f, a) __attribute__((format(printf, f, a)))
#else
#define PRINTF_LIKE(f, a)
#endif

/* ---- escrow_errors.c: errors and deadlines ---------------------------------------------- */

/* Fill `err` (when there is one) and return `code`. */
escrow_code PRINTF_LIKE(5, 6)
escrow__fail(escrow_error *err, escrow_code code, int sys_errno, const char *id,
             const char *fmt, ...);
/* The code an `error` frame names; ESCROW_OTHER for one newer than this client. */
escrow_code escrow__code_from_name(const char *name);
double escrow__now(void); /* CLOCK_MONOTONIC, in seconds: every deadline is on it */
int escrow__ms_left(double deadline);
int escrow__wait_io(int sock, short events, double deadline);
escrow_code escrow__io_failed(escrow_error *err, int e, const char *what);

/* ---- escrow_codec.c: the bytes of every message ----------------------------------------- */

/* A request being written: a growing buffer, its frame header first. */
typedef struct mp_out {
    unsigned char *data;
    size_t len, cap;
    int failed; /* out of memory: every later put is ignored, and the frame is refused */
} mp_out;

/* One frame as it arrived: its body, its `type`, and every fd that came with it. */
typedef struct frame {
    unsigned char *body;
    size_t len;
    char type[16];
    int fds[MAX_FDS_SEEN]; /* the first fds received; any beyond are closed at once */
    size_t nfds;           /* how many arrived in all */
} frame;

/* A Journal (section 10.6) | nil: where an app that journals writes. The API asks for none,
 * so it only reads one (and closes the journal file that comes with it). */
typedef struct journal_info {
    int set; /* 0: nil */
    int64_t capacity, total, position;
} journal_info;

/* A ReplayFile (section 12.8) | nil: where a replay sent by reference is. The API never asks
 * for one, so a handoff that has one anyway is refused (not acked). */
typedef struct replay_file_info {
    int set; /* 0: nil */
    int64_t offset, length;
} replay_file_info;

/* Requests: each writes a whole frame into `o` (free o->data after, whatever the result). */
escrow_code escrow__encode_hello(mp_out *o, const escrow_client *c, escrow_error *err);
escrow_code escrow__encode_deposit(mp_out *o, const char *id, const escrow_deposit_opts *opts,
                                   int journal, escrow_error *err);
escrow_code escrow__encode_id(mp_out *o, const char *type, const char *id, escrow_error *err);
escrow_code escrow__encode_retrieve(mp_out *o, const char *id, int keep, int journal,
                                    int replay_file, escrow_error *err);
escrow_code escrow__encode_ack(mp_out *o, const char *id, const char *handoff_id, int keep,
                               escrow_error *err);
escrow_code escrow__encode_update(mp_out *o, const char *id, int64_t cols, int64_t rows,
                                  const escrow_meta *meta, size_t meta_count,
                                  escrow_error *err);
escrow_code escrow__encode_list(mp_out *o, int all_owners, escrow_error *err);
escrow_code escrow__encode_status(mp_out *o, escrow_error *err);

/* What a frame is, and how many fds it must come with (section 4). */
int escrow__frame_type(const unsigned char *body, size_t len, char type[16]);
size_t escrow__fds_carried(const frame *f);

/* Answers: 0, or -1 when the body is not that message. */
int escrow__decode_welcome(const frame *f, escrow_welcome *w);
int escrow__decode_id(const frame *f, char id[ESCROW_NAME_MAX + 1]);
int escrow__decode_deposited(const frame *f, char id[ESCROW_NAME_MAX + 1], journal_info *j);
int escrow__decode_handoff(const frame *f, escrow_retrieved *out, journal_info *j,
                           replay_file_info *rf);
int escrow__decode_sessions(const frame *f, escrow_session **out, size_t *count);
int escrow__decode_status(const frame *f, escrow_status *s);
int escrow__decode_error_fields(const frame *f, escrow_error *e);
/* An `error` frame, as the escrow_code it names (ESCROW_OTHER for a code newer than us). */
escrow_code escrow__decode_error(const frame *f, escrow_error *err);

/* retrieve_many, ack_many and done_many (section 12.7): escrow_retrieve_many.c speaks them. */
escrow_code escrow__encode_retrieve_many(mp_out *o, const char *const *ids, size_t count,
                                         int keep, int journal, int replay_file,
                                         escrow_error *err);
escrow_code escrow__encode_ack_many(mp_out *o, const char *const *ids,
                                    const char *const *handoff_ids, size_t count, int keep,
                                    escrow_error *err);
#define ESCROW__BATCH_MAX 4096 /* ids in one retrieve_many, ack_many or done_many */
/* A count other than `expected` (0: any from 0 to ESCROW__BATCH_MAX) is refused unallocated. */
int escrow__decode_done_many(const frame *f, size_t expected,
                             char (**ids)[ESCROW_NAME_MAX + 1], size_t *count);

/* ---- escrow_frames.c: frames, and the fds that ride on them ----------------------------- */

void escrow__frame_free(frame *f); /* closes every fd still in the frame */
escrow_code escrow__recv_frame(int sock, double deadline, frame *f, escrow_error *err);
escrow_code escrow__send_frame(int sock, const unsigned char *data, size_t len, int fd,
                               double deadline, escrow_error *err);

/* ---- escrow_connect.c: a greeted connection --------------------------------------------- */

typedef escrow_custody conn; /* any greeted connection; a custody is one that deposited */

escrow_code escrow__connect_greet(const escrow_client *cl, conn *c, double deadline,
                                  escrow_error *err);
void escrow__conn_close(conn *c);
escrow_code escrow__call(conn *c, mp_out *o, int fd, const char *want, double deadline,
                         frame *f, escrow_error *err);
/* The same with no fd, within the client's timeout, for an answer `want`{id}: release,
 * update (a malformed one is ESCROW_PROTOCOL, naming `id`). */
escrow_code escrow__call_id(conn *c, mp_out *o, const char *want, const char *id,
                            escrow_error *err);
escrow_code escrow__check_retrieve_time(const conn *c, double deadline, const char *id,
                                        escrow_error *err);

/* ---- escrow.c: retrieve (section 12) ----------------------------------------------------- */

/* `done` never came for `r` (acked, its fd held unread): the table of 12.3, on a fresh
 * connection. On any code but ESCROW_OK the fd was closed and `r` freed. */
escrow_code escrow__resolve(const escrow_client *c, escrow_retrieved *r, escrow_error *err);
/* Ack `r` (not into custody) again on a fresh connection (section 10.4): a holder that
 * restarted and adopted our handoff completes it there. 1 on its `done`; -1 on ack_late,
 * the holder's words in `err` when not NULL (it kept the session and drains it); 0 on
 * anything else, to ask again (busy: our first connection's handoff is still being wound
 * up; or no answer). */
int escrow__ack_again(const escrow_client *c, const escrow_retrieved *r, double deadline,
                      escrow_error *err);

/* ---- escrow_journal.c: the journal writer (section 10.6) -------------------------------- */

/* One session's journal file, mapped shared and writable; `base` NULL: none. */
typedef struct escrow__journal {
    unsigned char *base;    /* the mapping: the header page, then the ring */
    size_t size;            /* of the mapping */
    uint64_t capacity;      /* the ring's bytes */
    int mark_reading;       /* the holder reads `reading` ("journal_reading") */
    int dontfork;           /* MADV_DONTFORK took: a forked child has no such mapping */
} escrow__journal;

/* Check the file (section 10.6, "Check it before the first write") and map it, with
 * MADV_DONTFORK where there is one; `info` is the message's Journal (0 < capacity <= the
 * file's data size; NULL: the caller kept none, and the ring is the data). Does not close
 * `fd` (the caller does, at once). -1:
 * not a journal this writer understands (nothing mapped; the session is escrowed all the
 * same, without a journal). */
int escrow__journal_map(escrow__journal *j, int fd, const journal_info *info,
                        int mark_reading);
void escrow__journal_unmap(escrow__journal *j);
/* Record bytes read from the master (pieces of at most 8192, `writing`, copy, `total`). */
void escrow__journal_record(escrow__journal *j, const void *data, size_t len);
/* read(2) on `master` whose bytes are recorded, marked in flight (or, for a holder without
 * the mark, read straight into the ring once the master is readable). */
long escrow__journal_read(escrow__journal *j, int master, void *buf, size_t size);

/* ---- escrow_resume.c: the custody's connection, and taking custody back (10.4) ---------- */

/* One session held here (section 10.4): what is needed to give it to the next holder. */
struct escrow_kept {
    char id[ESCROW_NAME_MAX + 1];
    int fd;                             /* our duplicate of the master; -1: none could be
                                           made (held, unprotected until released) */
    char *label;                        /* the deposit, as last updated: heap strings */
    int64_t child_pid, cols, rows;
    escrow_meta *meta;
    size_t meta_count;
    int journal_asked;                  /* deposits again ask for a journal */
    escrow__journal journal;            /* base NULL: none */
    int held;                           /* 1: held on the connection we have now; 0: not,
                                           or not known yet (a deposit owed its answer) */
    int gone;                           /* 1: the holder drains it (we closed the connection
                                           it was held on, or a resume got `exists`): not
                                           read here until a resume holds it again */
};

/* What a call on the custody's connection was (escrow_custody.owed). A retrieve into
 * custody whose `done` came late (12.6) is owed that frame, and then the answer to the
 * `status` that ended a refused handoff's wait when there was one: each read and dropped,
 * since the list asked on a fresh connection has decided those sessions already. A status
 * or a list (a reclaim's survey) is owed its one answer, dropped too. A retrieve whose
 * answers did not all come is owed `owed_count` more (handoffs closed unacked, errors),
 * then, when a handoff went unacked (`owed_unacked`), a `status` is sent to end the
 * holder's wait for our ack, and its answer is owed (as client/channel.py's _resync). */
enum { ESCROW__OWED_NONE, ESCROW__OWED_DEPOSIT, ESCROW__OWED_RELEASE, ESCROW__OWED_UPDATE,
       ESCROW__OWED_DONE, ESCROW__OWED_DONE_STATUS, ESCROW__OWED_STATUS, ESCROW__OWED_LIST,
       ESCROW__OWED_RETRIEVE };

/* Before anything is sent on the custody's connection: the answer it is owed, read within
 * `deadline` and acted on. ESCROW_OK: in step (nothing owed). ESCROW_BUSY: still owed
 * (nothing may be sent, nothing was), naming `id`. A broken connection is lost (lapsed),
 * and its code returned; a late refusal of a deposit is its code (the session kept, not
 * held: resume it). */
escrow_code escrow__custody_in_step(escrow_custody *cu, double deadline, const char *id,
                                    escrow_error *err);
/* One request and its answer (`want`, or an error) on the custody's connection, in step
 * first, all by `deadline`. No answer in time for a request that left whole: owed (`kind`,
 * `id`), the connection kept. A broken one (a hang-up, a reset, a broken or unexpected
 * frame): lost. `*doubt` 1: the request may have reached the holder and no answer was
 * believed. */
escrow_code escrow__custody_call(escrow_custody *cu, mp_out *o, int fd, const char *want,
                                 int kind, const char *id, double deadline, frame *f,
                                 int *doubt, escrow_error *err);
/* Kept session `k` as a deposit on the custody's connection (a new session, or a resume of
 * one held for this process before) by `deadline`; held once `deposited` came, its journal
 * moved to the file that answer carried. `*doubt` as for escrow__custody_call. */
escrow_code escrow__custody_send_deposit(escrow_custody *cu, escrow_kept *k, double deadline,
                                         int *doubt, escrow_error *err);
/* The custody's connection failed in a call with no answer (`why`): closed, protection
 * lapsed. ESCROW_UNAVAILABLE: the holder hung up (went away: the next one adopts what it
 * held, and the app goes on reading). Anything else: closed by us on a holder that lives,
 * which drains every session held on it from now: each is `gone`, its journal unmapped. */
void escrow__custody_lost(escrow_custody *cu, escrow_code why);

/* ---- escrow_custody.c: what a custody keeps (sections 10.2, 12.6) ------------------------ */

/* A session retrieved into custody `cu`: keep a duplicate of r->fd, the session's deposit
 * (from r->session: label, child_pid, size, meta; `journal` 1: the retrieve asked for a
 * journal, and every deposit of it again asks for one) and, when `journal_fd` >= 0, map
 * that journal file (closing it; `info` the handoff's Journal, checked against the file:
 * section 10.6) and set r->journal. `held` 1: its `done` came, or the holder says it is
 * held by us, on the custody's connection, still open; 0: that connection is gone, or the
 * holder has no copy (alone, out of escrow): it is deposited again from the duplicate at
 * once when the connection can take it, else by the next resume (the custody lapsed until
 * then), and no journal is mapped meanwhile. ESCROW_SYSTEM if it cannot keep it: the
 * session is ours all the same, and escrow_custody_protected stays 0 until it is released
 * (a resume cannot give it to the next holder). */
escrow_code escrow__custody_keep(escrow_custody *cu, escrow_retrieved *r, int journal,
                                 int journal_fd, const journal_info *info, int held,
                                 escrow_error *err);
/* ESCROW_OK while `cu` has a connection; else, naming `id`, ESCROW_UNAVAILABLE while it is
 * lapsed (nothing sent: escrow_custody_resume first), ESCROW_CONFIG once it is closed. */
escrow_code escrow__custody_connected(const escrow_custody *cu, const char *id,
                                      escrow_error *err);
/* 1: `cu` keeps session `id` (its duplicate, for the next holder), settled or not: the
 * custody holds it; 0: it does not (never deposited, refused, released). */
int escrow__custody_keeps(const escrow_custody *cu, const char *id);
/* Kept session `k` dropped from the table: its journal unmapped, its duplicate closed. */
void escrow__custody_drop(escrow_custody *cu, escrow_kept *k);
/* Every kept session dropped so, and the custody as if it never held any (nothing owed, not
 * lapsed): what closing it leaves, its connection closed first. */
void escrow__custody_forget(escrow_custody *cu);

/* ---- escrow_retrieve_many.c: one exchange (sections 12.2, 12.3, 12.6, 12.7) ------------- */

/* Retrieve ids[0..n) over `c` in one request (into custody `cu`, on its connection, when
 * not NULL). Every id ends with its answer in errs[i]: ESCROW_OK, taken and appended to
 * `into` (the caller's fd; with `cu`, kept by the custody too). Returns what spoiled the
 * whole call, if anything (then `c` is closed, or with `cu` lapsed; a `done` that did not
 * come in time into custody leaves the connection open, owed it). */
escrow_code escrow__exchange(conn *c, escrow_custody *cu, const char *const *ids, size_t n,
                             int journal, double deadline, escrow_reclaim_report *into,
                             escrow_error *errs);
/* As escrow__custody_connected, then ESCROW_CONFIG, naming `id`, unless the holder it is
 * connected to has "keep". */
escrow_code escrow__custody_usable(escrow_custody *cu, const char *id, escrow_error *err);

#endif
