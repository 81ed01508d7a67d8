/* escrow-c: a small command-line driver for the C client, run by the test suite.
 *
 * It links the library's objects as an app does, and includes escrow_internal.h only so that
 * `encode` and `decode` can reach the codec (every encoder and decoder is in every build of
 * the library, retrieve_many's, ack_many's and done_many's too) to check it against the
 * protocol's test vectors; every other command goes through escrow.h exactly as an app would.
 *
 * Output: JSON on stdout for what was asked (the terminal's raw bytes for `app` and
 * `retrieve`), and JSON lines on stderr: an error ({"type": "error", "code": ...}, with the
 * escrow_code as exit status), or the facts of a retrieve. Exit status 2 is a usage error, 98
 * an fd left open at exit (a leak: printed as {"leaked_fds": [...]}), 99 the terminal failing
 * to give the output asked for.
 */
#include "escrow_internal.h"
#include "vector_args.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static const char usage[] =
    "usage: escrow-c [--socket PATH] [--owner OWNER] [--timeout SECONDS] COMMAND [ARG...]\n"
    "  welcome | status | list [--all] | release ID\n"
    "  update ID COLS ROWS [META...]  COLS, ROWS: a number or - (unchanged); META: none\n"
    "                            (unchanged), {} (empty) or KEY=VALUE...\n"
    "  hand-off ID FD [PID]      deposit the inherited FD and end custody at once\n"
    "  app ID FD PID UNTIL       deposit FD under custody, copy its output to stdout until\n"
    "                            UNTIL has appeared, then end custody\n"
    "  custody-app ID FD PID JOURNAL [fork]\n"
    "                            deposit FD (with a journal if JOURNAL is 1), read it with\n"
    "                            escrow_custody_read to stdout, take custody back whenever\n"
    "                            the holder goes away, until stdin ends; events on stderr.\n"
    "                            fork: a forked child drops the custody and reports its fds\n"
    "  retrieve ID [LINES]       retrieve; write the replay to stdout, then live output\n"
    "                            until LINES more newlines (default 0)\n"
    "  reclaim [--keep] [--journal] [--deadline S] [--hold | --read]\n"
    "                            reclaim every session (--keep: into a custody); the report\n"
    "                            on stderr; --hold: keep custody until stdin closes; --read:\n"
    "                            that too, reading each session with escrow_custody_read\n"
    "                            (its journal records it) to stdout meanwhile\n"
    "  custody-retrieve ID [--journal] [--hold]\n"
    "                            retrieve one session into a custody; the facts on stderr\n"
    "  custody-script            one custody, driven by the lines of stdin (deposit ID FD\n"
    "                            [JOURNAL], release ID, update ID COLS ROWS, check, resume,\n"
    "                            retrieve ID [JOURNAL], record ID TEXT|@N, read ID, holds ID,\n"
    "                            stop-in-write, nofile N|off, close); a JSON line on stdout\n"
    "                            each\n"
    "  repaint FD                make the program on the inherited master FD redraw\n"
    "  cmsg                      the control messages that carry fd 7, and fds 7 and 9,\n"
    "                            and the constants\n"
    "  encode TYPE ARG...        a request frame from the C encoder, in hex (BOOL: true\n"
    "                            or false):\n"
    "      hello OWNER CLIENT TIMEOUT | list BOOL | status | release ID\n"
    "      deposit ID LABEL PID COLS ROWS JOURNAL [KEY=VALUE...]\n"
    "      retrieve ID KEEP JOURNAL REPLAY_FILE | retrieve_many KEEP JOURNAL REPLAY_FILE ID...\n"
    "      ack ID HANDOFF_ID KEEP | ack_many KEEP ID=HANDOFF_ID...\n"
    "      update ID COLS ROWS [META...]   (as the update command)\n"
    "  decode HEX                a holder's frame decoded by the C decoder, as JSON; on\n"
    "                            stderr the fds it must come with: {\"fds\": N}\n";

/* ---- JSON out ---------------------------------------------------------------------------- */

static void json_str(FILE *out, const char *s) {
    fputc('"', out);
    for (; *s != 0; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(out, "\\%c", c);
        else if (c < 0x20) fprintf(out, "\\u%04x", c);
        else fputc(c, out);
    }
    fputc('"', out);
}

static void json_float(FILE *out, double d) {
    char buf[64];
    snprintf(buf, sizeof buf, "%.17g", d);
    fputs(buf, out);
    if (strpbrk(buf, ".eEni") == NULL) fputs(".0", out); /* a float stays a float */
}

static void json_opt_int(FILE *out, int64_t v) {
    if (v < 0) fputs("null", out);
    else fprintf(out, "%lld", (long long)v);
}

static void json_ints(FILE *out, const escrow_ints *m) {
    fputc('{', out);
    for (size_t i = 0; i < m->count; i++) {
        if (i > 0) fputs(", ", out);
        json_str(out, m->entries[i].key);
        fprintf(out, ": %lld", (long long)m->entries[i].value);
    }
    fputc('}', out);
}

static void json_hex(FILE *out, const unsigned char *b, size_t n) {
    fputs("{\"bin\": \"", out);
    for (size_t i = 0; i < n; i++) fprintf(out, "%02x", b[i]);
    fputs("\"}", out);
}

