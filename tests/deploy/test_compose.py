"""The compose files: validated by docker-compose (no engine needed) and checked against the server.

Debian's `docker-compose` (Compose v1.29) validates a file against the Compose Specification without a
Docker engine. It does not know Compose v2's `!reset` tag, which docker-compose.cpu.yml needs to drop
the GPU reservation; that override is merged here by the specification's rules (mappings merge,
sequences append, `!reset` removes) and the result is validated instead.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.helpers import ROOT, WAIT, compose_file, find_binary, needs, server_defaults

PROFILES = ["", "lb", "loadtest", "monitoring", "lb,loadtest,monitoring"]
OVERRIDES = ["docker-compose.models.yml", "docker-compose.nginx.yml"]


def compose_env() -> dict[str, str]:
    """The caller's environment without the variables the compose files read, so defaults are tested."""
    prefixes = ("MHASERVE_", "LOCUST_", "LOADTEST_", "GRAFANA_", "PROMETHEUS_", "COMPOSE_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def profile_args(profiles: str) -> list[str]:
    return [arg for p in profiles.split(",") if p for arg in ("--profile", p)]


def docker_compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = find_binary("docker-compose")
    assert exe is not None
    return subprocess.run(
        [exe, "--project-directory", str(ROOT), *args],
        capture_output=True,
        text=True,
        timeout=WAIT,
        cwd=ROOT,
        env=env or compose_env(),
    )


@pytest.mark.integration
@needs("docker-compose")
@pytest.mark.parametrize("profile", PROFILES, ids=[p or "default" for p in PROFILES])
def test_compose_config_is_valid_for_every_profile(profile: str) -> None:
    args = ["-f", "docker-compose.yml", *profile_args(profile)]
    result = docker_compose(*args, "config", "-q")
    assert result.returncode == 0, result.stderr


@pytest.mark.integration
@needs("docker-compose")
@pytest.mark.parametrize("override", OVERRIDES)
def test_compose_override_is_valid(override: str) -> None:
    result = docker_compose("-f", "docker-compose.yml", "-f", override, "config", "-q")
    assert result.returncode == 0, result.stderr


@pytest.mark.integration
@needs("docker-compose")
def test_scaled_replicas_publish_no_fixed_host_port() -> None:
    """With the documented variables, `--scale encoder=N` gets ephemeral host ports (no clash)."""
    env = compose_env() | {
        "MHASERVE_GRPC_PUBLISH": "50051",
        "MHASERVE_HTTP_PUBLISH": "8080",
        "MHASERVE_METRICS_PUBLISH": "127.0.0.1::8000",
    }
    result = docker_compose("--profile", "lb", "config", env=env)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    for port in config["services"]["encoder"]["ports"]:
        published = port.get("published") if isinstance(port, dict) else port.split(":")[-2]
        assert not published, f"a replica publishes a fixed host port: {port}"
    # Long form ({published, target}), or a string where a host address is given (HAProxy's stats port).
    lb = [p if isinstance(p, dict) else dict(zip(("published", "target"), p.split(":")[-2:], strict=True)) for p in
          config["services"]["lb"]["ports"]]  # fmt: skip
    published = {str(p["published"]): int(str(p["target"]).split("/")[0]) for p in lb}
    assert published["50050"] == 50051 and published["8079"] == 8080, published


def test_every_setting_reaches_the_encoder_container() -> None:
    """The header and docs/deploy.md say every MHASERVE_* setting passes through from the shell or .env; a
    .env only feeds the file's own ${} substitutions, so each must be listed under `environment:` (without a
    value: passed when set, else the server's default). --processes, the keys and TLS were missing."""
    from mhaserve.service.settings import ENV_PREFIX, Settings

    listed = compose_file()["services"]["encoder"]["environment"]
    missing = [ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Settings)]
    assert not [name for name in missing if name not in listed]


class Reset:
    """The `!reset` tag of a Compose v2 override file: remove the key from the merged model."""


def load_override(path: Path) -> dict[str, Any]:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!reset", lambda loader, node: Reset())
    doc: dict[str, Any] = yaml.load(path.read_text(), Loader=Loader)  # SafeLoader plus one tag
    return doc


