/* escrow_resume.c: the custody's connection kept in step, and taking custody back when the
 * holder goes away (PROTOCOL.md section 10.4; one request at a time, section 5).
 *
 * Every session a custody holds stays `held` only while its connection is open: closing it
 * ends custody of all of them, and they start draining while the app still reads them (two
 * readers splitting one stream). So a call that got no answer in time does not close it.
 * If its request left whole, the holder may yet act on it and answer late: the custody
 * records the answer it is owed, and what for (a deposit of an id, a release, an update),
 * says protection is not known (escrow_custody_protected 0), and reads that answer before
 * anything else is sent, within the deadline of whichever call comes next, or when
 * escrow_custody_fd turns readable because it arrived (escrow_custody_check). A late
 * `deposited` settles the deposit (held, its journal mapped); a late refusal leaves it kept
 * and not held, as the Python client keeps it pending: nothing is given up on a late word,
 * and escrow_custody_resume deposits it again. A request that never left is no doubt at
 * all. Only a connection that is broken (a hang-up, a reset, a frame cut or not the
 * protocol, an answer of the wrong type: what the holder made of our requests is not known
 * and no later answer can be believed) is closed: protection has lapsed until a resume.
 *
 * Taking custody back (10.4): when the holder goes away the connection hangs up and
 * escrow_custody_fd turns readable; escrow_custody_check closes it, and
 * escrow_custody_resume, after escrow_custody_retry_ms (100 ms doubling to 2 s), holds
 * every kept session again on a new connection: one that holder adopted is resumed (a
 * deposit from this process of the same terminal, answered `deposited`), one it does not
 * know is deposited again from the duplicate. A `deposited` with a journal file moves the
 * writer to it; one with none stops the writer, since that holder will never read the old
 * file. `exists` means escrowed but no longer held for us: its journal stops and it is
 * asked again later; the others are held meanwhile. A session whose duplicate could not be
 * made cannot be given to anyone: protection stays 0 until the app releases it.
 *
 * The fds: the connection is the custody's (`sock`); a lapse closes it, a resume replaces
 * it. A journal file that comes with an answer is mapped and closed with its frame. No fd
 * is opened here otherwise.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define RETRY_FIRST_MS 100
#define RETRY_MAX_MS 2000

static escrow_kept *find(const escrow_custody *cu, const char *id) {
    for (size_t i = 0; i < cu->n_kept; i++)
        if (strcmp(cu->kept[i].id, id) == 0) return &cu->kept[i];
    return NULL;
}

/* The journal file an answer carried (its last fd), mapped for `k`; an answer with none
 * stops the writer: that holder will never read the old file (section 10.4). The file
 * stays the frame's, closed with it. */
static void take_journal(escrow_custody *cu, escrow_kept *k, const journal_info *info,
                         const frame *f) {
    escrow__journal_unmap(&k->journal); /* the same file again, or another: remapped */
    if (!info->set || f->nfds < 1) return;
    /* A file that fails the checks is not journaled: escrowed all the same. */
    (void)escrow__journal_map(&k->journal, f->fds[0], info,
                              escrow_has_feature(&cu->welcome, "journal_reading"));
}

/* ---- lapses ----------------------------------------------------------------------------- */

void escrow__custody_lost(escrow_custody *cu, escrow_code why) {
    escrow__conn_close(cu);
    for (size_t i = 0; i < cu->n_kept; i++) {
        escrow_kept *k = &cu->kept[i];
        if (why != ESCROW_UNAVAILABLE) {
            /* The holder lives, saw us go, and drains what was held here (10.2): its ring
             * is the holder's, and an app that read on would be a second reader. */
            escrow__journal_unmap(&k->journal);
            k->gone = 1;
        }
        k->held = 0;
    }
    cu->owed = ESCROW__OWED_NONE; /* a deposit owed its answer is not held: resume settles it */
    cu->lapsed = 1;
    if (cu->retry_ms <= 0) cu->retry_ms = RETRY_FIRST_MS;
}

