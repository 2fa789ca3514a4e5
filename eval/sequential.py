"""Sequential decisions on the pre-registered claims (:mod:`claims`): the rule, the record selection, the planner.

:func:`run_design` applies :class:`claims.Design` to per-seed paired differences, vectorised over replicates (the
report calls it with one, the simulation in ``tests/test_claims_sequential.py`` with thousands). Looks are
synchronous: the look of ``n`` seeds is taken only once every claim still open with ``n <= cap`` has its first ``n``
seeds (a claim not yet measured holds the look back too), and then for all of them at once. A look taken on some
claims while others waited would let the later arrivals change Holm's levels of a look already reported, turning a
published ``equivalent`` or ``open`` into ``agrees`` after the fact. At the look of ``n`` seeds, for every claim still
open with ``n <= cap``:

* the mean ``d`` and the standard error ``s / sqrt(n)`` of the per-seed differences give the two-sided Student-t
  p-value of ``d = 0`` (``p_sign``) and the TOST p-value of ``|d| >= margin`` (``max`` of the two one-sided ones);
* Holm's step-down across the claims: ``D`` = every registered claim without a sign decision so far (claims not
  measured, still waiting for seeds, unresolved or equivalent included: their level stays reserved); the claims are
  ordered by ``p_sign / f`` (``f`` = the Haybittle-Peto share of the look, :meth:`claims.Design.fraction`) and the
  ``k``-th (from 0) is rejected while ``p_sign <= f * alpha / (D - k)``: ``agrees`` / ``disagrees`` by the sign of
  ``d``;
* of the rest, a claim whose ``p_tost <= f * alpha / m`` (``m`` = every registered claim: Bonferroni, nothing is
  passed on) is ``equivalent``;
* a claim undecided at its cap is ``unresolved``; below the cap it stays ``open`` for the next look.

Under normal per-seed differences the probability of any false sign decision (a sign decision on a claim whose
true difference is 0) is at most ``alpha`` (Bonferroni over the looks, Holm over the claims), and so is the
probability of any false ``equivalent`` (true ``|d| >= margin``; Bonferroni over looks and claims). Equivalence
gets no level passed on because a claim retired by a correct sign decision may still have ``|d| >= margin``: Holm's
argument then fails for the equivalence hypotheses (a simulation at ``|d| = margin`` showed about twice the claim's
share when it did).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from claims import CLAIMS, DESIGN, LEGACY_ADOPTED_BY, Claim, Design, fingerprint

__all__ = ["VERDICTS", "run_design", "decide", "tails", "select_records", "next_look_runs"]

#: verdict codes of :func:`run_design`
VERDICTS = ("open", "agrees", "disagrees", "equivalent", "unresolved")
OPEN, AGREES, DISAGREES, EQUIVALENT, UNRESOLVED = range(5)


def _t():
    from scipy.stats import t

    return t


def run_design(diffs: np.ndarray, available: np.ndarray, margins: Sequence[float], caps: Sequence[int], *,
               design: Design = DESIGN) -> dict[str, np.ndarray]:  # fmt: skip
    """Decide ``m`` claims over ``R`` replicates. ``diffs``: ``(R, m, N)`` per-seed differences (points) in seed
    order; ``available``: ``(R, m)`` or ``(m,)`` seeds present from seed 0 (0: not measured). Returns ``verdict``
    codes (:data:`VERDICTS`), ``look`` (index of the look of the verdict, or the last look reached; -1: none) and
    ``alpha`` (the nominal two-sided level the claim was tested at there: the one it passed when decided, else the
    one it would have needed)."""
    x = np.asarray(diffs, dtype=np.float64)
    if x.ndim != 3:
        raise ValueError(f"diffs must be (replicates, claims, seeds), got shape {x.shape}")
    R, m, N = x.shape
    avail = np.broadcast_to(np.asarray(available), (R, m))
    margin = np.asarray(margins, dtype=np.float64)
    cap = np.asarray(caps)
    if margin.shape != (m,) or cap.shape != (m,) or (margin <= 0).any():
        raise ValueError(f"need {m} positive margins and {m} caps")
    t = _t()
    verdict = np.full((R, m), OPEN)
    look = np.full((R, m), -1)
    level = np.full((R, m), np.nan)
    signed = np.zeros((R, m), bool)  # sign decisions: the claims whose level Holm passes on
    rank = np.arange(m)[None, :]
    waiting = np.zeros(R, bool)  # a look not taken: neither is any later one
    for li, n in enumerate(design.looks):
        due = (verdict == OPEN) & (cap >= n)[None, :]  # (R, m): the claims this look tests
        waiting |= (due & ((avail < n) | (n > N))).any(axis=1)
        active = due & ~waiting[:, None]
        if not active.any():
            continue
        xs = np.where(active[..., None], x[:, :, :n], 0.0)
        mean = xs.mean(axis=2)
        se = xs.std(axis=2, ddof=1) / math.sqrt(n)
        with np.errstate(divide="ignore", invalid="ignore"):
            tstat = mean / se
            p_sign = np.where(np.isnan(tstat), 1.0, 2 * t.sf(np.abs(tstat), n - 1))
            p_tost = np.maximum(t.sf((mean + margin) / se, n - 1), t.cdf((mean - margin) / se, n - 1))
        p_tost = np.where(np.isnan(p_tost), 1.0, p_tost)
        frac = np.array([design.fraction(n, int(c)) if n <= c else np.nan for c in cap])[None, :]
        D = m - signed.sum(axis=1, keepdims=True)  # (R, 1)
        q = np.where(active, p_sign / frac, np.inf)
        order = np.argsort(q, axis=1, kind="stable")
        with np.errstate(divide="ignore"):
            step = np.where(D - rank > 0, design.alpha / (D - rank), -1.0)  # Holm's level of the k-th smallest
        passed = np.cumprod(np.take_along_axis(q, order, axis=1) <= step, axis=1).astype(bool)
        reject = np.zeros((R, m), bool)
        np.put_along_axis(reject, order, passed, axis=1)
        step_of = np.zeros((R, m))
        np.put_along_axis(step_of, order, step, axis=1)
        verdict[reject] = np.where(mean[reject] > 0, AGREES, DISAGREES)
        signed |= reject
        need = frac * design.alpha / m  # equivalence: Bonferroni over every registered claim, nothing passed on
        equiv = active & ~reject & (p_tost <= need)
        D2 = m - signed.sum(axis=1, keepdims=True)
        need = np.broadcast_to(frac * design.alpha / np.maximum(D2, 1), (R, m))  # the next sign step
        verdict[equiv] = EQUIVALENT
        verdict[active & (verdict == OPEN) & (cap == n)[None, :]] = UNRESOLVED
        look[active] = li
        level[active] = np.where(reject, frac * step_of, np.where(equiv, frac * design.alpha / m, need))[active]
    return {"verdict": verdict, "look": look, "alpha": level}


def _interval(xs: np.ndarray, level: float) -> list[float] | None:
    """The two-sided Student-t interval of ``level`` over the per-seed values; None for one seed."""
    if xs.size < 2 or not 0 < level < 1:
        return None
    h = float(_t().ppf(0.5 + level / 2, xs.size - 1) * xs.std(ddof=1) / math.sqrt(xs.size))
    m = float(xs.mean())
    return [m - h, m + h]


def decide(per_seed: Sequence[Mapping[int, float] | None], claims: Sequence[Claim] = CLAIMS, *,
           design: Design = DESIGN) -> list[dict[str, Any]]:  # fmt: skip
    """The decision of every claim from its per-seed differences ``{seed: points}`` (None: not measured):
    ``verdict`` (``not measured`` / :data:`VERDICTS`), ``look`` (1-based, None before the first), ``n`` (seeds of
    that look), ``diff``, ``ci95`` (plain 95 % t interval over those seeds), ``alpha_look`` with ``ci_rule`` (the
    ``1 - alpha_look`` interval of the sign test) and ``ci_tost`` (the ``1 - 2 alpha_look`` interval of TOST), and
    for an undecided claim ``next_look`` (seeds per row it needs next; None at the cap)."""
    if len(per_seed) != len(claims):
        raise ValueError(f"{len(per_seed)} per-seed sets for {len(claims)} claims")
    m, N = len(claims), design.looks[-1]
    diffs = np.zeros((1, m, N))
    avail = np.zeros(m, int)
    for i, ps in enumerate(per_seed):
        if not ps:
            continue
        n = 0
        while n in ps and n < N:
            diffs[0, i, n] = float(ps[n])
            n += 1
        avail[i] = n
    out = run_design(diffs, avail, [c.margin for c in claims], [c.cap for c in claims], design=design)
    res = []
    for i, (c, ps) in enumerate(zip(claims, per_seed)):
        if not ps:
            res.append({"verdict": "not measured"})
            continue
        li = int(out["look"][0, i])
        v = VERDICTS[int(out["verdict"][0, i])]
        n = design.looks[li] if li >= 0 else len(ps)
        seeds = list(range(n)) if li >= 0 else sorted(ps)
        xs = np.array([ps[s] for s in seeds], dtype=np.float64)
        a = None if li < 0 else float(out["alpha"][0, i])
        nxt = None
        if v == "open":
            nxt = next((k for k in design.looks if k > (n if li >= 0 else 0) and k <= c.cap), None)
        res.append({"verdict": v, "look": None if li < 0 else li + 1, "n": n, "seeds": seeds, "diff": float(xs.mean()),
                    "ci95": _interval(xs, 0.95), "alpha_look": a,
                    "ci_rule": None if a is None else _interval(xs, 1 - a),
                    "ci_tost": None if a is None else _interval(xs, 1 - 2 * a), "next_look": nxt,
                    **tails(xs, c.margin, v, a)})  # fmt: skip
    return res


def tails(xs: np.ndarray, margin: float, verdict: str, level: float | None) -> dict[str, Any]:
    """The p-values of one claim's look beside the rule's: ``p_t`` / ``p_tost`` (Student-t, what the rule reads),
    ``p_sign_flip`` / ``p_tost_sign_flip`` (exact sign-flip permutation tests of the same hypotheses,
    :func:`stats.sign_flip_p`: no normal tails, symmetric differences under the null), ``sign_flip_floor`` (the
    smallest two-sided sign-flip p-value ``n`` seeds allow) and ``normal_tails``: for a decided claim, whether the
    exact test of its decision misses the level ``level`` the rule used (True: the decision rests on the t
    distribution's tails); None for an undecided one."""
    from stats import sign_flip_p

    x = np.asarray(xs, dtype=np.float64)
    n = x.size
    if n < 2:
        return {}
    t = _t()
    se = x.std(ddof=1) / math.sqrt(n)
    d = float(x.mean())
    if se > 0:
        p_t = float(2 * t.sf(abs(d / se), n - 1))
        p_tost = float(max(t.sf((d + margin) / se, n - 1), t.cdf((d - margin) / se, n - 1)))
    else:  # every seed the same difference
        p_t, p_tost = float(d == 0), float(abs(d) >= margin)
    p_flip = sign_flip_p(x)
    p_tost_flip = max(sign_flip_p(x, shift=-margin, alternative="greater"),
                      sign_flip_p(x, shift=margin, alternative="less"))  # fmt: skip
    rests = None
    if level is not None and verdict in ("agrees", "disagrees"):
        rests = p_flip > level
    elif level is not None and verdict == "equivalent":
        rests = p_tost_flip > level
    return {"p_t": p_t, "p_tost": p_tost, "p_sign_flip": p_flip, "p_tost_sign_flip": p_tost_flip,
            "sign_flip_floor": 2 / 2**n, "normal_tails": rests}  # fmt: skip


def select_records(records: Mapping[str, Sequence[dict]], *, design: Design = DESIGN,
                   current: str | None = None) -> tuple[dict[str, list[dict]], list[str]]:  # fmt: skip
    """The records the decisions may use, and a message per record left out. A record of the current claims
    fingerprint is used; one without the field (written before the design) is used for the seeds of the first look
    when ``design.legacy == "first-look"`` and the current protocol is the one that adopted them
    (:data:`claims.LEGACY_ADOPTED_BY`); one of another fingerprint is refused: its looks were spent under other
    claims, margins or caps, and mixing them would change the error rates the rule guarantees."""
    current = fingerprint() if current is None else current
    adopt = design.legacy == "first-look" and current == LEGACY_ADOPTED_BY
    used: dict[str, list[dict]] = {}
    refused: list[str] = []
    for fam, recs in records.items():
        keep = []
        for r in recs:
            fp = r.get("claims_fingerprint")
            name = f"{fam}/{r.get('encoding')}_seed{r.get('seed')}"
            if fp == current:
                keep.append(r)
            elif fp is None and adopt and int(r["seed"]) < design.looks[0]:
                keep.append(r)
            elif fp is None and adopt:
                refused.append(f"{name}: written without a claims fingerprint; only seeds below "
                               f"{design.looks[0]} of such records count")  # fmt: skip
            elif fp is None:
                refused.append(f"{name}: written without a claims fingerprint; such records count only under claims "
                               f"protocol {LEGACY_ADOPTED_BY} (with legacy='first-look'), not {current}")  # fmt: skip
            else:
                refused.append(f"{name}: claims protocol {fp} is not the current {current}; left out of the "
                               f"decisions (records of different protocols do not mix)")  # fmt: skip
        used[fam] = keep
    return used, refused


def next_look_runs(entries: Sequence[Mapping[str, Any]], claims: Sequence[Claim] = CLAIMS, *,
                   design: Design = DESIGN) -> list[tuple[str, str, int]]:  # fmt: skip
    """The ``(family, row, seed)`` runs the next look needs: for every claim still ``open`` (or ``not measured``,
    whose first look is due), the seeds below its next look that either of its two rows lacks. Claims decided or
    unresolved ask for nothing. ``entries`` are :func:`aggregate.evaluate_claims`'s, in the order of ``claims``."""
    want: set[tuple[str, str, int]] = set()
    for c, e in zip(claims, entries):
        if e["verdict"] == "not measured":
            n = design.looks[0]
        elif e["verdict"] == "open" and e.get("next_look"):
            n = int(e["next_look"])
        else:
            continue
        have = e.get("row_seeds") or {}
        for row in (c.better, c.other):
            want |= {(c.family, row, s) for s in range(n) if s not in set(have.get(row, ()))}
    return sorted(want)
