"""The suite report (eval/report.py) on small hand-written result JSONs.

What is checked:
- mean +- sample standard deviation over seeds, in-distribution / extrapolated columns, against hand-computed values;
- every sentence about a paper's claim follows the measured numbers: swapping the two encodings' numbers flips
  "agrees" to "disagrees", a gap inside the seed spread says so, a missing encoding says "not measured";
- the README: only the text between the markers changes (byte-identical before and after them), the markers are
  appended at the end when absent, a lone marker is an error; a second report with the same numbers changes nothing;
- the suite plan (default / all / named encodings, run folders) and resumability: a run whose export and evaluation
  exist is not trained or evaluated again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))

import long_video  # noqa: E402
import report  # noqa: E402

RATIOS = [1.0, 2.0, 4.57]
LENGTHS, DEPTHS, TRAIN_FRAMES = [4, 8, 16, 32], [0.0, 1.0], 8


# ------------------------------------------------------------------------------------------------------------
# fake per-run evaluations, in the formats of eval/resolution.py, eval/long_video.py and eval/points.py
# ------------------------------------------------------------------------------------------------------------


def vit_eval(enc: str, seed: int, accs: list[float]) -> dict:
    results = [{"ratio": r, "size": int(28 * r), "acc": a, "ece": 0.05, "nll": 1.0, "count": 100}
               for r, a in zip(RATIOS, accs)]  # fmt: skip
    return {"name": f"{enc}_seed{seed}", "encoding": enc, "results": results,
            "bench": {"family": "vit", "encoding": enc, "seed": seed, "steps": 10}}  # fmt: skip


def vlm_eval(variant: str, seed: int, per_length: list[float], d_per_length: list[float] | None = None) -> dict:
    """Every depth gets the length's accuracy, so per-length means are exactly ``per_length``."""

    def entry(pl):
        grid = [list(pl) for _ in DEPTHS]
        return long_video.summarize(grid, LENGTHS, TRAIN_FRAMES)

    tasks = {"v_niah": {"teacher": entry(per_length), "generate": entry(per_length), "agreement": 1.0}}
    if d_per_length is not None:
        tasks["v_niah_d"] = {"teacher": entry(d_per_length), "generate": entry(d_per_length), "agreement": 1.0}
    return {"name": f"{variant}_seed{seed}", "variant": variant, "lengths": LENGTHS, "depths": DEPTHS,
            "train_frames": TRAIN_FRAMES, "tasks": tasks,
            "bench": {"family": "vlm", "encoding": variant, "seed": seed, "steps": 10}}  # fmt: skip


def points_eval(enc: str, seed: int, z: float, so3: float, x2: float) -> dict:
    results = [
        {"condition": "rotation", "rotation": "z", "points": 512, "factor": 1, "acc": z},
        {"condition": "rotation", "rotation": "so3", "points": 512, "factor": 1, "acc": so3},
        {"condition": "points", "rotation": "z", "points": 1024, "factor": 2, "acc": x2},
    ]
    return {"name": f"{enc}_seed{seed}", "encoding": enc, "results": results,
            "bench": {"family": "points", "encoding": enc, "seed": seed, "steps": 10}}  # fmt: skip


def write_results(root: Path, *, lookhere_wins: bool, videorope_wins: bool, ri_wins: bool) -> Path:
    hi, lo = [0.9, 0.7, 0.6], [0.9, 0.5, 0.2]
    lh, rope = (hi, lo) if lookhere_wins else (lo, hi)
    vit = [vit_eval("lookhere", s, [a + 0.01 * s for a in lh]) for s in range(2)]
    vit += [vit_eval("rope", s, [a + 0.01 * s for a in rope]) for s in range(2)]
    vit += [vit_eval("pape", s, [0.9, 0.6, 0.4]) for s in range(2)]
    good, bad = [1.0, 0.9, 0.8, 0.6], [1.0, 0.9, 0.3, 0.1]
    vr, mr = (good, bad) if videorope_wins else (bad, good)
    vlm = [vlm_eval("videorope", s, vr, vr) for s in range(2)] + [vlm_eval("mrope", s, mr, mr) for s in range(2)]
    vlm += [vlm_eval("mrope_i", s, [1.0, 1.0, 0.5, 0.5]) for s in range(2)]
    a, b = (0.8, 0.3) if ri_wins else (0.3, 0.8)
    pts = [points_eval("pape_ri", s, 0.8, a, 0.7) for s in range(2)] + [points_eval("pape", s, 0.85, b, 0.7)
                                                                        for s in range(2)]  # fmt: skip
    for fam, runs in (("vit", vit), ("vlm", vlm), ("points", pts)):
        (root / fam).mkdir(parents=True, exist_ok=True)
        (root / fam / "runs.json").write_text(json.dumps({"runs": runs}))
    return root


