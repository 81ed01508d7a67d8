/* escrow.c: the calls of escrow.h on a fresh connection, each a short exchange.
 *
 * The hand-off (section 11) is a deposit and the end of custody at once (custody itself is
 * escrow_custody.c's). Asking: list, status, release and update, each on a fresh
 * connection (section 8). Taking a terminal back: retrieve (section 12), which acks only once
 * it holds the fd and it is a terminal, never reads the fd before `done`, and when `done`
 * never comes asks on a fresh connection who owns it.
 *
 * The fds: every call closes each connection it opened before it returns, and never
 * closes the caller's fd (a deposit's copy goes to the holder on the frame). It keeps no fd
 * that comes with an answer, except the master of a retrieve, which escrow_retrieve hands to
 * the caller (escrow_retrieved.fd) on ESCROW_OK, and closes on every other return.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- calls with one answer (PROTOCOL.md section 8) -------------------------------------- */

/* update (section 10.5) on a greeted connection: {id} answered `updated{id}`. */
static escrow_code update_on(conn *c, const char *id, int64_t cols, int64_t rows,
                             const escrow_meta *meta, size_t meta_count, escrow_error *err) {
    mp_out o = {0};
    escrow_code rc = escrow__encode_update(&o, id, cols, rows, meta, meta_count, err);
    if (rc == ESCROW_OK) rc = escrow__call_id(c, &o, "updated", id, err);
    free(o.data);
    return rc;
}

/* ---- the hand-off (PROTOCOL.md section 11) ---------------------------------------------- */

escrow_code escrow_hand_off(const escrow_client *c, const char *id, int fd,
                            const escrow_deposit_opts *opts, escrow_error *err) {
    escrow_custody cu;
    escrow_code rc = escrow_custody_open(c, &cu, err);
    if (rc != ESCROW_OK) return rc;
    rc = escrow_deposit(&cu, id, fd, opts, err);
    /* Escrowed, or kept in doubt: done only once the end of custody is confirmed (the
     * holder's list shows it out of our hands), as client.py's hand_off is. */
    int kept = escrow__custody_keeps(&cu, id);
    escrow_code ended = escrow_custody_close(&cu);
    if (!kept) return rc;
    if (ended != ESCROW_OK)
        return escrow__fail(err, ended, 0, id, "the hand-off of %s was not confirmed within "
                            "the timeout: it may be held by nobody", id);
    if (err != NULL) memset(err, 0, sizeof *err);
    return ESCROW_OK;
}

/* ---- asking (PROTOCOL.md section 8) ----------------------------------------------------- */

/* One question on a fresh connection: list, status. */
static escrow_code ask(const escrow_client *c, mp_out *o, const char *want, frame *f,
                       escrow_error *err) {
    conn cn;
    double deadline = escrow__now() + c->timeout;
    escrow_code rc = escrow__connect_greet(c, &cn, deadline, err);
    if (rc == ESCROW_OK) rc = escrow__call(&cn, o, -1, want, deadline, f, err);
    escrow__conn_close(&cn);
    return rc;
}

escrow_code escrow_list(const escrow_client *c, int all_owners, escrow_session **out,
                        size_t *count, escrow_error *err) {
    mp_out o = {0};
    frame f;
    *out = NULL;
    *count = 0;
    escrow_code rc = escrow__encode_list(&o, all_owners, err);
    if (rc == ESCROW_OK) rc = ask(c, &o, "sessions", &f, err);
    free(o.data);
    if (rc != ESCROW_OK) return rc;
    if (escrow__decode_sessions(&f, out, count) != 0) {
        escrow_sessions_free(*out, *count);
        *out = NULL;
        *count = 0;
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL,
                          "the holder sent a malformed sessions list");
    }
    escrow__frame_free(&f);
    return rc;
}

escrow_code escrow_status_of(const escrow_client *c, escrow_status *out, escrow_error *err) {
    mp_out o = {0};
    frame f;
    escrow_code rc = escrow__encode_status(&o, err);
    if (rc == ESCROW_OK) rc = ask(c, &o, "holder_status", &f, err);
    free(o.data);
    if (rc != ESCROW_OK) return rc;
    if (escrow__decode_status(&f, out) != 0)
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL,
                          "the holder sent a malformed holder_status");
    escrow__frame_free(&f);
    return rc;
}

escrow_code escrow_release(const escrow_client *c, const char *id, escrow_error *err) {
    mp_out o = {0};
    conn cn;
    escrow_code rc = escrow__connect_greet(c, &cn, escrow__now() + c->timeout, err);
    if (rc != ESCROW_OK) return rc;
    rc = escrow__encode_id(&o, "release", id, err);
    if (rc == ESCROW_OK) rc = escrow__call_id(&cn, &o, "released", id, err);
    free(o.data);
    escrow__conn_close(&cn);
    return rc;
}

