"""Request traces: a documented synthetic generator (fixed seed), files, and replay through an engine.

Replaying a trace records the live batch shapes in the engine's model runner, which is what
``graphfleet profile export`` writes and ``graphs.profile`` plans ladders from.

``skewed_trace``: a chat-like mix where most requests have short prompts around a few
popular lengths and a small tail is long, arriving a few per engine step, so decode batch
sizes settle around a handful of values instead of spreading over 1..256.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from worker.sampling.params import SamplingParams

if TYPE_CHECKING:
    from worker.engine import Engine


def skewed_trace(n: int = 400, seed: int = 0, max_prompt: int = 2048) -> list[dict]:
    """``n`` requests: 70% prompts near 90 tokens, 20% near 700, 10% uniform up to ``max_prompt``;
    output lengths 8..64; arrivals in bursts of 0..6 per step, in waves, so batch sizes cluster."""
    rng = random.Random(seed)
    trace, step = [], 0
    while len(trace) < n:
        burst = rng.choice([0, 0, 1, 2, 3, 6]) if (step // 40) % 2 == 0 else rng.choice([0, 0, 0, 1])
        for _ in range(burst):
            r = rng.random()
            if r < 0.7:
                prompt = max(1, int(rng.gauss(90, 12)))
            elif r < 0.9:
                prompt = max(1, int(rng.gauss(700, 60)))
            else:
                prompt = rng.randint(1, max_prompt)
            trace.append({"prompt_len": min(prompt, max_prompt), "max_tokens": rng.randint(8, 64),
                          "arrival_step": step})
        step += 1
    return trace[:n]


def load_trace(path: str | Path) -> list[dict]:
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append({"prompt_len": int(row["prompt_len"]), "max_tokens": int(row["max_tokens"]),
                         "arrival_step": int(row.get("arrival_step", 0))})
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: bad trace row ({e}); need prompt_len, max_tokens[, arrival_step]") from None
    return rows


def run_trace(engine: Engine, trace: list[dict], seed: int = 0) -> int:
    """Feed ``trace`` rows (prompt_len, max_tokens, arrival_step) to ``engine`` by step; returns steps run.

    Prompts are random token ids (seeded); generation ignores EOS so each request runs its
    ``max_tokens``, which makes the batch shapes a property of the trace, not of the weights.
    """
    rng = random.Random(seed)
    pending = sorted(trace, key=lambda r: r["arrival_step"])
    vocab = engine.arch.vocab_size
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0]["arrival_step"] <= step:
            row = pending.pop(0)
            n = min(row["prompt_len"], engine.max_model_len - row["max_tokens"] - 1)
            ids = [rng.randrange(3, vocab) for _ in range(max(1, n))]
            engine.add_request(ids, SamplingParams(max_tokens=row["max_tokens"], temperature=0, ignore_eos=True))
        engine.step()
        for rid in [r for r, req in engine.requests.items() if req.finished]:
            engine.release(rid)
        step += 1
    return step
