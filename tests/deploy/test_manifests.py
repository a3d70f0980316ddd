"""Offline checks of the Dockerfile, the Kubernetes manifests, the dashboard and the docs.

The files are parsed, and what they say about ports, probes, users and grace periods is compared with
the server's own defaults (service/settings.py) and metric names (service/metrics.py), so that a change
on one side that the other does not follow fails here. The manifests are also validated against the
Kubernetes schemas (kubernetes-validate, offline). The images themselves are built and run by
test_containers.py.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mhaserve.service.metrics import Metrics, ModelMetrics
from tests.deploy.helpers import DEPLOY, ROOT, compose_file, load_yaml_all, metric_samples, server_defaults

K8S = DEPLOY / "k8s"


# ---- Dockerfile -------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def dockerfile_stages() -> dict[str, Stage]:
    """Stages in order, each with its instructions (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args.strip(), re.I)
            assert m, line
            current = Stage(m.group(2) or f"stage{len(stages)}", m.group(1))
            stages[current.name] = current
        elif current is not None:
            current.instructions.append((keyword, " ".join(args.split())))
    return stages


def lineage(stages: dict[str, Stage], name: str) -> list[Stage]:
    """A stage and the stages it is built FROM, base first."""
    chain = [stages[name]]
    while chain[0].base in stages:
        chain.insert(0, stages[chain[0].base])
    return chain


