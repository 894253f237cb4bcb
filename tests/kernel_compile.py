"""Compile our Triton kernels for Hopper (sm_90) on a machine with no GPU: Triton's own
compiler and its bundled ptxas, no interpreter. Run as ``python -m tests.kernel_compile`` (with
``TRITON_INTERPRET`` unset: under it ``triton.jit`` makes interpreted functions, which do not
compile); prints one JSON line per kernel variant. Used by tests/test_kernel_compile.py."""

from __future__ import annotations

import json
import os
import sys

ROPE_STORE_SIGNATURE = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "q_row": "i32", "k_row": "i32",
                        "v_row": "i32", "pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "cache_ptr": "*bf16"}
#: (name, module, kernel, signature, constexprs): the RoPE + KV-write kernel of the flashinfer backend's
#: decode and prefill steps, at the attention shapes of tinyllama-1.1b (32 q heads, 4 KV heads of 64)
#: and llama-3-8b (32 and 8 of 128), with int32 and int64 locations.
VARIANTS = [
    (f"rope_store q_heads=32 kv_heads={kv} head_dim={hd} locations={loc}", "worker.attention.rope_store",
     "_rope_store_kernel", {**ROPE_STORE_SIGNATURE, "loc_ptr": f"*{loc}"},
     {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": kv, "BLOCK_Q": 32, "BLOCK_KV": kv, "HALF": hd // 2, "PAGE_SIZE": 16})
    for kv, hd in [(4, 64), (8, 128)] for loc in ("i32", "i64")
]
FUSED_DECODE_SIGNATURE = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "q_row": "i32", "k_row": "i32",
                          "v_row": "i32", "pos_ptr": "*i64", "loc_ptr": "*i32", "cos_sin_ptr": "*fp32",
                          "cache_ptr": "*bf16", "indptr_ptr": "*i32", "indices_ptr": "*i32", "last_ptr": "*i32",
                          "out_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32", "count_ptr": "*i32",
                          "num_splits": "i32", "scale_log2": "fp32"}
#: The fused decode attention kernel (worker/attention/fused_decode.py) at the same two shapes.
VARIANTS += [
    (f"fused_decode q_heads=32 kv_heads={kv} head_dim={hd}", "worker.attention.fused_decode", "_fused_decode_kernel",
     FUSED_DECODE_SIGNATURE, {"GROUP": 32 // kv, "GROUP_P2": 32 // kv, "NUM_KV_HEADS": kv, "HALF": hd // 2,
                              "PAGE_SIZE": 16, "BLOCK_N": 32, "BLOCK_G": 16, "MAX_SPLITS": 8})
    for kv, hd in [(4, 64), (8, 128)]
]


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
        sys.exit("run with TRITON_INTERPRET unset: interpreted functions do not compile")
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for name, module, kernel, signature, constexprs in VARIANTS:
        fn = getattr(importlib.import_module(module), kernel)
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs,
                                                                                               "constexpr")},
                                                constexprs=constexprs),
                                      target=target, options={"num_warps": 4, "num_stages": 3})
            print(json.dumps({"name": name, "ok": True, "shared": compiled.metadata.shared}), flush=True)
        except Exception as e:  # noqa: BLE001 - every variant is reported, the test names the failures
            print(json.dumps({"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:3000]}), flush=True)


if __name__ == "__main__":
    main()
