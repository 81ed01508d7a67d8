/* escrow_custody.c: custody, and what it keeps so that it survives the holder.
 *
 * A custodian connection (PROTOCOL.md section 10.2) deposits terminals, releases and updates
 * them (10.5); while it is open every session it holds stays `held`, the app their reader,
 * and when it closes (SHUT_WR, then the holder's end of stream) they drain. A custody keeps,
 * for each session it holds, a duplicate of the master, the deposit that escrowed it (its
 * label, child, size and meta, kept current by update) and its journal (10.6), so that when
 * the holder goes away it can take custody back on the next one (escrow_resume.c, 10.4).
 * A session retrieved into custody (12.6) is kept as if deposited. How custody ends, and how
 * that end is confirmed, is escrow_custody_end.c's.
 *
 * No threads and no signals: the app watches escrow_custody_fd in its own loop. Every call
 * here goes through escrow__custody_call, which keeps the connection in step: a call that
 * got no answer in time leaves it open, owed that answer (escrow_resume.c says how it is
 * settled); a deposit that got no answer is kept, its duplicate with it, until it is
 * settled. Nothing is given up on a guess.
 *
 * The fds: the connection is the custody's (`sock`) until escrow_custody_close; a lapse or
 * a resume replaces it. Each kept session owns one fd, its duplicate (F_DUPFD_CLOEXEC), closed
 * when it is released or custody closes (also in a forked child). A journal file that comes
 * with an answer is mapped and closed with its frame; the mapping ends before custody does.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* Fill `k` (not yet in the table) with a copy of the deposit and a duplicate of `fd`. Out
 * of memory: nothing kept. No duplicate: `k` is whole, with fd -1, and the code says so. */
static escrow_code kept_init(escrow_kept *k, const char *id, int fd, const char *label,
                             int64_t child_pid, int64_t cols, int64_t rows,
                             const escrow_meta *meta, size_t meta_count, escrow_error *err) {
    memset(k, 0, sizeof *k);
    snprintf(k->id, sizeof k->id, "%s", id);
    k->child_pid = child_pid;
    k->cols = cols;
    k->rows = rows;
    k->fd = -1;
    k->label = copy_str(label);
    if (k->label == NULL || copy_meta(meta, meta_count, &k->meta) != 0) {
        free(k->label);
        k->label = NULL;
        return escrow__fail(err, ESCROW_SYSTEM, ENOMEM, id, "out of memory keeping %s", id);
    }
    k->meta_count = meta_count;
    k->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (k->fd < 0)
        return escrow__fail(err, ESCROW_SYSTEM, errno, id, "cannot keep a duplicate of %s: %s",
                            id, strerror(errno));
    return ESCROW_OK;
}

static void kept_free(escrow_kept *k) {
    escrow__journal_unmap(&k->journal);
    if (k->fd >= 0) close(k->fd);
    k->fd = -1;
    free(k->label);
    free_meta(k->meta, k->meta_count);
}

/* Room for one more kept session, made before anything is sent: a session the holder
 * may have must never be one the table has no room for. */
static escrow_code kept_room(escrow_custody *cu, const char *id, escrow_error *err) {
    if (cu->n_kept < cu->cap_kept) return ESCROW_OK;
    size_t cap = cu->cap_kept ? cu->cap_kept * 2 : 4;
    escrow_kept *grown = realloc(cu->kept, cap * sizeof *grown);
    if (grown == NULL)
        return escrow__fail(err, ESCROW_SYSTEM, ENOMEM, id, "out of memory keeping %s", id);
    cu->kept = grown;
    cu->cap_kept = cap;
    return ESCROW_OK;
}

/* Put `k` in the table (taking what it owns): kept_room made room for it. */
static escrow_kept *kept_add(escrow_custody *cu, const escrow_kept *k) {
    cu->kept[cu->n_kept] = *k;
    return &cu->kept[cu->n_kept++];
}

void escrow__custody_drop(escrow_custody *cu, escrow_kept *k) {
    kept_free(k);
    *k = cu->kept[--cu->n_kept];
}

void escrow__custody_forget(escrow_custody *cu) {
    for (size_t i = 0; i < cu->n_kept; i++) kept_free(&cu->kept[i]);
    free(cu->kept);
    cu->kept = NULL;
    cu->n_kept = cu->cap_kept = 0;
    cu->lapsed = cu->unkept = 0;
    cu->owed = ESCROW__OWED_NONE; /* a late answer went with the connection */
}

