/* escrow_codec.c: the bytes of every message the client sends or reads, and nothing else.
 *
 * First MessagePack, by hand and only the shapes the protocol uses (PROTOCOL.md section 3):
 * a port whose language has MessagePack uses that instead, with section 3's rules (strict
 * types, an int accepted for a float, unknown fields skipped at any depth, the last of
 * repeated keys winning). Then the messages of section 7 built from it: the requests, written
 * with every field in that table's order, defaults included, so that the bytes are the
 * reference encoder's and the test vectors'; what a holder's frame is, and how many fds
 * section 4 says it comes with; and the answers, each decoder walking its map once.
 *
 * It does no I/O and opens no fd: a frame's fds are escrow_frames.c's. What it allocates (a
 * request's buffer, a replay, meta strings, a sessions list) is freed by its caller, with
 * free() or the escrow_*_free of escrow.h.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 32 /* nesting allowed in a field this client skips */

/* ---- MessagePack by hand (PROTOCOL.md section 3) ---------------------------------------- */

/* Writing, into an mp_out (a growing buffer). Ints take the smallest format that fits,
 * floats are float64, text is str: the same bytes the reference encoder writes. */

static void put(mp_out *o, const void *p, size_t n) {
    if (o->failed) return;
    if (o->len + n > o->cap) {
        size_t cap = o->cap != 0 ? o->cap : 256;
        while (cap < o->len + n) cap *= 2;
        unsigned char *grown = realloc(o->data, cap);
        if (grown == NULL) {
            o->failed = 1;
            return;
        }
        o->data = grown;
        o->cap = cap;
    }
    memcpy(o->data + o->len, p, n);
    o->len += n;
}

static void put_byte(mp_out *o, unsigned b) {
    unsigned char c = (unsigned char)b;
    put(o, &c, 1);
}

/* A format byte, then `n` bytes of `v`, big-endian. */
static void put_be(mp_out *o, unsigned format, uint64_t v, int n) {
    unsigned char b[9];
    b[0] = (unsigned char)format;
    for (int i = 0; i < n; i++) b[1 + i] = (unsigned char)(v >> (8 * (n - 1 - i)));
    put(o, b, (size_t)n + 1);
}

static void mp_map(mp_out *o, uint32_t n) {
    if (n < 16) put_byte(o, 0x80 | n);
    else if (n <= 0xffff) put_be(o, 0xde, n, 2);
    else put_be(o, 0xdf, n, 4);
}

static void mp_array(mp_out *o, uint32_t n) { /* only retrieve_many sends one */
    if (n < 16) put_byte(o, 0x90 | n);
    else if (n <= 0xffff) put_be(o, 0xdc, n, 2);
    else put_be(o, 0xdd, n, 4);
}

static void mp_str(mp_out *o, const char *s) {
    size_t n = strlen(s);
    if (n < 32) put_byte(o, 0xa0 | (unsigned)n);
    else if (n <= 0xff) put_be(o, 0xd9, n, 1);
    else if (n <= 0xffff) put_be(o, 0xda, n, 2);
    else put_be(o, 0xdb, n, 4);
    put(o, s, n);
}

static void mp_int(mp_out *o, int64_t v) {
    if (v >= 0) {
        if (v < 128) put_byte(o, (unsigned)v);
        else if (v <= 0xff) put_be(o, 0xcc, (uint64_t)v, 1);
        else if (v <= 0xffff) put_be(o, 0xcd, (uint64_t)v, 2);
        else if (v <= 0xffffffff) put_be(o, 0xce, (uint64_t)v, 4);
        else put_be(o, 0xcf, (uint64_t)v, 8);
    } else {
        if (v >= -32) put_byte(o, (unsigned)(v & 0xff));
        else if (v >= -128) put_be(o, 0xd0, (uint64_t)v, 1);
        else if (v >= -32768) put_be(o, 0xd1, (uint64_t)v, 2);
        else if (v >= -2147483647 - 1) put_be(o, 0xd2, (uint64_t)v, 4);
        else put_be(o, 0xd3, (uint64_t)v, 8);
    }
}

static void mp_float(mp_out *o, double d) {
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    put_be(o, 0xcb, bits, 8);
}

static void mp_bool(mp_out *o, int v) { put_byte(o, v ? 0xc3 : 0xc2); }
static void mp_nil(mp_out *o) { put_byte(o, 0xc0); }

/* Reading: every function returns 0, or -1 when the next value is not of that type (or is
 * cut short). Types are strict, as in section 3, with its one conversion: an int for a float. */
typedef struct mp_in {
    const unsigned char *p, *end;
} mp_in;

static int peek(const mp_in *in) { return in->p < in->end ? *in->p : -1; }

static int take(mp_in *in, size_t n, const unsigned char **out) {
    if ((size_t)(in->end - in->p) < n) return -1;
    *out = in->p;
    in->p += n;
    return 0;
}

static int take_be(mp_in *in, size_t n, uint64_t *v) {
    const unsigned char *b;
    if (take(in, n, &b) != 0) return -1;
    *v = 0;
    for (size_t i = 0; i < n; i++) *v = *v << 8 | b[i];
    return 0;
}

