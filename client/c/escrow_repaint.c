/* escrow_repaint.c: make the full-screen program on a retrieved terminal draw its screen
 * again (PROTOCOL.md 12.5), as the reference client's repaint does (client/repaint.py).
 *
 * A relaunched app has a blank screen (plus the replay), while vim, less, top or a shell
 * prompt drew theirs before the crash and will not draw it again on their own. A resize is
 * the request they all answer: they redraw on SIGWINCH. The kernel sends SIGWINCH to the
 * terminal's foreground process group only when TIOCSWINSZ changes the size, so the window
 * is made one row smaller and then given its size back.
 *
 * When the size goes back matters. A program answers the shrink with a redraw that it
 * writes just before it waits for input again (less flushes, then reads; vim checks for a
 * pending resize, then flushes and selects). A SIGWINCH that lands in between is noted and
 * not acted on until the next key, and the program stays drawn a row short. So the size goes
 * back only once the program's output has stopped for 50 ms: by then it is waiting, and the
 * second signal wakes it. With no answer in 0.5 s (a program that ignores SIGWINCH) the size
 * goes back anyway, and 1 s is the bound in all (a program that keeps writing).
 *
 * The output is watched, never read: the caller reads it afterwards, so nothing is lost. It
 * is counted with FIONREAD on the master (Linux counts up to 4 KiB). Where FIONREAD on a
 * master does not count, the count stays put and the whole 0.5 s is waited, which costs time
 * but still lets the program see the change.
 *
 * The fds: none opened, none closed; `fd` is the caller's.
 */
#include "escrow_internal.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>

#define REPAINT_WAIT 0.5   /* vim, less, top and bash answered a resize within 10 ms */
#define REPAINT_QUIET 0.05
#define REPAINT_LIMIT 1.0
#define REPAINT_POLL_MS 2

/* How many bytes the program wrote that nobody has read from `fd` yet. */
static int unread(int fd, int *count) {
    int n = 0;
    if (ioctl(fd, FIONREAD, &n) != 0) return -1;
    *count = n;
    return 0;
}

/* Return once the program has answered and gone quiet, or the bounds say stop. */
static void wait_for_answer(int fd, int count) {
    double started = escrow__now(), changed_at = -1; /* -1: no answer yet */
    for (;;) {
        double now = escrow__now();
        int c = count;
        if (unread(fd, &c) == 0 && c != count) count = c, changed_at = now;
        if (now - started >= REPAINT_LIMIT) return;
        if (changed_at < 0 ? now - started >= REPAINT_WAIT : now - changed_at >= REPAINT_QUIET)
            return;
        poll(NULL, 0, REPAINT_POLL_MS);
    }
}

/* ---- repaint (PROTOCOL.md 12.5) --------------------------------------------------------- */

escrow_code escrow_repaint(int fd, escrow_error *err) {
    struct winsize size, other;
    int count = 0;
    if (ioctl(fd, TIOCGWINSZ, &size) != 0 || unread(fd, &count) != 0)
        return escrow__fail(err, ESCROW_SYSTEM, errno, NULL, "repaint: %s", strerror(errno));
    /* Shrink rather than grow, so nothing is drawn beyond the real screen meanwhile; an
     * unset size (0 rows) cannot shrink, and a program at 0 rows may draw for 24: grow it.
     * Not killpg(tcgetpgrp(fd), SIGWINCH): bash redraws its prompt only when the size it
     * reads differs from the one it knew, and a resize signals whatever group is in the
     * foreground at that moment, one we may not signal ourselves (su, sudo) included. */
    other = size;
    other.ws_row = (unsigned short)(size.ws_row > 1 ? size.ws_row - 1 : size.ws_row + 1);
    if (ioctl(fd, TIOCSWINSZ, &other) != 0)
        return escrow__fail(err, ESCROW_SYSTEM, errno, NULL, "repaint: %s", strerror(errno));
    wait_for_answer(fd, count);
    if (ioctl(fd, TIOCSWINSZ, &size) != 0) /* the window is left a row off: say so */
        return escrow__fail(err, ESCROW_SYSTEM, errno, NULL,
                            "repaint: the size could not be set back: %s", strerror(errno));
    return ESCROW_OK;
}
