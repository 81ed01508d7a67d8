/* Baselines for bench/run.py, compiled into a temp dir at run time (never committed).
 *
 *   baselines writer BYTES     write BYTES to stdout as fast as it can (stdout made raw if a tty)
 *   baselines reader           read stdin (a pty master) until EOF/EIO; print the byte count
 *   baselines roundtrip ROUNDS send a pty master to a child over a socketpair and back;
 *                              print the median and p99 round trip in microseconds
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

static int writer(long long total) {
    static char buf[65536];
    struct termios t;
    if (isatty(1) && tcgetattr(1, &t) == 0) {
        cfmakeraw(&t);
        tcsetattr(1, TCSANOW, &t);
    }
    for (size_t i = 0; i < sizeof buf; i++)  /* lines of 80 printable characters */
        buf[i] = (i % 80 == 79) ? '\n' : (char)('a' + i % 26);
    while (total > 0) {
        size_t want = total < (long long)sizeof buf ? (size_t)total : sizeof buf;
        ssize_t n = write(1, buf, want);
        if (n < 0) {
            if (errno == EINTR) continue;
            perror("write");
            return 1;
        }
        total -= n;
    }
    return 0;
}

static int reader(void) {
    static char buf[65536];
    long long total = 0;
    for (;;) {
        ssize_t n = read(0, buf, sizeof buf);
        if (n > 0) {
            total += n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        break; /* EIO: the last slave fd closed, and everything before it was read */
    }
    printf("%lld\n", total);
    return 0;
}

static int send_fd(int sock, int fd) {
    char byte = 'x';
    struct iovec iov = {&byte, 1};
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } u;
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = u.buf;
    msg.msg_controllen = sizeof u.buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    return sendmsg(sock, &msg, MSG_NOSIGNAL) == 1 ? 0 : -1;
}

static int recv_fd(int sock) {
    char byte;
    struct iovec iov = {&byte, 1};
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } u;
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = u.buf;
    msg.msg_controllen = sizeof u.buf;
    if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) != 1) return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (c == NULL || c->cmsg_type != SCM_RIGHTS) return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int roundtrip(int rounds) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 1;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        for (;;) {
            int fd = recv_fd(sv[1]);
            if (fd < 0) _exit(0);
            send_fd(sv[1], fd);
            close(fd);
        }
    }
    close(sv[1]);
    int master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master < 0) return 1;
    double *us = calloc((size_t)rounds, sizeof *us);
    for (int i = 0; i < rounds; i++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        if (send_fd(sv[0], master) != 0) return 1;
        int back = recv_fd(sv[0]);
        clock_gettime(CLOCK_MONOTONIC, &b);
        if (back < 0) return 1;
        close(back);
        us[i] = (b.tv_sec - a.tv_sec) * 1e6 + (b.tv_nsec - a.tv_nsec) / 1e3;
    }
    close(sv[0]);
    waitpid(pid, NULL, 0);
    qsort(us, (size_t)rounds, sizeof *us, cmp_double);
    printf("%.3f %.3f\n", us[rounds / 2], us[(rounds * 99) / 100]);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "writer") == 0) return writer(atoll(argv[2]));
    if (argc == 2 && strcmp(argv[1], "reader") == 0) return reader();
    if (argc == 3 && strcmp(argv[1], "roundtrip") == 0) {
        int rounds = atoi(argv[2]);
        return rounds > 0 ? roundtrip(rounds) : 2;
    }
    fprintf(stderr, "usage: baselines writer BYTES | reader | roundtrip ROUNDS\n");
    return 2;
}
