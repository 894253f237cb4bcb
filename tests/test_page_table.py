"""Page tables in numpy: a request's growable table, a step's CSR rows, and the attention metadata
built from them with array arithmetic, against plain per-token loops."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from worker.attention.base import AttentionBatch, kv_write_locations
from worker.attention.flashinfer_metadata import build_metadata
from worker.kv_cache import PagedKVCache
from worker.page_table import PageRows, PageTable

PAGE = 16


def reference_metadata(batch: AttentionBatch, rows: list[list[int]], page_size: int, num_tokens: int):
    """The loops the array code replaced: flashinfer's CSR metadata and every token's KV location."""
    qo, kv, last, indices, locations = [0], [0], [], [], []
    for seq_len, q_len, pages in zip(batch.seq_lens, batch.query_lens, rows):
        n = -(-seq_len // page_size)
        indices.extend(pages[:n])
        qo.append(qo[-1] + q_len)
        kv.append(kv[-1] + n)
        last.append(seq_len - (n - 1) * page_size if n else 0)
        for pos in range(seq_len - q_len, seq_len):
            locations.append(pages[pos // page_size] * page_size + pos % page_size)
    locations.extend([PagedKVCache.DUMMY_PAGE * page_size] * (num_tokens - len(locations)))
    return qo, kv, last, indices, locations


def random_batch(rng: random.Random, is_prefill: bool) -> tuple[AttentionBatch, list[list[int]]]:
    seq_lens, query_lens, rows = [], [], []
    for _ in range(rng.randint(1, 12)):
        if is_prefill and rng.random() < 0.2:  # a sentinel slot
            seq_lens.append(0)
            query_lens.append(0)
            rows.append([])
            continue
        seq = rng.randint(1, 200)
        q = rng.randint(1, seq) if is_prefill else 1
        extra = rng.choice([0, 0, 1, 3])  # pages held past seq_len (allocated ahead) are allowed
        rows.append([rng.randrange(1, 5000) for _ in range(-(-seq // PAGE) + extra)])
        seq_lens.append(seq)
        query_lens.append(q)
    tokens = sum(query_lens) + (rng.randint(0, 9) if is_prefill else 0)
    return AttentionBatch(is_prefill, seq_lens, query_lens, rows, tokens), rows


@pytest.mark.parametrize("is_prefill", [False, True])
def test_array_metadata_equals_the_per_token_loops(is_prefill):
    rng = random.Random(7 + is_prefill)
    for _ in range(200):
        batch, rows = random_batch(rng, is_prefill)
        got = build_metadata(batch, PAGE)
        want = reference_metadata(batch, rows, PAGE, batch.num_tokens)
        assert [a.tolist() for a in got] == list(want)
        assert kv_write_locations(batch, PAGE, batch.num_tokens + 5).tolist() == want[4] + [0] * 5


def test_rows_of_zero_and_two_tokens_are_not_taken_for_decode_rows():
    batch = AttentionBatch(True, [5, 18], [0, 2], [[3], [4, 6]], 2)
    assert kv_write_locations(batch, PAGE).tolist() == [6 * PAGE + 0, 6 * PAGE + 1]


def test_a_short_page_table_or_a_bad_query_length_is_named():
    with pytest.raises(ValueError, match="row 1: seq_len=33 needs 3 pages, page table has 2"):
        build_metadata(AttentionBatch.decode([5, 33], [[4], [5, 6]]), PAGE)
    with pytest.raises(ValueError, match="row 0: seq_len=33 needs 3 pages"):
        kv_write_locations(AttentionBatch.decode([33], [[5, 6]]), PAGE)
    with pytest.raises(ValueError, match=r"row 0: query_len=4 must be in \[0, seq_len=3\]"):
        build_metadata(AttentionBatch(True, [3], [4], [[1]], 4), PAGE)


def test_a_request_table_grows_and_reads_as_a_list_of_ints():
    table = PageTable([3, 9])
    for n in range(40):
        table.extend([100 + n, 200 + n])
    assert len(table) == 82 and table[:3] == [3, 9, 100] and table[-1] == 239
    assert table == [3, 9] + [x for n in range(40) for x in (100 + n, 200 + n)]
    assert all(type(p) is int for p in table) and type(table[0]) is int
    assert set(PageTable([5, 6])) == {5, 6}
    with pytest.raises(IndexError):
        table[82]
    with pytest.raises(ValueError, match="page ids must be ints"):
        table.extend(["seven"])


def test_a_steps_rows_are_a_copy_of_the_requests_tables():
    """A request preempted (its table replaced) or grown while a step planned from its pages is in
    flight does not change that step's rows."""
    a, b = PageTable([1, 2]), PageTable([7])
    rows = PageRows.gather([a, b, [], np.array([4, 5], dtype=np.int64)])
    a.extend([3])
    a.view()[0] = 99  # a buffer reused in place
    assert rows.tolist() == [[1, 2], [7], [], [4, 5]]
    assert rows.lengths().tolist() == [2, 1, 0, 2] and rows[-1].tolist() == [4, 5]
    assert [r.tolist() for r in rows] == rows.tolist() and len(rows) == 4
    back = pickle.loads(pickle.dumps(rows))
    assert back == rows and back.indices.dtype == np.int32
    with pytest.raises(ValueError, match="indptr must rise from 0"):
        PageRows(np.array([1, 2], dtype=np.int32), np.array([0, 3]))