escrow_code escrow__custody_connected(const escrow_custody *cu, const char *id,
                                      escrow_error *err) {
    if (cu->sock >= 0) return ESCROW_OK;
    if (cu->lapsed)
        return escrow__fail(err, ESCROW_UNAVAILABLE, 0, id,
                            "custody lapsed (the holder went away): nothing was sent; "
                            "escrow_custody_resume first");
    return escrow__fail(err, ESCROW_CONFIG, 0, id, "this custody is closed");
}

/* ---- custody (PROTOCOL.md sections 10.2 and 10.5) ----------------------------------------- */

escrow_code escrow_custody_open(const escrow_client *c, escrow_custody *cu, escrow_error *err) {
    return escrow__connect_greet(c, cu, escrow__now() + c->timeout, err);
}

escrow_code escrow_deposit(escrow_custody *cu, const char *id, int fd,
                           const escrow_deposit_opts *opts, escrow_error *err) {
    static const escrow_deposit_opts none = {NULL, 0, 0, 0, NULL, 0, 0};
    escrow_kept k;
    escrow_code rc = escrow__custody_connected(cu, id, err);
    if (rc != ESCROW_OK) return rc;
    if (opts == NULL) opts = &none;
    if (find(cu, id) != NULL)
        return escrow__fail(err, ESCROW_EXISTS, 0, id, "session %s is held by this custody", id);
    if ((rc = kept_room(cu, id, err)) != ESCROW_OK) return rc;
    rc = kept_init(&k, id, fd, opts->label, opts->child_pid, opts->cols, opts->rows,
                   opts->meta, opts->meta_count, err);
    if (rc != ESCROW_OK) {
        kept_free(&k); /* nothing was sent: a deposit without its duplicate is none */
        return rc;
    }
    k.journal_asked = opts->journal != 0;
    int doubt;
    rc = escrow__custody_send_deposit(cu, &k, escrow__now() + cu->client->timeout, &doubt, err);
    if (rc != ESCROW_OK && !doubt) {
        kept_free(&k); /* the holder answered, or nothing left: it does not have it */
        return rc;
    }
    /* Escrowed or not yet known (not held: settled by the late answer, or the resume). */
    kept_add(cu, &k);
    return rc;
}

/* A call with one {id} answer on the custody's connection (kept in step: a late answer is
 * owed, not taken for the next call's). While it is lapsed, on a connection of its own (any connection of the
 * owner may release or update any session: 10.2, 10.5). */
static escrow_code id_call(escrow_custody *cu, mp_out *o, const char *want, int kind,
                           const char *id, escrow_error *err) {
    if (cu->sock < 0) {
        conn cn;
        escrow_code rc = escrow__connect_greet(cu->client, &cn,
                                               escrow__now() + cu->client->timeout, err);
        if (rc == ESCROW_OK) rc = escrow__call_id(&cn, o, want, id, err);
        escrow__conn_close(&cn);
        return rc;
    }
    frame f;
    int doubt;
    escrow_code rc = escrow__custody_call(cu, o, -1, want, kind, id,
                                          escrow__now() + cu->client->timeout, &f, &doubt, err);
    if (rc != ESCROW_OK) return rc;
    char got[ESCROW_NAME_MAX + 1];
    if (escrow__decode_id(&f, got) != 0) {
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, id, "a malformed %s", want);
        escrow__custody_lost(cu, rc);
    }
    escrow__frame_free(&f);
    return rc;
}

/* Before a release or an update on the custody's connection: the answer owed read first,
 * so that nothing is changed here for a call that will not be sent. */
static escrow_code in_step(escrow_custody *cu, const char *id, escrow_error *err) {
    if (cu->sock < 0) return ESCROW_OK; /* lapsed: a connection of its own */
    escrow_code rc = escrow__custody_in_step(cu, escrow__now() + cu->client->timeout, id, err);
    if (cu->sock >= 0 && cu->owed != ESCROW__OWED_NONE) return rc; /* still owed: nothing sent */
    return ESCROW_OK;
}

escrow_code escrow_custody_release(escrow_custody *cu, const char *id, escrow_error *err) {
    mp_out o = {0};
    escrow_code rc = escrow__custody_connected(cu, id, err);
    if (rc != ESCROW_OK && !cu->lapsed) return rc;
    if ((rc = in_step(cu, id, err)) != ESCROW_OK) return rc;
    escrow_kept *k = find(cu, id);
    int pending = k != NULL && !k->held;
    if (k != NULL) escrow__custody_drop(cu, k); /* its journal stops before the holder hears (10.6) */
    rc = escrow__encode_id(&o, "release", id, err);
    if (rc == ESCROW_OK) rc = id_call(cu, &o, "released", ESCROW__OWED_RELEASE, id, err);
    free(o.data);
    if (rc == ESCROW_UNKNOWN && pending) rc = ESCROW_OK; /* a deposit that never arrived */
    return rc;
}

