"""Settings: one source of defaults; flag beats variable beats default; bad values named clearly."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from mhaserve.cli.main import build_parser, main
from mhaserve.cli.options import build
from mhaserve.service import settings as st
from mhaserve.service.batching import CPU_LIMITS, CUDA_LIMITS, Limits
from mhaserve.service.settings import Settings, SettingsError


def parse(*argv: str) -> dict[str, object]:
    return vars(build_parser().parse_args(["serve", *argv]))


def test_defaults() -> None:
    s = build({}, env={})
    assert s == Settings()
    assert (s.repository, s.model, s.host, s.port, s.metrics_port) == (Path("models"), (), "127.0.0.1", 50051, 8000)
    assert (s.http_port, s.model_control, s.repository_poll_s, s.auto_truncate) == (8080, "none", 5.0, True)
    assert (s.device, s.graph, s.batching, s.grace_period, s.log_level) == ("auto", "auto", "length", 30.0, "info")
    assert s.limits(on_cuda=False) == CPU_LIMITS
    assert s.limits(on_cuda=True) == CUDA_LIMITS
    # OpenAI's most inputs in one request on either device, and a queue that holds four such requests
    assert (CPU_LIMITS.max_client_batch_size, CPU_LIMITS.max_queue_size) == (2048, 8192)
    assert (CUDA_LIMITS.max_client_batch_size, CUDA_LIMITS.max_queue_size) == (2048, 8192)
    # 256 MiB of requests still arriving, or two messages at the limit where that is more
    assert s.max_incoming_bytes == 256 << 20
    assert build({}, env={"MHASERVE_MAX_MESSAGE_BYTES": str(200 << 20)}).max_incoming_bytes == 400 << 20


def test_every_field_has_a_flag_and_a_variable_named_after_it() -> None:
    args = build_parser().parse_args(["serve"])
    for f in dataclasses.fields(Settings):
        assert hasattr(args, f.name)
        assert st.env_var(f.name) == "MHASERVE_" + st.flag(f.name)[2:].upper().replace("-", "_")


def test_flag_beats_variable_beats_default() -> None:
    env = {"MHASERVE_PORT": "6000", "MHASERVE_MAX_WAIT_MS": "7.5", "MHASERVE_BATCHING": "arrival"}
    s = build(parse("--port", "7000"), env=env)
    assert (s.port, s.max_wait_ms, s.batching) == (7000, 7.5, "arrival")
    s = build(parse(), env={"MHASERVE_REPOSITORY": "/srv/models", "MHASERVE_MODEL": "tiny", "MHASERVE_DEVICE": "cpu"})
    assert (s.repository, s.model, s.device) == (Path("/srv/models"), ("tiny",), "cpu")
    # several models: a repeated flag, or a comma-separated variable; the flag beats the variable
    assert build(parse("--model", "a", "--model", "b"), env={"MHASERVE_MODEL": "c"}).model == ("a", "b")
    assert build(parse(), env={"MHASERVE_MODEL": "a, b,*"}).model == ("a", "b", "*")
    assert build(parse("--auto-truncate"), env={}).auto_truncate is True
    assert build(parse("--no-auto-truncate"), env={"MHASERVE_AUTO_TRUNCATE": "true"}).auto_truncate is False
    assert build(parse(), env={"MHASERVE_AUTO_TRUNCATE": "yes"}).auto_truncate is True
    s = build(
        parse(
            "--max-batch-tokens",
            "100",
            "--max-queue-size",
            "50",
            "--max-client-batch-size",
            "5",
            "--max-message-bytes",
            "1000",
            "--grace-period",
            "2",
            "--intra-op-threads",
            "3",
            "--graph",
            "fp32",
            "--metrics-port",
            "0",
            "--log-level",
            "DEBUG",
        ),
        env={"MHASERVE_MAX_BATCH_TOKENS": "999"},
    )
    assert (s.max_batch_tokens, s.max_queue_size, s.max_client_batch_size, s.max_message_bytes) == (100, 50, 5, 1000)
    assert (s.grace_period, s.intra_op_threads, s.graph, s.metrics_port, s.log_level) == (2.0, 3, "fp32", 0, "debug")
    assert s.limits(on_cuda=True) == Limits(100, CUDA_LIMITS.max_wait_ms, 50, 5, CUDA_LIMITS.max_padding)
    # 0 is a real choice (only equal lengths share a batch), not "unset".
    assert build(parse(), env={"MHASERVE_MAX_PADDING": "0"}).limits(on_cuda=False).max_padding == 0.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MHASERVE_PORT": "fifty"}, "MHASERVE_PORT='fifty' is not a valid --port"),
        ({"MHASERVE_PORT": "70000"}, "MHASERVE_PORT must be a port number"),
        ({"MHASERVE_DEVICE": "tpu"}, "MHASERVE_DEVICE must be one of auto, cuda, cpu"),
        ({"MHASERVE_MAX_BATCH_TOKENS": "0"}, "MHASERVE_MAX_BATCH_TOKENS must be > 0"),
        ({"MHASERVE_MAX_WAIT_MS": "-1"}, "MHASERVE_MAX_WAIT_MS must be >= 0"),
        ({"MHASERVE_MAX_PADDING": "1.5"}, "MHASERVE_MAX_PADDING must be a fraction in .0, 1., got 1.5"),
        ({"MHASERVE_HTTP_PORT": "-1"}, "MHASERVE_HTTP_PORT must be a port number"),
        ({"MHASERVE_MODEL_CONTROL": "auto"}, "MHASERVE_MODEL_CONTROL must be one of none, poll, explicit"),
        ({"MHASERVE_REPOSITORY_POLL_S": "0"}, "MHASERVE_REPOSITORY_POLL_S must be > 0"),
        ({"MHASERVE_AUTO_TRUNCATE": "maybe"}, "MHASERVE_AUTO_TRUNCATE='maybe' is not a valid --auto-truncate"),
        ({"MHASERVE_HTTP_HEADER_TIMEOUT": "0"}, "MHASERVE_HTTP_HEADER_TIMEOUT must be > 0"),
        # float() reads these; NaN compares false with everything, so only a test for it refuses it
        # (and "inf", which is >= 0: "a finite number", or the message contradicted itself)
        ({"MHASERVE_MAX_WAIT_MS": "nan"}, "MHASERVE_MAX_WAIT_MS must be a finite number >= 0, got nan"),
        ({"MHASERVE_INFERENCE_TIMEOUT": "nan"}, "MHASERVE_INFERENCE_TIMEOUT must be a finite number >= 0, got nan"),
        ({"MHASERVE_GRACE_PERIOD": "inf"}, "MHASERVE_GRACE_PERIOD must be a finite number >= 0, got inf"),
        ({"MHASERVE_HTTP_HEADER_TIMEOUT": "inf"}, "MHASERVE_HTTP_HEADER_TIMEOUT must be a finite number > 0, got inf"),
        ({"MHASERVE_MAX_WAIT_MS": "-1"}, "MHASERVE_MAX_WAIT_MS must be >= 0, got -1"),
        # grpc core takes its message limit as a C int: past it, the server failed with a traceback
        ({"MHASERVE_MAX_MESSAGE_BYTES": str(2**31)}, "MHASERVE_MAX_MESSAGE_BYTES must be at most 2147483647"),
        # a request at the message limit could never be read
        (
            {"MHASERVE_MAX_INCOMING_BYTES": "4194303"},
            "MHASERVE_MAX_INCOMING_BYTES must be at least --max-message-bytes [+] 5 (4194309",
        ),
        # one port for two listeners failed at bind, once the model had loaded
        ({"MHASERVE_PORT": "9000", "MHASERVE_HTTP_PORT": "9000"}, "MHASERVE_PORT and MHASERVE_HTTP_PORT are both 9000"),
        (
            {"MHASERVE_HTTP_PORT": "9000", "MHASERVE_METRICS_PORT": "9000"},
            "MHASERVE_HTTP_PORT and MHASERVE_METRICS_PORT are both",
        ),
        # process i's own metrics port: a traceback from the supervisor once, naming that port as --metrics-port
        (
            {"MHASERVE_PROCESSES": "2", "MHASERVE_METRICS_PORT": "9000", "MHASERVE_PORT": "9002"},
            "MHASERVE_PORT and process 1's metrics port .MHASERVE_METRICS_PORT [+] 1 [+] 1. are both 9002",
        ),
        # the metrics host named otherwise, the same address (or every address): checked as the same host was
        (
            {"MHASERVE_METRICS_HOST": "localhost", "MHASERVE_HTTP_PORT": "9000", "MHASERVE_METRICS_PORT": "9000"},
            "MHASERVE_HTTP_PORT and MHASERVE_METRICS_PORT are both",
        ),
        (
            {
                "MHASERVE_HOST": "::",
                "MHASERVE_METRICS_HOST": "0.0.0.0",
                "MHASERVE_HTTP_PORT": "9000",
                "MHASERVE_METRICS_PORT": "9000",
            },  # fmt: skip
            "MHASERVE_HTTP_PORT and MHASERVE_METRICS_PORT are both",
        ),
        (
            {
                "MHASERVE_METRICS_HOST": "0.0.0.0",
                "MHASERVE_PROCESSES": "2",
                "MHASERVE_METRICS_PORT": "9000",
                "MHASERVE_HTTP_PORT": "9001",
            },
            "MHASERVE_HTTP_PORT and process 0's metrics port",
        ),
    ],
)
def test_bad_values_are_refused_by_name(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace("?", r"\?")):
        build({}, env=env)


@pytest.mark.parametrize(("host", "metrics_host"), [("127.0.0.1", "127.0.0.2"), ("::1", "0.0.0.0")])
def test_two_addresses_may_listen_on_one_port(host: str, metrics_host: str) -> None:
    """Two addresses, or one of IPv6 and IPv4's every-address, bind one port each: no clash."""
    env = {"MHASERVE_HOST": host, "MHASERVE_METRICS_HOST": metrics_host, "MHASERVE_HTTP_PORT": "9000",
           "MHASERVE_METRICS_PORT": "9000"}  # fmt: skip
    assert build({}, env=env).metrics_address == metrics_host


