"""The ``ours_compile`` peer of ``bench/decode.py``, child side: ``torch.compile(mode="reduce-overhead",
dynamic=False)`` of our decode step, what a user of our code would try, timed as ours (plan + call +
device sync, median of ``--repeats`` after warm-up).

``python bench/decode_compile.py --model DIR --batch B ...`` prints one JSON row on stdout:
``{"peer": "ours_compile", "batch", "step_s"}`` or ``{"peer", "batch", "error"}``. The parent starts
one child per batch: torch.compile state is process-wide, building a model after a compile once
tripped an assert, and a failed compile left the next batch's first CUDA call asserting (H200,
2a446d4).

Attention goes through the ``graphfleet::attention`` custom op (as ``tc_full`` traces it), so dynamo
sees the step as one graph; called directly, flashinfer's Python wrappers break it at every layer,
the per-layer frames recompile past dynamo's limit, and inductor failed. The batch plans into
flashinfer's CUDA-graph wrapper of its size, whose buffers keep their addresses, so the graphs
cudagraph trees record read each later plan. The model's ``forward`` and ``compute_logits`` are
compiled without their ``@torch.inference_mode()`` decorators, under ``torch.no_grad()``: with the
decorators traced, inductor failed at every batch of both presets (``KeyError`` on a storage weakref
in AOT autograd's functional call of the first projection; H100, 9204af9).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.decode import Setup, timed  # noqa: E402
from bench.decode_peers import emit, error_text  # noqa: E402
from worker.attention.splitting import SplittingAttention  # noqa: E402
from worker.model_steps import ModelDecodeStep  # noqa: E402


def compiled_ours(setup: Setup, b: int, repeats: int) -> None:
    """Time the compiled step at batch ``b``: one JSON row on stdout (a failure is an error row)."""
    step = ModelDecodeStep(setup.model, setup.attention, breakable=False)
    splitting = SplittingAttention(setup.attention)

    model = setup.model
    hidden_of = type(model).forward.__wrapped__  # the undecorated methods (see the module docstring)
    logits_of = type(model).compute_logits.__wrapped__

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return logits_of(model, hidden_of(model, input_ids, positions, splitting), dtype=None)

    compiled = torch.compile(forward, mode="reduce-overhead", dynamic=False)
    live = setup.batch(b)
    step.plan_dummy(b)  # selects the graph wrapper of b rows

    def run():
        step.plan(live.attention, b)
        return compiled(live.input_ids, live.positions)

    try:
        emit("ours_compile", b, step_s=timed(run, repeats))
    except Exception as e:  # noqa: BLE001 - a failing peer is a result
        emit("ours_compile", b, error=error_text(e))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the checkpoint directory")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--attention", default="flashinfer", choices=["flashinfer", "torch"])
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    compiled_ours(Setup(Path(args.model), args.batch, args.context, args.attention, args.page_size), args.batch,
                  args.repeats)


if __name__ == "__main__":
    main()
