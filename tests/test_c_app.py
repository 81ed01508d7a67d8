"""The app scenarios (tests/app_scenarios.py) with the C app, client/c/examples/term-app.c:
a C app keeps its shells through its own crashes, the holder's and a total loss, as the
Python app does.

The app is built here as tests/test_c_client.py builds its driver, warnings as errors,
with AddressSanitizer and UBSan, linking the C client's files; at SIGTERM it exits 0 only
with no fd left open and (the sanitizers) nothing leaked. With no compiler the tests fail,
naming `scripts/setup --test`, which installs one.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import app_scenarios
import pytest
from app_scenarios import *  # noqa: F403 (the six scenarios, collected with this app)
from app_scenarios import REACT, Apps, Holders, first_run
from test_c_client import LIBRARY, SANITIZER_ENV, SANITIZERS, SOURCE, WARNINGS, _compile

from conftest import start_holder

APP = SOURCE / "examples" / "term-app.c"


@pytest.fixture(scope="module")
def term_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None:
        pytest.fail("no C compiler (cc) on the PATH: run scripts/setup --test, which installs one")
    out = tmp_path_factory.mktemp("c-app") / "term-app"
    _compile("-std=c11", *WARNINGS, "-O1", "-g", *SANITIZERS, str(APP), *LIBRARY,
             "-o", str(out))
    return out


@pytest.fixture
def apps(term_app: Path, make_holder: Holders) -> Iterator[Apps]:
    # (make_holder first: the apps end before their holders are checked and stopped)
    yield from app_scenarios.ending(Apps([str(term_app)], SANITIZER_ENV))


def test_the_app_compiles_as_c99_too() -> None:
    _compile("-std=c99", *WARNINGS, "-c", str(APP), "-o", "/dev/null")


def test_the_app_says_how_custody_ended_and_exits_non_zero_when_it_is_not_confirmed(
        apps: Apps, socket_dir: Path, tmp_path: Path) -> None:
    """Found in review: at SIGTERM the C app ignored escrow_custody_close's code, and
    exited 0 even when the end of custody was never confirmed (a custody that lapsed with
    no holder to end it on: its sessions may be held by nobody). Now it says so, in a
    `closed` event with the code, and exits 1; a confirmed end is `ok` and exits 0."""
    first = start_holder(socket_dir / "ok")
    try:
        one = first_run(apps, first, tmp_path / "ok")
        one.terminate()
        assert [e for e in one.events() if e["event"] == "closed"] == [
            {"event": "closed", "code": "ok"}]
    finally:
        first.stop()
    second = start_holder(socket_dir / "gone")
    try:
        two = first_run(apps, second, tmp_path / "gone")
        os.kill(second.pid, signal.SIGKILL)  # no keeper: nobody to end custody on
        second.proc.wait()
    finally:
        second.stop()
    two.wait_event("lapsed")
    two.proc.send_signal(signal.SIGTERM)
    assert two.proc.wait(REACT) == 1, two.stderr()
    assert [e for e in two.events() if e["event"] == "closed"] == [
        {"event": "closed", "code": "unavailable"}]