@pytest.mark.parametrize("metrics_host", ["bad..host", "x" * 64 + ".example"])
def test_a_host_name_that_cannot_be_encoded_is_left_to_the_bind(metrics_host: str) -> None:
    """A name whose label is empty or longer than 63 characters fails IDNA's encoding (a UnicodeError, no OSError)
    in the check for two listeners on one port: a traceback out of the settings. It is left to the bind, which
    says the host cannot be listened on, as --host's does."""
    env = {"MHASERVE_METRICS_HOST": metrics_host, "MHASERVE_HTTP_PORT": "9000", "MHASERVE_METRICS_PORT": "9000"}
    assert build({}, env=env).metrics_address == metrics_host


@pytest.mark.usefixtures("gpu_without_cuda")
def test_device_auto_where_cuda_does_not_load_gets_a_cpus_workers() -> None:
    """A host that shows a GPU whose CUDA does not load: `--device auto` sizes the workers as on a CPU host (one
    worker, CUDA's, before runtime.devices.cuda_loads; tests/runtime/test_engine.py has the rest)."""
    from mhaserve.runtime.devices import cuda_loads

    if cuda_loads():
        pytest.skip("CUDA loads here")
    assert st.auto_inference_workers("auto", 4) == 2


def test_inference_workers_auto_gives_two_on_a_cpu_of_two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mhaserve.service.settings.available_cpus", lambda: 2)
    assert build({}, env={}).inference_workers is None  # auto, the default
    assert build({}, env={"MHASERVE_GRAPH": "int8", "MHASERVE_DEVICE": "cpu"}).workers == 2
    assert build(parse("--graph", "int8", "--device", "cpu", "--inference-workers", "auto"), env={}).workers == 2
    assert build({}, env={"MHASERVE_GRAPH": "optimized", "MHASERVE_DEVICE": "cpu"}).workers == 2
    assert build({}, env={"MHASERVE_DEVICE": "cpu"}).workers == 2
    # CUDA runs batches on one session; a given number wins; one core has nothing to split
    assert build({}, env={"MHASERVE_GRAPH": "int8", "MHASERVE_DEVICE": "cuda"}).workers == 1
    assert build(parse("--graph", "int8", "--device", "cpu", "--inference-workers", "1"), env={}).workers == 1
    assert build({}, env={"MHASERVE_DEVICE": "cpu", "MHASERVE_INFERENCE_WORKERS": "3"}).workers == 3
    monkeypatch.setattr("mhaserve.service.settings.available_cpus", lambda: 1)
    assert build({}, env={"MHASERVE_GRAPH": "int8", "MHASERVE_DEVICE": "cpu"}).workers == 1
    assert build({}, env={"MHASERVE_DEVICE": "cpu"}).workers == 1
    with pytest.raises(SettingsError, match="MHASERVE_INFERENCE_WORKERS must be > 0"):
        build({}, env={"MHASERVE_INFERENCE_WORKERS": "0"})


