/* escrow_custody.c: custody, and what it keeps so that it survives the holder.
 *
 * A custodian connection (PROTOCOL.md section 10.2) deposits terminals, releases and updates
 * them (10.5); while it is open every session it holds stays `held`, the app their reader,
 * and when it closes (SHUT_WR, then the holder's end of stream) they drain. A custody keeps,
 * for each session it holds, a duplicate of the master, the deposit that escrowed it (its
 * label, child, size and meta, kept current by update) and its journal (10.6), so that when
 * the holder goes away (a crash, an upgrade: the connection hangs up, escrow_custody_fd
 * turns readable) it can take custody back on the next one (10.4): a session that holder
 * adopted is resumed (a deposit from this process of the same terminal, answered
 * `deposited`), one it does not know is deposited again from the duplicate. A `deposited`
 * with a journal file moves the writer to it; one with none stops the writer, since that
 * holder will never read the old file. `exists` means escrowed but no longer held for us:
 * its journal stops and it is asked again later; the others are held meanwhile.
 *
 * No threads and no signals: the app watches escrow_custody_fd in its own loop and calls
 * escrow_custody_check, then escrow_custody_resume after escrow_custody_retry_ms. A call that
 * got no answer (the holder hung up, the deadline passed, an answer that is not the
 * protocol) cannot tell what the holder did, and the connection is out of step: it is closed
 * and protection has lapsed until a resume, which settles a deposit that got no answer (a
 * holder that has it resumes it, one that has not is given it again). Nothing is given up on
 * a guess.
 *
 * The fds: the connection is the custody's (`sock`) until escrow_custody_close, a lapse or
 * a resume replaces it. Each kept session owns one fd, its duplicate (F_DUPFD_CLOEXEC), closed
 * when it is released or custody closes (also in a forked child). A journal file that comes
 * with an answer is mapped and closed with its frame; the mapping ends before custody does.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define RETRY_FIRST_MS 100
#define RETRY_MAX_MS 2000

/* One session held here (section 10.4): what is needed to give it to the next holder. */
struct escrow_kept {
    char id[ESCROW_NAME_MAX + 1];
    int fd;                             /* our duplicate of the master */
    char *label;                        /* the deposit, as last updated: heap strings */
    int64_t child_pid, cols, rows;
    escrow_meta *meta;
    size_t meta_count;
    int journal_asked;                  /* deposits again ask for a journal */
    escrow__journal journal;            /* base NULL: none */
    int held;                           /* 1: held on the connection we have now */
};

/* ---- the kept table ----------------------------------------------------------------------- */

static escrow_kept *find(const escrow_custody *cu, const char *id) {
    for (size_t i = 0; i < cu->n_kept; i++)
        if (strcmp(cu->kept[i].id, id) == 0) return &cu->kept[i];
    return NULL;
}

static char *copy_str(const char *s) {
    size_t n = strlen(s != NULL ? s : "") + 1;
    char *out = malloc(n);
    if (out != NULL) memcpy(out, s != NULL ? s : "", n);
    return out;
}

static void free_meta(escrow_meta *meta, size_t count) {
    for (size_t i = 0; i < count; i++) {
        free((char *)meta[i].key);
        free((char *)meta[i].value);
    }
    free(meta);
}

/* A heap copy of `count` entries, or -1 (nothing allocated). */
static int copy_meta(const escrow_meta *meta, size_t count, escrow_meta **out) {
    *out = NULL;
    if (count == 0) return 0;
    escrow_meta *m = calloc(count, sizeof *m);
    if (m == NULL) return -1;
    for (size_t i = 0; i < count; i++) {
        m[i].key = copy_str(meta[i].key);
        m[i].value = copy_str(meta[i].value);
        if (m[i].key == NULL || m[i].value == NULL) {
            free_meta(m, i + 1);
            return -1;
        }
    }
    *out = m;
    return 0;
}

