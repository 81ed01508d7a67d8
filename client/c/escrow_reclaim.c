/* escrow_reclaim.c: every session of the owner taken back at launch, with its report
 * (PROTOCOL.md section 16), as the reference client does (client/reclaim.py).
 *
 * Over one connection (a fresh one for escrow_reclaim_all, the custody's for
 * escrow_custody_reclaim_all) and under one deadline: status first (who answered, and
 * whether it restarted: an empty report from a holder that adopted nothing after restarts
 * means the escrow was lost), list, then the live sessions in rounds of exchanges
 * (escrow__exchange, escrow_retrieve_many.c) of at most 4096 ids: custody_held retried for a
 * 1 s grace, then only where the custodian is positively dead (gone, or a zombie); busy
 * retried with a back-off; no request started with drain_stop_budget + send_deadline or less
 * left. A later round's answer replaces an earlier one: the report ends with each session
 * either retrieved or failed, once.
 *
 * The fds: each master in the report is the caller's (escrow_reclaim_report_free closes
 * none), the sessions of every round that took them, whatever a later round met. The
 * connection of escrow_reclaim_all is opened and closed here (opened again for the next round
 * where one failed); a custody's stays the custody's, and a failure there lapses it.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_BATCH 4096        /* ids in one retrieve_many (section 12.7) */
#define CUSTODY_GRACE 1.0     /* custody_held retried this long: an old instance exiting */
#define RECLAIM_DEADLINE 8.0

/* ---- the report ------------------------------------------------------------------------- */

void escrow_reclaim_report_free(escrow_reclaim_report *r) {
    for (size_t i = 0; i < r->n_retrieved; i++) escrow_retrieved_free(&r->retrieved[i]);
    free(r->retrieved);
    free(r->failed);
    r->retrieved = NULL;
    r->failed = NULL;
    r->n_retrieved = r->n_failed = 0;
}

static void report_init(escrow_reclaim_report *r) {
    memset(r, 0, sizeof *r);
}

/* A session's answer for now (a later round may replace it, or take the session). */
static void report_fail(escrow_reclaim_report *r, const char *id, const escrow_error *e) {
    escrow_reclaim_failure *f = NULL;
    for (size_t i = 0; i < r->n_failed && f == NULL; i++)
        if (strcmp(r->failed[i].id, id) == 0) f = &r->failed[i];
    if (f == NULL) {
        escrow_reclaim_failure *grown = realloc(r->failed, (r->n_failed + 1) * sizeof *grown);
        if (grown == NULL) return; /* out of memory: the session is escrowed all the same */
        r->failed = grown;
        f = &r->failed[r->n_failed++];
    }
    snprintf(f->id, sizeof f->id, "%s", id);
    f->error = *e;
}

static void report_unfail(escrow_reclaim_report *r, const char *id) {
    for (size_t i = 0; i < r->n_failed; i++)
        if (strcmp(r->failed[i].id, id) == 0) {
            r->failed[i] = r->failed[--r->n_failed];
            return;
        }
}

static const escrow_error *report_failure(const escrow_reclaim_report *r, const char *id) {
    for (size_t i = 0; i < r->n_failed; i++)
        if (strcmp(r->failed[i].id, id) == 0) return &r->failed[i].error;
    return NULL;
}


/* ---- the reclaim (PROTOCOL.md section 16) ----------------------------------------------- */

/* Positive proof only: the custodian's pid is gone (ESRCH), or a zombie. */
static int custodian_dead(int64_t pid) {
    if (pid <= 0 || pid > INT32_MAX) return 0;
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
#ifdef __linux__
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *stat = fopen(path, "re");
    if (stat == NULL) return 0;
    size_t len = fread(buf, 1, sizeof buf - 1, stat);
    fclose(stat);
    buf[len] = 0;
    const char *paren = strrchr(buf, ')'); /* the name may hold anything, ")" too */
    return paren != NULL && paren[1] == ' ' && paren[2] == 'Z';
#else
    return 0;
#endif
}

static int live_state(const char *state) {
    return strcmp(state, "held") == 0 || strcmp(state, "draining") == 0 ||
           strcmp(state, "handing_off") == 0 || strcmp(state, "exited") == 0;
}

/* One question of the survey: on the custody's connection (`cu`) a call kept in step,
 * owed its answer if it does not come in time (closing the connection would end custody
 * of every session on it); else on `c`. */