@pytest.mark.parametrize(
    ("cpus", "workers"),
    [(1, 1), (2, 2), (3, 2), (4, 2), (5, 2), (8, 4), (16, 8), (17, 8), (64, 8)],
)
def test_inference_workers_auto_gives_one_per_two_cores_on_a_cpu(
    monkeypatch: pytest.MonkeyPatch, cpus: int, workers: int
) -> None:
    """On 16 cores one worker left most cores spinning on small batches; one per two cores served about 2x
    (docs/gpu.md). On 2 cores two workers served more than one with either graph (docs/benchmarks.md). Past
    16 cores, 8: more were not faster there, and each batch in flight holds its own activations."""
    monkeypatch.setattr("mhaserve.service.settings.available_cpus", lambda: cpus)
    assert build({}, env={"MHASERVE_GRAPH": "optimized", "MHASERVE_DEVICE": "cpu"}).workers == workers
    assert build({}, env={"MHASERVE_GRAPH": "int8", "MHASERVE_DEVICE": "cpu"}).workers == workers
    assert build({}, env={"MHASERVE_GRAPH": "optimized", "MHASERVE_DEVICE": "cuda"}).workers == 1


def test_client_batch_larger_than_the_queue_is_refused_before_the_server_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused by the settings themselves, before ports or models, with the device's defaults for the limits not
    set; `auto` is resolved for it only where a CPU's and CUDA's defaults disagree."""
    monkeypatch.setattr("mhaserve.service.settings.wants_cuda", lambda device: device == "cuda")  # a CPU host
    with pytest.raises(SettingsError, match="could never be queued"):
        Settings(max_queue_size=10, max_client_batch_size=20)
    with pytest.raises(SettingsError, match=r"--max-client-batch-size \(2048\) exceeds --max-queue-size \(8\)"):
        Settings(max_queue_size=8)
    with pytest.raises(SettingsError, match="could never be queued"):
        Settings(max_queue_size=100, device="cuda")
    auto = Settings(max_queue_size=100, max_client_batch_size=64)
    assert auto.limits(on_cuda=False).max_client_batch_size == auto.limits(on_cuda=True).max_client_batch_size == 64


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-host", "gpu-host"])
def test_client_batch_past_the_devices_default_queue_is_refused_before_the_server_starts(
    monkeypatch: pytest.MonkeyPatch, gpu: bool
) -> None:
    """--max-client-batch-size 5000 fits CUDA's default queue (8192), not a CPU's where that is 2048 (as it was,
    and is here): with --device auto on a CPU host it was refused only once the ports were bound and the model
    loaded."""
    monkeypatch.setattr("mhaserve.service.settings.wants_cuda", lambda device: device == "cuda" or gpu)
    monkeypatch.setattr(
        "mhaserve.service.settings.CPU_LIMITS",
        dataclasses.replace(CPU_LIMITS, max_queue_size=2048, max_client_batch_size=64),
    )
    if gpu:
        assert Settings(max_client_batch_size=5000).max_client_batch_size == 5000
    else:
        with pytest.raises(SettingsError, match=r"--max-client-batch-size \(5000\) exceeds --max-queue-size \(2048\)"):
            Settings(max_client_batch_size=5000)
    with pytest.raises(SettingsError, match=r"\(5000\) exceeds --max-queue-size \(2048\)"):
        Settings(max_client_batch_size=5000, device="cpu")
    assert Settings(max_client_batch_size=5000, device="cuda").max_client_batch_size == 5000
    assert Settings(max_client_batch_size=5000, max_queue_size=5000).max_client_batch_size == 5000


def test_a_bad_value_is_named_by_the_variable_or_the_flag_that_set_it() -> None:
    """MHASERVE_DEVICE=tpu was reported as "--device must be one of ...", a flag the user never typed."""
    with pytest.raises(SettingsError, match="^MHASERVE_DEVICE must be one of auto, cuda, cpu, got 'tpu'$"):
        build({}, env={"MHASERVE_DEVICE": "tpu"})
    with pytest.raises(SettingsError, match="^--device must be one of"):
        build({"device": "tpu"}, env={"MHASERVE_DEVICE": "cpu"})  # the flag beat the variable
    with pytest.raises(SettingsError, match="^--port and MHASERVE_HTTP_PORT are both 9000"):
        build(parse("--port", "9000"), env={"MHASERVE_HTTP_PORT": "9000"})
    # one variable's name is not taken for the start of another's flag
    with pytest.raises(SettingsError, match="^--repository-poll-s must be > 0"):
        build({"repository_poll_s": 0.0}, env={"MHASERVE_REPOSITORY": "models"})


WITH_CHOICES = [f for f in dataclasses.fields(Settings) if f.metadata.get("choices")]


@pytest.mark.parametrize("field", WITH_CHOICES, ids=lambda f: f.name)
def test_every_setting_with_choices_refuses_another_value_from_its_variable(field: dataclasses.Field[Any]) -> None:
    """MHASERVE_GRPC_FRONT=nope served on grpc.aio's front without a word: the choices were checked by a list of
    settings that lacked it, where argparse refused --grpc-front nope."""
    choices = ", ".join(field.metadata["choices"])
    with pytest.raises(SettingsError, match=f"^{st.env_var(field.name)} must be one of {choices}, got 'nope'$"):
        build({}, env={st.env_var(field.name): "nope"})


def test_argparse_names_the_type_not_a_function(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse said "invalid _int_or_none value: 'abc'": a function of the code, not what the flag takes."""
    for argv, message in [
        (["--max-batch-tokens", "abc"], "argument --max-batch-tokens: invalid int value: 'abc'"),
        (["--max-wait-ms", "abc"], "argument --max-wait-ms: invalid float value: 'abc'"),
        (["--max-padding", "abc"], "argument --max-padding: invalid float value: 'abc'"),
    ]:
        with pytest.raises(SystemExit):
            parse(*argv)
        assert message in capsys.readouterr().err
    assert parse("--max-batch-tokens", "auto")["max_batch_tokens"] is None


