"""deploy/images/install-podman.sh's containers.conf drop-in, written to a temporary path (`--write-conf`).

No root, packages or engine needed: the script's configuration step alone. That podman reads the file is
not checked here (that would change the host's configuration); by hand, on podman 4.3.1, a container
created with CONTAINERS_CONF pointing at the written file had StopTimeout 45 (10 without it).
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

from tests.deploy.helpers import ROOT, compose_file

SCRIPT = ROOT / "deploy" / "images" / "install-podman.sh"

# What the script wrote before it set stop_timeout: hosts that ran it then have exactly this.
EARLIER = """\
# Written by mhaserve's deploy/images/install-podman.sh.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"
"""


def write_conf(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "--write-conf", str(path)], capture_output=True, text=True, timeout=60, check=True
    )


def grace_seconds() -> int:
    period = compose_file()["services"]["encoder"]["stop_grace_period"]
    m = re.fullmatch(r"(\d+)s", str(period))
    assert m, f"expected a duration like 45s, got {period!r}"
    return int(m.group(1))


def test_the_drop_in_keeps_what_hosts_need_and_stops_after_the_compose_grace_period(tmp_path: Path) -> None:
    conf = tmp_path / "containers.conf.d" / "50-mhaserve.conf"
    write_conf(conf)
    doc = tomllib.loads(conf.read_text())
    assert doc["containers"]["default_ulimits"] == ["nofile=1024:1024", "nproc=1024:1024"]
    assert doc["engine"]["runtime"] == "runc"
    # podman-compose does not pass stop_grace_period on: podman's own default has to be the same.
    assert doc["engine"]["stop_timeout"] == grace_seconds()


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    conf = tmp_path / "50-mhaserve.conf"
    write_conf(conf)
    before = (conf.read_text(), conf.stat().st_mtime_ns)
    second = write_conf(conf)
    assert (conf.read_text(), conf.stat().st_mtime_ns) == before
    assert second.stderr == ""


def test_the_drop_in_an_earlier_version_wrote_is_brought_up_to_date(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.conf"
    write_conf(fresh)
    conf = tmp_path / "50-mhaserve.conf"
    conf.write_text(EARLIER)
    write_conf(conf)
    assert conf.read_text() == fresh.read_text()


def test_a_drop_in_written_by_someone_else_is_left_alone_with_a_warning(tmp_path: Path) -> None:
    conf = tmp_path / "50-mhaserve.conf"
    mine = '[engine]\nruntime = "crun"\n'
    conf.write_text(mine)
    run = write_conf(conf)
    assert conf.read_text() == mine
    assert "leaving it as it is" in run.stderr
    assert "stop_timeout" in run.stderr