def sentence(claims: list[str], what: str) -> str:
    (s,) = [c for c in claims if c.startswith(f"**{what}**")]
    return s


# ------------------------------------------------------------------------------------------------------------
# statistics and tables
# ------------------------------------------------------------------------------------------------------------


def test_stat_mean_and_sample_std():
    s = report.Stat.of([0.5, 0.7, None])
    assert s.n == 2 and s.mean == pytest.approx(0.6) and s.std == pytest.approx(0.1414213562)  # sqrt(0.02)
    assert s.text() == "60.0 ± 14.1"
    assert report.Stat.of([0.25]).text() == "25.0" and report.Stat.of([]).text() == "–"


def test_vit_aggregate_hand_values():
    evals = [vit_eval("rope", 0, [0.9, 0.5, 0.3]), vit_eval("rope", 1, [0.7, 0.5, 0.1])]
    agg = report.aggregate_vit(evals)["encodings"]["rope"]
    assert agg["in_distribution"]["mean"] == pytest.approx(0.8)
    assert agg["extrapolated"]["mean"] == pytest.approx((0.4 + 0.3) / 2)  # per seed: mean(0.5, 0.3), mean(0.5, 0.1)
    assert agg["extrapolated"]["std"] == pytest.approx(0.0707106781)
    assert agg["acc"][2]["mean"] == pytest.approx(0.2) and agg["seeds"] == 2


def test_vlm_aggregate_in_distribution_and_extrapolated():
    agg = report.aggregate_vlm([vlm_eval("mrope", 0, [1.0, 0.8, 0.4, 0.2]), vlm_eval("mrope", 1, [1.0, 0.6, 0.2, 0.0])])
    t = agg["variants"]["mrope"]["tasks"]["v_niah"]["teacher"]
    assert t["in_distribution"]["mean"] == pytest.approx((0.9 + 0.8) / 2)  # lengths 4 and 8 (<= 8 frames)
    assert t["extrapolated"]["mean"] == pytest.approx((0.3 + 0.1) / 2)  # lengths 16 and 32
    assert t["grid"][0] == pytest.approx([1.0, 0.7, 0.3, 0.1])


def test_points_aggregate_drop():
    agg = report.aggregate_points([points_eval("rope", 0, 0.8, 0.2, 0.7), points_eval("rope", 1, 0.6, 0.4, 0.5)])
    assert agg["encodings"]["rope"]["so3_minus_z"]["mean"] == pytest.approx(-0.4)
    assert agg["encodings"]["rope"]["acc"][1]["mean"] == pytest.approx(0.3)


