"""The one batch arithmetic (``trials/data.py``) against hand counts: the data each step draws,
the shapes the estimator reads, the loss shares the engines multiply by, the ``--documents``
syntax. Every expected number here is written out by hand, not computed by the module."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch

from trials.data import (
    IGNORE_INDEX,
    LEARNABLE_ALPHABET,
    Batch,
    Documents,
    Shape,
    batch_for_step,
    document_lengths,
    layout,
    micro_lengths,
    micro_shapes,
    step_batches,
    typical,
)


def test_fixed_length_rows_are_full() -> None:
    full = Shape(rows=4, length=64, tokens=256, targets=252)  # 4 x 64, 63 targets a row
    assert micro_shapes({"micro_batch_size": 4}, 64, 8, None) == (full, full)
    assert micro_shapes({}, 64, 8, None)[0] == Shape(8, 64, 512, 504)  # the whole batch
    shapes = layout(3, 4, 2, 64, None, False, seed=0, world=2)
    assert shapes == [full] * 12  # 3 steps x 2 micro-batches x 2 ranks


def test_fixed_length_batches_split_the_step() -> None:
    tokens = batch_for_step(5, 8, 16, 300, 1)
    batches = step_batches(5, 2, 2, 16, 300, 1, None, packed=False, rank=1, world=2)
    assert [b.input_ids.tolist() for b in batches] == [tokens[4:6].tolist(), tokens[6:8].tolist()]
    for b in batches:
        assert b.labels is b.input_ids and b.position_ids is None
        assert b.share == Fraction(1, 2)
        assert b.shape == Shape(2, 16, 32, 30)


def test_the_synthetic_rows_are_progressions() -> None:
    tokens = batch_for_step(0, 6, 20, 100_000, 7)
    assert tokens.shape == (6, 20)
    assert int(tokens.max()) < LEARNABLE_ALPHABET
    steps = (tokens[:, 1:] - tokens[:, :-1]) % LEARNABLE_ALPHABET
    assert all(len(set(row.tolist())) == 1 for row in steps)  # one stride a row
    assert all(1 <= int(row[0]) < 16 for row in steps)
    assert torch.equal(tokens, batch_for_step(0, 6, 20, 100_000, 7))
    assert not torch.equal(tokens, batch_for_step(1, 6, 20, 100_000, 7))
    small = batch_for_step(0, 6, 20, 10, 7)  # a vocabulary under the alphabet bounds the ids
    assert int(small.max()) < 10


def _strides_and_starts(rows: list[list[int]], alphabet: int) -> tuple[set[int], set[int]]:
    return {(r[1] - r[0]) % alphabet for r in rows}, {r[0] for r in rows}


@pytest.mark.parametrize(
    "vocab,strides",
    [
        (100_000, set(range(1, 16))),  # alphabet 256: strides 1 to 15
        (40, set(range(1, 10))),  # alphabet 40: strides below 40 // 4 = 10
        (8, {1}),  # alphabet 8: below max(2, 8 // 4) = 2
    ],
)
def test_strides_and_starts_cover_their_ranges(vocab: int, strides: set[int]) -> None:
    alphabet = min(vocab, LEARNABLE_ALPHABET)
    rows = batch_for_step(0, 2000, 3, vocab, 0).tolist()
    seen, starts = _strides_and_starts(rows, alphabet)
    assert seen == strides and starts == set(range(alphabet))
    docs = [
        b.input_ids[r].tolist()
        for step in range(40)
        for b in step_batches(step, 50, 1, 4, vocab, 0, Documents(4, 4), packed=False)
        for r in range(b.input_ids.size(0))
    ]
    for doc in docs:  # each document a progression within the alphabet
        assert len({(b - a) % alphabet for a, b in itertools.pairwise(doc)}) == 1
        assert max(doc) < alphabet
    seen, starts = _strides_and_starts(docs, alphabet)
    assert seen == strides and starts == set(range(alphabet))


def test_document_lengths_are_drawn_within_the_range() -> None:
    docs = Documents(5, 40)
    lengths = document_lengths(3, 200, docs, 64, seed=2)
    assert len(lengths) == 200 and min(lengths) == 5 and max(lengths) == 40
    assert len(set(lengths)) > 20  # drawn, not constant
    assert lengths == document_lengths(3, 200, docs, 64, seed=2)
    assert lengths != document_lengths(4, 200, docs, 64, seed=2)
    assert lengths != document_lengths(3, 200, docs, 64, seed=3)
    cut = document_lengths(3, 200, docs, 16, seed=2)  # longer than the sequence: cut to it
    assert cut == [min(n, 16) for n in lengths]


def test_each_rank_takes_its_share_of_the_step() -> None:
    docs = Documents(3, 30)
    drawn = document_lengths(2, 12, docs, 32, seed=0)  # 2 ranks x 3 micro-batches x 2
    assert micro_lengths(2, 2, 3, 32, docs, 0, rank=0, world=2) == [
        drawn[0:2],
        drawn[2:4],
        drawn[4:6],
    ]
    assert micro_lengths(2, 2, 3, 32, docs, 0, rank=1, world=2) == [
        drawn[6:8],
        drawn[8:10],
        drawn[10:12],
    ]
    assert (
        micro_lengths(2, 2, 3, 32, docs, 0)
        == [  # one rank by default: all of it
            drawn[0:2][:0] + document_lengths(2, 6, docs, 32, seed=0)[i : i + 2] for i in (0, 2, 4)
        ]
    )
    assert layout(2, 2, 3, 32, docs, False, seed=0) == layout(2, 2, 3, 32, docs, False, 0, 1)
    shapes = layout(1, 2, 3, 32, docs, False, seed=0, world=2)  # step 0's
    drawn = document_lengths(0, 12, docs, 32, seed=0)
    assert len(shapes) == 6
    assert [s.tokens for s in shapes] == [sum(drawn[i : i + 2]) for i in range(0, 12, 2)]
    assert [s.length for s in shapes] == [max(drawn[i : i + 2]) for i in range(0, 12, 2)]
    assert all(s.rows == 2 for s in shapes)


def test_the_estimator_s_micro_batches_are_the_trial_s() -> None:
    """The shapes ``micro_shapes`` lays out are those of the tensors ``step_batches`` makes,
    over the documents' steps and both ranks, padded and packed."""
    docs = Documents(4, 64, seed=5, steps=3)  # seed 5: rank 1 holds the largest micro-batch
    biggest = {}
    for packed in (False, True):
        config = {"micro_batch_size": 4, "packing": packed}
        made = [
            b.shape
            for step in range(3)
            for rank in range(2)
            for b in step_batches(step, 4, 2, 96, 256, 5, docs, packed, rank, 2)
        ]
        assert made == layout(3, 4, 2, 96, docs, packed, seed=5, world=2)
        biggest[packed] = max(made, key=lambda s: (s.rows * s.length, s.length))
        assert micro_shapes(config, 96, 8, docs, world=2)[0] == biggest[packed]
        alone = micro_shapes(config, 96, 8, docs)[0]  # one rank by default
        assert alone == micro_shapes(config, 96, 8, docs, world=1)[0] != biggest[packed]
        for step in range(3):
            for b in step_batches(step, 4, 2, 96, 256, 5, docs, packed):
                assert tuple(b.input_ids.shape) == (b.shape.rows, b.shape.length)
                assert int((b.labels != IGNORE_INDEX).sum()) == b.shape.targets
                if packed:
                    assert b.position_ids is not None and b.position_ids.dtype == torch.long
                    for r in range(b.shape.rows):  # the padding restarts its positions
                        skipped = (b.labels[r] == IGNORE_INDEX).flip(0).cumprod(0)
                        used = b.shape.length - int(skipped.sum())
                        if used < b.shape.length:
                            assert int(b.position_ids[r, used]) == 0
                else:
                    assert b.position_ids is None
    # packed rows are as long as their fullest: here 3 x 95 positions against 4 x 63 padded
    assert biggest[True] == Shape(3, 95, 220, 216) and biggest[False] == Shape(4, 63, 220, 216)
    # a micro-batch that does not divide the batch: the estimator's what-if, not an error
    assert micro_shapes({"micro_batch_size": 3}, 64, 8, None)[0] == Shape(3, 64, 192, 189)


