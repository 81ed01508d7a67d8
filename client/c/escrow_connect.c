/* escrow_connect.c: where the holder is, whether to trust it, and a greeted connection.
 *
 * The socket's path resolves as PROTOCOL.md section 1.2 says, at most 103 bytes. Before a
 * single byte goes out, the client checks whom it is talking to (section 1.3): the socket's
 * directory is a real directory, ours, writable by nobody else, and after connect the
 * listening process runs as our uid; else ESCROW_FORBIDDEN, and nothing was sent. A deposit
 * sends a PTY master, and whoever receives one can type into the user's shell.
 *
 * Then every connection says hello and takes the welcome (section 5), and goes on one request
 * at a time: escrow__call sends one and reads its one answer. The timeout invariant of
 * section 12.1 is checked against that welcome before a retrieve.
 *
 * The fds: the socket is made close-on-exec and non-blocking (section 1.5) and is closed on
 * every path that fails; escrow__connect_greet hands it back only greeted, in `conn.sock`,
 * which escrow__conn_close closes (and sets to -1, so closing twice is harmless).
 */
#include "escrow_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

/* ---- the socket's path (PROTOCOL.md section 1.2) ---------------------------------------- */

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
    if (path[0] == 0) return escrow__fail(err, ESCROW_CONFIG, 0, NULL, "the socket path is empty");
    if (path[0] == '/') {
        snprintf(joined, sizeof joined, "%s", path);
    } else {
        if (getcwd(cwd, sizeof cwd) == NULL)
            return escrow__fail(err, ESCROW_SYSTEM, errno, NULL, "getcwd: %s", strerror(errno));
        snprintf(joined, sizeof joined, "%s/%.255s", cwd, path);
    }
    size_t len = strlen(joined);
    if (len > ESCROW_MAX_SOCKET_PATH || len >= size)
        return escrow__fail(err, ESCROW_CONFIG, 0, NULL,
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

escrow_code escrow_client_init(escrow_client *c, const char *owner, const char *socket_path,
                               double timeout, escrow_error *err) {
    memset(c, 0, sizeof *c);
    if (owner == NULL || !valid_name(owner))
        return escrow__fail(err, ESCROW_CONFIG, 0, NULL,
                            "owner must match [A-Za-z0-9._:@-]{1,128}");
    snprintf(c->owner, sizeof c->owner, "%s", owner);
    snprintf(c->client_name, sizeof c->client_name, "escrow.c pid=%ld", (long)getpid());
    c->timeout = timeout > 0 ? timeout : ESCROW_DEFAULT_TIMEOUT;
    if (socket_path != NULL)
        return absolute(socket_path, c->socket_path, sizeof c->socket_path, err);
    return escrow_default_socket_path(c->socket_path, sizeof c->socket_path, err);
}

/* ---- trust (PROTOCOL.md section 1.3) ---------------------------------------------------- */

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
            return escrow__fail(err, ESCROW_UNAVAILABLE, e, NULL,
                                "no holder is listening on %s (its directory does not exist)",
                                socket_path);
        return escrow__fail(err, ESCROW_FORBIDDEN, e, NULL,
                            "cannot check the socket directory %s: %s", dir, strerror(e));
    }
    unsigned long me = (unsigned long)getuid();
    if (S_ISLNK(st.st_mode))
        return escrow__fail(err, ESCROW_FORBIDDEN, 0, NULL,
                            "socket directory %s is a symlink; expected a real directory owned by "
                            "uid %lu: nothing was sent", dir, me);
    if (!S_ISDIR(st.st_mode))
        return escrow__fail(err, ESCROW_FORBIDDEN, 0, NULL,
                            "socket directory %s is not a directory: nothing was sent", dir);
    if ((unsigned long)st.st_uid != me)
        return escrow__fail(err, ESCROW_FORBIDDEN, 0, NULL,
                            "socket directory %s is owned by uid %lu; expected uid %lu (yours): "
                            "nothing was sent", dir, (unsigned long)st.st_uid, me);
    if ((st.st_mode & 022) != 0)
        return escrow__fail(err, ESCROW_FORBIDDEN, 0, NULL,
                            "socket directory %s has mode %04o, writable by group or others; "
                            "expected a directory only its owner (uid %lu) can write: "
                            "nothing was sent", dir, (unsigned)(st.st_mode & 07777), me);
    return ESCROW_OK;
}

/* After connect, before a byte goes out: the listening process runs as our uid. */
static escrow_code check_peer(int sock, const char *path, escrow_error *err) {
    unsigned long uid;
#if defined(SO_PEERCRED)
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
        return escrow__fail(err, ESCROW_FORBIDDEN, errno, NULL,
                            "cannot tell who listens on %s: %s", path, strerror(errno));
    uid = (unsigned long)cred.uid;
#else
    uid_t peer_uid;
    gid_t peer_gid;
    if (getpeereid(sock, &peer_uid, &peer_gid) != 0)
        return escrow__fail(err, ESCROW_FORBIDDEN, errno, NULL,
                            "cannot tell who listens on %s: %s", path, strerror(errno));
    uid = (unsigned long)peer_uid;
#endif
    if (uid != (unsigned long)getuid())
        return escrow__fail(err, ESCROW_FORBIDDEN, 0, NULL,
                            "the process listening on %s runs as uid %lu; expected uid %lu "
                            "(yours): nothing was sent", path, uid, (unsigned long)getuid());
    return ESCROW_OK;
}

