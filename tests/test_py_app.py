"""The app scenarios (tests/app_scenarios.py) with the Python app, tests/term_app.py: the
behaviour the C and Node apps are held to, run through the same harness."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import app_scenarios
import pytest
from app_scenarios import *  # noqa: F403 (the six scenarios, collected with this app)
from app_scenarios import Apps, Holders

APP = Path(__file__).resolve().parent / "term_app.py"


@pytest.fixture
def apps(make_holder: Holders) -> Iterator[Apps]:
    # (make_holder first: the apps end before their holders are checked and stopped)
    yield from app_scenarios.ending(Apps([sys.executable, str(APP)]))
