"""Deferred data-dependent checks and packed rows (``cu_seqlens``) of a multimodal batch.

:class:`Check` holds a 0-d bool tensor and the message of its failure, so that validation reads the host once
for all checks of a call (or never, with ``validate=False``). :class:`Samples` describes the samples packed into
the rows of a ``(B, S)`` batch from flash-attention style cumulative lengths: every token's sample (one
``searchsorted`` of the token index into the boundaries) and its sample's first token, so that running
positions restart at every boundary without a loop over samples (:func:`packed_samples`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

__all__ = ["Check", "Samples", "packed_samples", "CU_SEQLENS_FORMS"]


@dataclass
class Check:
    """A deferred data-dependent validity check: ``bad`` is a 0-d bool tensor, ``message`` explains a failure."""

    bad: Tensor
    message: Callable[[], str]


@dataclass
class Samples:
    """The samples packed into the rows of a ``(B, S)`` batch, from ``cu_seqlens`` (:func:`packed_samples`).

    Attributes:
        cu: ``(n + 1,)`` int64 sample boundaries over the flattened batch (flat token indices into ``B * S``;
            sample ``k`` holds tokens ``cu[k] <= idx < cu[k + 1]``), clamped into ``[0, B * S]``.
        index: ``(B, S)`` the sample of every token (in ``0 .. n - 1``).
        start: ``(B * S,)`` flat index of the first token of every token's sample.
        checks: deferred validity checks of ``cu_seqlens`` (one host read in :meth:`TokenLayout.validate`).
    """

    cu: Tensor
    index: Tensor
    start: Tensor
    checks: list[Check] = field(default_factory=list)

    @property
    def count(self) -> int:
        """Number of samples ``n`` (empty ones included), from the shape of ``cu``: no host read."""
        return self.cu.shape[0] - 1

    def cumsum(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Segment sums of per-token values ``x (..., B, S)``: ``(exclusive, totals)``.

        ``exclusive (..., B, S)``: the sum of ``x`` over the earlier tokens of the same sample;
        ``totals (..., n)``: the sum over each sample (0 for an empty one). One row ``cumsum`` (samples never
        span rows) minus its value at every sample's first token.
        """
        lead, (B, S) = x.shape[:-2], x.shape[-2:]
        N = B * S
        incl = x.cumsum(-1).reshape(*lead, N)  # (..., N) inclusive, per row
        excl = incl - x.reshape(*lead, N)
        base = excl.index_select(-1, self.start)  # (..., N) the exclusive sum at each token's sample start
        first, last = self.cu[:-1].clamp(max=N - 1), (self.cu[1:] - 1).clamp(min=0)  # (n,) each
        totals = incl.index_select(-1, last) - excl.index_select(-1, first)
        totals = torch.where(self.cu[1:] > self.cu[:-1], totals, torch.zeros_like(totals))
        return (excl - base).reshape(x.shape), totals

    def holes(self, valid: Tensor) -> Check:
        """The check that no padding slot sits between two real tokens of one sample (``valid (B, S)`` real).

        A packed row is read as one contiguous run of real tokens per sample: the text row restarts at padding
        (:func:`vlpe.encodings.multimodal.text_position_ids` gives it 0), and a block-diagonal mask built from it
        (transformers' mask from packed position ids, the patch's flash-attention boundaries) would cut the
        sample in two there. Padding at a sample's start or end is exact (its slots become segments of their own,
        before or after every real token). Two segment sums, no host read (the message reads the first hole)."""
        v = valid.to(torch.int64)  # (B, S)
        before, totals = self.cumsum(v)  # (B, S) real tokens earlier in the sample, (n,) real tokens per sample
        after = totals.index_select(0, self.index.reshape(-1)).view(v.shape) - before - v  # (B, S) real tokens later
        hole = (v == 0) & (before > 0) & (after > 0)  # (B, S)

        def message() -> str:
            b, s = (int(x) for x in hole.nonzero()[0])
            k = int(self.index[b, s])
            return (
                f"sample {k} of the packed batch (row {b}) has padding at slot {s} (attention_mask 0) between two of "
                "its real tokens; packed samples must be contiguous runs of real tokens, or the text positions "
                "restart at the padding and split the sample in two. Put a sample's padding at its end (or start), "
                "or leave it out"
            )

        return Check(hole.any(), message)