escrow_code escrow_update(const escrow_client *c, const char *id, int64_t cols, int64_t rows,
                          const escrow_meta *meta, size_t meta_count, escrow_error *err) {
    conn cn;
    escrow_code rc = escrow__connect_greet(c, &cn, escrow__now() + c->timeout, err);
    if (rc != ESCROW_OK) return rc;
    rc = update_on(&cn, id, cols, rows, meta, meta_count, err);
    escrow__conn_close(&cn);
    return rc;
}

escrow_code escrow_welcome_of(const escrow_client *c, escrow_welcome *out, escrow_error *err) {
    conn cn;
    escrow_code rc = escrow__connect_greet(c, &cn, escrow__now() + c->timeout, err);
    if (rc == ESCROW_OK) *out = cn.welcome;
    escrow__conn_close(&cn);
    return rc;
}

/* ---- retrieve (PROTOCOL.md section 12) -------------------------------------------------- */

void escrow_retrieved_free(escrow_retrieved *r) {
    escrow_session_clear(&r->session);
    free(r->replay);
    r->replay = NULL;
    r->replay_len = 0;
}

/* Drop our copy of a retrieved fd: the holder kept the session, so we must not read it. */
static void give_back(escrow_retrieved *r) {
    if (r->fd >= 0) close(r->fd);
    r->fd = -1;
    escrow_retrieved_free(r);
}

/* Ack `r` again on a fresh connection, where a restarted holder completes our handoff
 * (section 10.4): 1, -1 or 0 as escrow_internal.h says. A retrieve into custody whose
 * `done` never came acks again with it too (escrow_retrieve_many.c). */
int escrow__ack_again(const escrow_client *c, const escrow_retrieved *r, double deadline,
                      escrow_error *err) {
    conn cn;
    mp_out o = {0};
    frame f;
    escrow_error e;
    if (escrow__connect_greet(c, &cn, deadline, NULL) != ESCROW_OK) return 0;
    escrow_code rc = escrow__encode_ack(&o, r->session.id, r->handoff_id, 0, NULL);
    if (rc == ESCROW_OK) rc = escrow__call(&cn, &o, -1, "done", deadline, &f, &e);
    free(o.data);
    escrow__conn_close(&cn);
    if (rc == ESCROW_ACK_LATE && err != NULL) *err = e;
    if (rc != ESCROW_OK) return rc == ESCROW_ACK_LATE ? -1 : 0;
    char id[ESCROW_NAME_MAX + 1];
    int ours = escrow__decode_id(&f, id) == 0 && strcmp(id, r->session.id) == 0;
    escrow__frame_free(&f);
    return ours;
}

/* `done` never came: ask on a fresh connection who owns the fd (section 12.3). We still hold
 * our copy, unread. (escrow_retrieve_many.c asks it too, for a retrieve_many.) Our own handoff
 * still `handing_off` is acked again on a fresh connection, which completes it where a
 * restarted holder adopted it (section 10.4); until then, and while the holder answers busy,
 * we ask again within the timeout. */