/* Fill `k` (not yet in the table) with a duplicate of `fd` and a copy of the deposit. */
static escrow_code kept_init(escrow_kept *k, const char *id, int fd, const char *label,
                             int64_t child_pid, int64_t cols, int64_t rows,
                             const escrow_meta *meta, size_t meta_count, escrow_error *err) {
    memset(k, 0, sizeof *k);
    snprintf(k->id, sizeof k->id, "%s", id);
    k->child_pid = child_pid;
    k->cols = cols;
    k->rows = rows;
    k->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (k->fd < 0)
        return escrow__fail(err, ESCROW_SYSTEM, errno, id, "cannot keep a duplicate of %s: %s",
                            id, strerror(errno));
    k->label = copy_str(label);
    if (k->label == NULL || copy_meta(meta, meta_count, &k->meta) != 0) {
        free(k->label);
        close(k->fd);
        return escrow__fail(err, ESCROW_SYSTEM, ENOMEM, id, "out of memory keeping %s", id);
    }
    k->meta_count = meta_count;
    return ESCROW_OK;
}

static void kept_free(escrow_kept *k) {
    escrow__journal_unmap(&k->journal);
    if (k->fd >= 0) close(k->fd);
    k->fd = -1;
    free(k->label);
    free_meta(k->meta, k->meta_count);
}

/* Put `k` in the table (taking what it owns), or free it and fail. */
static escrow_code kept_add(escrow_custody *cu, escrow_kept *k, escrow_error *err) {
    if (cu->n_kept == cu->cap_kept) {
        size_t cap = cu->cap_kept ? cu->cap_kept * 2 : 4;
        escrow_kept *grown = realloc(cu->kept, cap * sizeof *grown);
        if (grown == NULL) {
            kept_free(k);
            return escrow__fail(err, ESCROW_SYSTEM, ENOMEM, k->id, "out of memory keeping %s",
                                k->id);
        }
        cu->kept = grown;
        cu->cap_kept = cap;
    }
    cu->kept[cu->n_kept++] = *k;
    return ESCROW_OK;
}

static void kept_drop(escrow_custody *cu, escrow_kept *k) {
    kept_free(k);
    *k = cu->kept[--cu->n_kept];
}

static void drop_all(escrow_custody *cu) {
    for (size_t i = 0; i < cu->n_kept; i++) kept_free(&cu->kept[i]);
    free(cu->kept);
    cu->kept = NULL;
    cu->n_kept = cu->cap_kept = 0;
}

/* The journal file an answer carried (its last fd), mapped for `k`; an answer with none
 * stops the writer: that holder will never read the old file (section 10.4). The file
 * stays the frame's, closed with it. */
static void take_journal(escrow_custody *cu, escrow_kept *k, const journal_info *info,
                         const frame *f, int fd_at) {
    escrow__journal_unmap(&k->journal); /* the same file again, or another: remapped */
    if (!info->set || f->nfds <= (size_t)fd_at) return;
    /* A file that fails the checks is not journaled: escrowed all the same. */
    (void)escrow__journal_map(&k->journal, f->fds[fd_at],
                              escrow_has_feature(&cu->welcome, "journal_reading"));
}

/* ---- lapses (PROTOCOL.md 10.4) ------------------------------------------------------------ */

void escrow__custody_lost(escrow_custody *cu) {
    escrow__conn_close(cu);
    for (size_t i = 0; i < cu->n_kept; i++) cu->kept[i].held = 0;
    cu->lapsed = 1;
    if (cu->retry_ms <= 0) cu->retry_ms = RETRY_FIRST_MS;
}

/* A call that failed this way got no answer we can believe: what the holder did is not
 * known, and the connection is out of step. */
static int no_answer(escrow_code rc) {
    return rc == ESCROW_UNAVAILABLE || rc == ESCROW_UNRESPONSIVE || rc == ESCROW_PROTOCOL ||
           rc == ESCROW_SYSTEM;
}

static escrow_code usable(const escrow_custody *cu, const char *id, escrow_error *err) {
    if (cu->sock >= 0) return ESCROW_OK;
    if (cu->lapsed)
        return escrow__fail(err, ESCROW_UNAVAILABLE, 0, id,
                            "custody lapsed (the holder went away): escrow_custody_resume "
                            "first");
    return escrow__fail(err, ESCROW_CONFIG, 0, id, "this custody is closed");
}

/* ---- custody (PROTOCOL.md sections 10.2 and 10.5) ----------------------------------------- */

escrow_code escrow_custody_open(const escrow_client *c, escrow_custody *cu, escrow_error *err) {
    return escrow__connect_greet(c, cu, escrow__now() + c->timeout, err);
}

/* Send kept session `k` as a deposit on `cu`'s connection: a new session, or a resume of one
 * the holder has held for this process (section 10.4). `*doubt` 1: it got no answer (see
 * no_answer), and whether the holder has it is not known. */
