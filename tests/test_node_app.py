"""The app scenarios (tests/app_scenarios.py) with the Node app,
client/node/examples/term-app.js: a Node app over the package keeps its shells through its
own crashes, the holder's and a total loss, as the C and Python apps do.

The package is built here as tests/test_node_client.py builds it (npm ci where needed, then
npm run build, warnings as errors). With no node, npm or cc the tests fail, naming
`scripts/setup --test`, which installs them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import app_scenarios
import pytest
from app_scenarios import Apps, Holders
from test_node_client import PACKAGE, build_package

APP = PACKAGE / "examples" / "term-app.js"


@pytest.fixture(scope="module")
def node() -> str:
    for program in ("node", "npm", "cc"):
        if shutil.which(program) is None:
            pytest.fail(f"no {program} on the PATH: run scripts/setup --test, which installs it")
    build_package()
    found = shutil.which("node")
    assert found is not None
    return found


@pytest.fixture
def apps(node: str, make_holder: Holders) -> Iterator[Apps]:
    # (make_holder first: the apps end before their holders are checked and stopped)
    yield from app_scenarios.ending(Apps([node, str(APP)]))


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
