"""One terminal, one identity (docs/design.md §3): the same pty under two ids is refused, and two
different ptys are never mistaken for one.

Incident pinned: the "one terminal under two ids" check keyed on the pts number alone, so
two terminals from different devpts instances (a container, toolbox, bwrap: each counts
from /dev/pts/0) were refused as `exists`. The test makes two real devpts instances with
`mount -t devpts -o newinstance` in a private mount namespace, and deposits pts 0 of each
with a real holder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import HolderProcess, require_program, require_real

APP = textwrap.dedent("""
    import fcntl, json, os, struct, sys
    from escrow_client import EscrowClient, EscrowError
    TIOCSPTLCK, TIOCGPTN = 0x40045431, 0x80045430
    masters = []
    for instance in sys.argv[2:]:
        master = os.open(os.path.join(instance, "ptmx"), os.O_RDWR | os.O_NOCTTY)
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        number = struct.unpack("I", fcntl.ioctl(master, TIOCGPTN, b"\\0" * 4))[0]
        masters.append((master, number, os.fstat(master).st_dev))
    result = {"numbers": [n for _, n, _ in masters], "devs": [d for _, _, d in masters]}
    custody = EscrowClient("com.example.term", socket_path=sys.argv[1]).custody()
    for name, (master, _, _) in zip(("a", "b"), masters):
        try:
            custody.deposit(name, master)
            result[name] = "deposited"
        except EscrowError as exc:
            result[name] = exc.code
    try:
        custody.deposit("a-again", masters[0][0])  # the same terminal under a second id
        result["a-again"] = "deposited"
    except EscrowError as exc:
        result["a-again"] = exc.code
    for name in ("a", "b"):
        if result[name] == "deposited":
            custody.release(name)
    custody.close()
    print(json.dumps(result))
""")


def test_pts_0_of_two_devpts_instances_are_two_terminals(
    holder: HolderProcess, tmp_path: Path,
) -> None:
    unshare = require_program("unshare")
    require_real("root (to mount devpts instances)", os.geteuid() == 0,
                 "run the suite as root, as CI does")
    script = tmp_path / "app.py"
    script.write_text(APP)
    pa, pb = tmp_path / "pts-a", tmp_path / "pts-b"
    pa.mkdir()
    pb.mkdir()
    inner = textwrap.dedent(f"""
        set -eu
        mount -t devpts -o newinstance,ptmxmode=0666 devpts {pa}
        mount -t devpts -o newinstance,ptmxmode=0666 devpts {pb}
        {sys.executable} {script} {holder.socket} {pa} {pb}
    """)
    result = subprocess.run([unshare, "-m", "--propagation", "private", "sh", "-c", inner],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["numbers"] == [0, 0], seen  # the same pts number in both instances
    assert seen["devs"][0] != seen["devs"][1], seen
    assert seen["a"] == "deposited" and seen["b"] == "deposited", seen
    assert seen["a-again"] == "exists", seen
