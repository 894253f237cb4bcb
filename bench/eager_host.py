"""Where an eager decode step's host time goes (issue 17: the eager engine step no slower than HF
eager generate at batch 1 and 64; at a430655 it was 6.1 ms against HF's 3.67 on tinyllama-1.1b at
batch 1). On the 2-core CPU (tiny-llama, context 512) ours was 1.0-1.12x HF's forward at batch 1
but 2.0x at batch 4: the torch reference attention's page gather and einsums; on the GPU the
calls differ (flashinfer, Triton), which is what this measures there.

Per preset, batch and kernel set: the host microseconds of one call of each thing a decoder layer
launches (queued back to back without a sync: what the host pays before the device can start,
the bound of a host-bound eager step), and its wall time with the sync, then the whole eager step
(attention plan, forward, LM head) the same two ways. Kernel sets:

* ``fused``: flashinfer's norm and SiLU kernels and the Triton RoPE + KV write (the default);
* ``fused_unfused_rope``: the same with flashinfer's RoPE and its paged-KV append (two launches);
* ``torch``: the PyTorch element-wise kernels (more kernels, plain dispatch) with flashinfer attention;
* ``hf``: HF transformers' eager forward of the same checkpoint in the same process (one token a
  row over a growing ``DynamicCache``), the reference the issue compares with.

On a CPU it runs the torch kernels with the torch attention backend (a smoke run of the script:
do not quote it). ``python bench/eager_host.py [--presets tinyllama-1.1b] [--batches 1,64]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import add_preset_arguments, environment, print_table, write_results  # noqa: E402
from bench.engine import ensure_checkpoint  # noqa: E402
from worker.attention.base import AttentionBatch, Rope  # noqa: E402
from worker.attention.factory import create_attention_backend  # noqa: E402
from worker.kv_cache import KVCacheShape, PagedKVCache  # noqa: E402
from worker.model.loader import load_model  # noqa: E402
from worker.model.torch_kernels import TorchKernels  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_and_wall_us(fn, device: torch.device, calls: int, repeats: int = 5) -> tuple[float, float]:
    """Median over ``repeats`` of (host us per call of ``fn`` issued ``calls`` times back to back
    without a sync, wall us per call including the sync at the end)."""
    for _ in range(3):
        fn()
    sync(device)
    hosts, walls = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        queued = time.perf_counter()
        sync(device)
        end = time.perf_counter()
        hosts.append((queued - start) / calls * 1e6)
        walls.append((end - start) / calls * 1e6)
    return statistics.median(hosts), statistics.median(walls)


def use_kernels(model, kernels) -> None:
    """Point every module of ``model`` that holds element-wise kernels at ``kernels``."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels


def kernel_sets(device: torch.device, fused_kernels) -> list[tuple[str, object, str, bool]]:
    """(name, kernels, attention backend, fused RoPE + KV write) per kernel set to time here."""
    if device.type != "cuda":
        return [("torch", TorchKernels(), "torch", False)]
    return [("fused", fused_kernels, "flashinfer", True), ("fused_unfused_rope", fused_kernels, "flashinfer", False),
            ("torch", TorchKernels(), "flashinfer", False)]