/* ---- the connection in step (PROTOCOL.md section 5) ------------------------------------- */

/* The next answer, `want` or an `error` (its code). *none 1: not a byte of it came by the
 * deadline, and the stream is still in step. Any other failure breaks the connection. */
static escrow_code answer(escrow_custody *cu, const char *want, double deadline, frame *f,
                          int *none, escrow_error *err) {
    *none = 0;
    if (escrow__wait_io(cu->sock, POLLIN, deadline) != 0) {
        int e = errno;
        *none = e == ETIMEDOUT;
        return escrow__io_failed(err, e, "did not answer");
    }
    escrow_code rc = escrow__recv_frame(cu->sock, deadline, f, err);
    if (rc != ESCROW_OK) return rc; /* cut, or not the protocol, or the holder hung up */
    if (strcmp(f->type, want) == 0) return ESCROW_OK;
    if (strcmp(f->type, "error") == 0) rc = escrow__decode_error(f, err);
    else rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL, "expected %s, got %s", want, f->type);
    escrow__frame_free(f);
    return rc;
}

/* A code that says the stream can no longer be believed (an `error` answer keeps it). */
static int breaks(escrow_code rc) {
    return rc == ESCROW_UNAVAILABLE || rc == ESCROW_UNRESPONSIVE || rc == ESCROW_PROTOCOL ||
           rc == ESCROW_SYSTEM;
}

static const char *const owed_answer[] = {"", "deposited", "released", "updated"};

static escrow_code still_owed(escrow_custody *cu, const char *id, escrow_error *err) {
    return escrow__fail(err, ESCROW_BUSY, ETIMEDOUT, id != NULL && id[0] ? id : cu->owed_id,
                        "the holder has not answered the call before (on %s) yet: nothing "
                        "was sent, nothing kept", cu->owed_id);
}

/* A retrieve's answer read late: a handoff (its fds closed with the frame: never acked),
 * or an error (one naming no id refused the whole request: nothing else comes). -1: not
 * a retrieve's answer. */
static int late_answer(escrow_custody *cu, const frame *f) {
    if (strcmp(f->type, "handoff") == 0) {
        cu->owed_unacked = 1;
    } else if (strcmp(f->type, "error") == 0) {
        escrow_error e;
        memset(&e, 0, sizeof e);
        if (escrow__decode_error_fields(f, &e) != 0) return -1;
        if (e.id[0] == 0) cu->owed_count = 1;
    } else {
        return -1;
    }
    return 0;
}

/* The late frames of a retrieve into custody (12.6), of a survey, of a retrieve whose
 * answers did not all come: whatever they say, the sessions were decided (on a fresh
 * connection, or never acked); read to put the stream back in step. */
static escrow_code late_frames(escrow_custody *cu, double deadline, const char *id,
                               escrow_error *err) {
    while (cu->owed >= ESCROW__OWED_DONE) {
        frame f;
        escrow_code rc = ESCROW_OK;
        if (cu->owed == ESCROW__OWED_RETRIEVE && cu->owed_count <= 0) {
            /* Every answer read; a handoff went unacked: the holder waits for our ack
             * until a frame that is not one ends it (answered error, or holder_status). */
            mp_out o = {0};
            rc = escrow__encode_status(&o, err);
            if (rc == ESCROW_OK)
                rc = escrow__send_frame(cu->sock, o.data, o.len, -1, deadline, err);
            free(o.data);
            if (rc != ESCROW_OK) {
                escrow__custody_lost(cu, rc); /* (a status cut short is out of step) */
                return rc;
            }
            cu->owed = ESCROW__OWED_STATUS;
            continue;
        }
        if (escrow__wait_io(cu->sock, POLLIN, deadline) != 0) {
            int e = errno;
            if (e == ETIMEDOUT) return still_owed(cu, id, err);
            rc = escrow__io_failed(err, e, "did not answer");
        }
        if (rc == ESCROW_OK) rc = escrow__recv_frame(cu->sock, deadline, &f, err);
        if (rc != ESCROW_OK) {
            escrow__custody_lost(cu, rc);
            return rc;
        }
        if (cu->owed == ESCROW__OWED_RETRIEVE) {
            if (late_answer(cu, &f) != 0) {
                rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL, "expected a retrieve's "
                                  "answer, got %s", f.type);
                escrow__frame_free(&f);
                escrow__custody_lost(cu, rc);
                return rc;
            }
            escrow__frame_free(&f);
            if (--cu->owed_count <= 0 && !cu->owed_unacked) cu->owed = ESCROW__OWED_NONE;
            continue;
        }
        escrow__frame_free(&f);
        cu->owed = cu->owed == ESCROW__OWED_DONE_STATUS ? ESCROW__OWED_STATUS : ESCROW__OWED_NONE;
    }
    return ESCROW_OK;
}