def sources(stages: dict[str, Stage], name: str) -> set[str]:
    """Every stage whose files can reach `name`: its lineage and what it copies or mounts from."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        stage = stages[todo.pop()]
        if stage.name in seen:
            continue
        seen.add(stage.name)
        if stage.base in stages:
            todo.append(stage.base)
        for _, args in stage.instructions:
            todo += [s for s in re.findall(r"from=([\w-]+)", args) if s in stages]
    return seen


SERVING = ["cpu", "gpu"]
FINAL = [*SERVING, "loadtest"]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_dockerfile_stages() -> None:
    stages = dockerfile_stages()
    assert {"export", "cpu", "gpu", "loadtest"} <= set(stages)
    assert list(stages)[-1] == "gpu", "a plain `docker build .` must give the GPU image"
    assert all(s.base in stages or s.base == "${PYTHON_IMAGE}" for s in stages.values())


def test_build_arguments_have_public_defaults() -> None:
    """Hosts that reach other sources override them (deploy/images/build.sh does from the host's pip)."""
    defaults = dict(re.findall(r"^ARG (\w+)=(.*)$", DOCKERFILE.split("\nFROM ", 1)[0], re.M))
    assert defaults["PYTHON_IMAGE"] == "docker.io/library/python:3.11-slim"
    assert defaults["PIP_INDEX_URL"] == "https://pypi.org/simple"
    assert defaults["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    for unset in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_CONSTRAINT"):
        assert defaults[unset] == "", f"{unset}: pip reads an empty value as none"
    # No source is written into a RUN: every index comes from an argument.
    assert not re.search(r"--(extra-)?index-url\s+https?://", DOCKERFILE)


def pip_stages(stages: dict[str, Stage]) -> set[str]:
    """Stages that read pip's configuration (their RUNs see the PIP_* arguments, and their history shows them)."""
    return {s.name for s in stages.values() if any(a.startswith("PIP_") for a in s.all("ARG"))}


def torch_stages(stages: dict[str, Stage]) -> set[str]:
    return {s.name for s in stages.values() if any("torch" in r for r in s.all("RUN"))}


def test_export_stage_installs_cpu_torch_first_and_exports() -> None:
    stages = dockerfile_stages()
    runs = " ".join(r for s in lineage(stages, "export") for r in s.all("RUN"))
    assert runs.index("-r /requirements/torch.txt") < runs.index("-r /requirements/export.txt")
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in runs
    assert re.search(r"\bmhaserve export\b.*--repository /models", runs)
    # torch's requirement is the export extra's pin: one place says which torch.
    assert "--extra export --only torch > /requirements/torch.txt" in " ".join(stages["requirements"].all("RUN"))
    assert "--extra export --exclude torch > /requirements/export.txt" in " ".join(stages["requirements"].all("RUN"))


@pytest.mark.parametrize("target", FINAL)
def test_final_images_carry_no_pip_configuration_and_no_torch(target: str) -> None:
    """A final image is built FROM stages that never saw pip's configuration (index URLs may hold
    credentials; build arguments show in an image's history) and copies only from stages without torch,
    but for /models from the export."""
    stages = dockerfile_stages()
    chain = {s.name for s in lineage(stages, target)}
    assert not chain & pip_stages(stages), f"{target} is built FROM {chain & pip_stages(stages)}"
    for stage in lineage(stages, target):
        for args in stage.all("COPY"):
            m = re.search(r"--from=([\w-]+)", args)
            if not m:
                continue
            source = m.group(1)
            if source == "export":
                assert args.endswith("/models /models"), f"only the model repository comes from the export: {args}"
            else:
                assert not {s.name for s in lineage(stages, source)} & torch_stages(stages), f"{target}: {args}"
    assert target == "loadtest" or "torch" not in " ".join(r for s in lineage(stages, target) for r in s.all("RUN"))


@pytest.mark.parametrize("target", SERVING)
def test_serving_image_runtime_contract(target: str) -> None:
    defaults = server_defaults()
    chain = lineage(dockerfile_stages(), target)
    instructions = [i for stage in chain for i in stage.instructions]

    def last(keyword: str) -> str:
        return [args for kw, args in instructions if kw == keyword][-1]

    user = last("USER").split(":")[0]
    assert user not in ("root", "0"), "the server must not run as root"
    # The check is the entry point's, which works out the port the server listens on as it does for the server.
    assert last("HEALTHCHECK").endswith('CMD ["mhaserve-entrypoint", "healthcheck"]')
    exposed = {int(p) for args in (a for kw, a in instructions if kw == "EXPOSE") for p in args.split()}
    assert exposed == {defaults.port, defaults.http_port, defaults.metrics_port}
    env = " ".join(a for kw, a in instructions if kw == "ENV")
    assert "MHASERVE_HOST=0.0.0.0" in env
    assert f"MHASERVE_PORT={defaults.port}" in env and f"MHASERVE_METRICS_PORT={defaults.metrics_port}" in env
    assert "MHASERVE_REPOSITORY=/models" in env
    assert f"MHASERVE_HTTP_PORT={defaults.http_port}" in env
    # A stop (SIGTERM) says NOT_SERVING while serving on, so that balancers move away before refusals.
    assert float(re.search(r"MHASERVE_DRAIN_DELAY=(\S+)", env).group(1)) > 0  # type: ignore[union-attr]
    # The entry point execs `mhaserve serve` with the container's arguments; under SageMaker's `serve` it moves
    # the ports the image sets, and no others.
    assert last("ENTRYPOINT") == '["mhaserve-entrypoint"]'
    script = (DEPLOY / "images" / "entrypoint.sh").read_text()
    assert script.rstrip().endswith('exec mhaserve serve "$@"')
    assert f'"${{MHASERVE_PORT:-{defaults.port}}}" = {defaults.port}' in script
    assert f'"${{MHASERVE_METRICS_PORT:-{defaults.metrics_port}}}" = {defaults.metrics_port}' in script
    assert f'--address "127.0.0.1:${{port:-${{MHASERVE_PORT:-{defaults.port}}}}}"' in script


ENTRYPOINT_CASES = {
    # (arguments, environment besides the image's) -> (what mhaserve is run with, its environment's changes)
    "options only": ((["--graph", "int8"], {}), (["serve", "--graph", "int8"], {})),
    "healthcheck": ((["healthcheck"], {}), (["health", "--address", "127.0.0.1:50051"], {})),
    "healthcheck with its options": (
        (["healthcheck", "--tls-ca", "/etc/mhaserve/ca.pem"], {}),
        (["health", "--address", "127.0.0.1:50051", "--tls-ca", "/etc/mhaserve/ca.pem"], {}),
    ),
    "sagemaker": (
        (["serve"], {"SAGEMAKER_SAFE_PORT_RANGE": "29000-29999", "SAGEMAKER_BIND_TO_PORT": "8081"}),
        (
            ["serve"],
            {
                "MHASERVE_PORT": "29000",
                "MHASERVE_METRICS_PORT": "29001",
                "MHASERVE_HTTP_PORT": "8081",
                "MHASERVE_GRACE_PERIOD": "20",
                # SageMaker's 6 MB (InvokeEndpoint's limit, a batch transform's default MaxPayloadInMB).
                "MHASERVE_MAX_MESSAGE_BYTES": str(6 * 2**20),
            },
        ),
    ),
    "sagemaker, a message limit set": (
        (["serve"], {"MHASERVE_MAX_MESSAGE_BYTES": "1048576"}),
        (["serve"], {"MHASERVE_GRACE_PERIOD": "20"}),
    ),
    # Docker runs the check with the image's environment, not the server's: it must find the moved port itself.
    "healthcheck under sagemaker": (
        (["healthcheck"], {"SAGEMAKER_SAFE_PORT_RANGE": "29000-29999"}),
        (["health", "--address", "127.0.0.1:29000"], {"MHASERVE_PORT": "29000", "MHASERVE_METRICS_PORT": "29001"}),
    ),
    "healthcheck under sagemaker, a port set": (
        (["healthcheck"], {"SAGEMAKER_SAFE_PORT_RANGE": "29000-29999", "MHASERVE_PORT": "6000"}),
        (["health", "--address", "127.0.0.1:6000"], {"MHASERVE_METRICS_PORT": "29001"}),
    ),
}

# The server's command line, as pid 1's /proc/<pid>/cmdline holds it (what the image's entry point execs, with
# the container's arguments), against the port the check asks. A --port there wins over MHASERVE_PORT, as in
# `mhaserve serve`; the last one given wins; a command line that is not `mhaserve serve` says nothing.
SERVE = ["/opt/venv/bin/python3", "/opt/venv/bin/mhaserve", "serve"]
SERVER_COMMAND_LINES = {
    "no --port": (SERVE + ["--graph", "int8"], {}, "50051"),
    "--port N": (SERVE + ["--graph", "int8", "--port", "6000", "--http-port", "6001"], {}, "6000"),
    "--port=N": (SERVE + ["--port=6000"], {}, "6000"),
    "the last --port": (SERVE + ["--port", "6000", "--port=6002"], {}, "6002"),
    "over MHASERVE_PORT": (SERVE + ["--port", "6000"], {"MHASERVE_PORT": "7000"}, "6000"),
    "MHASERVE_PORT without --port": (SERVE + ["--metrics-port", "6003"], {"MHASERVE_PORT": "7000"}, "7000"),
    "over SageMaker's range": (SERVE + ["--port", "6000"], {"SAGEMAKER_SAFE_PORT_RANGE": "29000-29999"}, "6000"),
    "a --port value that is another option's": (SERVE + ["--http-port", "--port"], {}, "50051"),
    "pid 1 not mhaserve serve": (["/sbin/init", "--port", "6000"], {}, "50051"),
    "mhaserve, another command": (["/opt/venv/bin/mhaserve", "health", "--port", "6000"], {}, "50051"),
}


@pytest.mark.parametrize("case", SERVER_COMMAND_LINES)
def test_healthcheck_asks_the_port_on_the_servers_command_line(case: str, tmp_path: Path) -> None:
    """`docker run IMAGE --port 6000`: the check runs apart from the server, so it reads pid 1's command line
    (a file written here as the kernel writes it: NUL after each argument)."""
    command_line, extra, port = SERVER_COMMAND_LINES[case]
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"".join(a.encode() + b"\0" for a in command_line))
    fake = tmp_path / "mhaserve"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$OUT.args"\n')
    fake.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "OUT": str(tmp_path / "run"),
        "MHASERVE_PORT": "50051",
        "_MHASERVE_SERVER_CMDLINE": str(cmdline),
        **extra,
    }
    subprocess.run(["sh", str(DEPLOY / "images" / "entrypoint.sh"), "healthcheck"], env=env, check=True, timeout=30)
    assert (tmp_path / "run.args").read_text().splitlines() == ["health", "--address", f"127.0.0.1:{port}"]


