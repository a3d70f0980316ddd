"""docs/reliability.md from a run: the machine and command, each check and whether it passed, the figures."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from mhaserve.loadtest.reliability.results import OVERLOAD_CLIENT_BATCH, Run


def _ms(seconds: float) -> str:
    return "–" if math.isnan(seconds) else f"{seconds * 1000:.1f} ms"


def _codes(codes: Counter[str] | dict[str, int]) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(codes.items(), key=lambda kv: -kv[1])) or "none"


def _ok_re(codes: Counter[str] | dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in codes.items() if k in ("OK", "RESOURCE_EXHAUSTED")}


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def render(run: Run) -> str:
    r = run.results
    failed = [c for c in run.checks if not c.passed]
    out = [
        "# Reliability: what mhaserve survives, measured",
        "",
        "Written by `make reliability` (`loadtest/reliability/`); the short versions of the same scenarios run in",
        "`make test` (`tests/reliability/`, `tests/security/`). Traffic goes to 127.0.0.1 only. Latencies depend on",
        "the machine and on what else ran on it; codes and counts do not.",
        "",
        f"- command: `{run.command}`",
        f"- run: {run.started}, {sum(run.seconds.values()):.0f} s of scenarios",
        f"- model: {run.model}, on the CPU",
        *[f"- {k}: {v}" for k, v in run.machine.items()],
        "",
        f"**{len(run.checks) - len(failed)} of {len(run.checks)} checks passed.**"
        + (" Failed: " + "; ".join(f"{c.scenario}: {c.what}" for c in failed) + "." if failed else ""),
        "",
        *_table(
            ["scenario", "check", "result"],
            ((c.scenario, c.what, "pass" if c.passed else "**FAIL**") for c in run.checks),
        ),
        "",
    ]
    if "bad input" in r:
        f = r["bad input"]
        out += [
            "## Bad input (property-based)",
            "",
            "Hypothesis drew requests over every field of both APIs against one running server: texts of random",
            "unicode with control characters, NUL, BOM and bidi overrides, empty and huge (up to 5 MB, past the",
            "message limit); token id lists empty, past the model's length, with negative, past-the-vocabulary and",
            "int64-extreme ids; more inputs than allowed; hostile model names (`../`, absolute paths, NUL, unicode",
            "dots) and versions; Open Inference Protocol tensors of every name, datatype and shape, raw contents cut",
            "short or too long, masks of any values and shapes, parameters of every type; random `x-request-id`.",
            "After every case, health had to say SERVING and a good request (both APIs) had to get the answer it",
            "got before the fuzzing.",
            "",
            *_table(
                ["API", "cases tried", "status codes received (stream responses included)"],
                ((api, f.cases[api], _codes(f.codes[api])) for api in f.cases),
            ),
            "",
            f"{sum(f.cases.values())} cases in {f.seconds:.0f} s, {f.checks_after} health-and-good-request checks "
            f"after them; failures: {'; '.join(f.failures) if f.failures else 'none'}.",
            "",
        ]
    if "overload" in r:
        runs = r["overload"]
        first = runs[0]
        out += [
            "## Overload",
            "",
            f"A real `mhaserve serve` with `--max-queue-size {first.max_queue_size}` (inputs) and",
            f"`--max-client-batch-size {OVERLOAD_CLIENT_BATCH}` (the queue must hold the largest request a client may",
            "send: a server whose queue is smaller refuses to start). For each factor: the",
            "capacity measured with 8 closed-loop clients; then an open-loop burst of requests (one text each) at",
            f"that factor times the capacity for {first.burst_seconds:g} s, whatever the answers; then closed-loop",
            "clients again, measuring how soon the throughput is back. Every OK answer was compared with that",
            "text's embedding; the server's own counts (its metrics) with what the clients received.",
            "",
            "The queue limit bounds what an admitted request waits for: the batch computing when it came, the",
            "inputs queued ahead of it and its own batch, each at most a queue's worth, so 3 x queue / throughput",
            "(plus the rest of its path, the closed-loop p99) whatever the offered load. To keep admitted latency",
            "under L seconds, set `--max-queue-size` to about L x throughput / 3, and `--max-client-batch-size`",
            "no higher. Refusals are answered before",
            "tokenisation, so they cost little and come at once.",
            "",
            *_table(
                ["", *[f"{o.factor:g}x capacity" for o in runs]],
                [
                    ("capacity before (requests/s)", *[f"{o.capacity:.0f}" for o in runs]),
                    (
                        "offered / really sent (requests/s)",
                        *[f"{o.offered_rate:.0f} / {o.sent_rate:.0f}" for o in runs],
                    ),
                    ("requests in the burst", *[o.sent for o in runs]),
                    ("codes received in the burst", *[_codes(o.codes) for o in runs]),
                    ("answers lost / wrong", *[f"{o.lost} / {o.wrong}" for o in runs]),
                    ("whole run: clients received", *[_codes(_ok_re(o.client_codes)) for o in runs]),
                    ("whole run: server counted", *[_codes(_ok_re(o.server_codes)) for o in runs]),
                    (
                        "admitted p50 / p99 / max",
                        *[f"{_ms(o.admitted.p50)} / {_ms(o.admitted.p99)} / {_ms(o.admitted.max)}" for o in runs],
                    ),
                    ("throughput in the burst (OK/s)", *[f"{o.burst_throughput:.0f}" for o in runs]),
                    ("bound: 3 x queue / throughput + closed-loop p99", *[_ms(o.bound) for o in runs]),
                    ("refused p50 / p99", *[f"{_ms(o.refused.p50)} / {_ms(o.refused.p99)}" for o in runs]),
                    ("after the burst, OK/s per 0.5 s", *[", ".join(f"{v:.0f}" for v in o.after[:8]) for o in runs]),
                    (
                        "back to 80% of capacity after",
                        *["never" if o.recovery is None else f"{o.recovery:g} s" for o in runs],
                    ),
                ],
            ),
            "",
        ]
        short = [o for o in runs if o.sent_rate < 0.9 * o.offered_rate]
        if short:
            out += [
                "At " + ", ".join(f"{o.factor:g}x" for o in short) + " the load generator, on the same cores as the "
                "server, sent less than 90 % of the offered rate ("
                + ", ".join(f"{o.sent_rate:.0f} of {o.offered_rate:.0f} a second" for o in short)
                + "): the cores, shared by the model, the server's front and the client, could not carry the calls. "
                "There the request path, not the model, is the bottleneck, and calls wait in gRPC before the service "
                "sees them, so neither the queue limit nor fast refusals hold (Known limits, below).",
                "",
            ]
    if "deadlines" in r:
        d = r["deadlines"]
        b, a = d.before, d.after
        out += [
            "## Deadlines and cancellation",
            "",
            f"{d.cycles} cycles, each with a batch held in the engine and, queued behind it: requests with a "
            f"{d.deadline:g} s",
            "deadline, requests the client cancelled, and streams cancelled with requests queued. Counted in the",
            "server's process before and after (a garbage collection first).",
            "",
            *_table(
                ["figure", "value"],
                [
                    ("expired while queued", f"{d.expired_sent}: {_codes(d.expired_codes)}"),
                    *(
                        [("batches of them sent again, not queued within half their deadline", d.retried)]
                        if d.retried
                        else []
                    ),
                    ("cancelled while queued", f"{d.cancelled_sent}: {_codes(d.cancelled_codes)}"),
                    ("streams cancelled", f"{d.streams_cancelled} ({d.stream_requests} requests queued in them)"),
                    ("of these, inputs that reached the model", d.reached_model),
                    (
                        "server counted DEADLINE_EXCEEDED / CANCELLED",
                        f"{d.server_deadline_exceeded} / {d.server_cancelled}",
                    ),
                ],
            ),
            "",
            *_table(
                ["held by the server", "before", "after"],
                [
                    ("asyncio tasks", b.tasks, a.tasks),
                    ("batcher jobs / sequences alive", f"{b.jobs} / {b.seqs}", f"{a.jobs} / {a.seqs}"),
                    ("RPCs in flight", b.in_flight, a.in_flight),
                    ("queue depth", b.depth, a.depth),
                    ("threads (server and clients: one process)", b.threads, a.threads),
                ],
            ),
            "",
        ]
    if "engine errors" in r:
        e, h = r["engine errors"], r["engine hangs"]
        stuck = r.get("stuck engine exit")
        out += [
            "## Faults",
            "",
            f"An engine that raises on batches holding a marker token: {e.requests} concurrent requests, "
            f"{e.poisoned} of them holding it.",
            "",
            *_table(
                ["figure", "value"],
                [
                    ("requests with the marker", _codes(e.poisoned_codes)),
                    ("the others", _codes(e.codes)),
                    ("the others that shared a batch with the marker (run again without it)", e.shared_with_poison),
                    ("the others that failed", e.failed_without_poison),
                    ("wrong answers", e.wrong),
                    ("SERVING and right afterwards", e.serving_after),
                ],
            ),
            "",
            f"An engine that hangs (until released) with `--inference-timeout 0.5`, {h.hangs} times:",
            "",
            *_table(
                ["figure", "value"],
                [
                    ("the request in the stuck batch", _codes(h.hung_codes)),
                    ("requests queued behind it", _codes(h.queued_codes)),
                    ("requests sent while stuck", _codes(h.refused_codes)),
                    ("health while stuck", _codes(h.health_while_stuck)),
                    ("serving again after the engine returned", f"{h.recovered} of {h.hangs}"),
                    ("message", "; ".join(sorted(h.hang_messages))),
                ],
            ),
            "",
        ]
        if stuck is not None:
            out += [
                f"A `mhaserve serve` process whose engine stays stuck: the request got {stuck.hung_code}, and SIGTERM "
                f"ended the process in {stuck.seconds:.1f} s with status {stuck.exit_code} (the stuck inference "
                "thread cannot hold its exit).",
                "",
            ]
    if "soak" in r:
        s = r["soak"]
        steady = s.steady()
        first, last = steady[0], steady[-1]
        peak = max(x.rss_kib for x in steady)
        out += [
            "## Long run (soak)",
            "",
            f"{s.clients} closed-loop clients for {s.seconds:g} s against a real `mhaserve serve`; its resident",
            "memory, open descriptors and threads sampled from /proc; the memory slope is a least-squares fit",
            f"after the first {s.warmup:g} s (warm-up: ONNX Runtime's arena, allocator pools).",
            "",
            *_table(
                ["figure", "value"],
                [
                    ("requests", f"{s.requests} ({s.requests / s.seconds:.0f}/s): {_codes(s.codes)}"),
                    (
                        "resident memory after warm-up",
                        f"{first.rss_kib / 1024:.1f} MiB -> {last.rss_kib / 1024:.1f} MiB (peak {peak / 1024:.1f} MiB)",
                    ),
                    ("memory slope after warm-up", f"{s.rss_slope_kib_per_min:+.1f} KiB/min"),
                    ("bound", f"{s.bound_kib_per_min:g} KiB/min"),
                    ("open descriptors", f"{first.fds} -> {last.fds} (max {max(x.fds for x in steady)})"),
                    ("threads", f"{first.threads} -> {last.threads} (max {max(x.threads for x in steady)})"),
                    ("samples", len(s.samples)),
                ],
            ),
            "",
            "Resident memory after warm-up, MiB (lowest and highest at the ends):",
            "",
            "```",
            _sparkline(s),
            "```",
            "",
        ]
    if "shutdown" in r:
        sd = r["shutdown"]
        out += [
            "## Shutdown under load",
            "",
            f"{sd.clients} closed-loop clients against a real `mhaserve serve`, then {sd.signal}; the clients went on",
            "until the server was gone.",
            "",
            *_table(
                ["figure", "value"],
                [
                    ("requests sent", sd.sent),
                    ("codes received", _codes(sd.codes)),
                    (
                        "in flight at the signal / answered OK / refused at the door",
                        f"{sd.in_flight_at_signal} / {sd.in_flight_ok} / {sd.in_flight_refused}",
                    ),
                    ("UNAVAILABLE, why", _codes(sd.unavailable)),
                    ("CANCELLED sent before the signal", sd.cancelled_sent_before_signal),
                    ("OK answers in the server's log / received", f"{sd.server_ok} / {sd.codes.get('OK', 0)}"),
                    ("exit status, seconds after the signal", f"{sd.exit_code}, {sd.exit_seconds:.2f} s"),
                ],
            ),
            "",
            "CANCELLED, when it appears, is gRPC's own answer to a call that reached the server in the instant it",
            "stopped accepting (grpc/grpc#41785): the service never saw it, so it was not accepted and not lost;",
            "clients should retry it like UNAVAILABLE.",
            "",
        ]
        for f in r.get("second signal", []):
            out.append(
                f"- {f.signals}, a request held in the engine: still draining after the first "
                f"({f.after_first_still_running}), exit status {f.exit_code} {f.seconds_after_second:.2f} s after "
                "the second."
            )
        out.append("")
    out += [
        "## Known limits",
        "",
        "- On grpc.aio's front (`--grpc-front grpc`), requests gRPC refuses before the service sees them (a",
        "  message over `--max-message-bytes`, a call arriving as the server stops, one whose deadline passed",
        "  while it waited in gRPC) are not in `mhaserve_requests_total`; the lean front, the default, counts",
        "  those it refuses as it reads them.",
        "- A stuck inference thread cannot be killed from inside the process: the server fails its requests,",
        "  reports NOT_SERVING and waits for it; only a restart (the orchestrator's, on NOT_SERVING) frees it.",
        "- The queue limit bounds latency when the model is the bottleneck. When the request path itself is (a",
        "  tiny model, a fast GPU, few cores, a flood of calls), calls wait in gRPC before the service sees them;",
        "  past 20000 of them gRPC sheds the excess itself (CANCELLED). A refusal is cheap next to the model but",
        "  not free: one gRPC call refused for a full queue takes 0.54-0.67 ms of the server's CPU on a 2-vCPU",
        "  Intel Xeon, against 0.34-0.41 ms for an empty grpc.aio call (docs/benchmarks.md), so on such a host",
        "  a flood of a few thousand calls a second outruns one event loop. Add replicas, or cores per replica.",
        "",
    ]
    return "\n".join(out)


def _sparkline(soak: Any, width: int = 60) -> str:
    samples = soak.steady()
    if not samples:
        return ""
    picked = samples[:: max(1, math.ceil(len(samples) / width))]
    lo = min(s.rss_kib for s in picked)
    hi = max(s.rss_kib for s in picked)
    bars = "▁▂▃▄▅▆▇█"
    line = "".join(bars[0 if hi == lo else round((s.rss_kib - lo) / (hi - lo) * (len(bars) - 1))] for s in picked)
    return f"{lo / 1024:.1f} {line} {hi / 1024:.1f}"
