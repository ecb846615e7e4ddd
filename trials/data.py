"""Deterministic, learnable synthetic token data, and the one place batches are laid out.

Each sequence is an arithmetic progression modulo a small alphabet (``start + stride * t``), with
``start`` and ``stride`` drawn from a generator seeded by (seed, step). The next token is a
function of the previous two, so a causal LM's loss falls within a few steps, and every trial
with the same seed sees exactly the same tokens in the same order.

Two kinds of data. By default every sequence is ``seq_len`` tokens: rows are full, there is no
padding. With ``Documents`` (``autotune run --documents MIN:MAX``) each sequence is a document
of MIN to MAX tokens (uniform, seeded), as in fine-tuning data; a micro-batch's documents are
then laid out either one per row, right-padded to the longest (the pads' labels skipped, so
padding costs memory and time but trains nothing and is not counted in tokens/s), or packed
(``trials.techniques.packing``): as few rows of ``seq_len`` as hold them whole (best-fit
decreasing), each document with its own positions, which transformers turns into a
block-causal mask. A step trains on the same documents either way, and its loss is the mean
over the same target tokens: packing is exact.

With a user's dataset (``autotune run --data``, ``DatasetDocuments``) the documents are its own,
in the order the controller chose (``autotune.data_source``: the longest in the last warm-up
step), and their tokens come from the file it wrote (``trials.user_data``); the layout is the
same.

``layout`` (token counts only) is what the estimator reads; ``step_batches`` (tensors) is what
the job trains on; both come from the same functions here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Tokens are drawn from the first ``LEARNABLE_ALPHABET`` ids, so even a few steps move the loss
#: visibly (from ln(vocab) towards ln(alphabet) and below) and lossy techniques show their cost.
LEARNABLE_ALPHABET = 256
IGNORE_INDEX = -100  # transformers' and PyTorch's label to skip
PAD_ID = 0


@dataclass(frozen=True)
class Documents:
    """Variable-length documents of ``shortest`` to ``longest`` tokens (each at most the
    sequence length: a longer one is cut, as a tokenizer's ``max_length`` would). ``seed`` and
    ``steps``: the trial's draw of them whose memory is measured (the estimator lays out the
    same micro-batches: ``trials.spec.trial_documents``)."""

    shortest: int
    longest: int
    seed: int = 0
    steps: int = 8  # warm-up and measured steps (a study's defaults: 2 + 6)

    @classmethod
    def parse(cls, text: str) -> Documents:
        """``MIN:MAX`` (tokens), e.g. ``32:256``."""
        parts = text.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"documents '{text}': expected MIN:MAX tokens, e.g. 32:256")
        lo, hi = int(parts[0]), int(parts[1])
        if not 2 <= lo <= hi:
            raise ValueError(f"documents '{text}': need 2 <= MIN <= MAX")
        return cls(lo, hi)

    @classmethod
    def of(cls, value: Any, seed: int = 0, steps: int = 8) -> Documents | None:
        """From a spec's or study's stored ``[MIN, MAX]`` (None: fixed-length data)."""
        return cls(int(value[0]), int(value[1]), seed, steps) if value else None

    def stored(self) -> list[int]:
        return [self.shortest, self.longest]

    def __str__(self) -> str:
        return f"{self.shortest}:{self.longest}"

    def lengths_of(self, step: int, count: int, seq_len: int, seed: int) -> list[int]:
        """The lengths of step ``step``'s ``count`` documents (all ranks'), each at most
        ``seq_len``; drawn from their own generator, so the estimator reads them without
        tokens."""
        import torch

        gen = _generator(seed + 7_919, step)
        lengths = torch.randint(self.shortest, self.longest + 1, (count,), generator=gen)
        return [min(int(n), seq_len) for n in lengths]

    def document(
        self, step: int, index: int, count: int, length: int, vocab: int, seed: int
    ) -> torch.Tensor:
        """The tokens of document ``index`` (of ``count``) of step ``step``."""
        return _document(step, index, length, vocab, seed)

    def timed_steps(self) -> range:
        """The steps whose mean micro-batch the estimator times (all those it lays out)."""
        return range(self.steps)


@dataclass(frozen=True)
class DatasetDocuments(Documents):
    """A user's dataset (``autotune run --data``): ``order`` holds the token length of each
    document a trial trains on, step after step (``count`` a step, all ranks'), in the fixed
    order the controller chose (``autotune.data_source``); ``timed``: the measured steps
    (first, how many), whose mean micro-batch the estimator times, while the memory is that of
    the largest micro-batch of the ``steps`` tracked ones. ``store``: the documents' tokens,
    in a job (``trials.user_data``); the estimator reads the lengths only."""

    order: tuple[int, ...] = ()
    timed: tuple[int, int] = (0, 0)
    store: Any = field(default=None, compare=False, repr=False)

    def lengths_of(self, step: int, count: int, seq_len: int, seed: int) -> list[int]:
        n = len(self.order)
        return [min(self.order[(step * count + i) % n], seq_len) for i in range(count)]

    def document(
        self, step: int, index: int, count: int, length: int, vocab: int, seed: int
    ) -> torch.Tensor:
        if self.store is None:
            raise RuntimeError("the dataset's tokens were not loaded (trials.user_data)")
        return self.store.document((step * count + index) % len(self.order))[:length]

    def timed_steps(self) -> range:
        return range(self.timed[0], self.timed[0] + self.timed[1])


def _generator(seed: int, step: int) -> torch.Generator:
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def batch_for_step(
    step: int, batch_size: int, seq_len: int, vocab_size: int, seed: int
) -> torch.Tensor:
    """``batch_size`` sequences of ``seq_len`` tokens for step ``step``."""
    import torch

    gen = _generator(seed, step)
    alphabet = min(vocab_size, LEARNABLE_ALPHABET)
    max_stride = max(2, min(16, alphabet // 4))
    start = torch.randint(0, alphabet, (batch_size, 1), generator=gen)
    stride = torch.randint(1, max_stride, (batch_size, 1), generator=gen)
    positions = torch.arange(seq_len).unsqueeze(0)
    return (start + stride * positions) % alphabet


def document_lengths(
    step: int, count: int, documents: Documents, seq_len: int, seed: int
) -> list[int]:
    """The lengths of step ``step``'s ``count`` documents (all ranks'), each at most
    ``seq_len`` (``Documents.lengths_of``)."""
    return documents.lengths_of(step, count, seq_len, seed)


# --- layout: which documents share a row --------------------------------------------------------

#: a micro-batch's rows, each the lengths of the documents in it, in order
Rows = list[list[int]]


def pack(lengths: list[int], capacity: int) -> Rows:
    """Best-fit decreasing: each document, longest first, into the fullest row it still fits
    (a new row when none does); documents are never split, so each keeps its whole context."""
    rows: Rows = []
    room: list[int] = []
    for n in sorted(lengths, reverse=True):
        fits = [i for i, r in enumerate(room) if r >= n]
        if fits:
            best = min(fits, key=lambda i: room[i])
            rows[best].append(n)
            room[best] -= n
        else:
            rows.append([n])
            room.append(capacity - n)
    return rows


def rows_of(lengths: list[int], seq_len: int, packed: bool) -> Rows:
    """A micro-batch's documents one per row (padded), or packed into rows of ``seq_len``."""
    return pack(lengths, seq_len) if packed else [[n] for n in lengths]


