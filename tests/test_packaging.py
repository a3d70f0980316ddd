"""Promises about what gets installed: serving without torch, one ONNX Runtime package, a pinned torch."""

from __future__ import annotations

import subprocess
import sys
import tomllib
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
    code = "import sys, service.cli as c; c.build_parser(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_console_script_runs() -> None:
    out = subprocess.run([Path(sys.executable).parent / "mhaserve", "export", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--source" in out.stdout