static void json_session(FILE *out, const escrow_session *s) {
    fputs("{\"owner\": ", out), json_str(out, s->owner);
    fputs(", \"id\": ", out), json_str(out, s->id);
    fputs(", \"label\": ", out), json_str(out, s->label);
    fputs(", \"state\": ", out), json_str(out, s->state);
    fputs(", \"child_pid\": ", out), json_opt_int(out, s->child_pid);
    fprintf(out, ", \"child_alive\": %s",
            s->child_alive < 0 ? "null" : s->child_alive ? "true" : "false");
    fputs(", \"deposited_at\": ", out), json_float(out, s->deposited_at);
    fputs(", \"state_since\": ", out), json_float(out, s->state_since);
    fprintf(out, ", \"buffered_bytes\": %lld, \"dropped_bytes\": %lld",
            (long long)s->buffered_bytes, (long long)s->dropped_bytes);
    fputs(", \"custodian_pid\": ", out), json_opt_int(out, s->custodian_pid);
    fputs(", \"handoff_id\": ", out);
    if (s->handoff_id[0] != 0) json_str(out, s->handoff_id);
    else fputs("null", out);
    fprintf(out, ", \"cols\": %lld, \"rows\": %lld, \"meta\": {", (long long)s->cols,
            (long long)s->rows);
    for (size_t i = 0; i < s->meta_count; i++) {
        if (i > 0) fputs(", ", out);
        json_str(out, s->meta[i].key), fputs(": ", out), json_str(out, s->meta[i].value);
    }
    fputs("}, \"replay_gap_at\": ", out), json_opt_int(out, s->replay_gap_at);
    fputs(", \"replay_gaps\": [", out);
    for (size_t i = 0; i < s->n_replay_gaps; i++)
        fprintf(out, "%s%lld", i > 0 ? ", " : "", (long long)s->replay_gaps[i]);
    fputs("]}", out);
}

static void json_welcome(FILE *out, const escrow_welcome *w) {
    fprintf(out, "{\"type\": \"welcome\", \"version\": %lld, \"holder_version\": ",
            (long long)w->version);
    json_str(out, w->holder_version);
    fprintf(out, ", \"pid\": %lld, \"drain_stop_budget\": ", (long long)w->pid);
    json_float(out, w->drain_stop_budget);
    fputs(", \"send_deadline\": ", out), json_float(out, w->send_deadline);
    fputs(", \"ack_deadline\": ", out), json_float(out, w->ack_deadline);
    fputs(", \"limits\": ", out), json_ints(out, &w->limits);
    fputs(", \"features\": [", out);
    for (size_t i = 0; i < w->n_features; i++)
        fputs(i > 0 ? ", " : "", out), json_str(out, w->features[i]);
    fputs("]}\n", out);
}

static void json_status(FILE *out, const escrow_status *s) {
    fprintf(out, "{\"type\": \"holder_status\", \"pid\": %lld, \"version\": ", (long long)s->pid);
    json_str(out, s->version);
    fputs(", \"started_at\": ", out), json_float(out, s->started_at);
    fputs(", \"socket\": ", out), json_str(out, s->socket);
    fputs(", \"sessions_by_state\": ", out), json_ints(out, &s->sessions_by_state);
    fputs(", \"counters\": ", out), json_ints(out, &s->counters);
    fputs(", \"limits\": ", out), json_ints(out, &s->limits);
    fputs(", \"open_fds\": ", out), json_opt_int(out, s->open_fds);
    fputs(", \"rss_bytes\": ", out), json_opt_int(out, s->rss_bytes);
    fputs(", \"instance\": ", out), json_str(out, s->instance);
    fputs(", \"fd_store\": ", out), json_str(out, s->fd_store);
    fputs(", \"keeper_pid\": ", out), json_opt_int(out, s->keeper_pid);
    fprintf(out, ", \"adopted\": %lld, \"restarts\": ", (long long)s->adopted);
    json_opt_int(out, s->restarts);
    fputs(", \"unclean_restarts\": ", out), json_opt_int(out, s->unclean_restarts);
    fprintf(out, ", \"adopted_without_record\": %lld, \"adopted_renamed\": %lld}\n",
            (long long)s->adopted_without_record, (long long)s->adopted_renamed);
}

static void json_sessions(FILE *out, const escrow_session *s, size_t n) {
    fputs("{\"type\": \"sessions\", \"sessions\": [", out);
    for (size_t i = 0; i < n; i++) {
        if (i > 0) fputs(", ", out);
        json_session(out, &s[i]);
    }
    fputs("]}\n", out);
}

static void json_error(FILE *out, const escrow_error *e) {
    fputs("{\"type\": \"error\", \"code\": ", out), json_str(out, e->code_name);
    fputs(", \"message\": ", out), json_str(out, e->message);
    fputs(", \"id\": ", out);
    if (e->id[0] != 0) json_str(out, e->id);
    else fputs("null", out);
    fputs(", \"versions\": ", out);
    if (e->n_versions == 0) fputs("null", out);
    for (size_t i = 0; i < e->n_versions; i++)
        fprintf(out, "%s%lld%s", i == 0 ? "[" : ", ", (long long)e->versions[i],
                i + 1 == e->n_versions ? "]" : "");
    fprintf(out, ", \"escrow_code\": %d, \"sys_errno\": %d}\n", (int)e->code, e->sys_errno);
}

static int failed(escrow_code rc, const escrow_error *e) {
    json_error(stderr, e);
    return (int)rc;
}

/* ---- the terminal's bytes ------------------------------------------------------------------ */

/* Copy what `fd` says to stdout until `stop(seen so far)` holds; 10 s at most. */
static int copy_until(int fd, int (*stop)(const char *, size_t, const void *), const void *arg,
                      char **seen, size_t *len) {
    double deadline = escrow__now() + 10.0;
    while (!stop(*seen, *len, arg)) {
        struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
        int ms = escrow__ms_left(deadline);
        if (ms == 0 || poll(&p, 1, ms) < 0) return -1;
        if (p.revents == 0) continue;
        char buf[4096];
        ssize_t n = read(fd, buf, sizeof buf);
        if (n <= 0) return -1; /* EIO: the terminal hung up */
        char *grown = realloc(*seen, *len + (size_t)n + 1);
        if (grown == NULL) return -1;
        *seen = grown;
        memcpy(*seen + *len, buf, (size_t)n);
        *len += (size_t)n;
        (*seen)[*len] = 0;
        fwrite(buf, 1, (size_t)n, stdout);
        fflush(stdout);
    }
    return 0;
}

