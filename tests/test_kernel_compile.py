"""Our Triton kernels compile for Hopper on this CPU machine (tests/kernel_compile.py): a
compile error, a shape a ``tl.dot`` refuses or a constexpr misuse shows here, not first on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernel_compile import VARIANTS

ROOT = Path(__file__).resolve().parents[1]


def test_our_triton_kernels_compile_for_sm90():
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this Triton cannot compile ahead of time for a GPU: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "graphfleet-triton-aot")
    res = subprocess.run([sys.executable, "-m", "tests.kernel_compile"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert res.returncode == 0 and rows, res.stderr[-3000:]
    failed = [f"{r['name']}: {r['error']}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert [r["name"] for r in rows] == [v[0] for v in VARIANTS]
