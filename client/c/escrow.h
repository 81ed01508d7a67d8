/* escrow.h: a C client for escrowd, the fd-escrow holder (wire protocol version 1).
 *
 * Written from PROTOCOL.md; C11 and libc only. It is the reference for ports to Swift, Rust
 * and Zig: every file of it, and every section in them, names the PROTOCOL.md section it
 * implements (escrow_internal.h lists the files, and what each is for).
 *
 * Every call:
 * - has a deadline: `timeout` seconds from the call's start (connect, hello and every frame
 *   inside it), and never blocks past it (poll, on non-blocking sockets);
 * - closes every fd it opened or received, on every path, except the fds it hands to the
 *   caller (escrow_retrieved.fd) and those a custody keeps (a duplicate of each master it
 *   holds, closed with the custody), and never closes the caller's fds. A journal file is
 *   mapped and closed at once; one that comes unasked for is closed;
 * - returns an escrow_code, and fills `err` (when not NULL) with the code's name, a message
 *   and the session id the error is about.
 * Nothing here is thread-safe beyond this: different escrow_custody objects may be used from
 * different threads; one custody, from one thread at a time. No call starts a thread. No global state, no signals: sends use MSG_NOSIGNAL (SO_NOSIGPIPE on
 * macOS), so a holder that went away gives ESCROW_UNAVAILABLE, never SIGPIPE.
 */
#ifndef ESCROW_H
#define ESCROW_H

#include <stddef.h>
#include <stdint.h>

#define ESCROW_PROTOCOL_VERSION 1
#define ESCROW_DEFAULT_TIMEOUT 5.0  /* seconds: above the holder's default 3 + 1 */
#define ESCROW_MAX_SOCKET_PATH 103  /* bytes, without the NUL, on every platform */
#define ESCROW_NAME_MAX 128         /* owner and id: [A-Za-z0-9._:@-]{1,128} */
#define ESCROW_LABEL_BYTES 1024     /* 256 code points of UTF-8 */
#define ESCROW_HANDOFF_ID_MAX 64
#define ESCROW_META_MAX 32          /* entries */
#define ESCROW_INTS_MAX 32          /* entries kept from a map of ints; more are ignored */
#define ESCROW_FEATURES_MAX 16      /* names kept from welcome.features; more are ignored */
#define ESCROW_MODES_MAX 16         /* names kept from handoff.restored_modes; more are ignored */

typedef enum escrow_code {
    ESCROW_OK = 0,
    /* The holder's answers (PROTOCOL.md section 9), in that table's order. */
    ESCROW_BAD_REQUEST,
    ESCROW_UNSUPPORTED_VERSION,
    ESCROW_FORBIDDEN,       /* also: the client's own trust checks failed (section 1.3) */
    ESCROW_UNKNOWN,
    ESCROW_EXISTS,
    ESCROW_NOT_A_TERMINAL,
    ESCROW_CUSTODY_HELD,
    ESCROW_BUSY,
    ESCROW_DRAIN_STOP_TIMEOUT,
    ESCROW_LIMIT,
    ESCROW_HANDED_OFF,
    ESCROW_RELEASED,
    ESCROW_EXPIRED,
    ESCROW_ACK_LATE,
    ESCROW_OTHER,           /* a code newer than this client: its name is in err->code_name */
    /* Found by the client; the names match the Python client's codes. */
    ESCROW_UNAVAILABLE,     /* "unavailable": nothing listens, or the holder hung up */
    ESCROW_UNRESPONSIVE,    /* "unresponsive": the deadline passed */
    ESCROW_CONFIG,          /* "config": a bad argument, a path too long, the timeout invariant */
    ESCROW_PROTOCOL,        /* "protocol": the holder sent something that is not the protocol */
    ESCROW_SYSTEM           /* "system": a local call failed (out of memory, out of fds...) */
} escrow_code;

typedef struct escrow_error {
    escrow_code code;
    char code_name[33];                 /* "custody_held", "unresponsive", ... */
    char message[512];                  /* for people; cut if longer */
    char id[ESCROW_NAME_MAX + 1];       /* the session it is about, or "" */
    int sys_errno;                      /* the errno behind it, or 0 */
    int64_t versions[8];                /* unsupported_version: what the holder speaks */
    size_t n_versions;
} escrow_error;

/* A map of str to int as the holder sends it (limits, counters, sessions_by_state): the
 * first ESCROW_INTS_MAX entries with keys up to 63 bytes; the protocol lets them grow. */
