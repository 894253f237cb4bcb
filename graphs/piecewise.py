"""torch.compile split at opaque ops: the compile half of the ``tc_piecewise`` backend.

vLLM's piecewise design: the forward is traced whole with ``torch.compile(fullgraph=True)``;
a custom dynamo backend (:class:`PiecewiseCompiler`) receives the FX graph, cuts it at the
*splitting ops* (attention, a torch custom op that dynamo cannot see into) with
``torch.fx.passes.split_module``, compiles every other piece with inductor, and returns the split
module, which runs ``piece, op, piece, ..., piece`` in order. Capturing the pieces is the graph
backend's job (:class:`graphs.backends.TcPiecewiseBackend`): each piece becomes one CUDA graph
segment per shape, the splitting ops run eagerly between them (off CUDA,
:class:`graphs.backends.TcPiecewiseNoGraphBackend` runs the pieces without graphs).

Shapes: as vLLM, one compile for a symbolic token dimension (dim 0 of every tensor argument is
marked dynamic), reused by every bucket; only capture is per shape. Compile and capture time are
therefore separate costs: :func:`compile_clock` lets a capture measure the compile time spent
inside it.

Process-global state: dynamo caches compiled code per Python code object, process-wide.
Recompiling the same step code for a new model (a new step object) counts against dynamo's
recompile limit, and compiled code outlives the objects it was traced from until
``torch._dynamo.reset()``. Reuse one :class:`PiecewiseCompiled` per model, reset dynamo between
tests, and run benchmarks that build further models after compiling in a subprocess.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

COMPILERS = ("inductor", "eager")

# Inference mode is entered by the caller (PiecewiseCompiled.__call__) instead: dynamo traces a
# decorator's enter/exit as two nodes passing a Python handle, which a split would carry across
# pieces and inductor cannot return.
_GLOBAL_STATE_FNS = tuple(f for f in (getattr(torch.autograd.grad_mode, "_enter_inference_mode", None),
                                      getattr(torch.autograd.grad_mode, "_exit_inference_mode", None)) if f)


@dataclass
class CompileClock:
    """Compile work observed while a :func:`compile_clock` is active."""

    seconds: float = 0.0
    compiles: int = 0
    pieces: int = 0  # of the last compiled forward called
    splits: int = 0


_clocks: contextvars.ContextVar[tuple[CompileClock, ...]] = contextvars.ContextVar("compile_clocks", default=())


@contextlib.contextmanager
def compile_clock() -> Iterator[CompileClock]:
    """Collect the compile seconds of every :class:`PiecewiseCompiled` call inside the block."""
    clock = CompileClock()
    token = _clocks.set(_clocks.get() + (clock,))
    try:
        yield clock
    finally:
        _clocks.reset(token)


def _packet(op: Any) -> Any:
    return getattr(op, "overloadpacket", op)


class PiecewiseCompiler:
    """A dynamo backend: split the FX graph at ``splitting_ops``, compile the pieces between.

    ``compiler`` is ``inductor`` (each piece through ``compile_fx``) or ``eager`` (pieces stay FX
    modules, as SGLang's ``--cuda-graph-tc-compiler eager``). After a compile, ``split`` is the
    split module, ``pieces`` the number of compiled pieces and ``splits`` the number of
    splitting-op calls (``pieces == splits + 1`` for a graph that starts and ends with compute).
    """

    def __init__(self, splitting_ops: Iterable[Any], compiler: str = "inductor") -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"piece compiler {compiler!r}; allowed: {', '.join(COMPILERS)}")
        self.splitting_ops = frozenset(_packet(op) for op in splitting_ops)
        self.compiler = compiler
        self.compiles = 0
        self.seconds = 0.0  # split + piece compilation, dynamo tracing excluded
        self.split: torch.fx.GraphModule | None = None
        self.pieces = 0
        self.splits = 0

    def is_split_node(self, node: torch.fx.Node) -> bool:
        return node.op == "call_function" and _packet(node.target) in self.splitting_ops

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        _strip_global_state(gm)
        split, split_names, piece_names = self._split(gm)
        if self.compiler == "inductor":
            _compile_pieces(split, piece_names, example_inputs)
        self.split, self.pieces, self.splits = split, len(piece_names), len(split_names)
        self.compiles += 1
        self.seconds += time.perf_counter() - start
        return split

    def _split(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
        partition: dict[torch.fx.Node, int] = {}
        split_ids: set[int] = set()
        current = 0
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if self.is_split_node(node):
                current += 1
                split_ids.add(current)
                partition[node] = current
                current += 1
            else:
                partition[node] = current
        split = split_module(gm, None, lambda node: partition[node], keep_original_order=True)
        names = [name for name, _ in split.named_children()]
        split_names = [n for n in names if int(n.rsplit("_", 1)[1]) in split_ids]
        return split, split_names, [n for n in names if n not in split_names]


def _strip_global_state(gm: torch.fx.GraphModule) -> None:
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in _GLOBAL_STATE_FNS:
            gm.graph.erase_node(node)  # reversed: each exit goes before the enter it consumes
    gm.recompile()


def _compile_pieces(split: torch.fx.GraphModule, pieces: list[str], example_inputs: list[Any]) -> None:
    """Run ``split`` on fake inputs; compile each piece with inductor for the (symbolic) inputs it sees."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx

    fake_mode = detect_fake_mode(example_inputs)
    to_compile = set(pieces)

    class Compile(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            out = super().call_module(target, args, kwargs)
            if target in to_compile:
                # An instance attribute shadows the submodule of the same name in the split
                # module's generated forward (vLLM does the same).
                self.module.__dict__[target] = compile_fx(self.fetch_attr(target), list(args))
            return out

    # The fake mode memoises dynamo's fake tensors, so real inputs map back to their symbolic shapes.
    fake_args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    with fake_mode, enable_python_dispatcher():
        Compile(split).run(*fake_args)


class PiecewiseCompiled:
    """``fn`` under ``torch.compile(fullgraph=True)`` with a :class:`PiecewiseCompiler` backend.

    Call it like ``fn``. Dim 0 of every tensor argument (the token dimension) is marked dynamic,
    so one compile serves every size >= 2. Calls run under inference mode. A compile failure
    (a graph break: fullgraph refuses it) is remembered and raised again on later calls without
    tracing anew. ``compile_seconds`` is the wall time of the calls that compiled (dynamo
    tracing included).
    """

    def __init__(self, fn: Callable[..., Any], splitting_ops: Iterable[Any], compiler: str = "inductor") -> None:
        self.compiler = PiecewiseCompiler(splitting_ops, compiler)
        self._compiled = torch.compile(fn, fullgraph=True, backend=self.compiler)
        self.compile_seconds = 0.0
        self.error: Exception | None = None

    @property
    def compiles(self) -> int:
        return self.compiler.compiles

    def __call__(self, *args: Any) -> Any:
        if self.error is not None:
            raise RuntimeError(f"torch.compile failed earlier: {type(self.error).__name__}: "
                               f"{str(self.error).splitlines()[0]}") from self.error
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] > 1:
                torch._dynamo.mark_dynamic(a, 0)
        before, start = self.compiler.compiles, time.perf_counter()
        try:
            with torch.inference_mode():
                return self._compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:
            self.error = e
            raise
        finally:
            self._report(self.compiler.compiles - before, time.perf_counter() - start)

    def _report(self, compiles: int, seconds: float) -> None:
        if compiles:
            self.compile_seconds += seconds
        for clock in _clocks.get():
            clock.pieces, clock.splits = self.compiler.pieces, self.compiler.splits
            if compiles:
                clock.compiles += compiles
                clock.seconds += seconds