@pytest.mark.parametrize("case", ENTRYPOINT_CASES)
def test_entrypoint_runs_mhaserve_with_the_ports_the_server_listens_on(case: str, tmp_path: Path) -> None:
    """The entry point script itself, run by sh with the image's environment, and an `mhaserve` of the test's
    on the PATH that writes what it was run with."""
    (arguments, extra), (expected_args, changes) = ENTRYPOINT_CASES[case]
    image_env = {
        "MHASERVE_PORT": "50051",
        "MHASERVE_HTTP_PORT": "8080",
        "MHASERVE_METRICS_PORT": "8000",
        "MHASERVE_REPOSITORY": "/models",
    }
    fake = tmp_path / "mhaserve"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$OUT.args"\nenv > "$OUT.env"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "OUT": str(tmp_path / "run"), **image_env, **extra}
    subprocess.run(["sh", str(DEPLOY / "images" / "entrypoint.sh"), *arguments], env=env, check=True, timeout=30)
    assert (tmp_path / "run.args").read_text().splitlines() == expected_args
    ran_with = dict(line.split("=", 1) for line in (tmp_path / "run.env").read_text().splitlines() if "=" in line)
    mhaserve_env = {k: v for k, v in ran_with.items() if k.startswith("MHASERVE_")}
    assert mhaserve_env == {**image_env, **{k: v for k, v in extra.items() if k.startswith("MHASERVE_")}, **changes}


