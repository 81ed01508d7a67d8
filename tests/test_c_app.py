"""The app scenarios (tests/app_scenarios.py) with the C app, client/c/examples/term-app.c:
a C app keeps its shells through its own crashes, the holder's and a total loss, as the
Python app does.

The app is built here as tests/test_c_client.py builds its driver, warnings as errors,
with AddressSanitizer and UBSan, linking the C client's files; at SIGTERM it exits 0 only
with no fd left open and (the sanitizers) nothing leaked. With no compiler the tests fail,
naming `scripts/setup --test`, which installs one.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import app_scenarios
import pytest
from app_scenarios import *  # noqa: F403 (the six scenarios, collected with this app)
from app_scenarios import Apps, Holders
from test_c_client import LIBRARY, SANITIZER_ENV, SANITIZERS, SOURCE, WARNINGS, _compile

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
