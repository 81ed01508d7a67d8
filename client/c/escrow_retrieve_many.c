/* escrow_retrieve_many.c: one exchange that takes sessions back, one or many, out of escrow
 * or into custody (PROTOCOL.md 12.2, 12.3, 12.6 and 12.7), as the reference client does
 * (client/retrieve.py, client/resolve.py). escrow_reclaim.c runs its rounds of these.
 *
 * One exchange serves them all (escrow__exchange): one `retrieve` (one id) or
 * `retrieve_many`, every answer read first, each handoff checked (its fds, a terminal), then
 * one `ack` or `ack_many` for those taken, then `done` or `done_many`. A handoff that fails
 * the checks is not acked: the exchange is ended with a `status` (a frame no holder can take
 * for an ack), whose answer is read after the `done`, so that the holder puts that session
 * back now and the connection stays in step (a custody's must stay open). A refused ack
 * (`ack_late`, `bad_request`) closes those copies: the holder drains them again. A `done`
 * that never comes is asked about on a fresh connection: 12.3 out of escrow
 * (escrow__resolve, once the exchange's own connection is closed), 12.6 into custody
 * (`resolve_kept`).
 *
 * Into custody (`keep`), the exchange runs on the custody's connection, and every session
 * done is given to escrow__custody_keep (with its journal file, when the handoff had one),
 * which keeps a duplicate so that a holder restart cannot take it either: held on the
 * custody's connection, or, when that is gone or the holder has no copy left (our ack
 * completed on a fresh connection: out of escrow), deposited again, as the Python client
 * does. The answer a custody call before is owed is read first (escrow__custody_in_step). A
 * `done` that did not come in time leaves the connection open, owed it, since closing it
 * would end custody of every session held there (the list decides these). A connection
 * that breaks lapses the custody (escrow__custody_lost): it is never replaced here, since
 * taking custody back (escrow_custody_resume) is the app's call.
 *
 * The fds: a handoff's master is the report's (the caller's) once taken, and closed on every
 * path where it is not acked or the ack is refused; a journal file goes to
 * escrow__custody_keep, which closes it, or is closed here; a replay file (never asked for)
 * is refused with its handoff. The connection is the caller's, or the custody's: an
 * exchange never opens one, only the fresh one it asks on (12.3, 12.6), closed before it
 * returns.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

/* A handoff taken in an exchange: its retrieve, its journal file (-1: none). */
typedef struct taken {
    escrow_retrieved r;
    int journal_fd;
    journal_info journal; /* the handoff's, checked against the file when it is mapped */
    int alone;            /* the holder has no copy left: ours alone, out of escrow (12.6) */
    size_t at;            /* its id's place in the batch */
} taken;

/* ESCROW_SYSTEM when the report cannot grow: the caller closes the fd instead. */
static int report_take(escrow_reclaim_report *r, escrow_retrieved *got) {
    escrow_retrieved *grown = realloc(r->retrieved, (r->n_retrieved + 1) * sizeof *grown);
    if (grown == NULL) return -1;
    r->retrieved = grown;
    r->retrieved[r->n_retrieved++] = *got;
    return 0;
}

/* ---- 12.6: a `done` that never came, into custody --------------------------------------- */

/* Whether the holder has `t` held for this process (ESCROW_OK, confirmed), has no copy of it
 * (ESCROW_OK, confirmed, its journal file closed: ours alone, to be deposited again), or
 * kept it or cannot say (the code, our copies closed: it may be draining). */