escrow_code escrow__custody_in_step(escrow_custody *cu, double deadline, const char *id,
                                    escrow_error *err) {
    if (cu->owed == ESCROW__OWED_NONE || cu->sock < 0) return ESCROW_OK;
    if (cu->owed >= ESCROW__OWED_DONE) return late_frames(cu, deadline, id, err);
    frame f;
    int none;
    int kind = cu->owed;
    escrow_code rc = answer(cu, owed_answer[kind], deadline, &f, &none, err);
    if (none) return still_owed(cu, id, err); /* nothing may be sent before it */
    escrow_kept *k = kind == ESCROW__OWED_DEPOSIT ? find(cu, cu->owed_id) : NULL;
    int have_frame = rc == ESCROW_OK;
    if (rc == ESCROW_OK && kind == ESCROW__OWED_DEPOSIT) {
        char got[ESCROW_NAME_MAX + 1];
        journal_info journal;
        if (escrow__decode_deposited(&f, got, &journal) != 0 || strcmp(got, cu->owed_id) != 0)
            rc = escrow__fail(err, ESCROW_PROTOCOL, 0, cu->owed_id, "a malformed deposited");
        else if (k != NULL) { /* (released meanwhile: nothing left to settle) */
            take_journal(cu, k, &journal, &f);
            k->held = 1;
            k->gone = 0;
        }
    } else if (rc == ESCROW_OK) {
        char got[ESCROW_NAME_MAX + 1];
        if (escrow__decode_id(&f, got) != 0)
            rc = escrow__fail(err, ESCROW_PROTOCOL, 0, cu->owed_id, "a malformed %s",
                              owed_answer[kind]);
    }
    if (have_frame) escrow__frame_free(&f);
    if (breaks(rc)) {
        escrow__custody_lost(cu, rc);
        return rc;
    }
    cu->owed = ESCROW__OWED_NONE; /* in step again */
    if (rc != ESCROW_OK && k != NULL) {
        /* A late refusal: not escrowed by that deposit, but kept, to be deposited again. */
        if (err != NULL) snprintf(err->id, sizeof err->id, "%s", k->id);
        cu->lapsed = 1;
        if (cu->retry_ms <= 0) cu->retry_ms = RETRY_FIRST_MS;
        return rc;
    }
    return ESCROW_OK; /* a late release or update, whatever it said, is over */
}

