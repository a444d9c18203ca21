# SPDX-License-Identifier: Apache-2.0
"""How rounds and prefill passes run: eagerly, from padded static buffers (captured as CUDA graphs on
a GPU), or through compiled code; and the compiled rounds' whole lifecycle.

The code that runs is always `RoundParts.round` / `RoundParts.prefill` (engine/round.py). The executor
decides how:
  - eager: called as they are;
  - static (`static_rounds`, or CUDA graphs): the batch is padded to the graph ladder and the pages to
    a power of two, copied into static buffers and run (captured once per padded shape on CUDA, then
    replayed); padding rows point at page 0, which no sequence owns;
  - compiled (`enable_compile`): each shape class through its compiled code (engine/compile.py
    `RoundCache`), loaded from disk or compiled on first use, eager where none covers a call.
Lifecycle of compiled rounds, all here: `enable_compile` (start), `expect` + `load_ready` (classes a
background process compiles: engine/precompile.py), `freeze` (from now on a class without compiled
code runs eagerly rather than stalling serving to compile it), `disable` (back to eager, after a failed
compilation), `claim` (the only classes this process compiles, when processes share a warm-up).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dflash_trt.engine.compile import PREFILL, ROUND, Core, RoundCache
from dflash_trt.engine.round import RoundInputs, RoundParts, RoundShape
from dflash_trt.layers import cpu_gemm

log = logging.getLogger(__name__)

# Padded batch sizes for captured rounds; a batch replays the smallest graph that fits.
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Eager CPU rounds build DDTrees on the host (heap, `build_tree_host`) up to this many nodes per
# batch: cheaper than the batched builder's per-depth dispatches there (bench/README.md, DDTree).
HOST_TREE_MAX_NODES = 256


class Executor:
    def __init__(self, parts: RoundParts, *, num_pages: int, cuda_graphs: bool = False,
                 graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES, static_rounds: bool = False,
                 compile: bool = False, compile_dir: str | None = None) -> None:  # fmt: skip
        """static_rounds: run rounds from padded static buffers even without CUDA graphs (on CPU this
        exercises exactly the padding a captured round sees; tests use it). compile: run rounds and
        prefills through torch.compile (inductor), one compilation per shape class. compile_dir: where
        compiled rounds are saved and looked for (engine/compile.py); None keeps them in memory only."""
        self.parts = parts
        self.device = parts.device
        self.num_pages = num_pages
        moe = parts.target.config.moe is not None
        self.cuda_graphs = bool(cuda_graphs and self.device.type == "cuda" and not moe)
        if cuda_graphs and self.device.type == "cuda" and moe:
            log.warning("CUDA graphs are off for MoE targets (their expert routing is data dependent)")
        max_b = parts.max_batch_size
        self.graph_batch_sizes = tuple(b for b in graph_batch_sizes if b <= max_b) or (max_b,)
        if self.graph_batch_sizes[-1] < max_b:
            self.graph_batch_sizes = (*self.graph_batch_sizes, max_b)
        self.static_rounds = static_rounds or self.cuda_graphs
        self._graphs: dict[tuple[Any, ...], StaticRound] = {}
        self._graph_failed = False
        self.rounds: RoundCache | None = None  # compiled rounds per shape class, when compiling
        self.compile_prefill = True  # whether a prefill without compiled code compiles it (the warm-up's)
        self.compile_dir = compile_dir
        if compile:
            self.enable_compile()
        self._set_host_trees()

    # --- running -------------------------------------------------------------------------------
    def round(self, inputs: RoundInputs, shape: RoundShape) -> torch.Tensor:
        """One round: `stack`'s results [bs, 2g + 5]."""
        self._set_host_trees()
        if not self.static_rounds or self._graph_failed:
            return self.call(ROUND, tuple(inputs), shape.kwargs())
        try:
            return self._replay(inputs, shape)
        except Exception as exc:  # pragma: no cover - GPU only
            if not self.cuda_graphs or (self.rounds is not None and not self.rounds.frozen):
                raise  # or a compilation failed: the warm-up's caller turns compiling off instead
            log.warning("CUDA graph capture failed (%s); falling back to eager rounds", exc)
            self._graph_failed = True
            self._graphs.clear()
            return self.call(ROUND, tuple(inputs), shape.kwargs())

    def prefill(self, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One prefill pass (`RoundParts.prefill`'s arguments) -> logits [bs, V], on every core the
        engine may use (`cpu_gemm.all_cores`; compiled and run under that thread count)."""
        with cpu_gemm.all_cores():
            return self.call(PREFILL, args, {}, compile=self.compile_prefill)

    def prefill_scored(self, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """A prefill pass whose logits cover every chunk position [bs, t, V] (`RoundParts.prefill_scored`'s
        arguments): prompt log-probabilities, run eagerly (rare, and of data-dependent size)."""
        with cpu_gemm.all_cores():
            return self.parts.prefill_scored(*args)

    def call(self, kind: str, args: tuple[torch.Tensor, ...], kwargs: dict[str, Any], *,
              compile: bool = True) -> torch.Tensor:  # fmt: skip
        """`kind` through its shape class's compiled code, or eagerly where there is none. A loaded
        compilation whose guards refuse the arguments (made for other sizes) is never run: it is
        dropped and compiled again (before the engine is frozen) or the call runs eagerly.
        compile=False: load a saved compilation, never compile one."""
        rounds = self.rounds
        if rounds is None:
            return self._core(kind)(*args, **kwargs)
        from dflash_trt.engine.compile import is_guard_failure, shape_rules

        rounds.refresh()
        with shape_rules():
            for _ in range(2):
                fn = rounds.get(args, kwargs, kind, compile=compile)
                if fn is None:
                    break
                try:
                    return fn(self.parts, *args, **kwargs)
                except RuntimeError as exc:
                    if not is_guard_failure(exc):
                        raise
                    log.warning(
                        "a compiled %s refused this batch (%s)", kind, str(exc).splitlines()[-1][:200]
                    )
                    rounds.forget(args, kwargs, kind)
        return self._core(kind)(*args, **kwargs)

    def _core(self, kind: str) -> Any:
        return self.parts.round if kind == ROUND else self.parts.prefill

    def _replay(self, inputs: RoundInputs, shape: RoundShape) -> torch.Tensor:
        """Pad the batch to the graph ladder and the pages to a power of two, then run (replay)."""
        bs, width = inputs.anchors.shape[0], inputs.tables.shape[1]
        bs_pad = next(b for b in self.graph_batch_sizes if b >= bs)
        w_pad = min(1 << max(0, (width - 1).bit_length()), self.num_pages - 1)
        key = (bs_pad, w_pad, shape)
        if self.cuda_graphs and self.rounds is not None:  # uncaptured static rounds refresh in call
            self.rounds.refresh()  # compiled rounds of a background process, when they are ready
        graph = self._graphs.get(key)
        if graph is None or graph.stale():
            graph = StaticRound(self, bs_pad, w_pad, shape, capture=self.cuda_graphs)
            self._graphs[key] = graph
        return graph.run(inputs)

    def _set_host_trees(self) -> None:
        """Eager CPU rounds build small trees with the host's heap; compiled and static (graph) rounds
        keep the batched builder: no host reads inside them."""
        eager_cpu = self.device.type == "cpu" and not (self.compiled or self.static_rounds)
        self.parts.host_tree_nodes = HOST_TREE_MAX_NODES if eager_cpu else 0

    # --- the compiled rounds' lifecycle ------------------------------------------------------------
    @property
    def compiled(self) -> bool:
        return self.rounds is not None

    def enable_compile(self) -> None:
        """Run rounds compiled from now on: the first round of each shape class loads its saved
        compilation or compiles it; `LLMEngine.warm_up` does that before traffic."""
        from dflash_trt.engine.compile import ROUNDS_DIR, round_fingerprint

        directory = None
        if self.compile_dir is not None:
            directory = Path(self.compile_dir) / ROUNDS_DIR / round_fingerprint(self.compile_facts())
        cores = {
            ROUND: Core(self.parts.round, dynamic=((3, 1),)),  # the tables' page width
            # the chunk's length (ids, pos, valid) and the tables' page width
            PREFILL: Core(self.parts.prefill, dynamic=((0, 1), (1, 1), (2, 1), (3, 1))),
        }
        isa_dir = (
            Path(self.compile_dir) if self.compile_dir is not None and self.device.type == "cpu" else None
        )
        self.rounds = RoundCache(cores, directory, isa_dir)
        self._set_host_trees()

    def compile_facts(self) -> dict[str, Any]:
        """What a compiled round depends on besides the source code (engine/compile.py)."""
        p = self.parts
        models = [m for m in (p.target, p.drafter) if m is not None]
        return {
            "device": self.device.type,
            "dtype": str(p.target.model.embed_tokens.weight.dtype),
            "target": repr(p.target.config),
            "drafter": None if p.drafter is None else repr(p.drafter.config),
            "sizes": (p.max_batch_size, self.num_pages, p.page_size, p.block_size),
            "plugins": p.backend.plugins,
            # which linears run on packed fp32 weights (3-D): the switch DFLASH_TRT_CPU_GEMM changes them
            "packed_f32": sum(b.dim() == 3 for m in models for b in m.buffers()),
            # and which on packed bf16 weights in `dflash_bf16::linear` (4-D): the same switch
            "packed_bf16": sum(b.dim() == 4 for m in models for b in m.buffers()),
            # whether sampled rounds hash their uniforms in dflash_rng::uniform: DFLASH_TRT_CPU_UNIFORM
            "native_uniform": p.native_uniform,
            # whether tree rounds build their trees in dflash_tree::best_first: DFLASH_TRT_CPU_TREE
            "native_tree": p.native_tree,
            # which attention modules read the paged caches in place: DFLASH_TRT_CPU_ATTENTION changes them
            "paged_attention": sum(
                bool(getattr(a, "paged_kernel", False)) for m in models for a in m.modules()
            ),
        }

    def freeze(self) -> None:
        """From now on a round of a shape class no compiled round covers runs eagerly instead of
        compiling: a compilation takes minutes on a small CPU, and serving must never stall for one
        (nor trip the engine's wedge watchdog). `LLMEngine.warm_up` compiles the usual classes first."""
        if self.rounds is not None:
            self.rounds.frozen = True

    def disable(self) -> None:
        """Back to eager rounds (after a failed compilation); CUDA graphs are captured again from them."""
        self.rounds = None
        self._graphs.clear()
        self._graph_failed = False
        self._set_host_trees()

    @property
    def directory(self) -> Path | None:
        """Where compiled rounds are saved and looked for (None: in memory only, or not compiling)."""
        return self.rounds.directory if self.rounds is not None else None

    def on_disk(self, keys: list[tuple[Any, ...]]) -> bool:
        """Whether every class of `keys` has a saved compilation."""
        return self.rounds is not None and self.rounds.on_disk(keys)

    @property
    def expecting(self) -> bool:
        """Shape classes compiled by another process are still to be loaded."""
        return self.rounds is not None and self.rounds.expecting

    def expect(self, keys: list[tuple[Any, ...]]) -> None:
        """Classes another process compiles: each is loaded once it is on disk (`load_ready`)."""
        if self.rounds is not None:
            self.rounds.expect(keys)

    def load_ready(self) -> int:
        """Load the background-compiled classes that are ready. Returns how many."""
        return self.rounds.refresh() if self.rounds is not None else 0

    def claim(self, keys: set[tuple[Any, ...]] | None) -> None:
        """The only classes this process compiles (None: every class it meets)."""
        if self.rounds is not None:
            self.rounds.assigned = keys

    @property
    def compiled_count(self) -> int:
        """Compiled classes in use: loaded from disk or compiled here."""
        return 0 if self.rounds is None else self.rounds.loaded + self.rounds.compiled


class StaticRound:
    """Static input buffers for one (padded batch, pages, round shape), and the copy-in / run /
    copy-out protocol. With `capture` (CUDA) the round is recorded once as a CUDA graph and
    replayed; without it the same buffers are run eagerly (CPU tests of the padding).

    With compiled rounds on, what is run (and captured) is the shape class's compiled round: inductor
    fuses the round's elementwise work into a few kernels and the graph removes their launches. The
    warm-up run before the capture loads or compiles it; a class that had no compiled round then
    (frozen, or compiled later by a background process) is captured eagerly and captured again
    once its compiled round is loaded (`stale`)."""

    def __init__(self, executor: Executor, bs: int, width: int, shape: RoundShape, *, capture: bool) -> None:
        dev = executor.device
        self.executor, self.bs, self.width, self.shape = executor, bs, width, shape
        self.capture = capture
        i64 = torch.long
        self.buf = RoundInputs(
            anchors=torch.zeros(bs, dtype=i64, device=dev),
            starts=torch.ones(bs, dtype=i64, device=dev),  # padding rows: one garbage token at position 0
            block_lens=torch.ones(bs, dtype=i64, device=dev),
            tables=torch.zeros(bs, width, dtype=i64, device=dev),
            rows=torch.zeros(bs, dtype=i64, device=dev),
            seeds=torch.zeros(bs, dtype=i64, device=dev),
            temps=torch.zeros(bs, dtype=torch.float32, device=dev),
            top_k=torch.zeros(bs, dtype=i64, device=dev),
            top_p=torch.ones(bs, dtype=torch.float32, device=dev),
            greedy_draft=torch.ones(bs, dtype=torch.bool, device=dev),
            repetition=torch.ones(bs, dtype=torch.float32, device=dev),
            frequency=torch.zeros(bs, dtype=torch.float32, device=dev),
            presence=torch.zeros(bs, dtype=torch.float32, device=dev),
            min_p=torch.zeros(bs, dtype=torch.float32, device=dev),
        )
        self._fill_padding()
        self.compiled_fn: Any = None  # the compiled round this graph runs (None: the eager round)
        if capture:  # pragma: no cover - GPU only
            stream = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):  # compile, allocate and autotune outside the graph
                self._warm_call()
            torch.cuda.current_stream(dev).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._replay_call()

    def _warm_call(self) -> torch.Tensor:
        """Run the round once through the executor's compiled path (load or compile its class; eager
        where there is none) and remember which compiled round that was."""
        ex, args, kwargs = self.executor, tuple(self.buf), self.shape.kwargs()
        out = ex.call(ROUND, args, kwargs)
        self.compiled_fn = ex.rounds.loaded_fn(args, kwargs) if ex.rounds is not None else None
        return out

    def _replay_call(self) -> torch.Tensor:
        """The round as `_warm_call` found it: no loading, compiling or guard retries (inside a capture)."""
        parts, kwargs = self.executor.parts, self.shape.kwargs()
        if self.compiled_fn is None:
            return parts.round(*self.buf, **kwargs)
        from dflash_trt.engine.compile import shape_rules

        with shape_rules():
            return self.compiled_fn(parts, *self.buf, **kwargs)

    def stale(self) -> bool:
        """Captured eagerly, but its class now has a compiled round (loaded after the capture)."""
        rounds = self.executor.rounds
        return (self.capture and self.compiled_fn is None and rounds is not None
                and rounds.loaded_fn(tuple(self.buf), self.shape.kwargs()) is not None)  # fmt: skip

    def _fill_padding(self) -> None:
        b = self.buf
        b.starts.fill_(1)
        b.block_lens.fill_(1)
        b.tables.zero_()
        b.rows.fill_(self.executor.parts.max_batch_size)  # the spare row of the per-request buffers

    def run(self, inputs: RoundInputs) -> torch.Tensor:
        """Copy the batch's rows in (the rest stay padding), run, and return the batch's rows."""
        bs, width = inputs.anchors.shape[0], inputs.tables.shape[1]
        self._fill_padding()
        for buf, src in zip(self.buf, inputs):
            if buf.dim() == 2:
                buf[:bs, :width].copy_(src)
            else:
                buf[:bs].copy_(src)
        if self.capture:  # pragma: no cover - GPU only
            self.graph.replay()
            out = self.out
        else:
            out = self._warm_call()
        return out[:bs]
