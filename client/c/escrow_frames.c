/* escrow_frames.c: frames on the socket, and the fds that ride on them.
 *
 * A frame is a u32 big-endian length and that many bytes of body (PROTOCOL.md section 2). A
 * send puts the fd of a deposit on the sendmsg that carries the frame's first byte (section
 * 4.1), and when the holder has hung up (EPIPE, ECONNRESET) reads the error it sent first
 * (section 1.4). A receive reads exactly the 4 bytes of the length, then exactly the body,
 * never more, or bytes and fds of the next frame would come with this one (section 4.2);
 * then it checks what arrived (section 4.3): no MSG_CTRUNC, a body that is a message, and
 * exactly the fds that message comes with.
 *
 * The fds: every fd a recvmsg installs is the frame's at once (`frame.fds`; any beyond
 * MAX_FDS_SEEN are closed as they arrive, and counted), close-on-exec from birth on Linux
 * (MSG_CMSG_CLOEXEC) and right after on macOS. A frame that fails its checks has closed them
 * all before escrow__recv_frame returns; a good one holds them until escrow__frame_free, or
 * until its caller takes one out. A send never closes the fd it sends: it is the caller's.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_RESPONSE_BYTES (256u << 20) /* a handoff carries a whole ring; 4 GiB never */

/* ---- receiving (PROTOCOL.md sections 2, 4.2 and 4.3) ------------------------------------ */

/* Close every fd the frame still holds, and free its body. */
void escrow__frame_free(frame *f) {
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
                if (escrow__wait_io(sock, POLLIN, deadline) != 0)
                    return escrow__io_failed(err, errno, "did not answer");
                continue;
            }
            return escrow__io_failed(err, errno, "did not answer");
        }
        take_fds(&msg, f);
        if (msg.msg_flags & MSG_CTRUNC) *truncated = 1; /* read on: the stream stays in step */
        if (r == 0) {
            if (at_start && got == 0 && f->nfds == 0 && !*truncated)
                return escrow__fail(err, ESCROW_UNAVAILABLE, 0, NULL,
                                    "the holder closed the connection");
            return escrow__fail(err, ESCROW_PROTOCOL, 0, NULL,
                                "the holder closed the connection in the middle of a frame");
        }
        got += (size_t)r;
    }
    return ESCROW_OK;
}

/* One whole frame, checked: a sane length, no MSG_CTRUNC, a body that is a message, and
 * exactly the fds the message carries (section 4's table: it depends on `journal` in a
 * handoff or a deposited). On any failure every fd that came with it is closed. */
escrow_code escrow__recv_frame(int sock, double deadline, frame *f, escrow_error *err) {
    unsigned char header[4];
    int truncated = 0;
    memset(f, 0, sizeof *f);
    escrow_code rc = read_exactly(sock, header, 4, f, &truncated, 1, deadline, err);
    if (rc == ESCROW_OK) {
        uint32_t len = (uint32_t)header[0] << 24 | (uint32_t)header[1] << 16 |
                       (uint32_t)header[2] << 8 | header[3];
        if (len == 0 || len > MAX_RESPONSE_BYTES)
            rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL, "a frame length of %lu bytes",
                              (unsigned long)len);
        else if ((f->body = malloc(len)) == NULL)
            rc = escrow__fail(err, ESCROW_SYSTEM, ENOMEM, NULL,
                              "no memory for a %lu-byte frame", (unsigned long)len);
        else
            f->len = len, rc = read_exactly(sock, f->body, len, f, &truncated, 0, deadline, err);
    }
    if (rc == ESCROW_OK && truncated)
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL, "ancillary data was cut (MSG_CTRUNC)");
    if (rc == ESCROW_OK && escrow__frame_type(f->body, f->len, f->type) != 0)
        rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL,
                          "the holder sent a frame that is not a message");
    if (rc == ESCROW_OK) {
        size_t wanted = escrow__fds_carried(f);
        if (f->nfds != wanted)
            rc = escrow__fail(err, ESCROW_PROTOCOL, 0, NULL,
                              "a %s frame came with %zu fds, not %zu", f->type, f->nfds, wanted);
    }
    if (rc != ESCROW_OK) escrow__frame_free(f);
    return rc;
}

/* ---- sending (PROTOCOL.md sections 2, 4.1 and 1.4) -------------------------------------- */

/* Send one whole frame; `fd` (if >= 0) rides on the sendmsg that carries its first byte. */
escrow_code escrow__send_frame(int sock, const unsigned char *data, size_t len, int fd,
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
            if (escrow__wait_io(sock, POLLOUT, deadline) != 0)
                return escrow__io_failed(err, errno, "did not take a request");
            continue;
        }
        if (e == EPIPE || e == ECONNRESET) {
            /* A holder that refuses us says why first, then hangs up: read what it said. */
            frame said;
            if (escrow__recv_frame(sock, deadline, &said, NULL) == ESCROW_OK) {
                escrow_code rc = strcmp(said.type, "error") == 0
                                     ? escrow__decode_error(&said, err)
                                     : ESCROW_UNAVAILABLE;
                escrow__frame_free(&said);
                if (rc != ESCROW_UNAVAILABLE) return rc;
            }
        }
        return escrow__io_failed(err, e, "did not take a request");
    }
    return ESCROW_OK;
}