def merge(base: Any, override: Any) -> Any:
    """Compose's merge rules, as far as the repo's overrides use them."""
    if isinstance(override, Reset):
        return Reset()
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge(base[key], value) if key in base else value
        return {k: v for k, v in merged.items() if not isinstance(v, Reset)}
    if isinstance(base, list) and isinstance(override, list):
        return base + override
    return override


def cpu_stack() -> dict[str, Any]:
    merged: dict[str, Any] = merge(compose_file(), load_override(ROOT / "docker-compose.cpu.yml"))
    return merged


def test_cpu_override_drops_the_gpu_and_keeps_the_rest() -> None:
    encoder = cpu_stack()["services"]["encoder"]
    assert "devices" not in encoder["deploy"]["resources"]["reservations"]
    assert encoder["build"]["target"] == "cpu"
    assert encoder["environment"]["MHASERVE_DEVICE"] == "cpu"
    base = compose_file()["services"]["encoder"]
    for key in ("healthcheck", "ports", "restart", "stop_grace_period"):
        assert encoder[key] == base[key]
    assert set(cpu_stack()["services"]) == set(compose_file()["services"])


@pytest.mark.integration
@needs("docker-compose")
@pytest.mark.parametrize("profile", PROFILES, ids=[p or "default" for p in PROFILES])
def test_cpu_stack_is_valid(tmp_path: Path, profile: str) -> None:
    merged = tmp_path / "docker-compose.cpu-merged.yml"
    merged.write_text(yaml.safe_dump(cpu_stack()))
    args = ["-f", str(merged), *profile_args(profile)]
    result = docker_compose(*args, "config", "-q")
    assert result.returncode == 0, result.stderr


def seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)s", str(duration))
    assert m, f"expected a duration like 40s, got {duration!r}"
    return float(m.group(1))


def test_encoder_service_matches_the_server() -> None:
    defaults = server_defaults()
    encoder = compose_file()["services"]["encoder"]
    env = encoder["environment"]
    assert env["MHASERVE_HOST"] == "0.0.0.0", "a container must listen on all its interfaces"
    assert int(env["MHASERVE_PORT"]) == defaults.port
    assert int(env["MHASERVE_METRICS_PORT"]) == defaults.metrics_port
    assert int(env["MHASERVE_HTTP_PORT"]) == 8080, "the images, the balancer and the manifests expect 8080"
    # Every variable is one the server reads (a typo would be silently ignored).
    from mhaserve.service.settings import env_var

    known = {env_var(f.name) for f in dataclasses.fields(defaults)}
    assert set(env) <= known, f"unknown settings: {set(env) - known}"
    # Default ports: gRPC published as is; metrics on loopback only.
    assert encoder["ports"][0].endswith(f"{defaults.port}:{defaults.port}}}")
    assert encoder["ports"][1].endswith("8080:8080}")
    assert encoder["ports"][2].endswith(f"127.0.0.1:{defaults.metrics_port}:{defaults.metrics_port}}}")
    gpu = encoder["deploy"]["resources"]["reservations"]["devices"]
    assert gpu == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert {k: v for k, v in encoder["build"].items() if k != "args"} == {"context": ".", "target": "gpu"}
    assert encoder["restart"] in ("always", "unless-stopped")
    # The image's check (deploy/images/entrypoint.sh): it finds the port as the server does, `--port` included.
    assert encoder["healthcheck"]["test"] == ["CMD", "mhaserve-entrypoint", "healthcheck"]
    # Docker's SIGKILL must not cut the server's drain (its delay, then its grace period) short.
    grace = float(re.search(r"MHASERVE_GRACE_PERIOD:-(\d+)", env["MHASERVE_GRACE_PERIOD"]).group(1))  # type: ignore[union-attr]
    delay = float(re.search(r"MHASERVE_DRAIN_DELAY:-(\d+)", env["MHASERVE_DRAIN_DELAY"]).group(1))  # type: ignore[union-attr]
    assert grace == defaults.grace_period
    assert delay > 0, "without a drain delay a balancer learns of a stop only from refused calls"
    assert seconds(encoder["stop_grace_period"]) > delay + grace