static escrow_code resolve_kept(const escrow_client *c, taken *t, escrow_error *err) {
    double deadline = escrow__now() + c->timeout;
    const char *id = t->r.session.id;
    escrow_session *all = NULL, *s = NULL;
    size_t n = 0;
    int asked = 0;
    for (;;) {
        escrow_client asking = *c;
        asking.timeout = deadline - escrow__now();
        escrow_sessions_free(all, n);
        all = NULL, s = NULL, n = 0;
        asked = asking.timeout > 0 && escrow_list(&asking, 0, &all, &n, NULL) == ESCROW_OK;
        for (size_t i = 0; asked && i < n; i++)
            if (strcmp(all[i].id, id) == 0) s = &all[i];
        int ours_under_way = s != NULL && strcmp(s->state, "handing_off") == 0 &&
                             strcmp(s->handoff_id, t->r.handoff_id) == 0;
        if ((asked && !ours_under_way) || escrow__ms_left(deadline) < 50) break;
        if (ours_under_way) {
            int acked = escrow__ack_again(c, &t->r, deadline, NULL);
            /* ack_late is no proof the holder drains it: our first ack may have completed
             * meanwhile on the custody's connection, held by us there. The list decides;
             * the master stays unread until then. */
            if (acked < 0) {
                poll(NULL, 0, 50);
                continue;
            }
            if (acked > 0) {
                s = NULL; /* the holder let go: alone, below */
                break;
            }
        }
        poll(NULL, 0, 50);
    }
    escrow_code rc = ESCROW_OK;
    if (asked && (s == NULL || strcmp(s->state, "released") == 0 ||
                  strcmp(s->state, "expired") == 0)) {
        if (t->journal_fd >= 0) close(t->journal_fd); /* that holder's journal is over */
        t->journal_fd = -1;
        t->r.confirmed = t->alone = 1; /* to be deposited again */
    } else if (s != NULL && strcmp(s->state, "held") == 0 &&
               s->custodian_pid == (int64_t)getpid()) {
        t->r.confirmed = 1;
    } else {
        rc = escrow__fail(err, ESCROW_UNRESPONSIVE, 0, id,
                          "retrieving %s into custody was not confirmed; it is still escrowed "
                          "(%s): retrieve it again", id, s != NULL ? s->state : "state unknown");
    }
    escrow_sessions_free(all, n);
    return rc;
}

/* ---- one exchange (PROTOCOL.md 12.2, 12.6 and 12.7) ------------------------------------- */

static escrow_code send_only(conn *c, mp_out *o, double deadline, escrow_error *err) {
    escrow_code rc = o->failed ? escrow__fail(err, ESCROW_SYSTEM, ENOMEM, NULL, "no memory")
                               : escrow__send_frame(c->sock, o->data, o->len, -1, deadline, err);
    free(o->data);
    memset(o, 0, sizeof *o);
    return rc;
}

static long find(const char *const *ids, size_t n, const char *id) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(ids[i], id) == 0) return (long)i;
    return -1;
}

static void close_taken(taken *t) {
    if (t->r.fd >= 0) close(t->r.fd);
    if (t->journal_fd >= 0) close(t->journal_fd);
    t->r.fd = t->journal_fd = -1;
    escrow_retrieved_free(&t->r);
}

/* A handoff frame: taken into `t` (its fds out of the frame), or refused (ESCROW_PROTOCOL in
 * `why`, its fds closed with the frame). -1: a handoff that matches no id waiting. */
static int take_handoff(frame *f, const char *const *ids, size_t n, escrow_error *errs,
                        char *answered, taken *t) {
    journal_info journal;
    replay_file_info replay_file;
    memset(t, 0, sizeof *t);
    t->r.fd = t->journal_fd = -1;
    if (escrow__decode_handoff(f, &t->r, &journal, &replay_file) != 0) {
        escrow_retrieved_free(&t->r);
        return -1; /* whose it is cannot be told */
    }
    long at = find(ids, n, t->r.session.id);
    if (at < 0 || answered[at]) {
        escrow_retrieved_free(&t->r);
        return -1;
    }
    answered[at] = 1;
    t->at = (size_t)at;
    /* The master first, then the journal file (section 4.3); a replay file is never asked. */
    if (replay_file.set || !isatty(f->fds[0])) {
        escrow__fail(&errs[at], ESCROW_PROTOCOL, 0, ids[at],
                     replay_file.set ? "the holder sent %s's replay in a file unasked"
                                     : "the holder handed off %s as a non-terminal", ids[at]);
        escrow_retrieved_free(&t->r);
        return 0;
    }
    t->r.fd = f->fds[0];
    if (journal.set) t->journal_fd = f->fds[1];
    t->journal = journal;
    f->nfds = 0; /* both are t's now */
    return 1;
}

