"""The inference engine: the one piece of code that feeds an exported graph.

`Engine` is the protocol the batcher and servicers depend on, so tests can inject a fake one and
nothing above this file imports ONNX Runtime. `OnnxEngine` is the real thing. The export's parity gate
runs graphs through `OnnxEngine` too, so the gate checks the path the server serves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Iterator, MutableSequence
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from mhaserve.runtime.cpus import available_cpus
from mhaserve.runtime.devices import CPU, CUDA, Device, preload_cuda, wants_cuda
from mhaserve.runtime.errors import InvalidArgument, Unavailable, reason

log = logging.getLogger(__name__)


class Engine(Protocol):
    """Runs padded batches: (B, T) int64 ids and mask in, (B, d) float32 pooled embeddings out."""

    @property
    def providers(self) -> list[str]: ...

    def run(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64], *, beside: bool = False
    ) -> npt.NDArray[np.float32]:
        """`beside`: the caller knows of another batch that computes or is about to (see OnnxEngine.run)."""
        ...


def check_batch(
    input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64], *, max_seq_len: int, vocab_size: int
) -> None:
    """Refuse what the graph must never see: a sequence past the position table, ids outside the vocab.

    The graph itself would index out of its tables (ONNX Runtime errors or, on CUDA, reads garbage).
    """
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise InvalidArgument(
            f"input_ids and attention_mask must be 2-D of one shape, got {input_ids.shape} and {attention_mask.shape}"
        )
    if input_ids.dtype != np.int64 or attention_mask.dtype != np.int64:
        raise InvalidArgument(f"inputs must be int64, got {input_ids.dtype} and {attention_mask.dtype}")
    batch, seq = input_ids.shape
    if batch == 0 or seq == 0:
        raise InvalidArgument(f"empty batch: shape {input_ids.shape}")
    if seq > max_seq_len:
        raise InvalidArgument(f"sequence length {seq} exceeds the model's maximum of {max_seq_len} tokens")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidArgument(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if not np.isin(attention_mask, (0, 1)).all():
        raise InvalidArgument("attention_mask must hold only 0 and 1")


@functools.cache
def _register_shared_arena() -> None:
    """One CPU arena in ONNX Runtime's environment, for sessions that ask for it (once per process)."""
    import onnxruntime as ort

    memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, -1, -1, -1))


def _session_options(
    intra_op_threads: int | None, inter_op_threads: int, *, shared_arena: bool = False, spin: bool = True
) -> object:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if shared_arena:
        _register_shared_arena()
        opts.add_session_config_entry("session.use_env_allocators", "1")
    # Explicit thread counts: ORT's default spins one thread per core, which fights the event loop
    # and the tokeniser threads of the server on a small machine.
    opts.intra_op_num_threads = intra_op_threads or available_cpus()
    opts.inter_op_num_threads = inter_op_threads
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # On the CPU the pool threads spin while a run computes and stop as soon as it returns. Spinning inside a
    # run spares the second thread a wake-up at every operator: one short text ran 1.6 ms sooner (4.6 against
    # 6.2 ms on 2 cores), and the server's one-client p50 fell by as much. Spinning on between runs, ORT's
    # default, takes the cores the event loop needs to answer and refuse requests: under a 10x burst on 2
    # cores, refusals took 1.3 s at p50 with it; stopped at the end of each run, they take what they took
    # with spinning off (docs/benchmarks.md, "ONNX Runtime's threads spin during a run only"). On CUDA
    # (`spin` False) the pool has next to nothing to compute and a thread spinning while the GPU works would
    # only take a core from tokenising; not measured on a GPU, so it stays off there.
    if spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1")
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    else:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


class Runs:
    """Engine runs in progress, counted over every engine that shares this: with several models served, a
    batch of one overlaps a batch of another as much as one of its own, and must take its share of the
    cores, not all of them (two sessions with every core each would preempt each other).

    `peers` extends the count to other server processes on the same cores (`mhaserve serve --processes`):
    a table in shared memory with one slot per process, where slot `index` is this process's own count
    and the others are read as runs that overlap. Each process writes its own slot only, so no lock spans
    processes (a process killed mid-update would leave none held), and the supervisor clears the slot of
    a process that exited. A read may miss a run that starts at that instant: two batches then both take
    every core for once, which costs time and nothing else."""

    def __init__(self, peers: MutableSequence[int] | None = None, index: int = 0) -> None:
        self._n = 0
        self._lock = threading.Lock()
        self._peers = peers
        self._index = index

    def _others(self) -> int:
        if self._peers is None:
            return 0
        return sum(self._peers) - self._peers[self._index]

    @contextlib.contextmanager
    def counted(self) -> Iterator[int]:
        """Count a run for as long as it lasts; yields how many others were in progress when it began."""
        with self._lock:
            others = self._n + self._others()
            self._n += 1
            if self._peers is not None:
                self._peers[self._index] = self._n
        try:
            yield others
        finally:
            with self._lock:
                self._n -= 1
                if self._peers is not None:
                    self._peers[self._index] = self._n


