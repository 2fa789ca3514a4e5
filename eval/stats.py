"""Statistics of the benchmark: cells over seeds and test items, paired differences between encodings.

The unit of replication is the *seed*. Seed ``k`` of every encoding of a family trains from the same seed and is
tested on the same items, and the items of different seeds are disjoint slices of the test set (ViT, points) or
independent draws (V-NIAH), so:

* a cell (one encoding, one test condition) is the mean over seeds of the per-seed accuracy; its 95 % interval is
  a Student-t interval over the per-seed values (``mean +- t_{0.975, S-1} * std / sqrt(S)``). Each per-seed
  value is measured on its own test items, so the spread of the per-seed values, and hence the interval, carries
  both the seed-to-seed variation of training and the sampling noise of the test items;
* a paired difference (encoding A minus encoding B, same seeds, same items) is the mean over seeds of the
  per-seed differences, with the same t interval over the per-seed differences;
* beside it, a hierarchical bootstrap (resample seeds with replacement, then the test items of each drawn seed
  with replacement, jointly for every condition and for both encodings of a pair) gives a second 95 % interval
  (``ci95_bootstrap``, percentile method), as a cross-check: the verdicts use the t interval (with 5 seeds the
  percentile bootstrap of the seed level is known to undercover).

Per-item outcomes travel as packed bits (:func:`pack_bits` / :func:`unpack_bits`): a run's evaluation stores
``{"n": items, "bits": base64}`` per condition. The t quantile is ``scipy.stats.t.ppf``. Checked in
``tests/test_stats.py`` against closed forms (intervals by hand, binomial variances) and a slow resampling loop.
"""

from __future__ import annotations

import base64
import math
from typing import Mapping, Sequence

import numpy as np

__all__ = [
    "pack_bits",
    "unpack_bits",
    "t_quantile",
    "seeds_needed",
    "t_interval",
    "Cell",
    "cell",
    "paired",
    "verdict",
    "sign_flip_p",
    "BOOTSTRAP",
]

#: Bootstrap replicates (percentile interval; 4000 keeps the 2.5 % quantile within ~0.1 point).
BOOTSTRAP = 4000


def pack_bits(correct: Sequence[bool] | np.ndarray) -> dict:
    """``{"n": len, "bits": base64 of numpy.packbits}``: the per-item outcomes of one condition, compactly."""
    arr = np.asarray(correct, dtype=bool).ravel()
    return {"n": int(arr.size), "bits": base64.b64encode(np.packbits(arr).tobytes()).decode("ascii")}


def unpack_bits(packed: Mapping) -> np.ndarray:
    """The boolean vector of :func:`pack_bits`."""
    try:
        n, raw = int(packed["n"]), base64.b64decode(packed["bits"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"expected per-item outcomes as {{'n': int, 'bits': base64}}, got {packed!r:.80}") from e
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8))
    if bits.size < n or bits.size - n >= 8:
        raise ValueError(f"packed outcomes hold {bits.size} bits, inconsistent with n={n}")
    return bits[:n].astype(bool)


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom: ``scipy.stats.t.ppf`` (scipy is pinned in
    requirements.txt), after checking the arguments."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    from scipy.stats import t

    return float(t.ppf(p, df))


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float, float]:
    """(mean, sample std, lower, upper) of the Student-t interval over ``values``; one value: a zero-width
    interval is *not* claimed, the bounds are -inf / inf."""
    xs = np.asarray(values, dtype=np.float64)
    if xs.size == 0:
        raise ValueError("t_interval needs at least one value")
    m = float(xs.mean())
    if xs.size == 1:
        return m, 0.0, -math.inf, math.inf
    s = float(xs.std(ddof=1))
    h = t_quantile(0.5 + level / 2, xs.size - 1) * s / math.sqrt(xs.size)
    return m, s, m - h, m + h


def seeds_needed(sd: float, half_width: float, level: float = 0.95, *, cap: int = 100_000) -> int:
    """The fewest seeds ``n >= 2`` whose Student-t interval over per-seed values of standard deviation ``sd`` has
    half-width at most ``half_width`` (``t_{n-1} * sd / sqrt(n) <= half_width``); ``cap`` when even that many do
    not suffice. Assumes the spread stays ``sd``: a planning figure, not a promise."""
    if half_width <= 0:
        raise ValueError(f"half_width must be > 0, got {half_width}")
    if sd < 0 or not math.isfinite(sd):
        raise ValueError(f"sd must be finite and >= 0, got {sd}")

    def fits(n: int) -> bool:
        return t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n) <= half_width

    if fits(2):
        return 2
    lo, hi = 2, 4  # fits(lo) is False; find hi with fits(hi), then bisect (the half-width decreases with n)
    while not fits(hi):
        lo, hi = hi, hi * 2
        if hi >= cap:
            return cap if not fits(cap) else _bisect(fits, lo, cap)
    return _bisect(fits, lo, hi)