/* A length that follows a format byte: 1, 2 or 4 bytes for the formats base, base+1, base+2. */
static int sized(mp_in *in, int b, int base, size_t *len) {
    static const size_t widths[] = {1, 2, 4};
    uint64_t v;
    in->p++;
    if (take_be(in, widths[b - base], &v) != 0) return -1;
    *len = (size_t)v;
    return 0;
}

static int rd_map(mp_in *in, size_t *n) {
    int b = peek(in);
    if (b >= 0x80 && b <= 0x8f) return in->p++, *n = (size_t)(b & 0x0f), 0;
    if (b == 0xde || b == 0xdf) return sized(in, b, 0xdd, n); /* 0xdd + 1 = map16 */
    return -1;
}

static int rd_array(mp_in *in, size_t *n) {
    int b = peek(in);
    if (b >= 0x90 && b <= 0x9f) return in->p++, *n = (size_t)(b & 0x0f), 0;
    if (b == 0xdc || b == 0xdd) return sized(in, b, 0xdb, n);
    return -1;
}

static int rd_str(mp_in *in, const char **s, size_t *len) {
    int b = peek(in);
    const unsigned char *bytes;
    if (b >= 0xa0 && b <= 0xbf) in->p++, *len = (size_t)(b & 0x1f);
    else if (b >= 0xd9 && b <= 0xdb) { if (sized(in, b, 0xd9, len) != 0) return -1; }
    else return -1;
    if (take(in, *len, &bytes) != 0) return -1;
    *s = (const char *)bytes;
    return 0;
}

static int rd_bin(mp_in *in, const unsigned char **bytes, size_t *len) {
    int b = peek(in);
    if (b < 0xc4 || b > 0xc6 || sized(in, b, 0xc4, len) != 0) return -1;
    return take(in, *len, bytes);
}

static int rd_nil(mp_in *in) { return peek(in) == 0xc0 ? (in->p++, 1) : 0; }

static int rd_bool(mp_in *in, int *v) {
    int b = peek(in);
    if (b != 0xc2 && b != 0xc3) return -1;
    in->p++;
    *v = b == 0xc3;
    return 0;
}

/* Any int format into an int64. A uint64 above INT64_MAX is refused: the holder never sends
 * one (section 3). */
static int rd_int(mp_in *in, int64_t *v) {
    int b = peek(in);
    uint64_t u;
    if (b < 0) return -1;
    if (b <= 0x7f) return in->p++, *v = b, 0;
    if (b >= 0xe0) return in->p++, *v = b - 0x100, 0;
    if (b >= 0xcc && b <= 0xcf) { /* uint8..uint64 */
        in->p++;
        if (take_be(in, (size_t)1 << (b - 0xcc), &u) != 0 || u > INT64_MAX) return -1;
        *v = (int64_t)u;
        return 0;
    }
    if (b >= 0xd0 && b <= 0xd3) { /* int8..int64: sign-extend */
        size_t n = (size_t)1 << (b - 0xd0);
        in->p++;
        if (take_be(in, n, &u) != 0) return -1;
        if (n < 8 && (u >> (8 * n - 1)) != 0) u |= ~(uint64_t)0 << (8 * n);
        *v = (u >> 63) != 0 ? -(int64_t)(~u) - 1 : (int64_t)u;
        return 0;
    }
    return -1;
}

/* A float field: float64, float32, or any int (section 3's one conversion). */
static int rd_float(mp_in *in, double *v) {
    int b = peek(in);
    uint64_t u;
    if (b == 0xcb) {
        in->p++;
        if (take_be(in, 8, &u) != 0) return -1;
        memcpy(v, &u, sizeof *v);
        return 0;
    }
    if (b == 0xca) {
        float f;
        uint32_t u32;
        in->p++;
        if (take_be(in, 4, &u) != 0) return -1;
        u32 = (uint32_t)u;
        memcpy(&f, &u32, sizeof f);
        *v = f;
        return 0;
    }
    int64_t i;
    if (rd_int(in, &i) != 0) return -1;
    *v = (double)i;
    return 0;
}

/* Skip one value of any type: unknown fields are ignored, at any depth (section 3). */
static int rd_skip(mp_in *in, int depth) {
    int b = peek(in);
    size_t n = 0;
    const unsigned char *ignored;
    if (b < 0 || depth > MAX_DEPTH) return -1;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) return in->p++, 0;
    if ((b >= 0x80 && b <= 0x8f) || b == 0xde || b == 0xdf) {
        if (rd_map(in, &n) != 0) return -1;
        for (size_t i = 0; i < 2 * n; i++)
            if (rd_skip(in, depth + 1) != 0) return -1;
        return 0;
    }
    if ((b >= 0x90 && b <= 0x9f) || b == 0xdc || b == 0xdd) {
        if (rd_array(in, &n) != 0) return -1;
        for (size_t i = 0; i < n; i++)
            if (rd_skip(in, depth + 1) != 0) return -1;
        return 0;
    }
    if ((b >= 0xa0 && b <= 0xbf) || (b >= 0xd9 && b <= 0xdb)) {
        const char *s;
        return rd_str(in, &s, &n);
    }
    if (b >= 0xc4 && b <= 0xc6) return rd_bin(in, &ignored, &n);
    if (b >= 0xc7 && b <= 0xc9) { /* ext8/16/32: a length, a type byte, the data */
        if (sized(in, b, 0xc7, &n) != 0) return -1;
        return take(in, n + 1, &ignored);
    }
    in->p++;
    switch (b) {
    case 0xca: case 0xce: case 0xd2: return take(in, 4, &ignored);
    case 0xcb: case 0xcf: case 0xd3: return take(in, 8, &ignored);
    case 0xcc: case 0xd0: return take(in, 1, &ignored);
    case 0xcd: case 0xd1: return take(in, 2, &ignored);
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: /* fixext 1..16, plus a type byte */
        return take(in, ((size_t)1 << (b - 0xd4)) + 1, &ignored);
    default: return -1; /* 0xc1 is never used */
    }
}