/* The answer to our ack: done for the one, done_many for them all; an error refuses them. */
static escrow_code receive_done(conn *c, taken *got, size_t n_got, double deadline,
                                escrow_error *refusal, escrow_error *err) {
    frame f;
    escrow_code rc = escrow__recv_frame(c->sock, deadline, &f, err);
    if (rc != ESCROW_OK) return rc;
    if (strcmp(f.type, "error") == 0) {
        escrow__decode_error(&f, refusal);
        escrow__frame_free(&f);
        return ESCROW_OK; /* an answer: the holder kept them */
    }
    size_t matched = 0;
    char type[16];
    memcpy(type, f.type, sizeof type);
    if (strcmp(f.type, "done") == 0 && n_got == 1) {
        char id[ESCROW_NAME_MAX + 1];
        matched = escrow__decode_id(&f, id) == 0 && strcmp(id, got[0].r.session.id) == 0;
    } else if (strcmp(f.type, "done_many") == 0) {
        char (*ids)[ESCROW_NAME_MAX + 1] = NULL;
        size_t count = 0;
        if (escrow__decode_done_many(&f, n_got, &ids, &count) == 0 && count == n_got)
            for (size_t i = 0; i < n_got; i++)
                for (size_t j = 0; j < count; j++)
                    if (strcmp(ids[j], got[i].r.session.id) == 0) {
                        matched++;
                        break;
                    }
        if (matched != n_got) matched = 0;
        free(ids);
    }
    escrow__frame_free(&f);
    if (matched == 0)
        return escrow__fail(err, ESCROW_PROTOCOL, 0, NULL, "expected done, got %s", type);
    for (size_t i = 0; i < n_got; i++) got[i].r.confirmed = 1;
    return ESCROW_OK;
}

/* The answer to the `status` that ended the holder's wait for a handoff we refused: error
 * (it took it for the wrong frame it is) or holder_status (its ack deadline had passed). */
static escrow_code receive_refusal(conn *c, double deadline, escrow_error *err) {
    frame f;
    escrow_code rc = escrow__recv_frame(c->sock, deadline, &f, err);
    if (rc != ESCROW_OK) return rc;
    if (strcmp(f.type, "error") != 0 && strcmp(f.type, "holder_status") != 0)
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL,
                          "expected the answer to status, got %s", f.type);
    escrow__frame_free(&f);
    return rc;
}

/* Retrieve ids[0..n) over `c` in one request. Every id ends with its answer in errs[i]
 * (code ESCROW_OK: taken, in the report; with `cu`, given to the custody too). Returns what
 * spoiled the whole call, if anything (then `c` is closed, or with `cu` lapsed). */
