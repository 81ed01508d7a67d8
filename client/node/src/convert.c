/* convert.c: JS values into the C client's arguments, and its answers into JS values.
 *
 * Every string the C client reads is copied onto the heap of the op that carries it (the op
 * runs off the main thread, where no JS value may be touched), and freed with the op. Every
 * answer is built on the main thread from the op's copy; a replay is copied into a Buffer,
 * and the C answer is freed by the op. A null in C (-1 for a pid, "" for a handoff id) is
 * null in JS, as the Python client and the protocol have it.
 */
#define _GNU_SOURCE
#include "addon.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- errors ----------------------------------------------------------------------------- */

void escrow__node_throw_napi(napi_env env) {
    bool pending = false;
    if (napi_is_exception_pending(env, &pending) == napi_ok && pending) return;
    const napi_extended_error_info *info = NULL;
    napi_get_last_error_info(env, &info);
    napi_throw_error(env, NULL,
                     info != NULL && info->error_message ? info->error_message : "napi failed");
}

static void set_str(napi_env env, napi_value o, const char *key, const char *s) {
    napi_value v;
    if (s == NULL) napi_get_null(env, &v);
    else napi_create_string_utf8(env, s, NAPI_AUTO_LENGTH, &v);
    napi_set_named_property(env, o, key, v);
}

static void set_i64(napi_env env, napi_value o, const char *key, int64_t n) {
    napi_value v;
    napi_create_int64(env, n, &v);
    napi_set_named_property(env, o, key, v);
}

/* -1 (the C client's nil) is null. */
static void set_opt(napi_env env, napi_value o, const char *key, int64_t n) {
    napi_value v;
    if (n < 0) napi_get_null(env, &v);
    else napi_create_int64(env, n, &v);
    napi_set_named_property(env, o, key, v);
}

static void set_f64(napi_env env, napi_value o, const char *key, double d) {
    napi_value v;
    napi_create_double(env, d, &v);
    napi_set_named_property(env, o, key, v);
}

static void set_bool(napi_env env, napi_value o, const char *key, int b) {
    napi_value v;
    napi_get_boolean(env, b != 0, &v);
    napi_set_named_property(env, o, key, v);
}

napi_value escrow__node_error(napi_env env, const escrow_error *e) {
    napi_value msg, error;
    napi_create_string_utf8(env, e->message[0] ? e->message : e->code_name, NAPI_AUTO_LENGTH,
                            &msg);
    napi_create_error(env, NULL, msg, &error);
    set_str(env, error, "code", e->code_name[0] ? e->code_name : escrow_code_name(e->code));
    set_str(env, error, "id", e->id[0] ? e->id : NULL);
    set_i64(env, error, "errno", e->sys_errno);
    if (e->n_versions > 0) {
        napi_value versions;
        napi_create_array_with_length(env, e->n_versions, &versions);
        for (size_t i = 0; i < e->n_versions; i++) {
            napi_value n;
            napi_create_int64(env, e->versions[i], &n);
            napi_set_element(env, versions, (uint32_t)i, n);
        }
        napi_set_named_property(env, error, "versions", versions);
    }
    return error;
}

napi_value escrow__node_throw(napi_env env, escrow_code code, const char *fmt, ...) {
    escrow_error e;
    va_list ap;
    memset(&e, 0, sizeof e);
    e.code = code;
    snprintf(e.code_name, sizeof e.code_name, "%s", escrow_code_name(code));
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    napi_throw(env, escrow__node_error(env, &e));
    return NULL;
}

/* ---- arguments -------------------------------------------------------------------------- */

static int is_nullish(napi_env env, napi_value v) {
    napi_valuetype t;
    return v == NULL || napi_typeof(env, v, &t) != napi_ok || t == napi_null ||
           t == napi_undefined;
}