escrow_code escrow__custody_call(escrow_custody *cu, mp_out *o, int fd, const char *want,
                                 int kind, const char *id, double deadline, frame *f,
                                 int *doubt, escrow_error *err) {
    int64_t limit;
    escrow_code rc = ESCROW_OK;
    *doubt = 0;
    (void)escrow__custody_in_step(cu, deadline, id, err);
    if (cu->sock < 0) {
        rc = escrow__fail(err, ESCROW_UNAVAILABLE, 0, id,
                          "custody lapsed (the holder went away): escrow_custody_resume first");
    } else if (cu->owed != ESCROW__OWED_NONE) {
        rc = still_owed(cu, id, err);
    } else if (escrow_ints_get(&cu->welcome.limits, "max_request_bytes", &limit) &&
               (int64_t)o->len - 4 > limit) {
        /* The holder would end the connection, and with it custody of every session. */
        rc = escrow__fail(err, ESCROW_BAD_REQUEST, 0, id,
                          "a request of %zu bytes is over the holder's limit of %lld: "
                          "nothing was sent", o->len - 4, (long long)limit);
    } else if (escrow__wait_io(cu->sock, POLLOUT, deadline) != 0) {
        rc = escrow__io_failed(err, errno, "did not take a request"); /* nothing left */
    }
    if (rc != ESCROW_OK) return rc;
    rc = escrow__send_frame(cu->sock, o->data, o->len, fd, deadline, err);
    if (rc == ESCROW_OK) {
        int none;
        rc = answer(cu, want, deadline, f, &none, err);
        if (none) {
            /* Left whole, not answered yet: the holder may act on it. Owed, kept open. */
            cu->owed = kind;
            snprintf(cu->owed_id, sizeof cu->owed_id, "%s", id);
            *doubt = 1;
            return rc;
        }
    }
    if (breaks(rc)) {
        /* A refusal read after EPIPE is an answer; anything else may have reached it. */
        *doubt = 1;
        escrow__custody_lost(cu, rc);
    }
    return rc;
}

escrow_code escrow__custody_send_deposit(escrow_custody *cu, escrow_kept *k, double deadline,
                                         int *doubt, escrow_error *err) {
    mp_out o = {0};
    frame f;
    escrow_deposit_opts opts = {k->label, k->child_pid, k->cols, k->rows, k->meta,
                                k->meta_count, k->journal_asked};
    *doubt = 0;
    escrow_code rc = escrow__encode_deposit(&o, k->id, &opts, k->journal_asked, err);
    if (rc == ESCROW_OK)
        rc = escrow__custody_call(cu, &o, k->fd, "deposited", ESCROW__OWED_DEPOSIT, k->id,
                                  deadline, &f, doubt, err);
    free(o.data);
    if (rc != ESCROW_OK) return rc;
    char got[ESCROW_NAME_MAX + 1];
    journal_info journal;
    if (escrow__decode_deposited(&f, got, &journal) != 0 || strcmp(got, k->id) != 0) {
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, k->id, "a malformed deposited");
        *doubt = 1;
        escrow__custody_lost(cu, rc); /* an answer that is not this request's: out of step */
    } else {
        take_journal(cu, k, &journal, &f);
        k->held = 1;
        k->gone = 0;
    }
    escrow__frame_free(&f);
    return rc;
}

/* ---- when the holder goes away (PROTOCOL.md 10.4) --------------------------------------- */

int escrow_custody_fd(const escrow_custody *cu) { return cu->sock; }

int escrow_custody_protected(const escrow_custody *cu) {
    if (cu->sock < 0 || cu->lapsed || cu->owed != ESCROW__OWED_NONE || cu->unkept > 0)
        return 0;
    for (size_t i = 0; i < cu->n_kept; i++)
        if (!cu->kept[i].held || cu->kept[i].fd < 0) return 0;
    return 1;
}

int escrow_custody_retry_ms(const escrow_custody *cu) {
    return cu->retry_ms > 0 ? cu->retry_ms : RETRY_FIRST_MS;
}