escrow_code escrow__exchange(conn *c, escrow_custody *cu, const char *const *ids, size_t n,
                             int journal, double deadline, escrow_reclaim_report *into,
                             escrow_error *errs) {
    mp_out o = {0};
    frame f;
    escrow_error whole;
    int keep = cu != NULL, refused = 0, acked = 0;
    size_t n_got = 0;
    char *answered = calloc(n, 1);
    taken *got = calloc(n, sizeof *got);
    escrow_code rc = answered == NULL || got == NULL
                         ? escrow__fail(&whole, ESCROW_SYSTEM, ENOMEM, NULL, "no memory")
                         : ESCROW_OK;
    if (rc == ESCROW_OK && cu != NULL) {
        /* The answer a custody call before is owed comes first (a late refusal of a
         * deposit is that deposit's, not this call's). */
        escrow_code owed = escrow__custody_in_step(cu, deadline, ids[0], &whole);
        if (cu->sock < 0) rc = escrow__custody_connected(cu, ids[0], &whole);
        else if (cu->owed != ESCROW__OWED_NONE) rc = owed; /* busy: nothing sent */
    }
    if (rc == ESCROW_OK) rc = escrow__check_retrieve_time(c, deadline, ids[0], &whole);
    if (rc == ESCROW_OK) {
        if (n == 1) rc = escrow__encode_retrieve(&o, ids[0], keep, journal, 0, &whole);
        else rc = escrow__encode_retrieve_many(&o, ids, n, keep, journal, 0, &whole);
    }
    for (size_t i = 0; i < n; i++) {
        memset(&errs[i], 0, sizeof errs[i]);
        if (rc != ESCROW_OK) { /* nothing sent: the connection is as it was */
            errs[i] = whole;
            snprintf(errs[i].id, sizeof errs[i].id, "%s", ids[i]);
        }
    }
    if (rc != ESCROW_OK) {
        free(o.data);
        free(answered);
        free(got);
        return rc;
    }
    rc = send_only(c, &o, deadline, &whole);
    int late = 0; /* into custody, not a byte of an answer in time: owed, the connection kept */
    for (size_t answers = 0; rc == ESCROW_OK && answers < n;) {
        if (cu != NULL && escrow__wait_io(c->sock, POLLIN, deadline) != 0) {
            int e = errno;
            rc = escrow__io_failed(&whole, e, "did not answer the retrieve");
            if (e == ETIMEDOUT) {
                /* The rest may come late: read before the next request, each handoff
                 * closed unacked (so are those taken here: never acked, the holder
                 * puts them back), and its wait for our ack ended by a status. */
                late = 1;
                cu->owed = ESCROW__OWED_RETRIEVE;
                cu->owed_count = (int)(n - answers);
                cu->owed_unacked = n_got > 0 || refused;
                snprintf(cu->owed_id, sizeof cu->owed_id, "%s", ids[0]);
            }
            break;
        }
        if ((rc = escrow__recv_frame(c->sock, deadline, &f, &whole)) != ESCROW_OK) break;
        if (strcmp(f.type, "error") == 0) {
            escrow_error e;
            escrow_code code = escrow__decode_error(&f, &e);
            long at = e.id[0] != 0 ? find(ids, n, e.id) : -1;
            escrow__frame_free(&f);
            if (at < 0 || answered[at]) { /* the whole request refused: nothing else comes */
                whole = e, rc = code;
                break;
            }
            answered[at] = 1, errs[at] = e, answers++;
            continue;
        }
        char type[16];
        memcpy(type, f.type, sizeof type);
        int t = strcmp(type, "handoff") == 0 ? take_handoff(&f, ids, n, errs, answered,
                                                            &got[n_got]) : -1;
        escrow__frame_free(&f);
        if (t < 0) {
            rc = escrow__fail(&whole, ESCROW_PROTOCOL, 0, NULL,
                              "the holder sent a %s unasked, twice or malformed", type);
            break;
        }
        answers++;
        if (t == 0) refused = 1;
        else n_got++;
    }
    /* One ack for all, now that we hold them; never read before `done`. */
    if (rc == ESCROW_OK && n_got > 0) {
        if (n_got == 1) {
            rc = escrow__encode_ack(&o, got[0].r.session.id, got[0].r.handoff_id, keep, &whole);
        } else {
            const char **a = calloc(n_got, sizeof *a), **h = calloc(n_got, sizeof *h);
            for (size_t i = 0; a != NULL && h != NULL && i < n_got; i++)
                a[i] = got[i].r.session.id, h[i] = got[i].r.handoff_id;
            rc = a == NULL || h == NULL
                     ? escrow__fail(&whole, ESCROW_SYSTEM, ENOMEM, NULL, "no memory")
                     : escrow__encode_ack_many(&o, a, h, n_got, keep, &whole);
            free(a);
            free(h);
        }
        acked = 1; /* from here on the holder may have taken it: resolve, never guess */
        if (rc == ESCROW_OK) rc = send_only(c, &o, deadline, &whole);
        free(o.data);
        o = (mp_out){0};
    }
    if (rc == ESCROW_OK && refused) {
        rc = escrow__encode_status(&o, &whole);
        if (rc == ESCROW_OK) rc = send_only(c, &o, deadline, &whole);
        free(o.data);
    }
    if (rc == ESCROW_OK && n_got > 0) {
        escrow_error refusal;
        memset(&refusal, 0, sizeof refusal);
        if (cu != NULL && escrow__wait_io(c->sock, POLLIN, deadline) != 0) {
            int e = errno;
            rc = escrow__io_failed(&whole, e, "did not answer the ack");
            if ((late = e == ETIMEDOUT) != 0) {
                /* Closing it would end custody of every session on it, these too if the
                 * holder took the ack: the late frames are read before the next request
                 * (escrow_resume.c), and the list decides these sessions below. */
                cu->owed = refused ? ESCROW__OWED_DONE_STATUS : ESCROW__OWED_DONE;
                snprintf(cu->owed_id, sizeof cu->owed_id, "%s", got[0].r.session.id);
            }
        } else {
            rc = receive_done(c, got, n_got, deadline, &refusal, &whole);
        }
        if (rc == ESCROW_OK && refusal.code != ESCROW_OK)
            for (size_t i = 0; i < n_got; i++) { /* the holder kept them: drains them again */
                errs[got[i].at] = refusal;
                snprintf(errs[got[i].at].id, sizeof errs[0].id, "%s", got[i].r.session.id);
                close_taken(&got[i]);
            }
    }
    if (rc == ESCROW_OK && refused) {
        if (cu != NULL && escrow__wait_io(c->sock, POLLIN, deadline) != 0) {
            int e = errno;
            rc = escrow__io_failed(&whole, e, "did not answer the status");
            if ((late = e == ETIMEDOUT) != 0) { /* the sessions are decided: owed only it */
                cu->owed = ESCROW__OWED_STATUS;
                snprintf(cu->owed_id, sizeof cu->owed_id, "%s", ids[0]);
            }
        } else {
            rc = receive_refusal(c, deadline, &whole);
        }
    }
    int lost = !late && (rc == ESCROW_UNAVAILABLE || rc == ESCROW_UNRESPONSIVE ||
                         rc == ESCROW_PROTOCOL || rc == ESCROW_SYSTEM);
    if (rc != ESCROW_OK) {
        /* No answer, or the stream out of step (or the whole request refused: then nothing
         * was handed off). With `keep` the custody's connection is lost; asked first, while
         * it still holds what it held. Without, ours is closed first (client/retrieve.py):
         * the holder winds our handoff up when it goes, and answers an ack sent again on a
         * fresh connection `busy` until then. */
        if (lost && cu == NULL) escrow__conn_close(c);
        for (size_t i = 0; i < n_got; i++) {
            taken *t = &got[i];
            if (t->r.fd < 0 || t->r.confirmed) continue;
            escrow_code verdict = rc;
            escrow_error why = whole;
            if (acked && keep) verdict = resolve_kept(c->client, t, &why);
            else if (acked) verdict = escrow__resolve(c->client, &t->r, &why);
            if (verdict != ESCROW_OK) { /* never acked, or kept: still the holder's */
                close_taken(t); /* (escrow__resolve gave the master back already) */
                errs[t->at] = why;
                errs[t->at].code = verdict;
            }
        }
        for (size_t i = 0; i < n; i++)
            if (answered == NULL || !answered[i]) {
                errs[i] = whole;
                errs[i].code = rc;
                snprintf(errs[i].id, sizeof errs[i].id, "%s", ids[i]);
            }
        if (lost && cu != NULL) escrow__custody_lost(cu, rc);
    }
    /* What was taken is the report's (and the custody's). */
    for (size_t i = 0; i < n_got; i++) {
        taken *t = &got[i];
        if (t->r.fd < 0) continue;
        if (cu != NULL) {
            /* Held on the connection we have, unless that is gone or the holder has no
             * copy: then it is deposited again. Unprotected if it cannot be kept: ours all
             * the same. */
            escrow_error ignored;
            escrow__custody_keep(cu, &t->r, journal, t->journal_fd,
                                 t->journal_fd >= 0 ? &t->journal : NULL,
                                 cu->sock >= 0 && !t->alone, &ignored);
        } else if (t->journal_fd >= 0) {
            close(t->journal_fd); /* unasked: this client writes no journal out of custody */
        }
        t->journal_fd = -1;
        if (report_take(into, &t->r) != 0) {
            close_taken(t); /* cannot report it: ours, but closed rather than leaked */
            escrow__fail(&errs[t->at], ESCROW_SYSTEM, ENOMEM, ids[t->at], "no memory");
        }
    }
    free(answered);
    free(got);
    return rc;
}

