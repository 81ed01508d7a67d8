/* escrow.c: the fd-escrow client in C (see escrow.h for the API, PROTOCOL.md for the wire).
 *
 * Sections, each naming the PROTOCOL.md section it implements:
 *   1. errors and deadlines
 *   2. MessagePack by hand, only the shapes the protocol uses (section 3)
 *   3. the socket: its path, the trust checks, connect (section 1)
 *   4. frames, and the fds that ride on them (sections 2 and 4)
 *   5. messages (section 7)
 *   6. the calls (sections 5, 10, 11 and 12)
 */
#if defined(__linux__)
#define _GNU_SOURCE /* SOCK_CLOEXEC, MSG_CMSG_CLOEXEC, struct ucred for SO_PEERCRED */
#endif

#include "escrow.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#ifdef MSG_NOSIGNAL
#define SEND_FLAGS MSG_NOSIGNAL /* a holder that hung up gives EPIPE, not SIGPIPE */
#else
#define SEND_FLAGS 0 /* macOS: SO_NOSIGPIPE is set on the socket instead */
#endif
#ifdef MSG_CMSG_CLOEXEC
#define RECV_FLAGS MSG_CMSG_CLOEXEC /* received fds are close-on-exec from birth */
#else
#define RECV_FLAGS 0 /* macOS: FD_CLOEXEC is set right after recvmsg */
#endif

#define MAX_FDS_SEEN 8                 /* room for more than one: too many are seen, and closed */
#define MAX_RESPONSE_BYTES (256u << 20) /* a handoff carries a whole ring; 4 GiB never */
#define MAX_DEPTH 32                   /* nesting allowed in a field this client skips */

#ifdef __GNUC__
#define PRINTF_LIKE(f, a) __attribute__((format(printf, f, a)))
#define MAYBE_UNUSED __attribute__((unused)) /* ESCROW_FULL_CODEC's: the API calls none */
#else
#define PRINTF_LIKE(f, a)
#define MAYBE_UNUSED
#endif

/* ---- 1. errors and deadlines ---------------------------------------------------------- */

static const char *const code_names[] = {
    "ok", "bad_request", "unsupported_version", "forbidden", "unknown", "exists",
    "not_a_terminal", "custody_held", "busy", "drain_stop_timeout", "limit", "handed_off",
    "released", "expired", "ack_late", "other", "unavailable", "unresponsive", "config",
    "protocol", "system",
};

const char *escrow_code_name(escrow_code code) {
    if ((size_t)code < sizeof code_names / sizeof code_names[0]) return code_names[code];
    return "?";
}

static escrow_code code_from_name(const char *name) {
    for (int i = ESCROW_BAD_REQUEST; i <= ESCROW_ACK_LATE; i++)
        if (strcmp(code_names[i], name) == 0) return (escrow_code)i;
    return ESCROW_OTHER;
}

/* Fill `err` (when there is one) and return `code`. */
static escrow_code PRINTF_LIKE(5, 6)
fail(escrow_error *err, escrow_code code, int sys_errno, const char *id, const char *fmt, ...) {
    if (err != NULL) {
        memset(err, 0, sizeof *err);
        err->code = code;
        err->sys_errno = sys_errno;
        snprintf(err->code_name, sizeof err->code_name, "%s", escrow_code_name(code));
        snprintf(err->id, sizeof err->id, "%s", id != NULL ? id : "");
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
    }
    return code;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Milliseconds to `deadline`, rounded up so a poll never wakes just short of it; 0 if passed. */
static int ms_left(double deadline) {
    double left = deadline - now();
    if (left <= 0) return 0;
    if (left > 1e6) left = 1e6;
    return (int)(left * 1000.0) + 1;
}

/* Wait until `sock` is ready for `events`; -1 with errno ETIMEDOUT once the deadline passed. */
static int wait_io(int sock, short events, double deadline) {
    for (;;) {
        int ms = ms_left(deadline);
        if (ms == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        struct pollfd p = {.fd = sock, .events = events, .revents = 0};
        int r = poll(&p, 1, ms);
        if (r > 0) return 0; /* ready, or hung up: the next call says which */
        if (r < 0 && errno != EINTR) return -1;
    }
}

/* A failed read or write: past the deadline, the holder is unresponsive; else it is gone. */
static escrow_code io_failed(escrow_error *err, int e, const char *what) {
    if (e == ETIMEDOUT)
        return fail(err, ESCROW_UNRESPONSIVE, e, NULL, "the holder %s in time", what);
    return fail(err, ESCROW_UNAVAILABLE, e, NULL, "the holder closed the connection (%s)",
                strerror(e));
}

/* ---- 2. MessagePack by hand (PROTOCOL.md section 3) ------------------------------------ */

/* Writing: a growing buffer. Ints take the smallest format that fits, floats are float64,
 * text is str: the same bytes the reference encoder writes. */
typedef struct mp_out {
    unsigned char *data;
    size_t len, cap;
    int failed; /* out of memory: every later put is ignored, and the frame is refused */
} mp_out;

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

#ifdef ESCROW_FULL_CODEC /* only retrieve_many sends an array (section 5 below) */
static void mp_array(mp_out *o, uint32_t n) {
    if (n < 16) put_byte(o, 0x90 | n);
    else if (n <= 0xffff) put_be(o, 0xdc, n, 2);
    else put_be(o, 0xdd, n, 4);
}
#endif

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

/* ---- 3. the socket: path, trust, connect (PROTOCOL.md section 1) ------------------------ */

static int valid_name(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > ESCROW_NAME_MAX) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                 c == '.' || c == '_' || c == ':' || c == '@' || c == '-';
        if (!ok) return 0;
    }
    return 1;
}