static int has_text(const char *seen, size_t len, const void *text) {
    size_t t = strlen(text);
    for (size_t i = 0; i + t <= len; i++)
        if (memcmp(seen + i, text, t) == 0) return 1;
    return 0;
}

static int has_newlines(const char *seen, size_t len, const void *count) {
    size_t lines = 0;
    for (size_t i = 0; i < len; i++) lines += seen[i] == '\n';
    return lines >= *(const size_t *)count;
}

/* ---- commands ------------------------------------------------------------------------------- */

static escrow_deposit_opts opts_for(int argc, char **argv, int pid_at) {
    escrow_deposit_opts o = {"sh", 0, 80, 24, NULL, 0, 0};
    if (argc > pid_at) o.child_pid = atoll(argv[pid_at]);
    return o;
}

static int cmd_app(const escrow_client *c, char **argv) {
    escrow_custody cu;
    escrow_error err;
    escrow_deposit_opts opts = opts_for(4, argv, 2);
    int fd = atoi(argv[1]);
    escrow_code rc = escrow_custody_open(c, &cu, &err);
    if (rc == ESCROW_OK) rc = escrow_deposit(&cu, argv[0], fd, &opts, &err);
    if (rc != ESCROW_OK) {
        escrow_custody_close(&cu);
        return failed(rc, &err);
    }
    fprintf(stderr, "{\"deposited\": "), json_str(stderr, argv[0]), fputs("}\n", stderr);
    char *seen = NULL;
    size_t len = 0;
    int r = copy_until(fd, has_text, argv[3], &seen, &len); /* the app is the reader */
    free(seen);
    escrow_custody_close(&cu); /* custody ends: the holder drains from here on */
    close(fd);
    fprintf(stderr, "{\"custody_ended\": "), json_str(stderr, argv[0]), fputs("}\n", stderr);
    return r == 0 ? 0 : 99;
}

static int cmd_retrieve(const escrow_client *c, const char *id, size_t lines) {
    escrow_retrieved got;
    escrow_error err;
    escrow_code rc = escrow_retrieve(c, id, &got, &err);
    if (rc != ESCROW_OK) return failed(rc, &err);
    fprintf(stderr, "{\"confirmed\": %s, \"handoff_id\": ", got.confirmed ? "true" : "false");
    json_str(stderr, got.handoff_id);
    fprintf(stderr,
            ", \"dropped_bytes\": %lld, \"replay_trimmed\": %lld, \"replay_journaled\": %lld"
            ", \"replay_bytes\": %zu, \"session\": ",
            (long long)got.dropped_bytes, (long long)got.replay_trimmed,
            (long long)got.replay_journaled, got.replay_len);
    json_session(stderr, &got.session);
    fputs("}\n", stderr);
    fwrite(got.replay, 1, got.replay_len, stdout); /* the replay first, then the live fd */
    fflush(stdout);
    char *seen = NULL;
    size_t len = 0;
    int r = lines > 0 ? copy_until(got.fd, has_newlines, &lines, &seen, &len) : 0;
    free(seen);
    close(got.fd);
    escrow_retrieved_free(&got);
    return r == 0 ? 0 : 99;
}

/* ---- custody that survives the holder (escrow_custody.c, PROTOCOL.md 10.4 and 10.6) ------- */

static void event(const char *name, escrow_code rc, const escrow_error *e) {
    fprintf(stderr, "{\"event\": \"%s\"", name);
    if (rc != ESCROW_OK) {
        fputs(", \"code\": ", stderr), json_str(stderr, e->code_name);
        fputs(", \"id\": ", stderr), json_str(stderr, e->id);
    }
    fputs("}\n", stderr);
}

/* A forked child that does not exec: it drops the custody, says which fds it has and
 * whether a journal is mapped in it, and lives until stdin ends. */
static void child_holds_nothing(escrow_custody *cu, int fd) {
    escrow_custody_close_in_child(cu);
    close(fd);
    fprintf(stderr, "{\"event\": \"child\", \"pid\": %ld, \"fds\": [", (long)getpid());
    for (int i = 0, n = 0; i < 1024; i++)
        if (fcntl(i, F_GETFD) != -1) fprintf(stderr, "%s%d", n++ ? ", " : "", i);
    int mapped = 0;
    FILE *maps = fopen("/proc/self/maps", "r");
    char line[512];
    while (maps != NULL && fgets(line, sizeof line, maps) != NULL)
        mapped |= strstr(line, "escrowd:journal") != NULL;
    if (maps != NULL) fclose(maps);
    fprintf(stderr, "], \"journal_mapped\": %s}\n", mapped ? "true" : "false");
    fflush(stderr);
    char sink[64];
    while (read(0, sink, sizeof sink) > 0) {
    }
    _exit(0);
}

