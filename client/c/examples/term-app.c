/* term-app: a terminal app as small as can be, over the C client, whose shells outlive it.
 *
 *   term-app --socket PATH --owner OWNER --out DIR [--new ID]... [--timeout S]
 *
 * What every app that keeps its sessions in escrow does (PROTOCOL.md 10.2, 10.4, 10.6, 16):
 * at launch it opens one custody for its lifetime and reclaims into it, with a journal,
 * every session the last instance left; it shows each replay, repaints, and reads on. A
 * session it starts it deposits into the same custody. It reads every terminal through the
 * custody (escrow_custody_read), so that the journal has every byte it showed and the next
 * instance's replay starts at the session's first line. When the holder goes away, the
 * custody's fd says so; the app retries escrow_custody_resume until it is protected again.
 *
 * Its "screen" is a file: DIR/<id>.<pid>.out is what this run showed of the session (the
 * replay, then every byte read). DIR/events says what happened, a JSON line each, written
 * with one write(2) on an O_APPEND fd, so that a SIGKILL never leaves half a line.
 * SIGTERM ends custody (the holder drains the sessions until the next launch), says so in
 * a `closed` event with escrow_custody_close's code, and exits 0 once that end is confirmed
 * and no fd is left open (1: not confirmed, 98: an fd left open); a SIGKILL is a crash,
 * which the holder survives.
 *
 * Built by tests/test_c_app.py against the C client's files, and run through the scenarios
 * of tests/app_scenarios.py.
 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* O_CLOEXEC, pipe2 */
#endif

#include "../escrow.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>
#ifdef __APPLE__
#include <util.h>
#else
#include <pty.h>
#endif

#define MAX_SESSIONS 16
#define LOOP "i=0; while :; do i=$((i+1)); echo L$i; sleep 0.02; done"

typedef struct session {
    char id[ESCROW_NAME_MAX + 1];
    int master;  /* the app's own fd of the terminal: it polls it, and closes it at exit */
    int screen;  /* DIR/<id>.<pid>.out */
    int ended;   /* the terminal hung up: not read again */
} session;

typedef struct app {
    const char *dir;
    int events;
    session sessions[MAX_SESSIONS];
    size_t n;
} app;

/* The self-pipe: SIGTERM wakes the poll loop, with no race between a check and poll. */
static int term_pipe[2] = {-1, -1};

static void on_term(int signum) {
    (void)signum;
    int saved = errno;
    (void)!write(term_pipe[1], "t", 1);
    errno = saved;
}

static void event(app *a, const char *fmt, ...) {
    char line[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof line - 1) return;
    line[n] = '\n';
    (void)!write(a->events, line, (size_t)n + 1); /* one write: the line whole or not at all */
}

static int open_append(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
}

static session *add_session(app *a, const char *id, int master) {
    if (a->n == MAX_SESSIONS) return NULL;
    session *s = &a->sessions[a->n++];
    snprintf(s->id, sizeof s->id, "%s", id);
    s->master = master;
    s->ended = 0;
    char name[ESCROW_NAME_MAX + 32];
    snprintf(name, sizeof name, "%s.%ld.out", id, (long)getpid());
    s->screen = open_append(a->dir, name);
    return s;
}