def _bisect(fits, lo: int, hi: int) -> int:
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _finite(t: tuple[float, float, float, float]) -> tuple:
    """One seed: no interval (None bounds, JSON ``null``) rather than infinities."""
    m, s, lo, hi = t
    return (m, s, None, None) if not (math.isfinite(lo) and math.isfinite(hi)) else t


class Cell(dict):
    """``{"mean", "std", "n", "items", "ci95", "ci95_bootstrap", "per_seed"}`` (fractions; ``n`` = seeds,
    ``items`` = test items per seed; ``ci95`` None for a single seed)."""


def _weights(rng: np.random.Generator, n: int, reps: int) -> np.ndarray:
    """``(reps, n)`` multinomial counts: ``reps`` bootstrap resamples of ``n`` items, as item weights."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=reps).astype(np.float64)


def _bootstrap(per_seed: Sequence[tuple[np.ndarray, ...]], stat, *, reps: int, seed: int) -> tuple[float, float]:
    """Percentile 95 % interval of ``mean over seeds of stat(*weighted item means)``, hierarchical resampling.

    ``per_seed[s]`` is a tuple of ``(C, n_s)`` 0/1 matrices (one per encoding of the statistic) sharing the
    items of seed ``s``; ``stat`` maps the tuple of ``(reps, C)`` resampled per-condition accuracies to
    ``(reps,)``.
    """
    rng = np.random.default_rng(seed)
    S = len(per_seed)
    vals = np.empty((S, reps))
    for s, mats in enumerate(per_seed):
        n = mats[0].shape[1]
        w = _weights(rng, n, reps)  # (reps, n), the same items for every matrix of the seed
        vals[s] = stat(*(w @ m.T.astype(np.float64) / n for m in mats))
    pick = rng.integers(0, S, size=(reps, S))  # seeds drawn with replacement
    boot = vals[pick, np.arange(reps)[:, None]].mean(axis=1)  # (reps,)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return float(lo), float(hi)


def _check(per_seed: Sequence[np.ndarray], what: str) -> list[np.ndarray]:
    mats = []
    for m in per_seed:
        m = np.asarray(m)
        if m.ndim == 1:
            m = m[None]
        if m.ndim != 2 or m.shape[1] < 1:
            raise ValueError(f"{what}: expected per-seed (conditions, items) outcome matrices, got shape {m.shape}")
        mats.append(m.astype(bool))
    if not mats:
        raise ValueError(f"{what}: no seeds")
    return mats


def cell(per_seed: Sequence[np.ndarray], weights: Sequence[float] | None = None, *, reps: int = BOOTSTRAP,
         seed: int = 0) -> Cell:  # fmt: skip
    """The cell of one encoding: per seed a ``(C, n)`` 0/1 matrix (conditions x items), the statistic the
    ``weights``-average over conditions (default: the mean over all ``C``) of the item accuracy."""
    mats = _check(per_seed, "cell")
    C = mats[0].shape[0]
    w = np.full(C, 1.0 / C) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (C,) or any(m.shape[0] != C for m in mats):
        raise ValueError(f"cell: every seed needs {C} conditions matching {len(w)} weights")
    values = [float(m.mean(axis=1) @ w) for m in mats]
    mean, std, lo, hi = _finite(t_interval(values))
    blo, bhi = _bootstrap([(m,) for m in mats], lambda a: a @ w, reps=reps, seed=seed)
    return Cell(mean=mean, std=std, n=len(mats), items=int(min(m.shape[1] for m in mats)),
                ci95=None if lo is None else [lo, hi], ci95_bootstrap=[blo, bhi], per_seed=values)  # fmt: skip


def paired(a: Sequence[np.ndarray], b: Sequence[np.ndarray], weights_a: Sequence[float],
           weights_b: Sequence[float] | None = None, *, reps: int = BOOTSTRAP, seed: int = 0) -> Cell:  # fmt: skip
    """Paired difference ``wa . acc(A) - wb . acc(B)`` over matched seeds; ``a[s]`` and ``b[s]`` are the
    ``(C, n)`` outcome matrices of seed ``s`` on the *same* items (checked by shape)."""
    ma, mb = _check(a, "paired A"), _check(b, "paired B")
    if len(ma) != len(mb):
        raise ValueError(f"paired: A has {len(ma)} seeds and B {len(mb)}; pair them seed by seed")
    wa = np.asarray(weights_a, dtype=np.float64)
    wb = wa if weights_b is None else np.asarray(weights_b, dtype=np.float64)
    for x, y in zip(ma, mb):
        if x.shape[1] != y.shape[1] or x.shape[0] != wa.size or y.shape[0] != wb.size:
            raise ValueError(f"paired: seed matrices {x.shape} / {y.shape} do not share items or fit the weights")
    diffs = [float(x.mean(axis=1) @ wa - y.mean(axis=1) @ wb) for x, y in zip(ma, mb)]
    mean, std, lo, hi = _finite(t_interval(diffs))
    blo, bhi = _bootstrap(list(zip(ma, mb)), lambda p, q: p @ wa - q @ wb, reps=reps, seed=seed)
    return Cell(mean=mean, std=std, n=len(ma), items=int(min(x.shape[1] for x in ma)),
                ci95=None if lo is None else [lo, hi], ci95_bootstrap=[blo, bhi], per_seed=diffs)  # fmt: skip


def _signed_sums(x: np.ndarray) -> np.ndarray:
    """``sum(s_i x_i)`` over every sign vector ``s`` in ``{-1, +1}^n`` (``2^n`` values, unordered)."""
    signs = 1 - 2 * ((np.arange(2 ** x.size)[:, None] >> np.arange(x.size)[None, :]) & 1)
    return signs @ x


def sign_flip_p(values: Sequence[float], *, shift: float = 0.0, alternative: str = "two-sided") -> float:
    """Exact sign-flip permutation p-value of ``mean(values) = shift``: the share of the ``2^n`` sign vectors
    ``s`` whose ``sum(s_i (x_i - shift))`` is at least as extreme as the observed sum (``|.|`` for
    ``two-sided``, ``>=`` for ``greater``, ``<=`` for ``less``). Valid when the differences are symmetric about
    ``shift`` under the null (paired differences of exchangeable rows), without assuming normal tails; its smallest
    value is ``2 / 2^n`` two-sided and ``1 / 2^n`` one-sided (0.0625 and 0.03125 at 5 seeds).

    Args:
        values (Sequence[float]): the per-seed differences (at most 40; computed by meeting in the middle: the
            signed sums of the two halves are enumerated and the pairs counted on sorted sums).
        shift (float): the null value of the mean.
        alternative (str): ``two-sided``, ``greater`` or ``less``.

    Returns:
        float: the p-value; ties within ``1e-9`` of the values' scale count as at least as extreme.

    Raises:
        ValueError: for no values, more than 40 or an unknown ``alternative``.
    """
    x = np.asarray(values, dtype=np.float64).ravel() - shift
    if x.size == 0 or x.size > 40 or not np.isfinite(x).all():
        raise ValueError(f"sign_flip_p needs 1 to 40 finite values, got {x.size}")
    if alternative not in ("two-sided", "greater", "less"):
        raise ValueError(f"alternative must be 'two-sided', 'greater' or 'less', got {alternative!r}")
    tol = 1e-9 * max(float(np.abs(x).sum()), 1e-300)
    obs = float(x.sum())
    h = x.size // 2
    a, b = _signed_sums(x[:h]), np.sort(_signed_sums(x[h:]))

    def at_least(c: float) -> int:  # pairs with a + b >= c
        return int((b.size - np.searchsorted(b, c - a, side="left")).sum())

    def at_most(c: float) -> int:  # pairs with a + b <= c
        return int(np.searchsorted(b, c - a, side="right").sum())

    if alternative == "greater":
        hits = at_least(obs - tol)
    elif alternative == "less":
        hits = at_most(obs + tol)
    else:
        T = abs(obs) - tol
        hits = at_least(T) + at_most(-T) if T > 0 else 2 ** x.size
    return min(1.0, hits / 2 ** x.size)


def verdict(ci95: Sequence[float] | None) -> str:
    """``agrees`` when the interval of (claimed better - other) lies above 0, ``disagrees`` below, else
    ``unresolved`` (also without an interval: one seed)."""
    if ci95 is None:
        return "unresolved"
    lo, hi = ci95
    if lo > 0:
        return "agrees"
    if hi < 0:
        return "disagrees"
    return "unresolved"