IMAGE_VARIABLES = {
    "encoder": ("MHASERVE_IMAGE", "mhaserve:gpu"),
    "lb": ("HAPROXY_IMAGE", "docker.io/library/haproxy:3.0-alpine"),
    "locust-master": ("LOADTEST_IMAGE", "mhaserve:loadtest"),
    "locust-worker": ("LOADTEST_IMAGE", "mhaserve:loadtest"),
    "prometheus": ("PROMETHEUS_IMAGE", "docker.io/prom/prometheus:v3.5.0"),
    "grafana": ("GRAFANA_IMAGE", "docker.io/grafana/grafana:11.6.0"),
}


def test_every_image_is_a_variable_with_a_public_default() -> None:
    """Hosts without a registry point the variables at images they built (deploy/images/build.sh)."""
    services = compose_file()["services"]
    assert set(services) == set(IMAGE_VARIABLES)
    for name, (variable, default) in IMAGE_VARIABLES.items():
        assert services[name]["image"] == f"${{{variable}:-{default}}}", name
    assert cpu_stack()["services"]["encoder"]["image"] == "${MHASERVE_IMAGE:-mhaserve:cpu}"


def test_build_args_pass_through_to_arguments_the_dockerfile_declares() -> None:
    declared = set(re.findall(r"^ARG (\w+)", (ROOT / "Dockerfile").read_text(), re.M))
    services = compose_file()["services"]
    for name in ("encoder", "locust-master"):
        args = services[name]["build"]["args"]
        assert all("=" not in a for a in args), "no values: they pass through from the shell when set"
        assert set(args) <= declared, f"{name}: {set(args) - declared} are not ARGs of the Dockerfile"


def test_profiles_and_their_files() -> None:
    services = compose_file()["services"]
    profiles = {name: tuple(s.get("profiles", [])) for name, s in services.items()}
    assert profiles == {
        "encoder": (),
        "lb": ("lb",),
        "locust-master": ("loadtest",),
        "locust-worker": ("loadtest",),
        "prometheus": ("monitoring",),
        "grafana": ("monitoring",),
    }
    # Every file a service mounts from the repo exists.
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repo"
    # The balancer runs the repo's configuration; the load test runs the repo's locustfile.
    assert "./deploy/haproxy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in services["lb"]["volumes"]
    assert services["locust-master"]["build"]["target"] == "loadtest"
    assert (ROOT / "loadtest" / "locustfile.py").is_file()
    (master_command,) = services["locust-master"]["command"]
    assert 'exec locust --master --host "$${LOADTEST_TARGET:-$$target}"' in master_command
    assert services["locust-worker"]["command"][:3] == ["--worker", "--master-host", "locust-master"]
    assert "ports" not in services["locust-worker"], "workers are scaled: they must not publish ports"


def test_monitoring_wiring_agrees() -> None:
    """Prometheus finds the replicas by the service name on the metrics port; Grafana finds Prometheus."""
    services = compose_file()["services"]
    prom_cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    job = next(j for j in prom_cfg["scrape_configs"] if j["job_name"] == "mhaserve")
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["encoder"] and sd["type"] == "A"
    assert sd["port"] == server_defaults().metrics_port
    assert any(v.startswith("./deploy/prometheus:/etc/prometheus") for v in services["prometheus"]["volumes"])
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]

    datasources = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["type"] == "prometheus"
    providers = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/mhaserve.yml").read_text())
    path = providers["providers"][0]["options"]["path"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/dashboards"] == path
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_nginx_override_swaps_the_balancer_and_nothing_else() -> None:
    """docker-compose.nginx.yml: the documented alternative to HAProxy, on the same ports."""
    override = load_override(ROOT / "docker-compose.nginx.yml")
    assert set(override["services"]) == {"lb"}
    merged = merge(compose_file(), override)["services"]["lb"]
    assert merged["image"] == "${NGINX_IMAGE:-docker.io/library/nginx:1.28-alpine}"
    assert "./deploy/nginx/mhaserve.conf.template:/etc/nginx/templates/default.conf.template:ro" in merged["volumes"]
    assert merged["ports"] == compose_file()["services"]["lb"]["ports"]
    env = merged["environment"]
    assert (env["NGINX_LISTEN"], env["NGINX_HTTP_LISTEN"]) == ("50051", "8080")
