"""deploy/prometheus/ checked by promtool, and Prometheus scraping a real server with the repo's config.

The live test keeps the repo's prometheus.yml and alerts.yml and changes only what must differ outside
Docker: the replica's address (a static loopback target instead of Docker's DNS) and the intervals.
Every Grafana panel query and every alert expression is then run against it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service import openai, tei
from mhaserve.service.kserve import rest as kserve_rest
from mhaserve.testing.loopback import free_port
from tests.deploy.helpers import (
    DEPLOY,
    WAIT,
    Process,
    Replica,
    encode,
    find_binary,
    http_get,
    needs,
    wait_until,
)

PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "mhaserve.json"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = find_binary("promtool")
    assert exe is not None
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=WAIT, cwd=PROMETHEUS_DIR)


@pytest.mark.integration
@needs("promtool", "prometheus")
def test_promtool_accepts_config_and_rules() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
@needs("promtool", "prometheus")
def test_alert_rules_fire_as_their_unit_tests_say() -> None:
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def loopback_config(workdir: Path, metrics_port: int, prometheus_port: int) -> Path:
    """The repo's config with the replica at a loopback address and 1 s intervals."""
    config: dict[str, Any] = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["mhaserve"]
    assert job.pop("dns_sd_configs"), "the mhaserve job discovers replicas through Docker's DNS"
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    jobs["prometheus"]["static_configs"] = [{"targets": [f"127.0.0.1:{prometheus_port}"]}]
    for rule_file in config["rule_files"]:
        shutil.copy(PROMETHEUS_DIR / rule_file, workdir / rule_file)
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


class Prometheus(Process):
    def __init__(self, replica: Replica, workdir: Path) -> None:
        self.port = free_port()
        config = loopback_config(workdir, replica.metrics_port, self.port)
        exe = find_binary("prometheus")
        assert exe is not None
        args = [exe, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}"]
        args += [f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        super().__init__(args, workdir / "prometheus.log", cwd=workdir)
        try:
            wait_until(lambda: not self.alive() or self.ready(), "Prometheus to be ready", interval=0.2)
            assert self.alive(), f"prometheus exited:\n{self.log()}"
        except BaseException:
            self.stop()
            raise

    def ready(self) -> bool:
        try:
            http_get(f"http://127.0.0.1:{self.port}/-/ready", timeout=1)
            return True
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = http_get(url)
        except urllib.error.HTTPError as e:  # 400 for a bad query: its body says why
            body = e.read()
        return json.loads(body)

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = self.api("query", query=expr)
        assert answer["status"] == "success", f"{expr!r}: {answer.get('error')}"
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[Replica], Prometheus]]:
    started: list[Prometheus] = []

    def start(replica: Replica) -> Prometheus:
        workdir = tmp_path / "prometheus"
        workdir.mkdir()
        started.append(Prometheus(replica, workdir))
        return started[-1]

    try:
        yield start
    finally:
        for p in started:
            p.stop()


def dashboard_queries(rate_interval: str = "10s") -> list[tuple[str, str]]:
    """(panel title, expr) for every query of the dashboard, with Grafana's variables filled in."""
    dashboard = json.loads(DASHBOARD.read_text())
    # Grafana's own interval variables, then every selector the dashboard defines set to "all" (a selector
    # added later is filled without touching this test; a query naming an undefined one still fails below).
    fill = {"$__rate_interval": rate_interval, "$__interval": "1s"}
    fill |= {f"${v['name']}": ".*" for v in dashboard["templating"]["list"] if v["type"] != "datasource"}
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in fill.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unfilled variable in {panel['title']!r}: {expr}"
            queries.append((panel["title"], expr))
    return queries


def alert_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    return [(r["alert"], r["expr"]) for group in rules["groups"] for r in group["rules"]]


