"""``eval/stats.py`` takes its Student-t quantile from scipy, and scipy is declared where the project's pins are.

Checked against ``scipy.stats.t.ppf`` itself (the function the quantile must be), ``requirements.txt`` (exact pin =
the installed version), ``pyproject.toml`` (the ``all`` extra, where the harness's dependencies are declared) and
``results/claims.json`` (the recorded 95 % intervals of the paper claims, recomputed from their per-seed values).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
import stats  # noqa: E402  (eval/ is on pytest's pythonpath)

scipy_stats = pytest.importorskip("scipy.stats")


def test_t_quantile_is_scipys_ppf(monkeypatch):
    """The quantile is scipy's: a replaced ``scipy.stats.t.ppf`` is what ``t_quantile`` returns."""
    seen = []

    def ppf(p, df):
        seen.append((p, df))
        return 1.25

    monkeypatch.setattr(scipy_stats.t, "ppf", ppf)
    assert stats.t_quantile(0.975, 4) == 1.25 and seen == [(0.975, 4)]
    assert not hasattr(stats, "_betainc"), "eval/stats.py still carries its own incomplete beta function"


def test_t_quantile_still_checks_its_arguments():
    with pytest.raises(ValueError, match="df must be >= 1"):
        stats.t_quantile(0.975, 0)
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\)"):
        stats.t_quantile(1.0, 4)


def test_scipy_is_pinned_at_the_installed_version_and_declared():
    installed = importlib.metadata.version("scipy")
    pins = re.findall(r"^scipy==(\S+)\s*$", (ROOT / "requirements.txt").read_text(), flags=re.M)
    assert pins == [installed], f"requirements.txt should pin scipy=={installed} once, found {pins}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [d for d in project["optional-dependencies"]["all"] if re.match(r"scipy\b", d)]
    assert declared, "pyproject.toml's `all` extra (the harness's dependencies) should declare scipy"


def test_recorded_claim_intervals_are_unchanged():
    """Every measured claim's t interval, recomputed from its per-seed differences, is the recorded one (to
    rounding far below the one decimal the README reports)."""
    claims = [c for c in json.loads((ROOT / "results" / "claims.json").read_text()) if c.get("per_seed")]
    assert claims
    for c in claims:
        if len(c["per_seed"]) < 2:  # one seed (a look under way): a difference, no interval
            assert c["ci95"] is None, c["claim"]
            continue
        _, _, lo, hi = stats.t_interval(c["per_seed"])
        assert math.isclose(lo, c["ci95"][0], abs_tol=1e-9) and math.isclose(hi, c["ci95"][1], abs_tol=1e-9), c["claim"]
        assert f"{lo:+.1f}, {hi:+.1f}" == f"{c['ci95'][0]:+.1f}, {c['ci95'][1]:+.1f}", c["claim"]