class OnnxEngine:
    """An ONNX Runtime session on CUDA (with IO binding) or the CPU, with its inputs checked."""

    def __init__(
        self,
        graph: Path,
        *,
        max_seq_len: int,
        vocab_size: int,
        device: Device = "auto",
        intra_op_threads: int | None = None,
        inter_op_threads: int = 1,
        pooling: str = "mean",
        overlap_threads: int | None = None,
        runs: Runs | None = None,
        hidden_size: int | None = None,
    ) -> None:
        """`overlap_threads`: on the CPU, a second session of the same graph with this many threads, for a batch
        that starts while another computes (see `run`); None: every batch on the one session. `runs`: where the
        runs in progress are counted, shared by the engines of one server (None: this engine's own).
        `hidden_size`: the manifest's, refused where the graph's output says another size."""
        import onnxruntime as ort

        self.graph = graph
        self.max_seq_len = max_seq_len
        self.pooling = pooling  # for a graph that outputs token states; a pooled graph's own pooling stands
        self.vocab_size = vocab_size
        want_cuda = wants_cuda(device)
        providers: list[str | tuple[str, dict[str, str]]] = [CPU]
        if want_cuda:
            preload_cuda()
            # CPU only for the nodes CUDA cannot run; ORT assigns those itself.
            providers = [(CUDA, {"cudnn_conv_algo_search": "DEFAULT"}), CPU]
        # The overlap session (CPU only) and the main one draw on one arena: each session's own would plan
        # for the widest batch twice (MiniLM: 946 MB resident after warm-up against 540 with one session).
        overlap = overlap_threads is not None and not want_cuda
        self.session = ort.InferenceSession(
            str(graph),
            sess_options=_session_options(intra_op_threads, inter_op_threads, shared_arena=overlap, spin=not want_cuda),
            providers=providers,
        )
        self.overlap_session = None
        if overlap:
            self.overlap_session = ort.InferenceSession(
                str(graph),
                sess_options=_session_options(overlap_threads, inter_op_threads, shared_arena=True),
                providers=[CPU],
            )
        got = self.session.get_providers()
        self._runs = runs or Runs()  # runs in progress, over both sessions (and other engines sharing it)
        self.overlapped_runs = 0  # how many ran on the overlap session (a test and the curious read it)
        # ONNX Runtime falls back to the CPU silently when the CUDA libraries do not load: check.
        self.on_cuda = got[0] == CUDA
        if device == "cuda" and not self.on_cuda:
            raise Unavailable(
                f"--device cuda was asked for but ONNX Runtime could not load CUDA (session got {got}); "
                "check the driver and the CUDA and cuDNN libraries this onnxruntime-gpu build needs (ONNX Runtime's "
                "own error above names the one missing), or use --device cpu"
            )
        if want_cuda and not self.on_cuda:
            log.warning("CUDA is available to ONNX Runtime but the session did not load it; running on %s", got)
        log.info("ONNX Runtime session for %s uses providers %s", graph.name, got)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_name = self.session.get_outputs()[0].name
        # (batch, sequence, hidden): an encoder without pooling (an imported graph); pool it here.
        self.token_states = len(self.session.get_outputs()[0].shape) == 3
        # A manifest edited by hand or copied beside another graph: the server would announce one size
        # (metadata, `dimensions`' bound) and answer another.
        width = self.session.get_outputs()[0].shape[-1]
        if hidden_size is not None and isinstance(width, int) and width != hidden_size:
            raise Unavailable(
                f"{graph.name} outputs embeddings of {width} values, but its manifest says hidden_size {hidden_size}"
            )

    @property
    def providers(self) -> list[str]:
        return list(self.session.get_providers())

    @contextlib.contextmanager
    def _counted(self, beside: bool) -> Iterator[bool]:
        """Count this run among those in progress; yields whether it goes to the overlap session."""
        with self._runs.counted() as others:
            overlapped = (beside or others > 0) and self.overlap_session is not None
            self.overlapped_runs += overlapped
            yield overlapped

    def run(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64], *, beside: bool = False
    ) -> npt.NDArray[np.float32]:
        """Embed a padded batch: (B, d) float32.

        With an overlap session (several inference workers on the CPU), a batch that starts while another
        computes runs on it, with its share of the cores, and a batch alone runs on the main session, with
        all of them. One session for both cases loses either way on 2 cores: all threads for every batch
        makes concurrent batches fight over the same pool (0.97x one worker's throughput at 32 clients),
        a share for every batch leaves a lone request on one core (0.58x at one client); the two
        sessions keep one worker's speed at one client and two workers' under load (docs/benchmarks.md).

        `beside`: the caller (the batcher) knows of another batch that computes or waits to, so this one takes
        its share even when no other run is counted at this instant. Under load a worker that has just ended
        a batch is between runs for a moment; a batch that started then took every core for its whole run,
        and the next batch beside it its share on top: three threads on two cores for ~25 ms, a run in
        eleven at 32 clients (docs/benchmarks.md, twenty-eighth session).
        """
        with self._counted(beside) as overlapped:
            return self._run(input_ids, attention_mask, overlapped=overlapped)

    def _run(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64], *, overlapped: bool
    ) -> npt.NDArray[np.float32]:
        check_batch(input_ids, attention_mask, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size)
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        if not self.on_cuda:
            session = self.overlap_session if overlapped and self.overlap_session is not None else self.session
            out = np.asarray(session.run([self.output_name], feeds)[0], dtype=np.float32)
        else:
            binding = self.session.io_binding()
            for name, value in feeds.items():
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            binding.bind_output(self.output_name, "cpu")
            self.session.run_with_iobinding(binding)
            out = np.asarray(binding.copy_outputs_to_cpu()[0], dtype=np.float32)
        return pool(out, attention_mask, self.pooling) if self.token_states else out


