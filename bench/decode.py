"""Decode step time per bucket: eager vs full graph vs breakable graph vs peers, and the HBM floor.

All variants run in one process on the same checkpoint, weights and KV contents (random, never
zero), context ``--context`` tokens per row. Steps are timed wall-clock around host planning,
launch and a device sync (what a serving step costs), median of ``--repeats`` after warm-up.
Peers: HF transformers with a static cache (eager, and ``torch.compile(mode="reduce-overhead")``)
and ``torch.compile`` of our own decode step. Failures of a peer are recorded, not fatal.
Also reports graph memory of the whole ladder on one pool against one pool per shape.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import copy_bandwidth, environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from graphs.backends import create_backend  # noqa: E402
from graphs.buckets import default_decode_ladder  # noqa: E402
from graphs.decode import DecodeGraphRunner, LiveDecodeBatch  # noqa: E402
from worker.attention.base import AttentionBatch  # noqa: E402
from worker.attention.factory import create_attention_backend  # noqa: E402
from worker.kv_cache import KVCacheShape, PagedKVCache  # noqa: E402
from worker.model.kernels import select_kernels  # noqa: E402
from worker.model.loader import load_model  # noqa: E402
from worker.model_steps import ModelDecodeStep  # noqa: E402

CUDA = torch.device("cuda")


def timed(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Setup:
    def __init__(self, path: Path, max_bs: int, context: int, attention: str = "flashinfer") -> None:
        self.model, self.arch = load_model(path, torch.bfloat16, CUDA,
                                           kernels=select_kernels(CUDA, prefer_fused=attention == "flashinfer"))
        ps = 16
        self.pages_per_row = -(-(context + 1) // ps)
        num_pages = max_bs * self.pages_per_row + 2
        shape = self.model.attention_shape
        self.cache = PagedKVCache(KVCacheShape(self.arch.num_layers, num_pages, ps, shape.num_kv_heads,
                                               self.arch.head_dim), torch.bfloat16, CUDA)
        self.cache.kv.normal_(generator=torch.Generator(device="cuda").manual_seed(0))
        self.attention = create_attention_backend(attention, shape, self.cache, max_bs, max(max_bs, 8192),
                                                  self.pages_per_row)
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


def ours(setup: Setup, batches: list[int], repeats: int) -> tuple[dict, dict]:
    rows: dict[tuple[str, int], float] = {}
    eager_step = ModelDecodeStep(setup.model, setup.attention, breakable=False)
    for b in batches:
        live = setup.batch(b)

        def eager():
            setup.attention.plan(live.attention)
            return eager_step.forward(live.input_ids, live.positions)

        rows[("eager", b)] = timed(eager, repeats)
    memory = {}
    for name in ("full", "breakable"):
        step = ModelDecodeStep(setup.model, setup.attention, breakable=name == "breakable")
        runner = DecodeGraphRunner(step, create_backend(name, CUDA), batches)
        summary = runner.capture_all(progress=False)
        if runner.failed:
            raise RuntimeError(f"{name} capture failed: {next(iter(runner.failed.values()))}")
        memory[name] = {"capture_s": summary.seconds, "bytes": summary.resident_bytes}
        for b in batches:
            live = setup.batch(b)
            choice = runner.decide(live)
            rows[(name, b)] = timed(lambda: runner.execute(live, choice), repeats)
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


def compiled_ours(setup: Setup, batches: list[int], repeats: int) -> dict:
    """torch.compile(mode="reduce-overhead") of our decode step, what a user of our code would try."""
    out = {}
    step = ModelDecodeStep(setup.model, setup.attention, breakable=False)
    compiled = torch.compile(step.forward, mode="reduce-overhead", dynamic=False)
    for b in batches:
        live = setup.batch(b)
        try:
            def run():
                setup.attention.plan(live.attention)
                return compiled(live.input_ids, live.positions)

            out[b] = timed(run, repeats)
        except Exception as e:  # noqa: BLE001 - a failing peer is a result
            out[b] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


def hf_peer(path: Path, batches: list[int], context: int, repeats: int, compile_: bool) -> dict:
    out = {}
    try:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    except Exception as e:  # noqa: BLE001
        return {b: f"load failed: {e}" for b in batches}
    fwd = torch.compile(model.forward, mode="reduce-overhead") if compile_ else model.forward
    for b in batches:
        try:
            cache = transformers.StaticCache(config=model.config, max_cache_len=context + 8)
            g = torch.Generator().manual_seed(b)
            prompt = torch.randint(10, model.config.vocab_size, (b, context), generator=g).cuda()
            with torch.no_grad():
                model(prompt, past_key_values=cache, use_cache=True)
                tok = torch.randint(10, model.config.vocab_size, (b, 1), generator=g).cuda()
                pos = torch.tensor([context], device="cuda")

                def step():
                    return fwd(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

                out[b] = timed(step, repeats)
        except Exception as e:  # noqa: BLE001
            out[b] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            traceback.print_exc(limit=2)
        torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tinyllama-1.1b,llama-3-8b")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--peers", default="hf,hf_compile,ours_compile")
    ap.add_argument("--compile-batches", default="1,64",
                    help="batch sizes for the torch.compile peers (each size compiles anew)")
    ap.add_argument("--checkpoints", default="/tmp/graphfleet-bench")
    ap.add_argument("--attention", default="flashinfer", choices=["flashinfer", "torch"])
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    peers = set(filter(None, args.peers.split(",")))
    bw = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s")
    results, table = {"env": environment(), "copy_bandwidth_Bps": bw, "args": vars(args), "presets": {}}, []
    for preset in args.presets.split(","):
        path = ensure_checkpoint(preset, Path(args.checkpoints))
        setup = Setup(path, max(batches), args.context, args.attention)
        floors = {b: setup.floor_bytes(b) / bw * 1e3 for b in batches}
        rows, memory = ours(setup, batches, args.repeats)
        memory["ladder"] = ladder_memory(setup, max(batches))
        compile_batches = [int(b) for b in args.compile_batches.split(",")]
        # torch.compile runs last: on torch 2.11 building a model after it tripped a
        # PythonDispatcher assert. With compile peers on, give one preset per invocation.
        hf = hf_peer(path, batches, args.context, args.repeats, False) if "hf" in peers else {}
        hfc = hf_peer(path, compile_batches, args.context, args.repeats, True) if "hf_compile" in peers else {}
        compiled = compiled_ours(setup, compile_batches, args.repeats) if "ours_compile" in peers else {}
        del setup
        gc.collect()
        torch.cuda.empty_cache()
        per_preset = []
        for b in batches:
            r = {"preset": preset, "batch": b,
                 **{f"{k}_ms": rows[(k, b)] * 1e3 for k in ("eager", "full", "breakable")}}
            r["floor_ms"] = floors[b]
            r["full_over_floor"] = r["full_ms"] / floors[b]
            r["eager_over_full"] = rows[("eager", b)] / rows[("full", b)]
            r["breakable_over_full"] = rows[("breakable", b)] / rows[("full", b)]
            for name, res in (("hf_eager", hf), ("hf_compile", hfc), ("ours_compile", compiled)):
                v = res.get(b)
                r[f"{name}_ms"] = v * 1e3 if isinstance(v, float) else None
                if isinstance(v, str):
                    r[f"{name}_error"] = v
            per_preset.append(r)
        results["presets"][preset] = {"rows": per_preset, "graph_memory": memory}
        table += per_preset
    print_table(table, ["preset", "batch", "floor_ms", "eager_ms", "full_ms", "breakable_ms", "hf_eager_ms",
                        "hf_compile_ms", "ours_compile_ms", "eager_over_full", "breakable_over_full",
                        "full_over_floor"])
    for preset, res in results["presets"].items():
        print(preset, "graph memory:", res["graph_memory"])
    print(f"wrote {write_results('decode', results)}")


if __name__ == "__main__":
    main()