def bench_preset(path: Path, batches: list[int], context: int, calls: int, device: torch.device) -> list[dict]:
    from worker.model.kernels import select_kernels

    fused = select_kernels(device)
    model, arch = load_model(path, torch.bfloat16 if device.type == "cuda" else torch.float32, device, kernels=fused)
    page_size = 16
    pages_per_row = -(-(context + 1) // page_size)
    shape = model.attention_shape
    cache = PagedKVCache(KVCacheShape(arch.num_layers, max(batches) * pages_per_row + 2, page_size,
                                      shape.num_kv_heads, arch.head_dim), model.dtype, device)
    cache.kv.normal_()
    layer = model.layers[0]
    rows = []
    for set_name, kernels, backend_name, fused_store in kernel_sets(device, fused):
        use_kernels(model, kernels)
        extra = dict(fast_decode_plan=True, fused_rope_store=fused_store, decode_graph_split_kv="auto") \
            if backend_name == "flashinfer" else {}
        attention = create_attention_backend(backend_name, shape, cache, max(batches), max(max(batches), 512),
                                             pages_per_row, **extra)
        for b in batches:
            g = torch.Generator().manual_seed(b)
            tables = [list(range(1 + i * pages_per_row, 1 + (i + 1) * pages_per_row)) for i in range(b)]
            batch = AttentionBatch.decode([context + 1] * b, tables)
            ids = torch.randint(10, arch.vocab_size, (b,), generator=g).to(device)
            positions = torch.full((b,), context, dtype=torch.int64, device=device)
            x = torch.randn(b, arch.hidden_size, generator=g).to(device, model.dtype)
            residual = torch.randn(b, arch.hidden_size, generator=g).to(device, model.dtype)
            w = layer.input_layernorm.weight
            eps = arch.rms_norm_eps
            attention.plan(batch)
            qkv = layer.self_attn.qkv_proj(x)
            q_size, kv_size = layer.self_attn.q_size, layer.self_attn.kv_size
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            rope = Rope(positions, model.cos_sin_cache, arch.head_dim, kernels.apply_rope)
            q3 = q.reshape(b, shape.num_q_heads, shape.head_dim).contiguous()
            out = torch.empty_like(q3)
            gate_up = layer.mlp.gate_up_proj(x)

            def step():
                attention.plan(batch)
                return model.compute_logits(model(ids, positions, attention))

            ops = {
                "torch add (dispatch floor)": lambda: x.add(1),
                "empty_like": lambda: torch.empty_like(q3),
                "linear qkv": lambda: layer.self_attn.qkv_proj(x),
                "linear gate_up": lambda: layer.mlp.gate_up_proj(x),
                "rms_norm": lambda: kernels.rms_norm(x, w, eps),
                "fused_add_rms_norm": lambda: kernels.fused_add_rms_norm(x.clone(), residual.clone(), w, eps),
                "clone x2 (in the line above)": lambda: (x.clone(), residual.clone()),
                "silu_and_mul": lambda: kernels.silu_and_mul(gate_up),
                "store_rotated (RoPE + KV write)": lambda: attention.store_rotated(0, rope, q, k, v),
                "attend": lambda: attention.attend(0, q3, out),
                "attention plan": lambda: attention.plan(batch),
                "decoder layer": lambda: layer(x, residual.clone(), rope, attention),
                "eager step (plan, forward, LM head)": step,
            }
            for name, fn in ops.items():
                n = max(3, calls // 10) if name.startswith(("eager step", "decoder layer")) else calls
                host, wall = host_and_wall_us(fn, device, n)
                rows.append({"preset": path.name, "batch": b, "kernels": set_name, "op": name,
                             "host_us": host, "wall_us": wall})
            per_layer = next(r for r in rows[::-1] if r["op"] == "decoder layer")
            step_row = rows[-1]
            step_row["layers"] = arch.num_layers
            step_row["host_us_per_layer"] = step_row["host_us"] / arch.num_layers
            per_layer["layers"] = arch.num_layers
    rows += hf_rows(path, batches, context, calls, device, model.dtype)
    return rows


def hf_rows(path: Path, batches: list[int], context: int, calls: int, device: torch.device,
            dtype: torch.dtype) -> list[dict]:
    """HF transformers' eager forward of one new token per row over a ``context``-token cache
    (``DynamicCache``, growing by a token per call), host and wall us: the reference the issue
    compares the eager step with, in the same process."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return [{"preset": path.name, "kernels": "hf", "op": f"HF forward: {e}"}]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    rows = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        with torch.no_grad():
            cache = hf(torch.randint(10, hf.config.vocab_size, (b, context), generator=g).to(device),
                       use_cache=True).past_key_values
        ids = torch.randint(10, hf.config.vocab_size, (b, 1), generator=g).to(device)

        def forward():
            with torch.no_grad():
                return hf(ids, past_key_values=cache, use_cache=True).logits

        host, wall = host_and_wall_us(forward, device, max(3, calls // 10))
        n = hf.config.num_hidden_layers
        rows.append({"preset": path.name, "batch": b, "kernels": "hf", "op": "HF forward (DynamicCache)",
                     "host_us": host, "wall_us": wall, "layers": n, "host_us_per_layer": host / n})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_preset_arguments(ap, presets="tinyllama-1.1b", batches="1,64")
    ap.add_argument("--calls", type=int, default=200, help="calls of each op per timed repeat (a tenth for steps)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for preset in args.presets.split(","):
        rows += bench_preset(ensure_checkpoint(preset, Path(args.checkpoints)),
                             [int(b) for b in args.batches.split(",")], args.context, args.calls, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, ["preset", "batch", "kernels", "op", "host_us", "wall_us", "host_us_per_layer"])
    print(f"wrote {write_results('eager_host', {'env': environment(), 'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