def test_a_file_the_server_reads_at_start_is_refused_by_the_name_that_set_it(tmp_path: Path) -> None:
    """`MHASERVE_TLS_CERT=/nope MHASERVE_TLS_KEY=/nope mhaserve serve` said "cannot start: cannot read --tls-cert
    /nope" once the server started (exit 1), a flag the user never typed; now a usage error naming the variable."""
    nope = tmp_path / "nope.pem"
    with pytest.raises(SettingsError, match=f"^cannot read MHASERVE_TLS_CERT {nope}: No such file or directory$"):
        build({}, env={"MHASERVE_TLS_CERT": str(nope), "MHASERVE_TLS_KEY": str(nope)})
    with pytest.raises(SettingsError, match=f"^cannot read --api-keys-file {tmp_path}: Is a directory$"):
        build(parse("--api-keys-file", str(tmp_path)), env={})
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    assert build({}, env={"MHASERVE_ADMIN_KEYS_FILE": str(keys)}).admin_keys_file == keys


def test_a_keys_file_without_keys_is_a_usage_error_named_as_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MHASERVE_API_KEYS_FILE=nokeys was "cannot start: --api-keys-file nokeys holds no key" (exit 1) once the
    server started; now the same usage error as a file that cannot be read, named by the variable."""
    empty = tmp_path / "nokeys"
    empty.write_text("# only a comment\n")
    with pytest.raises(SettingsError, match=f"^MHASERVE_ADMIN_KEYS_FILE {empty} holds no key"):
        build({}, env={"MHASERVE_ADMIN_KEYS_FILE": str(empty)})
    with pytest.raises(SettingsError, match=f"^--api-keys-file {empty} holds no key"):
        build(parse("--api-keys-file", str(empty)), env={})
    monkeypatch.setenv("MHASERVE_API_KEYS_FILE", str(empty))
    assert main(["serve", "--repository", str(tmp_path)]) == 2
    assert f"MHASERVE_API_KEYS_FILE {empty} holds no key" in capsys.readouterr().err


@pytest.mark.parametrize("variable", ["MHASERVE_API_KEYS", "MHASERVE_ADMIN_KEYS"])
def test_a_malformed_key_in_the_environment_is_a_usage_error_as_in_a_keys_file(
    variable: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same key in --api-keys-file was a usage error (2) before the server started; in the variable, the
    server started and stopped with "cannot start: ..." (1), which an orchestrator reads as another failure."""
    with pytest.raises(SettingsError, match=f"^{variable} is not valid: an API key must be printable ASCII"):
        build({}, env={variable: "good,bad key"})
    monkeypatch.setenv(variable, "k1,caf\u00e9")
    assert main(["serve", "--repository", str(tmp_path), "--port", "0", "--http-port", "0", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mhaserve serve: error: {variable} is not valid: an API key must be printable ASCII")
    assert "caf" not in err  # the keys are never shown


def test_metrics_ports_past_65535_for_the_processes_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each process listens on --metrics-port + 1 + i: past 65535 the supervisor found it only as it claimed its
    ports ("cannot start", 1), where two of those ports the same is a usage error (2)."""
    message = (
        r"^--metrics-port 65534 with --processes 2: process 1's metrics port \(--metrics-port \+ 1 \+ 1\) would be "
        "65536, past 65535$"
    )
    with pytest.raises(SettingsError, match=message):
        build(parse("--processes", "2", "--metrics-port", "65534"), env={})
    assert build(parse("--processes", "2", "--metrics-port", "65533"), env={}).metrics_port == 65533
    assert build(parse("--processes", "2", "--metrics-port", "0"), env={}).metrics_port == 0  # none
    args = ["serve", "--repository", str(tmp_path), "--port", "0", "--http-port", "0"]
    assert main([*args, "--processes", "2", "--metrics-port", "65535"]) == 2
    assert "process 0's metrics port (--metrics-port + 1 + 0) would be 65536" in capsys.readouterr().err


def test_a_model_name_the_repository_cannot_hold_is_refused_by_the_name_that_set_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`serve --model Bad/Name` was "cannot start: invalid model name 'Bad/Name'" once the server started (exit 1),
    naming neither the flag nor the variable; export's and import's --name refuse it as a usage error."""
    rule = "use lower-case letters, digits, '.', '_' and '-', beginning with a letter or a digit"
    with pytest.raises(SettingsError, match=f"^--model: invalid model name 'Bad/Name': {rule}$"):
        build(parse("--model", "tiny", "--model", "Bad/Name"), env={"MHASERVE_MODEL": "tiny"})
    with pytest.raises(SettingsError, match="^MHASERVE_MODEL: invalid model name 'TINY'"):
        build({}, env={"MHASERVE_MODEL": "tiny,TINY"})
    assert build({}, env={"MHASERVE_MODEL": "*,tiny"}).model == ("*", "tiny")
    monkeypatch.setenv("MHASERVE_MODEL", "TINY")
    assert main(["serve", "--repository", str(tmp_path), "--port", "0", "--http-port", "0", "--metrics-port", "0"]) == 2
    assert capsys.readouterr().err == f"mhaserve serve: error: MHASERVE_MODEL: invalid model name 'TINY': {rule}\n"


def test_a_model_list_that_names_no_model_is_refused_as_a_key_list_is(capsys: pytest.CaptureFixture[str]) -> None:
    """MHASERVE_MODEL=',' served the default model without a word, where MHASERVE_API_KEYS=',' is a usage error."""
    with pytest.raises(SettingsError, match="^MHASERVE_MODEL: ',' names no model$"):
        build({}, env={"MHASERVE_MODEL": ","})
    with pytest.raises(SystemExit) as e:
        parse("--model", "tiny", "--model", " , ")
    assert e.value.code == 2
    assert "argument --model: ' , ' names no model" in capsys.readouterr().err
    assert build({}, env={"MHASERVE_MODEL": ""}).model == ()  # empty is unset, as for every variable


def test_a_repository_that_is_a_file_is_refused_as_one(tmp_path: Path) -> None:
    """`serve --repository FILE` said "(no such folder)" once the ports were bound, and suggested
    `mhaserve export --repository FILE`."""
    file = tmp_path / "models"
    file.write_text("")
    with pytest.raises(SettingsError, match=f"^--repository: {file} is a file, not a folder$"):
        build(parse("--repository", str(file)), env={})
    with pytest.raises(SettingsError, match="^MHASERVE_REPOSITORY: .* is a file, not a folder"):
        build({}, env={"MHASERVE_REPOSITORY": str(file)})


def test_argparse_refuses_bad_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--batching", "random")
    assert "invalid choice" in capsys.readouterr().err


def test_serve_exits_2_on_a_bad_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MHASERVE_GRACE_PERIOD", "soon")
    assert main(["serve"]) == 2
    assert "MHASERVE_GRACE_PERIOD='soon' is not a valid --grace-period" in capsys.readouterr().err


def test_a_model_named_twice_is_served_once_and_ports_on_other_hosts_may_match() -> None:
    assert build({}, env={"MHASERVE_MODEL": "a,b,a"}).model == ("a", "b")
    # the metrics port on another address than the others may reuse a number
    settings = build(
        {}, env={"MHASERVE_HTTP_PORT": "9000", "MHASERVE_METRICS_PORT": "9000", "MHASERVE_METRICS_HOST": "10.0.0.1"}
    )
    assert settings.http_port == settings.metrics_port == 9000


def test_a_variable_nearly_named_as_a_setting_is_warned_about() -> None:
    """MHASERVE_HTTP_PROT was ignored without a word; other MHASERVE_* names (compose's) are left alone."""
    from mhaserve.cli.options import misspelt

    warnings = misspelt({"MHASERVE_HTTP_PROT": "9000", "MHASERVE_IMAGE": "x", "MHASERVE_GRPC_PUBLISH": "1",
                         "MHASERVE_HTTP_PORT": "9001"})  # fmt: skip
    assert warnings == [
        "MHASERVE_HTTP_PROT is not a setting of mhaserve serve (ignored); did you mean MHASERVE_HTTP_PORT?"
    ]


def test_the_client_commands_key_variable_is_not_warned_about_and_the_grpc_port_is_named() -> None:
    """MHASERVE_API_KEY is what `mhaserve health` (the image's HEALTHCHECK), `encode` and Locust read: a container
    may well set it beside the server's MHASERVE_API_KEYS, and was told it meant that. MHASERVE_GRPC_PORT was told
    it meant MHASERVE_GRPC_FRONT, where the gRPC port is MHASERVE_PORT."""
    from mhaserve.cli.options import misspelt

    assert misspelt({"MHASERVE_API_KEY": "k", "MHASERVE_API_KEYS": "k"}) == []
    assert misspelt({"MHASERVE_GRPC_PORT": "50051", "MHASERVE_GRPC_HOST": "::", "MHASERVE_HTTP_HOST": "::"}) == [
        "MHASERVE_GRPC_HOST is not a setting of mhaserve serve (ignored); did you mean MHASERVE_HOST?",
        "MHASERVE_GRPC_PORT is not a setting of mhaserve serve (ignored); did you mean MHASERVE_PORT?",
        "MHASERVE_HTTP_HOST is not a setting of mhaserve serve (ignored); did you mean MHASERVE_HOST?",
    ]


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("MHASERVE_GRACE", "MHASERVE_GRACE_PERIOD"),
        ("MHASERVE_TLS_CA", "MHASERVE_TLS_CLIENT_CA"),
        ("MHASERVE_DRAIN", "MHASERVE_DRAIN_DELAY"),
        ("MHASERVE_REPO", "MHASERVE_REPOSITORY"),
        ("MHASERVE_WORKERS", "MHASERVE_INFERENCE_WORKERS"),
    ],
)
def test_a_variable_short_of_a_settings_name_is_told_that_setting(name: str, meant: str) -> None:
    """A name the setting's starts with, or whose words the setting's all has, was told the setting nearest in
    spelling (MHASERVE_GRACE: MHASERVE_GRAPH, and MHASERVE_GRAPH=30 is not a grace period; MHASERVE_TLS_CA:
    MHASERVE_TLS_CERT), or nothing at all (MHASERVE_DRAIN, MHASERVE_REPO, MHASERVE_WORKERS were ignored without a
    word). MHASERVE_REPO is not told MHASERVE_REPOSITORY_POLL_S too: two words more than MHASERVE_REPOSITORY."""
    from mhaserve.cli.options import misspelt

    assert misspelt({name: "30"}) == [f"{name} is not a setting of mhaserve serve (ignored); did you mean {meant}?"]


