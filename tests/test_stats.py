"""The benchmark's statistics (eval/stats.py) against independent implementations and closed forms.

- the t quantile against scipy's; the t interval against one computed by hand from scipy's quantile;
- the hierarchical bootstrap: its variance against the closed form ``(Var_pop(p_s) + mean(p_s (1 - p_s)) / n) / S``
  of resampling S seeds then n items, and against a slow resampling loop written here;
- paired differences: hand-computed per-seed differences, zero for identical inputs, sign flip on swap;
- packed outcomes round-trip and reject malformed input.
"""

from __future__ import annotations

import math

import numpy as np
import pytest


import stats  # noqa: E402

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("df", [1, 2, 4, 9, 30])
@pytest.mark.parametrize("p", [0.975, 0.9, 0.6, 0.025])
def test_t_quantile_matches_scipy(p, df):
    assert stats.t_quantile(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), abs=1e-8)


def test_t_interval_by_hand():
    xs = [0.61, 0.58, 0.66, 0.60, 0.63]
    m, s, lo, hi = stats.t_interval(xs)
    mean = sum(xs) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / 4)
    h = scipy_stats.t.ppf(0.975, 4) * sd / math.sqrt(5)
    assert (m, s) == (pytest.approx(mean), pytest.approx(sd))
    assert (lo, hi) == (pytest.approx(mean - h), pytest.approx(mean + h))
    one = stats.t_interval([0.5])
    assert one[2] == -math.inf and one[3] == math.inf  # one seed: no interval is claimed


def _seeds(ps, n, rng):
    return [(rng.random(n) < p)[None] for p in ps]


def test_cell_mean_std_and_t_interval():
    rng = np.random.default_rng(1)
    mats = _seeds([0.7, 0.8, 0.75, 0.72, 0.78], 400, rng)
    c = stats.cell(mats, reps=500)
    per_seed = [m.mean() for m in mats]
    m, s, lo, hi = stats.t_interval(per_seed)
    assert c["mean"] == pytest.approx(m) and c["std"] == pytest.approx(s)
    assert c["ci95"] == [pytest.approx(lo), pytest.approx(hi)]
    assert c["n"] == 5 and c["items"] == 400


def test_hierarchical_bootstrap_variance_matches_closed_form():
    rng = np.random.default_rng(2)
    ps = [0.55, 0.7, 0.62, 0.8, 0.66]
    n = 300
    mats = _seeds(ps, n, rng)
    p_hat = np.array([m.mean() for m in mats])
    var = (p_hat.var() + np.mean(p_hat * (1 - p_hat)) / n) / len(ps)  # seeds resampled, then items
    c = stats.cell(mats, reps=20000, seed=3)
    width = c["ci95_bootstrap"][1] - c["ci95_bootstrap"][0]
    assert width == pytest.approx(2 * 1.96 * math.sqrt(var), rel=0.08)


def test_bootstrap_agrees_with_a_slow_resampling_loop():
    rng = np.random.default_rng(4)
    mats = [(rng.random((2, 60)) < p) for p in (0.5, 0.7, 0.6)]
    w = np.array([0.25, 0.75])
    slow = []
    r = np.random.default_rng(5)
    for _ in range(4000):
        picks = r.integers(0, 3, size=3)
        vals = []
        for s in picks:
            items = r.integers(0, 60, size=60)
            vals.append(float(mats[s][:, items].mean(axis=1) @ w))
        slow.append(sum(vals) / 3)
    lo, hi = np.quantile(slow, [0.025, 0.975])
    fast = stats.cell(mats, w, reps=8000, seed=6)["ci95_bootstrap"]
    assert fast[0] == pytest.approx(lo, abs=0.02) and fast[1] == pytest.approx(hi, abs=0.02)


def test_paired_difference_by_hand_and_antisymmetry():
    a = [np.array([[1, 1, 0, 1]], bool), np.array([[1, 0, 0, 1]], bool)]
    b = [np.array([[1, 0, 0, 0]], bool), np.array([[1, 0, 1, 1]], bool)]
    d = stats.paired(a, b, [1.0], reps=200)
    assert d["per_seed"] == [pytest.approx(0.5), pytest.approx(-0.25)]
    assert d["mean"] == pytest.approx(0.125)
    e = stats.paired(b, a, [1.0], reps=200)
    assert e["mean"] == pytest.approx(-0.125)
    assert e["ci95"] == [pytest.approx(-d["ci95"][1]), pytest.approx(-d["ci95"][0])]
    same = stats.paired(a, a, [1.0], reps=200)
    assert same["mean"] == 0 and same["ci95"] == [0, 0] and same["ci95_bootstrap"] == [0, 0]


