"""The chunk plan of a staging budget (chunking.py): every byte once, in order, within the
chunk size; tensors cut only when larger than a chunk."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt.staging.chunking import ALIGN, plan_chunks


def _check(sizes: list[int], chunk: int) -> None:
    chunks = plan_chunks(sizes, chunk)
    seen = [(p.index, p.start, p.stop) for c in chunks for p in c.pieces]
    # every byte of every tensor exactly once, in staging order
    expected_next = {}
    order = []
    for index, start, stop in seen:
        assert start == expected_next.get(index, 0), (index, start)
        assert stop >= start
        expected_next[index] = stop
        if not order or order[-1] != index:
            order.append(index)
    assert order == list(range(len(sizes)))
    assert [expected_next[i] for i in range(len(sizes))] == sizes
    for c in chunks:
        assert c.pieces and c.nbytes <= chunk
        end = 0
        for p in c.pieces:
            assert p.offset % ALIGN == 0 and p.offset >= end  # aligned, not overlapping
            end = p.offset + p.nbytes
        assert c.nbytes == end
    for i, size in enumerate(sizes):
        cut = [p for c in chunks for p in c.pieces if p.index == i]
        if size <= chunk:
            assert len(cut) == 1  # whole where it fits
        else:
            assert len(cut) == -(-size // chunk)  # whole chunks and one tail


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 5000), max_size=40),
    st.integers(1, 40).map(lambda n: n * ALIGN),
)
def test_every_byte_once_in_order_within_the_chunk_size(sizes, chunk):
    _check(sizes, chunk)


def test_a_tensor_larger_than_a_chunk_is_cut_into_slices_and_a_shared_tail():
    chunks = plan_chunks([100, 900, 10, 70], 256)
    assert [[(p.index, p.start, p.stop, p.offset) for p in c.pieces] for c in chunks] == [
        [(0, 0, 100, 0)],
        [(1, 0, 256, 0)],
        [(1, 256, 512, 0)],
        [(1, 512, 768, 0)],
        [(1, 768, 900, 0), (2, 0, 10, 192)],  # the tail's 132 bytes, then 10 at 192
        [(3, 0, 70, 0)],  # 70 bytes no longer fit after 202
    ]


def test_small_tensors_share_a_chunk_aligned():
    (only,) = plan_chunks([10, 10, 0, 10], 256)
    assert [(p.index, p.offset) for p in only.pieces] == [(0, 0), (1, 64), (2, 128), (3, 128)]
    assert only.nbytes == 138


@pytest.mark.parametrize("chunk", [0, -64, 100])
def test_a_chunk_size_that_is_no_positive_multiple_of_the_alignment_is_refused(chunk):
    with pytest.raises(ValueError, match="multiple"):
        plan_chunks([1], chunk)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(1, 96)), max_size=30),
    st.integers(2, 40).map(lambda n: n * ALIGN),
)
def test_with_quanta_a_tensor_is_cut_at_whole_rows_only(shapes, chunk):
    """``quanta`` (a row's bytes): the same plan properties, and every piece of a cut tensor
    starts and ends on a row, so each slice is a block of whole rows."""
    shapes = [(rows, row) for rows, row in shapes if row <= chunk]
    sizes = [rows * row for rows, row in shapes]
    quanta = [row for _, row in shapes]
    chunks = plan_chunks(sizes, chunk, quanta)
    seen: dict[int, int] = {}
    for c in chunks:
        assert c.nbytes <= chunk
        for p in c.pieces:
            assert p.start == seen.get(p.index, 0)
            seen[p.index] = p.stop
            assert p.start % quanta[p.index] == 0 and p.stop % quanta[p.index] == 0
    assert [seen.get(i, 0) for i in range(len(sizes))] == sizes


def test_a_row_larger_than_a_chunk_cannot_be_cut():
    with pytest.raises(ValueError, match="row"):
        plan_chunks([4 * 300], 256, [300])