def test_every_other_mhaserve_variable_is_warned_about_with_every_setting_as_near() -> None:
    """A MHASERVE_* name near no setting's was ignored without a word, though mhaserve serve never reads it; and
    of two settings as near, one only was named. A fragment of many settings' names (MHASERVE_MAX) names none of
    them rather than two picked by chance; a name in other capitals is told the setting's."""
    from mhaserve.cli.options import misspelt

    env = {"MHASERVE_NOPE": "1", "MHASERVE_KEYS_FILE": "k", "MHASERVE_TIMEOUT": "5", "MHASERVE_MAX": "9"}
    assert misspelt({**env, "MHASERVE_Port": "6000"}) == [
        "MHASERVE_KEYS_FILE is not a setting of mhaserve serve (ignored); did you mean MHASERVE_ADMIN_KEYS_FILE or "
        "MHASERVE_API_KEYS_FILE?",
        "MHASERVE_MAX is not a setting of mhaserve serve (ignored); mhaserve serve --help lists its variables",
        "MHASERVE_NOPE is not a setting of mhaserve serve (ignored); mhaserve serve --help lists its variables",
        "MHASERVE_Port is not a setting of mhaserve serve (ignored); did you mean MHASERVE_PORT?",
        "MHASERVE_TIMEOUT is not a setting of mhaserve serve (ignored); did you mean MHASERVE_INFERENCE_TIMEOUT or "
        "MHASERVE_PROCESS_TIMEOUT?",
    ]