char *escrow__node_string(napi_env env, napi_value v, int optional, int *present) {
    size_t len = 0;
    if (present != NULL) *present = 0;
    if (optional && is_nullish(env, v)) return NULL;
    if (napi_get_value_string_utf8(env, v, NULL, 0, &len) != napi_ok) {
        napi_throw_type_error(env, NULL, "a string was expected");
        return NULL;
    }
    char *s = malloc(len + 1);
    if (s == NULL) {
        escrow__node_throw(env, ESCROW_SYSTEM, "out of memory");
        return NULL;
    }
    napi_get_value_string_utf8(env, v, s, len + 1, &len);
    if (strlen(s) != len) { /* a NUL inside: the C client would read a shorter name */
        free(s);
        napi_throw_type_error(env, NULL, "a string with a NUL character");
        return NULL;
    }
    if (present != NULL) *present = 1;
    return s;
}

int escrow__node_int64(napi_env env, napi_value v, int64_t dflt, int64_t *out) {
    if (is_nullish(env, v)) return *out = dflt, 0;
    if (napi_get_value_int64(env, v, out) != napi_ok) {
        napi_throw_type_error(env, NULL, "a number was expected");
        return -1;
    }
    return 0;
}

int escrow__node_double(napi_env env, napi_value v, double dflt, double *out) {
    if (is_nullish(env, v)) return *out = dflt, 0;
    if (napi_get_value_double(env, v, out) != napi_ok) {
        napi_throw_type_error(env, NULL, "a number was expected");
        return -1;
    }
    return 0;
}

int escrow__node_bool(napi_env env, napi_value v, int dflt, int *out) {
    bool b;
    if (is_nullish(env, v)) return *out = dflt, 0;
    if (napi_get_value_bool(env, v, &b) != napi_ok) {
        napi_throw_type_error(env, NULL, "a boolean was expected");
        return -1;
    }
    *out = b;
    return 0;
}

napi_value escrow__node_get(napi_env env, napi_value object, const char *key) {
    napi_value v = NULL;
    if (is_nullish(env, object) || napi_get_named_property(env, object, key, &v) != napi_ok)
        return NULL;
    return v;
}

void escrow__node_meta_free(escrow__node_meta *m) {
    for (size_t i = 0; i < 2 * m->count; i++) free(m->strings[i]);
    m->count = 0;
}

int escrow__node_read_meta(napi_env env, napi_value v, escrow__node_meta *m) {
    napi_value keys;
    uint32_t n = 0;
    memset(m, 0, sizeof *m);
    if (is_nullish(env, v)) return 0;
    m->given = 1;
    if (napi_get_property_names(env, v, &keys) != napi_ok ||
        napi_get_array_length(env, keys, &n) != napi_ok) {
        napi_throw_type_error(env, NULL, "meta: an object of strings was expected");
        return -1;
    }
    if (n > ESCROW_META_MAX) {
        escrow__node_throw(env, ESCROW_CONFIG, "meta has %u entries, over %d", n,
                           ESCROW_META_MAX);
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        napi_value key, value;
        napi_get_element(env, keys, i, &key);
        napi_get_property(env, v, key, &value);
        char *k = escrow__node_string(env, key, 0, NULL);
        char *val = k == NULL ? NULL : escrow__node_string(env, value, 0, NULL);
        if (val == NULL) {
            free(k);
            escrow__node_meta_free(m);
            return -1;
        }
        m->strings[2 * m->count] = k;
        m->strings[2 * m->count + 1] = val;
        m->entries[m->count++] = (escrow_meta){k, val};
    }
    return 0;
}

