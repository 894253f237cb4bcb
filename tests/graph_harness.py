"""Random decode, prefill and mixed batches over a KV cache full of random data, for graph-vs-eager
comparisons, and reference padding: the padded batches a runner's plan must match, built as lists."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from graphs.decode import LiveDecodeBatch
from graphs.prefill import LivePrefillBatch
from tests.reference import OwnModel
from worker.attention.base import AttentionBatch
from worker.attention.factory import flashinfer_importable
from worker.kv_cache import PagedKVCache
from worker.model.kernels import select_kernels


@dataclass
class RandomDecodeBatch:
    live: LiveDecodeBatch
    seq_lens: list[int]


def gpu_own_model(checkpoint_dir, attention: str) -> OwnModel:
    """tiny-llama in bf16 on the GPU with ``attention`` ("torch" or "flashinfer": skipped when it is
    not installed) and a randomly filled 4,096-page cache, as the GPU graph tests use it."""
    if attention == "flashinfer" and not flashinfer_importable():
        pytest.skip("flashinfer not installed")
    own = OwnModel(checkpoint_dir("tiny-llama"), dtype=torch.bfloat16, device="cuda", backend=attention,
                   num_pages=4096, kernels=select_kernels(torch.device("cuda"), prefer_fused=attention == "flashinfer"),
                   max_rows=64, max_pages_per_row=256)
    fill_cache_randomly(own)
    return own


def fill_cache_randomly(own: OwnModel, seed: int = 0) -> None:
    g = torch.Generator(device=own.cache.kv.device).manual_seed(seed)
    own.cache.kv.normal_(generator=g)


def random_tables(own: OwnModel, rng: random.Random, seq_lens: list[int]) -> tuple[list[list[int]], list[int]]:
    """Page tables on distinct random pages (page 0, the dummy page, excluded), and all pages used."""
    ps = own.page_size
    pages = rng.sample(range(1, own.cache.num_pages), sum(-(-s // ps) for s in seq_lens))
    tables, at = [], 0
    for s in seq_lens:
        n = -(-s // ps)
        tables.append(pages[at:at + n])
        at += n
    return tables, pages


def random_decode_batch(own: OwnModel, rng: random.Random, size: int, max_context: int) -> RandomDecodeBatch:
    """``size`` rows with random context lengths on distinct random pages."""
    seq_lens = [rng.randint(1, max_context) for _ in range(size)]
    tables, _ = random_tables(own, rng, seq_lens)
    device = own.cache.device
    ids = torch.tensor([rng.randrange(3, own.arch.vocab_size) for _ in range(size)], device=device)
    pos = torch.tensor([s - 1 for s in seq_lens], device=device)
    return RandomDecodeBatch(LiveDecodeBatch(ids, pos, AttentionBatch.decode(seq_lens, tables)), seq_lens)


def eager_logits(own: OwnModel, batch: RandomDecodeBatch) -> torch.Tensor:
    own.attention.plan(batch.live.attention)
    hidden = own.model(batch.live.input_ids, batch.live.positions, own.attention)
    return own.model.compute_logits(hidden)


@dataclass
class RandomPrefillBatch:
    live: LivePrefillBatch
    pages: set[int]


def random_prefill_batch(own: OwnModel, rng: random.Random, requests: int, max_new: int,
                         max_prefix: int = 0) -> RandomPrefillBatch:
    """``requests`` rows each appending 1..max_new tokens after a cached prefix of 0..max_prefix."""
    prefix = [rng.randint(0, max_prefix) for _ in range(requests)]
    new = [rng.randint(1, max_new) for _ in range(requests)]
    seq_lens = [p + n for p, n in zip(prefix, new)]
    tables, pages = random_tables(own, rng, seq_lens)
    device = own.cache.device
    ids = torch.tensor([rng.randrange(3, own.arch.vocab_size) for _ in range(sum(new))], device=device)
    pos = torch.tensor([p + i for p, n in zip(prefix, new) for i in range(n)], device=device)
    attention = AttentionBatch.prefill(seq_lens, new, tables)
    last = torch.tensor(new, device=device).cumsum(0) - 1  # each request's last token: the sampled rows
    return RandomPrefillBatch(LivePrefillBatch(ids, pos, attention, requests, last), set(pages))


def random_mixed_batch(own: OwnModel, rng: random.Random, decodes: int, prefills: int,
                       max_context: int = 200, max_new: int = 90) -> LivePrefillBatch:
    """A mixed step as the prefill runner sees it: ``decodes`` one-token rows after a cached
    context of 1..max_context, then ``prefills`` chunks of 2..max_new tokens after a cached prefix
    (0 for a first chunk). The sampled rows are every decode row and the last token of each chunk
    that samples (about 60%; a middle chunk does not)."""
    new = [1] * decodes + [rng.randint(2, max_new) for _ in range(prefills)]
    prefix = [rng.randint(1, max_context) for _ in range(decodes)] + [rng.choice([0, rng.randint(1, 60)])
                                                                      for _ in range(prefills)]
    seq_lens = [p + n for p, n in zip(prefix, new)]
    tables, _ = random_tables(own, rng, seq_lens)
    device = own.cache.device
    ids = torch.tensor([rng.randrange(3, own.arch.vocab_size) for _ in range(sum(new))], device=device)
    pos = torch.tensor([p + i for p, n in zip(prefix, new) for i in range(n)], device=device)
    ends = torch.tensor(new, device=device).cumsum(0) - 1
    samples = [True] * decodes + [rng.random() < 0.6 for _ in range(prefills)]
    rows = ends[torch.tensor(samples, device=device)]
    return LivePrefillBatch(ids, pos, AttentionBatch.prefill(seq_lens, new, tables), len(new), rows)


def eager_hidden(own: OwnModel, live: LivePrefillBatch) -> torch.Tensor:
    """The eager forward's final hidden states of ``live.rows`` (what the prefill runner returns)."""
    own.attention.plan(live.attention)
    return own.model(live.input_ids, live.positions, own.attention).index_select(0, live.rows)


def pad_decode_batch(batch: AttentionBatch, rows: int) -> AttentionBatch:
    """``batch`` plus padding rows (length 1, dummy page) up to ``rows``."""
    pad = rows - batch.num_rows
    if pad < 0:
        raise ValueError(f"cannot pad a batch of {batch.num_rows} rows to {rows}")
    dummy = [PagedKVCache.DUMMY_PAGE]
    return AttentionBatch(False, batch.seq_lens + [1] * pad, batch.query_lens + [1] * pad,
                          batch.page_tables.tolist() + [dummy] * pad, rows)


def pad_prefill_batch(batch: AttentionBatch, tokens: int, slots: int) -> AttentionBatch:
    """``batch`` in ``slots`` rows and ``tokens`` tokens: unused rows are zero-length sentinels.

    Sentinel rows have sequence and query length 0 and no pages, so their offsets sit after the
    real tokens and they read and write nothing; tokens past the real ones are tail padding
    whose KV goes to the dummy page.
    """
    pad = slots - batch.num_rows
    if pad < 0:
        raise ValueError(f"{batch.num_rows} requests do not fit {slots} request slots")
    if tokens < batch.num_tokens:
        raise ValueError(f"cannot pad {batch.num_tokens} tokens down to {tokens}")
    return AttentionBatch(True, batch.seq_lens + [0] * pad, batch.query_lens + [0] * pad,
                          batch.page_tables.tolist() + [[] for _ in range(pad)], tokens)