# ------------------------------------------------------------------------------------------------------------
# claims follow the numbers
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flip", [False, True])
def test_claim_sentences_flip_with_the_numbers(tmp_path, flip):
    root = write_results(tmp_path / "results", lookhere_wins=not flip, videorope_wins=not flip, ri_wins=not flip)
    summary = report.report(root, readme=None)
    cl = summary["claims"]
    want, other = ("disagrees", "agrees") if flip else ("agrees", "disagrees")
    for what in ("LookHere vs 2D RoPE", "VideoRoPE vs MRoPE", "VideoRoPE vs MRoPE with distractors",
                 "PaPE-RI under rotation"):  # fmt: skip
        s = sentence(cl, what)
        assert f"which {want} with the direction" in s and f"which {other} with" not in s, s
        assert "exceeds the seed spread" in s, s
    # LookHere 0.60/0.61 vs RoPE 0.20/0.21 at 4.57x: +40.0 points (or -40.0)
    assert ("+40.0 points" if not flip else "-40.0 points") in sentence(cl, "LookHere vs 2D RoPE")
    # PaPE (0.4) vs LookHere at 4.57x: LookHere is 0.605 (wins) or 0.205 (flipped)
    pape = sentence(cl, "PaPE vs LookHere")
    assert ("which disagrees" if not flip else "which agrees") in pape
    # the table in the README section carries the same numbers
    text = (root / "README.md").read_text()
    assert ("| lookhere | 2 | 90.5 ± 0.7 | 65.5 ± 0.7 |" if not flip else "| lookhere | 2 | 90.5 ± 0.7 | 35.5 ± 0.7 |") in text


def test_claim_within_spread_and_missing():
    a, b = report.Stat(0.52, 0.05, 3), report.Stat(0.50, 0.04, 3)
    s = report.compare("X vs Y", "paper", "X", a, "Y", b, "top-1")
    assert "which agrees" in s and "within the seed spread" in s
    s = report.compare("X vs Y", "paper", "X", b, "Y", a, "top-1")
    assert "which disagrees" in s and "within the seed spread" in s
    s = report.compare("X vs Y", "paper", "X", report.Stat(None, 0.0, 0), "Y", a, "top-1")
    assert "not measured" in s and "X" in s
    hope = report.claims({"vlm": report.aggregate_vlm([vlm_eval("mrope", 0, [1, 1, 0, 0])])})
    assert any(c.startswith("**HoPE vs MRoPE**") and "not measured" in c for c in hope)


# ------------------------------------------------------------------------------------------------------------
# README markers
# ------------------------------------------------------------------------------------------------------------


def test_readme_only_between_markers_changes(tmp_path):
    root = write_results(tmp_path / "results", lookhere_wins=True, videorope_wins=True, ri_wins=True)
    before, after = "# Project\n\nIntro text.\n\n", "\n\n## Licence\n\nMIT\n"
    readme = tmp_path / "README.md"
    readme.write_text(before + report.START + "\nold results\n" + report.END + after)
    report.report(root, readme=readme)
    text = readme.read_text()
    assert text.startswith(before + report.START) and text.endswith(report.END + after)
    inner = text[len(before) + len(report.START): -len(report.END + after)]
    assert "old results" not in inner and "## Results" in inner and "which agrees" in inner
    # flip the numbers: the sentence flips, still only between the markers
    write_results(root, lookhere_wins=False, videorope_wins=False, ri_wins=False)
    report.report(root, readme=readme)
    flipped = readme.read_text()
    assert flipped.startswith(before + report.START) and flipped.endswith(report.END + after)
    assert sentence(report.claims(json_summary(root)), "LookHere vs 2D RoPE") in flipped
    assert "LookHere 20.5 ± 0.7 vs RoPE 60.5 ± 0.7" in flipped and "which disagrees" in flipped
    assert not report.update_readme(readme, (root / "README.md").read_text())  # same numbers: unchanged


def json_summary(root: Path) -> dict:
    return {fam: json.loads((root / fam / "summary.json").read_text()) for fam in ("vit", "vlm", "points")}