def test_a_typical_micro_batch_by_hand() -> None:
    shapes = [Shape(2, 10, 15, 13), Shape(4, 20, 70, 66)]
    # mean length 15; mean positions (20 + 80) / 2 = 50 -> 50 / 15 = 3.3 rows; tokens 42.5
    # and targets 39.5 rounded to even
    assert typical(shapes) == Shape(3, 15, 42, 40)
    assert typical([Shape(1, 1, 1, 0)]) == Shape(1, 1, 1, 0)


def test_the_loss_share_by_hand() -> None:
    loss = torch.tensor(8.0)
    ids = torch.zeros(1, 4, dtype=torch.long)

    def batch(share: Fraction) -> Batch:
        return Batch(ids, ids, None, Shape(1, 4, 4, 3), share)

    assert batch(Fraction(1, 4)).scaled(loss).item() == 2.0
    assert batch(Fraction(3, 8)).scaled(loss).item() == 3.0
    assert batch(Fraction(1, 4)).scaled(loss, by=4) is loss  # an engine dividing by 4 itself
    assert batch(Fraction(3, 8)).scaled(loss, by=4).item() == 12.0
    assert batch(Fraction(1, 1)).scaled(loss) is loss


def test_a_batch_moves_with_its_positions() -> None:
    ids = torch.arange(6).view(2, 3)
    packed = Batch(ids, ids + 1, ids + 2, Shape(2, 3, 6, 4), Fraction(1, 2)).to("cpu")
    assert packed.inputs().keys() == {"input_ids", "labels", "position_ids"}
    assert torch.equal(packed.inputs()["position_ids"], ids + 2)
    assert torch.equal(packed.input_ids, ids) and torch.equal(packed.labels, ids + 1)
    assert packed.shape == Shape(2, 3, 6, 4)
    assert packed.share == Fraction(1, 2)
    padded = Batch(ids, ids, None, Shape(2, 3, 6, 4), Fraction(1)).to("cpu")
    assert padded.position_ids is None and padded.inputs().keys() == {"input_ids", "labels"}


def test_documents_syntax() -> None:
    assert Documents.parse("8:64") == Documents(8, 64)
    assert Documents.parse(" 2 : 2 ") == Documents(2, 2)
    for bad in ("8-64", "8:", ":64", "a:b", "1:64", "64:8", "8:64:128", "-8:64", "8.5:64"):
        with pytest.raises(ValueError, match="documents"):
            Documents.parse(bad)
    assert str(Documents(8, 64)) == "8:64" and Documents(8, 64).stored() == [8, 64]
    assert Documents.of(None) is None and Documents.of([]) is None
    assert Documents.of([8, 64], 3, 5) == Documents(8, 64, seed=3, steps=5)
    assert Documents.of([8, 64]) == Documents(8, 64, seed=0, steps=8)