typedef struct escrow_ints {
    struct { char key[64]; int64_t value; } entries[ESCROW_INTS_MAX];
    size_t count;
} escrow_ints;

typedef struct escrow_meta {
    const char *key;    /* up to 64 code points */
    const char *value;  /* up to 1024 code points */
} escrow_meta;

typedef struct escrow_welcome {
    int64_t version;
    char holder_version[65];            /* cut if longer */
    int64_t pid;
    double drain_stop_budget, send_deadline, ack_deadline;
    escrow_ints limits;
    /* What the holder has beyond the first version-1 holders (PROTOCOL.md 6.1), an open set:
     * "keep", "retrieve_many", "journal", "update", ... in the order sent; none from an older
     * holder. Names over 32 bytes are left out. escrow_has_feature asks for one. */
    char features[ESCROW_FEATURES_MAX][33];
    size_t n_features;
} escrow_welcome;

typedef struct escrow_session {
    char owner[ESCROW_NAME_MAX + 1];
    char id[ESCROW_NAME_MAX + 1];
    char label[ESCROW_LABEL_BYTES + 1];
    char state[33];                     /* an open set: treat a state you do not know as such */
    int64_t child_pid;                  /* -1: nil */
    int child_alive;                    /* 1 alive, 0 positively dead, -1 nil: cannot tell */
    double deposited_at, state_since;
    int64_t buffered_bytes, dropped_bytes;
    int64_t custodian_pid;              /* -1: nil */
    char handoff_id[ESCROW_HANDOFF_ID_MAX + 1];  /* "": nil */
    int64_t cols, rows;
    escrow_meta meta[ESCROW_META_MAX];  /* strings on the heap: escrow_session_clear */
    size_t meta_count;
    int64_t replay_gap_at;              /* -1: nil (a seamless replay); else the offset in
                                           the replay where one read may be missing */
    int64_t replay_gaps[8];             /* every such spot, oldest first (the first 8) */
    size_t n_replay_gaps;
} escrow_session;

typedef struct escrow_status {
    int64_t pid;
    char version[65];
    double started_at;
    char socket[256];
    escrow_ints sessions_by_state, counters, limits;
    int64_t open_fds, rss_bytes;        /* -1: nil */
    /* Who this holder is, and what it took up when it started (PROTOCOL.md 10.4). */
    char instance[65];                  /* "" from a holder that does not say */
    char fd_store[17];                  /* "systemd", "keeper", "none" */
    int64_t keeper_pid;                 /* -1: nil */
    int64_t adopted, adopted_without_record, adopted_renamed;
    int64_t restarts, unclean_restarts; /* -1: nil, unknown: the holder lost the count (a
                                           total loss must never read as "no restart") */
} escrow_status;

typedef struct escrow_client {
    char owner[ESCROW_NAME_MAX + 1];
    char socket_path[ESCROW_MAX_SOCKET_PATH + 1];
    char client_name[257];
    double timeout;                     /* seconds per call */
} escrow_client;

/* What a custody keeps of each session it holds (escrow_custody.c): a duplicate of the
 * master, the deposit that put it in escrow, its journal. Opaque. */
typedef struct escrow_kept escrow_kept;

/* A custodian connection (PROTOCOL.md 10.2): sessions deposited through it (or retrieved
 * into it) stay `held`, the app still their reader, until it closes. It keeps a duplicate of
 * every master it holds (one fd a session), so that when the holder goes away it can give
 * each again to the next one (escrow_custody_resume). `sock` is -1 while there is no
 * connection (closed, or protection lapsed until a resume). */
typedef struct escrow_custody {
    int sock;
    escrow_welcome welcome;
    const escrow_client *client;
    escrow_kept *kept;                  /* the sessions held here: escrow_custody.c's */
    size_t n_kept, cap_kept;
    int lapsed;                         /* 1: the connection was lost with sessions held */
    int retry_ms;                       /* the back-off before the next resume */
    /* A call whose request left whole and got no answer in time leaves the connection
     * open (closing it would end custody of every session on it): the answer it is owed,
     * and what for, read before anything else is sent (escrow_resume.c). */
    int owed;                           /* 0: none; else what was asked (escrow_resume.c) */
    char owed_id[ESCROW_NAME_MAX + 1];
    int owed_count, owed_unacked;       /* a retrieve's answers still owed (escrow_resume.c) */
    int unkept;                         /* sessions held here that could not be kept at all
                                           (out of memory): unprotected until close */
} escrow_custody;

