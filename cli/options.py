"""Flags and `MHASERVE_*` environment variables, bound to the fields of `Settings`: the only place that reads them.

Each field of `mhaserve.service.settings.Settings` becomes a flag (`--max-wait-ms`) and a variable
(`MHASERVE_MAX_WAIT_MS`) with the field's parser and help text. A flag beats its variable, which beats
the default. Nothing here runs at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from mhaserve.service.auth import AuthError, read_keys_file
from mhaserve.service.settings import Settings, SettingsError, env_var, flag
from mhaserve.service.tls import TlsError, TlsFiles, TlsMaterial


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; argparse keeps None for flags not given, so the environment can fill them."""
    for f in dataclasses.fields(Settings):
        meta = f.metadata
        if meta.get("env_only"):
            parser.set_defaults(**{f.name: None})  # no flag; build() reads the variable
            continue
        # Fields whose default depends on the device or the repository say so in their help.
        default = "" if "(default" in meta["help"] else f"; default: {f.default}"
        if meta.get("repeatable"):  # --model a --model b
            parser.add_argument(
                flag(f.name),
                dest=f.name,
                default=None,
                action="append",
                type=_flag_type(meta["parse"]),
                metavar=meta.get("metavar"),
                help=f"{meta['help']} [env {env_var(f.name)}{default}]",
            )
            continue
        if f.type in (bool, "bool"):  # --auto-truncate / --no-auto-truncate
            parser.add_argument(
                flag(f.name),
                dest=f.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=f"{meta['help']} [env {env_var(f.name)}{default}]",
            )
            continue
        parser.add_argument(
            flag(f.name),
            dest=f.name,
            default=None,
            type=_flag_type(meta["parse"]),
            choices=meta["choices"],
            metavar=None if meta["choices"] else meta.get("metavar") or f.name.split("_")[-1].upper(),
            help=f"{meta['help']} [env {env_var(f.name)}{default}]",
        )


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A field's parser as argparse's type: a SettingsError it raises says what is wrong, and argparse shows it
    (for any other ValueError it shows "invalid <the type's name> value: ...", as for int's)."""

    def flag_type(text: str) -> Any:
        try:
            return parse(text)
        except SettingsError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    flag_type.__name__ = getattr(parse, "__name__", repr(parse))
    return flag_type


# What the client commands (`mhaserve health`, the image's HEALTHCHECK; `encode`; Locust) read: a container may set
# it beside the server's own settings, MHASERVE_API_KEYS among them, which it is not a misspelling of.
CLIENT_VARIABLES = (env_var("api_key"),)
# What else reads MHASERVE_* variables from the shell or .env that starts the server: the compose files (the image,
# the models' folder, the ports they publish) and the container tests. Not settings, and not mistakes.
OTHER_VARIABLES = (
    "MHASERVE_IMAGE",
    "MHASERVE_MODELS_DIR",
    "MHASERVE_GRPC_PUBLISH",
    "MHASERVE_HTTP_PUBLISH",
    "MHASERVE_METRICS_PUBLISH",
    "MHASERVE_LB_PUBLISH",
    "MHASERVE_LB_HTTP_PUBLISH",
    "MHASERVE_LB_STATS_PUBLISH",
    "MHASERVE_TEST_KEEP_IMAGES",
)
# What Kubernetes sets in a pod for a Service named mhaserve (or mhaserve-<x>) where enableServiceLinks is on, as
# Docker's links did: <SVC>_SERVICE_HOST, <SVC>_SERVICE_PORT[_<NAME>], <SVC>_PORT_<n>_<PROTO>[_PROTO|_PORT|_ADDR]
# (and <SVC>_PORT=tcp://..., which for `mhaserve` is --port's own variable: deploy/k8s sets it, and the links off).
SERVICE_LINK = re.compile(
    r"MHASERVE(_\w+?)?_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)\Z"
)
# Names that look like a setting's but are nearest in spelling to another's: the gRPC port is --port, and one
# --host serves gRPC and HTTP.
MEANT = {
    "MHASERVE_GRPC_PORT": env_var("port"),
    "MHASERVE_GRPC_HOST": env_var("host"),
    "MHASERVE_HTTP_HOST": env_var("host"),
}


def misspelt(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each MHASERVE_* variable that is not a setting, whatever its name: the server never reads it
    (MHASERVE_HTTP_PROT left the default port, MHASERVE_DRAIN no drain delay, without a word). It names the
    setting likely meant where one is (`_meant`). Not for the variables the compose files, the client commands and
    the tests read (MHASERVE_IMAGE, MHASERVE_API_KEY), nor Kubernetes' service links (SERVICE_LINK)."""
    env = os.environ if env is None else env
    known = [env_var(f.name) for f in dataclasses.fields(Settings)]
    warnings = []
    for name in sorted(env):
        if SERVICE_LINK.match(name) or (re.fullmatch(r"MHASERVE_\w+_PORT", name) and env[name].startswith("tcp://")):
            continue  # a Kubernetes service link: no one's mistake
        if name.startswith("MHASERVE_") and name not in known and name not in CLIENT_VARIABLES + OTHER_VARIABLES:
            meant = _meant(name, known)
            hint = f"did you mean {_either(meant)}?" if meant else "mhaserve serve --help lists its variables"
            warnings.append(f"{name} is not a setting of mhaserve serve (ignored); {hint}")
    return warnings


def _meant(name: str, known: list[str]) -> list[str]:
    """The settings `name` likely meant, all those as likely as the likeliest, or none. First a setting whose name
    starts with it or whose words hold all of its (MHASERVE_GRACE: MHASERVE_GRACE_PERIOD, MHASERVE_TLS_CA:
    MHASERVE_TLS_CLIENT_CA), the fewest words longer (MHASERVE_REPO: MHASERVE_REPOSITORY, not
    MHASERVE_REPOSITORY_POLL_S); then the nearest in spelling, which alone told MHASERVE_GRACE to set
    MHASERVE_GRAPH."""
    # In capitals: the server reads MHASERVE_PORT, never MHASERVE_Port, and the names compare as they would be written.
    name = name.upper()
    if name in MEANT:
        return [MEANT[name]]
    words = _words(name)
    if not words:  # MHASERVE_ alone starts every setting's name and means none of them
        return []
    extra = {
        setting: len(_words(setting)) - len(words)
        for setting in known
        if setting.startswith(name) or set(words) <= set(_words(setting))
    }
    if len(extra) > 4:  # a fragment of many (MHASERVE_MAX: nine settings); the fewest words would pick by chance
        return []
    if extra:
        fewest = min(extra.values())
        return sorted(setting for setting, more in extra.items() if more == fewest)
    ratio = {setting: difflib.SequenceMatcher(None, name, setting).ratio() for setting in known}
    best = max(ratio.values(), default=0.0)
    return sorted(setting for setting, r in ratio.items() if r == best) if best >= 0.85 else []


def _words(name: str) -> list[str]:
    return [word for word in name.removeprefix("MHASERVE_").split("_") if word]


def _either(names: list[str]) -> str:
    """The names as a sentence lists them: A; A or B; A, B or C."""
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def build(cli: argparse.Namespace | Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from parsed flags (None where not given), then `MHASERVE_*` variables, then the defaults."""
    given, env = _given(cli), os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        if given.get(f.name) is not None:
            value = given[f.name]
            if f.metadata.get("repeatable") and isinstance(value, list):  # a repeated flag: every value given
                value = tuple(v for part in value for v in part)
            values[f.name] = value
        elif env.get(env_var(f.name), "") != "":
            raw = env[env_var(f.name)]
            try:
                values[f.name] = f.metadata["parse"](raw)
            except SettingsError as e:  # the parser's own words, for the variable
                raise SettingsError(f"{env_var(f.name)}: {e}") from None
            except ValueError as e:
                if f.metadata.get("env_only"):  # keys: no flag to name, and a value never shown
                    raise SettingsError(f"{env_var(f.name)} is not valid: {e}") from None
                raise SettingsError(f"{env_var(f.name)}={raw!r} is not a valid {flag(f.name)}") from None
    try:
        settings = Settings(**values)
    except SettingsError as e:
        raise SettingsError(_as_set(str(e), _from_env(given, env))) from None
    # Here, named as the user set them: the server found a bad one only as it started, naming the flag where a
    # variable had set it (MHASERVE_TLS_CERT=/nope: "cannot start: cannot read --tls-cert /nope", exit 1).
    try:
        _read_at_start(settings)
    except (AuthError, TlsError) as e:
        raise SettingsError(_as_set(str(e), _from_env(given, env))) from None
    return settings


def _read_at_start(settings: Settings) -> None:
    """Each file the server reads as it starts, read as the server will read it (and will again): a certificate
    and key that can be read, are PEM and a pair, a client CA, keys files that hold keys."""
    TlsMaterial.read(TlsFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca))
    for name in ("api_keys_file", "admin_keys_file"):
        if (path := getattr(settings, name)) is not None:
            read_keys_file(path, flag(name))


def inert(settings: Settings, cli: argparse.Namespace | Mapping[str, Any] | None = None,
          env: Mapping[str, str] | None = None) -> list[str]:  # fmt: skip
    """A warning for each setting given a value that the others leave without effect (`Settings.inert`), named
    as the user set it, by its flag or its variable."""
    from_env = _from_env(_given(cli), os.environ if env is None else env)
    return [_as_set(f"{flag(name)} {why} (ignored)", from_env) for name, why in settings.inert()]


def _given(cli: argparse.Namespace | Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(vars(cli) if isinstance(cli, argparse.Namespace) else (cli or {}))


def _from_env(given: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The settings a variable set: not given as a flag, their variable set and not empty."""
    return [f.name for f in dataclasses.fields(Settings) if given.get(f.name) is None and env.get(env_var(f.name))]


def _as_set(message: str, from_env: list[str]) -> str:
    """`message` with the flag of each setting set through its variable replaced by that variable: Settings
    names flags, and "--device must be one of ..." answered MHASERVE_DEVICE=tpu. Not followed by a letter or a
    dash: --repository is not --repository-poll-s."""
    for name in from_env:
        message = re.sub(rf"{re.escape(flag(name))}(?![\w-])", env_var(name), message)
    return message
