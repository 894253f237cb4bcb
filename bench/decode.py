"""Decode step time per bucket: ours (eager, full graph, breakable) against the HBM floor and peers.

Ours, in this process: one checkpoint, weights and KV contents (random, never zero), ``--context``
tokens per row; the eager step, the full CUDA graph and the breakable graph, each timed wall-clock
around host planning, launch and a device sync (body and LM head, no sampling), median of
``--repeats`` after warm-up. The graph variants (``full``, ``breakable`` and those below) are all
captured first and then timed in interleaved rounds, one call of each per round
(``bench.common.interleaved_wall_times``), so drift over the run does not bias their ratios (timed
one after the other, two identical variants differed by up to 7% on tinyllama). Graph memory per
variant is what its own capture added, with the earlier variants' graphs still held. The HBM floor
is (weights + KV read) / the device-to-device copy bandwidth measured at start. Also graph memory of
the whole ladder on one pool against one pool per shape.

Peers (``--peers``), each in a process of its own, started one after the other once ours has
released its GPU memory (a device-side assert poisons only the child's CUDA context; a crash, a
non-zero exit or a timeout is a row with the child's last stderr lines, never a crashed bench):

* ``ours_compile``: ``torch.compile(mode="reduce-overhead", dynamic=False)`` of our decode step, what
  a user of our code would try (attention through our ``graphfleet::attention`` op); timed as ours,
  ``--compile-batches``, one ``bench/decode_compile.py`` child per batch, our environment.
* ``engine``: our whole engine (graphs, async scheduling, sampling) through ``generate``, timed as the
  vLLM peer is (below), one ``bench/decode_engine.py`` child for every batch: the serving loops side by
  side (``engine_over_vllm`` below 1: ours is faster), where ``full`` is one graph step run serially.
* ``hf``: HF transformers ``generate()`` with a static cache, eager (``disable_compile=True``);
  ``hf_compile``: the same with transformers' automatic torch.compile. ``--hf-batches``, our env.
* ``vllm``: vLLM 0.25.0's offline ``LLM`` (CUDA graphs on), ``--vllm-batches``, in a child whose
  PYTHONPATH is ``--vllm-site`` alone (its pins differ from ours).

Engine, HF and vLLM per token = (t(65 new tokens) - t(1 new token)) / 64 for b prompts of ``--context``
random ids, medians of ``--peer-repeats`` after a warm-up: one decode step of batch b with their own
sampling and loop (bench/decode_peers.py has the details). ``full_over_<peer>`` is our full graph
step over the peer's (below 1: ours is faster). The JSON has, per preset, the table's rows (with
``<peer>_error`` where a peer gave no number), ``graph_memory`` and ``peers``: each peer's rows per
batch (``step_s``, ``t1_s``, ``t65_s`` or ``error``), its process-level ``error`` and ``wall_s``.

The attention backend is built as the engine builds it (fast decode plan, fused RoPE + KV write);
``full_two_kernel`` is the same full graph with RoPE and the KV append as two kernels, timed in the
same run (``two_kernel_over_fused`` above 1: the fused kernel is faster); ``full_no_split`` is the
full graph with ``attention.decode_graph_split_kv`` off (no KV split, no merge kernel) and
``full_split`` with it on; ``full`` itself runs the engine's default, ``"auto"``, whose choice per
batch is the ``graph_split_kv`` column.
``full_fused_decode`` is the full graph with ``attention.fused_decode`` on (RoPE, the KV write and
attention in one Triton kernel a layer; ``fused_decode_over_full`` below 1: it is faster).
``--fa3`` adds ``full_fa3``: the full graph with flashinfer's fa3 decode kernels
(``attention.decode_kernel=fa3``, Hopper; ``fa3_over_full`` below 1: fa3 is faster).
``--tc-full`` adds ``tc_full`` (``graphs.decode.backend=tc_full``: the forward under torch.compile,
attention an opaque op, one full graph a shape; ``tc_full_over_full`` below 1: it is faster), with
its compile and capture seconds apart in ``graph_memory`` (a failed compile is its
``compile_error`` there and no rows).

GPU machine (vLLM staged into /tmp/vllm-site): ``PYTHONPATH=/tmp/site:. python3 bench/decode.py
--presets tinyllama-1.1b``; a missing vLLM site is a ``vllm`` error row.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import copy_bandwidth, environment, interleaved_wall_times, print_table, write_results  # noqa: E402
from bench.decode_peers import hf_peer, merge_results, run_peer, step_or_error, vllm_peer  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from graphs.backends import create_backend  # noqa: E402
from graphs.buckets import default_decode_ladder  # noqa: E402
from graphs.decode import DecodeGraphRunner, LiveDecodeBatch  # noqa: E402
from worker.attention.base import AttentionBatch  # noqa: E402
from worker.attention.factory import create_attention_backend  # noqa: E402
from worker.kv_cache import KVCacheShape, PagedKVCache  # noqa: E402
from worker.model.kernels import select_kernels  # noqa: E402
from worker.model.loader import load_model  # noqa: E402
from worker.model_steps import CompiledDecodeStep, ModelDecodeStep  # noqa: E402

CUDA = torch.device("cuda")
PEERS = ("ours_compile", "engine", "hf", "hf_compile", "vllm")  # the order they run in
PEER_COLUMNS = {"ours_compile": "ours_torch_compile_ms", "engine": "engine_ms", "hf": "hf_generate_ms",
                "hf_compile": "hf_generate_compile_ms", "vllm": "vllm_ms"}


def timed(fn, repeats: int, warmup: int = 3) -> float:
    """Median wall seconds of ``fn`` and a device sync, after ``warmup`` calls."""
    torch.cuda.synchronize()  # work queued before (a warm-up elsewhere) never counts against the first call
    return statistics.median(interleaved_wall_times({"fn": fn}, repeats, torch.cuda.synchronize, warmup)["fn"])


class Setup:
    def __init__(self, path: Path, max_bs: int, context: int, attention: str = "flashinfer",
                 page_size: int = 16, fa3: bool = False) -> None:
        self.model, self.arch = load_model(path, torch.bfloat16, CUDA,
                                           kernels=select_kernels(CUDA, prefer_fused=attention == "flashinfer"))
        ps = page_size
        self.pages_per_row = -(-(context + 1) // ps)
        num_pages = max_bs * self.pages_per_row + 2
        shape = self.model.attention_shape
        self.cache = PagedKVCache(KVCacheShape(self.arch.num_layers, num_pages, ps, shape.num_kv_heads,
                                               self.arch.head_dim), torch.bfloat16, CUDA)
        self.cache.kv.normal_(generator=torch.Generator(device="cuda").manual_seed(0))
        # As the engine's defaults: the fast decode plan and the fused RoPE + KV write; the same
        # full graph without the fused kernel is timed beside it (``full_two_kernel``).
        def backend(**kw):
            return create_attention_backend(attention, shape, self.cache, max_bs, max(max_bs, 8192),
                                            self.pages_per_row, fast_decode_plan=True, **kw)

        self.attention = backend(fused_rope_store=True, decode_graph_split_kv="auto")
        self.two_kernel = self.split = self.no_split = self.fa3 = self.fused_decode = None
        if getattr(self.attention, "fused_rope_store", False):
            self.two_kernel = backend(decode_graph_split_kv="auto")
        if attention == "flashinfer":  # decode graphs with and without flashinfer's KV split and merge kernel
            fused = backend(fused_rope_store=True, decode_graph_split_kv="auto", fused_decode=True)
            self.fused_decode = fused if fused.fused_decode else None  # our one-kernel decode attention
            self.split = backend(fused_rope_store=True, decode_graph_split_kv=True)
            self.no_split = backend(fused_rope_store=True, decode_graph_split_kv=False)
            if fa3:
                self.fa3 = backend(fused_rope_store=True, decode_graph_split_kv="auto", decode_kernel="fa3")
        self.context = context

    def batch(self, b: int) -> LiveDecodeBatch:
        tables = [list(range(1 + i * self.pages_per_row, 1 + (i + 1) * self.pages_per_row)) for i in range(b)]
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(10, self.arch.vocab_size, (b,), generator=g).cuda()
        pos = torch.full((b,), self.context, dtype=torch.int64, device="cuda")
        return LiveDecodeBatch(ids, pos, AttentionBatch.decode([self.context + 1] * b, tables))

    def floor_bytes(self, b: int) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        emb = self.model.embed_tokens.weight
        if not self.arch.tie_word_embeddings:
            weights += (b - emb.shape[0]) * emb.shape[1] * emb.element_size()
        per_token = self.cache.shape.bytes_per_page(torch.bfloat16) // self.cache.page_size
        return weights + b * (self.context + 1) * per_token


def ours(setup: Setup, batches: list[int], repeats: int, tc_full: bool = False) -> tuple[dict, dict]:
    rows: dict[tuple[str, int], float] = {}
    eager_step = ModelDecodeStep(setup.model, setup.attention, breakable=False)
    for b in batches:
        live = setup.batch(b)

        def eager():
            setup.attention.plan(live.attention)
            return eager_step.forward(live.input_ids, live.positions).float()  # float32, as the engine

        rows[("eager", b)] = timed(eager, repeats)
    memory = {}
    variants = [("full", setup.attention), ("breakable", setup.attention)]
    if setup.two_kernel is not None:
        variants.append(("full_two_kernel", setup.two_kernel))
    if setup.split is not None:
        variants += [("full_split", setup.split), ("full_no_split", setup.no_split)]
    if setup.fa3 is not None:
        variants.append(("full_fa3", setup.fa3))
    if setup.fused_decode is not None:
        variants.append(("full_fused_decode", setup.fused_decode))
    if tc_full:
        variants.append(("tc_full", setup.attention))
    runners = {}
    try:
        for name, attention in variants:
            if name == "tc_full":  # graphs.decode.backend=tc_full: the compiled forward, one full graph a shape
                step = CompiledDecodeStep(setup.model, attention)
                backend = create_backend("tc_full", CUDA)
            else:
                step = ModelDecodeStep(setup.model, attention, breakable=name == "breakable")
                backend = create_backend(name.split("_")[0], CUDA)
            runner = DecodeGraphRunner(step, backend, batches)
            summary = runner.capture_all(progress=False)
            if runner.failed:
                raise RuntimeError(f"{name} capture failed: {next(iter(runner.failed.values()))}")
            memory[name] = {"capture_s": summary.seconds, "bytes": summary.resident_bytes}
            if name == "tc_full":
                memory[name].update(compile_s=backend.compile_seconds, capture_only_s=backend.capture_seconds,
                                    compiles=backend.compiles, compile_error=step.compile_error)
                if step.compile_error:  # it fell back to the plain forward: no tc_full numbers
                    runner.release()
                    continue
            runners[name] = runner
        for b in batches:  # every variant's replays in interleaved rounds: drift falls on all alike
            live = setup.batch(b)
            steps = {name: functools.partial(r.execute, live, r.decide(live)) for name, r in runners.items()}
            for name, times in interleaved_wall_times(steps, repeats, torch.cuda.synchronize).items():
                rows[(name, b)] = statistics.median(times)
    finally:
        for runner in runners.values():
            runner.release()
        gc.collect()
    return rows, memory


def ladder_memory(setup: Setup, max_bs: int) -> dict:
    """Full decode ladder on one pool vs its largest shape alone vs one pool per shape."""
    step = ModelDecodeStep(setup.model, setup.attention, breakable=False)
    ladder = default_decode_ladder(max_bs)

    def measure(shapes):
        runner = DecodeGraphRunner(step, create_backend("full", CUDA, pool=torch.cuda.graph_pool_handle()), shapes)
        runner.capture_all(progress=False)
        if runner.failed:
            raise RuntimeError(f"capture failed: {runner.failed}")
        total = runner.backend.resident_bytes
        runner.release()
        gc.collect()
        torch.cuda.empty_cache()
        return total

    largest, shared = measure([ladder[-1]]), measure(ladder)
    per_shape = sum(measure([b]) for b in ladder)
    return {"shapes": len(ladder), "largest_alone_bytes": largest, "shared_pool_bytes": shared,
            "one_pool_per_shape_bytes": per_shape, "shared_over_largest": shared / largest}


def run_peers(path: Path, args: argparse.Namespace, peers: list[str]) -> dict[str, dict]:
    """Each selected peer in a child of its own, in :data:`PEERS` order: ``{peer: run_peer's result}``."""
    ctx, reps, out = args.context, args.peer_repeats, {}
    for peer in (p for p in PEERS if p in peers):
        print(f"{path.name}: peer {peer}", flush=True)
        if peer == "ours_compile":  # a child per batch: a failed compile can leave a process unusable
            child = [sys.executable, str(Path(__file__).resolve().with_name("decode_compile.py")), "--model", str(path),
                     "--context", str(ctx), "--repeats", str(args.repeats), "--attention", args.attention,
                     "--page-size", str(args.page_size)]
            out[peer] = merge_results(peer, [run_peer(peer, child + ["--batch", str(b)], dict(os.environ),
                                                      args.peer_timeout_s, [b]) for b in ints(args.compile_batches)])
        elif peer == "engine":  # our whole engine, timed as vLLM's offline generate is
            child = [sys.executable, str(Path(__file__).resolve().with_name("decode_engine.py")), "--model", str(path),
                     "--batches", args.batches, "--context", str(ctx), "--repeats", str(reps)]
            out[peer] = run_peer(peer, child, dict(os.environ), args.peer_timeout_s, ints(args.batches))
        elif peer in ("hf", "hf_compile"):
            out[peer] = hf_peer(path, ints(args.hf_batches), ctx, reps, args.peer_timeout_s, compile_=peer != "hf")
        else:
            out[peer] = vllm_peer(path, ints(args.vllm_batches or args.batches), ctx, reps, args.vllm_timeout_s,
                                  args.vllm_site, args.vllm_gpu_memory_utilization)
    return out


def preset_rows(preset: str, batches: list[int], rows: dict, floors: dict, peers: dict[str, dict],
                splits: dict[int, bool | None] | None = None) -> list[dict]:
    """Table rows of one preset: ours, the floor, each peer's step (or its error) and full graph over
    it; ``splits``: whether ``full``'s captured shape of each batch splits the KV (None: not flashinfer)."""
    out = []
    for b in batches:
        full = rows[("full", b)]
        r = {"preset": preset, "batch": b, "floor_ms": floors[b], "full_ms": full * 1e3,
             "graph_split_kv": (splits or {}).get(b),
             "full_over_floor": full * 1e3 / floors[b], "eager_ms": rows[("eager", b)] * 1e3,
             "breakable_ms": rows[("breakable", b)] * 1e3, "eager_over_full": rows[("eager", b)] / full,
             "breakable_over_full": rows[("breakable", b)] / full}
        if ("full_two_kernel", b) in rows:  # RoPE and the KV append as two kernels, side by side
            r["full_two_kernel_ms"] = rows[("full_two_kernel", b)] * 1e3
            r["two_kernel_over_fused"] = rows[("full_two_kernel", b)] / full
        if ("full_fa3", b) in rows:  # flashinfer's fa3 decode kernels
            r["full_fa3_ms"], r["fa3_over_full"] = rows[("full_fa3", b)] * 1e3, rows[("full_fa3", b)] / full
        if ("full_fused_decode", b) in rows:  # our one-kernel decode attention
            r["full_fused_decode_ms"] = rows[("full_fused_decode", b)] * 1e3
            r["fused_decode_over_full"] = rows[("full_fused_decode", b)] / full
        for forced in ("split", "no_split"):  # decode graphs with the KV split forced on and off
            if (f"full_{forced}", b) in rows:
                r[f"full_{forced}_ms"] = rows[(f"full_{forced}", b)] * 1e3
                r[f"{forced}_over_full"] = rows[(f"full_{forced}", b)] / full
        if ("tc_full", b) in rows:  # the torch.compile'd forward in one full graph a shape
            r["tc_full_ms"] = rows[("tc_full", b)] * 1e3
            r["tc_full_over_full"] = rows[("tc_full", b)] / full
        for peer, res in peers.items():
            step, error = step_or_error(res, b)
            r[PEER_COLUMNS[peer]] = step * 1e3 if step is not None else None
            r[f"full_over_{peer}"] = full / step if step is not None and step > 0 else None
            if error:
                r[f"{peer}_error"] = error
        if r.get("engine_ms") and r.get("vllm_ms"):  # the two serving loops, each per output token
            r["engine_over_vllm"] = r["engine_ms"] / r["vllm_ms"]
        out.append(r)
    return out


def ints(csv: str) -> list[int]:
    return [int(b) for b in csv.split(",") if b]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tinyllama-1.1b,llama-3-8b")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--peers", default="hf,ours_compile,engine,vllm", help=f"any of {','.join(PEERS)}; empty for none")
    ap.add_argument("--compile-batches", default="1,64",
                    help="batch sizes for torch.compile of ours (each size compiles anew)")
    ap.add_argument("--hf-batches", default="1,8,64", help="batch sizes for HF generate")
    ap.add_argument("--vllm-batches", help="batch sizes for vLLM (default: --batches)")
    ap.add_argument("--peer-repeats", type=int, default=3, help="timed repeats of each generate length (HF, vLLM)")
    ap.add_argument("--peer-timeout-s", type=float, default=900.0, help="limit of each ours_compile / hf child")
    ap.add_argument("--vllm-site", default="/tmp/vllm-site", help="where vLLM and its pins are installed")
    ap.add_argument("--vllm-timeout-s", type=float, default=900.0)
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--attention", default="flashinfer", choices=["flashinfer", "torch"])
    ap.add_argument("--page-size", type=int, default=16, help="KV-cache page size (tokens; cache.page_size)")
    ap.add_argument("--tc-full", action="store_true",
                    help="also time graphs.decode.backend=tc_full (torch.compile'd forward, one full graph a "
                         "shape; its compile and capture seconds go to graph_memory)")
    ap.add_argument("--fa3", action="store_true", help="also the full graph with fa3 decode kernels (Hopper)")
    args = ap.parse_args()
    unknown = set(filter(None, args.peers.split(","))) - set(PEERS)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose from {','.join(PEERS)}")
    return args