CU_SEQLENS_FORMS = (
    "cu_seqlens takes cumulative sample lengths (integer token offsets, flash-attention's varlen convention) in one "
    "of two forms: one 1-D sequence (n + 1,) over the flattened batch, 0 = cu[0] <= cu[1] <= ... <= cu[n] = B * S "
    "with every row boundary b * S an entry (for B = 1 the row's own boundaries), as an integer tensor, numpy array "
    "or list of ints; or one such sequence per row, each from 0 to S, as a list of B tensors / lists or a "
    "(B, k + 1) integer tensor"
)


def _integral(x) -> bool:
    """A Python / numpy integer (not a bool) or a 0-d integer tensor: one entry of a 1-D ``cu_seqlens`` list."""
    if isinstance(x, Tensor):
        return x.dim() == 0 and not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _entry_error(what: str, k: int, x) -> ValueError:
    return ValueError(
        f"{what}[{k}] must be an integer token offset, got {type(x).__name__} {x!r:.40}; {CU_SEQLENS_FORMS}"
    )


def _one(c, what: str, device: torch.device) -> Tensor:
    """A 1-D int64 tensor from one sequence of boundaries (tensor, numpy array, or list / tuple of integers)."""
    if isinstance(c, (list, tuple)):
        for k, x in enumerate(c):
            if not _integral(x):
                raise _entry_error(what, k, x)
        if any(isinstance(x, Tensor) for x in c):
            t = torch.stack([torch.as_tensor(x, device=device).to(torch.int64) for x in c])
        else:
            t = torch.tensor([int(x) for x in c], dtype=torch.int64, device=device)
    elif isinstance(c, Tensor) or type(c).__module__ == "numpy":
        t = torch.as_tensor(c, device=device)
    else:
        raise ValueError(
            f"{what} must be a tensor, a numpy array or a list, got {type(c).__name__} {c!r:.40}; {CU_SEQLENS_FORMS}"
        )
    if t.dim() != 1 or t.shape[0] < 2:
        raise ValueError(
            f"{what} must be 1-D cumulative sample lengths starting at 0, e.g. [0, 7, 12], with at least "
            f"2 entries; got shape {tuple(t.shape)}. {CU_SEQLENS_FORMS}"
        )
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{what} must hold integer token offsets, got dtype {t.dtype}; {CU_SEQLENS_FORMS}")
    return t.to(torch.int64)


def _as_cu(cu_seqlens, B: int, S: int, device: torch.device) -> tuple[Tensor, str]:
    """Flat int64 boundaries ``(n + 1,)`` over ``B * S`` and a description of the accepted form (for messages).

    The form is read from the container alone (no host read of a tensor's values): a list / tuple whose entries
    are all sequences (lists, tuples, 1-D tensors, numpy arrays) or a 2-D tensor is per row; a list / tuple of
    integers, a 1-D tensor or a 1-D numpy array is one sequence over the flattened batch. Anything else (a
    string, a float, a dict, a mix of both list forms) is a ``ValueError`` naming :data:`CU_SEQLENS_FORMS`."""

    def is_row(x) -> bool:
        return isinstance(x, (list, tuple)) or (
            (isinstance(x, Tensor) or type(x).__module__ == "numpy") and getattr(x, "ndim", 0) >= 1
        )

    rows = None
    if isinstance(cu_seqlens, (list, tuple)) and cu_seqlens and is_row(cu_seqlens[0]):
        rows = list(cu_seqlens)
        for b, r in enumerate(rows):
            if not is_row(r):
                raise ValueError(
                    f"cu_seqlens mixes the two forms: entry 0 is a sequence (one per row) but entry {b} is "
                    f"{type(r).__name__} {r!r:.40}; {CU_SEQLENS_FORMS}"
                )
    elif isinstance(cu_seqlens, Tensor) and cu_seqlens.dim() == 2:
        rows = list(cu_seqlens.unbind(0))
    if rows is None:  # one 1-D sequence over the flattened batch
        form = f"from 0 to the row length S = {S}"
        if B > 1:
            form = f"1-D over the flattened batch, from 0 to B * S = {B * S}"
        return _one(cu_seqlens, "cu_seqlens", device), form
    if len(rows) != B:
        raise ValueError(
            f"cu_seqlens given per row must have one entry per row (B = {B}), got {len(rows)}; {CU_SEQLENS_FORMS}"
        )
    per_row = [_one(r, f"cu_seqlens[{b}]", device) for b, r in enumerate(rows)]
    offsets = [r[1:] + b * S for b, r in enumerate(per_row)]
    return torch.cat([per_row[0][:1], *offsets]), f"per row, each from 0 to S = {S}"


