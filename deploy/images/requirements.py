"""Print a pyproject.toml's requirements, one a line, for `pip install -r`: the image builds install
dependencies from the project files alone (before the code is copied in), so a code change does not
reinstall them, and no requirement is written twice.

    python3 requirements.py pyproject.toml                          # [project] dependencies
    python3 requirements.py pyproject.toml --extra export           # an optional-dependencies group
    python3 requirements.py pyproject.toml --extra export --only torch
    python3 requirements.py loadtest/pyproject.toml --exclude mhaserve
    python3 requirements.py pyproject.toml --build-system           # what building its wheel needs
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib


def name(requirement: str) -> str:
    """The project name a requirement is about, normalised (PEP 503)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not m:
        raise SystemExit(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pyproject")
    parser.add_argument("--extra", help="an optional-dependencies group instead of the dependencies")
    parser.add_argument("--build-system", action="store_true", help="[build-system] requires instead")
    parser.add_argument("--only", action="append", default=[], help="keep only these projects")
    parser.add_argument("--exclude", action="append", default=[], help="leave these projects out")
    args = parser.parse_args()
    with open(args.pyproject, "rb") as f:
        toml = tomllib.load(f)
    project = toml["project"]
    if args.build_system:
        reqs = toml["build-system"]["requires"]
    elif args.extra:
        reqs = project["optional-dependencies"][args.extra]
    else:
        reqs = project.get("dependencies", [])
    only, exclude = {name(n) for n in args.only}, {name(n) for n in args.exclude}
    picked = [r for r in reqs if (not only or name(r) in only) and name(r) not in exclude]
    if only and len(picked) != len(only):
        raise SystemExit(f"{args.pyproject} does not require all of {sorted(only)}")
    sys.stdout.write("".join(r + "\n" for r in picked))


if __name__ == "__main__":
    main()
