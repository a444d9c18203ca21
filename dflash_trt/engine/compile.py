# SPDX-License-Identifier: Apache-2.0
"""Compiled rounds: when torch.compile can run here, its options, and where its artifacts live.

The whole round (both models, the sampling and the acceptance) goes through inductor as one graph:
on CPU its elementwise work becomes fused C++ loops and the GEMMs stay MKL/oneDNN calls, which
removes most of the per-operator cost that dominates small models.

Shape classes. A round is compiled once per (draft length g, DDTree budget, sampling flags, batch of one
or more):
the batch and the context's page width are dynamic inside a class (one graph serves every batch of
two or more and every context length; a batch of one has a graph of its own). `LLMEngine.warm_up`
makes a round of every usual class before the engine reports ready; after it a class without a
graph runs eagerly rather than stalling serving to compile (`ModelRunner.freeze_compiled`).
Requests with top-k/top-p filtering are such a class today. The prefill pass (the target over prompt
chunks, the drafter's context injection: `ModelRunner._prefill_core`) is compiled too, in two more
classes, batch of one or more, with the chunk length and page width dynamic. The warm-up compiles
each in its last batch of that size, so that most of the full block's rounds come first.

Inside a class's graph each decoder layer (the target's and the drafter's) is one nested compile
region (layers/regions.py): dynamo traces the first layer and inductor generates its code once, every
other layer calls it with its own weights. That roughly halved `tiny`'s cold compile (12 layers), and
more layers save more. The graph's C++ kernels are then built as one translation unit, one compiler
run per graph instead of one per kernel (engine/kernel_units.py), around both compiling and loading.

Ahead-of-time artifacts (`RoundCache`). Each class is compiled with
`torch.compile(fullgraph=True).aot_compile` and saved, so that a later start loads it in seconds
instead of tracing and compiling it again (tracing alone took ~40 s for the four classes of `tiny`
on 2 CPU cores). Artifacts live in `<root>/<machine key>/rounds/<fingerprint>/`: the machine key
names the torch version and the CPU's vector ISA (or the GPU model); the fingerprint covers every
input of the compiled code: dflash_trt's own model and engine code (docstrings, comments and layout
do not count), both models' configurations, dtype, device, cache and batch sizes (`round_fingerprint`).
An artifact whose guards refuse the first round it sees is compiled again and replaced. Inductor's own
FX-graph and kernel caches sit beside them (a cold class then compiles faster).

The root is `serve`'s `<bundle>/compile-cache` (shared by every pod that mounts the bundle),
$DFLASH_TRT_COMPILE_CACHE, or `~/.cache/dflash-trt/compile` for the library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_trt.engine.kernel_units import one_unit_per_graph
from dflash_trt.utils.env import scoped_env

if TYPE_CHECKING:  # torch is imported where it is used: `serve` reads the names below without it
    import torch

log = logging.getLogger(__name__)

COMPILE_ENV = "DFLASH_TRT_COMPILE"  # "0": eager rounds by default (tests that start many engines)
# inductor's options for a saved round: no size/stride asserts on the graph's inputs and on the outputs
# of its extern kernels (~215 checks per round on `tiny`, ~0.1 ms). Dynamo's guards check the inputs,
# the cache's fingerprint the code and the model, the compiled-equals-eager tests the operators' shapes.
_OPTIONS: dict[str, Any] = {"size_asserts": False}
CACHE_ENV = "DFLASH_TRT_COMPILE_CACHE"  # the cache root
BUNDLE_CACHE_DIR = "compile-cache"  # `serve`'s cache root inside a writable bundle
DEFAULT_CACHE_ROOT = Path("~/.cache/dflash-trt/compile")


def unsupported_reason(device: torch.device) -> str | None:
    """Why rounds cannot be compiled on `device`, or None when they can."""
    if device.type == "cpu":
        compiler = os.environ.get("CXX") or next(
            (c for c in ("g++", "c++", "clang++") if shutil.which(c)), None
        )
        if compiler is None or shutil.which(compiler) is None:
            return (
                "no C++ compiler on PATH (inductor builds its CPU kernels with one; set CXX or install g++)"
            )
        return None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "the triton package is not installed (inductor's CUDA kernels need it)"
        return None
    return f"torch.compile is not used on {device.type}"


def off_by_default_reason(device: torch.device) -> str | None:
    """Why rounds are not compiled by default on `device` although they can be (None: they are).
    On a GPU the default is eager rounds in CUDA graphs. A compiled round captured in the graphs is
    faster (Qwen3-8B shapes: plain step 1.46x on an H200, DFlash round at batch 16 1.60x on an H100;
    bench/README.md), but it has only been checked on torch 2.11, which cannot save it: every start
    compiles each shape class again, 1.5-2 minutes apiece for an 8B target, and the saved-artifact
    path has not run on a GPU yet. `compile=True` (`serve --compile`) asks for it, and falls back to
    eager graphs with a warning if it fails."""
    if device.type == "cuda":
        return "on a GPU rounds run eagerly in CUDA graphs unless compile=True (serve --compile) asks"
    return None


def machine_key(device: torch.device) -> str:
    """torch version + what the generated code depends on: the CPU's vector ISA, or the GPU model."""
    import torch

    from dflash_trt.utils.device import cpu_flags

    if device.type == "cuda":
        kind = torch.cuda.get_device_name(device).replace(" ", "-")
    else:
        flags = cpu_flags()
        isa = [
            f
            for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve")
            if f in flags
        ]
        kind = f"{platform.machine()}-" + hashlib.sha1(" ".join(isa).encode()).hexdigest()[:8]
    return f"torch-{torch.__version__.replace('+', '-')}-{kind}"


