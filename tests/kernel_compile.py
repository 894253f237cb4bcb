"""Compile our Triton decode kernels for Hopper (sm_90) on a machine with no GPU: Triton's own
compiler and its bundled ptxas, no interpreter. Run as ``python -m tests.kernel_compile`` (with
``TRITON_INTERPRET`` unset: under it ``triton.jit`` makes interpreted functions, which do not
compile); prints one JSON line per kernel variant. Used by tests/test_kernel_compile.py."""

from __future__ import annotations

import json
import os
import sys

LINEAR_SIGNATURE = {**{p: "*bf16" for p in ("x_ptr", "r_ptr", "g_ptr", "w_ptr", "b_ptr", "out_ptr", "res_ptr")},
                    **{i: "i32" for i in ("M", "K", "N", "x_row", "r_row", "out_row")}, "eps": "fp32"}
ROPE_SIGNATURE = {**{p: "*bf16" for p in ("x_ptr", "r_ptr", "g_ptr", "w_ptr", "b_ptr", "q_ptr", "res_ptr")},
                  "pos_ptr": "*i64", "loc_ptr": "*i32", "cos_sin_ptr": "*fp32", "cache_ptr": "*bf16",
                  **{i: "i32" for i in ("M", "K", "x_row", "r_row")}, "eps": "fp32"}
#: (name, module, kernel, signature, constexprs): the default tilings (16 weight rows; K steps of 256
#: for one row, 128 for 16) of every switch the layers use, and a wide tile of the bench's sweep.
VARIANTS = [
    *[(f"norm_linear rows={bm} norm={n} residual={r} bias={b} silu={s} block_n={bn}", "worker.model.norm_linear",
       "_add_norm_linear_kernel", LINEAR_SIGNATURE,
       {"HAS_NORM": n, "HAS_RESIDUAL": r, "HAS_BIAS": b, "SILU_MUL": s, "BLOCK_M": bm, "BLOCK_N": bn,
        "BLOCK_K": 256 if bm == 1 else 128, "DOT_PRECISION": "tf32", "DOT_FP32": False})
      for n, r, b, s, bn in [(True, True, False, False, 16), (True, True, False, True, 16),
                             (True, False, True, False, 64), (False, False, False, False, 16)]
      for bm in (1, 16)],
    *[(f"norm_qkv_rope rows={bm} head_dim={hd} bias={b}", "worker.model.norm_qkv_rope", "_norm_qkv_rope_kernel",
       ROPE_SIGNATURE,
       {"HAS_RESIDUAL": True, "HAS_BIAS": b, "NUM_Q_HEADS": 32, "NUM_KV_HEADS": kv, "HALF": hd // 2, "PAGE_SIZE": 16,
        "BLOCK_M": bm, "BLOCK_P": bp, "BLOCK_K": 256 if bm == 1 else 128, "DOT_PRECISION": "tf32", "DOT_FP32": False})
      for hd, kv, b, bp in [(64, 4, False, 16), (128, 8, True, 32)] for bm in (1, 16)],
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