/* `path` made absolute against the current directory; at most 103 bytes (section 1.2). */
static escrow_code absolute(const char *path, char *out, size_t size, escrow_error *err) {
    char cwd[4096], joined[4096 + 256];
    if (path[0] == 0) return fail(err, ESCROW_CONFIG, 0, NULL, "the socket path is empty");
    if (path[0] == '/') {
        snprintf(joined, sizeof joined, "%s", path);
    } else {
        if (getcwd(cwd, sizeof cwd) == NULL)
            return fail(err, ESCROW_SYSTEM, errno, NULL, "getcwd: %s", strerror(errno));
        snprintf(joined, sizeof joined, "%s/%.255s", cwd, path);
    }
    size_t len = strlen(joined);
    if (len > ESCROW_MAX_SOCKET_PATH || len >= size)
        return fail(err, ESCROW_CONFIG, 0, NULL,
                    "socket path is %zu bytes, over the %d-byte limit of a Unix socket "
                    "address: %.300s", len, ESCROW_MAX_SOCKET_PATH, joined);
    memcpy(out, joined, len + 1);
    return ESCROW_OK;
}

escrow_code escrow_default_socket_path(char *buf, size_t size, escrow_error *err) {
    char path[4096];
    const char *explicit = getenv("ESCROW_SOCKET");
    const char *runtime = getenv("XDG_RUNTIME_DIR");
    if (explicit != NULL && explicit[0] != 0) return absolute(explicit, buf, size, err);
    if (runtime != NULL && runtime[0] != 0) {
        size_t n = strlen(runtime);
        while (n > 1 && runtime[n - 1] == '/') n--; /* "/run/user/1000/" joins without "//" */
        snprintf(path, sizeof path, "%.*s/escrowd/escrowd.sock", (int)(n < 3000 ? n : 3000),
                 runtime);
        return absolute(path, buf, size, err);
    }
    /* Literally /tmp, never $TMPDIR: an app, a shell and a LaunchAgent must agree. */
    snprintf(path, sizeof path, "/tmp/escrowd-%lu/escrowd.sock", (unsigned long)getuid());
    return absolute(path, buf, size, err);
}

/* Before a single byte goes out: the socket's directory is a real directory (not a
 * symlink), ours, and writable by nobody else. Else another user could stand in for the
 * holder and receive our terminals (section 1.3). */
static escrow_code check_directory(const char *socket_path, escrow_error *err) {
    char dir[ESCROW_MAX_SOCKET_PATH + 1];
    struct stat st;
    snprintf(dir, sizeof dir, "%s", socket_path);
    char *slash = strrchr(dir, '/');
    if (slash == dir) slash[1] = 0; /* a socket in / */
    else if (slash != NULL) *slash = 0;
    if (lstat(dir, &st) != 0) {
        int e = errno;
        if (e == ENOENT)
            return fail(err, ESCROW_UNAVAILABLE, e, NULL,
                        "no holder is listening on %s (its directory does not exist)",
                        socket_path);
        return fail(err, ESCROW_FORBIDDEN, e, NULL, "cannot check the socket directory %s: %s",
                    dir, strerror(e));
    }
    unsigned long me = (unsigned long)getuid();
    if (S_ISLNK(st.st_mode))
        return fail(err, ESCROW_FORBIDDEN, 0, NULL,
                    "socket directory %s is a symlink; expected a real directory owned by "
                    "uid %lu: nothing was sent", dir, me);
    if (!S_ISDIR(st.st_mode))
        return fail(err, ESCROW_FORBIDDEN, 0, NULL,
                    "socket directory %s is not a directory: nothing was sent", dir);
    if ((unsigned long)st.st_uid != me)
        return fail(err, ESCROW_FORBIDDEN, 0, NULL,
                    "socket directory %s is owned by uid %lu; expected uid %lu (yours): "
                    "nothing was sent", dir, (unsigned long)st.st_uid, me);
    if ((st.st_mode & 022) != 0)
        return fail(err, ESCROW_FORBIDDEN, 0, NULL,
                    "socket directory %s has mode %04o, writable by group or others; "
                    "expected a directory only its owner (uid %lu) can write: nothing was sent",
                    dir, (unsigned)(st.st_mode & 07777), me);
    return ESCROW_OK;
}

/* After connect, before a byte goes out: the listening process runs as our uid. */
static escrow_code check_peer(int sock, const char *path, escrow_error *err) {
    unsigned long uid;
#if defined(SO_PEERCRED)
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
        return fail(err, ESCROW_FORBIDDEN, errno, NULL, "cannot tell who listens on %s: %s",
                    path, strerror(errno));
    uid = (unsigned long)cred.uid;
#else
    uid_t peer_uid;
    gid_t peer_gid;
    if (getpeereid(sock, &peer_uid, &peer_gid) != 0)
        return fail(err, ESCROW_FORBIDDEN, errno, NULL, "cannot tell who listens on %s: %s",
                    path, strerror(errno));
    uid = (unsigned long)peer_uid;
#endif
    if (uid != (unsigned long)getuid())
        return fail(err, ESCROW_FORBIDDEN, 0, NULL,
                    "the process listening on %s runs as uid %lu; expected uid %lu (yours): "
                    "nothing was sent", path, uid, (unsigned long)getuid());
    return ESCROW_OK;
}