def use_cache_root(root: str | os.PathLike[str] | None, device: torch.device) -> Path:
    """The directory of this machine's compiled rounds: <root>/<machine key> (root: the argument,
    $DFLASH_TRT_COMPILE_CACHE, or ~/.cache/dflash-trt/compile). Inductor's caches go there too
    (`point_inductor_at`, with the record of inductor's ISA probe on the CPU). Returns the directory."""
    base = Path(root or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_ROOT).expanduser()
    directory = base / machine_key(device)
    directory.mkdir(parents=True, exist_ok=True)
    point_inductor_at(directory, cpu=device.type == "cpu")
    point_kernels_at(directory / KERNELS_DIR)
    return directory


def point_inductor_at(directory: str | os.PathLike[str], *, cpu: bool) -> None:
    """Inductor's own caches (FX graphs, kernels) beside our compiled rounds, unless the user set
    TORCHINDUCTOR_CACHE_DIR (torch writes its own default there on first use: that one is replaced).
    A user's setting moves only inductor's caches: the compiled rounds stay in their directory. `cpu`:
    inductor's ISA probe is skipped where `directory` records that it passed (engine/vec_isa.py)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if cpu:
        from dflash_trt.engine import vec_isa

        vec_isa.trust(Path(directory))
    preset = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if preset and os.path.abspath(preset) != os.path.abspath(default_cache_dir()):
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)


_kernels_set: str | None = None  # the DFLASH_TRT_KERNEL_CACHE value point_kernels_at set (not the user's)


def point_kernels_at(directory: str | os.PathLike[str]) -> None:
    """dflash-trt's own C/C++ operators (layers/native.py: the GEMMs, the paged attention, the uniforms)
    beside the compiled rounds, unless the user set DFLASH_TRT_KERNEL_CACHE. The rounds call them, so
    they belong to the same cache: a pod that mounts a bundle whose cache `dflash-trt precompile` filled
    loads them instead of building them with g++ at every start (~20 s on 2 cores: a warm start of
    6.7 s took 26.5 s with the kernels missing)."""
    global _kernels_set
    from dflash_trt.layers import native

    preset = os.environ.get(native.CACHE_ENV)
    if preset and preset != _kernels_set:
        return
    _kernels_set = os.environ[native.CACHE_ENV] = str(directory)


ROUND_SOURCES = ("layers", "models", "spec", "plugins", "engine")  # what a compiled round is made of
ROUND, PREFILL = "round", "prefill"  # the kinds of compiled code: a decode round, a prefill pass
ROUNDS_DIR = "rounds"
REFRESH_S = 1.0  # how often a serving engine looks for rounds compiled by another process
BACKGROUND_ENV = "DFLASH_TRT_COMPILE_BACKGROUND"  # "0": compile before ready instead (engine/precompile.py)
ARTIFACT_SUFFIX = ".aot"
KERNELS_DIR = "kernels"  # dflash-trt's operator libraries, inside a machine's cache directory


def foreground_compile() -> contextlib.AbstractContextManager[None]:
    """Engines built inside compile (or load) their rounds before they are ready instead of serving
    eagerly while a background process compiles: `precompile` and the benchmarks, which measure the
    compiled steady state."""
    return scoped_env(BACKGROUND_ENV, "0")


def bundle_cache_root(bundle: str | os.PathLike[str]) -> Path | None:
    """The compile cache root of a bundle's servers (`serve`) and of `precompile`: $DFLASH_TRT_COMPILE_CACHE
    when set, else <bundle>/compile-cache when the bundle is writable (shared by every server of the
    bundle), else None (the engine's default under ~/.cache)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(bundle) / BUNDLE_CACHE_DIR if os.access(bundle, os.W_OK) else None


def round_fingerprint(facts: dict[str, Any]) -> str:
    """A key for everything a compiled round depends on: `facts` (the runner's sizes, dtypes and model
    configurations) and the code of the dflash_trt packages the round runs (`_code_digest`)."""
    digest = hashlib.sha256(repr(sorted(facts.items())).encode())
    package = Path(__file__).resolve().parent.parent
    for sub in ROUND_SOURCES:
        for path in sorted((package / sub).rglob("*.py")):
            digest.update(path.relative_to(package).as_posix().encode())
            digest.update(_code_digest(path.read_bytes()))
    return digest.hexdigest()[:16]


def _code_digest(source: bytes) -> bytes:
    """What of a module's source a compiled round depends on: its syntax tree without docstrings,
    comments, formatting or line numbers. An edit to any of those keeps every saved round valid (a
    saved artifact carries its own bytecode; its line numbers only show in tracebacks). Source that
    does not parse is taken byte for byte."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return hashlib.sha256(source).digest()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).digest()


@dataclasses.dataclass(frozen=True)
class Core:
    """Code that `RoundCache` compiles: a bound method of the runner, pure tensor code, and the
    sizes that vary inside one of its classes besides the batch: (argument index, dimension)."""

    fn: Callable[..., Any]
    dynamic: tuple[tuple[int, int], ...]


class RoundCache:
    """The runner's compiled rounds, one per shape class, kept in memory and (with a directory) on disk.

    `get` returns a class's compiled round: already in memory, loaded from disk, or (unless frozen)
    compiled now from the round's arguments and saved (only the `assigned` classes, when a warm-up
    shares the classes among processes: engine/precompile.py). `kwargs` are the round's static keyword
    arguments (g, flags, budget: `RoundShape.kwargs`); a compiled round is called as
    `fn(runner, *args, **kwargs)`; `None` means: run this round eagerly.
    """

    def __init__(self, cores: dict[str, Core], directory: Path | None, isa_dir: Path | None = None) -> None:
        self._cores = cores  # ROUND: the runner's bound _round_core; PREFILL: its _prefill_core
        self.directory = directory
        self.isa_dir = isa_dir  # CPU rounds: where inductor's ISA probe is recorded (engine/vec_isa.py)
        self._fns: dict[tuple[Any, ...], Any] = {}
        self._refused: set[tuple[Any, ...]] = set()  # classes whose compilation failed: eager from now on
        self.frozen = False
        self.assigned: set[tuple[Any, ...]] | None = None  # the only classes to compile (None: all)
        self.loaded = self.compiled = 0  # classes loaded from disk / compiled in this process
        self.helped = 0  # of those loaded: classes helper processes compiled for this one (precompile.py)
        self._expected: list[tuple[Any, ...]] = []  # classes another process compiles (`expect`)
        self._next_look = 0.0

    def __getstate__(self) -> dict[str, Any]:
        # Saving a compilation pickles the runner it was traced on, this cache included: the compiled
        # rounds already here (unpicklable guard managers) are never part of another one's state.
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__({}, state["directory"])  # type: ignore[misc]

    @staticmethod
    def class_key(kwargs: dict[str, Any], single: bool, kind: str = ROUND) -> tuple[Any, ...]:
        """A shape class: what is compiled (ROUND or PREFILL), its static keyword arguments, and
        whether the batch has one sequence (a class of its own: a compiled graph whose batch is
        symbolic guards on a batch of two or more)."""
        return (kind, tuple(sorted(kwargs.items())), single)

    @classmethod
    def key(
        cls, args: tuple[torch.Tensor, ...], kwargs: dict[str, Any], kind: str = ROUND
    ) -> tuple[Any, ...]:
        return cls.class_key(kwargs, args[0].shape[0] == 1, kind)

    def core(self, kind: str) -> Callable[..., Any]:
        """The eager code of `kind` (what runs where no compiled code covers a call)."""
        return self._cores[kind].fn

    def on_disk(self, keys: list[tuple[Any, ...]]) -> bool:
        """Whether every class of `keys` has a saved compilation."""
        paths = [self._path(k) for k in keys]
        return all(p is not None and p.is_file() for p in paths)

    def expect(self, keys: list[tuple[Any, ...]]) -> None:
        """Classes another process is compiling: `refresh` loads each once it is on disk."""
        self._expected = [k for k in keys if k not in self._fns]
        self._next_look = 0.0

    @property
    def expecting(self) -> bool:
        """Whether classes compiled by another process are still to be loaded."""
        return bool(self._expected)

    def refresh(self) -> int:
        """Load the expected classes that appeared on disk since the last look (at most one look per
        REFRESH_S; a load stalls the calling round for about a second). Returns how many it loaded."""
        if not self._expected:
            return 0
        now = time.monotonic()
        if now < self._next_look:
            return 0
        self._next_look = now + REFRESH_S
        ready = [k for k in self._expected if (p := self._path(k)) is not None and p.is_file()]
        loaded = 0
        for key in ready:
            self._expected.remove(key)
            fn = self._load(key)
            if fn is not None:
                self._fns[key] = fn
                loaded += 1
        return loaded

    def _path(self, key: tuple[Any, ...]) -> Path | None:
        if self.directory is None:
            return None
        kind, items, single = key
        parts = [] if kind == ROUND else [kind]
        for (
            name,
            value,
        ) in items:  # e.g. budget=0, flags=(True, True, False, False), g=15 -> budget0-flags1100-g15
            if isinstance(value, tuple):
                value = "".join("1" if v else "0" for v in value)
            parts.append(f"{name}{value}")
        return self.directory / f"{'-'.join(parts)}-{'b1' if single else 'bN'}{ARTIFACT_SUFFIX}"

    def get(
        self,
        args: tuple[torch.Tensor, ...],
        kwargs: dict[str, Any],
        kind: str = ROUND,
        *,
        compile: bool = True,
    ) -> Any:
        """compile=False: only what is in memory or on disk (the warm-up compiles rounds first)."""
        key = self.key(args, kwargs, kind)
        fn = self._fns.get(key)
        if fn is not None or key in self._refused:
            return fn
        fn = self._load(key)
        if fn is None and compile and not self.frozen and (self.assigned is None or key in self.assigned):
            try:
                fn = self._compile(key, args, kwargs)
            except Exception as exc:
                if kind == ROUND:
                    raise  # the warm-up's caller serves eagerly (api/llm.py)
                # the other kinds are worth less than the rounds: only this one runs eagerly
                log.warning("compiling the %s failed (%s: %s); it runs eagerly", kind, type(exc).__name__,
                            str(exc).splitlines()[0] if str(exc) else "")  # fmt: skip
                self._refused.add(key)
                return None
        if fn is not None:
            self._fns[key] = fn
        return fn

    def loaded_fn(self, args: tuple[torch.Tensor, ...], kwargs: dict[str, Any], kind: str = ROUND) -> Any:
        """The class's compiled round if it is in memory now (nothing is loaded or compiled)."""
        return self._fns.get(self.key(args, kwargs, kind))

    def forget(self, args: tuple[torch.Tensor, ...], kwargs: dict[str, Any], kind: str = ROUND) -> None:
        """A class whose compiled round refused these arguments (its guards failed): compile it again
        on its next round, unless frozen."""
        key = self.key(args, kwargs, kind)
        self._fns.pop(key, None)
        path = self._path(key)
        if path is not None:
            path.unlink(missing_ok=True)
        if self.frozen:
            self._refused.add(key)

    def _load(self, key: tuple[Any, ...]) -> Any:
        import torch

        path = self._path(key)
        if path is None or not path.is_file():
            return None
        t0 = time.perf_counter()
        try:
            with open(path, "rb") as f, one_unit_per_graph():  # finds the units its compile built
                fn = torch.compiler.load_compiled_function(f, f_globals=self._cores[key[0]].fn.__globals__)
        except Exception as exc:  # a stale or damaged artifact is compiled again, never trusted
            log.warning("compiled round %s could not be loaded (%s); compiling it again", path.name, exc)
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        self._record_isa()
        log.info("compiled round %s loaded in %.1f s", path.name, time.perf_counter() - t0)
        return fn

    def _record_isa(self) -> None:
        if self.isa_dir is not None:
            from dflash_trt.engine import vec_isa

            vec_isa.record(self.isa_dir)

    def _compile(self, key: tuple[Any, ...], args: tuple[torch.Tensor, ...], kwargs: dict[str, Any]) -> Any:
        import torch

        t0 = time.perf_counter()
        core = self._cores[key[0]]
        for a in args:  # the batch is dynamic in a class that is not a batch of one
            if not key[2]:
                torch._dynamo.mark_dynamic(a, 0)
        for i, dim in core.dynamic:
            torch._dynamo.mark_dynamic(args[i], dim)
        if not saves_compiled_rounds():  # an older torch: compiled in memory, for this process only
            with compile_rules():
                fn = _InMemoryRound(
                    torch.compile(_own_code(core.fn), fullgraph=True, dynamic=None, options=dict(_OPTIONS))
                )
                fn(None, *args, **kwargs)  # compile now, not in the first round that serves
            self.compiled += 1
            log.info("compiled round %s in %.1f s (not saved: this torch has no aot_compile)", key,
                     time.perf_counter() - t0)  # fmt: skip
            return fn
        with compile_rules():
            compiled: Any = torch.compile(
                core.fn, fullgraph=True, dynamic=None, options=_OPTIONS | {"guard_filter_fn": _guard_filter}
            )
            fn = compiled.aot_compile((args, kwargs))
        self.compiled += 1
        self._record_isa()
        path = self._path(key)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fn.save_compiled_function(str(tmp))
            os.replace(tmp, path)  # readers (other pods on the same volume) see all of it or nothing
        log.info("compiled round %s in %.1f s", path.name if path else key, time.perf_counter() - t0)
        return fn


