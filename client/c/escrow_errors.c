/* escrow_errors.c: what every call returns, and the deadline every call keeps.
 *
 * Every call of the API returns an escrow_code and, given an escrow_error, fills it: the
 * code's name (the holder's, PROTOCOL.md section 9, or the client's own: unavailable,
 * unresponsive, config, protocol, system), a message for people, the session id, the errno.
 *
 * Every call has one deadline, `timeout` seconds from its start (section 12.1: one deadline
 * covering every step). Sockets are non-blocking, and every wait is a poll bounded by the
 * time left (section 1.5), so no call blocks past it. A read or write that fails is the
 * holder being unresponsive once the deadline has passed, and gone before it.
 *
 * This file opens no fd.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* ---- the codes (PROTOCOL.md section 9) -------------------------------------------------- */

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

escrow_code escrow__code_from_name(const char *name) {
    for (int i = ESCROW_BAD_REQUEST; i <= ESCROW_ACK_LATE; i++)
        if (strcmp(code_names[i], name) == 0) return (escrow_code)i;
    return ESCROW_OTHER;
}

/* Fill `err` (when there is one) and return `code`. */
escrow_code escrow__fail(escrow_error *err, escrow_code code, int sys_errno, const char *id,
                         const char *fmt, ...) {
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

/* ---- deadlines (PROTOCOL.md sections 1.5 and 12.1) -------------------------------------- */

double escrow__now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Milliseconds to `deadline`, rounded up so a poll never wakes just short of it; 0 if passed. */
int escrow__ms_left(double deadline) {
    double left = deadline - escrow__now();
    if (left <= 0) return 0;
    if (left > 1e6) left = 1e6;
    return (int)(left * 1000.0) + 1;
}

/* Wait until `sock` is ready for `events`; -1 with errno ETIMEDOUT once the deadline passed. */
int escrow__wait_io(int sock, short events, double deadline) {
    for (;;) {
        int ms = escrow__ms_left(deadline);
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
escrow_code escrow__io_failed(escrow_error *err, int e, const char *what) {
    if (e == ETIMEDOUT)
        return escrow__fail(err, ESCROW_UNRESPONSIVE, e, NULL, "the holder %s in time", what);
    return escrow__fail(err, ESCROW_UNAVAILABLE, e, NULL,
                        "the holder closed the connection (%s)", strerror(e));
}