def bench_preset(preset: str, args: argparse.Namespace, bw: float) -> dict:
    """Ours in this process, then (its GPU memory released) the peers in their children."""
    batches = ints(args.batches)
    path = ensure_checkpoint(preset, Path(args.checkpoints))
    setup = Setup(path, max(batches), args.context, args.attention, args.page_size, args.fa3)
    floors = {b: setup.floor_bytes(b) / bw * 1e3 for b in batches}
    rows, memory = ours(setup, batches, args.repeats, args.tc_full)
    split_of = getattr(setup.attention, "graph_splits_kv", None)
    splits = {b: split_of(b) if split_of else None for b in batches}
    memory["ladder"] = ladder_memory(setup, max(batches))
    del setup
    gc.collect()
    torch.cuda.empty_cache()  # what we held goes to the peers' children
    peers = run_peers(path, args, list(filter(None, args.peers.split(","))))
    return {"rows": preset_rows(preset, batches, rows, floors, peers, splits), "graph_memory": memory,
            "peers": peers}


def report(results: dict, peers: list[str]) -> None:
    chosen = [p for p in PEERS if p in peers]
    print_table([r for res in results["presets"].values() for r in res["rows"]],
                ["preset", "batch", "floor_ms", "full_ms", "full_over_floor", "graph_split_kv", "full_two_kernel_ms",
                 "two_kernel_over_fused", "split_over_full", "no_split_over_full", "fa3_over_full",
                 "fused_decode_over_full", "tc_full_ms", "tc_full_over_full", "eager_ms", "breakable_ms",
                 *(PEER_COLUMNS[p] for p in chosen), *(f"full_over_{p}" for p in chosen), "engine_over_vllm"])
    for preset, res in results["presets"].items():
        print(preset, "graph memory:", res["graph_memory"])
        for peer, r in res["peers"].items():
            errors = {b: row["error"] for b, row in r["rows"].items() if "error" in row}
            if r["error"] or errors:
                print(f"{preset} {peer} failed: {r['error'] or ''} {errors or ''}".rstrip())


def main() -> None:
    args = parse_args()
    bw = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s")
    results = {"env": environment(), "copy_bandwidth_Bps": bw, "args": vars(args), "presets": {}}
    presets = args.presets.split(",")
    for i, preset in enumerate(presets):
        results["presets"][preset] = bench_preset(preset, args, bw)
        if i + 1 < len(presets):
            write_results("decode-partial", results)  # survives a later preset's crash or the run's timeout
    report(results, args.peers.split(","))
    print(f"wrote {write_results('decode', results)}")


if __name__ == "__main__":
    main()