@functools.cache
def saves_compiled_rounds() -> bool:
    """Whether this torch compiles ahead of time into an artifact that can be saved and loaded
    (`aot_compile` on a compiled function, recent torch releases). Without it rounds are compiled in
    each process, in memory: no artifact cache, no background compiler."""
    import torch

    return hasattr(torch.compile(_identity), "aot_compile")


def _identity(x: Any) -> Any:
    return x


def _own_code(method: Any) -> Any:
    """`method` (a bound method) with a code object of its own. Dynamo keeps the compilations of a
    function on its code object, with a limit of 8: every shape class compiled in memory, of every
    engine in the process, would otherwise pile up on `_round_core`'s one code object, each call
    checking the others' guards first, and the ninth class would fail to compile."""
    import types

    func = method.__func__
    code = func.__code__.replace()  # an equal, distinct code object: an empty compile cache
    copy = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return types.MethodType(copy, method.__self__)


class _InMemoryRound:
    """A round compiled just in time (torch without aot_compile), called like a loaded artifact:
    `fn(runner, *args, **kwargs)`; the runner is already bound in the compiled method."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self._compiled = compiled

    def __call__(self, _runner: Any, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)


def _guard_filter(entries: Any) -> list[bool]:
    """The guards a saved round keeps: those a saved compilation can carry (no globals: aot_compile's
    own rule), and none on the models' modules and parameters. Their structure, dtypes and shapes are
    what the fingerprint names, and nothing changes them while an engine serves; checked on every
    round, those ~2800 guards cost ~0.5 ms (a tenth of a `tiny` round). The round's tensor
    arguments and the KV caches stay guarded."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [
        not (
            e.is_global
            or e.guard_type in unsupported
            or (e.orig_guard.source.is_unspecialized_nn_module() and e.guard_type not in _STRUCTURE_GUARDS)
        )
        for e in entries
    ]