/* A non-blocking, close-on-exec socket that never raises SIGPIPE. */
static int new_socket(void) {
#ifdef SOCK_CLOEXEC
    return socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
#else
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    int one = 1;
    if (s < 0) return -1;
    if (fcntl(s, F_SETFD, FD_CLOEXEC) != 0 || fcntl(s, F_SETFL, O_NONBLOCK) != 0 ||
        setsockopt(s, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one) != 0) {
        int e = errno;
        close(s);
        errno = e;
        return -1;
    }
    return s;
#endif
}

static escrow_code open_socket(const char *path, double deadline, int *out, escrow_error *err) {
    struct sockaddr_un addr;
    escrow_code rc = check_directory(path, err);
    if (rc != ESCROW_OK) return rc;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, strlen(path) + 1); /* at most 104 bytes: checked at init */
    int s = new_socket();
    if (s < 0) return fail(err, ESCROW_SYSTEM, errno, NULL, "socket: %s", strerror(errno));
    for (;;) {
        int e = connect(s, (struct sockaddr *)&addr, sizeof addr) == 0 ? 0 : errno;
        if (e == EINPROGRESS || e == EALREADY || e == EINTR) {
            socklen_t len = sizeof e;
            if (wait_io(s, POLLOUT, deadline) != 0) e = errno;
            else if (getsockopt(s, SOL_SOCKET, SO_ERROR, &e, &len) != 0) e = errno;
        }
        if (e == 0 || e == EISCONN) break;
        if (e == EAGAIN && ms_left(deadline) > 0) { /* Linux: the listen backlog is full */
            poll(NULL, 0, ms_left(deadline) < 10 ? ms_left(deadline) : 10);
            continue;
        }
        close(s);
        if (e == EAGAIN || e == ETIMEDOUT)
            return fail(err, ESCROW_UNRESPONSIVE, e, NULL,
                        "the holder on %s did not accept the connection in time", path);
        return fail(err, ESCROW_UNAVAILABLE, e, NULL, "no holder is listening on %s (%s)", path,
                    strerror(e));
    }
    rc = check_peer(s, path, err);
    if (rc != ESCROW_OK) {
        close(s);
        return rc;
    }
    *out = s;
    return ESCROW_OK;
}

/* ---- 4. frames, and the fds that ride on them (PROTOCOL.md sections 2 and 4) ----------- */

typedef struct frame {
    unsigned char *body;
    size_t len;
    char type[16];
    int fds[MAX_FDS_SEEN]; /* the first fds received; any beyond are closed at once */
    size_t nfds;           /* how many arrived in all */
} frame;

static void frame_free(frame *f) {
    for (size_t i = 0; i < f->nfds && i < MAX_FDS_SEEN; i++) close(f->fds[i]);
    free(f->body);
    memset(f, 0, sizeof *f);
}

/* Take every fd that one recvmsg installed, counting fds rather than control messages. */
static void take_fds(struct msghdr *msg, frame *f) {
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_len < CMSG_LEN(0)) break;
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
#ifndef MSG_CMSG_CLOEXEC
            fcntl(fd, F_SETFD, FD_CLOEXEC);
#endif
            if (f->nfds < MAX_FDS_SEEN) f->fds[f->nfds] = fd;
            else close(fd);
            f->nfds++;
        }
    }
}

/* Read exactly `n` bytes: never more, or bytes and fds of the next frame would be taken
 * with this one (section 4.2). */
static escrow_code read_exactly(int sock, unsigned char *buf, size_t n, frame *f,
                                int *truncated, int at_start, double deadline,
                                escrow_error *err) {
    size_t got = 0;
    while (got < n) {
        union {
            struct cmsghdr align;
            unsigned char space[CMSG_SPACE(MAX_FDS_SEEN * sizeof(int))];
        } control;
        struct iovec iov = {.iov_base = buf + got, .iov_len = n - got};
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.space;
        msg.msg_controllen = sizeof control.space;
        ssize_t r = recvmsg(sock, &msg, RECV_FLAGS);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (wait_io(sock, POLLIN, deadline) != 0)
                    return io_failed(err, errno, "did not answer");
                continue;
            }
            return io_failed(err, errno, "did not answer");
        }
        take_fds(&msg, f);
        if (msg.msg_flags & MSG_CTRUNC) *truncated = 1; /* read on: the stream stays in step */
        if (r == 0) {
            if (at_start && got == 0 && f->nfds == 0 && !*truncated)
                return fail(err, ESCROW_UNAVAILABLE, 0, NULL, "the holder closed the connection");
            return fail(err, ESCROW_PROTOCOL, 0, NULL,
                        "the holder closed the connection in the middle of a frame");
        }
        got += (size_t)r;
    }
    return ESCROW_OK;
}

static int frame_type(const unsigned char *body, size_t len, char type[16]);
static size_t fds_carried(const frame *f);

/* One whole frame, checked: a sane length, no MSG_CTRUNC, a body that is a message, and
 * exactly the fds the message carries (section 4's table: it depends on `journal` in a
 * handoff or a deposited). On any failure every fd that came with it is closed. */
