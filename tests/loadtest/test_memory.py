"""The bench's server-memory figures: /proc parsing, which graphs are measured, growth and the verdict, and a
short run against a real server. No memory figure is asserted beyond what the kernel guarantees (peak >= now)."""

from __future__ import annotations

import os

import pytest

from mhaserve.loadtest.bench import memory
from mhaserve.loadtest.bench.client import Server
from mhaserve.loadtest.bench.workloads import Workload
from mhaserve.testing.process import Memory, parse_status, status

# A /proc/<pid>/status of Linux 6, cut: sizes, counts, masks of digits alone, names and lists.
STATUS = """Name:\tpython -m mhaserve.cli serve
Umask:\t0022
State:\tS (sleeping)
Tgid:\t4242
Pid:\t4242
PPid:\t4200
Uid:\t0\t0\t0\t0
FDSize:\t128
Groups:\t
VmPeak:\t 2113492 kB
VmSize:\t 2048000 kB
VmHWM:\t  531200 kB
VmRSS:\t  523312 kB
RssAnon:\t  401000 kB
RssFile:\t  122312 kB
RssShmem:\t       0 kB
VmSwap:\t       0 kB
Threads:\t23
SigQ:\t0/96364
SigPnd:\t0000000000000000
SigCgt:\t0000000180004a02
CapInh:\t0000000000000000
Cpus_allowed:\t3
Cpus_allowed_list:\t0-1
voluntary_ctxt_switches:\t1500
"""


def test_status_sizes_and_counts_but_no_masks() -> None:
    fields = parse_status(STATUS)
    assert fields["VmRSS"] == 523_312 and fields["VmHWM"] == 531_200 and fields["RssAnon"] == 401_000
    assert fields["VmSwap"] == 0 and fields["Threads"] == 23 and fields["Pid"] == 4242
    # hex masks that happen to be all digits must not read as numbers; names and lists are not figures
    for key in ("SigPnd", "SigCgt", "CapInh", "Cpus_allowed", "Umask", "Uid", "SigQ", "Name", "State", "Groups"):
        assert key not in fields, key
    assert Memory.of(fields) == Memory(rss_kib=523_312, peak_kib=531_200, anon_kib=401_000)
    # RssAnon came with Linux 4.5: without it the memory is still read
    older = parse_status("\n".join(line for line in STATUS.splitlines() if not line.startswith("RssAnon")))
    assert Memory.of(older).anon_kib is None


def test_status_of_a_live_process() -> None:
    mine = Memory.of(status(os.getpid()))
    assert 0 < mine.rss_kib <= mine.peak_kib
    assert mine.anon_kib is not None and mine.anon_kib <= mine.rss_kib


def test_the_graphs_measured_and_those_skipped_with_why() -> None:
    servable = ("auto", "fp32", "optimized", "fp16")  # a server without --graph int8
    # asked for none: the CPU graphs the entry has, never fp16 (a GPU graph: its memory is not in RSS)
    assert memory.graphs_to_measure(None, {"fp32": 1, "fp16": 1}, servable) == (["fp32"], {})
    # int8 is found by the manifest's key alone; a server that cannot serve it skips it, saying so
    measured, skipped = memory.graphs_to_measure(None, ["int8", "fp16", "optimized", "fp32"], servable)
    assert measured == ["fp32", "optimized"] and list(skipped) == ["int8"]
    assert "cannot serve" in skipped["int8"] and "--graph" in skipped["int8"]
    assert memory.graphs_to_measure(None, ["int8", "fp32"], (*servable, "int8")) == (["fp32", "int8"], {})
    # asked for: in the order asked, fp16 too; a graph the entry lacks is skipped with what it has
    measured, skipped = memory.graphs_to_measure(("int8", "fp16", "fp32"), ["fp32", "optimized", "fp16"], servable)
    assert measured == ["fp16", "fp32"] and list(skipped) == ["int8"]
    assert skipped["int8"] == "the entry has no int8 graph (it has fp32, optimized, fp16)"


def test_workload_and_warm_up() -> None:
    assert memory.pick_workload(["fixed", "mixed", "short"]) == "short"
    assert memory.pick_workload(["fixed", "mixed"]) == "mixed"
    assert memory.pick_workload(["fixed"]) == "fixed"
    assert memory.warmup_requests(100_000, 2000) == 5000
    assert memory.warmup_requests(2000, 48) == 100
    assert memory.warmup_requests(100, 48) == 48  # every input at least once


def _run(rss_mib: list[float]) -> dict[str, object]:
    step = 10_000
    return {
        "requests": step * (len(rss_mib) - 1),
        "samples": [
            {"requests": k * step, "rss_kib": int(v * 1024), "peak_kib": int(max(rss_mib[: k + 1]) * 1024)}
            for k, v in enumerate(rss_mib)
        ],
    }


def test_growth_levelling_off_is_not_a_leak_and_a_leak_is_called_one() -> None:
    levelling = memory.growth(_run([500, 503, 504, 504, 504, 504]))
    assert levelling["growth_kib"] == 4 * 1024 and levelling["second_half_growth_kib"] == 0
    assert levelling["steady"] and levelling["end"]["requests"] == 50_000
    leaking = memory.growth(_run([500, 505, 510, 515, 520, 525]))
    assert leaking["growth_kib"] == 25 * 1024 and not leaking["steady"]
    assert leaking["slope_kib_per_10k"] == pytest.approx(5 * 1024)
    assert leaking["peak_growth_kib"] == 25 * 1024

    ok = memory.verdict({"fp32": {"summary": levelling}, "optimized": {"summary": levelling}})
    assert ok.startswith("no growth") and "+4.0 MiB" in ok
    bad = memory.verdict({"fp32": {"summary": levelling}, "int8": {"summary": leaking}})
    assert bad.startswith("GROWTH: int8 grew +25.0 MiB over 50,000 requests") and "fp32" not in bad
    assert memory.verdict({}) == "no graph was measured"


def test_a_short_run_against_a_real_server(tiny_server: Server) -> None:
    texts = ["a short query", "a sentence of a few more words than the query", "x " * 200]
    workload = Workload("short", "test", "texts", [[1, 2, 3]] * len(texts), texts)
    told: list[tuple[int, Memory]] = []
    run = memory.measure(
        tiny_server, workload, requests=60, clients=4, checkpoints=3, told=lambda n, m: told.append((n, m))
    )
    assert run["errors"] == {} and run["warmup_requests"] == 3 and run["clients"] == 4 and run["seconds"] > 0
    assert [s["requests"] for s in run["samples"]] == [0, 20, 40, 60]
    # each reading is told as it is taken, with the requests sent after the warm-up so far
    assert [(n, m.rss_kib) for n, m in told] == [(s["requests"], s["rss_kib"]) for s in run["samples"]]
    for reading in (run["start"], *run["samples"]):
        assert 0 < reading["rss_kib"] <= reading["peak_kib"]
    # the high-water mark never goes down
    peaks = [run["start"]["peak_kib"], *(s["peak_kib"] for s in run["samples"])]
    assert peaks == sorted(peaks)
    summary = memory.growth(run)
    assert summary["end"] == run["samples"][-1] and summary["warm"] == run["samples"][0]