static escrow_code send_deposit(escrow_custody *cu, escrow_kept *k, int *doubt,
                                escrow_error *err) {
    mp_out o = {0};
    frame f;
    escrow_deposit_opts opts = {k->label, k->child_pid, k->cols, k->rows, k->meta,
                                k->meta_count, k->journal_asked};
    *doubt = 0;
    escrow_code rc = escrow__encode_deposit(&o, k->id, &opts, k->journal_asked, err);
    if (rc != ESCROW_OK) {
        free(o.data); /* not sent: no doubt about it */
        return rc;
    }
    rc = escrow__call(cu, &o, k->fd, "deposited", escrow__now() + cu->client->timeout, &f, err);
    free(o.data);
    if (rc != ESCROW_OK) {
        *doubt = no_answer(rc);
        return rc;
    }
    char got[ESCROW_NAME_MAX + 1];
    journal_info journal;
    if (escrow__decode_deposited(&f, got, &journal) != 0 || strcmp(got, k->id) != 0) {
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, k->id, "a malformed deposited");
        *doubt = 1;
    } else {
        take_journal(cu, k, &journal, &f, 0);
        k->held = 1;
    }
    escrow__frame_free(&f);
    return rc;
}

escrow_code escrow_deposit(escrow_custody *cu, const char *id, int fd,
                           const escrow_deposit_opts *opts, escrow_error *err) {
    static const escrow_deposit_opts none = {NULL, 0, 0, 0, NULL, 0, 0};
    escrow_kept k;
    escrow_code rc = usable(cu, id, err);
    if (rc != ESCROW_OK) return rc;
    if (opts == NULL) opts = &none;
    if (find(cu, id) != NULL)
        return escrow__fail(err, ESCROW_EXISTS, 0, id, "session %s is held by this custody", id);
    rc = kept_init(&k, id, fd, opts->label, opts->child_pid, opts->cols, opts->rows,
                   opts->meta, opts->meta_count, err);
    if (rc != ESCROW_OK) return rc;
    k.journal_asked = opts->journal != 0;
    int doubt;
    rc = send_deposit(cu, &k, &doubt, err);
    if (rc == ESCROW_OK) return kept_add(cu, &k, err);
    if (!doubt) {
        kept_free(&k); /* the holder answered: it does not have it */
        return rc;
    }
    /* Escrowed or not, nobody can say: keep the duplicate for the resume to settle. */
    escrow_code kept = kept_add(cu, &k, NULL);
    escrow__custody_lost(cu);
    if (kept != ESCROW_OK && err != NULL) err->sys_errno = ENOMEM;
    return rc;
}

/* A call with one {id} answer on a greeted connection: release, update. */
static escrow_code one_answer(conn *c, mp_out *o, const char *want, const char *id,
                              escrow_error *err) {
    frame f;
    escrow_code rc = escrow__call(c, o, -1, want, escrow__now() + c->client->timeout, &f, err);
    if (rc != ESCROW_OK) return rc;
    char got[ESCROW_NAME_MAX + 1];
    if (escrow__decode_id(&f, got) != 0)
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, id, "a malformed %s", want);
    escrow__frame_free(&f);
    return rc;
}

/* The same on the custody's connection, which an answer that never came leaves out of step:
 * lapsed. While it is lapsed, on a connection of its own (any connection of the owner may
 * release or update any session: 10.2, 10.5). */
static escrow_code id_call(escrow_custody *cu, mp_out *o, const char *want, const char *id,
                           escrow_error *err) {
    if (cu->sock < 0) {
        conn cn;
        escrow_code rc = escrow__connect_greet(cu->client, &cn,
                                               escrow__now() + cu->client->timeout, err);
        if (rc == ESCROW_OK) rc = one_answer(&cn, o, want, id, err);
        escrow__conn_close(&cn);
        return rc;
    }
    escrow_code rc = one_answer(cu, o, want, id, err);
    if (no_answer(rc)) escrow__custody_lost(cu);
    return rc;
}

escrow_code escrow_custody_release(escrow_custody *cu, const char *id, escrow_error *err) {
    mp_out o = {0};
    escrow_code rc = usable(cu, id, err);
    if (rc != ESCROW_OK && !cu->lapsed) return rc;
    escrow_kept *k = find(cu, id);
    int pending = k != NULL && !k->held;
    if (k != NULL) kept_drop(cu, k); /* its journal stops before the holder hears (10.6) */
    rc = escrow__encode_id(&o, "release", id, err);
    if (rc == ESCROW_OK) rc = id_call(cu, &o, "released", id, err);
    free(o.data);
    if (rc == ESCROW_UNKNOWN && pending) rc = ESCROW_OK; /* a deposit that never arrived */
    return rc;
}