def packed_samples(cu_seqlens, batch: int, length: int, *, device: torch.device | None = None) -> Samples:
    """The samples packed into the rows of a ``(batch, length)`` batch.

    ``cu_seqlens`` takes two forms (the cumulative sample lengths that flash-attention's varlen kernels take):

    * one 1-D tensor (or list of ints) ``(n + 1,)`` over the *flattened* batch: ``0 = cu[0] <= cu[1] <= ... <=
      cu[n] = batch * length``, and every row boundary ``b * length`` must be one of the entries (a sample never
      spans two rows). For ``batch = 1`` this is the row's own ``cu_seqlens``;
    * one 1-D sequence per row (a list of ``batch`` tensors / lists, or a ``(batch, k + 1)`` tensor), each from
      0 to ``length``; samples are numbered row by row.

    Equal consecutive entries make empty samples. The form is checked at once (a ``ValueError`` naming the
    accepted forms, :data:`CU_SEQLENS_FORMS`, for a string, floats, a dict, a mix of both forms ...), and so is
    ``length >= 1``; the checks of the values (start at 0, non-decreasing, end at the row length, row boundaries)
    are deferred to :attr:`Samples.checks`; values are clamped, so nothing indexes out of range before they run.
    """
    device = torch.device("cpu") if device is None else device
    B, S = int(batch), int(length)
    if S <= 0:
        raise ValueError(
            f"packed rows of length {S}: a batch (B, S) with cu_seqlens needs S >= 1 tokens per row (drop empty "
            "batches before computing position ids)"
        )
    N = B * S
    cu, form = _as_cu(cu_seqlens, B, S, device)
    raw = cu
    cu = cu.clamp(0, N)
    token = torch.arange(N, device=device)
    index = (torch.searchsorted(cu, token, right=True) - 1).clamp_(0, cu.shape[0] - 2)  # (N,) sample of each token
    start = cu.index_select(0, index)  # (N,)
    checks = [
        Check(
            raw[0] != 0,
            lambda: f"cu_seqlens must start at 0 (the first sample's first token; cumulative sample lengths, {form}); "
            f"got {raw.tolist()}. {CU_SEQLENS_FORMS}",
        ),
        Check(
            (raw[1:] < raw[:-1]).any(),
            lambda: f"cu_seqlens must not decrease (cumulative sample lengths, {form}); got {raw.tolist()}. "
            f"{CU_SEQLENS_FORMS}",
        ),
        Check(
            raw[-1] != N,
            lambda: f"cu_seqlens must end at the row length ({form}; packed samples must cover every token, "
            f"padding included in a sample); got {raw.tolist()}. {CU_SEQLENS_FORMS}",
        ),
    ]
    if B > 1:
        row_bounds = torch.arange(1, B, device=device) * S  # (B-1,)
        pos = torch.searchsorted(raw, row_bounds).clamp(max=raw.shape[0] - 1)
        checks.append(
            Check(
                (raw.index_select(0, pos) != row_bounds).any(),
                lambda: f"cu_seqlens over the flattened batch must contain every row boundary "
                f"{row_bounds.tolist()} (a sample may not span two rows of length {S}); got {raw.tolist()}. "
                f"{CU_SEQLENS_FORMS}",
            )
        )
    return Samples(cu=cu, index=index.view(B, S), start=start, checks=checks)
