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

import app_scenarios
import pytest
from app_scenarios import *  # noqa: F403 (the six scenarios, collected with this app)
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
