"""Random decode batches over a KV cache full of random data, for graph-vs-eager comparisons."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from graphs.decode import LiveDecodeBatch
from tests.reference import OwnModel
from worker.attention.base import AttentionBatch


@dataclass
class RandomDecodeBatch:
    live: LiveDecodeBatch
    seq_lens: list[int]


def fill_cache_randomly(own: OwnModel, seed: int = 0) -> None:
    g = torch.Generator(device=own.cache.kv.device).manual_seed(seed)
    own.cache.kv.normal_(generator=g)


def random_decode_batch(own: OwnModel, rng: random.Random, size: int, max_context: int) -> RandomDecodeBatch:
    """``size`` rows with random context lengths on distinct random pages (page 0 excluded)."""
    ps = own.page_size
    seq_lens = [rng.randint(1, max_context) for _ in range(size)]
    need = sum(-(-s // ps) for s in seq_lens)
    pages = rng.sample(range(1, own.cache.num_pages), need)
    tables, at = [], 0
    for s in seq_lens:
        n = -(-s // ps)
        tables.append(pages[at:at + n])
        at += n
    device = own.cache.device
    ids = torch.tensor([rng.randrange(3, own.arch.vocab_size) for _ in range(size)], device=device)
    pos = torch.tensor([s - 1 for s in seq_lens], device=device)
    return RandomDecodeBatch(LiveDecodeBatch(ids, pos, AttentionBatch.decode(seq_lens, tables)), seq_lens)


def eager_logits(own: OwnModel, batch: RandomDecodeBatch) -> torch.Tensor:
    own.attention.plan(batch.live.attention)
    hidden = own.model(batch.live.input_ids, batch.live.positions, own.attention)
    return own.model.compute_logits(hidden)