escrow_code escrow_custody_update(escrow_custody *cu, const char *id, int64_t cols, int64_t rows,
                                  const escrow_meta *meta, size_t meta_count,
                                  escrow_error *err) {
    mp_out o = {0};
    escrow_code rc = usable(cu, id, err);
    if (rc != ESCROW_OK && !cu->lapsed) return rc;
    rc = escrow__encode_update(&o, id, cols, rows, meta, meta_count, err);
    if (rc == ESCROW_OK) rc = id_call(cu, &o, "updated", id, err);
    free(o.data);
    escrow_kept *k = find(cu, id);
    if (rc != ESCROW_OK || k == NULL) return rc;
    /* A deposit made again after a holder lost it carries the current values (10.5). */
    if (cols >= 0) k->cols = cols;
    if (rows >= 0) k->rows = rows;
    if (meta != NULL) {
        escrow_meta *copy;
        if (copy_meta(meta, meta_count, &copy) != 0)
            return escrow__fail(err, ESCROW_SYSTEM, ENOMEM, id,
                                "updated, but out of memory keeping the new meta of %s", id);
        free_meta(k->meta, k->meta_count);
        k->meta = copy;
        k->meta_count = meta_count;
    }
    return ESCROW_OK;
}

void escrow_custody_close(escrow_custody *cu) {
    /* The journals stop before custody ends: from then on each ring is the holder's. */
    for (size_t i = 0; i < cu->n_kept; i++) escrow__journal_unmap(&cu->kept[i].journal);
    if (cu->sock >= 0) {
        /* The holder closes its side once it has ended our custody: every session held here
         * is draining by then. Nothing else arrives after our SHUT_WR (section 11). */
        double deadline = escrow__now() + cu->client->timeout;
        if (shutdown(cu->sock, SHUT_WR) == 0) {
            unsigned char sink[256];
            for (;;) {
                ssize_t n = recv(cu->sock, sink, sizeof sink, 0);
                if (n == 0) break;
                if (n > 0 || errno == EINTR) continue;
                if ((errno != EAGAIN && errno != EWOULDBLOCK) ||
                    escrow__wait_io(cu->sock, POLLIN, deadline) != 0)
                    break; /* the holder acts on our hang-up anyway; waiting was a courtesy */
            }
        }
        escrow__conn_close(cu);
    }
    drop_all(cu); /* the app must not read them again: the holder does */
    cu->lapsed = 0;
}

void escrow_custody_close_in_child(escrow_custody *cu) {
    escrow__conn_close(cu);
    /* With MADV_DONTFORK the child has no such mapping: unmapping the range could take
     * whatever the child mapped there since. */
    for (size_t i = 0; i < cu->n_kept; i++)
        if (cu->kept[i].journal.dontfork) cu->kept[i].journal.base = NULL;
    drop_all(cu);
    cu->lapsed = 0;
}

/* ---- the journal of a held session (PROTOCOL.md 10.6) ------------------------------------- */

long escrow_custody_read(escrow_custody *cu, const char *id, void *buf, size_t size) {
    escrow_kept *k = find(cu, id);
    if (k == NULL) {
        errno = ENOENT;
        return -1;
    }
    return escrow__journal_read(&k->journal, k->fd, buf, size);
}

int escrow_custody_record(escrow_custody *cu, const char *id, const void *data, size_t len) {
    escrow_kept *k = find(cu, id);
    if (k == NULL) {
        errno = ENOENT;
        return -1;
    }
    escrow__journal_record(&k->journal, data, len);
    return 0;
}

int escrow_custody_journaled(const escrow_custody *cu, const char *id) {
    const escrow_kept *k = find(cu, id);
    return k != NULL && k->journal.base != NULL;
}

/* ---- sessions retrieved into custody (PROTOCOL.md 12.6) ----------------------------------- */