escrow_code escrow_custody_check(escrow_custody *cu, escrow_error *err) {
    if (cu->sock < 0)
        return escrow__fail(err, cu->lapsed ? ESCROW_UNAVAILABLE : ESCROW_CONFIG, 0, NULL,
                            cu->lapsed ? "custody lapsed (the holder went away): "
                                         "escrow_custody_resume first"
                                       : "this custody is closed");
    struct pollfd p = {cu->sock, POLLIN, 0};
    if (poll(&p, 1, 0) <= 0 || p.revents == 0) return ESCROW_OK; /* nothing: still there */
    if (cu->owed != ESCROW__OWED_NONE) /* the late answer, or a hang-up */
        return escrow__custody_in_step(cu, escrow__now() + cu->client->timeout, NULL, err);
    unsigned char byte;
    ssize_t n = (p.revents & POLLIN) ? recv(cu->sock, &byte, 1, MSG_PEEK) : 0;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return ESCROW_OK;
    int e = n < 0 ? errno : 0;
    escrow__custody_lost(cu, n > 0 ? ESCROW_PROTOCOL : ESCROW_UNAVAILABLE);
    if (n > 0) /* the holder never speaks unasked */
        return escrow__fail(err, ESCROW_PROTOCOL, 0, NULL,
                            "the holder sent a frame nobody asked for: custody lapsed");
    return escrow__fail(err, ESCROW_UNAVAILABLE, e, NULL,
                        "the holder went away: custody lapsed until a resume");
}

/* The first refusal of a resume names its session; the others stay held meanwhile. */
static void first_refusal(escrow_code *refused, const escrow_error *why, escrow_error *err) {
    if (*refused != ESCROW_OK) return;
    *refused = why->code;
    if (err != NULL) *err = *why;
}

/* Give every kept session not held on the connection we have to the holder. */
static escrow_code hold_all(escrow_custody *cu, double deadline, escrow_error *err) {
    escrow_code refused = ESCROW_OK;
    for (size_t i = 0; i < cu->n_kept; i++) {
        escrow_kept *k = &cu->kept[i];
        escrow_error why;
        int doubt;
        if (k->held && k->fd >= 0) continue;
        if (k->fd < 0) {
            /* Nothing to give the next holder: held by us (or draining), never protected. */
            escrow__fail(&why, ESCROW_SYSTEM, EMFILE, k->id, "no duplicate of %s could be "
                         "kept: it is unprotected until released", k->id);
            first_refusal(&refused, &why, err);
            continue;
        }
        escrow_code got = escrow__custody_send_deposit(cu, k, deadline, &doubt, &why);
        if (doubt) { /* owed its answer (the connection kept), or the connection lost */
            if (err != NULL) *err = why;
            return got;
        }
        if (got != ESCROW_OK) {
            /* exists: escrowed, but not held for us (or limit...): its journal stops, it is
             * asked again next time. */
            escrow__journal_unmap(&k->journal);
            if (got == ESCROW_EXISTS) k->gone = 1; /* another's reader, not ours */
            snprintf(why.id, sizeof why.id, "%s", k->id);
            first_refusal(&refused, &why, err);
        }
    }
    return refused;
}

escrow_code escrow_custody_resume(escrow_custody *cu, escrow_error *err) {
    escrow_code rc = ESCROW_OK;
    double deadline = escrow__now() + cu->client->timeout; /* one for the whole resume */
    if (cu->sock < 0 && !cu->lapsed)
        return escrow__fail(err, ESCROW_CONFIG, 0, NULL, "this custody is closed");
    if (cu->sock >= 0) {
        /* A late refusal is deposited again below; a broken connection is replaced. */
        escrow_code got = escrow__custody_in_step(cu, deadline, NULL, err);
        if (cu->sock >= 0 && cu->owed != ESCROW__OWED_NONE) rc = got; /* still owed */
    }
    if (rc == ESCROW_OK && cu->sock < 0) {
        escrow_custody fresh; /* escrow__connect_greet clears what it is given */
        rc = escrow__connect_greet(cu->client, &fresh, deadline, err);
        if (rc == ESCROW_OK) {
            cu->sock = fresh.sock;
            cu->welcome = fresh.welcome;
        }
    }
    if (rc == ESCROW_OK) rc = hold_all(cu, deadline, err);
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
