"""The shortest path through a handoff, end to end."""

import os
import select

from conftest import HolderProcess, PtyChild, wait_for

# Echo is on (a cooked terminal), so what the holder drains is the typed line, echoed, and
# then the child's answer.
REPLAY = b"escrow\r\nhello-escrow\r\n"


def test_hand_off_and_retrieve(holder: HolderProcess, pty_children) -> None:
    """The whole point, once: what a child prints while its app is away comes back as the
    replay, byte for byte, and the fd handed back is the same live terminal."""
    child: PtyChild = pty_children(
        ["sh", "-c", 'read a; echo "hello-$a"; read b; echo "bye-$b"; exec sleep 60'])
    client = holder.client()
    client.hand_off("tab-1", child.master, child_pid=child.pid, label="sh")
    os.write(child.master, b"escrow\n")  # writing is not reading: the holder is the reader
    os.close(child.master)
    child.master = -1
    wait_for(lambda: client.list()[0].buffered_bytes >= len(REPLAY), 10.0,
             "the child's answer drained")
    got = client.retrieve("tab-1")
    try:
        assert got.confirmed
        assert got.session.state == "draining"
        assert got.session.child_pid == child.pid
        assert got.session.child_alive is True
        assert os.isatty(got.fd)
        assert (got.replay, got.dropped_bytes) == (REPLAY, 0)
        # The same child answers on the fd we got back.
        os.write(got.fd, b"again\n")
        out = b""
        while b"bye-again\r\n" not in out:
            assert select.select([got.fd], [], [], 10.0)[0], f"no answer; got {out!r}"
            chunk = os.read(got.fd, 1024)
            assert chunk, "end of file on a live master"
            out += chunk
        assert out == b"again\r\nbye-again\r\n"
    finally:
        os.close(got.fd)