def pool(states: npt.NDArray[np.float32], mask: npt.NDArray[np.int64], pooling: str) -> npt.NDArray[np.float32]:
    """(B, T, d) token states -> (B, d): the mean over real tokens (as sentence-transformers), or the first."""
    if pooling == "cls":
        return np.ascontiguousarray(states[:, 0, :])
    weights = mask.astype(np.float32)[:, :, None]
    return (states * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)


def release_memory(engine: Engine) -> None:
    """Before an engine is dropped: its sessions' shared arena (several inference workers on a CPU) belongs
    to the process and outlives them; a run that asks ONNX Runtime to shrink it gives its free chunks back
    (MiniLM: 371 MB resident after dropping an engine, 145 MB with this; other models' sessions on the
    arena take what they need again at their next batch)."""
    if not isinstance(engine, OnnxEngine) or engine.overlap_session is None:
        return
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    ones = np.ones((1, 2), dtype=np.int64)
    for session in (engine.session, engine.overlap_session):
        session.run([engine.output_name], {"input_ids": ones, "attention_mask": ones}, options)


def _check_vocabulary(engine: OnnxEngine) -> None:
    """Run the last id of the vocabulary the manifest says: a vocab_size past the graph's embedding table (a
    manifest edited by hand, or beside another graph) lets ids between the two through check_batch, and each
    request holding one failed in the graph, a 500, while the version was reported ready. On the CPU only:
    CUDA's Gather answers zeros for an id past its table, and its EmbedLayerNormalization does not check."""
    top = np.array([[engine.vocab_size - 1]], dtype=np.int64)
    try:
        engine.run(top, np.ones_like(top))
    except Exception as e:  # the first run of the graph: what fails may be another thing, which reason(e) says
        raise Unavailable(
            f"the graph fails on token id {top[0, 0]}, the last of the vocab_size {engine.vocab_size} its manifest "
            f"says (a manifest that does not describe this graph?): {reason(e)}"
        ) from None


def warm_up(engine: Engine, *, max_seq_len: int, max_batch_tokens: int) -> int:
    """Run the graph over the shapes a batcher will make, before the model is reported ready.

    Powers of two up to the model's maximum length, one row each, then the widest batch the token
    budget allows at that length: ONNX Runtime plans its memory arena (and on CUDA picks its kernels)
    on first sight of a shape, and no client should pay for that. First, the vocabulary's last id
    (_check_vocabulary). Returns the number of runs.
    """
    lengths = sorted({min(2**i, max_seq_len) for i in range(math.ceil(math.log2(max_seq_len)) + 1)})
    # Once each: with a budget of one longest input (the CPU's 256 for MiniLM) the widest batch is the last row.
    shapes = list(dict.fromkeys([(1, n) for n in lengths] + [(max(1, max_batch_tokens // max_seq_len), max_seq_len)]))
    overlap = isinstance(engine, OnnxEngine) and engine.overlap_session is not None
    if isinstance(engine, OnnxEngine):
        _check_vocabulary(engine)
    for rows, n in shapes:
        try:
            ones = np.ones((rows, n), dtype=np.int64)
            engine.run(ones, ones)
            if overlap:  # the second session plans its own arena
                assert isinstance(engine, OnnxEngine)
                engine._run(ones, ones, overlapped=True)
        except Exception as e:
            if rows == 1:
                raise
            # A budget too large for this host (an extra zero): numpy's or ONNX Runtime's allocation failure
            # named neither the budget nor where it is set. The batcher would form such a batch under load.
            raise Unavailable(
                f"the widest batch of the token budget, {rows} inputs of {n} tokens (max_batch_tokens "
                f"{max_batch_tokens}: --max-batch-tokens, or limits in the model's serving.json), cannot run here: "
                f"{reason(e)}"
            ) from None
    return len(shapes) * (2 if overlap else 1) + isinstance(engine, OnnxEngine)  # and the vocabulary's run
