"""Prefill step time: eager vs breakable vs full vs tc_piecewise prefill graphs vs the Meta library.

One request at a time, one output token, decode graphs off, prompt lengths 64..2048 (each a
captured shape, so no padding), presets tinyllama-1.1b and llama-3-8b in bf16 with flashinfer.
Peer: Meta's ``breakable-cuda-graphs`` 0.1.0 wrapping our same model with the same break
(attention after the in-graph KV write). ``tc_piecewise`` (torch.compile split at attention,
pieces captured; the KV write is inside its attention op) also reports its compile and capture
seconds apart.
Timing: wall clock around host planning, replay and the LM head on the last token, with a
device sync, median of ``--repeats`` after warm-up. Every variant but tc_piecewise runs in one
process per preset; tc_piecewise runs in a subprocess of its own, because torch.compile state is
process-wide (building a model after a compile in the same process once tripped an assert).
``--fa3``: the full graphs again with flashinfer's fa3 prefill kernels (``attention.prefill_kernel``,
Hopper; the first use JIT-compiles them) on the same cache: ``full_fa3_ms`` and ``fa3_over_fa2``.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import environment, print_table, write_results  # noqa: E402
from bench.decode import timed  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from graphs.backends import create_backend  # noqa: E402
from graphs.config import PrefillGraphConfig  # noqa: E402
from graphs.prefill import LivePrefillBatch, PrefillGraphRunner  # noqa: E402
from worker.attention.base import AttentionBatch  # noqa: E402
from worker.attention.factory import create_attention_backend  # noqa: E402
from worker.kv_cache import KVCacheShape, PagedKVCache  # noqa: E402
from worker.model.kernels import select_kernels  # noqa: E402
from worker.model.loader import load_model  # noqa: E402
from worker.model_steps import CompiledPrefillStep, ModelPrefillStep  # noqa: E402

CUDA = torch.device("cuda")
SLOTS = 4


class Setup:
    def __init__(self, path: Path, ceiling: int) -> None:
        self.model, self.arch = load_model(path, torch.bfloat16, CUDA, kernels=select_kernels(CUDA))
        self.pages = -(-ceiling // 16) + 1
        shape = self.model.attention_shape
        self.cache = PagedKVCache(KVCacheShape(self.arch.num_layers, self.pages + 1, 16, shape.num_kv_heads,
                                               self.arch.head_dim), torch.bfloat16, CUDA)
        self.attention = create_attention_backend("flashinfer", shape, self.cache, SLOTS, ceiling, self.pages)

    def batch(self, n: int) -> LivePrefillBatch:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(10, self.arch.vocab_size, (n,), generator=g).cuda()
        pos = torch.arange(n, device="cuda")
        pages = list(range(1, 1 + -(-n // 16)))
        return LivePrefillBatch(ids, pos, AttentionBatch.prefill([n], [n], [pages]), 1)


def eager(setup: Setup, lengths: list[int], repeats: int) -> dict[int, float]:
    out = {}
    for n in lengths:
        live = setup.batch(n)

        def step():
            setup.attention.plan(live.attention, SLOTS, n)
            hidden = setup.model(live.input_ids, live.positions, setup.attention)
            return setup.model.compute_logits(hidden[-1:])

        out[n] = timed(step, repeats)
    return out


def graphs(setup: Setup, backend: str, lengths: list[int], repeats: int) -> tuple[dict[int, float], dict]:
    """Step seconds per length, and the build: ``seconds`` (plus compile/capture for tc_piecewise)."""
    step = CompiledPrefillStep(setup.model, setup.attention) if backend == "tc_piecewise" else \
        ModelPrefillStep(setup.model, setup.attention, breakable=backend == "breakable",
                         mlp_chunk_tokens=PrefillGraphConfig().mlp_chunk_tokens)  # as the fleet's default
    runner = PrefillGraphRunner(step, create_backend(backend, CUDA), lengths, SLOTS, 2.0, None, torch.bfloat16)
    summary = runner.capture_all(progress=False)
    if runner.failed:
        raise RuntimeError(f"{backend}: {next(iter(runner.failed.values()))}")
    out = {}
    for n in lengths:
        live = setup.batch(n)
        choice = runner.decide(live)
        out[n] = timed(lambda: setup.model.compute_logits(runner.execute(live, choice)[-1:]), repeats)
    build = {"seconds": summary.seconds}
    if backend == "tc_piecewise":
        build |= runner.backend.stats()
    runner.release()
    return out, build


def tc_piecewise(path: Path, args: argparse.Namespace) -> tuple[dict[int, float], dict] | str:
    """:func:`graphs` for tc_piecewise in a fresh process; an error string if it failed."""
    cmd = [sys.executable, __file__, "--lengths", args.lengths, "--repeats", str(args.repeats), "--tc-one", str(path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return f"failed: {res.stderr[-500:]}"
    got = json.loads(lines[-1])
    return {int(n): t for n, t in got["times"].items()}, got["build"]


def meta_peer(setup: Setup, lengths: list[int], repeats: int) -> dict[int, float] | str:
    """The same model and break under Meta's breakable-cuda-graphs 0.1.0."""
    try:
        import breakable_cuda_graphs as bcg
    except ImportError as e:
        return f"not installed: {e}"
    attention = setup.attention

    @bcg.no_graph
    def attend(layer, q, out):
        attention.attend(layer, q, out)

    class MetaBreaks:
        def run(self, layer, q, k, v):
            attention.store(layer, k, v)
            out = torch.empty_like(q)
            attend(layer, q, out)
            return out

        def run_with_rope(self, layer, rope, q, k, v):
            q, k = rope.rotate(q, k)
            s, n = attention.shape, q.shape[0]
            return self.run(layer, q.view(n, s.num_q_heads, s.head_dim), k.view(n, s.num_kv_heads, s.head_dim),
                            v.view(n, s.num_kv_heads, s.head_dim))

    out = {}
    stream = torch.cuda.Stream()
    for n in lengths:
        live = setup.batch(n)
        ids, pos = live.input_ids.clone(), live.positions.clone()
        hidden = torch.empty((n, setup.arch.hidden_size), dtype=torch.bfloat16, device="cuda")
        attention.plan(live.attention, SLOTS, n)
        breaks = MetaBreaks()
        with torch.cuda.stream(stream):
            for _ in range(2):
                hidden.copy_(setup.model(ids, pos, breaks))
        torch.cuda.synchronize()
        graph = bcg.BreakableCUDAGraph()
        with bcg.breakable_graph(graph, stream=stream):
            hidden.copy_(setup.model(ids, pos, breaks))

        def step():
            attention.plan(live.attention, SLOTS, n)
            graph.replay()
            return setup.model.compute_logits(hidden[-1:])

        out[n] = timed(step, repeats)
        graph.reset()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tinyllama-1.1b,llama-3-8b")
    ap.add_argument("--lengths", default="64,128,256,512,1024,2048")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--fa3", action="store_true", help="also full graphs with fa3 prefill kernels (Hopper)")
    ap.add_argument("--tc-one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.tc_one:
        times, build = graphs(Setup(Path(args.tc_one), max(lengths)), "tc_piecewise", lengths, args.repeats)
        print(json.dumps({"times": times, "build": build}))
        return
    rows, capture, errors = [], {}, {}
    for preset in args.presets.split(","):
        path = ensure_checkpoint(preset, Path(args.checkpoints))
        setup = Setup(path, max(lengths))
        e = eager(setup, lengths, args.repeats)
        b, b_build = graphs(setup, "breakable", lengths, args.repeats)
        f, f_build = graphs(setup, "full", lengths, args.repeats)
        f3 = {}
        if args.fa3:
            fa2 = setup.attention
            setup.attention = create_attention_backend("flashinfer", setup.model.attention_shape, setup.cache, SLOTS,
                                                       max(lengths), setup.pages, prefill_kernel="fa3")
            f3, _ = graphs(setup, "full", lengths, args.repeats)
            setup.attention = fa2
        m = meta_peer(setup, lengths, args.repeats)
        del setup
        gc.collect()
        torch.cuda.empty_cache()
        tc = tc_piecewise(path, args)
        capture[preset] = {"breakable_s": b_build["seconds"], "full_s": f_build["seconds"]}
        if isinstance(tc, str):
            errors[preset] = tc
            tc = {}
        else:
            tc, tc_build = tc
            capture[preset] |= {"tc_piecewise_s": tc_build["seconds"],
                                "tc_piecewise_compile_s": tc_build["compile_seconds"],
                                "tc_piecewise_capture_s": tc_build["capture_seconds"]}
        for n in lengths:
            r = {"preset": preset, "tokens": n, "eager_ms": e[n] * 1e3, "breakable_ms": b[n] * 1e3,
                 "full_ms": f[n] * 1e3, "meta_ms": m[n] * 1e3 if isinstance(m, dict) else None,
                 "tc_piecewise_ms": tc[n] * 1e3 if n in tc else None, "full_x": e[n] / f[n],
                 "breakable_x": e[n] / b[n], "tc_piecewise_x": e[n] / tc[n] if n in tc else None}
            if isinstance(m, dict):
                r["breakable_over_meta"] = b[n] / m[n]
            if n in f3:
                r["full_fa3_ms"], r["fa3_over_fa2"] = f3[n] * 1e3, f3[n] / f[n]
            rows.append(r)
    print_table(rows, ["preset", "tokens", "eager_ms", "breakable_ms", "full_ms", "tc_piecewise_ms", "meta_ms",
                       "full_x", "breakable_x", "tc_piecewise_x", "breakable_over_meta"]
                + (["full_fa3_ms", "fa3_over_fa2"] if args.fa3 else []))
    for preset, build in capture.items():
        print(preset, "build seconds:", build)
    payload = {"env": environment(), "rows": rows, "capture": capture, "args": vars(args)}
    if errors:
        payload["tc_piecewise_errors"] = errors
        print("tc_piecewise failed:", errors)
    print(f"wrote {write_results('prefill', payload)}")


if __name__ == "__main__":
    main()