static int key_is(const char *key, size_t len, const char *name) {
    return strlen(name) == len && memcmp(key, name, len) == 0;
}

/* Copy a str into a C buffer. An identity (a name, a state, a handoff id) must fit whole
 * and hold no NUL; free text is cut, at a UTF-8 character boundary. */
static int copy_exact(char *dst, size_t cap, const char *s, size_t len) {
    if (len >= cap || memchr(s, 0, len) != NULL) return -1;
    memcpy(dst, s, len);
    dst[len] = 0;
    return 0;
}

static void copy_cut(char *dst, size_t cap, const char *s, size_t len) {
    if (len >= cap) {
        len = cap - 1;
        while (len > 0 && ((unsigned char)s[len] & 0xc0) == 0x80) len--;
    }
    memcpy(dst, s, len);
    dst[len] = 0;
}

static int rd_exact(mp_in *in, char *dst, size_t cap) {
    const char *s;
    size_t len;
    return rd_str(in, &s, &len) != 0 ? -1 : copy_exact(dst, cap, s, len);
}

static int rd_cut(mp_in *in, char *dst, size_t cap) {
    const char *s;
    size_t len;
    if (rd_str(in, &s, &len) != 0) return -1;
    copy_cut(dst, cap, s, len);
    return 0;
}

static char *dup_str(const char *s, size_t len) {
    char *copy = malloc(len + 1);
    if (copy != NULL) {
        memcpy(copy, s, len);
        copy[len] = 0;
    }
    return copy;
}

/* ---- requests (PROTOCOL.md section 7) --------------------------------------------------- */

/* A request: a frame header (filled in by `finish`), then a map of `fields` + 1 entries. */
static void begin(mp_out *o, const char *type, uint32_t fields) {
    put(o, "\0\0\0\0", 4);
    mp_map(o, fields + 1);
    mp_str(o, "type");
    mp_str(o, type);
}

static escrow_code finish(mp_out *o, escrow_error *err) {
    if (o->failed)
        return escrow__fail(err, ESCROW_SYSTEM, ENOMEM, NULL, "no memory for a request");
    size_t body = o->len - 4;
    for (int i = 0; i < 4; i++) o->data[i] = (unsigned char)(body >> (8 * (3 - i)));
    return ESCROW_OK;
}

escrow_code escrow__encode_hello(mp_out *o, const escrow_client *c, escrow_error *err) {
    begin(o, "hello", 4);
    mp_str(o, "version"), mp_int(o, ESCROW_PROTOCOL_VERSION);
    mp_str(o, "owner"), mp_str(o, c->owner);
    mp_str(o, "client"), mp_str(o, c->client_name);
    mp_str(o, "timeout"), mp_float(o, c->timeout);
    return finish(o, err);
}

/* Every request writes `type`, then every field of section 7 in that table's order, defaults
 * included: the bytes of the reference encoder and of the test vectors. */

static void put_meta(mp_out *o, const escrow_meta *meta, size_t count) {
    mp_map(o, (uint32_t)count);
    for (size_t i = 0; i < count; i++) mp_str(o, meta[i].key), mp_str(o, meta[i].value);
}

/* `journal`: ask for a journal file to record into (section 10.6): escrow_deposit asks when
 * the app's opts->journal says so. */
escrow_code escrow__encode_deposit(mp_out *o, const char *id, const escrow_deposit_opts *opts,
                                   int journal, escrow_error *err) {
    static const escrow_deposit_opts none = {NULL, 0, 0, 0, NULL, 0, 0};
    if (opts == NULL) opts = &none;
    begin(o, "deposit", 7);
    mp_str(o, "id"), mp_str(o, id);
    mp_str(o, "label"), mp_str(o, opts->label != NULL ? opts->label : "");
    mp_str(o, "child_pid");
    if (opts->child_pid > 0) mp_int(o, opts->child_pid);
    else mp_nil(o); /* no pid is nil, never 0 */
    mp_str(o, "cols"), mp_int(o, opts->cols);
    mp_str(o, "rows"), mp_int(o, opts->rows);
    mp_str(o, "meta"), put_meta(o, opts->meta, opts->meta_count);
    mp_str(o, "journal"), mp_bool(o, journal);
    return finish(o, err);
}

/* release: {id}. */
escrow_code escrow__encode_id(mp_out *o, const char *type, const char *id, escrow_error *err) {
    begin(o, type, 1);
    mp_str(o, "id"), mp_str(o, id);
    return finish(o, err);
}

