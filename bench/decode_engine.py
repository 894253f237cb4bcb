"""The ``engine`` peer of ``bench/decode.py``, child side: our whole engine timed the way vLLM's offline
``LLM.generate`` is, so that the two serving loops compare like with like.

``bench/decode.py``'s ``full`` column is one graph step run serially (plan, replay, device sync). vLLM's
per-token figure is a steady state of its loop: scheduling, sampling and, with async scheduling, the
host work of one step behind the device work of the one before. This child gives ours the same: an
:class:`~worker.engine.Engine` with the fleet's defaults (decode and prefill graphs on CUDA, async
scheduling, the sampler) runs ``generate`` on ``b`` prompts of ``--context`` random token ids, greedy,
``ignore_eos``, and the per-token time is (t(65 new tokens) - t(1 new token)) / 64, medians of
``--repeats`` pairs after a warm-up pair (``bench/decode_peers.per_token``, as the HF and vLLM peers).

Two settings leave the fleet's defaults, both to match the vLLM peer's method: prefix caching is off
(every call prefills, as vLLM's child runs it), and so are mixed steps: then every prompt is prefilled
before the first decode step, and the 64 steps the difference counts are all decode steps of ``b``
rows (with mixed steps, early rows would take tokens while later ones prefill and finish early, so
the difference would count shrinking batches). ``--gpu-memory-fraction`` defaults to the vLLM
peer's 0.5.

``python bench/decode_engine.py --model DIR --batches 1,8 ...`` prints one JSON row per batch on
stdout: ``{"peer": "engine", "batch", "step_s", "t1_s", "t65_s"}`` or ``{"peer", "batch", "error"}``.
On a machine without CUDA the engine runs as it does there (graphs off, the torch attention).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.decode_peers import NEW_TOKENS, emit, error_text, per_token, random_prompts  # noqa: E402
from deploy.config import load_config  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402


def engine_overrides(model: Path, batches: list[int], context: int, gpu_memory_fraction: float,
                     num_pages: int | None) -> list[str]:
    """The config overrides of the peer's engine (the module docstring says why each one)."""
    out = [f"model.path={model}", "cache.prefix_caching=false", "scheduler.mixed_steps=false",
           f"scheduler.max_running_requests={max(batches)}", f"cache.gpu_memory_fraction={gpu_memory_fraction}",
           f"model.max_model_len={context + NEW_TOKENS + 16}"]
    if torch.cuda.is_available():
        out.append("model.dtype=bfloat16")
    if num_pages is not None:
        out.append(f"cache.num_pages={num_pages}")
    return out


def timed_engine(args: argparse.Namespace) -> None:
    """One engine for every batch; a row per batch on stdout (a failure is an error row)."""
    batches = [int(b) for b in args.batches.split(",") if b]
    engine = Engine(load_config(None, engine_overrides(Path(args.model), batches, args.context,
                                                       args.gpu_memory_fraction, args.num_pages)))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    try:
        for b in batches:
            try:
                prompts = random_prompts(b, args.context, engine.arch.vocab_size)

                def gen(n: int) -> None:
                    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                    outs = engine.generate(prompts, params)
                    if [len(o.token_ids) for o in outs] != [n] * b:
                        raise RuntimeError(f"asked for {n} tokens a row, got {[len(o.token_ids) for o in outs]}")

                emit("engine", b, **per_token(gen, args.repeats, sync))
            except Exception as e:  # noqa: BLE001 - a failing peer is a result
                emit("engine", b, error=error_text(e))
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the checkpoint directory")
    ap.add_argument("--batches", required=True, help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.5)
    ap.add_argument("--num-pages", type=int, help="KV pages (default: sized as the engine sizes them)")
    args = ap.parse_args()
    timed_engine(args)


if __name__ == "__main__":
    main()