def test_readme_markers_appended_when_absent_and_lone_marker_rejected(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\nText without markers.\n")
    assert report.update_readme(readme, "## Results\n\nnumbers\n")
    text = readme.read_text()
    assert text.startswith("# Project\n\nText without markers.\n")
    assert text.endswith(f"{report.START}\n## Results\n\nnumbers\n{report.END}\n")
    readme.write_text(f"# Project\n{report.START}\nno end marker\n")
    with pytest.raises(ValueError, match="expected one"):
        report.update_readme(readme, "x")


def test_report_writes_tables_plots_and_summary(tmp_path):
    from matplotlib.image import imread

    root = write_results(tmp_path / "results", lookhere_wins=True, videorope_wins=True, ri_wins=True)
    report.report(root, readme=None)
    for rel in ("vit/resolution.png", "vlm/accuracy_vs_length.png", "vlm/heatmap_videorope.png",
                "vlm/heatmap_mrope.png"):  # fmt: skip
        img = imread(root / rel)
        assert img.ndim == 3 and min(img.shape[:2]) > 100 and (root / rel).stat().st_size < 200_000, rel
    md = (root / "vit" / "resolution.md").read_text()
    assert "| rope | 2 | 90.5 ± 0.7 | 35.5 ± 0.7 |" in md  # in-dist 0.90/0.91, extrapolated mean(0.5, 0.2) + s/100
    assert "| videorope | 2 | 95.0 ± 0.0 | 70.0 ± 0.0 |" in (root / "vlm" / "long_video.md").read_text()
    assert (root / "points" / "points.md").is_file() and (root / "vit" / "summary.json").is_file()


# ------------------------------------------------------------------------------------------------------------
# plan and resumability
# ------------------------------------------------------------------------------------------------------------


def test_plan_defaults_all_and_named(tmp_path):
    prof = report.PROFILES["small"]
    plan = report.plan_runs(["vit", "vlm"], encodings=None, seeds=2, profile=prof, steps=None, runs_dir=tmp_path)
    vit = {s.encoding for s in plan if s.family == "vit"}
    assert vit == set(report.DEFAULT_ENCODINGS["vit"])
    vlm = {s.encoding for s in plan if s.family == "vlm"}
    assert vlm == set(report.DEFAULT_ENCODINGS["vlm"]) and vlm <= set(report.discover("vlm"))
    assert len(plan) == 2 * (len(vit) + len(vlm))
    every = report.plan_runs(["vit"], encodings=["all"], seeds=1, profile=prof, steps=7, runs_dir=tmp_path)
    assert {s.encoding for s in every} == {p.stem[4:] for p in (ROOT / "configs").glob("vit_*.yaml")}
    assert every[0].out_dir == tmp_path / "vit" / "steps7" / f"{every[0].encoding}_seed0"
    named = report.plan_runs(["vit", "points"], encodings=["pape_ri"], seeds=1, profile=prof, steps=None,
                             runs_dir=tmp_path)  # fmt: skip
    assert [(s.family, s.encoding) for s in named] == [("vit", "pape_ri"), ("points", "pape_ri")]
    with pytest.raises(ValueError, match="no config"):
        report.plan_runs(["vit"], encodings=["no_such"], seeds=1, profile=prof, steps=None, runs_dir=tmp_path)


def test_finished_runs_are_not_run_again(tmp_path, monkeypatch):
    prof = report.PROFILES["small"]
    (spec,) = report.plan_runs(["vit"], encodings=["rope"], seeds=1, profile=prof, steps=None, runs_dir=tmp_path)
    spec.out_dir.mkdir(parents=True)
    (spec.out_dir / "model.safetensors").write_bytes(b"exported")
    cmd, result = report._eval_cmd(spec, prof)
    result.parent.mkdir()
    result.write_text(json.dumps({"runs": [vit_eval("rope", 0, [0.9, 0.5, 0.3])]}))
    wanted = {"cmd": [c for c in cmd[2:] if c not in (str(spec.out_dir), str(spec.out_dir / "eval"))]}
    (result.parent / "settings.json").write_text(json.dumps(wanted))
    calls = []
    monkeypatch.setattr(report, "run_logged", lambda *a, **k: calls.append(a) or (1, 0.0, 0.0))
    out = report.execute(spec, prof, fresh=False, threads=1, status={})
    assert out.error is None and out.eval_path == result and calls == []
    # other evaluation settings: the evaluation (only) is run again
    (result.parent / "settings.json").write_text(json.dumps({"cmd": ["--limit", "1"]}))
    out = report.execute(spec, prof, fresh=False, threads=1, status={})
    assert len(calls) == 1 and "resolution.py" in calls[0][0][1] and out.error and "evaluation failed" in out.error