@pytest.mark.integration
@needs("promtool", "prometheus")
def test_the_server_errors_panel_counts_what_the_alert_counts(tmp_path: Path) -> None:
    """The dashboard's "Server errors" stat read mhaserve_requests_total alone, where MhaserveServerErrors counts
    the responses within streams too: a stream whose every response fails is one OK call, so the panel said 0 %
    while the alert fired. promtool evaluates both over one replica's series: the panel's ratio is the alert's."""
    (panel,) = [expr for title, expr in dashboard_queries(rate_interval="5m") if title == "Server errors"]
    (alert,) = [expr for name, expr in alert_exprs() if name == "MhaserveServerErrors"]
    ratio = alert.rsplit(">", 1)[0]  # the alert's expression without its threshold
    series = {
        'mhaserve_requests_total{method="encoder.v1.EncoderService/Encode", code="OK"}': "0+95x15",
        'mhaserve_requests_total{method="encoder.v1.EncoderService/Encode", code="INTERNAL"}': "0+5x15",
        'mhaserve_requests_total{method="encoder.v1.EncoderService/EncodeStream", code="OK"}': "0+10x15",
        'mhaserve_stream_responses_total{method="encoder.v1.EncoderService/EncodeStream", code="OK"}': "0+900x15",
        'mhaserve_stream_responses_total{method="encoder.v1.EncoderService/EncodeStream", code="INTERNAL"}': "0+100x15",
    }
    test = {
        "rule_files": [],
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": name.replace("{", '{job="mhaserve", instance="a:8000", '), "values": values}
                    for name, values in series.items()
                ],
                "promql_expr_test": [
                    {
                        "expr": f"abs(({panel}) - on() ({ratio})) < bool 1e-9",
                        "eval_time": "12m",
                        "exp_samples": [{"labels": "{}", "value": 1}],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "server_errors_test.yml"
    path.write_text(yaml.safe_dump(test))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
@needs("promtool", "prometheus")
def test_a_by_replica_line_with_a_zero_default_draws_no_blank_line_beside_the_replicas(tmp_path: Path) -> None:
    """Lines by replica that show 0 when no series exists yet (`or vector(0)`) drew an unlabelled 0 line beside the
    replicas' once there were series (`or` keeps what the other side lacks by its labels, and `{}` matches
    none): the 0 only where nothing else is. promtool evaluates each such query over two replicas' series."""
    queries = [(title, expr) for title, expr in dashboard_queries(rate_interval="5m") if "sum by (instance" in expr]
    queries = [(title, expr) for title, expr in queries if "vector(0)" in expr]
    assert queries, "no dashboard line by replica with a zero default: the test reads nothing"
    instances = ["a:8000", "b:8000"]
    series = [
        {"series": f'{metric}{{job="mhaserve", instance="{i}", model="m", version="1"}}', "values": "1x15"}
        for i in instances
        for metric in ("mhaserve_process_restarts_total", "mhaserve_model_load_failures_total")
    ]
    nothing_yet = [{"series": f'up{{job="mhaserve", instance="{i}"}}', "values": "1x15"} for i in instances]
    tests = [
        {
            "interval": "1m",
            "input_series": given,
            "promql_expr_test": [
                {"expr": f"count(({expr}) * 0 + 1)", "eval_time": "12m", "exp_samples": [{"labels": "{}", "value": n}]}
            ],
        }
        for _, expr in queries
        for given, n in ((series, len(instances)), (nothing_yet, 1))  # the replicas' lines; the one 0 line
    ]
    path = tmp_path / "zero_default_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "tests": tests}))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, f"{[t for t, _ in queries]}\n{result.stdout}{result.stderr}"


@pytest.mark.integration
@pytest.mark.slow
@needs("prometheus")
@pytest.mark.timeout(180)
def test_prometheus_scrapes_a_replica_and_sees_requests_counted(
    replicas: Callable[[int], list[Replica]], prometheus: Callable[[Replica], Prometheus]
) -> None:
    (replica,) = replicas(1)
    prom = prometheus(replica)
    wait_until(lambda: prom.value('up{job="mhaserve"}') == 1.0, "the replica's target to be up")

    counted = 'sum(mhaserve_requests_total{job="mhaserve", code="OK"})'
    with grpc.insecure_channel(replica.address) as ch:
        stub = pb_grpc.EncoderServiceStub(ch)
        for total in (10, 25):
            while (replica.encode_ok()) < total:
                encode(stub, "count me")
            wait_until(lambda t=total: (prom.value(counted) or 0) >= t, f"Prometheus to count {total} requests")  # type: ignore[misc]
    assert prom.value(counted) == 25.0

    # The rules loaded and evaluate without error.
    def rules_healthy() -> bool:
        groups = prom.api("rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return len(rules) == len(alert_exprs()) and all(r["health"] == "ok" for r in rules)

    wait_until(rules_healthy, "the alert rules to evaluate")
    firing = [a["labels"]["alertname"] for a in prom.api("alerts")["data"]["alerts"]]
    assert not firing, f"alerts fire against a healthy replica: {firing}"

    # Every query the alerts and the dashboard make is valid PromQL over the server's real series, and
    # every panel has data (rates and percentiles need traffic between two scrapes in their window).
    for _alert, expr in alert_exprs():
        prom.query(expr)
    with grpc.insecure_channel(replica.address) as ch:
        stub = pb_grpc.EncoderServiceStub(ch)
        for _ in range(20):
            encode(stub, "keep the rates up")

    def empty_panels() -> list[str]:
        return [title for title, expr in dashboard_queries() if not prom.query(expr)]

    try:
        wait_until(lambda: not empty_panels(), "every dashboard panel to show data", timeout=15)
    except AssertionError:
        raise AssertionError(f"dashboard panels without data: {empty_panels()}") from None


# The labels of the unary inference calls, as the server names them (a gRPC method with or without its
# leading slash, as the two fronts differ; an HTTP route by its template), each route from the code that
# serves it, so a route added there is checked here.
UNARY_INFERENCE_METHODS = [
    *(
        f"{slash}{method}"
        for slash in ("", "/")
        for method in (
            "encoder.v1.EncoderService/Encode",
            "inference.GRPCInferenceService/ModelInfer",
            "tei.v1.Embed/Embed",
        )
    ),
    *(f"POST {path}" for path in (*openai.EMBEDDINGS_PATHS, tei.EMBED_PATH, tei.SIMILARITY_PATH, *tei.ROOT_PATHS)),
    *(f"POST {kserve_rest.PREFIX}/models/{{model_name}}{v}/infer" for v in ("", "/versions/{model_version}")),
]
# Calls that last longer by nature, or that compute nothing: not the alert's.
OTHER_METHODS = [
    "/encoder.v1.EncoderService/EncodeStream",
    "inference.GRPCInferenceService/ModelStreamInfer",
    "tei.v1.Embed/EmbedStream",
    "encoder.v1.EncoderService/ListModels",
    "POST /tokenize",
    "POST /v2/repository/models/{model_name}/load",
    "GET /v2/models/{model_name}/ready",
]


def slow_request_methods() -> list[tuple[str, re.Pattern[str]]]:
    """(where, the method regex) of the slow-request alert and of the dashboard's p99 panel, anchored as
    Prometheus anchors a `=~` match."""
    found = [(name, expr) for name, expr in alert_exprs() if name == "MhaserveSlowRequests"]
    found += [(title, expr) for title, expr in dashboard_queries() if "ModelInfer" in expr]
    assert len(found) == 2, found
    regexes = []
    for where, expr in found:
        (pattern,) = [m for m in re.findall(r'method=~"([^"]+)"', expr.replace('\\"', '"')) if "Encode" in m]
        regexes.append((where, re.compile(f"^(?:{pattern})$")))
    return regexes


@pytest.mark.parametrize("method", UNARY_INFERENCE_METHODS)
def test_slow_request_alert_and_p99_panel_see_every_unary_inference_call(method: str) -> None:
    for where, regex in slow_request_methods():
        assert regex.match(method), f"{where} does not see {method}"


@pytest.mark.parametrize("method", OTHER_METHODS)
def test_slow_request_alert_leaves_streams_and_control_calls_out(method: str) -> None:
    for where, regex in slow_request_methods():
        assert not regex.match(method), f"{where} counts {method}"
