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
# Names that look like a setting's but are nearest in spelling to another's: the gRPC port is --port, and one
# --host serves gRPC and HTTP.
MEANT = {
    "MHASERVE_GRPC_PORT": env_var("port"),
    "MHASERVE_GRPC_HOST": env_var("host"),
    "MHASERVE_HTTP_HOST": env_var("host"),
}


def misspelt(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each MHASERVE_* variable that is not a setting but is nearly one's name (a typo, ignored
    without a word: MHASERVE_HTTP_PROT left the default port). Other MHASERVE_* names are left alone: compose
    files and the client commands have their own (MHASERVE_IMAGE, MHASERVE_API_KEY)."""
    env = os.environ if env is None else env
    known = [env_var(f.name) for f in dataclasses.fields(Settings)]
    warnings = []
    for name in sorted(env):
        if name.startswith("MHASERVE_") and name not in known and name not in CLIENT_VARIABLES:
            close = [MEANT[name]] if name in MEANT else difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            if close:
                warnings.append(f"{name} is not a setting of mhaserve serve (ignored); did you mean {close[0]}?")
    return warnings


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