@dataclass(frozen=True)
class Shape:
    """A micro-batch as the model sees it: ``rows`` x ``length`` positions (``length``: the
    longest row; shorter rows padded to it), ``tokens`` of them real, ``targets`` of them with a
    label the loss counts (a document's first token predicts nothing: its label is skipped)."""

    rows: int
    length: int
    tokens: int
    targets: int

    @property
    def positions(self) -> int:
        return self.rows * self.length


def shape_of(rows: Rows) -> Shape:
    tokens = sum(sum(r) for r in rows)
    documents = sum(len(r) for r in rows)
    return Shape(len(rows), max(sum(r) for r in rows), tokens, tokens - documents)


def micro_lengths(
    step: int,
    micro: int,
    accumulation: int,
    seq_len: int,
    documents: Documents,
    seed: int,
    rank: int = 0,
    world: int = 1,
) -> list[list[int]]:
    """Rank ``rank``'s documents of step ``step``, micro-batch by micro-batch: the same
    documents, split across ranks, whatever the world size."""
    per_rank = micro * accumulation
    lengths = document_lengths(step, per_rank * world, documents, seq_len, seed)
    mine = lengths[rank * per_rank : (rank + 1) * per_rank]
    return [mine[i * micro : (i + 1) * micro] for i in range(accumulation)]


