"""The model repository's contract: `<repository>/<name>/<version>/manifest.json` and its graphs.

This module imports neither torch nor onnx: the server reads manifests with it, the exporter writes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mhaserve.runtime.digests import sha256_file
from mhaserve.runtime.external_data import file_name
from mhaserve.runtime.external_data import locations as external_files
from mhaserve.runtime.serving import POOLINGS

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT = 1
INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAME = "embeddings"
# The fused fp32 graph for CPUs: `optimized` with its layer norms as plain operators (export/layer_norms.py).
CPU_GRAPH = "optimized-cpu"
# The graphs written for the CPU, in the order the export measures their speed (fp16 is for CUDA hosts).
CPU_GRAPHS = ("fp32", "optimized", CPU_GRAPH, "int8")
# Every graph an entry may have: its manifest's `graphs` keys.
GRAPH_NAMES = ("fp32", "optimized", CPU_GRAPH, "fp16", "int8")
# Lower-case letters, digits, '.', '_' and '-', not starting with a dot: a name never names a path.
# `\Z`, not `$`: `$` also matches before a final newline ("abc\n" would pass).
MAX_NAME = 128
NAME_RE = re.compile(rf"^[a-z0-9][a-z0-9._-]{{0,{MAX_NAME - 1}}}\Z")


class ManifestError(ValueError):
    """A repository entry is missing, malformed, or its graph does not match its checksum."""


@dataclass(frozen=True)
class GraphEntry:
    """One ONNX graph of an entry: the plain fp32 export, or a fused (`optimized`, and `optimized-cpu` for
    CPUs), fp16 or int8 variant of it."""

    file: str
    sha256: str
    precision: str  # "fp32", "fp16" or "int8"
    optimized: bool  # ONNX Runtime fusions applied (attention, embedding and skip layernorms, bias-gelu)
    # What its gate measured (the parity gate against the eager model, or the int8 gate against the fused
    # fp32 graph) and its bar, the graph's node count by type, and (CPU graphs of an export with --optimize
    # or --int8) its in-process speed relative to the plain fp32 graph on the exporting machine.
    parity: dict[str, Any]
    # The sha256 of each external-data file the graph reads tensors from, by its name (a graph past 1.5 GB
    # keeps every weight in model.onnx.data; the fused graphs of such an export read theirs from it too): the
    # graph's own sha256 vouches for the files' names, not their bytes. None (no key, or null) for a graph
    # that holds its tensors, whose sha256 vouches that it names no file; left out of the manifest then, so
    # that servers older than the key read such manifests (they refuse an unknown key). Manifests written
    # before it was recorded have none either: their external data is not checked.
    external_data: dict[str, str] | None = None

    @classmethod
    def of(cls, path: Path, *, precision: str, optimized: bool, parity: dict[str, Any]) -> GraphEntry:
        """The entry of the graph written at `path`, with its sha256 and that of each external-data file it
        reads."""
        files = sorted(external_files(path))
        _refuse_elsewhere(path, files)  # before any is read: `../x` would have it hash a file of another folder
        return cls(
            file=path.name,
            sha256=sha256_file(path),
            precision=precision,
            optimized=optimized,
            parity=parity,
            external_data={name: sha256_file(path.parent / name) for name in files} or None,
        )


@dataclass(frozen=True)
class Manifest:
    """What a server needs to serve an entry, and what a user audits about how it was made."""

    name: str
    version: int
    source: str
    architecture: str
    hidden_size: int
    layers: int
    heads: int
    ffn: int
    max_seq_len: int
    max_positions: int
    pooling: str
    normalize: bool
    vocab_size: int
    pad_id: int
    opset: int
    graphs: dict[str, GraphEntry]
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    tokenizer: str = TOKENIZER
    # The tokenizer's sha256, checked as a graph's: another tokenizer gives other ids, so other vectors, with
    # no error anywhere. "" in manifests written before it was recorded: those are not checked.
    tokenizer_sha256: str = ""
    exporter: dict[str, str] = field(default_factory=dict)
    created: str = ""
    format: int = FORMAT
    # sentence-transformers' named prompts and default prompt of the source (config_sentence_transformers.json),
    # served unless the model's serving.json names prompts of its own.
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str = ""

    def to_json(self) -> str:
        d = asdict(self)
        for graph in d["graphs"].values():
            if graph["external_data"] is None:
                del graph["external_data"]  # a graph that holds its tensors (GraphEntry.external_data)
        return json.dumps(d, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: Any) -> Manifest:
        """A manifest from its JSON; ManifestError naming the key at fault (a hand-edited or truncated file is
        refused in one line, not by a TypeError deep in the loader)."""
        d = dict(_checked(cls, d, "the manifest"))
        if d.get("format") != FORMAT:
            raise ManifestError(f"unsupported manifest format {d.get('format')!r} (expected {FORMAT})")
        for key in ("max_seq_len", "vocab_size"):
            if d[key] < 1:
                raise ManifestError(f"manifest key {key!r} must be at least 1, got {d[key]}")
        if d["max_seq_len"] > d["max_positions"]:  # ONNX Runtime failed on a bare broadcast in warm-up, no key named
            raise ManifestError(
                f"manifest key 'max_seq_len' ({d['max_seq_len']}) exceeds 'max_positions' ({d['max_positions']}): the "
                "graph has no position past it"
            )
        if d["pooling"] not in POOLINGS:  # what the server pools a graph of token states by, and reports
            raise ManifestError(f"manifest key 'pooling' must be one of {', '.join(POOLINGS)}, got {d['pooling']!r}")
        if not isinstance(d["graphs"], dict) or not d["graphs"]:
            raise ManifestError("manifest key 'graphs' must be an object naming at least one graph")
        d["graphs"] = {k: GraphEntry(**_checked(GraphEntry, v, f"graph {k!r}")) for k, v in d["graphs"].items()}
        for k, g in d["graphs"].items():
            if not all(isinstance(v, str) for v in (g.external_data or {}).values()):
                raise ManifestError(f"graph {k!r}: 'external_data' must map file names to sha256 digests")
        prompts = d.get("prompts", {})
        if not all(isinstance(v, str) for v in prompts.values()):
            raise ManifestError("manifest key 'prompts' must map names to prompt texts")
        if d.get("default_prompt_name") and d["default_prompt_name"] not in prompts:
            raise ManifestError(f"manifest: default_prompt_name {d['default_prompt_name']!r} is not one of its prompts")
        return cls(**d)

    def graph(self, variant: str) -> GraphEntry:
        try:
            return self.graphs[variant]
        except KeyError:
            raise ManifestError(
                f"model {self.name} version {self.version} has no {variant!r} graph (has: {', '.join(self.graphs)})"
            ) from None


# The JSON type each field's annotation asks for (annotations are strings here: `from __future__ import annotations`).
_JSON_TYPES: dict[str, tuple[type, str]] = {
    "str": (str, "a string"),
    "int": (int, "an integer"),
    "bool": (bool, "true or false"),
    "dict[str, Any]": (dict, "an object"),
    "dict[str, str]": (dict, "an object"),
    "dict[str, str] | None": (dict, "an object"),
    "dict[str, GraphEntry]": (dict, "an object"),
    "list[dict[str, Any]]": (list, "a list"),
}


def _checked(cls: type, d: Any, what: str) -> dict[str, Any]:
    """`d`, checked against `cls`'s fields: an object, no key missing or unknown, each of its field's JSON type
    (true is not an integer; null where the field may be None), integers not negative."""
    if not isinstance(d, dict):
        raise ManifestError(f"{what} must be a JSON object, got {type(d).__name__}")
    known = {f.name: f for f in fields(cls)}
    if unknown := sorted(set(d) - set(known)):
        raise ManifestError(f"{what} has an unknown key {unknown[0]!r}")
    for name, f in known.items():
        if name not in d:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ManifestError(f"{what} lacks the key {name!r}")
            continue
        want, said = _JSON_TYPES[str(f.type)]
        value = d[name]
        if value is None and str(f.type).endswith(" | None"):
            continue
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ManifestError(f"{what}: {name!r} must be {said}, got {json.dumps(value)[:60]}")
        if isinstance(value, int) and value < 0:
            raise ManifestError(f"{what}: {name!r} must not be negative, got {value}")
    return d


def read_manifest(entry_dir: Path) -> Manifest:
    path = entry_dir / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))  # -sig: a byte order mark (Notepad) skipped
    except FileNotFoundError:
        raise ManifestError(f"{entry_dir} has no {MANIFEST}") from None
    except ValueError as e:  # JSONDecodeError, a byte that is not UTF-8, a number past Python's digits
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ManifestError(f"{path} is not valid JSON: nested too deeply") from None
    try:
        return Manifest.from_dict(data)
    except ManifestError as e:
        raise ManifestError(f"{path}: {e}") from None


def verify_graph(entry_dir: Path, entry: GraphEntry) -> Path:
    """The graph's path, after checking that its bytes, and those of each external-data file it reads, are
    the ones the manifest vouches for (a manifest written before it listed external data: the graph's only)."""
    path = entry_dir / entry.file
    if Path(entry.file).name != entry.file:
        raise ManifestError(f"graph file {entry.file!r} must be a plain file name inside {entry_dir}")
    if not path.is_file():
        raise ManifestError(f"graph {path} is missing")
    actual = sha256_file(path)
    if actual != entry.sha256:
        raise ManifestError(
            f"graph {path} fails its checksum: sha256 {actual[:12]}…, manifest says {entry.sha256[:12]}…"
        )
    if entry.external_data is not None:
        _verify_external_data(path, entry.external_data)
    return path


def _verify_external_data(graph: Path, listed: dict[str, str]) -> None:
    # Read from the graph, now that its checksum vouches for it, not from the folder: a graph saved again
    # with its weights apart, its sha256 updated and not this, would have ONNX Runtime read bytes no manifest
    # vouches for.
    read = external_files(graph)
    # A manifest may spell a file as the graph does (`./model.onnx.data`): the same file, by the same rule.
    listed = {file_name(name): digest for name, digest in listed.items()}
    # The graph's own locations first: one outside the folder is refused as such, whatever the manifest lists
    # (external_files has made `./model.onnx.data` plain already).
    _refuse_elsewhere(graph, read)
    if unlisted := sorted(read - set(listed)):
        raise ManifestError(f"graph {graph} reads external data {unlisted[0]!r} that its manifest does not list")
    for name, digest in sorted(listed.items()):
        if not _plain(name):
            raise ManifestError(
                f"external data file {name!r} of graph {graph} must be a plain file name inside {graph.parent}"
            )
        path = graph.parent / name
        if not path.is_file():
            raise ManifestError(f"external data {path} of graph {graph} is missing")
        # A link is hashed through, so its bytes are checked; but where it leads out of the folder the version
        # reads a file that is not its own (ONNX Runtime 1.31 refuses that at the session; older ones need not).
        real = path.resolve()
        if not real.is_relative_to(graph.parent.resolve()):
            raise ManifestError(
                f"external data {path} of graph {graph} is a link to {real}, outside {graph.parent}: a graph may "
                "read only files of its own version's folder"
            )
        actual = sha256_file(path)
        if actual != digest:
            raise ManifestError(
                f"external data {path} of graph {graph} fails its checksum: sha256 {actual[:12]}…, "
                f"manifest says {digest[:12]}…"
            )


def _refuse_elsewhere(graph: Path, locations: Iterable[str]) -> None:
    if elsewhere := sorted(name for name in locations if not _plain(name)):
        raise ManifestError(
            f"graph {graph} reads external data {elsewhere[0]!r}, which is no plain file name inside "
            f"{graph.parent}: a graph may read only files of its own version's folder"
        )


def _plain(name: str) -> bool:
    """A file name of the folder itself: no folder part, not the folder or its parent, no NUL (where ONNX
    Runtime's C string would end and name another file)."""
    return Path(name).name == name and name not in ("", ".", "..") and "\x00" not in name


def verify_tokenizer(entry_dir: Path, manifest: Manifest) -> Path:
    """The tokenizer's path, after checking that it is there and, where the manifest records its sha256, that
    its bytes are the ones the manifest vouches for."""
    path = entry_dir / manifest.tokenizer
    if Path(manifest.tokenizer).name != manifest.tokenizer or not path.is_file():
        raise ManifestError(f"{entry_dir} has no tokenizer file {manifest.tokenizer!r}")
    if manifest.tokenizer_sha256:
        actual = sha256_file(path)
        if actual != manifest.tokenizer_sha256:
            raise ManifestError(
                f"tokenizer {path} fails its checksum: sha256 {actual[:12]}…, "
                f"manifest says {manifest.tokenizer_sha256[:12]}…"
            )
    return path


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        if len(name) > MAX_NAME and re.fullmatch(r"[a-z0-9][a-z0-9._-]*", name):  # the rule it breaks: its length
            raise ManifestError(f"invalid model name {name!r} ({len(name)} characters): at most {MAX_NAME}")
        raise ManifestError(
            f"invalid model name {name!r}: use lower-case letters, digits, '.', '_' and '-', beginning with a "
            "letter or a digit"
        )
    return name


# A version is an int64 where the gRPC APIs carry it (encoder.v1's model_version, GetModelInfo's version).
MAX_VERSION = 2**63 - 1


def is_number(text: str) -> bool:
    """ASCII digits only (a version, a length): str.isdigit() is also true of "²" or "١", which int() refuses
    or reads as a number."""
    return text.isascii() and text.isdigit()


def number(text: str) -> int | None:
    """The value of `text` if it is a number (is_number), else None. One of more than 19 digits past its
    leading zeros reads as MAX_VERSION + 1, more than any version or length served (a version not found, a
    length too large): int() refuses a string of over 4,300 digits, zeros included, and such a version in a
    request was a ValueError, answered 500."""
    if not is_number(text):
        return None
    digits = text.lstrip("0")
    return int(digits or "0") if len(digits) <= 19 else MAX_VERSION + 1


def versions(repository: Path, name: str) -> list[int]:
    """The published versions of a model, ascending (directories named by a positive integer, written as one:
    `08` was counted as version 8 while its files were looked for in `8/`)."""
    base = repository / check_name(name)
    if not base.is_dir():
        return []
    return sorted(int(p.name) for p in base.iterdir() if p.is_dir() and is_version(p.name))


def is_version(folder: str) -> bool:
    """Whether a model's folder of this name is a version: a number from 1 to MAX_VERSION, written as one (not
    `08`)."""
    value = number(folder)
    return value is not None and 0 < value <= MAX_VERSION and folder == str(value)


def models(repository: Path) -> list[str]:
    """The model names in a repository that have at least one version, or whose folder cannot be read (listed:
    its reader says why; one such folder failed the whole listing, every other model's poll and the index)."""
    if not repository.is_dir():
        return []
    return sorted(p.name for p in repository.iterdir() if NAME_RE.match(p.name) and _has_versions(repository, p.name))


def _has_versions(repository: Path, name: str) -> bool:
    try:
        return bool(versions(repository, name))
    except OSError:
        return True


def entry_dir(repository: Path, name: str, version: int) -> Path:
    return repository / check_name(name) / str(int(version))
