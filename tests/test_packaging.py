"""Promises about what gets installed: serving without torch, one ONNX Runtime package, a pinned torch."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_only_the_gpu_build_of_onnxruntime_is_installed() -> None:
    """onnxruntime and onnxruntime-gpu overwrite each other's files: one must never come in with the other."""
    distribution("onnxruntime-gpu")
    with pytest.raises(PackageNotFoundError):
        distribution("onnxruntime")


def test_serving_dependencies_hold_no_torch_and_export_pins_it() -> None:
    project = _pyproject()["project"]
    runtime = " ".join(project["dependencies"])
    assert "torch" not in runtime and "onnxruntime-gpu" in runtime
    assert "torch==2.13.0" in project["optional-dependencies"]["export"]
    assert not any(d.startswith("onnxruntime") for extra in project["optional-dependencies"].values() for d in extra)


def test_cli_imports_no_torch() -> None:
    """`mhaserve --help` (and the server) must not pay for importing torch."""
    code = "import sys, mhaserve.cli.main as c; c.build_parser(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_console_script_runs() -> None:
    out = subprocess.run([Path(sys.executable).parent / "mhaserve", "export", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--source" in out.stdout


# ---- one import namespace ------------------------------------------------------------------------------


def _wheel(project: Path, out: Path) -> list[str]:
    """Build a project's wheel (no dependencies, this venv's setuptools) and list the files in it."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(project)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # A folder of data files under a package is a package to setuptools: one left out of `packages` still ships
    # through package-data, but every install prints a page of warnings about it.
    assert "absent from the `packages` configuration" not in built.stderr, built.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def _sources(folder: Path, package: str) -> set[str]:
    """Where each module of a folder lands when installed: mhaserve/<package>/..."""
    return {
        f"mhaserve/{package}/{p.relative_to(folder).as_posix()}"
        for p in folder.rglob("*.py")
        if not {"build", "__pycache__"} & set(p.relative_to(folder).parts)
    }


@pytest.fixture(scope="module")
def serving_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("wheel")
    return out, _wheel(ROOT, out)


def test_the_serving_wheel_installs_one_top_level_name_and_every_module(serving_wheel: tuple[Path, list[str]]) -> None:
    _, names = serving_wheel
    tops = {n.split("/")[0] for n in names}
    assert tops == {"mhaserve", next(t for t in tops if t.endswith(".dist-info"))}
    assert "mhaserve/__init__.py" not in names  # a namespace package: the load-test distribution adds to it
    for package, folder in _pyproject()["tool"]["setuptools"]["package-dir"].items():
        missing = _sources(ROOT / folder, package.split(".", 1)[1]) - set(names)
        assert not missing, f"modules left out of the wheel (add their package to pyproject.toml): {sorted(missing)}"
    # data the int8 gate of `mhaserve export --int8` reads
    assert {"mhaserve/export/gate/fidelity.json", "mhaserve/export/gate/retrieval.json"} <= set(names)


def test_the_serving_wheel_carries_no_load_test_code_and_no_tests(serving_wheel: tuple[Path, list[str]]) -> None:
    _, names = serving_wheel
    assert not [n for n in names if n.startswith(("mhaserve/loadtest", "tests/")) or "locust" in n]


def test_the_load_test_tooling_is_its_own_distribution(tmp_path: Path) -> None:
    names = _wheel(ROOT / "loadtest", tmp_path)
    assert {n.split("/")[0] for n in names} - {n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD")} == {
        "mhaserve"
    }
    assert _sources(ROOT / "loadtest", "loadtest") <= set(names)
    assert "mhaserve/loadtest/corpus.txt" in names
    # the short-text corpus and the topics it is made from (`mhaserve bench`'s short workload)
    assert "mhaserve/loadtest/texts/short.txt" in names
    assert any(n.startswith("mhaserve/loadtest/texts/topics/") and n.endswith(".toml") for n in names)
    assert not [n for n in names if n.startswith("mhaserve/") and not n.startswith("mhaserve/loadtest/")]


def test_an_empty_venv_imports_mhaserve_and_nothing_else(serving_wheel: tuple[Path, list[str]], tmp_path: Path) -> None:
    out, _ = serving_wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    (wheel,) = out.glob("*.whl")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # Outside the checkout, whose folders would otherwise be importable from the working directory.
    code = (
        "import importlib.metadata as md, importlib.util as u, mhaserve.service, mhaserve.runtime, mhaserve.cli\n"
        "assert md.distribution('mhaserve').version\n"
        "for name in ('service', 'model', 'export', 'proto', 'loadtest', 'runtime', 'cli', 'testing'):\n"
        "    assert u.find_spec(name) is None, name\n"
    )
    subprocess.run([python, "-c", code], check=True, cwd=tmp_path, timeout=60)