/* ---- retrieve into custody (PROTOCOL.md 12.6) ------------------------------------------- */

escrow_code escrow__custody_usable(escrow_custody *cu, const char *id, escrow_error *err) {
    escrow_code rc = escrow__custody_connected(cu, id, err);
    if (rc != ESCROW_OK) return rc;
    if (!escrow_has_feature(&cu->welcome, "keep"))
        return escrow__fail(err, ESCROW_CONFIG, 0, id,
                            "the holder (version %s) cannot retrieve into custody (keep): it "
                            "is older than this client; upgrade it",
                            cu->welcome.holder_version);
    return ESCROW_OK;
}

escrow_code escrow_custody_retrieve(escrow_custody *cu, const char *id, int journal,
                                    escrow_retrieved *out, escrow_error *err) {
    escrow_reclaim_report got;
    escrow_error why;
    memset(out, 0, sizeof *out);
    out->fd = -1;
    escrow_code rc = escrow__custody_usable(cu, id, err);
    if (rc != ESCROW_OK) return rc;
    memset(&got, 0, sizeof got);
    const char *ids[1] = {id};
    escrow__exchange(cu, cu, ids, 1, journal, escrow__now() + cu->client->timeout, &got, &why);
    if (got.n_retrieved == 1) {
        *out = got.retrieved[0];
        free(got.retrieved);
        return ESCROW_OK;
    }
    free(got.retrieved); /* (nothing in it: one id, not taken) */
    if (err != NULL) *err = why;
    return why.code;
}