static escrow_code ask(conn *c, escrow_custody *cu, mp_out *o, const char *want, int kind,
                       double deadline, frame *f, escrow_error *err) {
    int doubt;
    if (cu == NULL) return escrow__call(c, o, -1, want, deadline, f, err);
    return escrow__custody_call(cu, o, -1, want, kind, "", deadline, f, &doubt, err);
}

/* status, then list, on `c`: the report's header and the live sessions. */
static escrow_code survey(conn *c, escrow_custody *cu, double deadline,
                          escrow_reclaim_report *out, escrow_session **live, size_t *n_live,
                          escrow_error *err) {
    mp_out o = {0};
    frame f;
    escrow_status st;
    escrow_code rc = escrow__encode_status(&o, err);
    if (rc == ESCROW_OK)
        rc = ask(c, cu, &o, "holder_status", ESCROW__OWED_STATUS, deadline, &f, err);
    free(o.data);
    if (rc != ESCROW_OK) return rc;
    int bad = escrow__decode_status(&f, &st);
    escrow__frame_free(&f);
    if (bad) return escrow__fail(err, ESCROW_PROTOCOL, 0, NULL, "a malformed holder_status");
    snprintf(out->holder_instance, sizeof out->holder_instance, "%s", st.instance);
    out->adopted = st.adopted;
    out->restarts = st.restarts;
    out->unclean_restarts = st.unclean_restarts;
    o = (mp_out){0};
    rc = escrow__encode_list(&o, 0, err);
    if (rc == ESCROW_OK) rc = ask(c, cu, &o, "sessions", ESCROW__OWED_LIST, deadline, &f, err);
    free(o.data);
    if (rc != ESCROW_OK) return rc;
    escrow_session *all = NULL;
    size_t n = 0;
    bad = escrow__decode_sessions(&f, &all, &n);
    escrow__frame_free(&f);
    if (bad) {
        escrow_sessions_free(all, n);
        return escrow__fail(err, ESCROW_PROTOCOL, 0, NULL, "a malformed sessions list");
    }
    *n_live = 0;
    for (size_t i = 0; i < n; i++) {
        if (live_state(all[i].state)) all[(*n_live)++] = all[i];
        else escrow_session_clear(&all[i]);
    }
    *live = all;
    return ESCROW_OK;
}