static escrow_code recv_frame(int sock, double deadline, frame *f, escrow_error *err) {
    unsigned char header[4];
    int truncated = 0;
    memset(f, 0, sizeof *f);
    escrow_code rc = read_exactly(sock, header, 4, f, &truncated, 1, deadline, err);
    if (rc == ESCROW_OK) {
        uint32_t len = (uint32_t)header[0] << 24 | (uint32_t)header[1] << 16 |
                       (uint32_t)header[2] << 8 | header[3];
        if (len == 0 || len > MAX_RESPONSE_BYTES)
            rc = fail(err, ESCROW_PROTOCOL, 0, NULL, "a frame length of %lu bytes",
                      (unsigned long)len);
        else if ((f->body = malloc(len)) == NULL)
            rc = fail(err, ESCROW_SYSTEM, ENOMEM, NULL, "no memory for a %lu-byte frame",
                      (unsigned long)len);
        else
            f->len = len, rc = read_exactly(sock, f->body, len, f, &truncated, 0, deadline, err);
    }
    if (rc == ESCROW_OK && truncated)
        rc = fail(err, ESCROW_PROTOCOL, 0, NULL, "ancillary data was cut (MSG_CTRUNC)");
    if (rc == ESCROW_OK && frame_type(f->body, f->len, f->type) != 0)
        rc = fail(err, ESCROW_PROTOCOL, 0, NULL, "the holder sent a frame that is not a message");
    if (rc == ESCROW_OK) {
        size_t wanted = fds_carried(f);
        if (f->nfds != wanted)
            rc = fail(err, ESCROW_PROTOCOL, 0, NULL, "a %s frame came with %zu fds, not %zu",
                      f->type, f->nfds, wanted);
    }
    if (rc != ESCROW_OK) frame_free(f);
    return rc;
}

static escrow_code decode_error(const frame *f, escrow_error *err);

/* Send one whole frame; `fd` (if >= 0) rides on the sendmsg that carries its first byte. */
static escrow_code send_frame(int sock, const unsigned char *data, size_t len, int fd,
                              double deadline, escrow_error *err) {
    size_t sent = 0;
    while (sent < len) {
        union {
            struct cmsghdr align;
            unsigned char space[CMSG_SPACE(sizeof(int))];
        } control;
        struct iovec iov = {.iov_base = (void *)(data + sent), .iov_len = len - sent};
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        if (fd >= 0 && sent == 0) {
            memset(&control, 0, sizeof control);
            msg.msg_control = control.space;
            msg.msg_controllen = sizeof control.space;
            struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(c), &fd, sizeof fd);
        }
        ssize_t n = sendmsg(sock, &msg, SEND_FLAGS);
        if (n >= 0) {
            sent += (size_t)n;
            continue;
        }
        int e = errno;
        if (e == EINTR) continue; /* nothing was sent, fd included: send it again */
        if (e == EAGAIN || e == EWOULDBLOCK) {
            if (wait_io(sock, POLLOUT, deadline) != 0)
                return io_failed(err, errno, "did not take a request");
            continue;
        }
        if (e == EPIPE || e == ECONNRESET) {
            /* A holder that refuses us says why first, then hangs up: read what it said. */
            frame said;
            if (recv_frame(sock, deadline, &said, NULL) == ESCROW_OK) {
                escrow_code rc = strcmp(said.type, "error") == 0 ? decode_error(&said, err)
                                                                  : ESCROW_UNAVAILABLE;
                frame_free(&said);
                if (rc != ESCROW_UNAVAILABLE) return rc;
            }
        }
        return io_failed(err, e, "did not take a request");
    }
    return ESCROW_OK;
}

/* ---- 5. messages (PROTOCOL.md section 7) ----------------------------------------------- */

/* A request: a frame header (filled in by `finish`), then a map of `fields` + 1 entries. */
static void begin(mp_out *o, const char *type, uint32_t fields) {
    put(o, "\0\0\0\0", 4);
    mp_map(o, fields + 1);
    mp_str(o, "type");
    mp_str(o, type);
}

static escrow_code finish(mp_out *o, escrow_error *err) {
    if (o->failed) return fail(err, ESCROW_SYSTEM, ENOMEM, NULL, "no memory for a request");
    size_t body = o->len - 4;
    for (int i = 0; i < 4; i++) o->data[i] = (unsigned char)(body >> (8 * (3 - i)));
    return ESCROW_OK;
}

