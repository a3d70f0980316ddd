"""This host's pip configuration as `docker build` / `podman build` arguments, one a line.

The images install their Python packages with pip inside the build. By default they use public PyPI
(and PyTorch's CPU index for the export's torch); a host that reaches packages another way (a company
mirror, local wheel directories, an offline index, a TLS-intercepting proxy) has said so in its pip
configuration. This reads that configuration (`pip config list`: the files and PIP_* variables) and
carries it into the build:

- index-url, extra-index-url, find-links, trusted-host, constraint  -> --build-arg PIP_*
- cert (a CA bundle)                                                 -> --secret id=pip_cert (never in a layer)
- local directories and files those settings name (file:// indexes, wheel directories, constraint files)
                                                                     -> --volume PATH:PATH:ro (podman only),
                                                                        at build time only
- TORCH_INDEX_URL="" when this host's pip already resolves the pinned torch to a CPU build, so that the
  export installs it as `make install` does here; otherwise the Dockerfile's default (PyTorch's CPU index)

docker cannot mount directories into a build: with docker, local paths are left out and named on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parents[2]
CARRIED = {  # pip option -> build argument
    "index-url": "PIP_INDEX_URL",
    "extra-index-url": "PIP_EXTRA_INDEX_URL",
    "find-links": "PIP_FIND_LINKS",
    "trusted-host": "PIP_TRUSTED_HOST",
    "constraint": "PIP_CONSTRAINT",
}
# Where an option set in several sections is read from, weakest first (pip's own order for `install`).
SECTIONS = ("global", "install", ":env:")


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )


def host_config() -> dict[str, str]:
    """The effective value of each option, from `pip config list` (`section.option='value'` lines)."""
    listed = pip("config", "list")
    if listed.returncode != 0:
        print(
            f"pip_config.py: `pip config list` failed, using the Dockerfile's defaults: {listed.stderr}",
            file=sys.stderr,
        )
        return {}
    found: dict[str, dict[str, str]] = {}
    for line in listed.stdout.splitlines():
        m = re.fullmatch(r"(.+?)\.([\w-]+)='(.*)'", line.strip())
        if m:
            found.setdefault(m.group(2), {})[m.group(1)] = m.group(3)
    return {opt: next(v[s] for s in reversed(SECTIONS) if s in v) for opt, v in found.items() if set(v) & set(SECTIONS)}


def local_path(item: str) -> str | None:
    """The local path a pip location names (a path or a file:// URL), else None."""
    if item.startswith("file:"):
        return unquote(urlparse(item).path)
    if "://" in item:
        return None
    return item


def torch_from_host() -> bool:
    """Whether this host's pip gives the pinned torch as a CPU build (a `+cpu` local version)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [r for r in project["optional-dependencies"]["export"] if re.match(r"torch\s*==", r)]
    if not pins:
        return False
    dry = pip("install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet", "--report", "-", pins[0])
    if dry.returncode != 0:
        return False
    try:
        versions = [i["metadata"]["version"] for i in json.loads(dry.stdout)["install"]]
    except (ValueError, KeyError):
        return False
    return bool(versions) and all(v.endswith("+cpu") for v in versions)


def build_args(engine: str) -> list[str]:
    config = host_config()
    args: list[str] = []
    mounts: set[str] = set()
    left_out: list[str] = []
    for option, arg in CARRIED.items():
        if option not in config:
            continue
        kept = []
        for item in config[option].split():
            path = local_path(item) if option != "trusted-host" else None
            if path is not None:
                if not os.path.exists(path):
                    left_out.append(f"{option} {item} (does not exist)")
                    continue
                if engine != "podman":
                    left_out.append(f"{option} {item} ({engine} cannot mount it into a build)")
                    continue
                # At the same path inside, so the setting reads the same there. A local index's pages
                # link to files beside its `simple/` folder (../../files/...): its parent goes in too.
                is_index = option.endswith("index-url")
                mounts.add(
                    os.path.dirname(path.rstrip("/")) if is_index and path.rstrip("/").endswith("/simple") else path
                )
            kept.append(item)
        if kept:
            args.append(f"--build-arg={arg}={' '.join(kept)}")
    cert = config.get("cert")
    if cert and os.path.isfile(cert):
        args.append(f"--secret=id=pip_cert,src={cert}")
    args += [f"--volume={m}:{m}:ro" for m in sorted(mounts)]
    if os.environ.get("TORCH_INDEX_URL") is not None:
        args.append(f"--build-arg=TORCH_INDEX_URL={os.environ['TORCH_INDEX_URL']}")
    elif torch_from_host():
        args.append("--build-arg=TORCH_INDEX_URL=")
    for item in left_out:
        print(f"pip_config.py: left out of the build: {item}", file=sys.stderr)
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["docker", "podman"], required=True)
    opts = parser.parse_args()
    sys.stdout.write("".join(a + "\n" for a in build_args(opts.engine)))


if __name__ == "__main__":
    main()