/* `keep`: retrieve into custody (section 12.6); `journal` only with it. `replay_file`: the
 * replay by reference (section 12.8), which the API never asks for (it has no mapping). */
escrow_code escrow__encode_retrieve(mp_out *o, const char *id, int keep, int journal,
                                    int replay_file, escrow_error *err) {
    begin(o, "retrieve", 4);
    mp_str(o, "id"), mp_str(o, id);
    mp_str(o, "keep"), mp_bool(o, keep);
    mp_str(o, "journal"), mp_bool(o, journal);
    mp_str(o, "replay_file"), mp_bool(o, replay_file);
    return finish(o, err);
}

/* `keep` repeats the retrieve's (section 12.6). */
escrow_code escrow__encode_ack(mp_out *o, const char *id, const char *handoff_id, int keep,
                               escrow_error *err) {
    begin(o, "ack", 3);
    mp_str(o, "id"), mp_str(o, id);
    mp_str(o, "handoff_id"), mp_str(o, handoff_id);
    mp_str(o, "keep"), mp_bool(o, keep);
    return finish(o, err);
}

/* update (section 10.5): cols or rows < 0, or meta NULL, is nil: unchanged. A meta that is
 * given (even with no entries) replaces the whole map. */
escrow_code escrow__encode_update(mp_out *o, const char *id, int64_t cols, int64_t rows,
                                  const escrow_meta *meta, size_t meta_count,
                                  escrow_error *err) {
    begin(o, "update", 4);
    mp_str(o, "id"), mp_str(o, id);
    mp_str(o, "cols");
    if (cols >= 0) mp_int(o, cols);
    else mp_nil(o);
    mp_str(o, "rows");
    if (rows >= 0) mp_int(o, rows);
    else mp_nil(o);
    mp_str(o, "meta");
    if (meta != NULL) put_meta(o, meta, meta_count);
    else mp_nil(o);
    return finish(o, err);
}

/* retrieve_many (section 12.7): 1 to 4096 distinct ids, `keep` and `journal` as retrieve's. */
escrow_code escrow__encode_retrieve_many(mp_out *o, const char *const *ids, size_t count,
                                         int keep, int journal, int replay_file,
                                         escrow_error *err) {
    begin(o, "retrieve_many", 4);
    mp_str(o, "ids"), mp_array(o, (uint32_t)count);
    for (size_t i = 0; i < count; i++) mp_str(o, ids[i]);
    mp_str(o, "keep"), mp_bool(o, keep);
    mp_str(o, "journal"), mp_bool(o, journal);
    mp_str(o, "replay_file"), mp_bool(o, replay_file);
    return finish(o, err);
}

/* acks: ids[i] -> handoff_ids[i], in this order (the holder answers done_many in it). */
escrow_code escrow__encode_ack_many(mp_out *o, const char *const *ids,
                                    const char *const *handoff_ids, size_t count, int keep,
                                    escrow_error *err) {
    begin(o, "ack_many", 2);
    mp_str(o, "acks"), mp_map(o, (uint32_t)count);
    for (size_t i = 0; i < count; i++) mp_str(o, ids[i]), mp_str(o, handoff_ids[i]);
    mp_str(o, "keep"), mp_bool(o, keep);
    return finish(o, err);
}

escrow_code escrow__encode_list(mp_out *o, int all_owners, escrow_error *err) {
    begin(o, "list", 1);
    mp_str(o, "all_owners"), mp_bool(o, all_owners);
    return finish(o, err);
}

/* status: no field. */
escrow_code escrow__encode_status(mp_out *o, escrow_error *err) {
    begin(o, "status", 0);
    return finish(o, err);
}

/* ---- what a frame is, and the fds it comes with (PROTOCOL.md sections 2 and 4.3) -------- */

/* The body's `type`. A repeated `type` key must repeat the same value. */
int escrow__frame_type(const unsigned char *body, size_t len, char type[16]) {
    mp_in in = {body, body + len};
    size_t n;
    type[0] = 0;
    if (rd_map(&in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k, *v;
        size_t kl, vl;
        if (rd_str(&in, &k, &kl) != 0) return -1;
        if (!key_is(k, kl, "type")) {
            if (rd_skip(&in, 0) != 0) return -1;
            continue;
        }
        if (rd_str(&in, &v, &vl) != 0 || vl == 0 || vl > 15 || memchr(v, 0, vl) != NULL) return -1;
        if (type[0] != 0 && !key_is(v, vl, type)) return -1;
        memcpy(type, v, vl);
        type[vl] = 0;
    }
    return in.p == in.end && type[0] != 0 ? 0 : -1; /* nothing may follow the one value */
}

/* Does the body's field `name` hold a value (not nil)? The last of repeated keys counts. */
static int has_value(const frame *f, const char *name) {
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    int set = 0;
    if (rd_map(&in, &n) != 0) return 0;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        if (rd_str(&in, &k, &kl) != 0) return 0;
        if (key_is(k, kl, name)) set = peek(&in) != 0xc0;
        if (rd_skip(&in, 0) != 0) return 0;
    }
    return set;
}