escrow_code escrow__resolve(const escrow_client *c, escrow_retrieved *r, escrow_error *err) {
    double deadline = escrow__now() + c->timeout;
    const char *id = r->session.id;
    for (;;) {
        escrow_session *all = NULL, *s = NULL;
        size_t n = 0;
        escrow_client asking = *c;
        asking.timeout = deadline - escrow__now();
        if (asking.timeout <= 0) return ESCROW_OK; /* cannot tell: keep it, unconfirmed */
        escrow_code rc = escrow_list(&asking, 0, &all, &n, NULL);
        if (rc != ESCROW_OK) return ESCROW_OK; /* gone (its copy with it), or cannot tell */
        for (size_t i = 0; i < n; i++)
            if (strcmp(all[i].id, id) == 0) s = &all[i];
        escrow_code verdict = ESCROW_OK;
        int again = 0;
        if (s == NULL) {
            /* absent: the holder has no copy left; ours is the only one */
        } else if (strcmp(s->state, "handed_off") == 0) {
            if (strcmp(s->handoff_id, r->handoff_id) == 0) r->confirmed = 1;
            else verdict = escrow__fail(err, ESCROW_HANDED_OFF, 0, id,
                                        "session %s was handed off to another client", id);
        } else if (strcmp(s->state, "handing_off") == 0) {
            if (s->handoff_id[0] != 0 && strcmp(s->handoff_id, r->handoff_id) != 0)
                verdict = escrow__fail(err, ESCROW_BUSY, 0, id,
                                       "session %s is being handed off to another client", id);
            else again = 1; /* the holder is still acting on our ack or our hang-up */
        } else if (strcmp(s->state, "draining") == 0 || strcmp(s->state, "exited") == 0 ||
                   strcmp(s->state, "held") == 0) {
            if (s->deposited_at == r->session.deposited_at) /* else a new deposit reused the id */
                verdict = escrow__fail(err, ESCROW_UNRESPONSIVE, 0, id,
                                       "the handoff of %s was not confirmed and the holder kept "
                                       "it (%s): retrieve it again", id, s->state);
        } /* released, expired, or a state newer than us: the holder has no copy to read */
        escrow_sessions_free(all, n);
        if (verdict != ESCROW_OK) {
            give_back(r);
            return verdict;
        }
        if (!again) return ESCROW_OK;
        int acked = escrow__ack_again(c, r, deadline, err);
        if (acked > 0) {
            r->confirmed = 1;
            return ESCROW_OK;
        }
        if (acked < 0) { /* ack_late: the holder drains it again; we must not read too */
            give_back(r);
            return ESCROW_ACK_LATE;
        }
        if (escrow__ms_left(deadline) <= 20)
            return ESCROW_OK; /* our ack is queued there, if anything */
        poll(NULL, 0, 20);
    }
}

escrow_code escrow_retrieve(const escrow_client *c, const char *id, escrow_retrieved *out,
                            escrow_error *err) {
    conn cn;
    frame f;
    mp_out o = {0};
    double deadline = escrow__now() + c->timeout;
    memset(out, 0, sizeof *out);
    out->fd = -1;
    escrow_code rc = escrow__connect_greet(c, &cn, deadline, err);
    if (rc != ESCROW_OK) return rc;
    /* The timeout invariant (section 12.1), against this welcome, before anything is sent. */
    rc = escrow__check_retrieve_time(&cn, deadline, id, err);
    if (rc != ESCROW_OK) {
        escrow__conn_close(&cn);
        return rc;
    }
    /* No keep, no journal, the replay in the frame: section 12.2. */
    rc = escrow__encode_retrieve(&o, id, 0, 0, 0, err);
    if (rc == ESCROW_OK) rc = escrow__call(&cn, &o, -1, "handoff", deadline, &f, err);
    free(o.data);
    if (rc != ESCROW_OK) {
        escrow__conn_close(&cn);
        if (err != NULL && err->id[0] == 0) snprintf(err->id, sizeof err->id, "%s", id);
        return rc;
    }
    journal_info journal;
    replay_file_info replay_file;
    if (escrow__decode_handoff(&f, out, &journal, &replay_file) != 0 || replay_file.set) {
        escrow__frame_free(&f); /* closes the fds: never acked, the holder drains it again */
        escrow_retrieved_free(out);
        escrow__conn_close(&cn);
        return escrow__fail(err, ESCROW_PROTOCOL, 0, id, "the holder sent a malformed handoff");
    }
    /* The master is the first fd (section 4.3). A second, the journal file of a journal,
     * comes only to a retrieve with keep and journal, which this one is not:
     * escrow__frame_free closes it. */
    out->fd = f.fds[0];
    f.fds[0] = f.fds[--f.nfds]; /* the master is out's now; the rest stay the frame's */
    escrow__frame_free(&f);
    if (!isatty(out->fd)) { /* do not ack: the holder drains it again when we hang up */
        give_back(out);
        escrow__conn_close(&cn);
        return escrow__fail(err, ESCROW_PROTOCOL, 0, id,
                            "the holder handed off %s as a non-terminal", id);
    }
    /* Ack, and read nothing from the fd before `done`: ownership moves at `done`. */
    rc = escrow__encode_ack(&o, id, out->handoff_id, 0, err);
    if (rc == ESCROW_OK) rc = escrow__call(&cn, &o, -1, "done", deadline, &f, err);
    free(o.data);
    escrow__conn_close(&cn);
    if (rc == ESCROW_OK) {
        escrow__frame_free(&f);
        out->confirmed = 1;
        return ESCROW_OK;
    }
    if (rc == ESCROW_UNRESPONSIVE || rc == ESCROW_UNAVAILABLE || rc == ESCROW_PROTOCOL ||
        rc == ESCROW_SYSTEM)
        return escrow__resolve(c, out, err); /* no answer: ask who owns it */
    give_back(out); /* ack_late, or the ack refused: the holder is draining it again */
    return rc;
}
