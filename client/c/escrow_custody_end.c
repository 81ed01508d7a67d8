/* escrow_custody_end.c: the end of custody, and its confirmation (PROTOCOL.md 10.2, 10.4
 * and 11), as the reference client ends it (client/custody_end.py).
 *
 * Custody ends when its connection closes (escrow_custody_close, or the process dying): the
 * holder starts draining every session held by it (10.2). Closing shuts our side down and
 * waits for the holder to close its own (section 11: by then it has acted on our going
 * away). The journals stop first (10.6): from then on each ring is the holder's.
 *
 * A custody with sessions held does not know what the holder made of its end (it may
 * have lapsed, be owed an answer, or have a holder that restarted unnoticed), so its end
 * is not taken on trust: the holder's list, asked on a connection of its own, must
 * show each session kept here out of our hands. One still listed as held by this process (a
 * holder that restarted before it saw the end, and adopted it: 10.4), not listed at all (a
 * holder that lost it), or listed only as a tombstone of an earlier session of the same id
 * for a deposit that was owed its answer (it never arrived) is taken back
 * (escrow_custody_resume) with its journal stopped, and that custody ended in turn, with a
 * back-off, all within the one timeout; ESCROW_UNAVAILABLE if it is still not confirmed
 * then: those sessions may be held by nobody.
 *
 * The fds: the custody's connection is closed here, and so is every connection a resume
 * opens on the way; the list is asked on a connection closed before it returns. Every
 * duplicate the custody kept is closed before escrow_custody_close returns.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- the end of custody (PROTOCOL.md 10.2 and 11) ----------------------------------------- */

/* Our side shut down, then the holder's end of stream awaited: it closes its side once it
 * has ended our custody, and every session held here is draining by then. Nothing else
 * arrives after our SHUT_WR (section 11). The connection is closed after. */
static void finish(escrow_custody *cu, double deadline) {
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

/* ---- its confirmation (PROTOCOL.md 10.4, and 8.1's list) ---------------------------------- */

/* Our owner's sessions, asked on a connection of its own (section 8.1). */
static escrow_code list_ours(const escrow_client *cl, escrow_session **all, size_t *n) {
    conn cn;
    mp_out o = {0};
    frame f;
    escrow_error why;
    double deadline = escrow__now() + cl->timeout;
    *all = NULL;
    *n = 0;
    escrow_code rc = escrow__connect_greet(cl, &cn, deadline, &why);
    if (rc != ESCROW_OK) return rc;
    rc = escrow__encode_list(&o, 0, &why);
    if (rc == ESCROW_OK) rc = escrow__call(&cn, &o, -1, "sessions", deadline, &f, &why);
    free(o.data);
    escrow__conn_close(&cn);
    if (rc != ESCROW_OK) return rc;
    if (escrow__decode_sessions(&f, all, n) != 0) {
        escrow_sessions_free(*all, *n);
        *all = NULL;
        *n = 0;
        rc = ESCROW_PROTOCOL;
    }
    escrow__frame_free(&f);
    return rc;
}

/* Drop each kept session whose end of custody the holder's list confirms (draining, being
 * retrieved, exited, or ended by someone); 1 when none is left. A session still held by
 * this process (a holder that restarted before it saw the end, and adopted it), not listed
 * (a holder that lost it), or only a tombstone of an earlier one of that id for the deposit
 * that was owed its answer (it never arrived) stays, as all do if the list cannot be had. */
static int confirmed(escrow_custody *cu, const char *pending) {
    escrow_session *all = NULL;
    size_t n = 0;
    if (cu->n_kept == 0) return 1;
    if (list_ours(cu->client, &all, &n) != ESCROW_OK) return 0;
    for (size_t i = cu->n_kept; i-- > 0;) {
        escrow_kept *k = &cu->kept[i];
        const escrow_session *s = NULL;
        for (size_t j = 0; j < n && s == NULL; j++)
            if (strcmp(all[j].id, k->id) == 0) s = &all[j];
        int ours = s != NULL && strcmp(s->state, "held") == 0 &&
                   s->custodian_pid == (int64_t)getpid();
        int tombstone = s != NULL && (strcmp(s->state, "handed_off") == 0 ||
                                      strcmp(s->state, "released") == 0 ||
                                      strcmp(s->state, "expired") == 0);
        if (s != NULL && !ours && !(tombstone && strcmp(k->id, pending) == 0))
            escrow__custody_drop(cu, k);
    }
    escrow_sessions_free(all, n);
    return cu->n_kept == 0;
}

/* ---- closing a custody (PROTOCOL.md 10.2, 10.4 and 11) ------------------------------------ */

escrow_code escrow_custody_close(escrow_custody *cu) {
    /* The journals stop before custody ends: from then on each ring is the holder's, and
     * they stay stopped through any custody taken back below. */
    for (size_t i = 0; i < cu->n_kept; i++) {
        escrow__journal_unmap(&cu->kept[i].journal);
        cu->kept[i].journal_asked = 0;
    }
    escrow_code rc = ESCROW_OK;
    const escrow_client *own = cu->client;
    if (cu->n_kept > 0 || cu->lapsed || cu->owed != ESCROW__OWED_NONE) {
        /* What the holder made of us is not known for sure, even on a connection that
         * looks well: a holder SIGKILLed and restarted under its keeper since the last
         * call adopted what it held as ours, and our hang-up now reaches nobody. See it
         * confirmed (custody_end.py), every call bounded by what is left of the one
         * timeout. */
        char pending[ESCROW_NAME_MAX + 1] = "";
        if (cu->owed == ESCROW__OWED_DEPOSIT) snprintf(pending, sizeof pending, "%s", cu->owed_id);
        double deadline = escrow__now() + own->timeout;
        escrow_client bounded = *own;
        int pause_ms = escrow_custody_retry_ms(cu);
        cu->client = &bounded;
        for (;;) {
            if (cu->sock >= 0) finish(cu, deadline);
            bounded.timeout = deadline - escrow__now();
            if (bounded.timeout > 0 && confirmed(cu, pending)) break;
            int left = escrow__ms_left(deadline);
            if (left <= 0) {
                rc = ESCROW_UNAVAILABLE;
                break;
            }
            /* A holder that restarted before it saw the end: custody taken back, ended
             * again. The owed deposit is settled on that connection or deposited again. */
            poll(NULL, 0, pause_ms < left ? pause_ms : left);
            pause_ms = pause_ms * 2 < 2000 ? pause_ms * 2 : 2000;
            bounded.timeout = deadline - escrow__now();
            if (bounded.timeout <= 0) continue;
            cu->owed = ESCROW__OWED_NONE;
            for (size_t i = 0; i < cu->n_kept; i++) cu->kept[i].held = 0;
            cu->lapsed = 1;
            (void)escrow_custody_resume(cu, NULL); /* what it takes back is ended above */
            for (size_t i = 0; i < cu->n_kept; i++) escrow__journal_unmap(&cu->kept[i].journal);
        }
        cu->client = own;
    } else if (cu->sock >= 0) {
        finish(cu, escrow__now() + own->timeout);
    }
    escrow__custody_forget(cu); /* the app must not read them again: the holder does */
    return rc;
}