escrow_code escrow__custody_keep(escrow_custody *cu, escrow_retrieved *r, int journal_fd,
                                 escrow_error *err) {
    escrow_kept k;
    const escrow_session *s = &r->session;
    r->journal = 0;
    escrow_code rc = kept_init(&k, s->id, r->fd, s->label, s->child_pid, s->cols, s->rows,
                               s->meta, s->meta_count, err);
    if (rc == ESCROW_OK) {
        k.journal_asked = journal_fd >= 0;
        k.held = 1;
        if (journal_fd >= 0 &&
            escrow__journal_map(&k.journal, journal_fd,
                                escrow_has_feature(&cu->welcome, "journal_reading")) == 0)
            r->journal = 1;
        rc = kept_add(cu, &k, err);
        if (rc != ESCROW_OK) r->journal = 0;
    }
    if (journal_fd >= 0) close(journal_fd);
    if (rc != ESCROW_OK) cu->lapsed = 1; /* held by us all the same, but not kept: unprotected */
    return rc;
}

/* ---- when the holder goes away (PROTOCOL.md 10.4) ----------------------------------------- */

int escrow_custody_fd(const escrow_custody *cu) { return cu->sock; }

int escrow_custody_protected(const escrow_custody *cu) {
    return cu->sock >= 0 && !cu->lapsed;
}

int escrow_custody_retry_ms(const escrow_custody *cu) {
    return cu->retry_ms > 0 ? cu->retry_ms : RETRY_FIRST_MS;
}

escrow_code escrow_custody_check(escrow_custody *cu, escrow_error *err) {
    escrow_code rc = usable(cu, NULL, err);
    if (rc != ESCROW_OK) return rc;
    struct pollfd p = {cu->sock, POLLIN, 0};
    if (poll(&p, 1, 0) <= 0 || p.revents == 0) return ESCROW_OK; /* nothing: still there */
    unsigned char byte;
    ssize_t n = (p.revents & POLLIN) ? recv(cu->sock, &byte, 1, MSG_PEEK) : 0;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return ESCROW_OK;
    int e = n < 0 ? errno : 0;
    escrow__custody_lost(cu);
    if (n > 0) /* the holder never speaks unasked */
        return escrow__fail(err, ESCROW_PROTOCOL, 0, NULL,
                            "the holder sent a frame nobody asked for: custody lapsed");
    return escrow__fail(err, ESCROW_UNAVAILABLE, e, NULL,
                        "the holder went away: custody lapsed until a resume");
}

escrow_code escrow_custody_resume(escrow_custody *cu, escrow_error *err) {
    escrow_code rc = ESCROW_OK, refused = ESCROW_OK;
    if (cu->sock < 0 && !cu->lapsed)
        return escrow__fail(err, ESCROW_CONFIG, 0, NULL, "this custody is closed");
    if (cu->sock < 0) {
        escrow_custody fresh; /* escrow__connect_greet clears what it is given */
        rc = escrow__connect_greet(cu->client, &fresh, escrow__now() + cu->client->timeout, err);
        if (rc == ESCROW_OK) {
            cu->sock = fresh.sock;
            cu->welcome = fresh.welcome;
        }
    }
    for (size_t i = 0; rc == ESCROW_OK && i < cu->n_kept; i++) {
        escrow_kept *k = &cu->kept[i];
        if (k->held) continue;
        escrow_error why;
        int doubt;
        escrow_code got = send_deposit(cu, k, &doubt, &why);
        if (doubt) {
            rc = got;
            if (err != NULL) *err = why;
            escrow__custody_lost(cu);
        } else if (got != ESCROW_OK) {
            /* exists: escrowed, but not held for us (or limit...): its journal stops, it is
             * asked again next time, and the others stay held meanwhile. */
            escrow__journal_unmap(&k->journal);
            if (refused == ESCROW_OK) {
                refused = got;
                if (err != NULL) {
                    *err = why;
                    snprintf(err->id, sizeof err->id, "%s", k->id);
                }
            }
        }
    }
    if (rc == ESCROW_OK) rc = refused;
    if (rc == ESCROW_OK) {
        cu->lapsed = 0;
        cu->retry_ms = 0;
        return ESCROW_OK;
    }
    cu->lapsed = 1;
    int next = escrow_custody_retry_ms(cu) * 2;
    cu->retry_ms = next < RETRY_MAX_MS ? next : RETRY_MAX_MS;
    return rc;
}

/* ---- whether a session is kept (PROTOCOL.md 10.2, 10.4) ----------------------------------- */

int escrow__custody_keeps(const escrow_custody *cu, const char *id) {
    return find(cu, id) != NULL;
}
