"""The README's Install block and its removal block, pasted as they are into one bash, under
a real `systemd --user` (tests/usermanager.py) with a home of its own: `pipx install .`,
the PATH made right in the same shell, the units installed and the holder started by its
first connection; then uninstall-service, the stop, and `pipx uninstall`, leaving nothing.

Slow (a pipx install, 20-40 s), like tests/test_packaging.py; it runs in CI all the same.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import usermanager
from test_docs import block_with
from test_packaging import _NOT_SOURCE

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def pip_settings() -> str:
    """Where this machine's pip finds packages (its index, its wheels): the environment of
    the shell the blocks are pasted into, not part of what is pasted."""
    words = [f"export {k}={shlex.quote(v)}" for k, v in os.environ.items()
             if k.startswith("PIP_")]
    config = Path.home() / ".config" / "pip" / "pip.conf"
    if config.exists():
        words.append(f"export PIP_CONFIG_FILE={shlex.quote(str(config))}")
    return "\n".join(words)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_install_and_removal_work_as_pasted() -> None:
    install = block_with("sh", README, "pipx install .").text
    removal = block_with("sh", README, "pipx uninstall fd-escrow").text
    with usermanager.started() as manager:
        src, tools = manager.home / "src", manager.home / "tools"
        shutil.copytree(REPO, src, ignore=_NOT_SOURCE)
        tools.mkdir()
        (tools / "pipx").symlink_to(Path(sys.executable).with_name("pipx"))  # pipx installed
        script = manager.home / "paste.sh"
        script.write_text(f"{pip_settings()}\nexport PATH={tools}:$PATH\ncd {src}\n"
                          f"{install}\necho '-- removal --'\n{removal}")
        result = manager.run("bash", "--norc", "--noprofile", "-e", str(script),
                             check=False, timeout=240)
        out = result.stdout
        assert result.returncode == 0, (out, result.stderr)
        installed, removed = out.split("-- removal --\n")
        assert "escrowd: running" in installed, installed
        assert f"removed {manager.unit_dir / 'escrowd.socket'}" in removed, removed
        assert f"removed {manager.unit_dir / 'escrowd.service'}" in removed
        assert not (manager.unit_dir / "escrowd.socket").exists()
        assert not (manager.home / ".local" / "bin" / "escrowctl").exists()
        assert manager.show("escrowd.socket", "ActiveState") == {"ActiveState": "inactive"}