escrow_code escrow_custody_update(escrow_custody *cu, const char *id, int64_t cols, int64_t rows,
                                  const escrow_meta *meta, size_t meta_count,
                                  escrow_error *err) {
    mp_out o = {0};
    escrow_code rc = escrow__custody_connected(cu, id, err);
    if (rc != ESCROW_OK && !cu->lapsed) return rc;
    if ((rc = in_step(cu, id, err)) != ESCROW_OK) return rc;
    rc = escrow__encode_update(&o, id, cols, rows, meta, meta_count, err);
    if (rc == ESCROW_OK) rc = id_call(cu, &o, "updated", ESCROW__OWED_UPDATE, id, err);
    free(o.data);
    escrow_kept *k = find(cu, id);
    /* Sent whole and owed its answer: the holder may have it, and the app has set it. */
    int owed = cu->owed == ESCROW__OWED_UPDATE && strcmp(cu->owed_id, id) == 0;
    if ((rc != ESCROW_OK && !owed) || k == NULL) return rc;
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
    return rc;
}

void escrow_custody_close_in_child(escrow_custody *cu) {
    escrow__conn_close(cu);
    /* With MADV_DONTFORK the child has no such mapping: unmapping the range could take
     * whatever the child mapped there since. */
    for (size_t i = 0; i < cu->n_kept; i++)
        if (cu->kept[i].journal.dontfork) cu->kept[i].journal.base = NULL;
    escrow__custody_forget(cu);
}

/* ---- the journal of a held session (PROTOCOL.md 10.6) ------------------------------------- */

long escrow_custody_read(escrow_custody *cu, const char *id, void *buf, size_t size) {
    escrow_kept *k = find(cu, id);
    if (k == NULL || k->gone) { /* (gone: the holder drains it, and is its reader) */
        errno = ENOENT;
        return -1;
    }
    if (k->fd < 0) {
        errno = EBADF; /* held here, but no duplicate of it could be kept */
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

escrow_code escrow__custody_keep(escrow_custody *cu, escrow_retrieved *r, int journal,
                                 int journal_fd, const journal_info *info, int held,
                                 escrow_error *err) {
    escrow_kept k;
    const escrow_session *s = &r->session;
    memset(&k, 0, sizeof k);
    r->journal = 0;
    escrow_code rc = kept_room(cu, s->id, err);
    if (rc == ESCROW_OK)
        rc = kept_init(&k, s->id, r->fd, s->label, s->child_pid, s->cols, s->rows, s->meta,
                       s->meta_count, err);
    if (rc == ESCROW_OK || (k.label != NULL && k.fd < 0)) {
        /* Without a duplicate it is kept all the same (its deposit, its journal): held by
         * us, read through r->fd, and unprotected until released, since no resume can give
         * it to the next holder (escrow_custody_protected says so). */
        k.journal_asked = journal != 0; /* a deposit again asks as the retrieve did */
        k.held = held;
        if (held && journal_fd >= 0 && k.fd >= 0 &&
            escrow__journal_map(&k.journal, journal_fd, info,
                                escrow_has_feature(&cu->welcome, "journal_reading")) == 0)
            r->journal = 1;
        escrow_kept *kept = kept_add(cu, &k);
        if (!held && kept->fd >= 0) {
            /* Ours alone, or its connection gone: given to the holder again from the
             * duplicate, now if the connection can take it (as a resume would), else by
             * the next resume; a refusal leaves it to that resume too. */
            escrow_error why;
            int doubt;
            if (cu->sock < 0 || cu->owed != ESCROW__OWED_NONE ||
                (escrow__custody_send_deposit(cu, kept, escrow__now() + cu->client->timeout,
                                              &doubt, &why) != ESCROW_OK && !doubt))
                cu->lapsed = 1;
        }
    } else {
        cu->unkept++; /* out of memory: held by us, and not even its name is kept */
    }
    if (journal_fd >= 0) close(journal_fd);
    return rc;
}

/* ---- whether a session is kept (PROTOCOL.md 10.2, 10.4) ----------------------------------- */

int escrow__custody_keeps(const escrow_custody *cu, const char *id) {
    return find(cu, id) != NULL;
}

int escrow_custody_holds(const escrow_custody *cu, const char *id) {
    const escrow_kept *k = find(cu, id);
    return k != NULL && !k->gone;
}