def test_the_settings_and_the_variables_read_beside_the_server_are_not_warned_about() -> None:
    """Every setting's variable, and what else reads MHASERVE_* variables from the same shell or container:
    the client commands and Locust (MHASERVE_API_KEY), the compose files (MHASERVE_IMAGE, the ports they publish),
    the test suite's container tests. Warning about every unknown name must not warn about these."""
    from mhaserve.cli.options import misspelt

    root = Path(__file__).resolve().parents[2]
    compose = {
        name for f in root.glob("docker-compose*.yml") for name in re.findall(r"\$\{(MHASERVE_\w+)", f.read_text())
    }
    assert {"MHASERVE_IMAGE", "MHASERVE_MODELS_DIR", "MHASERVE_LB_PUBLISH"} <= compose  # found them where they are
    settings = {st.env_var(f.name) for f in dataclasses.fields(Settings)}
    others = {"MHASERVE_API_KEY", "MHASERVE_TEST_KEEP_IMAGES"}
    assert misspelt(dict.fromkeys(settings | compose | others, "1")) == []


def test_kubernetes_service_links_are_not_warned_about_and_the_manifests_turn_them_off() -> None:
    """A Service named `mhaserve` (deploy/k8s) has Kubernetes set MHASERVE_SERVICE_HOST, MHASERVE_PORT_50051_TCP
    and the like in every pod that enableServiceLinks leaves on: 17 "not a setting" warnings at each pod start.
    They are no one's mistakes; and the manifests turn the links off (one, MHASERVE_PORT=tcp://..., is a setting's
    name, which the deployment sets itself)."""
    from mhaserve.cli.options import misspelt

    links = {
        "MHASERVE_SERVICE_HOST": "10.0.0.1",
        "MHASERVE_SERVICE_PORT": "50051",
        "MHASERVE_SERVICE_PORT_GRPC": "50051",
        "MHASERVE_PORT_50051_TCP": "tcp://10.0.0.1:50051",
        "MHASERVE_PORT_50051_TCP_PROTO": "tcp",
        "MHASERVE_PORT_50051_TCP_PORT": "50051",
        "MHASERVE_PORT_8080_TCP_ADDR": "10.0.0.1",
        "MHASERVE_GRPC_SERVICE_HOST": "10.0.0.2",  # a Service named mhaserve-grpc
        "MHASERVE_GRPC_PORT_50051_TCP": "tcp://10.0.0.2:50051",
    }
    assert misspelt(links) == []
    assert misspelt({"MHASERVE_SERVICE_HOTS": "x"})  # not a link's name: warned about as before
    root = Path(__file__).resolve().parents[2]
    assert "enableServiceLinks: false" in (root / "deploy/k8s/deployment.yaml").read_text()