def test_paired_uses_the_items_jointly():
    """Two rows that differ on few items have a much narrower paired bootstrap than independent rows would."""
    rng = np.random.default_rng(7)
    base = [(rng.random((1, 500)) < 0.6) for _ in range(5)]
    flipped = []
    for m in base:
        f = m.copy()
        f[0, :10] = ~f[0, :10]  # 10 of 500 items differ
        flipped.append(f)
    d = stats.paired(base, flipped, [1.0], reps=4000)
    assert d["ci95_bootstrap"][1] - d["ci95_bootstrap"][0] < 0.03


def test_verdict():
    assert stats.verdict([0.5, 2.0]) == "agrees"
    assert stats.verdict([-2.0, -0.1]) == "disagrees"
    assert stats.verdict([-1.0, 1.0]) == "unresolved"


def test_pack_bits_roundtrip_and_errors():
    rng = np.random.default_rng(8)
    for n in (1, 7, 8, 9, 1000):
        v = rng.random(n) < 0.5
        assert (stats.unpack_bits(stats.pack_bits(v)) == v).all()
    packed = stats.pack_bits([True] * 9)
    with pytest.raises(ValueError, match="inconsistent"):
        stats.unpack_bits({**packed, "n": 30})
    with pytest.raises(ValueError, match="per-item outcomes"):
        stats.unpack_bits({"bits": "???"})


def test_cell_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="conditions"):
        stats.cell([np.ones((2, 5), bool), np.ones((3, 5), bool)])
    with pytest.raises(ValueError, match="share items"):
        stats.paired([np.ones((1, 5), bool)], [np.ones((1, 6), bool)], [1.0])
    with pytest.raises(ValueError, match="seeds"):
        stats.paired([np.ones((1, 5), bool)] * 2, [np.ones((1, 5), bool)], [1.0])


@pytest.mark.parametrize("sd,hw", [(0.0, 3.0), (1.0, 3.0), (13.3, 3.0), (24.2, 3.0), (5.0, 0.5)])
def test_seeds_needed_is_the_first_n_that_fits(sd, hw):
    # independent check: scipy's t quantile and a plain upward scan
    def half(n):
        return scipy_stats.t.ppf(0.975, n - 1) * sd / np.sqrt(n)

    n = 2
    while half(n) > hw:
        n += 1
    assert stats.seeds_needed(sd, hw) == n


def test_seeds_needed_rejects_bad_input_and_caps():
    with pytest.raises(ValueError, match="half_width"):
        stats.seeds_needed(1.0, 0.0)
    with pytest.raises(ValueError, match="sd"):
        stats.seeds_needed(-1.0, 3.0)
    assert stats.seeds_needed(1e6, 1e-3, cap=1000) == 1000


def _brute_sign_flip(xs, shift=0.0, alternative="two-sided"):
    """Every sign vector enumerated one by one, the observed sum compared in exact rational arithmetic."""
    import itertools
    from fractions import Fraction

    d = [Fraction(x) - Fraction(shift) for x in xs]
    obs = sum(d)
    hits = 0
    for signs in itertools.product((1, -1), repeat=len(d)):
        s = sum(si * di for si, di in zip(signs, d))
        hits += {"two-sided": abs(s) >= abs(obs), "greater": s >= obs, "less": s <= obs}[alternative]
    return hits / 2 ** len(d)


@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
@pytest.mark.parametrize("case", range(8))
def test_sign_flip_p_matches_a_brute_force_enumeration(case, alternative):
    rng = np.random.default_rng(case)
    n = [1, 2, 5, 5, 7, 10, 11, 12][case]
    if case % 2:  # ties and zeros: small integers, as per-seed differences of counts are
        xs = rng.integers(-4, 5, size=n).astype(float)
    else:
        xs = np.round(rng.normal(1.0, 3.0, size=n), 3)
    shift = 0.0 if case < 4 else 0.5
    want = _brute_sign_flip(xs.tolist(), shift, alternative)
    assert stats.sign_flip_p(xs, shift=shift, alternative=alternative) == pytest.approx(want, abs=1e-12)


def test_sign_flip_p_smallest_values_and_errors():
    assert stats.sign_flip_p([3.0, 1.0, 4.0, 1.5, 9.0]) == 2 / 32  # all of one sign: 2 of the 32 sign vectors
    assert stats.sign_flip_p([3.0, 1.0, 4.0, 1.5, 9.0], alternative="greater") == 1 / 32
    assert stats.sign_flip_p([3.0, 1.0, 4.0, 1.5, 9.0], alternative="less") == 1.0
    assert stats.sign_flip_p([0.0, 0.0, 0.0]) == 1.0
    assert stats.sign_flip_p(np.arange(1.0, 21.0)) == 2 / 2**20
    with pytest.raises(ValueError, match="40"):
        stats.sign_flip_p(np.ones(41))
    with pytest.raises(ValueError, match="alternative"):
        stats.sign_flip_p([1.0], alternative="both")
