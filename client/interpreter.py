"""How fd-escrow starts a Python program of its own: the keeper's holder and each restart, an
upgrade's trial run (`escrowd --check`), an autostarted holder, the demo's app processes.

`python -m escrowd` puts the current directory first on `sys.path`, and `PYTHONPATH`,
`PYTHONSTARTUP`, `PYTHONHOME` or `PYTHONSAFEPATH` in the environment choose code too. A holder
started from a directory another user can write (/tmp, /var/tmp, /dev/shm, a shared project
folder) would then run an `escrowd/` package planted there, as the victim, and receive every
stored PTY master. So every such child runs isolated (`-I`: no current directory on the path,
no `PYTHON*` variables, no user site-packages) from `/`.

The one exception is an installation in the user's own site-packages (`pip install --user`),
which `-I` would hide: it gets `-E -P` instead (the same, but the user site stays).
"""

from __future__ import annotations

import os
import site
import sys

# Where every child starts: a directory nobody else can write, whose files choose nothing.
CHILD_CWD = "/"


def python_command(module: str, *args: str) -> list[str]:
    """The argv that runs `python -m module args...` with this interpreter, isolated from the
    caller's directory and environment (see the module's docstring). Run it from CHILD_CWD."""
    return [sys.executable, *_isolation_flags(), "-m", module, *args]


def _isolation_flags() -> list[str]:
    user_site = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user_site and os.path.realpath(__file__).startswith(os.path.realpath(user_site) + os.sep):
        return ["-E", "-P"]
    return ["-I"]