def test_gpu_image_has_cuda_from_pip_and_cpu_image_does_not() -> None:
    stages = dockerfile_stages()
    gpu_runs = " ".join(r for s in sources(stages, "gpu") for r in stages[s].all("RUN"))
    cpu_runs = " ".join(r for s in sources(stages, "cpu") for r in stages[s].all("RUN"))
    assert "onnxruntime-gpu[cuda,cudnn]" in gpu_runs
    assert "[cuda" not in cpu_runs and "cudnn" not in cpu_runs
    assert "ldconfig" in " ".join(stages["gpu"].all("RUN")), "the CUDA libraries from pip must be found"
    # Never the CPU `onnxruntime` package beside onnxruntime-gpu: both install the same module.
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"pip install[^\n]*\bonnxruntime(?!-gpu)(?![\w/.-])", text)


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    patterns = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", "models", "results", ".git"} <= patterns
    # pip install -e leaves *.egg-info in loadtest/ too: Docker's patterns match from the root only.
    assert {"**/build", "**/dist", "**/*.egg-info"} <= patterns
    # What the build needs must not be ignored.
    for needed in ("pyproject.toml", "README.md", "service", "model", "export", "proto", "loadtest"):
        assert needed not in patterns


def test_every_file_the_dockerfile_copies_from_the_context_is_sent() -> None:
    """A COPY of a file .dockerignore leaves out fails only when an image is built (minutes into the
    container tier): the entry point did, once. Docker's rules: the last pattern that matches a path or a
    folder above it decides, `!` sends it after all."""
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        above = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        decided = False
        for pattern in patterns:
            if any(fnmatch.fnmatchcase(p, pattern.removeprefix("!")) for p in above):
                decided = not pattern.startswith("!")
        return decided

    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            words = [w for w in line.split()[1:] if not w.startswith("--")]
            sources += [w for w in words[:-1] if w != "."]
    assert "deploy/images/entrypoint.sh" in sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not ignored(source), f"the Dockerfile copies {source}, which .dockerignore leaves out of the context"
    assert ignored("tests/deploy/test_manifests.py") and ignored("deploy/k8s/deployment.yaml"), "the rules read right"


# ---- Kubernetes -------------------------------------------------------------------------------------


