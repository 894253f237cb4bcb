"""Tiny checkpoints briefly trained on the bundled corpus, for greedy comparisons in bf16.

Random-weight models predict nearly uniformly: the top-2 logit gap of ~1000 random logits is
about a quarter of their spread, and two correct bf16 implementations (HF's and ours round
differently) disagree by about 1% of it, so greedy tokens flip between them at a few percent
of positions. Trained language models are decisive: :mod:`worker.checkpoint.train` trains them
(HF transformers, fp32) and ``make run`` serves one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from worker.checkpoint.train import corpus_ids, train_checkpoint

__all__ = ["corpus_ids", "corpus_prompts", "train_checkpoint"]


def corpus_prompts(model_dir: Path, lengths: list[int], seed: int) -> list[list[int]]:
    """Windows of the corpus of the given lengths, at seeded random offsets."""
    ids = corpus_ids(model_dir)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - max(lengths) - 1, (len(lengths),), generator=g).tolist()
    return [ids[s:s + n] for s, n in zip(starts, lengths)]