static escrow_code encode_hello(mp_out *o, const escrow_client *c, escrow_error *err) {
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

/* `journal`: ask to record into the ring (section 10.6). The API never asks (escrow_deposit
 * passes 0); the codec writes either, for the test vectors. */
static escrow_code encode_deposit(mp_out *o, const char *id, const escrow_deposit_opts *opts,
                                  int journal, escrow_error *err) {
    static const escrow_deposit_opts none = {NULL, 0, 0, 0, NULL, 0};
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
static escrow_code encode_id(mp_out *o, const char *type, const char *id, escrow_error *err) {
    begin(o, type, 1);
    mp_str(o, "id"), mp_str(o, id);
    return finish(o, err);
}

/* `keep`: retrieve into custody (section 12.6); `journal` only with it. */
static escrow_code encode_retrieve(mp_out *o, const char *id, int keep, int journal,
                                   escrow_error *err) {
    begin(o, "retrieve", 3);
    mp_str(o, "id"), mp_str(o, id);
    mp_str(o, "keep"), mp_bool(o, keep);
    mp_str(o, "journal"), mp_bool(o, journal);
    return finish(o, err);
}

/* `keep` repeats the retrieve's (section 12.6). */
static escrow_code encode_ack(mp_out *o, const char *id, const char *handoff_id, int keep,
                              escrow_error *err) {
    begin(o, "ack", 3);
    mp_str(o, "id"), mp_str(o, id);
    mp_str(o, "handoff_id"), mp_str(o, handoff_id);
    mp_str(o, "keep"), mp_bool(o, keep);
    return finish(o, err);
}

/* update (section 10.5): cols or rows < 0, or meta NULL, is nil: unchanged. A meta that is
 * given (even with no entries) replaces the whole map. */
static escrow_code encode_update(mp_out *o, const char *id, int64_t cols, int64_t rows,
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

#ifdef ESCROW_FULL_CODEC
/* Messages the API neither sends nor receives (it offers no retrieve_many), written out for
 * ports and checked against the test vectors: escrow-c.c defines ESCROW_FULL_CODEC. */

static escrow_code MAYBE_UNUSED
encode_retrieve_many(mp_out *o, const char *const *ids, size_t count, int keep, int journal,
                     escrow_error *err) {
    begin(o, "retrieve_many", 3);
    mp_str(o, "ids"), mp_array(o, (uint32_t)count);
    for (size_t i = 0; i < count; i++) mp_str(o, ids[i]);
    mp_str(o, "keep"), mp_bool(o, keep);
    mp_str(o, "journal"), mp_bool(o, journal);
    return finish(o, err);
}

/* acks: ids[i] -> handoff_ids[i], in this order (the holder answers done_many in it). */
static escrow_code MAYBE_UNUSED
encode_ack_many(mp_out *o, const char *const *ids, const char *const *handoff_ids, size_t count,
                int keep, escrow_error *err) {
    begin(o, "ack_many", 2);
    mp_str(o, "acks"), mp_map(o, (uint32_t)count);
    for (size_t i = 0; i < count; i++) mp_str(o, ids[i]), mp_str(o, handoff_ids[i]);
    mp_str(o, "keep"), mp_bool(o, keep);
    return finish(o, err);
}
#endif

static escrow_code encode_list(mp_out *o, int all_owners, escrow_error *err) {
    begin(o, "list", 1);
    mp_str(o, "all_owners"), mp_bool(o, all_owners);
    return finish(o, err);
}

/* The body's `type`. A repeated `type` key must repeat the same value. */
static int frame_type(const unsigned char *body, size_t len, char type[16]) {
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

/* Does the body's `journal` field hold a value (not nil)? The last of repeated keys counts. */
static int has_journal(const frame *f) {
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    int set = 0;
    if (rd_map(&in, &n) != 0) return 0;
    for (size_t i = 0; i < n; i++) {
        const char *k;
        size_t kl;
        if (rd_str(&in, &k, &kl) != 0) return 0;
        if (key_is(k, kl, "journal")) set = peek(&in) != 0xc0;
        if (rd_skip(&in, 0) != 0) return 0;
    }
    return set;
}

/* How many fds a holder's message comes with (section 4): the master of a handoff, and the
 * journal file of a granted journal (a handoff's second fd, a deposited's only one). A journal
 * of the wrong shape is counted as set; the frame then fails to decode. */
static size_t fds_carried(const frame *f) {
    if (strcmp(f->type, "handoff") == 0) return 1 + (size_t)has_journal(f);
    if (strcmp(f->type, "deposited") == 0) return (size_t)has_journal(f);
    return 0;
}

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

static int decode_welcome(const frame *f, escrow_welcome *w) {
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
static int decode_id(const frame *f, char id[ESCROW_NAME_MAX + 1]) {
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

/* A Journal (section 10.6) | nil: where an app that journals writes. The API asks for none,
 * so it only reads one (and closes the journal file that comes with it). */
typedef struct journal_info {
    int set; /* 0: nil */
    int64_t capacity, total, position;
} journal_info;

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

/* deposited: {id, journal}. */
static int decode_deposited(const frame *f, char id[ESCROW_NAME_MAX + 1], journal_info *j) {
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

static int decode_handoff(const frame *f, escrow_retrieved *out, journal_info *j) {
    enum { HANDOFF_ID = 1, SESSION = 2, REPLAY = 4 };
    unsigned need = HANDOFF_ID | SESSION | REPLAY;
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    memset(j, 0, sizeof *j);
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
        else r = rd_skip(&in, 0);
        if (r != 0) return -1;
    }
    return need == 0 ? 0 : -1;
}

#ifdef ESCROW_FULL_CODEC
/* done_many: {ids}, the sessions an ack_many acked, as an array the caller frees (whatever
 * the result). */
static int MAYBE_UNUSED
decode_done_many(const frame *f, char (**ids)[ESCROW_NAME_MAX + 1], size_t *count) {
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
        /* Every id takes at least one byte: a bound before the allocation. */
        if (rd_array(&in, &m) != 0 || m > (size_t)(in.end - in.p)) return -1;
        if ((*ids = calloc(m != 0 ? m : 1, sizeof **ids)) == NULL) return -1;
        for (; *count < m; (*count)++)
            if (rd_exact(&in, (*ids)[*count], sizeof **ids) != 0) return -1;
    }
    return have ? 0 : -1;
}
#endif

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

static int decode_sessions(const frame *f, escrow_session **out, size_t *count) {
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

static int decode_status(const frame *f, escrow_status *s) {
    enum { PID = 1, VERSION = 2, STARTED = 4, SOCKET = 8 };
    unsigned need = PID | VERSION | STARTED | SOCKET;
    mp_in in = {f->body, f->body + f->len};
    size_t n;
    memset(s, 0, sizeof *s);
    s->open_fds = s->rss_bytes = -1;
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

static int decode_error_fields(const frame *f, escrow_error *e) {
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
static escrow_code decode_error(const frame *f, escrow_error *err) {
    escrow_error local;
    escrow_error *e = err != NULL ? err : &local;
    memset(e, 0, sizeof *e);
    if (decode_error_fields(f, e) != 0)
        return fail(err, ESCROW_PROTOCOL, 0, NULL, "the holder sent a malformed error");
    e->code = code_from_name(e->code_name);
    return e->code;
}

/* ---- 6. the calls (PROTOCOL.md sections 5, 10, 11 and 12) ------------------------------- */

typedef escrow_custody conn; /* any greeted connection; a custody is one that deposited */

static void conn_close(conn *c) {
    if (c->sock >= 0) close(c->sock);
    c->sock = -1;
}

/* Send a request (freeing its buffer). A request over the holder's limit is never sent: the
 * holder would end the connection, and with it any custody it carries. */
static escrow_code send_request(conn *c, mp_out *o, int fd, double deadline, escrow_error *err) {
    int64_t limit;
    escrow_code rc = ESCROW_OK;
    if (escrow_ints_get(&c->welcome.limits, "max_request_bytes", &limit) &&
        (int64_t)o->len - 4 > limit)
        rc = fail(err, ESCROW_BAD_REQUEST, 0, NULL,
                  "a request of %zu bytes is over the holder's limit of %lld: nothing was sent",
                  o->len - 4, (long long)limit);
    if (rc == ESCROW_OK) rc = send_frame(c->sock, o->data, o->len, fd, deadline, err);
    free(o->data);
    memset(o, 0, sizeof *o);
    return rc;
}

/* The next frame, which must be `want` or an `error` (returned as its code). */
static escrow_code receive(conn *c, const char *want, double deadline, frame *f,
                           escrow_error *err) {
    escrow_code rc = recv_frame(c->sock, deadline, f, err);
    if (rc != ESCROW_OK) return rc;
    if (strcmp(f->type, want) == 0) return ESCROW_OK;
    if (strcmp(f->type, "error") == 0) rc = decode_error(f, err);
    else rc = fail(err, ESCROW_PROTOCOL, 0, NULL, "expected %s, got %s", want, f->type);
    frame_free(f);
    return rc;
}

static escrow_code call(conn *c, mp_out *o, int fd, const char *want, double deadline, frame *f,
                        escrow_error *err) {
    escrow_code rc = send_request(c, o, fd, deadline, err);
    return rc != ESCROW_OK ? rc : receive(c, want, deadline, f, err);
}

/* Connect, check whom we reached, and say hello (section 5). */
static escrow_code connect_greet(const escrow_client *cl, conn *c, double deadline,
                                 escrow_error *err) {
    mp_out o = {0};
    frame f;
    memset(c, 0, sizeof *c);
    c->sock = -1;
    c->client = cl;
    escrow_code rc = open_socket(cl->socket_path, deadline, &c->sock, err);
    if (rc == ESCROW_OK) rc = encode_hello(&o, cl, err);
    if (rc == ESCROW_OK) rc = call(c, &o, -1, "welcome", deadline, &f, err);
    free(o.data);
    if (rc != ESCROW_OK) {
        conn_close(c);
        return rc;
    }
    if (decode_welcome(&f, &c->welcome) != 0)
        rc = fail(err, ESCROW_PROTOCOL, 0, NULL, "the holder sent a malformed welcome");
    else if (c->welcome.version != ESCROW_PROTOCOL_VERSION)
        rc = fail(err, ESCROW_PROTOCOL, 0, NULL,
                  "the holder answered version %lld to a hello of %d",
                  (long long)c->welcome.version, ESCROW_PROTOCOL_VERSION);
    frame_free(&f);
    if (rc != ESCROW_OK) conn_close(c);
    return rc;
}

escrow_code escrow_client_init(escrow_client *c, const char *owner, const char *socket_path,
                               double timeout, escrow_error *err) {
    memset(c, 0, sizeof *c);
    if (owner == NULL || !valid_name(owner))
        return fail(err, ESCROW_CONFIG, 0, NULL, "owner must match [A-Za-z0-9._:@-]{1,128}");
    snprintf(c->owner, sizeof c->owner, "%s", owner);
    snprintf(c->client_name, sizeof c->client_name, "escrow.c pid=%ld", (long)getpid());
    c->timeout = timeout > 0 ? timeout : ESCROW_DEFAULT_TIMEOUT;
    if (socket_path != NULL)
        return absolute(socket_path, c->socket_path, sizeof c->socket_path, err);
    return escrow_default_socket_path(c->socket_path, sizeof c->socket_path, err);
}

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

escrow_code escrow_custody_open(const escrow_client *c, escrow_custody *cu, escrow_error *err) {
    return connect_greet(c, cu, now() + c->timeout, err);
}

/* A call with one {id} answer on a greeted connection: release, update. */
static escrow_code id_call(conn *c, mp_out *o, int fd, const char *want, const char *id,
                           escrow_error *err) {
    frame f;
    double deadline = now() + c->client->timeout;
    escrow_code rc = call(c, o, fd, want, deadline, &f, err);
    if (rc != ESCROW_OK) return rc;
    char got[ESCROW_NAME_MAX + 1];
    if (decode_id(&f, got) != 0) rc = fail(err, ESCROW_PROTOCOL, 0, id, "a malformed %s", want);
    frame_free(&f);
    return rc;
}

escrow_code escrow_deposit(escrow_custody *cu, const char *id, int fd,
                           const escrow_deposit_opts *opts, escrow_error *err) {
    mp_out o = {0};
    frame f;
    if (cu->sock < 0) return fail(err, ESCROW_CONFIG, 0, id, "this custody is closed");
    escrow_code rc = encode_deposit(&o, id, opts, 0, err); /* no journal: section 10.6 */
    if (rc == ESCROW_OK) rc = call(cu, &o, fd, "deposited", now() + cu->client->timeout, &f, err);
    free(o.data);
    if (rc != ESCROW_OK) return rc;
    char got[ESCROW_NAME_MAX + 1];
    journal_info journal;
    if (decode_deposited(&f, got, &journal) != 0)
        rc = fail(err, ESCROW_PROTOCOL, 0, id, "a malformed deposited");
    /* A journal file comes only with a journal, which this client never asks for; the one a
     * holder may still send (resuming a session that journals, section 10.4) is closed
     * with the frame: this client never writes a journal. */
    frame_free(&f);
    return rc;
}

escrow_code escrow_custody_release(escrow_custody *cu, const char *id, escrow_error *err) {
    mp_out o = {0};
    if (cu->sock < 0) return fail(err, ESCROW_CONFIG, 0, id, "this custody is closed");
    escrow_code rc = encode_id(&o, "release", id, err);
    if (rc == ESCROW_OK) rc = id_call(cu, &o, -1, "released", id, err);
    free(o.data);
    return rc;
}

/* update (section 10.5) on a greeted connection: {id} answered `updated{id}`. */
static escrow_code update_on(conn *c, const char *id, int64_t cols, int64_t rows,
                             const escrow_meta *meta, size_t meta_count, escrow_error *err) {
    mp_out o = {0};
    escrow_code rc = encode_update(&o, id, cols, rows, meta, meta_count, err);
    if (rc == ESCROW_OK) rc = id_call(c, &o, -1, "updated", id, err);
    free(o.data);
    return rc;
}

escrow_code escrow_custody_update(escrow_custody *cu, const char *id, int64_t cols, int64_t rows,
                                  const escrow_meta *meta, size_t meta_count,
                                  escrow_error *err) {
    if (cu->sock < 0) return fail(err, ESCROW_CONFIG, 0, id, "this custody is closed");
    return update_on(cu, id, cols, rows, meta, meta_count, err);
}

void escrow_custody_close(escrow_custody *cu) {
    if (cu->sock < 0) return;
    /* The holder closes its side once it has ended our custody: every session held here is
     * draining by then. Nothing else arrives after our SHUT_WR (section 11). */
    double deadline = now() + cu->client->timeout;
    if (shutdown(cu->sock, SHUT_WR) == 0) {
        unsigned char sink[256];
        for (;;) {
            ssize_t n = recv(cu->sock, sink, sizeof sink, 0);
            if (n == 0) break;
            if (n > 0 || errno == EINTR) continue;
            if ((errno != EAGAIN && errno != EWOULDBLOCK) ||
                wait_io(cu->sock, POLLIN, deadline) != 0)
                break; /* the holder acts on our hang-up anyway; waiting was a courtesy */
        }
    }
    conn_close(cu);
}

void escrow_custody_close_in_child(escrow_custody *cu) { conn_close(cu); }

escrow_code escrow_hand_off(const escrow_client *c, const char *id, int fd,
                            const escrow_deposit_opts *opts, escrow_error *err) {
    escrow_custody cu;
    escrow_code rc = escrow_custody_open(c, &cu, err);
    if (rc != ESCROW_OK) return rc;
    rc = escrow_deposit(&cu, id, fd, opts, err);
    escrow_custody_close(&cu);
    return rc;
}

/* One question on a fresh connection: list, status. */
static escrow_code ask(const escrow_client *c, mp_out *o, const char *want, frame *f,
                       escrow_error *err) {
    conn cn;
    double deadline = now() + c->timeout;
    escrow_code rc = connect_greet(c, &cn, deadline, err);
    if (rc == ESCROW_OK) rc = call(&cn, o, -1, want, deadline, f, err);
    conn_close(&cn);
    return rc;
}

escrow_code escrow_list(const escrow_client *c, int all_owners, escrow_session **out,
                        size_t *count, escrow_error *err) {
    mp_out o = {0};
    frame f;
    *out = NULL;
    *count = 0;
    escrow_code rc = encode_list(&o, all_owners, err);
    if (rc == ESCROW_OK) rc = ask(c, &o, "sessions", &f, err);
    free(o.data);
    if (rc != ESCROW_OK) return rc;
    if (decode_sessions(&f, out, count) != 0) {
        escrow_sessions_free(*out, *count);
        *out = NULL;
        *count = 0;
        rc = fail(err, ESCROW_PROTOCOL, 0, NULL, "the holder sent a malformed sessions list");
    }
    frame_free(&f);
    return rc;
}

void escrow_sessions_free(escrow_session *sessions, size_t count) {
    for (size_t i = 0; sessions != NULL && i < count; i++) escrow_session_clear(&sessions[i]);
    free(sessions);
}

escrow_code escrow_status_of(const escrow_client *c, escrow_status *out, escrow_error *err) {
    mp_out o = {0};
    frame f;
    begin(&o, "status", 0);
    escrow_code rc = finish(&o, err);
    if (rc == ESCROW_OK) rc = ask(c, &o, "holder_status", &f, err);
    free(o.data);
    if (rc != ESCROW_OK) return rc;
    if (decode_status(&f, out) != 0)
        rc = fail(err, ESCROW_PROTOCOL, 0, NULL, "the holder sent a malformed holder_status");
    frame_free(&f);
    return rc;
}

escrow_code escrow_release(const escrow_client *c, const char *id, escrow_error *err) {
    mp_out o = {0};
    conn cn;
    escrow_code rc = connect_greet(c, &cn, now() + c->timeout, err);
    if (rc != ESCROW_OK) return rc;
    rc = encode_id(&o, "release", id, err);
    if (rc == ESCROW_OK) rc = id_call(&cn, &o, -1, "released", id, err);
    free(o.data);
    conn_close(&cn);
    return rc;
}

escrow_code escrow_update(const escrow_client *c, const char *id, int64_t cols, int64_t rows,
                          const escrow_meta *meta, size_t meta_count, escrow_error *err) {
    conn cn;
    escrow_code rc = connect_greet(c, &cn, now() + c->timeout, err);
    if (rc != ESCROW_OK) return rc;
    rc = update_on(&cn, id, cols, rows, meta, meta_count, err);
    conn_close(&cn);
    return rc;
}

escrow_code escrow_welcome_of(const escrow_client *c, escrow_welcome *out, escrow_error *err) {
    conn cn;
    escrow_code rc = connect_greet(c, &cn, now() + c->timeout, err);
    if (rc == ESCROW_OK) *out = cn.welcome;
    conn_close(&cn);
    return rc;
}

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

/* `done` never came: ask on a fresh connection who owns the fd (section 12.3). We still hold
 * our copy, unread. */
static escrow_code resolve(const escrow_client *c, escrow_retrieved *r, escrow_error *err) {
    double deadline = now() + c->timeout;
    const char *id = r->session.id;
    for (;;) {
        escrow_session *all = NULL, *s = NULL;
        size_t n = 0;
        escrow_client asking = *c;
        asking.timeout = deadline - now();
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
            else verdict = fail(err, ESCROW_HANDED_OFF, 0, id,
                                "session %s was handed off to another client", id);
        } else if (strcmp(s->state, "handing_off") == 0) {
            if (s->handoff_id[0] != 0 && strcmp(s->handoff_id, r->handoff_id) != 0)
                verdict = fail(err, ESCROW_BUSY, 0, id,
                               "session %s is being handed off to another client", id);
            else again = 1; /* the holder is still acting on our ack or our hang-up */
        } else if (strcmp(s->state, "draining") == 0 || strcmp(s->state, "exited") == 0 ||
                   strcmp(s->state, "held") == 0) {
            if (s->deposited_at == r->session.deposited_at) /* else a new deposit reused the id */
                verdict = fail(err, ESCROW_UNRESPONSIVE, 0, id,
                               "the handoff of %s was not confirmed and the holder kept it (%s): "
                               "retrieve it again", id, s->state);
        } /* released, expired, or a state newer than us: the holder has no copy to read */
        escrow_sessions_free(all, n);
        if (verdict != ESCROW_OK) {
            give_back(r);
            return verdict;
        }
        if (!again) return ESCROW_OK;
        if (ms_left(deadline) <= 20) return ESCROW_OK; /* our ack is queued there, if anything */
        poll(NULL, 0, 20);
    }
}

escrow_code escrow_retrieve(const escrow_client *c, const char *id, escrow_retrieved *out,
                            escrow_error *err) {
    conn cn;
    frame f;
    mp_out o = {0};
    double deadline = now() + c->timeout;
    memset(out, 0, sizeof *out);
    out->fd = -1;
    escrow_code rc = connect_greet(c, &cn, deadline, err);
    if (rc != ESCROW_OK) return rc;
    /* The timeout invariant (section 12.1): never start a retrieve we would give up on while
     * the holder is still legitimately stopping the drain and sending. */
    double needs = cn.welcome.drain_stop_budget + cn.welcome.send_deadline;
    if (c->timeout <= needs) {
        conn_close(&cn);
        return fail(err, ESCROW_CONFIG, 0, id,
                    "client timeout %.3gs must exceed the holder's drain_stop_budget + "
                    "send_deadline = %.3gs; raise the timeout", c->timeout, needs);
    }
    if (deadline - now() <= needs) {
        conn_close(&cn);
        return fail(err, ESCROW_UNRESPONSIVE, 0, id, "not enough time left to retrieve %s", id);
    }
    rc = encode_retrieve(&o, id, 0, 0, err); /* no keep, no journal: section 12.2 */
    if (rc == ESCROW_OK) rc = call(&cn, &o, -1, "handoff", deadline, &f, err);
    free(o.data);
    if (rc != ESCROW_OK) {
        conn_close(&cn);
        if (err != NULL && err->id[0] == 0) snprintf(err->id, sizeof err->id, "%s", id);
        return rc;
    }
    journal_info journal;
    if (decode_handoff(&f, out, &journal) != 0) {
        frame_free(&f); /* closes the fds: never acked, the holder drains it again */
        escrow_retrieved_free(out);
        conn_close(&cn);
        return fail(err, ESCROW_PROTOCOL, 0, id, "the holder sent a malformed handoff");
    }
    /* The master is the first fd (section 4.3). A second, the journal file of a journal,
     * comes only to a retrieve with keep and journal, which this one is not: frame_free
     * closes it. */
    out->fd = f.fds[0];
    f.fds[0] = f.fds[--f.nfds]; /* the master is out's now; the rest stay the frame's */
    frame_free(&f);
    if (!isatty(out->fd)) { /* do not ack: the holder drains it again when we hang up */
        give_back(out);
        conn_close(&cn);
        return fail(err, ESCROW_PROTOCOL, 0, id, "the holder handed off %s as a non-terminal", id);
    }
    /* Ack, and read nothing from the fd before `done`: ownership moves at `done`. */
    rc = encode_ack(&o, id, out->handoff_id, 0, err);
    if (rc == ESCROW_OK) rc = call(&cn, &o, -1, "done", deadline, &f, err);
    free(o.data);
    conn_close(&cn);
    if (rc == ESCROW_OK) {
        frame_free(&f);
        out->confirmed = 1;
        return ESCROW_OK;
    }
    if (rc == ESCROW_UNRESPONSIVE || rc == ESCROW_UNAVAILABLE || rc == ESCROW_PROTOCOL ||
        rc == ESCROW_SYSTEM)
        return resolve(c, out, err); /* no answer: ask who owns it */
    give_back(out); /* ack_late, or the ack refused: the holder is draining it again */
    return rc;
}