/* {label, childPid, cols, rows, meta, journal}, every one optional. */
int escrow__node_read_opts(napi_env env, napi_value v, escrow_deposit_opts *o, char **label,
                           escrow__node_meta *m) {
    memset(o, 0, sizeof *o);
    o->cols = 80;
    o->rows = 24;
    *label = escrow__node_string(env, escrow__node_get(env, v, "label"), 1, NULL);
    bool pending = false;
    napi_is_exception_pending(env, &pending);
    if (pending) return -1;
    o->label = *label;
    if (escrow__node_int64(env, escrow__node_get(env, v, "childPid"), 0, &o->child_pid) != 0 ||
        escrow__node_int64(env, escrow__node_get(env, v, "cols"), 80, &o->cols) != 0 ||
        escrow__node_int64(env, escrow__node_get(env, v, "rows"), 24, &o->rows) != 0 ||
        escrow__node_bool(env, escrow__node_get(env, v, "journal"), 0, &o->journal) != 0 ||
        escrow__node_read_meta(env, escrow__node_get(env, v, "meta"), m) != 0)
        return -1;
    o->meta = m->entries;
    o->meta_count = m->count;
    return 0;
}

/* ---- answers ---------------------------------------------------------------------------- */

static napi_value ints(napi_env env, const escrow_ints *m) {
    napi_value o;
    napi_create_object(env, &o);
    for (size_t i = 0; i < m->count; i++) set_i64(env, o, m->entries[i].key, m->entries[i].value);
    return o;
}

napi_value escrow__node_session(napi_env env, const escrow_session *s) {
    napi_value o, meta, gaps, alive;
    napi_create_object(env, &o);
    set_str(env, o, "owner", s->owner);
    set_str(env, o, "id", s->id);
    set_str(env, o, "label", s->label);
    set_str(env, o, "state", s->state);
    set_opt(env, o, "childPid", s->child_pid);
    if (s->child_alive < 0) napi_get_null(env, &alive);
    else napi_get_boolean(env, s->child_alive != 0, &alive);
    napi_set_named_property(env, o, "childAlive", alive);
    set_f64(env, o, "depositedAt", s->deposited_at);
    set_f64(env, o, "stateSince", s->state_since);
    set_i64(env, o, "bufferedBytes", s->buffered_bytes);
    set_i64(env, o, "droppedBytes", s->dropped_bytes);
    set_opt(env, o, "custodianPid", s->custodian_pid);
    set_str(env, o, "handoffId", s->handoff_id[0] ? s->handoff_id : NULL);
    set_i64(env, o, "cols", s->cols);
    set_i64(env, o, "rows", s->rows);
    napi_create_object(env, &meta);
    for (size_t i = 0; i < s->meta_count; i++) set_str(env, meta, s->meta[i].key, s->meta[i].value);
    napi_set_named_property(env, o, "meta", meta);
    set_opt(env, o, "replayGapAt", s->replay_gap_at);
    napi_create_array_with_length(env, s->n_replay_gaps, &gaps);
    for (size_t i = 0; i < s->n_replay_gaps; i++) {
        napi_value n;
        napi_create_int64(env, s->replay_gaps[i], &n);
        napi_set_element(env, gaps, (uint32_t)i, n);
    }
    napi_set_named_property(env, o, "replayGaps", gaps);
    return o;
}

napi_value escrow__node_sessions(napi_env env, const escrow_session *s, size_t n) {
    napi_value a;
    napi_create_array_with_length(env, n, &a);
    for (size_t i = 0; i < n; i++) napi_set_element(env, a, (uint32_t)i, escrow__node_session(env, &s[i]));
    return a;
}

napi_value escrow__node_status(napi_env env, const escrow_status *s) {
    napi_value o;
    napi_create_object(env, &o);
    set_i64(env, o, "pid", s->pid);
    set_str(env, o, "version", s->version);
    set_f64(env, o, "startedAt", s->started_at);
    set_str(env, o, "socket", s->socket);
    napi_set_named_property(env, o, "sessionsByState", ints(env, &s->sessions_by_state));
    napi_set_named_property(env, o, "counters", ints(env, &s->counters));
    napi_set_named_property(env, o, "limits", ints(env, &s->limits));
    set_opt(env, o, "openFds", s->open_fds);
    set_opt(env, o, "rssBytes", s->rss_bytes);
    set_str(env, o, "instance", s->instance[0] ? s->instance : NULL);
    set_str(env, o, "fdStore", s->fd_store[0] ? s->fd_store : NULL);
    set_opt(env, o, "keeperPid", s->keeper_pid);
    set_i64(env, o, "adopted", s->adopted);
    set_i64(env, o, "adoptedWithoutRecord", s->adopted_without_record);
    set_i64(env, o, "adoptedRenamed", s->adopted_renamed);
    set_opt(env, o, "restarts", s->restarts);
    set_opt(env, o, "uncleanRestarts", s->unclean_restarts);
    return o;
}