/* How many fds a holder's message comes with (section 4): the master of a handoff, the
 * journal file of a granted journal (a handoff's second fd, a deposited's only one), and a
 * handoff's replay file (its last). A field of the wrong shape is counted as set; the frame
 * then fails to decode. */
size_t escrow__fds_carried(const frame *f) {
    if (strcmp(f->type, "handoff") == 0)
        return 1 + (size_t)has_value(f, "journal") + (size_t)has_value(f, "replay_file");
    if (strcmp(f->type, "deposited") == 0) return (size_t)has_value(f, "journal");
    return 0;
}

/* ---- answers (PROTOCOL.md sections 7, 6.1 and 9) ---------------------------------------- */

/* Each decoder below walks its map once: a known key is read with its strict type, any
 * other key (`type`, and fields newer than this client) is skipped, and a repeated key's
 * last value wins. `need` has one bit per required field not seen yet. */

static int rd_ints(mp_in *in, escrow_ints *m) {
    size_t n;
    m->count = 0;
    if (rd_map(in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int64_t v;
        if (rd_str(in, &k, &kl) != 0 || rd_int(in, &v) != 0) return -1;
        if (m->count < ESCROW_INTS_MAX && copy_exact(m->entries[m->count].key, 64, k, kl) == 0)
            m->entries[m->count++].value = v;
    }
    return 0;
}

/* int | nil, nil as -1 (pids are never negative). */
static int rd_opt_int(mp_in *in, int64_t *v) {
    if (rd_nil(in)) return *v = -1, 0;
    return rd_int(in, v);
}

static int rd_meta(mp_in *in, escrow_session *s) {
    size_t n;
    escrow_session_clear(s);
    if (rd_map(in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k, *v;
        size_t kl, vl;
        if (rd_str(in, &k, &kl) != 0 || rd_str(in, &v, &vl) != 0) return -1;
        if (s->meta_count == ESCROW_META_MAX) continue; /* the holder keeps 32 at most */
        escrow_meta *m = &s->meta[s->meta_count++];
        m->key = dup_str(k, kl);
        m->value = dup_str(v, vl);
        if (m->key == NULL || m->value == NULL) return -1;
    }
    return 0;
}

void escrow_session_clear(escrow_session *s) {
    for (size_t i = 0; i < s->meta_count; i++) {
        free((void *)s->meta[i].key);
        free((void *)s->meta[i].value);
    }
    s->meta_count = 0;
}

void escrow_sessions_free(escrow_session *sessions, size_t count) {
    for (size_t i = 0; sessions != NULL && i < count; i++) escrow_session_clear(&sessions[i]);
    free(sessions);
}

/* `replay_gaps`: a list of ints, of which the first 8 are kept. */
static int rd_gaps(mp_in *in, escrow_session *s) {
    size_t n;
    if (rd_array(in, &n) != 0) return -1;
    s->n_replay_gaps = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t v;
        if (rd_int(in, &v) != 0) return -1;
        if (s->n_replay_gaps < sizeof s->replay_gaps / sizeof s->replay_gaps[0])
            s->replay_gaps[s->n_replay_gaps++] = v;
    }
    return 0;
}

/* A SessionInfo: a map without `type`. On failure the caller still clears `s`. */
static int rd_session(mp_in *in, escrow_session *s) {
    enum { OWNER = 1, ID = 2, STATE = 4 };
    unsigned need = OWNER | ID | STATE;
    size_t n;
    memset(s, 0, sizeof *s);
    s->child_pid = s->custodian_pid = s->replay_gap_at = -1;
    s->child_alive = -1;
    if (rd_map(in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int r;
        if (rd_str(in, &k, &kl) != 0) return -1;
        if (key_is(k, kl, "owner")) r = rd_exact(in, s->owner, sizeof s->owner), need &= ~OWNER;
        else if (key_is(k, kl, "id")) r = rd_exact(in, s->id, sizeof s->id), need &= ~ID;
        else if (key_is(k, kl, "state"))
            r = rd_exact(in, s->state, sizeof s->state), need &= ~STATE;
        else if (key_is(k, kl, "label")) r = rd_cut(in, s->label, sizeof s->label);
        else if (key_is(k, kl, "child_pid")) r = rd_opt_int(in, &s->child_pid);
        else if (key_is(k, kl, "child_alive"))
            r = rd_nil(in) ? (s->child_alive = -1, 0) : rd_bool(in, &s->child_alive);
        else if (key_is(k, kl, "deposited_at")) r = rd_float(in, &s->deposited_at);
        else if (key_is(k, kl, "state_since")) r = rd_float(in, &s->state_since);
        else if (key_is(k, kl, "buffered_bytes")) r = rd_int(in, &s->buffered_bytes);
        else if (key_is(k, kl, "dropped_bytes")) r = rd_int(in, &s->dropped_bytes);
        else if (key_is(k, kl, "custodian_pid")) r = rd_opt_int(in, &s->custodian_pid);
        else if (key_is(k, kl, "handoff_id"))
            r = rd_nil(in) ? (s->handoff_id[0] = 0, 0)
                           : rd_exact(in, s->handoff_id, sizeof s->handoff_id);
        else if (key_is(k, kl, "cols")) r = rd_int(in, &s->cols);
        else if (key_is(k, kl, "rows")) r = rd_int(in, &s->rows);
        else if (key_is(k, kl, "meta")) r = rd_meta(in, s);
        else if (key_is(k, kl, "replay_gap_at")) r = rd_opt_int(in, &s->replay_gap_at);
        else if (key_is(k, kl, "replay_gaps")) r = rd_gaps(in, s);
        else r = rd_skip(in, 0);
        if (r != 0) return -1;
    }
    return need == 0 ? 0 : -1;
}

/* welcome.features: a list of str, an open set (section 6.1). */
static int rd_features(mp_in *in, escrow_welcome *w) {
    size_t n;
    w->n_features = 0;
    if (rd_array(in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        if (rd_str(in, &s, &len) != 0) return -1;
        if (w->n_features < ESCROW_FEATURES_MAX &&
            copy_exact(w->features[w->n_features], sizeof w->features[0], s, len) == 0)
            w->n_features++;
    }
    return 0;
}

int escrow__decode_welcome(const frame *f, escrow_welcome *w) {
    enum { VERSION = 1, HOLDER = 2, PID = 4, BUDGET = 8, SEND = 16, ACK = 32 };
    unsigned need = VERSION | HOLDER | PID | BUDGET | SEND | ACK;
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    memset(w, 0, sizeof *w);
    if (rd_map(&in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int r;
        if (rd_str(&in, &k, &kl) != 0) return -1;
        if (key_is(k, kl, "version")) r = rd_int(&in, &w->version), need &= ~VERSION;
        else if (key_is(k, kl, "holder_version"))
            r = rd_cut(&in, w->holder_version, sizeof w->holder_version), need &= ~HOLDER;
        else if (key_is(k, kl, "pid")) r = rd_int(&in, &w->pid), need &= ~PID;
        else if (key_is(k, kl, "drain_stop_budget"))
            r = rd_float(&in, &w->drain_stop_budget), need &= ~BUDGET;
        else if (key_is(k, kl, "send_deadline"))
            r = rd_float(&in, &w->send_deadline), need &= ~SEND;
        else if (key_is(k, kl, "ack_deadline")) r = rd_float(&in, &w->ack_deadline), need &= ~ACK;
        else if (key_is(k, kl, "limits")) r = rd_ints(&in, &w->limits);
        else if (key_is(k, kl, "features")) r = rd_features(&in, w);
        else r = rd_skip(&in, 0);
        if (r != 0) return -1;
    }
    return need == 0 ? 0 : -1;
}

/* deposited, released, done: {id}. */
int escrow__decode_id(const frame *f, char id[ESCROW_NAME_MAX + 1]) {
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    int have = 0;
    if (rd_map(&in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int r;
        if (rd_str(&in, &k, &kl) != 0) return -1;
        if (key_is(k, kl, "id")) r = rd_exact(&in, id, ESCROW_NAME_MAX + 1), have = 1;
        else r = rd_skip(&in, 0);
        if (r != 0) return -1;
    }
    return have ? 0 : -1;
}

static int rd_replay(mp_in *in, escrow_retrieved *r) {
    const unsigned char *bytes;
    size_t len;
    if (rd_bin(in, &bytes, &len) != 0) return -1;
    free(r->replay);
    if ((r->replay = malloc(len + 1)) == NULL) return -1;
    memcpy(r->replay, bytes, len);
    r->replay_len = len;
    return 0;
}

/* A Journal (section 10.6) | nil: a journal_info. */
static int rd_journal(mp_in *in, journal_info *j) {
    enum { CAPACITY = 1, TOTAL = 2, POSITION = 4 };
    unsigned need = CAPACITY | TOTAL | POSITION;
    size_t n;
    memset(j, 0, sizeof *j);
    if (rd_nil(in)) return 0;
    if (rd_map(in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int r;
        if (rd_str(in, &k, &kl) != 0) return -1;
        if (key_is(k, kl, "capacity")) r = rd_int(in, &j->capacity), need &= ~CAPACITY;
        else if (key_is(k, kl, "total")) r = rd_int(in, &j->total), need &= ~TOTAL;
        else if (key_is(k, kl, "position")) r = rd_int(in, &j->position), need &= ~POSITION;
        else r = rd_skip(in, 0);
        if (r != 0) return -1;
    }
    j->set = 1;
    return need == 0 ? 0 : -1;
}

/* A ReplayFile (section 12.8) | nil. */
static int rd_replay_file(mp_in *in, replay_file_info *rf) {
    enum { OFFSET = 1, LENGTH = 2 };
    unsigned need = OFFSET | LENGTH;
    size_t n;
    memset(rf, 0, sizeof *rf);
    if (rd_nil(in)) return 0;
    if (rd_map(in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int r;
        if (rd_str(in, &k, &kl) != 0) return -1;
        if (key_is(k, kl, "offset")) r = rd_int(in, &rf->offset), need &= ~OFFSET;
        else if (key_is(k, kl, "length")) r = rd_int(in, &rf->length), need &= ~LENGTH;
        else r = rd_skip(in, 0);
        if (r != 0) return -1;
    }
    rf->set = 1;
    return need == 0 ? 0 : -1;
}

/* deposited: {id, journal}. */
int escrow__decode_deposited(const frame *f, char id[ESCROW_NAME_MAX + 1], journal_info *j) {
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    int have = 0;
    memset(j, 0, sizeof *j);
    if (rd_map(&in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int r;
        if (rd_str(&in, &k, &kl) != 0) return -1;
        if (key_is(k, kl, "id")) r = rd_exact(&in, id, ESCROW_NAME_MAX + 1), have = 1;
        else if (key_is(k, kl, "journal")) r = rd_journal(&in, j);
        else r = rd_skip(&in, 0);
        if (r != 0) return -1;
    }
    return have ? 0 : -1;
}

/* handoff.restored_modes: a list of str, an open set (section 12.2 step 5). */
static int rd_modes(mp_in *in, escrow_retrieved *out) {
    size_t n;
    out->n_restored_modes = 0;
    if (rd_array(in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        if (rd_str(in, &s, &len) != 0) return -1;
        if (out->n_restored_modes < ESCROW_MODES_MAX &&
            copy_exact(out->restored_modes[out->n_restored_modes],
                       sizeof out->restored_modes[0], s, len) == 0)
            out->n_restored_modes++;
    }
    return 0;
}

int escrow__decode_handoff(const frame *f, escrow_retrieved *out, journal_info *j,
                           replay_file_info *rf) {
    enum { HANDOFF_ID = 1, SESSION = 2, REPLAY = 4 };
    unsigned need = HANDOFF_ID | SESSION | REPLAY;
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    memset(j, 0, sizeof *j);
    memset(rf, 0, sizeof *rf);
    if (rd_map(&in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int r;
        if (rd_str(&in, &k, &kl) != 0) return -1;
        if (key_is(k, kl, "handoff_id"))
            r = rd_exact(&in, out->handoff_id, sizeof out->handoff_id), need &= ~HANDOFF_ID;
        else if (key_is(k, kl, "session"))
            escrow_session_clear(&out->session), r = rd_session(&in, &out->session),
            need &= ~SESSION;
        else if (key_is(k, kl, "replay")) r = rd_replay(&in, out), need &= ~REPLAY;
        else if (key_is(k, kl, "dropped_bytes")) r = rd_int(&in, &out->dropped_bytes);
        else if (key_is(k, kl, "replay_trimmed")) r = rd_int(&in, &out->replay_trimmed);
        else if (key_is(k, kl, "replay_journaled")) r = rd_int(&in, &out->replay_journaled);
        else if (key_is(k, kl, "journal")) r = rd_journal(&in, j);
        else if (key_is(k, kl, "restored_modes")) r = rd_modes(&in, out);
        else if (key_is(k, kl, "replay_preamble")) r = rd_int(&in, &out->replay_preamble);
        else if (key_is(k, kl, "replay_file")) r = rd_replay_file(&in, rf);
        else r = rd_skip(&in, 0);
        if (r != 0) return -1;
    }
    return need == 0 ? 0 : -1;
}

/* done_many (section 12.7): {ids}, the sessions an ack_many acked, as an array the caller
 * frees (whatever the result). A count other than `expected` (the ack_many's entries; 0: any
 * count an ack_many may have) is refused before anything is allocated: the bytes of a frame
 * bound its ids only to ~129 times its size, which a holder must not make us allocate. */
int escrow__decode_done_many(const frame *f, size_t expected,
                             char (**ids)[ESCROW_NAME_MAX + 1], size_t *count) {
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    int have = 0;
    *ids = NULL;
    *count = 0;
    if (rd_map(&in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl, m;
        if (rd_str(&in, &k, &kl) != 0) return -1;
        if (!key_is(k, kl, "ids")) {
            if (rd_skip(&in, 0) != 0) return -1;
            continue;
        }
        free(*ids);
        *ids = NULL;
        *count = 0;
        have = 1;
        if (rd_array(&in, &m) != 0 || m > ESCROW__BATCH_MAX || (expected != 0 && m != expected))
            return -1;
        if (m > (size_t)(in.end - in.p)) return -1; /* every id takes at least one byte */
        if ((*ids = calloc(m != 0 ? m : 1, sizeof **ids)) == NULL) return -1;
        for (; *count < m; (*count)++)
            if (rd_exact(&in, (*ids)[*count], sizeof **ids) != 0) return -1;
    }
    return have ? 0 : -1;
}

static int rd_sessions(mp_in *in, escrow_session **out, size_t *count) {
    size_t n;
    escrow_sessions_free(*out, *count);
    *out = NULL;
    *count = 0;
    /* Every SessionInfo takes at least one byte: a bound before the allocation. */
    if (rd_array(in, &n) != 0 || n > (size_t)(in->end - in->p)) return -1;
    if ((*out = calloc(n != 0 ? n : 1, sizeof **out)) == NULL) return -1;
    while (*count < n)
        if (rd_session(in, &(*out)[(*count)++]) != 0) return -1;
    return 0;
}

int escrow__decode_sessions(const frame *f, escrow_session **out, size_t *count) {
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    int have = 0;
    if (rd_map(&in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int r;
        if (rd_str(&in, &k, &kl) != 0) return -1;
        if (key_is(k, kl, "sessions")) r = rd_sessions(&in, out, count), have = 1;
        else r = rd_skip(&in, 0);
        if (r != 0) return -1;
    }
    return have ? 0 : -1;
}

int escrow__decode_status(const frame *f, escrow_status *s) {
    enum { PID = 1, VERSION = 2, STARTED = 4, SOCKET = 8 };
    unsigned need = PID | VERSION | STARTED | SOCKET;
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    memset(s, 0, sizeof *s);
    s->open_fds = s->rss_bytes = s->keeper_pid = -1;
    memcpy(s->fd_store, "none", 5); /* section 7's default */
    if (rd_map(&in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int r;
        if (rd_str(&in, &k, &kl) != 0) return -1;
        if (key_is(k, kl, "pid")) r = rd_int(&in, &s->pid), need &= ~PID;
        else if (key_is(k, kl, "version"))
            r = rd_cut(&in, s->version, sizeof s->version), need &= ~VERSION;
        else if (key_is(k, kl, "started_at")) r = rd_float(&in, &s->started_at), need &= ~STARTED;
        else if (key_is(k, kl, "socket"))
            r = rd_cut(&in, s->socket, sizeof s->socket), need &= ~SOCKET;
        else if (key_is(k, kl, "sessions_by_state")) r = rd_ints(&in, &s->sessions_by_state);
        else if (key_is(k, kl, "counters")) r = rd_ints(&in, &s->counters);
        else if (key_is(k, kl, "limits")) r = rd_ints(&in, &s->limits);
        else if (key_is(k, kl, "open_fds")) r = rd_opt_int(&in, &s->open_fds);
        else if (key_is(k, kl, "rss_bytes")) r = rd_opt_int(&in, &s->rss_bytes);
        else if (key_is(k, kl, "instance")) r = rd_cut(&in, s->instance, sizeof s->instance);
        else if (key_is(k, kl, "fd_store")) r = rd_exact(&in, s->fd_store, sizeof s->fd_store);
        else if (key_is(k, kl, "keeper_pid")) r = rd_opt_int(&in, &s->keeper_pid);
        else if (key_is(k, kl, "adopted")) r = rd_int(&in, &s->adopted);
        else if (key_is(k, kl, "adopted_without_record"))
            r = rd_int(&in, &s->adopted_without_record);
        else if (key_is(k, kl, "adopted_renamed")) r = rd_int(&in, &s->adopted_renamed);
        else if (key_is(k, kl, "restarts")) r = rd_opt_int(&in, &s->restarts);
        else if (key_is(k, kl, "unclean_restarts")) r = rd_opt_int(&in, &s->unclean_restarts);
        else r = rd_skip(&in, 0);
        if (r != 0) return -1;
    }
    return need == 0 ? 0 : -1;
}

static int rd_versions(mp_in *in, escrow_error *e) {
    size_t n;
    e->n_versions = 0;
    if (rd_nil(in)) return 0;
    if (rd_array(in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        int64_t v;
        if (rd_int(in, &v) != 0) return -1;
        if (e->n_versions < sizeof e->versions / sizeof e->versions[0])
            e->versions[e->n_versions++] = v;
    }
    return 0;
}

int escrow__decode_error_fields(const frame *f, escrow_error *e) {
    enum { CODE = 1, MESSAGE = 2 };
    unsigned need = CODE | MESSAGE;
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    if (rd_map(&in, &n) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        int r;
        if (rd_str(&in, &k, &kl) != 0) return -1;
        if (key_is(k, kl, "code"))
            r = rd_cut(&in, e->code_name, sizeof e->code_name), need &= ~CODE;
        else if (key_is(k, kl, "message"))
            r = rd_cut(&in, e->message, sizeof e->message), need &= ~MESSAGE;
        else if (key_is(k, kl, "id"))
            r = rd_nil(&in) ? (e->id[0] = 0, 0) : rd_cut(&in, e->id, sizeof e->id);
        else if (key_is(k, kl, "versions")) r = rd_versions(&in, e);
        else r = rd_skip(&in, 0);
        if (r != 0) return -1;
    }
    return need == 0 ? 0 : -1;
}

/* An `error` frame, as the escrow_code it names (ESCROW_OTHER for a code newer than us). */
escrow_code escrow__decode_error(const frame *f, escrow_error *err) {
    escrow_error local;
    escrow_error *e = err != NULL ? err : &local;
    memset(e, 0, sizeof *e);
    if (escrow__decode_error_fields(f, e) != 0)
        return escrow__fail(err, ESCROW_PROTOCOL, 0, NULL, "the holder sent a malformed error");
    e->code = escrow__code_from_name(e->code_name);
    return e->code;
}

/* What the API reads out of decoded answers. */

int escrow_ints_get(const escrow_ints *m, const char *key, int64_t *value) {
    for (size_t i = 0; i < m->count; i++)
        if (strcmp(m->entries[i].key, key) == 0) return *value = m->entries[i].value, 1;
    return 0;
}

int escrow_has_feature(const escrow_welcome *w, const char *name) {
    for (size_t i = 0; i < w->n_features; i++)
        if (strcmp(w->features[i], name) == 0) return 1;
    return 0;
}