static void show(session *s, const void *data, size_t len) {
    const char *p = data;
    while (len > 0) {
        ssize_t n = write(s->screen, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        p += n, len -= (size_t)n;
    }
}

/* A shell on a new 80x24 terminal, with echo off (its only output is its own), as the
 * session leader with the terminal as its controlling tty: a hang-up reaches it. */
static int start_shell(int *master, pid_t *child) {
    struct winsize ws = {.ws_row = 24, .ws_col = 80};
    int slave;
    if (openpty(master, &slave, NULL, NULL, &ws) != 0) return -1;
    struct termios t;
    if (tcgetattr(slave, &t) == 0) {
        t.c_lflag &= ~(tcflag_t)ECHO;
        tcsetattr(slave, TCSANOW, &t);
    }
    fcntl(*master, F_SETFD, FD_CLOEXEC); /* no other shell inherits this terminal */
    const char *cmd = getenv("TERM_APP_CMD");
    *child = fork();
    if (*child == 0) {
        /* Everything else the app holds (the custody's socket and duplicates, the screens,
         * the other masters) is close-on-exec. */
        setsid();
        ioctl(slave, TIOCSCTTY, 0);
        dup2(slave, 0), dup2(slave, 1), dup2(slave, 2);
        if (slave > 2) close(slave);
        signal(SIGCHLD, SIG_DFL); /* an ignored signal stays ignored across exec */
        execl("/bin/sh", "sh", "-c", cmd != NULL ? cmd : LOOP, (char *)NULL);
        _exit(127);
    }
    close(slave);
    if (*child < 0) {
        close(*master);
        return -1;
    }
    return 0;
}

static void json_ids(char *buf, size_t size, const escrow_reclaim_report *r) {
    size_t at = (size_t)snprintf(buf, size, "[");
    for (size_t i = 0; i < r->n_retrieved && at < size; i++)
        at += (size_t)snprintf(buf + at, size - at, "%s\"%s\"", i ? ", " : "",
                               r->retrieved[i].session.id);
    if (at < size) snprintf(buf + at, size - at, "]");
}

static void json_failed(char *buf, size_t size, const escrow_reclaim_report *r) {
    size_t at = (size_t)snprintf(buf, size, "{");
    for (size_t i = 0; i < r->n_failed && at < size; i++)
        at += (size_t)snprintf(buf + at, size - at, "%s\"%s\": \"%s\"", i ? ", " : "",
                               r->failed[i].id, r->failed[i].error.code_name);
    if (at < size) snprintf(buf + at, size - at, "}");
}

static void json_count(char *buf, size_t size, int64_t v) {
    if (v < 0) snprintf(buf, size, "null"); /* unknown: the holder lost its count */
    else snprintf(buf, size, "%lld", (long long)v);
}

/* At launch: everything the last instance left comes back into this custody, still
 * escrowed (a crash right after loses nothing), each shown from its replay. */
static void reclaim(app *a, escrow_custody *cu) {
    escrow_reclaim_report r;
    escrow_error err;
    memset(&r, 0, sizeof r);
    escrow_code rc = escrow_custody_reclaim_all(cu, 1, 8.0, &r, &err);
    char ids[4096], failed[4096], restarts[24], unclean[24];
    json_ids(ids, sizeof ids, &r);
    json_failed(failed, sizeof failed, &r);
    json_count(restarts, sizeof restarts, r.restarts);
    json_count(unclean, sizeof unclean, r.unclean_restarts);
    event(a, "{\"event\": \"reclaimed\", \"instance\": \"%s\", \"adopted\": %lld, "
             "\"restarts\": %s, \"unclean_restarts\": %s, \"retrieved\": %s, \"failed\": %s%s%s%s}",
          r.holder_instance, (long long)r.adopted, restarts, unclean, ids, failed,
          rc == ESCROW_OK ? "" : ", \"error\": \"", rc == ESCROW_OK ? "" : err.code_name,
          rc == ESCROW_OK ? "" : "\"");
    for (size_t i = 0; i < r.n_retrieved; i++) {
        escrow_retrieved *got = &r.retrieved[i];
        session *s = add_session(a, got->session.id, got->fd);
        if (s == NULL) {
            close(got->fd); /* (no room: the custody's duplicate keeps it escrowed) */
            continue;
        }
        show(s, got->replay, got->replay_len);
        escrow_repaint(got->fd, NULL); /* a full-screen program draws itself again */
    }
    escrow_reclaim_report_free(&r);
}

static int reclaimed(const app *a, const char *id) {
    for (size_t i = 0; i < a->n; i++)
        if (strcmp(a->sessions[i].id, id) == 0) return 1;
    return 0;
}

static void create(app *a, escrow_custody *cu, const char *id) {
    int master;
    pid_t child;
    if (start_shell(&master, &child) != 0) {
        event(a, "{\"event\": \"error\", \"id\": \"%s\", \"message\": \"openpty or fork\"}", id);
        return;
    }
    escrow_deposit_opts opts = {.label = "sh", .child_pid = child, .cols = 80, .rows = 24,
                                .journal = 1};
    escrow_error err;
    escrow_code rc = escrow_deposit(cu, id, master, &opts, &err);
    /* Escrowed, or kept in doubt and settled by the next resume: the custody says which
     * (a deposit refused, busy with nothing kept, is no terminal of ours to show). */
    if (rc != ESCROW_OK)
        event(a, "{\"event\": \"error\", \"id\": \"%s\", \"code\": \"%s\"}", id, err.code_name);
    if (!escrow_custody_holds(cu, id)) {
        kill(child, SIGKILL); /* not escrowed, not ours to show: no terminal at all */
        close(master);
        waitpid(child, NULL, 0);
        return;
    }
    add_session(a, id, master);
    event(a, "{\"event\": \"created\", \"id\": \"%s\", \"child_pid\": %ld, \"journal\": %s}",
          id, (long)child, escrow_custody_journaled(cu, id) ? "true" : "false");
}

/* Read what is there, through the custody: the journal records it before it is shown. */
static void read_session(app *a, escrow_custody *cu, session *s) {
    unsigned char buf[65536];
    long n = escrow_custody_read(cu, s->id, buf, sizeof buf);
    if (n > 0) {
        show(s, buf, (size_t)n);
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        s->ended = 1; /* EIO: the terminal hung up */
        event(a, "{\"event\": \"ended\", \"id\": \"%s\"}", s->id);
    }
}

static long long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void run(app *a, escrow_custody *cu) {
    int lapsed = 0;
    long long resume_at = 0; /* while lapsed: when to try escrow_custody_resume next */
    for (;;) {
        if (!lapsed && !escrow_custody_protected(cu)) {
            lapsed = 1;
            resume_at = now_ms() + escrow_custody_retry_ms(cu);
            event(a, "{\"event\": \"lapsed\"}");
        }
        /* The terminals keep the loop busy: the resume is due by the clock, not when poll
         * finds nothing to read. */
        if (lapsed && now_ms() >= resume_at) {
            escrow_error err;
            if (escrow_custody_resume(cu, &err) == ESCROW_OK) {
                lapsed = 0;
                event(a, "{\"event\": \"protected\"}");
            } else {
                resume_at = now_ms() + escrow_custody_retry_ms(cu);
            }
        }
        struct pollfd fds[MAX_SESSIONS + 2];
        session *of[MAX_SESSIONS];
        nfds_t n = 0;
        fds[n++] = (struct pollfd){.fd = term_pipe[0], .events = POLLIN};
        int custody_fd = escrow_custody_fd(cu);
        if (!lapsed) fds[n++] = (struct pollfd){.fd = custody_fd, .events = POLLIN};
        nfds_t first_session = n;
        for (size_t i = 0; i < a->n; i++) {
            if (a->sessions[i].ended) continue;
            of[n - first_session] = &a->sessions[i];
            fds[n++] = (struct pollfd){.fd = a->sessions[i].master, .events = POLLIN};
        }
        long long wait = lapsed ? resume_at - now_ms() : -1;
        int ready = poll(fds, n, lapsed ? (wait > 0 ? (int)wait : 0) : -1);
        if (ready < 0 && errno != EINTR) return;
        if (ready <= 0) continue;
        if (fds[0].revents != 0) return; /* SIGTERM */
        if (!lapsed && fds[1].revents != 0) {
            escrow_error err;
            escrow_custody_check(cu, &err); /* the holder went away: not protected now */
        }
        for (nfds_t i = first_session; i < n; i++)
            if (fds[i].revents != 0) read_session(a, cu, of[i - first_session]);
    }
}

/* As escrow-c.c does: whatever paths the client took, nothing is left open. */
static int fds_left(void) {
    int leaked = 0;
    for (int fd = 3; fd < 1024; fd++) {
        if (fcntl(fd, F_GETFD) == -1) continue;
        fprintf(stderr, "%s%d", leaked++ == 0 ? "{\"leaked_fds\": [" : ", ", fd);
    }
    if (leaked > 0) fputs("]}\n", stderr);
    return leaked;
}

int main(int argc, char **argv) {
    const char *socket_path = NULL, *owner = NULL, *news[MAX_SESSIONS];
    size_t n_new = 0;
    double timeout = ESCROW_DEFAULT_TIMEOUT;
    app a = {.dir = NULL, .events = -1, .n = 0};
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--socket") == 0) socket_path = argv[i + 1];
        else if (strcmp(argv[i], "--owner") == 0) owner = argv[i + 1];
        else if (strcmp(argv[i], "--out") == 0) a.dir = argv[i + 1];
        else if (strcmp(argv[i], "--timeout") == 0) timeout = atof(argv[i + 1]);
        else if (strcmp(argv[i], "--new") == 0 && n_new < MAX_SESSIONS) news[n_new++] = argv[i + 1];
        else return 2;
    }
    if (socket_path == NULL || owner == NULL || a.dir == NULL) {
        fputs("usage: term-app --socket PATH --owner OWNER --out DIR [--new ID]... "
              "[--timeout S]\n", stderr);
        return 2;
    }
    if ((a.events = open_append(a.dir, "events")) < 0) return 1;
    if (pipe(term_pipe) != 0) return 1;
    fcntl(term_pipe[0], F_SETFD, FD_CLOEXEC), fcntl(term_pipe[1], F_SETFD, FD_CLOEXEC);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGCHLD, SIG_IGN); /* the shells are reaped, whoever ends first */
    event(&a, "{\"event\": \"started\", \"pid\": %ld}", (long)getpid());

    escrow_client c;
    escrow_custody cu;
    escrow_error err;
    if (escrow_client_init(&c, owner, socket_path, timeout, &err) != ESCROW_OK ||
        escrow_custody_open(&c, &cu, &err) != ESCROW_OK) {
        event(&a, "{\"event\": \"error\", \"code\": \"%s\"}", err.code_name);
        return 1;
    }
    reclaim(&a, &cu);
    for (size_t i = 0; i < n_new; i++)
        if (!reclaimed(&a, news[i])) create(&a, &cu, news[i]);
    run(&a, &cu);

    /* The holder drains every session until the next launch; not confirmed (a custody that
     * lapsed and found no holder to end it on): they may be held by nobody, and the exit
     * status says so to whoever stops the app. */
    escrow_code closed = escrow_custody_close(&cu);
    event(&a, "{\"event\": \"closed\", \"code\": \"%s\"}", escrow_code_name(closed));
    for (size_t i = 0; i < a.n; i++) close(a.sessions[i].master), close(a.sessions[i].screen);
    close(a.events), close(term_pipe[0]), close(term_pipe[1]);
    if (fds_left() != 0) return 98;
    return closed == ESCROW_OK ? 0 : 1;
}