typedef struct escrow_deposit_opts {
    const char *label;                  /* NULL: "" */
    int64_t child_pid;                  /* <= 0: none (sent as nil, never 0) */
    int64_t cols, rows;
    const escrow_meta *meta;
    size_t meta_count;
    int journal;                        /* 1: ask for a journal (PROTOCOL.md 10.6), then
                                           read with escrow_custody_read (or record with
                                           escrow_custody_record) what the app reads */
} escrow_deposit_opts;

typedef struct escrow_retrieved {
    int fd;                             /* the PTY master, close-on-exec: the caller's */
    escrow_session session;             /* state: `draining` or `exited`, before the retrieve */
    unsigned char *replay;              /* write it to the screen before reading fd */
    size_t replay_len;
    int64_t dropped_bytes;              /* lost off the front of replay */
    int64_t replay_trimmed;             /* then cut after them, so replay starts cleanly
                                           (section 12.2 step 5); 0 unless dropped_bytes */
    int64_t replay_journaled;           /* how many bytes of replay an app recorded */
    int64_t replay_preamble;            /* replay begins with this many bytes of the holder's
                                           that set the modes below (section 12.2 step 5):
                                           write replay to a terminal reset first */
    char restored_modes[ESCROW_MODES_MAX][33];
    size_t n_restored_modes;
    char handoff_id[ESCROW_HANDOFF_ID_MAX + 1];
    int confirmed;                      /* 1: the holder said `done` (or `list` proved it) */
    int journal;                        /* retrieved into custody with a journal granted:
                                           the custody records what escrow_custody_read
                                           reads (the replay stays in the holder's) */
} escrow_retrieved;

/* What a reclaim took back, what it could not, and who answered (PROTOCOL.md 16). An empty
 * report from a holder that adopted nothing after restarts (restarts or unclean_restarts
 * above 0, or -1: unknown) means the escrow was lost, not that there was none. */
typedef struct escrow_reclaim_failure {
    char id[ESCROW_NAME_MAX + 1];
    escrow_error error;                 /* the session's answer: it stays escrowed */
} escrow_reclaim_failure;

typedef struct escrow_reclaim_report {
    escrow_retrieved *retrieved;        /* each fd the caller's; confirmed as for a retrieve */
    size_t n_retrieved;
    escrow_reclaim_failure *failed;
    size_t n_failed;
    char holder_instance[65];
    int64_t adopted;
    int64_t restarts, unclean_restarts; /* -1: unknown */
} escrow_reclaim_report;

/* --- set up ------------------------------------------------------------------------------ */

/* socket_path NULL: $ESCROW_SOCKET, else $XDG_RUNTIME_DIR/escrowd/escrowd.sock, else
 * /tmp/escrowd-<uid>/escrowd.sock. timeout <= 0: ESCROW_DEFAULT_TIMEOUT. */
escrow_code escrow_client_init(escrow_client *c, const char *owner, const char *socket_path,
                               double timeout, escrow_error *err);
escrow_code escrow_default_socket_path(char *buf, size_t size, escrow_error *err);
const char *escrow_code_name(escrow_code code);

/* --- giving terminals to the holder ------------------------------------------------------ */

escrow_code escrow_custody_open(const escrow_client *c, escrow_custody *cu, escrow_error *err);
/* The holder gets its own copy of `fd` (SCM_RIGHTS); the app keeps reading its own, and the
 * custody keeps a duplicate (to give again after a holder restart). With opts->journal, a
 * journal granted is mapped here: read the session with escrow_custody_read from then on.
 * A deposit that got no answer may or may not be escrowed: the duplicate is kept and
 * escrow_custody_protected is 0 until it is settled. ESCROW_UNRESPONSIVE: the deadline
 * passed, the connection stays open (custody of the others with it), and the late answer
 * settles it (escrow_custody_check when escrow_custody_fd turns readable, or the next
 * call); ESCROW_UNAVAILABLE: the connection broke, protection lapsed, and
 * escrow_custody_resume settles it (a holder that has it resumes it, one that has not is
 * given it again). Any call on a custody owed an answer reads that answer first, within
 * its own deadline; if it still does not come, nothing is sent and nothing kept:
 * ESCROW_BUSY (a deposit is not in doubt then; escrow_custody_holds says 0). */
escrow_code escrow_deposit(escrow_custody *cu, const char *id, int fd,
                           const escrow_deposit_opts *opts, escrow_error *err);