@pytest.mark.parametrize(
    ("given", "env", "warning"),
    [
        (("--repository-poll-s", "1"), {},
         "--repository-poll-s is read only with --model-control poll, not none (ignored)"),
        ((), {"MHASERVE_REPOSITORY_POLL_S": "1", "MHASERVE_MODEL_CONTROL": "explicit"},
         "MHASERVE_REPOSITORY_POLL_S is read only with MHASERVE_MODEL_CONTROL poll, not explicit (ignored)"),
        (("--metrics-port", "0", "--metrics-host", "10.0.0.1"), {},
         "--metrics-host has no listener to place: --metrics-port is 0 (ignored)"),
        (("--batching", "arrival"), {"MHASERVE_MAX_PADDING": "0.2"},
         "MHASERVE_MAX_PADDING is read only with --batching length, not arrival (ignored)"),
        (("--open-methods", "none"), {},
         "--open-methods has nothing to open: with no API keys (--api-keys-file, MHASERVE_API_KEYS) every method "
         "is open (ignored)"),
    ],
    ids=["poll-s without poll", "poll-s by variable", "metrics host without a port", "padding cap on arrival",
         "open methods without keys"],
)  # fmt: skip
def test_a_setting_the_others_leave_without_effect_is_warned_about(
    given: tuple[str, ...], env: dict[str, str], warning: str
) -> None:
    """MHASERVE_REPOSITORY_POLL_S=1 without --model-control poll served what start-up loaded, without a word."""
    from mhaserve.cli.options import inert

    args = parse(*given)
    assert inert(build(args, env=env), args, env=env) == [warning]