def k8s(kind: str, path: str) -> list[dict[str, Any]]:
    docs = [d for d in load_yaml_all(K8S / path) if d.get("kind") == kind]
    assert docs, f"no {kind} in {path}"
    for d in docs:
        assert d.get("apiVersion") and d.get("metadata", {}).get("name"), d
    return docs


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def image_env() -> dict[str, str]:
    """The MHASERVE_* variables the serving image's ENV sets (the runtime stage of the Dockerfile)."""
    text = (ROOT / "Dockerfile").read_text()
    stage = text.split("\nFROM base AS runtime\n", 1)[1].split("\nFROM ", 1)[0]
    return dict(re.findall(r"\b(MHASERVE_[A-Z_]+)=(\S+)", stage))


def check_pod(pod: dict[str, Any], container: dict[str, Any], grpc_port_name: str) -> None:
    """What every pod spec running the server must get right."""
    defaults = server_defaults()
    env = env_of(container)
    assert env["MHASERVE_HOST"] == "0.0.0.0"
    port = int(env.get("MHASERVE_PORT", defaults.port))
    assert container_ports(container)[grpc_port_name] == port == defaults.port
    assert container["readinessProbe"]["grpc"]["port"] == port, "readiness must ask the gRPC health service"
    # one slow answer on a busy node must not take the pod out of the endpoints
    assert container["readinessProbe"].get("failureThreshold", 3) >= 2
    # A liveness failure while draining would kill the drain: it must take longer than the whole drain,
    # which is a preStop hook's sleep (if any), then the drain delay, then the grace period.
    live = container["livenessProbe"]
    # What the pod does not set, the image's ENV does (MHASERVE_DRAIN_DELAY=5), before the server's default.
    image = image_env()
    grace = float(env.get("MHASERVE_GRACE_PERIOD", image.get("MHASERVE_GRACE_PERIOD", defaults.grace_period)))
    delay = float(env.get("MHASERVE_DRAIN_DELAY", image.get("MHASERVE_DRAIN_DELAY", defaults.drain_delay)))
    prestop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
    assert prestop[0] == "sleep"
    drain = float(prestop[1]) + delay + grace
    assert pod["terminationGracePeriodSeconds"] > drain, "SIGKILL would cut the drain short"
    assert live["periodSeconds"] * live["failureThreshold"] > drain
    limits = container["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == 1
    assert env["MHASERVE_DEVICE"] == "cuda"


def test_deployment() -> None:
    (deploy,) = k8s("Deployment", "deployment.yaml")
    spec = deploy["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    check_pod(pod, container, "grpc")
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert container_ports(container)["metrics"] == server_defaults().metrics_port
    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(server_defaults().metrics_port)
    # The image's user: the Dockerfile's USER.
    assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["runAsNonRoot"] is True
    assert "USER 10001:10001" in (ROOT / "Dockerfile").read_text()
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    env = env_of(container)
    # Rolling restarts: NOT_SERVING for long enough that endpoint removal reaches every proxy (a few
    # seconds) before the server stops listening; /health on the HTTP port for the probes that use it.
    assert float(env["MHASERVE_DRAIN_DELAY"]) >= 5
    http = int(env["MHASERVE_HTTP_PORT"])
    assert container_ports(container)["http"] == http == server_defaults().http_port
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert spec["minReadySeconds"] > 0


def test_services_name_the_grpc_port_for_h2c() -> None:
    (deploy,) = k8s("Deployment", "deployment.yaml")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    ports = container_ports(deploy["spec"]["template"]["spec"]["containers"][0])
    services = k8s("Service", "service.yaml")
    assert {s["metadata"]["name"] for s in services} == {"mhaserve", "mhaserve-headless"}
    for svc in services:
        assert svc["spec"]["selector"].items() <= labels.items()
        grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert grpc["appProtocol"] == "kubernetes.io/h2c"
        assert grpc["port"] == server_defaults().port and grpc["targetPort"] in ports
        http = next(p for p in svc["spec"]["ports"] if p["name"] == "http")
        assert http["port"] == server_defaults().http_port and http["targetPort"] == "http" in ports
    headless = next(s for s in services if s["metadata"]["name"] == "mhaserve-headless")
    assert headless["spec"]["clusterIP"] == "None"


def test_hpa_scales_the_deployment_on_a_metric_the_server_exports() -> None:
    (hpa,) = k8s("HorizontalPodAutoscaler", "hpa.yaml")
    assert hpa["apiVersion"] == "autoscaling/v2"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "mhaserve"}
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    # The HPA owns the count: a `replicas` in the Deployment set it back at every `kubectl apply`.
    (deploy,) = k8s("Deployment", "deployment.yaml")
    assert "replicas" not in deploy["spec"]
    pods_metrics = [m["pods"]["metric"]["name"] for m in spec["metrics"] if m["type"] == "Pods"]
    assert pods_metrics and set(pods_metrics) <= metric_samples()
    (pdb,) = k8s("PodDisruptionBudget", "pdb.yaml")
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "mhaserve"
    # One pod at a time, whatever the HPA scaled to; never below what keeps serving.
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["maxUnavailable"] < spec["minReplicas"]


# The oldest release whose gRPC probes are GA, and the newest whose schemas kubernetes-validate ships.
K8S_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
# Fields of KServe's PredictorSpec beside the PodSpec it embeds.
KSERVE_PREDICTOR_FIELDS = {"minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "containerConcurrency"}


def kubernetes_documents() -> list[tuple[str, dict[str, Any]]]:
    """Every resource `kubectl apply -k deploy/k8s` creates, and the pod part of the KServe predictor."""
    (kustomization,) = load_yaml_all(K8S / "kustomization.yaml")
    docs = [(f"{path} {d['kind']}", d) for path in kustomization["resources"] for d in load_yaml_all(K8S / path)]
    (isvc,) = k8s("InferenceService", "kserve-inferenceservice.yaml")
    pod_spec = {k: v for k, v in isvc["spec"]["predictor"].items() if k not in KSERVE_PREDICTOR_FIELDS}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "predictor"}, "spec": pod_spec}
    return [*docs, ("kserve-inferenceservice.yaml predictor", pod)]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    """Offline, strict (unknown fields are errors): the OpenAPI schemas of the Kubernetes release, as
    kubernetes-validate ships them. KServe's InferenceService is a custom resource outside them; its
    predictor's pod fields are checked as a Pod."""
    for name, doc in kubernetes_documents():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{name} is not a valid {doc['kind']} for Kubernetes {version}: {e.message}") from None