static int cmd_custody_app(const escrow_client *c, char **argv, int forks) {
    escrow_custody cu;
    escrow_error err;
    escrow_deposit_opts opts = opts_for(3, argv, 2);
    const char *id = argv[0];
    int fd = atoi(argv[1]);
    opts.journal = atoi(argv[3]);
    escrow_code rc = escrow_custody_open(c, &cu, &err);
    if (rc == ESCROW_OK) rc = escrow_deposit(&cu, id, fd, &opts, &err);
    if (rc != ESCROW_OK) {
        escrow_custody_close(&cu);
        close(fd);
        return failed(rc, &err);
    }
    fprintf(stderr, "{\"event\": \"deposited\", \"journaled\": %s}\n",
            escrow_custody_journaled(&cu, id) ? "true" : "false");
    fflush(stderr);
    if (forks) {
        pid_t pid = fork();
        if (pid == 0) child_holds_nothing(&cu, fd);
        if (pid < 0) perror("fork");
    }
    int reading = 1;
    double next_try = 0;
    for (;;) {
        struct pollfd p[3] = {{0, POLLIN, 0}, {reading ? fd : -1, POLLIN, 0},
                              {escrow_custody_fd(&cu), POLLIN, 0}};
        int wait = -1;
        if (!escrow_custody_protected(&cu)) {
            wait = escrow__ms_left(next_try);
            if (wait == 0) {
                rc = escrow_custody_resume(&cu, &err);
                event(rc == ESCROW_OK ? "protected" : "resume_failed", rc, &err);
                next_try = escrow__now() + escrow_custody_retry_ms(&cu) / 1000.0;
                continue;
            }
        }
        if (poll(p, 3, wait) < 0) continue;
        if (p[0].revents != 0) {
            char sink[64];
            if (read(0, sink, sizeof sink) <= 0) break; /* stdin ended: so does the app */
        }
        if (p[1].revents != 0) {
            char buf[4096];
            long n = escrow_custody_read(&cu, id, buf, sizeof buf);
            if (n > 0) {
                fwrite(buf, 1, (size_t)n, stdout);
                fflush(stdout);
            } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
                reading = 0; /* the terminal hung up */
                event("hung_up", ESCROW_OK, &err);
            }
        }
        if (p[2].fd >= 0 && p[2].revents != 0) {
            rc = escrow_custody_check(&cu, &err);
            if (rc != ESCROW_OK) {
                event("lapsed", rc, &err);
                next_try = escrow__now() + escrow_custody_retry_ms(&cu) / 1000.0;
            }
        }
        fflush(stderr);
    }
    escrow_custody_close(&cu); /* custody ends: the holder drains from here on */
    close(fd);
    event("closed", ESCROW_OK, &err);
    return 0;
}

/* ---- a custody driven line by line (escrow_custody.c, escrow_resume.c: PROTOCOL.md 10) ---- */

#ifdef ESCROW_TEST_HOOKS
extern int escrow__test_stop_in_write; /* escrow_journal.c's, in this driver's build only */
#endif

/* What one line did, and whether the custody is protected after it. */
static void said(const char *cmd, escrow_code rc, const escrow_error *e,
                 const escrow_custody *cu, long fd) {
    printf("{\"cmd\": "), json_str(stdout, cmd);
    printf(", \"code\": "), json_str(stdout, rc == ESCROW_OK ? "ok" : e->code_name);
    printf(", \"id\": "), json_str(stdout, rc == ESCROW_OK ? "" : e->id);
    printf(", \"protected\": %d, \"fd\": %ld}\n", escrow_custody_protected(cu), fd);
    fflush(stdout);
}

/* `nofile N`: only N more fds may be opened from now (the lowest free ones); `off`: as
 * before. */
static int set_nofile(const char *arg, struct rlimit *saved) {
    struct rlimit lim = *saved;
    if (strcmp(arg, "off") != 0) {
        int top = 2;
        for (int fd = 3; fd < 1024; fd++)
            if (fcntl(fd, F_GETFD) != -1) top = fd;
        lim.rlim_cur = (rlim_t)(top + 1 + atoi(arg));
    }
    return setrlimit(RLIMIT_NOFILE, &lim);
}

