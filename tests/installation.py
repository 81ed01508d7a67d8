"""A second installation of fd-escrow, for tests of what a holder does with the code it is
given: a virtual environment of its own (no pip, made in a second or so) with a copy of
`escrowd` and `escrow_client` in its site-packages, and this environment's dependencies
(trio, msgspec, psutil) reachable after them. A test may break the copy as a bad upgrade
would; this checkout's code is never touched.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import escrow_client
import escrowd


def make_installation(where: Path) -> Path:
    """Make it in `where` (which must not exist); return its interpreter. Its copy of
    escrowd is at `site_packages(where) / "escrowd"`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   capture_output=True, timeout=60)
    python = where / "bin" / "python"
    site = site_packages(where)
    for package, name in ((escrowd, "escrowd"), (escrow_client, "escrow_client")):
        shutil.copytree(Path(package.__file__).parent, site / name,
                        ignore=shutil.ignore_patterns("__pycache__", "c"))
    # Only the dependencies: a path in a .pth file is added without its own .pth files, so
    # the editable install of this checkout is not (the copy is what runs).
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def site_packages(where: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return where / "lib" / version / "site-packages"