@pytest.mark.parametrize(
    "mistake",
    [
        lambda c: c.__setitem__("readinesProbe", c.pop("readinessProbe")),
        lambda c: c["readinessProbe"]["grpc"].__setitem__("port", "grpc"),
        lambda c: c["readinessProbe"]["grpc"].__setitem__("path", "/health"),
    ],
    ids=["misspelt probe", "named port in a grpc probe", "http field in a grpc probe"],
)
def test_schema_validation_catches_mistakes(mistake: Callable[[dict[str, Any]], None]) -> None:
    """The check above is not vacuous: mistakes that a YAML parser accepts fail it."""
    (deploy,) = k8s("Deployment", "deployment.yaml")
    broken = copy.deepcopy(deploy)
    mistake(broken["spec"]["template"]["spec"]["containers"][0])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_probes_ask_the_whole_servers_health() -> None:
    """grpc.health.v1 with service "" is SERVING only once the model is warmed up, NOT_SERVING while draining."""
    (deploy,) = k8s("Deployment", "deployment.yaml")
    (isvc,) = k8s("InferenceService", "kserve-inferenceservice.yaml")
    for container in (deploy["spec"]["template"]["spec"]["containers"][0], isvc["spec"]["predictor"]["containers"][0]):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "grpc" in container[probe]:
                assert container[probe]["grpc"].get("service", "") == "", f"{probe} asks a single service"
            else:
                assert container[probe]["httpGet"]["path"] == "/health", f"{probe}: /health is the whole server's"