def layout(
    steps: int,
    micro: int,
    accumulation: int,
    seq_len: int,
    documents: Documents | None,
    packed: bool,
    seed: int,
    world: int = 1,
    first: int = 0,
) -> list[Shape]:
    """Every micro-batch's shape over steps ``first`` to ``steps`` on every rank (what a
    trial trains on)."""
    if documents is None:
        full = Shape(micro, seq_len, micro * seq_len, micro * (seq_len - 1))
        return [full] * ((steps - first) * accumulation * world)
    return [
        shape_of(rows_of(lengths, seq_len, packed))
        for step in range(first, steps)
        for rank in range(world)
        for lengths in micro_lengths(
            step, micro, accumulation, seq_len, documents, seed, rank, world
        )
    ]


def largest(shapes: list[Shape]) -> Shape:
    """The micro-batch that needs the most memory: the most positions, then the longest rows
    (the s x s attention terms)."""
    return max(shapes, key=lambda s: (s.positions, s.length))


def typical(shapes: list[Shape]) -> Shape:
    """A micro-batch of the mean size (for the step time): mean positions in rows of the mean
    length, mean real tokens and targets."""
    n = len(shapes)
    length = max(1, round(sum(s.length for s in shapes) / n))
    positions = sum(s.positions for s in shapes) / n
    return Shape(
        max(1, round(positions / length)),
        length,
        round(sum(s.tokens for s in shapes) / n),
        round(sum(s.targets for s in shapes) / n),
    )


def micro_shapes(
    config: Any, seq_len: int, global_batch_size: int, documents: Documents | None, world: int = 1
) -> tuple[Shape, Shape]:
    """(the largest, a typical) micro-batch of a trial of ``config``: what the estimator
    counts for the memory (over the tracked steps) and for the step time (over the timed
    ones: ``Documents.timed_steps``)."""
    from trials.techniques.micro_batch import micro_and_accumulation
    from trials.techniques.packing import packs

    micro, accum = micro_and_accumulation(config, global_batch_size, strict=False)
    if documents is None:
        full = Shape(micro, seq_len, micro * seq_len, micro * (seq_len - 1))
        return full, full
    packed, seed = packs(config), documents.seed
    shapes = layout(documents.steps, micro, accum, seq_len, documents, packed, seed, world)
    timed = documents.timed_steps()
    if timed != range(documents.steps):
        return largest(shapes), typical(
            layout(timed.stop, micro, accum, seq_len, documents, packed, seed, world, timed.start)
        )
    return largest(shapes), typical(shapes)


# --- batches: the tensors a step trains on -------------------------------------------------------


