"""The layout shows the architecture: no import cycle, and no module or class too big to read
top to bottom (docs/design.md §2).

The imports are read from the source, as written: `if TYPE_CHECKING:` imports count (a cycle
there is still two modules that cannot be understood apart), relative imports are resolved
to their module, and `from package import module` counts as an import of that module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where each package's source lives, by the name it is imported as.
PACKAGES = {"escrowd": ROOT / "escrowd", "escrow_client": ROOT / "client"}
MAX_MODULE_LINES = 450  # about: the C client, split by its own sections, is apart
MAX_CLASS_LINES = 260  # about 250


def modules() -> dict[str, Path]:
    found = {}
    for package, where in PACKAGES.items():
        for path in where.rglob("*.py"):
            parts = path.relative_to(where).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules `name` imports (not itself, not what only names a package)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (here[: len(here) - node.level + 1] if node.level else [])
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not known[target].name == "__init__.py":
                out.add(target)
    return out


def test_no_module_imports_one_that_imports_it_back() -> None:
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    cycles: list[list[str]] = []

    def walk(start: str, at: str, trail: list[str]) -> None:
        for nxt in sorted(graph[at]):
            if nxt == start:
                cycles.append([*trail, start])
            elif nxt not in trail and nxt > start:  # each cycle once, from its least module
                walk(start, nxt, [*trail, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_or_class_is_too_big_to_read() -> None:
    too_big = []
    for name, path in sorted(modules().items()):
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            too_big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_big.append(f"{name}.{node.name}: {size} lines")
    assert not too_big, too_big


def test_every_design_reference_points_into_the_design_document() -> None:
    """Code, tests and docs cite docs/design.md by section: every section cited is there,
    and nothing cites a design document outside the repository."""
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\. ", design, re.M))
    cited: dict[str, set[str]] = {}
    outside = []
    for path in ROOT.rglob("*"):
        if (path.suffix not in (".py", ".md", ".c", ".h") or ".venv" in path.parts
                or ".git" in path.parts or not path.is_file()):
            continue
        text = path.read_text(errors="replace")
        for number in re.findall(r"docs/design\.md §(\d+)", text):
            cited.setdefault(number, set()).add(str(path.relative_to(ROOT)))
        if re.search(r"\bDESIGN" + r" §|shared/" + "DESIGN", text):  # (not this line)
            outside.append(str(path.relative_to(ROOT)))
    assert not outside, f"cite a design document outside the repository: {outside}"
    missing = {n: sorted(where) for n, where in cited.items() if n not in sections}
    assert not missing, f"cite sections docs/design.md does not have: {missing}"


def test_the_design_document_names_every_module() -> None:
    """docs/design.md §2 has every module in a line, the holder's in one table and the
    client's in the other: a module added is a line added."""
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## 2. ", 1)[1].split("\n## ", 1)[0]
    holder, client = section.split("| client (", 1)
    named = {"escrowd": set(re.findall(r"`([a-z_]+\.py)`", holder)),
             "escrow_client": set(re.findall(r"`([a-z_]+\.py)`", client))}
    unnamed = []
    for name, path in modules().items():
        where = path.relative_to(PACKAGES[name.split(".")[0]])
        if where.name == "__init__.py" or where.parts[0] == "commands":
            continue  # a package; the verbs are named together (`commands/`)
        if where.name not in named[name.split(".")[0]]:
            unnamed.append(str(path.relative_to(ROOT)))
    assert not unnamed, f"docs/design.md §2 does not name: {unnamed}"
    assert "`commands/`" in client