escrow_code escrow_custody_release(escrow_custody *cu, const char *id, escrow_error *err);
/* Tell the holder a session's window size or meta changed (PROTOCOL.md 10.5), after setting
 * it on the terminal (TIOCSWINSZ) yourself. cols or rows < 0: unchanged; meta NULL:
 * unchanged, else the meta_count entries replace the whole map (none: an empty map). Any
 * connection of the owner may update any live session; escrow_update uses a fresh one.
 * A holder without "update" in its welcome.features (section 6.1) answers
 * ESCROW_BAD_REQUEST with err->id "", and changes nothing. */
escrow_code escrow_custody_update(escrow_custody *cu, const char *id, int64_t cols, int64_t rows,
                                  const escrow_meta *meta, size_t meta_count,
                                  escrow_error *err);
/* End custody: stop every journal, shut down our side and wait (within the timeout) for the
 * holder to close its side, by when every session held here is draining; close the kept
 * duplicates. The app must not read those fds again. The end of a custody that held
 * sessions is confirmed (PROTOCOL.md 10.4: it may have lapsed, be owed an answer, or have a
 * holder that restarted unnoticed): each session still held by this process on
 * a holder that restarted, or unknown to it, is taken back (journals stopped) and its
 * custody ended again, until the holder's list says it is out of our hands. ESCROW_OK:
 * confirmed (or nothing to confirm); ESCROW_UNAVAILABLE: not within the client's timeout
 * (those sessions may be held by nobody, or not escrowed at all). Closed either way. */
escrow_code escrow_custody_close(escrow_custody *cu);
/* In a forked child that will not exec: drop the inherited custody socket, the duplicates
 * and the journal mappings without a word, so the child never keeps custody alive after the
 * app dies and never writes a journal. */
void escrow_custody_close_in_child(escrow_custody *cu);

/* --- journal: recording what the app reads (PROTOCOL.md 10.6) ---------------------------- */

/* Read up to `size` bytes from the session's master (the custody's duplicate of it, with the
 * blocking mode the app set on the terminal) and record them into its journal, the read
 * marked in flight where the holder reads the mark: what read(2) returns (-1 and errno:
 * EAGAIN, EIO once the terminal hung up). A session without a journal is read only. -1 with
 * errno ENOENT: not held here; EBADF: held here, but no duplicate of it could be kept (read
 * the fd the retrieve gave). */
long escrow_custody_read(escrow_custody *cu, const char *id, void *buf, size_t size);
/* Record bytes the app read itself (one copy into shared memory; a crash between the read
 * and this call loses that read unmarked, which escrow_custody_read does not). Nothing
 * happens for a session without a journal. 0, or -1 with errno ENOENT. */
int escrow_custody_record(escrow_custody *cu, const char *id, const void *data, size_t len);
/* 1: what is read of this session goes into its replay (its journal is mapped); else 0. */
int escrow_custody_journaled(const escrow_custody *cu, const char *id);
/* 1: the custody keeps session `id` and the app is its reader: escrowed, or kept in doubt
 * (a deposit owed its answer, or during a lapse) and given again by the next resume. 0:
 * not held here (never deposited, refused with nothing kept, released, or the holder
 * drains it: the connection it was held on closed by the client on a holder that lives, a
 * resume answered `exists`); escrow_custody_read then fails with ENOENT. Add a session to
 * the app's own table when this says 1, whatever the deposit's code. */
int escrow_custody_holds(const escrow_custody *cu, const char *id);

/* --- when the holder goes away (PROTOCOL.md 10.4) ---------------------------------------- */

/* The fd to watch in the app's run loop for POLLIN: it turns readable when the holder goes
 * away (a crash, an upgrade), and never between calls otherwise (the custody reads it only
 * inside a call). -1 while there is no connection: then call escrow_custody_resume after
 * escrow_custody_retry_ms. It changes with every resume: watch the new one. */
int escrow_custody_fd(const escrow_custody *cu);
/* After escrow_custody_fd turned readable: ESCROW_OK if the holder is still there (nothing
 * was pending, or the late answer to a call that timed out came and settled it: a deposit
 * answered `deposited` is held). A late refusal of a deposit is its code, naming the
 * session in err->id: it is kept, unprotected, and escrow_custody_resume deposits it again.
 * Else the connection is closed, protection has lapsed (escrow_custody_protected 0), and
 * the code says why (ESCROW_UNAVAILABLE). */
escrow_code escrow_custody_check(escrow_custody *cu, escrow_error *err);
/* 1: every session held here is escrowed right now; 0: protection has lapsed, or is not
 * known (a call that timed out is owed its answer), or a session is held here that the
 * custody could not keep a duplicate of (then 0 until it is released). */