def test_kustomization_lists_existing_manifests() -> None:
    (kustomization,) = load_yaml_all(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    assert "kserve-inferenceservice.yaml" not in kustomization["resources"], "it needs KServe's CRDs"


def test_kserve_inference_service_runs_the_image_as_a_grpc_custom_predictor() -> None:
    (isvc,) = k8s("InferenceService", "kserve-inferenceservice.yaml")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    predictor = isvc["spec"]["predictor"]
    (container,) = predictor["containers"]
    assert container["name"] == "kserve-container"
    # KServe sends HTTP/2 cleartext to the port named h2c: the one the server (and the OIP API) is on.
    assert [p["name"] for p in container["ports"]] == ["h2c"]
    check_pod(predictor, container, "h2c")
    assert container["image"].startswith("mhaserve")


# ---- Grafana ----------------------------------------------------------------------------------------


def test_dashboard_queries_only_metrics_the_server_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/mhaserve.json").read_text())
    assert dashboard["uid"] and dashboard["title"]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    titles = {p["title"] for p in dashboard["panels"]}
    for wanted in ("Throughput by status", "Request latency", "Queue depth", "Batch size", "Padding"):
        assert wanted in titles
    known = metric_samples()
    used = {m for e in exprs for m in re.findall(r"\bmhaserve_\w+", e)}
    assert used and used <= known, f"the server exports none of {used - known}"
    alert_exprs = (DEPLOY / "prometheus/alerts.yml").read_text()
    assert set(re.findall(r"\bmhaserve_\w+", alert_exprs)) <= known


def test_the_dashboard_draws_every_metric_an_alert_reads() -> None:
    """What can page someone can be looked at: the "Server errors" stat left out the responses within streams that
    MhaserveServerErrors counts (tests/deploy/test_prometheus.py evaluates both), and no panel read the restarts
    of --processes' server processes."""
    dashboard = json.loads((DEPLOY / "grafana/dashboards/mhaserve.json").read_text())
    drawn = {
        m for p in dashboard["panels"] for t in p.get("targets", []) for m in re.findall(r"\bmhaserve_\w+", t["expr"])
    }
    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    for rule in (r for group in rules["groups"] for r in group["rules"]):
        read = set(re.findall(r"\bmhaserve_\w+", rule["expr"]))
        assert read <= drawn, f"{rule['alert']} reads {read - drawn}, which no panel draws"


def test_readme_metrics_table_names_every_metric_the_server_exports() -> None:
    """The README's table is what operators read: every family the server defines, none it does not (the
    supervisor's two of --processes aside, defined in service/processes.py)."""
    from mhaserve.service.metrics import Metrics

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("### Metrics") : readme.index("### Options")]
    rows = [ln for ln in table.splitlines() if ln.startswith("| `mhaserve_")]
    named = {m for ln in rows for m in re.findall(r"`(mhaserve_\w+)", ln.split(" | ")[0])}
    families = set()
    for family in Metrics().registry.collect():
        families.add(family.name + ("_total" if family.type == "counter" else ""))
    supervisor = {"mhaserve_processes_serving", "mhaserve_process_restarts_total"}
    assert named - supervisor == families