@pytest.mark.parametrize(
    ("given", "env"),
    [
        ((), {}),
        (("--metrics-port", "0", "--http-port", "0"), {}),
        (("--model-control", "poll", "--repository-poll-s", "1"), {}),
        (("--metrics-host", "10.0.0.1"), {"MHASERVE_MAX_PADDING": "0.2"}),
        (("--open-methods", "none"), {"MHASERVE_API_KEYS": "k"}),
        (("--open-methods", "none", "--admin-keys-file", "admin.txt"), {}),
    ],
)
def test_settings_that_take_effect_are_not_warned_about(
    given: tuple[str, ...], env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mhaserve.cli.options import inert

    monkeypatch.chdir(tmp_path)
    (tmp_path / "admin.txt").write_text("a1\n")  # a file the server can read: build() checks
    args = parse(*given)
    assert inert(build(args, env=env), args, env=env) == []


def test_serve_prints_the_warning_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], root_logging: None
) -> None:
    """The serve command says it, on stderr, before anything loads (here a repository with no model, which
    then fails to serve)."""
    monkeypatch.setenv("MHASERVE_REPOSITORY_POLL_S", "2")
    argv = ["serve", "--repository", str(tmp_path), "--port", "0", "--http-port", "0", "--metrics-port", "0"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert err.startswith(
        "mhaserve serve: warning: MHASERVE_REPOSITORY_POLL_S is read only with --model-control poll, not none "
        "(ignored)\n"
    )


@pytest.mark.parametrize(
    ("argv", "verbose"),
    [
        (["serve"], False),
        (["-v", "serve"], True),
        (["serve", "-v"], True),
        (["encode", "hi", "--verbose"], True),
        (["bench", "--quick", "-v"], True),
    ],
)
def test_verbose_before_or_after_the_command(argv: list[str], verbose: bool) -> None:
    """`mhaserve serve -v` was refused ("unrecognized arguments"): -v was the program's option only."""
    assert build_parser().parse_args(argv).verbose is verbose