int escrow_custody_protected(const escrow_custody *cu);
/* One try, within the timeout: a new connection that holds every kept session again: one the
 * holder adopted is resumed (a deposit from this process of the same terminal), one it does
 * not know is deposited again from the duplicate, journals remapped to the files the answers
 * carry. ESCROW_OK: protected again. Otherwise try again after escrow_custody_retry_ms (the
 * back-off doubles, 100 ms to 2 s); a session the holder refuses (ESCROW_EXISTS: escrowed,
 * but not held for us) names itself in err->id and the others stay held meanwhile. */
escrow_code escrow_custody_resume(escrow_custody *cu, escrow_error *err);
int escrow_custody_retry_ms(const escrow_custody *cu);

/* --- taking them back into custody (PROTOCOL.md 12.6, 12.7, 16) -------------------------- */

/* Retrieve one session into this custody (`retrieve{keep}`): the caller gets out->fd and the
 * replay, and the session stays escrowed, held here, as if deposited. With `journal`, a
 * journal granted is mapped once `done` came (out->journal 1): read with escrow_custody_read.
 * Needs "keep" in the welcome's features (else ESCROW_CONFIG, nothing sent). */
escrow_code escrow_custody_retrieve(escrow_custody *cu, const char *id, int journal,
                                    escrow_retrieved *out, escrow_error *err);
/* Every session of the owner back into this custody, over its connection, under one deadline
 * (`deadline` seconds, <= 0: 8): status (who answered), list, then retrieve_many and ack_many
 * in rounds (section 16: custody_held retried for a 1 s grace, then only where the custodian
 * is positively dead; busy retried). ESCROW_OK: every session is in the report, retrieved or
 * failed; on another code the report still holds what was retrieved (the caller's fds). */
escrow_code escrow_custody_reclaim_all(escrow_custody *cu, int journal, double deadline,
                                       escrow_reclaim_report *out, escrow_error *err);
/* The same out of escrow, on a connection of its own: each session is the caller's alone. */
escrow_code escrow_reclaim_all(const escrow_client *c, double deadline,
                               escrow_reclaim_report *out, escrow_error *err);
void escrow_reclaim_report_free(escrow_reclaim_report *r); /* closes no fd */

/* --- repaint (PROTOCOL.md 12.5) ---------------------------------------------------------- */

/* Make the full-screen program on a retrieved terminal draw its screen again: resize the
 * window one row smaller, wait for the program's answer and for its output to go quiet
 * (50 ms), and set the size back, so its foreground process group gets SIGWINCH twice.
 * Nothing is read from `fd`; bounded by 0.5 s with no answer, 1 s in all. Call it after
 * writing the replay, before reading. ESCROW_SYSTEM (with errno) if an ioctl fails. */
escrow_code escrow_repaint(int fd, escrow_error *err);

/* The hand-off (PROTOCOL.md section 11): deposit on a fresh connection and end custody at
 * once. When it returns ESCROW_OK the holder is draining; `fd` stays open in the caller, who
 * must not read it again and should close it. */
escrow_code escrow_hand_off(const escrow_client *c, const char *id, int fd,
                            const escrow_deposit_opts *opts, escrow_error *err);

/* --- taking them back -------------------------------------------------------------------- */

/* Retrieve (PROTOCOL.md section 12), out of escrow. On ESCROW_OK the caller owns out->fd and frees the rest
 * with escrow_retrieved_free. out->confirmed 0 means the holder could not confirm (it is
 * gone, which took its copy with it, or it did not answer again); escrow_list tells later. */
escrow_code escrow_retrieve(const escrow_client *c, const char *id, escrow_retrieved *out,
                            escrow_error *err);
void escrow_retrieved_free(escrow_retrieved *r); /* does not close r->fd */

/* --- asking ------------------------------------------------------------------------------ */

escrow_code escrow_welcome_of(const escrow_client *c, escrow_welcome *out, escrow_error *err);
escrow_code escrow_list(const escrow_client *c, int all_owners, escrow_session **out,
                        size_t *count, escrow_error *err);
void escrow_sessions_free(escrow_session *sessions, size_t count);
void escrow_session_clear(escrow_session *s);
escrow_code escrow_status_of(const escrow_client *c, escrow_status *out, escrow_error *err);
escrow_code escrow_release(const escrow_client *c, const char *id, escrow_error *err);
escrow_code escrow_update(const escrow_client *c, const char *id, int64_t cols, int64_t rows,
                          const escrow_meta *meta, size_t meta_count, escrow_error *err);
int escrow_ints_get(const escrow_ints *m, const char *key, int64_t *value);
int escrow_has_feature(const escrow_welcome *w, const char *name);

#endif