@dataclass
class Batch:
    """One micro-batch. ``share``: this micro-batch's part of the step's loss, the fraction its
    mean loss is multiplied by before backward so that the gradients summed over micro-batches
    and averaged over ranks are those of the mean over every target token of the step (1/N of
    the micro-batches when they are equal, as with fixed-length data)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None
    shape: Shape
    share: Fraction

    def to(self, device: Any) -> Batch:
        pos = None if self.position_ids is None else self.position_ids.to(device)
        return Batch(self.input_ids.to(device), self.labels.to(device), pos, self.shape, self.share)

    def inputs(self) -> dict[str, torch.Tensor]:
        """The model's keyword arguments (positions only when packed)."""
        kwargs = {"input_ids": self.input_ids, "labels": self.labels}
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids
        return kwargs

    def scaled(self, loss: torch.Tensor, by: int = 1) -> torch.Tensor:
        """``loss`` x ``share`` x ``by`` (an engine that divides by the accumulation itself
        passes it): an integer product over an integer, exact when the share is 1/N."""
        share = self.share * by
        if share == 1:
            return loss
        if share.numerator == 1:
            return loss / share.denominator
        return loss * share.numerator / share.denominator


def _document(step: int, index: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Document ``index`` of step ``step``: a progression as ``batch_for_step``'s rows."""
    import torch

    gen = _generator(seed + 104_729 * (index + 1), step)
    alphabet = min(vocab, LEARNABLE_ALPHABET)
    max_stride = max(2, min(16, alphabet // 4))
    start = int(torch.randint(0, alphabet, (1,), generator=gen))
    stride = int(torch.randint(1, max_stride, (1,), generator=gen))
    return (start + stride * torch.arange(length)) % alphabet


def _row_tensors(
    row: list[tuple[int, torch.Tensor]], length: int, packed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, positions) of one row: its documents in order, then padding."""
    import torch

    ids = torch.full((length,), PAD_ID, dtype=torch.long)
    labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros(length, dtype=torch.long)
    at = 0
    for _, doc in row:
        n = len(doc)
        ids[at : at + n] = doc
        labels[at : at + n] = doc
        labels[at] = IGNORE_INDEX  # a document's first token follows nothing of its own
        positions[at : at + n] = torch.arange(n)
        at += n
    if packed:  # the padding as one more segment of its own (its labels skipped)
        positions[at:] = torch.arange(length - at)
    else:
        positions[at:] = torch.arange(at, length)
    return ids, labels, positions


def step_batches(
    step: int,
    micro: int,
    accumulation: int,
    seq_len: int,
    vocab: int,
    seed: int,
    documents: Documents | None,
    packed: bool,
    rank: int = 0,
    world: int = 1,
) -> list[Batch]:
    """Rank ``rank``'s micro-batches of step ``step``."""
    import torch

    if documents is None:
        tokens = batch_for_step(step, micro * accumulation * world, seq_len, vocab, seed)
        mine = tokens[rank * micro * accumulation : (rank + 1) * micro * accumulation]
        full = Shape(micro, seq_len, micro * seq_len, micro * (seq_len - 1))
        return [
            Batch(ids, ids, None, full, Fraction(1, accumulation))
            for ids in (mine[i * micro : (i + 1) * micro] for i in range(accumulation))
        ]
    everyone = [
        micro_lengths(step, micro, accumulation, seq_len, documents, seed, r, world)
        for r in range(world)
    ]
    step_targets = sum(n - 1 for per_rank in everyone for lengths in per_rank for n in lengths)
    batches = []
    index = rank * micro * accumulation
    count = micro * accumulation * world
    for lengths in everyone[rank]:
        docs = []
        for n in lengths:
            docs.append((n, documents.document(step, index, count, n, vocab, seed)))
            index += 1
        # lay out as ``rows_of`` does, each length taking its own document
        waiting = list(docs)
        rows: list[list[tuple[int, torch.Tensor]]] = []
        for row in rows_of(lengths, seq_len, packed):
            picked = []
            for n in row:
                i = next(j for j, (m, _) in enumerate(waiting) if m == n)
                picked.append(waiting.pop(i))
            rows.append(picked)
        shape = shape_of([[n for n, _ in r] for r in rows])
        parts = [_row_tensors(r, shape.length, packed) for r in rows]
        ids, labels, positions = (torch.stack(t) for t in zip(*parts, strict=True))
        batches.append(
            Batch(
                ids,
                labels,
                positions if packed else None,
                shape,
                Fraction(shape.targets * world, step_targets),
            )
        )
    return batches
