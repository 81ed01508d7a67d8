/* pty.c: a new terminal for an app that has no PTY library (the package's example app and
 * its tests): openpty with the window size given and echo off, the master close-on-exec.
 * Not the C client's, and not part of the package's API (index.ts exports it as `_pty`): a
 * Node terminal app has its PTY library, whose master fd it deposits.
 *
 * The fds: both are the caller's (it gives the slave to the child and closes it).
 */
#define _GNU_SOURCE
#include "addon.h"

#include <errno.h>
#include <fcntl.h>
#include <pty.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

/* openpty(cols, rows) -> {master, slave, path} */
napi_value escrow__node_openpty(napi_env env, napi_callback_info info) {
    size_t argc = 2;
    napi_value argv[2] = {0}, o, v;
    int64_t cols = 80, rows = 24;
    int master, slave;
    char path[256];
    NAPI_OK(env, napi_get_cb_info(env, info, &argc, argv, NULL, NULL), NULL);
    if (escrow__node_int64(env, argv[0], 80, &cols) != 0 ||
        escrow__node_int64(env, argv[1], 24, &rows) != 0)
        return NULL;
    struct winsize ws = {(unsigned short)rows, (unsigned short)cols, 0, 0};
    if (openpty(&master, &slave, path, NULL, &ws) != 0)
        return escrow__node_throw(env, ESCROW_SYSTEM, "openpty: %s", strerror(errno));
    struct termios t;
    if (tcgetattr(slave, &t) == 0) {
        t.c_lflag &= ~(tcflag_t)(ECHO | ECHONL);
        tcsetattr(slave, TCSANOW, &t);
    }
    fcntl(master, F_SETFD, FD_CLOEXEC);
    napi_create_object(env, &o);
    napi_create_int32(env, master, &v);
    napi_set_named_property(env, o, "master", v);
    napi_create_int32(env, slave, &v);
    napi_set_named_property(env, o, "slave", v);
    napi_create_string_utf8(env, path, NAPI_AUTO_LENGTH, &v);
    napi_set_named_property(env, o, "path", v);
    return o;
}