# Guards on the modules that stay: the key order of the module dicts the round iterates (a loaded
# round re-reads those dicts, so the path to each must be part of what is saved).
_STRUCTURE_GUARDS = frozenset({"DICT_KEYS_MATCH"})


def is_guard_failure(exc: BaseException) -> bool:
    """A compiled round refused its arguments (they are outside what it was compiled for)."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("GuardManager check failed")


def compile_rules() -> Any:
    """The symbolic-shape and tracing settings the round is compiled under: `shape_rules`; only the
    sizes `RoundCache` marks are symbolic (torch.compile's dynamic=None, and no automatic dynamic,
    which would turn a size symbolic once a second class of the same code compiles); no duck sizing
    (a batch of 2 and a page width of 2 stay separate symbols); Python float constants specialised
    (the round has no float inputs; aot_compile cannot restart a trace that finds one).

    The draft length g in particular stays a constant of its class. As a symbol (dynamic=True), every
    index into the [batch x block] rows becomes a division by a runtime size: inductor's C++ code
    generation then spends most of its time in sympy on those expressions (a cold compile of `tiny`'s
    12 classes took 667 s instead of 433 s, back to back on one machine; bench/README.md), and torch
    2.11's inductor fails on the round's slices of the block."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    stack = contextlib.ExitStack()
    stack.enter_context(shape_rules())
    stack.enter_context(fx_config.patch(use_duck_shape=False))  # type: ignore[attr-defined]
    stack.enter_context(dynamo_config.patch(specialize_float=True, automatic_dynamic_shapes=False))
    stack.enter_context(one_unit_per_graph())
    return stack


def shape_rules() -> Any:
    """The symbolic-shape rules the round is compiled and guarded under: sizes of 1 (a batch of one,
    a context of one page) stay symbolic instead of being specialised, so the general graph serves
    them. A context manager (torch's setting is process-wide: it is set only around our calls, so
    other torch.compile users in the process keep torch's defaults)."""
    return _ShapeRules()


class _ShapeRules:
    """`shape_rules`' context manager: sets and restores the one setting directly, which costs a third
    of torch's generic `config.patch` (~6 vs ~17 µs; it wraps every compiled round)."""

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        import torch.fx.experimental._config as fx_config

        self._saved = fx_config.backed_size_oblivious
        fx_config.backed_size_oblivious = True

    def __exit__(self, *exc: object) -> None:
        import torch.fx.experimental._config as fx_config

        fx_config.backed_size_oblivious = self._saved