static int cmd_custody_script(const escrow_client *c) {
    escrow_custody cu;
    escrow_error err;
    struct rlimit saved;
    int taken[64], n_taken = 0; /* retrieved masters: the driver's, closed at the end */
    getrlimit(RLIMIT_NOFILE, &saved);
    escrow_code rc = escrow_custody_open(c, &cu, &err);
    if (rc != ESCROW_OK) return failed(rc, &err);
    char line[4096];
    while (fgets(line, sizeof line, stdin) != NULL) {
        char *argv[4] = {NULL, NULL, NULL, NULL};
        int argc = 0;
        for (char *t = strtok(line, " \n"); t != NULL && argc < 4; t = strtok(NULL, " \n"))
            argv[argc++] = t;
        if (argc == 0) continue;
        const char *cmd = argv[0];
        long fd = -1;
        memset(&err, 0, sizeof err);
        rc = ESCROW_OK;
        if (strcmp(cmd, "deposit") == 0 && argc >= 3) {
            escrow_deposit_opts opts = {NULL, 0, 0, 0, NULL, 0, argc == 4 && atoi(argv[3])};
            rc = escrow_deposit(&cu, argv[1], atoi(argv[2]), &opts, &err);
            if (n_taken < 64) taken[n_taken++] = atoi(argv[2]); /* inherited: closed at the end */
        } else if (strcmp(cmd, "release") == 0 && argc == 2) {
            rc = escrow_custody_release(&cu, argv[1], &err);
        } else if (strcmp(cmd, "update") == 0 && argc == 4) {
            rc = escrow_custody_update(&cu, argv[1], atoll(argv[2]), atoll(argv[3]), NULL, 0,
                                       &err);
        } else if (strcmp(cmd, "check") == 0) {
            rc = escrow_custody_check(&cu, &err);
        } else if (strcmp(cmd, "resume") == 0) {
            rc = escrow_custody_resume(&cu, &err);
        } else if (strcmp(cmd, "close") == 0) {
            /* Custody ends (confirmed when it had lapsed); later lines find it closed. */
            rc = escrow_custody_close(&cu);
            err.code = rc;
            snprintf(err.code_name, sizeof err.code_name, "%s", escrow_code_name(rc));
        } else if (strcmp(cmd, "retrieve") == 0 && argc >= 2 && n_taken < 64) {
            escrow_retrieved r;
            rc = escrow_custody_retrieve(&cu, argv[1], argc == 3 && atoi(argv[2]), &r, &err);
            if (rc == ESCROW_OK) {
                fd = taken[n_taken++] = r.fd;
                escrow_retrieved_free(&r);
            }
        } else if (strcmp(cmd, "reclaim") == 0) {
            escrow_reclaim_report report; /* [JOURNAL]: fd is how many it took */
            rc = escrow_custody_reclaim_all(&cu, argc == 2 && atoi(argv[1]), 0, &report, &err);
            for (size_t i = 0; i < report.n_retrieved; i++) {
                if (n_taken < 64) taken[n_taken++] = report.retrieved[i].fd;
                else close(report.retrieved[i].fd);
            }
            fd = (long)report.n_retrieved;
            escrow_reclaim_report_free(&report);
        } else if (strcmp(cmd, "record") == 0 && argc == 3) {
            /* TEXT; @N: N bytes of lines "R<number>\n", eight bytes each; xN: N of 'X' */
            char kind = argv[2][0];
            size_t n = kind == '@' || kind == 'x' ? (size_t)atol(argv[2] + 1) : strlen(argv[2]);
            char *data = malloc(n + 9);
            for (size_t i = 0; data != NULL && i < n; i += 8)
                snprintf(data + i, 9, "R%06lu\n", (unsigned long)(i / 8 % 1000000));
            if (data != NULL && kind == 'x') memset(data, 'X', n);
            else if (data != NULL && kind != '@') memcpy(data, argv[2], n);
            fd = data == NULL ? -1 : escrow_custody_record(&cu, argv[1], data, n);
            free(data);
        } else if (strcmp(cmd, "holds") == 0 && argc == 2) {
            fd = escrow_custody_holds(&cu, argv[1]); /* 1: the app reads it */
        } else if (strcmp(cmd, "read") == 0 && argc == 2) {
            char buf[4096];
            fd = escrow_custody_read(&cu, argv[1], buf, sizeof buf);
        } else if (strcmp(cmd, "stop-in-write") == 0) {
#ifdef ESCROW_TEST_HOOKS
            escrow__test_stop_in_write = 1;
#endif
        } else if (strcmp(cmd, "nofile") == 0 && argc == 2) {
            fd = set_nofile(argv[1], &saved);
        } else {
            fprintf(stderr, "custody-script: what is %s?\n", cmd);
            continue;
        }
        said(cmd, rc, &err, &cu, fd);
    }
    setrlimit(RLIMIT_NOFILE, &saved);
    escrow_custody_close(&cu);
    for (int i = 0; i < n_taken; i++) close(taken[i]);
    return 0;
}

/* The control message that carries `n` fds (7, then 9), in hex, built by the C macros. */
static void print_cmsg(const char *name, int n) {
    union {
        struct cmsghdr align;
        unsigned char space[CMSG_SPACE(2 * sizeof(int))];
    } control;
    struct msghdr msg;
    int fds[2] = {7, 9};
    size_t size = CMSG_SPACE((size_t)n * sizeof(int));
    memset(&control, 0, sizeof control);
    memset(&msg, 0, sizeof msg);
    msg.msg_control = control.space;
    msg.msg_controllen = size;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_len = CMSG_LEN((size_t)n * sizeof(int));
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    memcpy(CMSG_DATA(c), fds, (size_t)n * sizeof(int));
    printf("\"%s\": \"", name);
    for (size_t i = 0; i < size; i++) printf("%02x", control.space[i]);
    printf("\", ");
}

static int cmd_cmsg(void) {
    union {
        struct cmsghdr align;
        unsigned char space[CMSG_SPACE(sizeof(int))];
    } control;
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_control = control.space;
    msg.msg_controllen = sizeof control.space;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    printf("{");
    print_cmsg("bytes", 1);
    print_cmsg("bytes_two", 2);
    printf("\"header\": %zu, \"data_offset\": %zu, \"cmsg_len_4\": %zu, "
           "\"cmsg_space_4\": %zu, \"cmsg_len_8\": %zu, \"cmsg_space_8\": %zu, "
           "\"cmsg_space_32\": %zu, \"sol_socket\": %d, "
           "\"scm_rights\": %d, \"msg_ctrunc\": %d, \"msg_nosignal\": %d, "
           "\"msg_cmsg_cloexec\": %d, \"sun_path\": %zu}\n",
           sizeof(struct cmsghdr), (size_t)(CMSG_DATA(c) - control.space),
           (size_t)CMSG_LEN(sizeof(int)), (size_t)CMSG_SPACE(sizeof(int)),
           (size_t)CMSG_LEN(2 * sizeof(int)), (size_t)CMSG_SPACE(2 * sizeof(int)),
           (size_t)CMSG_SPACE(8 * sizeof(int)), SOL_SOCKET, SCM_RIGHTS, MSG_CTRUNC,
           SEND_FLAGS, RECV_FLAGS, sizeof(((struct sockaddr_un *)0)->sun_path));
    return 0;
}

/* ---- encode ---------------------------------------------------------------------------------- */

