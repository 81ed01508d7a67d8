"""The app scenarios (tests/app_scenarios.py) with the Python app, tests/term_app.py: the
behaviour the C and Node apps are held to, run through the same harness."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import app_scenarios
import pytest
from app_scenarios import Apps, Holders

APP = Path(__file__).resolve().parent / "term_app.py"


@pytest.fixture
def apps(make_holder: Holders) -> Iterator[Apps]:
    # (make_holder first: the apps end before their holders are checked and stopped)
    yield from app_scenarios.ending(Apps([sys.executable, str(APP)]))


def test_a_crashed_app_reclaims_every_session_from_its_first_line(
        apps: Apps, make_holder: Holders, tmp_path: Path) -> None:
    app_scenarios.crash_and_reclaim(apps, make_holder, tmp_path)


def test_a_second_crash_right_after_the_reclaim_loses_nothing(
        apps: Apps, make_holder: Holders, tmp_path: Path) -> None:
    app_scenarios.second_crash_after_the_reclaim(apps, make_holder, tmp_path)


def test_the_holders_crash_under_the_app_is_taken_back_by_the_app(
        apps: Apps, make_holder: Holders, tmp_path: Path) -> None:
    app_scenarios.holder_crash_under_the_app(apps, make_holder, tmp_path)


def test_after_a_total_loss_the_app_deposits_again(
        apps: Apps, socket_dir: Path, tmp_path: Path) -> None:
    app_scenarios.total_loss(apps, socket_dir, tmp_path)


def test_a_ring_that_overflowed_replays_from_a_clean_start(
        apps: Apps, make_holder: Holders, tmp_path: Path) -> None:
    app_scenarios.ring_overflowed(apps, make_holder, tmp_path)


def test_a_second_instance_takes_nothing_from_the_first(
        apps: Apps, make_holder: Holders, tmp_path: Path) -> None:
    app_scenarios.launch_race(apps, make_holder, tmp_path)