/* ---- connect (PROTOCOL.md sections 1.4 and 1.5) ----------------------------------------- */

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
    if (s < 0) return escrow__fail(err, ESCROW_SYSTEM, errno, NULL, "socket: %s", strerror(errno));
    for (;;) {
        int e = connect(s, (struct sockaddr *)&addr, sizeof addr) == 0 ? 0 : errno;
        if (e == EINPROGRESS || e == EALREADY || e == EINTR) {
            socklen_t len = sizeof e;
            if (escrow__wait_io(s, POLLOUT, deadline) != 0) e = errno;
            else if (getsockopt(s, SOL_SOCKET, SO_ERROR, &e, &len) != 0) e = errno;
        }
        if (e == 0 || e == EISCONN) break;
        if (e == EAGAIN && escrow__ms_left(deadline) > 0) { /* Linux: the listen backlog is full */
            poll(NULL, 0, escrow__ms_left(deadline) < 10 ? escrow__ms_left(deadline) : 10);
            continue;
        }
        close(s);
        if (e == EAGAIN || e == ETIMEDOUT)
            return escrow__fail(err, ESCROW_UNRESPONSIVE, e, NULL,
                                "the holder on %s did not accept the connection in time", path);
        return escrow__fail(err, ESCROW_UNAVAILABLE, e, NULL,
                            "no holder is listening on %s (%s)", path, strerror(e));
    }
    rc = check_peer(s, path, err);
    if (rc != ESCROW_OK) {
        close(s);
        return rc;
    }
    *out = s;
    return ESCROW_OK;
}

/* ---- a greeted connection (PROTOCOL.md section 5) --------------------------------------- */

void escrow__conn_close(conn *c) {
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
        rc = escrow__fail(err, ESCROW_BAD_REQUEST, 0, NULL,
                          "a request of %zu bytes is over the holder's limit of %lld: "
                          "nothing was sent", o->len - 4, (long long)limit);
    if (rc == ESCROW_OK) rc = escrow__send_frame(c->sock, o->data, o->len, fd, deadline, err);
    free(o->data);
    memset(o, 0, sizeof *o);
    return rc;
}

/* The next frame, which must be `want` or an `error` (returned as its code). */
static escrow_code receive(conn *c, const char *want, double deadline, frame *f,
                           escrow_error *err) {
    escrow_code rc = escrow__recv_frame(c->sock, deadline, f, err);
    if (rc != ESCROW_OK) return rc;
    if (strcmp(f->type, want) == 0) return ESCROW_OK;
    if (strcmp(f->type, "error") == 0) rc = escrow__decode_error(f, err);
    else rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL, "expected %s, got %s", want, f->type);
    escrow__frame_free(f);
    return rc;
}

/* One request (`fd`, if >= 0, rides on it) and its one answer, which must be `want`: section 5
 * allows no second request before the answer to the first. */
escrow_code escrow__call(conn *c, mp_out *o, int fd, const char *want, double deadline,
                         frame *f, escrow_error *err) {
    escrow_code rc = send_request(c, o, fd, deadline, err);
    return rc != ESCROW_OK ? rc : receive(c, want, deadline, f, err);
}

/* A call whose answer is `want`{id}, within the client's timeout: release, update. */
escrow_code escrow__call_id(conn *c, mp_out *o, const char *want, const char *id,
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

/* Connect, check whom we reached, and say hello (section 5). */
escrow_code escrow__connect_greet(const escrow_client *cl, conn *c, double deadline,
                                  escrow_error *err) {
    mp_out o = {0};
    frame f;
    memset(c, 0, sizeof *c);
    c->sock = -1;
    c->client = cl;
    escrow_code rc = open_socket(cl->socket_path, deadline, &c->sock, err);
    if (rc == ESCROW_OK) rc = escrow__encode_hello(&o, cl, err);
    if (rc == ESCROW_OK) rc = escrow__call(c, &o, -1, "welcome", deadline, &f, err);
    free(o.data);
    if (rc != ESCROW_OK) {
        escrow__conn_close(c);
        return rc;
    }
    if (escrow__decode_welcome(&f, &c->welcome) != 0)
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL, "the holder sent a malformed welcome");
    else if (c->welcome.version != ESCROW_PROTOCOL_VERSION)
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL,
                          "the holder answered version %lld to a hello of %d",
                          (long long)c->welcome.version, ESCROW_PROTOCOL_VERSION);
    escrow__frame_free(&f);
    if (rc != ESCROW_OK) escrow__conn_close(c);
    return rc;
}

/* ---- the timeout invariant (PROTOCOL.md section 12.1) ----------------------------------- */

/* Before a retrieve is sent on `c`: never start one we would give up on while the holder is
 * still legitimately stopping the drain and sending. The timeout must exceed the welcome's
 * drain_stop_budget + send_deadline (else ESCROW_CONFIG), and so must the time left before
 * `deadline` (else ESCROW_UNRESPONSIVE). */
escrow_code escrow__check_retrieve_time(const conn *c, double deadline, const char *id,
                                        escrow_error *err) {
    double needs = c->welcome.drain_stop_budget + c->welcome.send_deadline;
    if (c->client->timeout <= needs)
        return escrow__fail(err, ESCROW_CONFIG, 0, id,
                            "client timeout %.3gs must exceed the holder's drain_stop_budget + "
                            "send_deadline = %.3gs; raise the timeout", c->client->timeout,
                            needs);
    if (deadline - escrow__now() <= needs)
        return escrow__fail(err, ESCROW_UNRESPONSIVE, 0, id,
                            "not enough time left to retrieve %s", id);
    return ESCROW_OK;
}
