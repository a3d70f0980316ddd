"""The model repository: finds entries by name and version, verifies them, loads them.

The server serves what this returns and nothing else: a graph whose sha256 differs from its manifest,
a tokenizer file that is missing, or a model that is not there is refused with a message that says which.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer

from mhaserve.runtime import int8_kernels, serving
from mhaserve.runtime import manifest as mf
from mhaserve.runtime.devices import CUDA, Device, wants_cuda
from mhaserve.runtime.engine import Engine, OnnxEngine, Runs
from mhaserve.runtime.errors import NotFound
from mhaserve.runtime.serving import ServingConfig
from mhaserve.runtime.tokenizer import load_for_serving

log = logging.getLogger(__name__)

DEFAULT_MODEL = "all-minilm-l6-v2"
GRAPHS = ("auto", *mf.GRAPH_NAMES)
GraphChoice = Literal["auto", "fp32", "optimized", "optimized-cpu", "fp16", "int8"]


class RepositoryError(RuntimeError):
    """An entry that cannot be served (malformed, tampered with, incomplete)."""


@dataclass(frozen=True)
class ModelEntry:
    """One verified version of a model: its manifest, the files the server reads, and the model's serving
    config (serving.py), with the effective values of what that config may override.

    Its name and version are its place in the repository (`<name>/<version>/`), as in Triton, not what its
    manifest recorded at export: a version copied in by hand (`cp -r 1 .2 && mv .2 2`, or into another
    model's folder) is served where it was put. Keyed by the manifest instead, such a copy was routed
    under one version while the repository's watcher knew it by another, and retired and reloaded itself
    every poll; or it was served under a name no request could reach."""

    manifest: mf.Manifest
    directory: Path
    graph: str  # the variant served: fp32, optimized, optimized-cpu, fp16 or int8
    graph_path: Path
    tokenizer_path: Path
    config: ServingConfig = field(default_factory=ServingConfig)

    @property
    def name(self) -> str:
        return self.directory.parent.name

    @property
    def version(self) -> int:
        return int(self.directory.name)

    @property
    def sha256(self) -> str:
        return self.manifest.graphs[self.graph].sha256

    @property
    def max_tokens(self) -> int:
        """The longest input served, special tokens included."""
        return self.config.max_length or self.manifest.max_seq_len

    @property
    def pooling(self) -> str:
        return self.config.pooling or self.manifest.pooling

    @property
    def normalize(self) -> bool:
        return self.manifest.normalize if self.config.normalize is None else self.config.normalize

    @property
    def prompts(self) -> dict[str, str]:
        """serving.json's prompts when it names any, else those the export found beside the source."""
        return self.config.prompts if self._own_prompts else self.manifest.prompts

    @property
    def default_prompt_name(self) -> str | None:
        if self._own_prompts:
            return self.config.default_prompt_name
        return self.manifest.default_prompt_name or None

    @property
    def _own_prompts(self) -> bool:
        return bool(self.config.prompts) or self.config.default_prompt_name is not None

    @property
    def digest(self) -> str:
        """What this version computes, as a sha256: its graph (by sha256, and the external data it reads: past
        1.5 GB the graph's sha256 covers the data file's name, not its weights), its tokenizer, and the settings
        that shape a vector. Another copy of the version (loaded again from changed files, or with other
        settings) has another; every process's copy the same. Not its version policy or limits."""
        data = sorted((self.manifest.graphs[self.graph].external_data or {}).items())
        prompts = sorted(self.prompts.items())
        tokenizer = self.manifest.tokenizer_sha256
        what = (self.graph, self.sha256, data, tokenizer, self.max_tokens, self.pooling, self.normalize, prompts)
        return hashlib.sha256(repr((*what, self.default_prompt_name)).encode()).hexdigest()

    @property
    def pools_in_graph(self) -> bool:
        """Whether the graph outputs pooled embeddings (rank 2) rather than token states (rank 3)."""
        return not self.manifest.outputs or len(self.manifest.outputs[0].get("shape", ())) != 3


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: its entry, its tokenizer and its engine."""

    entry: ModelEntry
    tokenizer: Tokenizer
    engine: Engine

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def version(self) -> int:
        return self.entry.version

    @property
    def provider(self) -> str:
        return self.engine.providers[0]

    @property
    def on_cuda(self) -> bool:
        return self.provider == CUDA


# What turns a verified entry into something that runs it: ONNX Runtime in production, a scripted
# engine in tests.
EngineFactory = Callable[[ModelEntry], Engine]


def onnx_engine(
    device: Device = "auto",
    intra_op_threads: int | None = None,
    overlap_threads: int | None = None,
    runs: Runs | None = None,
) -> EngineFactory:
    """The production engine factory: ONNX Runtime sessions on `device` (see OnnxEngine for `overlap_threads`).
    Its engines count their runs together (in `runs`, which may span processes), so that a batch that starts
    while another model's computes goes to its overlap session as it would beside one of its own."""
    runs = runs or Runs()

    def make(entry: ModelEntry) -> Engine:
        m = entry.manifest
        return OnnxEngine(
            entry.graph_path,
            max_seq_len=m.max_seq_len,
            vocab_size=m.vocab_size,
            device=device,
            intra_op_threads=intra_op_threads,
            pooling=entry.pooling,
            overlap_threads=overlap_threads,
            runs=runs,
            hidden_size=m.hidden_size,
        )

    return make


def auto_graph(graphs: Iterable[str], device: Device) -> str:
    """`--graph auto`: the fused fp32 graph for where the model runs. On CUDA `optimized`; on the CPU
    `optimized-cpu`, the same graph with its layer norms as plain operators (through the server 1.09-1.12x the
    texts a second on a Zen 5 EPYC, 1.03-1.10x on an AVX2-only Zen 3; docs/benchmarks.md), or `optimized` for
    entries exported before it existed. fp32 where neither is there; never fp16 or int8, whose vectors differ
    from the eager model's by more than the parity gate's 1e-5."""
    have = set(graphs)
    order = ("optimized",) if wants_cuda(device) else (mf.CPU_GRAPH, "optimized")
    return next((g for g in order if g in have), "fp32")


def preferred_default(names: Iterable[str]) -> str:
    """The default model among `names` (one at least): all-minilm-l6-v2 if there, else the first by name."""
    ordered = sorted(names)
    return DEFAULT_MODEL if DEFAULT_MODEL in ordered else ordered[0]


class ModelRepository:
    """A directory of `<name>/<version>/` entries, as `mhaserve export` writes them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._renamed: set[Path] = set()  # versions whose manifest records another name or version: said once
        self._no_cpu_graph: set[Path] = set()  # versions served `optimized` on a CPU for want of optimized-cpu
        self._ignored: set[Path] = set()  # folders that are no model or no version: said once

    def names(self) -> list[str]:
        self._say_ignored(self.root)
        return mf.models(self.root)

    def _say_ignored(self, folder: Path) -> None:
        """Each folder of the repository (`folder` is its root) or of a model (`folder` is the model's) that is
        no model or no version, said once at WARNING: one published as `MiniLM/1/` or `minilm/v1/` was left out
        with no word. Hidden folders (an export's scratch, a Kubernetes volume's `..data`) and lost+found pass."""
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and p.name[0] != "." and p.name != "lost+found")
        except OSError:
            return  # a repository that cannot be read is reported where it is read
        for child in children:
            name = child.name
            if folder == self.root:
                if mf.NAME_RE.match(name):
                    self._say_ignored(child)
                    continue
                lower = f" (as {name.lower()!r} it would be one)" if mf.NAME_RE.match(name.lower()) else ""
                why = f"not a model name{lower}: lower-case letters, digits, '.', '_' and '-'"
            elif mf.is_version(name):
                continue
            else:
                why = (
                    f"not a version: versions are folders named by a number from 1 to {mf.MAX_VERSION}, written as "
                    "one (1, 2, 10)"
                )
            if child not in self._ignored:
                self._ignored.add(child)
                log.warning("ignoring %s in the model repository: %s", child, why)

    def default_name(self) -> str:
        """all-minilm-l6-v2 if the repository has it, else its first model by name."""
        names = self.names()
        if not names:
            if (self.root / mf.MANIFEST).is_file():  # one version's files, unpacked or copied without their folders
                raise NotFound(
                    f"the model repository {self.root} has no models: it holds one model version's files at its "
                    f"top, where a repository holds them in <name>/<version>/ folders (as {self.root}/<name>/1/; "
                    "an archive of a repository: `tar -czf model.tar.gz -C models .`)"
                )
            versions = self._versions_at_top()
            if versions:  # a model's folder (a SageMaker model.tar.gz made with `tar -C models/<name> .`)
                raise NotFound(
                    f"the model repository {self.root} holds a model's versions ({', '.join(versions)}) at its top, "
                    f"where a repository holds them in <name>/<version>/ folders: --repository {self.root.parent} "
                    f"serves it as model {self.root.name!r} (an archive of a repository: `tar -czf model.tar.gz -C "
                    "models .`)"
                )
            raise NotFound(
                f"the model repository {self._where()} has no models; "
                f"create one with `mhaserve export --repository {self.root}`"
            )
        return preferred_default(names)

    def _versions_at_top(self) -> list[str]:
        """The repository's folders that are a model's versions (a number, a manifest in it), by number."""
        try:
            found = [p for p in self.root.iterdir() if mf.is_version(p.name) and (p / mf.MANIFEST).is_file()]
        except OSError:
            return []
        return [p.name for p in sorted(found, key=lambda p: int(p.name))]

    def published(self, name: str) -> list[int]:
        """The versions of a model in the repository, ascending; NOT_FOUND for a model it does not hold."""
        try:
            published = mf.versions(self.root, name)
        except mf.ManifestError as e:
            raise NotFound(str(e)) from None
        self._say_ignored(self.root / name)
        if not published:
            if (self.root / name).is_dir():  # its versions deleted, or never published as numbered folders
                raise NotFound(
                    f"model {name!r} has no version in the repository: its folder {self.root / name} holds no "
                    "version folder (1/, 2/, ...)"
                )
            raise NotFound(
                f"model {name!r} is not in the repository {self._where()} "
                f"(it has: {', '.join(self.names()) or 'nothing'})"
            )
        return published

    def _where(self) -> str:
        """The repository's path for a message; where it does not exist, said so, with the folder a relative
        path was read from (the default, `models`, is relative: a server started elsewhere finds none)."""
        if self.root.is_dir():
            return str(self.root)
        relative = "" if self.root.is_absolute() else f", relative to {Path.cwd()}"
        return f"{self.root} ({'a file, not a folder' if self.root.is_file() else 'no such folder'}{relative})"

    def config(self, name: str) -> ServingConfig:
        """The model's serving config (its serving.json, or the defaults)."""
        try:
            return serving.read(self.root / mf.check_name(name))
        except (serving.ServingConfigError, mf.ManifestError) as e:
            raise RepositoryError(str(e)) from None

    def to_serve(
        self, name: str, policy: serving.VersionPolicy | None = None, published: list[int] | None = None
    ) -> list[int]:
        """The versions the model's version policy (`policy`, where the caller has read it) serves, out of those
        published (`published`, likewise; ascending)."""
        published = self.published(name) if published is None else published
        chosen = (self.config(name).version_policy if policy is None else policy).select(published)
        if not chosen:
            raise NotFound(
                f"model {name!r}: its version policy selects none of the published versions "
                f"({', '.join(map(str, published))})"
            )
        return chosen

    def entry(
        self, name: str | None = None, version: int | None = None, graph: GraphChoice = "auto", device: Device = "auto"
    ) -> ModelEntry:
        """The entry for a model (default: `default_name()`) at a version (default: the latest), verified, with
        the graph `graph` names, or for `auto` the one `auto_graph` picks for `device`."""
        name = name or self.default_name()
        published = self.published(name)
        version = published[-1] if version is None else version
        if version not in published:
            raise NotFound(f"model {name!r} has no version {version} (it has: {', '.join(map(str, published))})")
        directory = mf.entry_dir(self.root, name, version)
        try:
            manifest = mf.read_manifest(directory)
            variant = graph if graph != "auto" else auto_graph(manifest.graphs, device)
            if variant not in manifest.graphs:  # named by its folder, not by the manifest (a copy may differ)
                raise RepositoryError(
                    f"model {name} version {version} has no {variant!r} graph (has: {', '.join(manifest.graphs)})"
                )
            graph_path = mf.verify_graph(directory, manifest.graph(variant))
            tokenizer_path = mf.verify_tokenizer(directory, manifest)
        except mf.ManifestError as e:
            raise RepositoryError(str(e)) from None
        entry = ModelEntry(manifest, directory, variant, graph_path, tokenizer_path, self.config(name))
        _check_config(entry)
        exported_before = graph == "auto" and variant == "optimized" and not wants_cuda(device)
        if exported_before and directory not in self._no_cpu_graph:
            self._no_cpu_graph.add(directory)  # said once, as a renamed version is below
            log.info(
                "%s version %d has no %s graph (exported before it existed): serving optimized on the CPU; "
                "`mhaserve export --optimize` writes a new version with it, about 1.1x the texts a second on a CPU",
                entry.name,
                entry.version,
                mf.CPU_GRAPH,
            )
        if (manifest.name, manifest.version) != (entry.name, entry.version) and directory not in self._renamed:
            self._renamed.add(directory)  # said once, not at each of the start's checks and each reload
            log.warning(
                "%s: its manifest records %s version %d; served as %s version %d, as its place in the repository says",
                directory,
                manifest.name,
                manifest.version,
                entry.name,
                entry.version,
            )
        return entry

    def load(self, entry: ModelEntry, engine_factory: EngineFactory) -> LoadedModel:
        """Open the tokenizer and the engine of a verified entry (slow: seconds for a real model)."""
        try:
            tokenizer = load_for_serving(entry.tokenizer_path, entry.max_tokens)
        except Exception as e:  # tokenizers raises a bare Exception, its parser's message naming no file
            raise RepositoryError(f"{entry.tokenizer_path} cannot be read as a tokenizer: {e}") from None
        if (size := tokenizer.get_vocab_size()) > entry.manifest.vocab_size:
            # (export refuses the pair; a manifest edited by hand had each text with a token past it refused as the
            # client's error, "outside the vocabulary")
            raise RepositoryError(
                f"model {entry.name} version {entry.version}: its tokenizer has {size} tokens, more than the "
                f"vocab_size {entry.manifest.vocab_size} its manifest says (a manifest that does not describe them?)"
            )
        for name, prompt in entry.prompts.items():
            # [CLS] prompt [SEP] filling max_length leaves the text no token: cut to fit, every text a request sent
            # with this prompt embedded as the prompt alone, to one vector. The default prompt's is every request
            # that names none: refused; another's only those that name it: said (a config that loaded before).
            if len(tokenizer.encode(prompt)) >= entry.max_tokens:
                why = (
                    f"model {entry.name} version {entry.version}: prompt {name!r} ({prompt[:100]!r}) with the special "
                    f"tokens fills max_length {entry.max_tokens}, and no token of a text would be left (every text cut "
                    "to the prompt alone): a shorter prompt, or a larger max_length"
                )
                if name == entry.default_prompt_name:
                    raise RepositoryError(why)
                log.warning("%s; a request that names it gets the prompt's vector for every text", why)
        engine = engine_factory(entry)
        log.info(
            "loaded %s version %d (%s graph, sha256 %s…) on %s%s",
            entry.name,
            entry.version,
            entry.graph,
            entry.sha256[:12],
            engine.providers,
            # the int8 graph's speed hangs on the CPU's int8 kernels (2x fp32 or 1.6x): say which it got
            f", int8 products on {int8_kernels.describe()}"
            if entry.graph == "int8" and CUDA not in engine.providers
            else "",
        )
        return LoadedModel(entry, tokenizer, engine)


def _check_config(entry: ModelEntry) -> None:
    """What a serving config may not ask of this version: more tokens than its position table, or a pooling
    its graph does not do (a graph that pools already cannot be re-pooled by the server)."""
    config, m = entry.config, entry.manifest
    where = f"{entry.directory.parent / serving.SERVING_FILE}"
    if config.max_length is not None and config.max_length > m.max_seq_len:
        raise RepositoryError(
            f"{where}: max_length {config.max_length} is more than version {entry.version} was exported for "
            f"({m.max_seq_len} tokens)"
        )
    if config.pooling is not None and entry.pools_in_graph and config.pooling != m.pooling:
        raise RepositoryError(
            f"{where}: pooling {config.pooling!r}, but version {entry.version}'s graph pools by {m.pooling!r} itself; "
            "the server can pool only a graph that outputs token states (last_hidden_state)"
        )
