"""graphs.layout on the CPU: a recorded allocation sequence laid out in one block the way the CUDA
caching allocator lays it out (best fit, a split only when more than 1 MiB remains, merging on
free), and the fewest whole 2 MiB granules that hold it (the GPU side, against real captures:
tests/test_graph_memory_gpu.py)."""

from __future__ import annotations

from graphs.layout import GRANULE, SMALL_REQUEST, one_block_bytes, replay, rounded

MIB = 1 << 20


def _alloc(addr: int, mib: float) -> tuple[str, int, int]:
    return ("alloc", addr, int(mib * MIB))


def _free(addr: int) -> tuple[str, int, int]:
    return ("free", addr, 0)


def test_requests_round_to_512_bytes_and_small_ones_stay_out_of_the_block():
    assert rounded(1) == 512 and rounded(512) == 512 and rounded(513) == 1024
    small = [("alloc", i, SMALL_REQUEST) for i in range(40)]  # 40 MiB of requests of exactly 1 MiB
    assert one_block_bytes(small) == 0
    assert one_block_bytes([*small, _alloc(99, 3)]) == 4 * MIB  # 3 MiB, in whole granules


def test_a_freed_range_is_reused_and_neighbours_merge():
    # a and b free, then c takes their merged range: the block's high-water stays at a + b + d.
    events = [_alloc(1, 4), _alloc(2, 4), _alloc(3, 8), _free(1), _free(2), _alloc(4, 8)]
    assert replay(events, 1 << 40) == 16 * MIB
    assert one_block_bytes(events) == 16 * MIB


def test_best_fit_takes_the_smallest_free_range_that_fits_not_the_first():
    # Free ranges of 10 and 6 MiB (kept apart by live ones): a 5 MiB request takes the 6, so the
    # later 9 MiB request still fits the 10; first fit would have split the 10 and grown the block.
    events = [_alloc(1, 10), _alloc(2, 2), _alloc(3, 6), _alloc(4, 2), _free(1), _free(3),
              _alloc(5, 5), _alloc(6, 9)]
    assert replay(events, 1 << 40) == 20 * MIB


def test_a_remainder_of_at_most_one_mib_is_not_split_off():
    # 7.5 MiB in an 8 MiB block leaves 0.5 MiB: the request takes the whole block. In a 10 MiB block
    # 2.5 MiB would remain, so the block splits and the request ends at 7.5.
    assert replay([_alloc(1, 7.5)], 8 * MIB) == 8 * MIB
    assert replay([_alloc(1, 7.5)], 10 * MIB) == 7.5 * MIB
    # The split-off 2.5 serves a 2 MiB request whole (0.5 would remain): the block is full.
    assert replay([_alloc(1, 7.5), _alloc(2, 2)], 10 * MIB) == 10 * MIB


def test_the_block_is_more_than_the_live_peak_when_best_fit_fragments_it():
    # Live peak 12 MiB, but the 6 MiB request comes when the free space is two 3 MiB holes.
    events = [_alloc(1, 3), _alloc(2, 3), _alloc(3, 3), _alloc(4, 3), _free(1), _free(3), _alloc(5, 6)]
    assert one_block_bytes(events) == 18 * MIB
    assert replay(events, 16 * MIB) is None  # a block of the live peak alone leaves the request over


def test_too_short_a_block_is_reported_and_the_search_goes_up_in_granules():
    events = [_alloc(1, 7), _alloc(2, 7), _free(1), _alloc(3, 9)]
    assert replay(events, 22 * MIB) is None
    # 7 + 7 + 9 end to end; the 1 MiB left behind the 9 is not split off, so it takes all 10.
    assert replay(events, 24 * MIB) == 24 * MIB
    assert one_block_bytes(events) == 24 * MIB
    assert one_block_bytes(events) % GRANULE == 0


def test_frees_of_blocks_the_sequence_never_allocated_are_ignored():
    events = [_free(77), _alloc(1, 5), _free(1), _free(1 << 30), _alloc(2, 5)]
    assert one_block_bytes(events) == 6 * MIB