static int cmd_encode(int argc, char **argv) {
    mp_out o = {0};
    escrow_error err;
    int rc = escrow__vector_encode(&o, argc, argv, &err); /* vector_args.c */
    if (rc < 0) {
        free(o.data);
        fputs(usage, stderr);
        return 2;
    }
    if (rc == ESCROW_OK) {
        for (size_t i = 0; i < o.len; i++) printf("%02x", o.data[i]);
        printf("\n");
    } else {
        failed((escrow_code)rc, &err);
    }
    free(o.data);
    return rc;
}

static void json_journal(FILE *out, const journal_info *j) {
    if (!j->set) {
        fputs("null", out);
        return;
    }
    fprintf(out, "{\"capacity\": %lld, \"total\": %lld, \"position\": %lld}",
            (long long)j->capacity, (long long)j->total, (long long)j->position);
}

static int cmd_decode(const char *hex) {
    size_t n = strlen(hex) / 2;
    frame f;
    int bad = 0;
    memset(&f, 0, sizeof f);
    unsigned char *raw = malloc(n + 1);
    if (raw == NULL) return 99;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) v = 0, bad = 1;
        raw[i] = (unsigned char)v;
    }
    if (bad || n < 4 || ((size_t)raw[0] << 24 | (size_t)raw[1] << 16 | (size_t)raw[2] << 8 |
                         raw[3]) != n - 4) {
        free(raw);
        fputs("decode: not a whole frame\n", stderr);
        return 2;
    }
    f.body = raw + 4;
    f.len = n - 4;
    int r = escrow__frame_type(f.body, f.len, f.type);
    if (r == 0 && strcmp(f.type, "welcome") == 0) {
        escrow_welcome w;
        if ((r = escrow__decode_welcome(&f, &w)) == 0) json_welcome(stdout, &w);
    } else if (r == 0 && (strcmp(f.type, "released") == 0 || strcmp(f.type, "done") == 0 ||
                          strcmp(f.type, "updated") == 0)) {
        char id[ESCROW_NAME_MAX + 1];
        if ((r = escrow__decode_id(&f, id)) == 0)
            printf("{\"type\": \"%s\", \"id\": ", f.type), json_str(stdout, id), printf("}\n");
    } else if (r == 0 && strcmp(f.type, "deposited") == 0) {
        char id[ESCROW_NAME_MAX + 1];
        journal_info j;
        if ((r = escrow__decode_deposited(&f, id, &j)) == 0) {
            printf("{\"type\": \"deposited\", \"id\": "), json_str(stdout, id);
            printf(", \"journal\": "), json_journal(stdout, &j), printf("}\n");
        }
    } else if (r == 0 && strcmp(f.type, "done_many") == 0) {
        char (*ids)[ESCROW_NAME_MAX + 1] = NULL;
        size_t count = 0;
        if ((r = escrow__decode_done_many(&f, 0, &ids, &count)) == 0) {
            printf("{\"type\": \"done_many\", \"ids\": [");
            for (size_t i = 0; i < count; i++)
                fputs(i > 0 ? ", " : "", stdout), json_str(stdout, ids[i]);
            printf("]}\n");
        }
        free(ids);
    } else if (r == 0 && strcmp(f.type, "handoff") == 0) {
        escrow_retrieved got;
        journal_info j;
        replay_file_info rf;
        memset(&got, 0, sizeof got);
        if ((r = escrow__decode_handoff(&f, &got, &j, &rf)) == 0) {
            printf("{\"type\": \"handoff\", \"handoff_id\": "), json_str(stdout, got.handoff_id);
            printf(", \"session\": "), json_session(stdout, &got.session);
            printf(", \"replay\": "), json_hex(stdout, got.replay, got.replay_len);
            printf(", \"dropped_bytes\": %lld, \"replay_trimmed\": %lld, "
                   "\"replay_journaled\": %lld, \"journal\": ",
                   (long long)got.dropped_bytes, (long long)got.replay_trimmed,
                   (long long)got.replay_journaled);
            json_journal(stdout, &j);
            printf(", \"restored_modes\": [");
            for (size_t i = 0; i < got.n_restored_modes; i++)
                fputs(i > 0 ? ", " : "", stdout), json_str(stdout, got.restored_modes[i]);
            printf("], \"replay_preamble\": %lld, \"replay_file\": ",
                   (long long)got.replay_preamble);
            if (rf.set)
                printf("{\"offset\": %lld, \"length\": %lld}}\n", (long long)rf.offset,
                       (long long)rf.length);
            else
                printf("null}\n");
        }
        escrow_retrieved_free(&got);
    } else if (r == 0 && strcmp(f.type, "sessions") == 0) {
        escrow_session *s = NULL;
        size_t count = 0;
        if ((r = escrow__decode_sessions(&f, &s, &count)) == 0) json_sessions(stdout, s, count);
        escrow_sessions_free(s, count);
    } else if (r == 0 && strcmp(f.type, "holder_status") == 0) {
        escrow_status s;
        if ((r = escrow__decode_status(&f, &s)) == 0) json_status(stdout, &s);
    } else if (r == 0 && strcmp(f.type, "error") == 0) {
        escrow_error e;
        memset(&e, 0, sizeof e);
        if ((r = escrow__decode_error_fields(&f, &e)) == 0) json_error(stdout, &e);
    } else {
        r = -1;
    }
    /* What escrow__recv_frame would insist on: the fds this message must come with (section 4). */
    if (r == 0) fprintf(stderr, "{\"fds\": %zu}\n", escrow__fds_carried(&f));
    free(raw);
    if (r != 0) fprintf(stderr, "decode: not a valid %s\n", f.type[0] ? f.type : "message");
    return r == 0 ? 0 : (int)ESCROW_PROTOCOL;
}

/* ---- into custody, reclaim, repaint (escrow_reclaim.c, escrow_repaint.c) ------------------ */