napi_value escrow__node_welcome(napi_env env, const escrow_welcome *w) {
    napi_value o, features;
    napi_create_object(env, &o);
    set_i64(env, o, "version", w->version);
    set_str(env, o, "holderVersion", w->holder_version);
    set_i64(env, o, "pid", w->pid);
    set_f64(env, o, "drainStopBudget", w->drain_stop_budget);
    set_f64(env, o, "sendDeadline", w->send_deadline);
    set_f64(env, o, "ackDeadline", w->ack_deadline);
    napi_set_named_property(env, o, "limits", ints(env, &w->limits));
    napi_create_array_with_length(env, w->n_features, &features);
    for (size_t i = 0; i < w->n_features; i++) {
        napi_value f;
        napi_create_string_utf8(env, w->features[i], NAPI_AUTO_LENGTH, &f);
        napi_set_element(env, features, (uint32_t)i, f);
    }
    napi_set_named_property(env, o, "features", features);
    return o;
}

napi_value escrow__node_retrieved(napi_env env, const escrow_retrieved *r) {
    napi_value o, replay, modes;
    void *data = NULL;
    napi_create_object(env, &o);
    set_str(env, o, "id", r->session.id);
    set_i64(env, o, "fd", r->fd);
    napi_create_buffer_copy(env, r->replay_len, r->replay_len ? (const void *)r->replay : (const void *)"", &data, &replay);
    napi_set_named_property(env, o, "replay", replay);
    set_i64(env, o, "droppedBytes", r->dropped_bytes);
    set_i64(env, o, "replayTrimmed", r->replay_trimmed);
    set_i64(env, o, "replayJournaled", r->replay_journaled);
    set_i64(env, o, "replayPreamble", r->replay_preamble);
    napi_create_array_with_length(env, r->n_restored_modes, &modes);
    for (size_t i = 0; i < r->n_restored_modes; i++) {
        napi_value m;
        napi_create_string_utf8(env, r->restored_modes[i], NAPI_AUTO_LENGTH, &m);
        napi_set_element(env, modes, (uint32_t)i, m);
    }
    napi_set_named_property(env, o, "restoredModes", modes);
    set_str(env, o, "handoffId", r->handoff_id[0] ? r->handoff_id : NULL);
    set_bool(env, o, "confirmed", r->confirmed);
    set_bool(env, o, "journal", r->journal);
    napi_set_named_property(env, o, "session", escrow__node_session(env, &r->session));
    return o;
}

napi_value escrow__node_report(napi_env env, const escrow_reclaim_report *r) {
    napi_value o, retrieved, failed;
    napi_create_object(env, &o);
    napi_create_array_with_length(env, r->n_retrieved, &retrieved);
    for (size_t i = 0; i < r->n_retrieved; i++)
        napi_set_element(env, retrieved, (uint32_t)i, escrow__node_retrieved(env, &r->retrieved[i]));
    napi_set_named_property(env, o, "retrieved", retrieved);
    napi_create_object(env, &failed);
    for (size_t i = 0; i < r->n_failed; i++)
        napi_set_named_property(env, failed, r->failed[i].id,
                                escrow__node_error(env, &r->failed[i].error));
    napi_set_named_property(env, o, "failed", failed);
    set_str(env, o, "holderInstance", r->holder_instance[0] ? r->holder_instance : NULL);
    set_i64(env, o, "adopted", r->adopted);
    set_opt(env, o, "restarts", r->restarts);
    set_opt(env, o, "uncleanRestarts", r->unclean_restarts);
    return o;
}