/* Every live session of the owner over `c` (the custody's with `cu`), in rounds. */
static escrow_code reclaim(conn *c, escrow_custody *cu, int journal, double total,
                           escrow_reclaim_report *out, escrow_error *err) {
    const escrow_client *cl = c->client;
    double span = total > 0 ? total : RECLAIM_DEADLINE, until = escrow__now() + span;
    double needs = c->welcome.drain_stop_budget + c->welcome.send_deadline;
    double call = escrow__now() + (cl->timeout < span ? cl->timeout : span);
    escrow_session *live = NULL;
    size_t n_live = 0, n_pending = 0;
    if (cl->timeout <= needs || span <= needs)
        return escrow__fail(err, ESCROW_CONFIG, 0, NULL,
                            "%s %.3gs must exceed the holder's drain_stop_budget + "
                            "send_deadline = %.3gs", cl->timeout <= needs ? "client timeout"
                            : "reclaim deadline", cl->timeout <= needs ? cl->timeout : span,
                            needs);
    escrow_code rc = survey(c, cu, call, out, &live, &n_live, err);
    if (rc != ESCROW_OK) return rc; /* (into custody: owed, or lost, as the call left it) */
    if (n_live > 0 && until - escrow__now() <= needs)
        rc = escrow__fail(err, ESCROW_CONFIG, 0, NULL, "reclaim deadline left %.3gs must "
                          "exceed the holder's drain_stop_budget + send_deadline = %.3gs",
                          until - escrow__now(), needs);
    const char **pending = calloc(n_live + 1, sizeof *pending);
    escrow_error *why = calloc(n_live < MAX_BATCH ? n_live + 1 : MAX_BATCH, sizeof *why);
    if (rc == ESCROW_OK && (pending == NULL || why == NULL))
        rc = escrow__fail(err, ESCROW_SYSTEM, ENOMEM, NULL, "no memory");
    for (size_t i = 0; rc == ESCROW_OK && i < n_live; i++) pending[n_pending++] = live[i].id;
    double grace_ends = escrow__now() + CUSTODY_GRACE;
    int pause_ms = 20;
    while (rc == ESCROW_OK && n_pending > 0) {
        double left = until - escrow__now();
        if (left <= needs) { /* out of time: the last real answer stays, if there was one */
            for (size_t i = 0; i < n_pending; i++)
                if (report_failure(out, pending[i]) == NULL) {
                    escrow_error e;
                    escrow__fail(&e, ESCROW_UNRESPONSIVE, 0, pending[i], "not enough of the "
                                 "reclaim deadline left to retrieve %s", pending[i]);
                    report_fail(out, pending[i], &e);
                }
            break;
        }
        call = escrow__now() + (cl->timeout < left ? cl->timeout : left);
        size_t size = escrow_has_feature(&c->welcome, "retrieve_many") ? MAX_BATCH : 1;
        size_t n_retry = 0;
        for (size_t start = 0; start < n_pending; start += size) {
            size_t n = n_pending - start < size ? n_pending - start : size;
            const char *const *batch = pending + start;
            if (c->sock < 0) {
                escrow_error e;
                escrow_code code = cu != NULL
                    ? escrow__fail(&e, ESCROW_UNAVAILABLE, 0, NULL,
                                   "the custody connection closed during the reclaim")
                    : escrow__connect_greet(cl, c, call, &e);
                for (size_t i = 0; code != ESCROW_OK && i < n; i++) {
                    why[i] = e;
                    why[i].code = code;
                }
                if (code == ESCROW_OK)
                    escrow__exchange(c, cu, batch, n, journal, call, out, why);
            } else {
                escrow__exchange(c, cu, batch, n, journal, call, out, why);
            }
            /* Retry custody_held within the grace, then only where the custodian is dead;
             * busy always (another client's handoff may yet be put back). */
            for (size_t i = 0; i < n; i++) {
                if (why[i].code == ESCROW_OK) {
                    report_unfail(out, batch[i]);
                    continue;
                }
                snprintf(why[i].id, sizeof why[i].id, "%s", batch[i]);
                report_fail(out, batch[i], &why[i]);
                int retry = why[i].code == ESCROW_BUSY;
                if (why[i].code == ESCROW_CUSTODY_HELD) {
                    retry = escrow__now() < grace_ends;
                    for (size_t j = 0; !retry && j < n_live; j++)
                        if (strcmp(live[j].id, batch[i]) == 0)
                            retry = custodian_dead(live[j].custodian_pid);
                }
                if (retry) pending[n_retry++] = batch[i];
            }
        }
        n_pending = n_retry;
        if (n_pending > 0) {
            int ms = escrow__ms_left(until);
            poll(NULL, 0, pause_ms < ms ? pause_ms : ms);
            pause_ms = pause_ms * 2 < 250 ? pause_ms * 2 : 250;
        }
    }
    free(pending);
    free(why);
    escrow_sessions_free(live, n_live);
    return rc;
}

escrow_code escrow_custody_reclaim_all(escrow_custody *cu, int journal, double deadline,
                                       escrow_reclaim_report *out, escrow_error *err) {
    report_init(out);
    escrow_code rc = escrow__custody_usable(cu, NULL, err);
    if (rc != ESCROW_OK) return rc;
    /* The answer a call before is owed first: taken for the survey's, it would put every
     * later answer one behind (a status read as the list...). Still owed: nothing sent. */
    escrow_code owed = escrow__custody_in_step(cu, escrow__now() + cu->client->timeout, "", err);
    if ((rc = escrow__custody_usable(cu, NULL, err)) != ESCROW_OK) return rc;
    if (cu->owed != ESCROW__OWED_NONE) return owed;
    return reclaim(cu, cu, journal, deadline, out, err);
}

escrow_code escrow_reclaim_all(const escrow_client *c, double deadline,
                               escrow_reclaim_report *out, escrow_error *err) {
    conn cn;
    report_init(out);
    escrow_code rc = escrow__connect_greet(c, &cn, escrow__now() + c->timeout, err);
    if (rc != ESCROW_OK) return rc;
    rc = reclaim(&cn, NULL, 0, deadline, out, err);
    escrow__conn_close(&cn);
    return rc;
}