static void json_retrieved(FILE *out, const escrow_retrieved *r) {
    fputs("{\"id\": ", out), json_str(out, r->session.id);
    fprintf(out, ", \"confirmed\": %s, \"tty\": %s, \"journal\": %s, \"replay\": ",
            r->confirmed ? "true" : "false", r->fd >= 0 && isatty(r->fd) ? "true" : "false",
            r->journal ? "true" : "false");
    json_hex(out, r->replay, r->replay_len);
    fprintf(out, ", \"dropped_bytes\": %lld, \"child_pid\": ", (long long)r->dropped_bytes);
    json_opt_int(out, r->session.child_pid);
    fputc('}', out);
}

static void json_report(FILE *out, const escrow_reclaim_report *r) {
    fputs("{\"report\": {\"holder_instance\": ", out), json_str(out, r->holder_instance);
    fprintf(out, ", \"adopted\": %lld, \"restarts\": ", (long long)r->adopted);
    json_opt_int(out, r->restarts);
    fputs(", \"unclean_restarts\": ", out), json_opt_int(out, r->unclean_restarts);
    fputs(", \"retrieved\": [", out);
    for (size_t i = 0; i < r->n_retrieved; i++)
        fputs(i > 0 ? ", " : "", out), json_retrieved(out, &r->retrieved[i]);
    fputs("], \"failed\": {", out);
    for (size_t i = 0; i < r->n_failed; i++) {
        fputs(i > 0 ? ", " : "", out), json_str(out, r->failed[i].id);
        fputs(": {\"code\": ", out), json_str(out, r->failed[i].error.code_name);
        fputs(", \"message\": ", out), json_str(out, r->failed[i].error.message);
        fputc('}', out);
    }
    fputs("}}}\n", out);
}

/* Until stdin closes: the test looks at what the holder says meanwhile, or SIGKILLs us. */
static void hold(void) {
    char sink[64];
    fputs("{\"holding\": true}\n", stderr);
    fflush(stderr);
    while (read(0, sink, sizeof sink) > 0) continue;
}

/* reclaim and custody-retrieve: the flags after the command's own arguments. */
typedef struct custody_flags {
    int keep, journal, hold, read;
    double deadline;
} custody_flags;

/* --read: until stdin closes, what the custody reads of each session goes to stdout, as an
 * app that journals shows it (a test SIGKILLs us meanwhile, or closes stdin). */
static void read_until_stdin_ends(escrow_custody *cu, const escrow_reclaim_report *r) {
    struct pollfd *p = calloc(r->n_retrieved + 1, sizeof *p);
    if (p == NULL) return;
    p[0].fd = 0;
    for (size_t i = 0; i < r->n_retrieved; i++) p[i + 1].fd = r->retrieved[i].fd;
    for (size_t i = 0; i <= r->n_retrieved; i++) p[i].events = POLLIN;
    fputs("{\"holding\": true}\n", stderr);
    fflush(stderr);
    for (;;) {
        if (poll(p, (nfds_t)r->n_retrieved + 1, -1) < 0) continue;
        if (p[0].revents != 0) {
            char sink[64];
            if (read(0, sink, sizeof sink) <= 0) break;
        }
        for (size_t i = 0; i < r->n_retrieved; i++) {
            if (p[i + 1].revents == 0) continue;
            char buf[4096];
            long n = escrow_custody_read(cu, r->retrieved[i].session.id, buf, sizeof buf);
            if (n > 0) {
                fwrite(buf, 1, (size_t)n, stdout);
                fflush(stdout);
            } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
                p[i + 1].fd = -1; /* hung up: poll skips it */
            }
        }
    }
    free(p);
}

static int parse_custody_flags(int argc, char **argv, custody_flags *f) {
    memset(f, 0, sizeof *f);
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--keep") == 0) f->keep = 1;
        else if (strcmp(argv[i], "--journal") == 0) f->journal = 1;
        else if (strcmp(argv[i], "--hold") == 0) f->hold = 1;
        else if (strcmp(argv[i], "--read") == 0) f->read = 1;
        else if (strcmp(argv[i], "--deadline") == 0 && i + 1 < argc) f->deadline = atof(argv[++i]);
        else return -1;
    }
    return 0;
}

static int cmd_reclaim(const escrow_client *c, const custody_flags *f) {
    escrow_custody cu;
    escrow_reclaim_report report;
    escrow_error err;
    escrow_code rc = ESCROW_OK;
    if (f->keep && (rc = escrow_custody_open(c, &cu, &err)) != ESCROW_OK) return failed(rc, &err);
    rc = f->keep ? escrow_custody_reclaim_all(&cu, f->journal, f->deadline, &report, &err)
                 : escrow_reclaim_all(c, f->deadline, &report, &err);
    json_report(stderr, &report);
    if (rc != ESCROW_OK) json_error(stderr, &err);
    if (f->read && f->keep) read_until_stdin_ends(&cu, &report);
    else if (f->hold || f->read) hold();
    for (size_t i = 0; i < report.n_retrieved; i++) close(report.retrieved[i].fd);
    escrow_reclaim_report_free(&report);
    if (f->keep) escrow_custody_close(&cu);
    return (int)rc;
}

static int cmd_custody_retrieve(const escrow_client *c, const char *id, const custody_flags *f) {
    escrow_custody cu;
    escrow_retrieved got;
    escrow_error err;
    escrow_code rc = escrow_custody_open(c, &cu, &err);
    if (rc != ESCROW_OK) return failed(rc, &err);
    rc = escrow_custody_retrieve(&cu, id, f->journal, &got, &err);
    if (rc == ESCROW_OK) {
        fputs("{\"retrieved\": ", stderr), json_retrieved(stderr, &got), fputs("}\n", stderr);
        fwrite(got.replay, 1, got.replay_len, stdout);
        fflush(stdout);
    } else {
        json_error(stderr, &err);
    }
    if (f->hold) hold();
    if (rc == ESCROW_OK) {
        close(got.fd);
        escrow_retrieved_free(&got);
    }
    escrow_custody_close(&cu);
    return (int)rc;
}

