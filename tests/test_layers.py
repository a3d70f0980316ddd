"""The layers of mhaserve, checked: every import points down, siblings stay apart, and no two files import
each other, directly or around a circle. docs/architecture.md draws the same picture.

Lazy imports inside functions count as much as those at the top of a file: a circle through a
function is still a circle. The one exception is a plugin lookup by name at run time
(`importlib.import_module`), which this test cannot see and the CLI uses for nothing but the
separately installed load-test tooling.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom; packages on one line are siblings and must not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("loadtest",),  # the load-test tooling: its own distribution (loadtest/pyproject.toml)
    ("testing",),  # the harness the tests and the tooling share: a server in a thread, a scripted engine
    ("cli",),  # the composition root: flags and environment in, Settings out
    ("service", "export"),  # serving; exporting and publishing models
    ("runtime", "model", "proto"),  # repository, manifest, engine, tokenizer; the PyTorch model; gRPC stubs
]
# Who may read Settings: the CLI, the server's start-up (one process's, and the supervisor's that starts
# several: `--processes`), and what builds servers on top of them.
SETTINGS_READERS = (
    "mhaserve.cli",
    "mhaserve.service.server",
    "mhaserve.service.processes",
    "mhaserve.service.settings",
    "mhaserve.testing",
    "mhaserve.loadtest",
)


def _folders() -> dict[str, Path]:
    """Each `mhaserve.<name>` package and the folder it installs from (pyproject's package-dir)."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {name.split(".", 1)[1]: ROOT / folder for name, folder in root.items()}
    folders["loadtest"] = ROOT / "loadtest"
    return folders


def _module(folder: Path, package: str, path: Path) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["mhaserve", package, *parts])


def _graph() -> dict[str, set[str]]:
    """module -> the mhaserve modules it imports (a package's __init__ stands for the package)."""
    files: dict[str, Path] = {}
    for package, folder in _folders().items():
        for path in folder.rglob("*.py"):
            if "build" in path.relative_to(folder).parts:
                continue
            files[_module(folder, package, path)] = path
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module or ""
                # `from pkg import sub` imports the module pkg.sub when there is one
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]  # mhaserve.service.batching.Batcher -> the module
                if name.startswith("mhaserve.") and name != module:
                    edges.add(name)
        graph[module] = edges
    return graph


def _layer(module: str) -> tuple[int, str]:
    package = module.split(".")[1]
    for rank, layer in enumerate(LAYERS):
        if package in layer:
            return rank, package
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and docs/architecture.md")


GRAPH = _graph()


def test_every_package_has_a_layer() -> None:
    assert {m.split(".")[1] for m in GRAPH} == {p for layer in LAYERS for p in layer}


def test_imports_point_down_and_siblings_stay_apart() -> None:
    wrong = []
    for module, targets in sorted(GRAPH.items()):
        rank, package = _layer(module)
        for target in sorted(targets):
            t_rank, t_package = _layer(target)
            if t_rank < rank or (t_rank == rank and t_package != package):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that run up or sideways:\n" + "\n".join(wrong)


def test_no_file_imports_itself_around_a_circle() -> None:
    # Tarjan's strongly connected components: any component of two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other: {circles}"


def test_only_the_composition_roots_read_settings() -> None:
    readers = {m for m, targets in GRAPH.items() if "mhaserve.service.settings" in targets}
    assert readers and all(r.startswith(SETTINGS_READERS) for r in readers), sorted(readers)


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("mhaserve.export", "mhaserve.service"),
        ("mhaserve.runtime", "mhaserve.service"),
        ("mhaserve.runtime", "mhaserve.export"),
        ("mhaserve.service", "mhaserve.loadtest"),
        ("mhaserve.service", "mhaserve.cli"),
    ],
)
def test_the_arrows_the_architecture_issue_named(importer: str, imported: str) -> None:
    found = [f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith(importer) for t in ts if t.startswith(imported)]
    assert not found, found
