"""A model's serving config: `<repository>/<name>/serving.json`, beside its versions, optional and validated.

What an operator decides about serving a model, apart from how it was exported:

    {
      "version_policy": {"latest": {"num_versions": 2}},     # or {"specific": {"versions": [1, 3]}}, {"all": {}}
      "pooling": "mean",                                      # mean or cls; for graphs that output token states
      "normalize": true,                                      # the default when a request does not say
      "max_length": 128,                                      # tokens, at most the export's maximum
      "prompts": {"query": "query: ", "passage": "passage: "},# requests select one by name (prompt_name)
      "default_prompt_name": "query",
      "limits": {"max_batch_tokens": 4096}                    # this model's own batcher limits
    }

Every key is optional; an unknown key, a wrong type or an impossible value is an error that names the
file and the key, so a typo never silently changes nothing. The version policy is Triton's: the latest
N versions (1 by default), specific versions, or all.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

SERVING_FILE = "serving.json"
POOLINGS = ("mean", "cls")
LIMIT_KEYS = {
    "max_batch_tokens": int,
    "max_wait_ms": float,
    "max_queue_size": int,
    "max_client_batch_size": int,
    "max_padding": float,
}
KEYS = {"version_policy", "pooling", "normalize", "max_length", "prompts", "default_prompt_name", "limits"}


class ServingConfigError(ValueError):
    """A serving.json that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class VersionPolicy:
    """Which published versions are served (Triton's ModelVersionPolicy)."""

    kind: Literal["latest", "specific", "all"] = "latest"
    latest: int = 1
    specific: tuple[int, ...] = ()

    def select(self, published: list[int]) -> list[int]:
        """The versions to serve out of those published (ascending)."""
        if self.kind == "all":
            return sorted(published)
        if self.kind == "specific":
            return sorted(v for v in published if v in self.specific)
        return sorted(published)[-self.latest :]

    def describe(self) -> dict[str, Any]:
        """As Triton writes it (the model config's version_policy)."""
        if self.kind == "all":
            return {"all": {}}
        if self.kind == "specific":
            return {"specific": {"versions": list(self.specific)}}
        return {"latest": {"num_versions": self.latest}}


@dataclass(frozen=True)
class ServingConfig:
    """See the module docstring; the defaults are those of a model with no serving.json."""

    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    pooling: str | None = None  # None: the graph's own (the manifest's)
    normalize: bool | None = None  # None: the manifest's
    max_length: int | None = None  # None: the manifest's max_seq_len
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    limits: dict[str, float] = field(default_factory=dict)


# The largest whole number a serving config takes: past it no queue, timer or version number holds it.
MAX_WHOLE = 2**63 - 1


def _whole(value: Any, least: int) -> bool:
    """Whether `value` is a whole number (not a bool) from `least` to MAX_WHOLE."""
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= MAX_WHOLE


def _finite(value: float, least: int) -> bool:
    return math.isfinite(value) and least <= value <= MAX_WHOLE


def _policy(value: Any, where: str) -> VersionPolicy:
    if not isinstance(value, dict) or len(value) != 1:
        raise ServingConfigError(f"{where}: version_policy must be one of latest, specific or all, e.g. "
                                 '{"latest": {"num_versions": 1}}')  # fmt: skip
    ((kind, body),) = value.items()
    if not isinstance(body, dict):
        raise ServingConfigError(f"{where}: version_policy.{kind} must be an object")
    if kind == "all" and not body:
        return VersionPolicy("all")
    if kind == "latest" and set(body) <= {"num_versions"}:
        n = body.get("num_versions", 1)
        if not _whole(n, 1):
            raise ServingConfigError(f"{where}: version_policy.latest.num_versions must be a whole number >= 1")
        return VersionPolicy("latest", latest=n)
    if kind == "specific" and set(body) == {"versions"}:
        versions = body["versions"]
        if not isinstance(versions, list) or not versions or not all(_whole(v, 1) for v in versions):
            raise ServingConfigError(f"{where}: version_policy.specific.versions must list version numbers >= 1")
        return VersionPolicy("specific", specific=tuple(sorted(set(versions))))
    raise ServingConfigError(
        f"{where}: version_policy {value!r} is not one of "
        '{"latest": {"num_versions": N}}, {"specific": {"versions": [...]}}, {"all": {}}'
    )


def parse(data: Any, where: str = SERVING_FILE) -> ServingConfig:
    """A serving config from its JSON value; ServingConfigError naming `where` and the key otherwise."""
    if not isinstance(data, dict):
        raise ServingConfigError(f"{where}: must be a JSON object")
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise ServingConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(KEYS))})")
    policy = _policy(data["version_policy"], where) if "version_policy" in data else VersionPolicy()
    pooling = data.get("pooling")
    if pooling is not None and not (isinstance(pooling, str) and pooling in POOLINGS):
        raise ServingConfigError(f"{where}: pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    normalize = data.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise ServingConfigError(f"{where}: normalize must be true or false")
    max_length = data.get("max_length")
    if max_length is not None and not _whole(max_length, 2):
        raise ServingConfigError(f"{where}: max_length must be a whole number >= 2 (special tokens included)")
    prompts = data.get("prompts", {})
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ServingConfigError(f"{where}: prompts must map names to prompt texts")
    default_prompt = data.get("default_prompt_name")
    if default_prompt is not None and not (isinstance(default_prompt, str) and default_prompt in prompts):
        raise ServingConfigError(f"{where}: default_prompt_name {default_prompt!r} is not one of the prompts")
    limits = data.get("limits", {})
    if not isinstance(limits, dict):
        raise ServingConfigError(f"{where}: limits must be an object")
    for key, value in limits.items():
        kind = LIMIT_KEYS.get(key)
        if kind is None:
            raise ServingConfigError(f"{where}: unknown limit {key!r} (known: {', '.join(LIMIT_KEYS)})")
        # As the flags: sizes at least 1 (a limit of 0 inputs refused every request), a wait or a padding 0 or more.
        least = 1 if kind is int else 0
        number_ok = _whole(value, least) or (kind is float and isinstance(value, float) and _finite(value, least))
        if not number_ok:
            raise ServingConfigError(
                f"{where}: limits.{key} must be a {'whole ' if kind is int else ''}number >= {least}, got {value!r}"
            )
    if "max_padding" in limits and limits["max_padding"] > 1:
        raise ServingConfigError(f"{where}: limits.max_padding must be a fraction in [0, 1]")
    if limits.get("max_client_batch_size", 0) > limits.get("max_queue_size", math.inf):
        raise ServingConfigError(
            f"{where}: limits.max_client_batch_size ({limits['max_client_batch_size']}) exceeds limits.max_queue_size "
            f"({limits['max_queue_size']}): such a request could never be queued"
        )
    return ServingConfig(policy, pooling, normalize, max_length, dict(prompts), default_prompt, dict(limits))


def read(model_dir: Path) -> ServingConfig:
    """`<model_dir>/serving.json`, or the defaults where there is none."""
    path = model_dir / SERVING_FILE
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte order mark (Notepad) skipped
    except FileNotFoundError:
        if path.is_symlink():  # a mounted config whose target went away: not "none", or the defaults come back
            raise ServingConfigError(
                f"{path}: cannot be read (a link to {os.readlink(path)}, which does not exist)"
            ) from None
        return ServingConfig()
    except (OSError, UnicodeDecodeError) as e:
        raise ServingConfigError(f"{path}: cannot be read ({e})") from None
    try:
        data = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or a number of more digits than Python reads
        raise ServingConfigError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ServingConfigError(f"{path}: not valid JSON (nested too deeply)") from None
    return parse(data, str(path))