static int cmd_repaint(int fd) {
    escrow_error err;
    escrow_code rc = escrow_repaint(fd, &err);
    close(fd); /* inherited for the call */
    return rc == ESCROW_OK ? 0 : failed(rc, &err);
}

static int command(int argc, char **argv) {
    const char *socket_path = NULL, *owner = "com.example.term";
    double timeout = 0;
    int i = 1;
    for (; i + 1 < argc && strncmp(argv[i], "--", 2) == 0; i += 2) {
        if (strcmp(argv[i], "--socket") == 0) socket_path = argv[i + 1];
        else if (strcmp(argv[i], "--owner") == 0) owner = argv[i + 1];
        else if (strcmp(argv[i], "--timeout") == 0) timeout = atof(argv[i + 1]);
        else break;
    }
    if (i >= argc) {
        fputs(usage, stderr);
        return 2;
    }
    const char *cmd = argv[i];
    char **args = argv + i + 1;
    int nargs = argc - i - 1;
    if (strcmp(cmd, "cmsg") == 0) return cmd_cmsg();
    if (strcmp(cmd, "encode") == 0) return cmd_encode(nargs, args);
    if (strcmp(cmd, "decode") == 0 && nargs == 1) return cmd_decode(args[0]);

    escrow_client c;
    escrow_error err;
    escrow_code rc = escrow_client_init(&c, owner, socket_path, timeout, &err);
    if (rc != ESCROW_OK) return failed(rc, &err);
    if (strcmp(cmd, "welcome") == 0 && nargs == 0) {
        escrow_welcome w;
        if ((rc = escrow_welcome_of(&c, &w, &err)) != ESCROW_OK) return failed(rc, &err);
        json_welcome(stdout, &w);
        return 0;
    }
    if (strcmp(cmd, "status") == 0 && nargs == 0) {
        escrow_status s;
        if ((rc = escrow_status_of(&c, &s, &err)) != ESCROW_OK) return failed(rc, &err);
        json_status(stdout, &s);
        return 0;
    }
    if (strcmp(cmd, "list") == 0 && nargs <= 1) {
        escrow_session *s;
        size_t n;
        int all = nargs == 1 && strcmp(args[0], "--all") == 0;
        if ((rc = escrow_list(&c, all, &s, &n, &err)) != ESCROW_OK) return failed(rc, &err);
        json_sessions(stdout, s, n);
        escrow_sessions_free(s, n);
        return 0;
    }
    if (strcmp(cmd, "release") == 0 && nargs == 1) {
        if ((rc = escrow_release(&c, args[0], &err)) != ESCROW_OK) return failed(rc, &err);
        return 0;
    }
    if (strcmp(cmd, "update") == 0 && nargs >= 3) {
        escrow__vector_update u;
        if (escrow__vector_parse_update(nargs - 1, args + 1, &u) != 0) {
            fputs(usage, stderr);
            return 2;
        }
        rc = escrow_update(&c, args[0], u.cols, u.rows, u.meta_given ? u.meta : NULL,
                           u.meta_count, &err);
        return rc == ESCROW_OK ? 0 : failed(rc, &err);
    }
    if (strcmp(cmd, "hand-off") == 0 && (nargs == 2 || nargs == 3)) {
        escrow_deposit_opts opts = opts_for(nargs, args, 2);
        rc = escrow_hand_off(&c, args[0], atoi(args[1]), &opts, &err);
        close(atoi(args[1])); /* the app's own copy: never read again once custody ends */
        return rc == ESCROW_OK ? 0 : failed(rc, &err);
    }
    if (strcmp(cmd, "app") == 0 && nargs == 4) return cmd_app(&c, args);
    if (strcmp(cmd, "custody-app") == 0 && (nargs == 4 || nargs == 5))
        return cmd_custody_app(&c, args, nargs == 5 && strcmp(args[4], "fork") == 0);
    custody_flags flags;
    if (strcmp(cmd, "reclaim") == 0 && parse_custody_flags(nargs, args, &flags) == 0)
        return cmd_reclaim(&c, &flags);
    if (strcmp(cmd, "custody-retrieve") == 0 && nargs >= 1 &&
        parse_custody_flags(nargs - 1, args + 1, &flags) == 0)
        return cmd_custody_retrieve(&c, args[0], &flags);
    if (strcmp(cmd, "custody-script") == 0 && nargs == 0) return cmd_custody_script(&c);
    if (strcmp(cmd, "repaint") == 0 && nargs == 1) return cmd_repaint(atoi(args[0]));
    if (strcmp(cmd, "retrieve") == 0 && (nargs == 1 || nargs == 2))
        return cmd_retrieve(&c, args[0], nargs == 2 ? (size_t)atoll(args[1]) : 0);
    fputs(usage, stderr);
    return 2;
}

/* Every command ends with no fd open beyond stdin, stdout and stderr: whatever path the
 * client took, it closed what it opened and what it received. */
int main(int argc, char **argv) {
    int status = command(argc, argv);
    int leaked = 0;
    for (int fd = 3; fd < 1024; fd++) {
        if (fcntl(fd, F_GETFD) == -1) continue;
        fprintf(stderr, "%s%d", leaked++ == 0 ? "{\"leaked_fds\": [" : ", ", fd);
    }
    if (leaked == 0) return status;
    fputs("]}\n", stderr);
    return 98;
}