def test_grafana_provisioning_is_well_formed() -> None:
    """Grafana's image comes from Docker Hub only, so the container tier cannot start it here: what Grafana
    reads at start-up is checked for the structure its provisioning and dashboard loaders expect."""
    provisioning = DEPLOY / "grafana/provisioning"
    sources = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())
    assert sources["apiVersion"] == 1
    datasources = sources["datasources"]
    assert all(
        {"name", "type", "uid", "url"} <= ds.keys() and ds.get("access", "proxy") == "proxy" for ds in datasources
    )
    assert len({ds["uid"] for ds in datasources}) == len(datasources)
    assert [ds["isDefault"] for ds in datasources if ds.get("isDefault")] == [True]
    providers = yaml.safe_load((provisioning / "dashboards/mhaserve.yml").read_text())
    assert providers["apiVersion"] == 1
    for provider in providers["providers"]:
        assert provider["type"] == "file" and provider["name"] and provider["options"]["path"].startswith("/")

    dashboard = json.loads((DEPLOY / "grafana/dashboards/mhaserve.json").read_text())
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] in {ds["type"] for ds in datasources}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] in {"${datasource}"} | {ds["uid"] for ds in datasources}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
    # Every variable a query uses is defined, and every series the server labels by model follows the model
    # selector (one server serves several models: a panel must not sum them unasked).
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {v for e in exprs for v in re.findall(r"\$(\w+)", e)} - {"__rate_interval"}
    assert used <= variables.keys(), used - variables.keys()
    assert "mhaserve_model_ready" in variables["model"]["query"]["query"]
    served = ModelMetrics(Metrics(), "m", 1)  # one model version's series, as the server exports them
    served.served("CPUExecutionProvider")
    registry = served.parent.registry
    per_model = {s.name for f in registry.collect() for s in f.samples if "model" in s.labels}
    assert "mhaserve_inputs_total" in per_model and "mhaserve_queue_wait_seconds_bucket" in per_model
    for e in exprs:
        for name, selector in re.findall(r"(mhaserve_\w+)\{([^}]*)\}", e):
            if name in per_model:
                assert 'model=~"$model"' in selector, e
    # The home dashboard Grafana opens is the provisioned file, where the compose file mounts it.
    grafana = compose_file()["services"]["grafana"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("./"))
    (host_dir,) = [src for src, dst in mounts.items() if home.startswith(dst + "/")]
    assert (ROOT / host_dir / home.removeprefix(mounts[host_dir] + "/")).is_file()


# ---- docs -------------------------------------------------------------------------------------------

PATH_RE = re.compile(
    r"(?<![\w/.-])((?:deploy|tests/deploy|loadtest|docs)/[\w./-]+\w|Dockerfile|\.dockerignore|docker-compose[\w.-]*\.yml)"
)


def deploy_section() -> str:
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"^## Deploy\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    assert m, "README.md has no '## Deploy' section"
    return m.group(1)


@pytest.mark.parametrize("doc", ["README.md#Deploy", "docs/deploy.md"])
def test_every_file_the_docs_name_exists(doc: str) -> None:
    text = deploy_section() if doc == "README.md#Deploy" else (ROOT / doc).read_text()
    named = set(PATH_RE.findall(text))
    assert named, "the docs name no files?"
    missing = sorted(p for p in named if not (ROOT / p).exists() and not any(ROOT.glob(p)))
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_readme_deploy_section_covers_the_user_path() -> None:
    text = deploy_section()
    for needed in (
        "docker compose up",
        "--profile loadtest",
        "--profile monitoring",
        "--scale encoder=",
        "docs/deploy.md",
    ):
        assert needed in text, f"README's Deploy section should show {needed!r}"


def test_docs_commands_use_real_profiles_and_services() -> None:
    services = compose_file()["services"]
    profiles = {p for s in services.values() for p in s.get("profiles", [])}
    text = deploy_section() + (ROOT / "docs/deploy.md").read_text()
    assert set(re.findall(r"--profile (\w+)", text)) <= profiles
    assert set(re.findall(r"--scale ([\w-]+)=", text)) <= set(services)


# retry-on's keywords in HAProxy's configuration manual (2.6 to 3.x), beside HTTP status codes.
HAPROXY_RETRY_ON = {"none", "conn-failure", "empty-response", "junk-response", "response-timeout", "0rtt-rejected",
                    "all-retryable-errors"}  # fmt: skip


def test_haproxy_cfg_holds_nothing_only_newer_releases_would_read() -> None:
    """The tests check the file with Debian's HAProxy 2.6; a `.if version_atleast(2.7)` branch went unchecked
    and named a retry-on keyword no HAProxy has, and the compose default (the official 3.0 image) refused the
    whole file."""
    cfg = (DEPLOY / "haproxy" / "haproxy.cfg").read_text()
    assert not re.search(r"^\s*\.if\b", cfg, re.M)
    for line in re.findall(r"^\s*retry-on\s+(.+)$", cfg, re.M):
        for word in line.split():
            assert word in HAPROXY_RETRY_ON or re.fullmatch(r"[1-5]\d\d", word), word
