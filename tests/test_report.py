"""The benchmark report (eval/report.py, aggregate.py, suite.py) on hand-made records.

What is checked:
- summary.json has the schema the README promises (families -> rows -> in_distribution / extrapolated / per-condition
  cells, each with mean, std, n, ci95), accuracies as fractions, means computed by hand from the outcomes;
- claims.json has one entry per registered claim (eval/claims.py) with verdict, diff, ci95, seeds, look and margin in
  points; with the first look's 5 seeds of a constant difference the claim is decided there; swapping the two rows'
  outcomes flips the sign and the verdict; a claim whose rows are missing says "not measured"; a record of another
  claims protocol is left out of the decisions (and listed) but stays in the summary tables;
- the PaPE-RI claim is the difference of the two rows' (SO(3) - z) contrasts, by hand;
- the README: only the text between the markers changes; a second report with the same records changes nothing;
- the suite: a job whose record matches its fingerprint is neither trained nor evaluated again; a stale record is
  redone; records of another protocol are ignored by the report; a new record stores the claims fingerprint and its
  provenance (commit, the files that made it dirty, library versions numpy and scipy included, CPU model, threads);
- results/claims.json is recomputed from the committed records; the claims' history is read from git.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

import report  # noqa: E402
import suite  # noqa: E402
from claims import CLAIMS, fingerprint  # noqa: E402
from protocols import PROTOCOLS  # noqa: E402
from stats import pack_bits  # noqa: E402

N = 40  # items per seed
RATIOS = [1.0, 2.0, 4.57]


def _bits(acc: float, seed: int, salt: int) -> dict:
    """Outcomes with exactly round(acc * N) correct items (deterministic, shuffled by seed and salt)."""
    k = int(round(acc * N))
    v = np.zeros(N, bool)
    v[:k] = True
    np.random.default_rng(1000 * seed + salt).shuffle(v)
    return pack_bits(v)


def vit_ev(accs, seed, salt=0):
    return {"name": "x", "encoding": "x", "num_classes": 10, "train_size": 28, "patch_size": 4, "scaling": None,
            "results": [{"ratio": r, "size": int(28 * r), "acc": a, "outcomes": _bits(a, seed, salt + i)}
                        for i, (r, a) in enumerate(zip(RATIOS, accs))]}  # fmt: skip


def vlm_ev(per_length, seed, salt=0):
    L = [4, 8, 16, 32]

    def entry(pl, off):
        return {"grid": [list(pl)], "outcomes": [_bits(a, seed, salt + off + i) for i, a in enumerate(pl)]}

    return {"name": "x", "variant": "x", "train_frames": 8, "lengths": L, "depths": [0.5], "samples_per_cell": N,
            "chance": 0.125, "tasks": {"v_niah": {"teacher": entry(per_length, 0)},
                                       "v_niah_d": {"teacher": entry(per_length, 10)}}}  # fmt: skip


def pts_ev(z, so3, x2, seed, salt=0):
    res = [("rotation", "z", 512, z), ("rotation", "so3", 512, so3), ("points", "z", 1024, x2)]
    return {"name": "x", "encoding": "x", "num_classes": 10, "train_rotation": "z", "train_points": 512,
            "results": [{"condition": c, "rotation": r, "points": n, "acc": a, "outcomes": _bits(a, seed, salt + i)}
                        for i, (c, r, n, a) in enumerate(res)]}  # fmt: skip


def write_record(results: Path, family: str, encoding: str, seed: int, rows: dict) -> None:
    job = suite.Job(PROTOCOLS[family], encoding, seed, Path("unused"), results)
    rec = {"family": family, "encoding": encoding, "seed": seed, "fingerprint": job.fingerprint,
           "eval_args": job.eval_args, "timing": {"train": {"cpu_s": 10.0, "wall_s": 11.0},
                                                  "eval": {"cpu_s": 5.0, "wall_s": 6.0}},
           "val_curve": [[1, 0.5], [2, 0.8]], "rows": rows}  # fmt: skip
    path = suite.record_path(results, family, encoding, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))


#: the rows the other claims compare, filled with their reference row's accuracies (a difference of exactly 0)
VIT_FILLERS = ("pape", "peg", "ape", "fire", "rope_mixed")
VLM_FILLERS = ("hope_video", "mrope_i", "vrope", "v2pe", "mhrope")
SHAPES_FILLERS = ("peg", "ape")


def make_results(root: Path, *, lookhere_wins: bool = True, without: tuple[str, ...] = ()) -> Path:
    """Five seeds (the first look) of every row a claim reads; ``without``: filler rows left unmeasured."""
    results = root / "results"
    good, bad = [0.9, 0.7, 0.6], [0.9, 0.5, 0.2]
    lh, rope = (good, bad) if lookhere_wins else (bad, good)
    for s in range(5):  # the first look of the claims' design
        d = 0.025 * s
        write_record(results, "vit", "lookhere", s, {"lookhere": vit_ev([a - d for a in lh], s, 0)})
        write_record(results, "vit", "rope", s, {"rope": vit_ev([a - d for a in rope], s, 100),
                                                 "rope+yarn": vit_ev([0.9, 0.6, 0.3], s, 200),
                                                 "rope+ntk": vit_ev([a - d for a in rope], s, 300)})  # fmt: skip
        write_record(results, "vlm", "videorope", s, {"videorope": vlm_ev([1.0, 1.0, 0.8, 0.6], s, 0)})
        write_record(results, "vlm", "mrope", s, {"mrope": vlm_ev([1.0, 1.0, 0.6, 0.3], s, 100)})
        write_record(results, "points", "pape_ri", s, {"pape_ri": pts_ev(0.8, 0.75, 0.7, s, 0)})
        write_record(results, "points", "pape", s, {"pape": pts_ev(0.85, 0.35, 0.7, s, 100)})
        for k, enc in enumerate(e for e in SHAPES_FILLERS if e not in without):  # PEG vs APE: a difference of 0
            write_record(results, "shapes", enc, s, {enc: vit_ev([a - d for a in rope], s, 500)})
        for k, enc in enumerate(e for e in VIT_FILLERS if e not in without):
            write_record(results, "vit", enc, s, {enc: vit_ev([a - d for a in rope], s, 400 + 10 * k)})
        for k, enc in enumerate(e for e in VLM_FILLERS if e not in without):
            write_record(results, "vlm", enc, s, {enc: vlm_ev([1.0, 1.0, 0.6, 0.3], s, 400 + 10 * k)})
    return results


def test_summary_schema_and_hand_computed_means(tmp_path):
    results = make_results(tmp_path)
    out = report.report(results, readme=None, reps=200)
    summary = json.loads((results / "summary.json").read_text())
    assert set(summary["families"]) == {"vit", "shapes", "vlm", "points"}
    lh = summary["families"]["vit"]["rows"]["lookhere"]
    for key in ("in_distribution", "extrapolated", "x1", "x2", "x4.57"):
        assert {"mean", "std", "n", "ci95"} <= set(lh[key]), key
        assert lh[key]["n"] == 5 and len(lh[key]["ci95"]) == 2
    # per seed s the accuracies are exactly round((a - 0.025 s) * 40) / 40
    per_seed = [[round((a - 0.025 * s) * N) / N for a in (0.9, 0.7, 0.6)] for s in range(5)]
    assert lh["in_distribution"]["mean"] == pytest.approx(np.mean([p[0] for p in per_seed]))
    assert lh["extrapolated"]["mean"] == pytest.approx(np.mean([(p[1] + p[2]) / 2 for p in per_seed]))
    assert lh["x4.57"]["std"] == pytest.approx(np.std([p[2] for p in per_seed], ddof=1))
    lo, hi = lh["x4.57"]["ci95"]
    assert lo < lh["x4.57"]["mean"] < hi
    vlm = summary["families"]["vlm"]["rows"]["videorope"]
    assert vlm["in_distribution"]["mean"] == pytest.approx(1.0)
    assert vlm["extrapolated"]["mean"] == pytest.approx((0.8 + 0.6) / 2)
    assert vlm["v_niah_d_extrapolated"]["mean"] == pytest.approx((0.8 + 0.6) / 2)
    pts = summary["families"]["points"]["rows"]["pape"]
    assert pts["in_distribution"]["mean"] == pytest.approx(0.85)
    assert pts["so3_minus_z"]["mean"] == pytest.approx(0.35 - 0.85)
    assert pts["extrapolated"]["mean"] == pytest.approx((0.35 + 0.7) / 2)
    assert "rope+yarn" in summary["families"]["vit"]["rows"]
    assert out["timing"]["estimate_h"] is not None
    for png in ("vit/resolution.png", "vlm/accuracy_vs_length.png", "vlm/heatmap_mrope.png", "points/conditions.png"):
        assert (results / png).stat().st_size > 1000


def _claim(claims, name):
    return next(c for c in claims if c["claim"].startswith(name))


def test_claims_follow_the_measurements(tmp_path):
    results = make_results(tmp_path / "a", lookhere_wins=True)
    report.report(results, readme=None, reps=200)
    claims = json.loads((results / "claims.json").read_text())
    assert [c["claim"] for c in claims] == [c.claim for c in CLAIMS]
    for c in claims:
        assert {"claim", "paper", "diff", "ci95", "verdict", "seeds", "look", "margin"} <= set(c)
        assert c["verdict"] in ("agrees", "disagrees", "equivalent", "unresolved", "open", "not measured")
        assert "precision_met" not in c and "seeds_needed" not in c  # the retired fixed-precision target
    lh = _claim(claims, "LookHere > 2D RoPE")
    assert lh["diff"] == pytest.approx(100 * (0.6 - 0.2), abs=1e-9)  # the same 0.4 on every seed: sd 0
    assert lh["verdict"] == "agrees" and lh["ci95"][0] > 0 and lh["look"] == 1 and lh["seeds"] == [0, 1, 2, 3, 4]
    assert lh["margin"] == 5.0 and lh["alpha_look"] == pytest.approx(0.02 * 0.05 / len(CLAIMS))
    vr = _claim(claims, "VideoRoPE > MRoPE on V-NIAH-D")
    assert vr["diff"] == pytest.approx(100 * ((0.8 + 0.6) / 2 - (0.6 + 0.3) / 2))
    ri = _claim(claims, "PaPE-RI robust")
    assert ri["diff"] == pytest.approx(100 * ((0.75 - 0.8) - (0.35 - 0.85)))
    assert ri["verdict"] == "agrees"
    fire = _claim(claims, "FIRE > 2D RoPE")  # the same accuracies as RoPE on every seed: a difference of 0
    assert fire["diff"] == 0 and fire["verdict"] == "equivalent" and fire["look"] == 1
    assert (results / "claims.png").stat().st_size > 1000

    # a row not yet measured holds the look back for every claim: nothing is decided, HoPE's claim says why
    waiting = make_results(tmp_path / "w", without=("hope_video",))
    report.report(waiting, readme=None, reps=200)
    claims = json.loads((waiting / "claims.json").read_text())
    assert _claim(claims, "HoPE")["verdict"] == "not measured"
    assert {c["verdict"] for c in claims} == {"open", "not measured"}
    assert _claim(claims, "LookHere > 2D RoPE")["look"] is None

    flipped = make_results(tmp_path / "b", lookhere_wins=False)
    report.report(flipped, readme=None, reps=200)
    lh2 = _claim(json.loads((flipped / "claims.json").read_text()), "LookHere > 2D RoPE")
    assert lh2["diff"] == pytest.approx(-lh["diff"]) and lh2["verdict"] == "disagrees"


def test_records_of_another_claims_protocol_stay_out_of_the_decisions(tmp_path):
    results = make_results(tmp_path)
    path = suite.record_path(results, "vlm", "mrope", 0)
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**rec, "claims_fingerprint": "0123456789ab"}))
    report.report(results, readme=None, reps=200)
    claims = json.loads((results / "claims.json").read_text())
    vr = _claim(claims, "VideoRoPE > MRoPE on V-NIAH-D")
    assert vr["verdict"] == "open" and vr["look"] is None and vr["seeds"] == [1, 2, 3, 4]  # seed 0 is missing
    assert any("vlm/mrope_seed0" in m and "0123456789ab" in m for m in vr["refused"])
    assert vr["protocol"] == fingerprint()
    summary = json.loads((results / "summary.json").read_text())
    assert summary["families"]["vlm"]["rows"]["mrope"]["seeds"] == [0, 1, 2, 3, 4]  # the tables keep it


def test_readme_only_between_markers_and_idempotent(tmp_path):
    results = make_results(tmp_path)
    readme = tmp_path / "README.md"
    before, after = "# Title\n\nintro\n\n", "\n\n## Later\ntext\n"
    readme.write_text(before + report.START + "\nold\n" + report.END + after)
    report.report(results, readme=readme, reps=200)
    text = readme.read_text()
    assert text.startswith(before + report.START) and text.endswith(report.END + after)
    assert "LookHere > 2D RoPE" in text and "**agrees**" in text
    assert "validation accuracy changed by +30.0 points" in text  # every fake curve goes 0.5 -> 0.8
    report.report(results, readme=readme, reps=200)
    assert readme.read_text() == text
    lone = tmp_path / "lone.md"
    lone.write_text("x\n" + report.START + "\n")
    with pytest.raises(ValueError, match="markers|expected one"):
        report.update_readme(lone, "s")


def test_suite_reuses_matching_records_and_redoes_stale_ones(tmp_path, monkeypatch):
    results = tmp_path / "results"
    calls = []
    monkeypatch.setattr(suite, "run_logged", lambda cmd, log, env: calls.append(cmd) or (1, 0.0, 0.0))
    jobs = suite.plan(["vlm"], encodings=["mrope"], seeds=2, runs_dir=tmp_path / "runs", results_dir=results)
    assert [j.seed for j in jobs] == [0, 1] and jobs[0].scalings == ["none", "yarn"]
    write_record(results, "vlm", "mrope", 0, {"mrope": vlm_ev([1, 1, 1, 1], 0), "mrope+yarn_t": vlm_ev([1, 1, 1, 1], 0)})
    errors = suite.run_jobs(jobs, jobs_at_once=1, progress=False)
    assert len(calls) == 1 and "train" in str(calls[0][1])  # only seed 1 was attempted
    assert len(errors) == 1 and "seed1" in errors[0]
    stale = json.loads(suite.record_path(results, "vlm", "mrope", 0).read_text())
    stale["fingerprint"] = "0" * 12
    suite.record_path(results, "vlm", "mrope", 0).write_text(json.dumps(stale))
    assert suite.load_records(results, "vlm") == []  # another protocol's record is not reported
    calls.clear()
    suite.run_jobs(jobs[:1], jobs_at_once=1, progress=False)
    assert len(calls) == 1  # the stale record is redone


def test_reevaluate_redoes_only_the_evaluation_of_runs_with_weights(tmp_path, monkeypatch):
    results = tmp_path / "results"
    calls = []
    monkeypatch.setattr(suite, "run_logged", lambda cmd, log, env: calls.append(cmd) or (1, 0.0, 0.0))
    jobs = suite.plan(["vlm"], encodings=["mrope"], seeds=2, runs_dir=tmp_path / "runs", results_dir=results)
    for seed in (0, 1):
        write_record(results, "vlm", "mrope", seed,
                     {"mrope": vlm_ev([1, 1, 1, 1], seed), "mrope+yarn_t": vlm_ev([1, 1, 1, 1], seed)})
    jobs[0].run_dir.mkdir(parents=True)
    (jobs[0].run_dir / "model.safetensors").write_bytes(b"")  # seed 0 has weights, seed 1 only its record
    assert suite.run_jobs(jobs, jobs_at_once=1, progress=False) == [] and calls == []  # plain: all reused
    errors = suite.run_jobs(jobs, jobs_at_once=1, reevaluate=True, progress=False)
    assert len(calls) == 1 and "eval" in str(calls[0][1]) and "train" not in str(calls[0][1])
    assert len(errors) == 1 and "seed0" in errors[0] and "evaluation failed" in errors[0]


def test_a_new_record_stores_the_claims_fingerprint_and_its_provenance(tmp_path, monkeypatch):
    results = tmp_path / "results"
    job = suite.plan(["vlm"], encodings=["mrope"], seeds=1, runs_dir=tmp_path / "runs", results_dir=results)[0]

    def fake(cmd, log, env):  # training writes the weights, the evaluation its result
        if "train" in str(cmd[1]):
            job.run_dir.mkdir(parents=True, exist_ok=True)
            (job.run_dir / "model.safetensors").write_bytes(b"")
        else:
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            runs = [{**vlm_ev([1, 1, 1, 1], 0), "scaling": sc} for sc in (None, "yarn")]
            (out / "long_video.json").write_text(json.dumps({"runs": runs}))
        return 0, 1.0, 1.0

    monkeypatch.setattr(suite, "run_logged", fake)
    assert suite.run_jobs([job], jobs_at_once=1, progress=False) == []
    rec = json.loads(suite.record_path(results, "vlm", "mrope", 0).read_text())
    assert rec["claims_fingerprint"] == fingerprint()
    prov = rec["provenance"]
    assert {"commit", "dirty", "torch", "deepspeed", "transformers", "cpu", "threads"} <= set(prov)
    assert prov["threads"] >= 1 and prov["torch"] == __import__("torch").__version__.split("+")[0]
    head = __import__("subprocess").run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert prov["commit"] == (head.stdout.strip() or None)
    import numpy
    import scipy

    assert prov["numpy"] == numpy.__version__ and prov["scipy"] == scipy.__version__
    assert prov["dirty"] == bool(prov["dirty_files"])
    real = suite._git
    porcelain = " M eval/report.py\nM  README.md\nMM tests/test_report.py"  # as git prints it, then stripped
    monkeypatch.setattr(suite, "_git", lambda *a: porcelain.strip() if a[0] == "status" else real(*a))
    prov = suite.provenance(1)
    assert prov["dirty"] is True and prov["dirty_files"] == ["README.md", "eval/report.py", "tests/test_report.py"]
    monkeypatch.setattr(suite, "_git", lambda *a: "" if a[0] == "status" else real(*a))
    assert suite.provenance(1)["dirty_files"] == [] and suite.provenance(1)["dirty"] is False


def test_plan_errors():
    with pytest.raises(ValueError, match="family"):
        suite.plan(["nope"], runs_dir=Path("r"), results_dir=Path("s"))
    with pytest.raises(ValueError, match="in no protocol"):
        suite.plan(["vit"], encodings=["not_an_encoding"], runs_dir=Path("r"), results_dir=Path("s"))
    allv = suite.plan(["vit"], encodings=["all"], seeds=1, runs_dir=Path("r"), results_dir=Path("s"))
    assert {j.encoding for j in allv} >= {"rope", "fire", "rope_dinov3", "pape_ri"}


@pytest.mark.parametrize("family", ["vit", "shapes"])
def test_image_protocol_slices_are_disjoint_and_exist_up_to_every_claims_cap(family):
    """Seed k's test images 500k ... 500k+499 must exist in the 10,000 test images for every seed a claim of the
    family may spend (its cap), and the protocol's ``max_seeds`` says how far they reach."""
    p = PROTOCOLS[family]
    assert "data.val_limit=null" in p.train and "data.holdout=1000" in p.train  # validation: held-out train images
    limit = int(p.eval_args[p.eval_args.index("--limit") + 1])
    caps = [c.cap for c in CLAIMS if c.family == family]
    assert caps and max(caps) <= p.max_seeds
    starts = [int(p.seed_args(k)[1]) for k in range(p.max_seeds)]
    assert all(b - a >= limit for a, b in zip(starts, starts[1:]))  # disjoint
    assert starts[-1] + limit <= 10_000  # the Fashion-MNIST test set / data.shapes_test


def test_next_look_jobs_map_rows_to_their_runs_and_keep_to_the_families(tmp_path):
    """The sequential suite asks for the encodings (not the rows) of the open claims' next look, seed-major, only in
    the families it runs; a scaled row (rope+yarn) is a run of its encoding."""
    entries = []
    for c in CLAIMS:
        have = {r: list(range(5)) for r in (c.better, c.other)}
        entries.append({"verdict": "open", "next_look": 10, "row_seeds": have})
    jobs = report.next_look_jobs(entries, ["vit"], runs_dir=tmp_path / "r", results_dir=tmp_path / "s")
    assert {j.family for j in jobs} == {"vit"}
    want = {r for c in CLAIMS if c.family == "vit" for r in (c.better, c.other)}
    encs = {next((r.encoding for r in PROTOCOLS["vit"].rows if r.name == w), w) for w in want}
    assert {j.encoding for j in jobs} == encs and "rope+yarn" not in encs and "rope" in encs
    assert sorted({j.seed for j in jobs}) == list(range(5, 10))
    assert [j.seed for j in jobs] == sorted(j.seed for j in jobs)  # seed-major
    decided = [{**e, "verdict": "agrees"} for e in entries]
    assert report.next_look_jobs(decided, ["vit", "vlm"], runs_dir=tmp_path, results_dir=tmp_path) == []


def test_each_suite_invocation_is_logged_with_its_wall_time(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    report.log_invocation(results, families=["vlm"], jobs=2, runs=3, wall_s=12.34)
    report.log_invocation(results, families=["points"], jobs=2, runs=0, wall_s=1.0)
    inv = json.loads((results / "timing.json").read_text())["invocations"]
    assert [i["families"] for i in inv] == [["vlm"], ["points"]] and inv[0]["wall_s"] == 12.3
    assert inv[0]["claims_protocol"] == fingerprint() and inv[0]["runs"] == 3
    t = report.timing({}, {})
    t["invocations"] = inv
    assert "0.00 h wall in all (vlm 0.00 h" in report._timing_text(t)  # only invocations that ran something


def test_the_training_fingerprint_reads_what_the_configs_say_not_how(tmp_path, monkeypatch):
    """A comment or a layout change in a config (or in the file it inherits) keeps every run; a changed value
    retrains. (A reworded comment in configs/_vit.yaml once orphaned all 45 ViT records.)"""
    import protocols

    (tmp_path / "_base.yaml").write_text("# shared\nmodel:\n  depth: 4\ntrain:\n  lr: 2.0e-3\n")
    (tmp_path / "vit_x.yaml").write_text("inherit: _base.yaml\nmodel:\n  encoding: x\n")
    monkeypatch.setattr(protocols, "config_path", lambda p, e: tmp_path / f"vit_{e}.yaml")
    p = PROTOCOLS["vit"]
    before = protocols.train_fingerprint(p, "x")
    (tmp_path / "_base.yaml").write_text("# shared defaults, described anew\nmodel: {depth: 4}\ntrain:\n  lr: 0.002\n")
    assert protocols.train_fingerprint(p, "x") == before
    (tmp_path / "_base.yaml").write_text("model:\n  depth: 5\ntrain:\n  lr: 2.0e-3\n")
    assert protocols.train_fingerprint(p, "x") != before
    (tmp_path / "_base.yaml").write_text("# shared\nmodel:\n  depth: 4\ntrain:\n  lr: 2.0e-3\n")
    (tmp_path / "vit_x.yaml").write_text("inherit: _base.yaml\nmodel:\n  encoding: y\n")
    assert protocols.train_fingerprint(p, "x") != before


def test_every_committed_record_matches_todays_protocol():
    """The records under results/ are the runs of today's configs and overrides: a config edit that changes what
    a run trains (and so orphans its records) shows here, not as a family silently dropped from the report."""
    from protocols import train_fingerprint

    records = sorted((ROOT / "results").glob("*/runs/*.json"))
    assert records
    stale = []
    for path in records:
        rec = json.loads(path.read_text())
        if rec["fingerprint"] != train_fingerprint(PROTOCOLS[rec["family"]], rec["encoding"]):
            stale.append(path.name)
    assert not stale, f"records whose configs changed since they ran: {stale}"


def test_a_claim_whose_rows_share_no_seed_says_so(tmp_path):
    results = make_results(tmp_path)
    for s in range(5):  # PaPE-RI's runs moved to seeds 5-9: both rows exist, no seed in common
        path = suite.record_path(results, "points", "pape_ri", s)
        rec = json.loads(path.read_text())
        path.unlink()
        write_record(results, "points", "pape_ri", s + 5, rec["rows"])
        moved = suite.record_path(results, "points", "pape_ri", s + 5)  # seeds past the first look: current protocol
        moved.write_text(json.dumps({**json.loads(moved.read_text()), "claims_fingerprint": fingerprint()}))
    report.report(results, readme=None, reps=200)
    ri = _claim(json.loads((results / "claims.json").read_text()), "PaPE-RI robust")
    assert ri["verdict"] == "not measured" and ri["reason"] == "no seed common to pape_ri and pape"


def test_the_vlm_claims_range_is_two_to_eight_times_the_training_length():
    """``near`` (what the V-NIAH claims read) weighs the lengths 2T ... 8T equally and nothing else; ``extrapolated``
    every length above T."""
    import aggregate

    L = [4, 8, 16, 32, 64, 128, 256]
    conds = [aggregate.Condition(f"{t}@{n}", "") for t in ("v_niah", "v_niah_d") for n in L]
    sel = aggregate.family_selectors("vlm", conds, {"train_frames": 8})
    near = dict(zip([c.key for c in conds], sel["near"]))
    assert {k for k, w in near.items() if w} == {"v_niah@16", "v_niah@32", "v_niah@64"}
    assert all(abs(w - 1 / 3) < 1e-12 for w in near.values() if w)
    d_near = dict(zip([c.key for c in conds], sel["v_niah_d_near"]))
    assert {k for k, w in d_near.items() if w} == {"v_niah_d@16", "v_niah_d@32", "v_niah_d@64"}
    assert sum(1 for w in sel["extrapolated"] if w) == 5


def test_suite_runs_import_the_checkout_that_runs_them(tmp_path, monkeypatch):
    """A run started by the suite imports this checkout's packages, whatever else is on the path (runs of a second
    worktree sharing one .venv once imported the first checkout's working tree through its .pth file): a decoy
    checkout on PYTHONPATH must not win."""
    import subprocess
    import sys

    decoy = tmp_path / "decoy"
    for pkg in ("vlpe", "models", "train"):
        (decoy / pkg).mkdir(parents=True)
        (decoy / pkg / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(decoy))
    env = suite._child_env(1)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(suite.ROOT)
    code = "import vlpe, models, train; print(vlpe.__file__); print(models.__file__); print(train.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert all(line.startswith(str(suite.ROOT)) for line in out.stdout.split()), out.stdout


def test_a_stopped_suite_stops_its_runs_keeps_their_cost_and_logs_itself(tmp_path):
    """SIGTERM to ``report.py --suite`` (a session's end, a scheduler's preemption) stops the training in flight,
    starts nothing new, keeps the stopped attempt's time in the run's timing.json (the resumed run's record counts
    it) and appends the invocation to results/timing.json marked ``interrupted``; the old code died without logging
    and left its child running."""
    import signal
    import subprocess
    import sys
    import time

    results, runs, pidfile = tmp_path / "results", tmp_path / "runs", tmp_path / "child.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    driver = (
        "import sys, suite, report\n"
        f"suite.job_command_train = lambda job: [sys.executable, '-c', {child!r}]\n"
        f"sys.exit(report.main(['--suite', '--families', 'vlm', '--encodings', 'mrope', 'videorope', '--seeds', '1',"
        f" '--jobs', '1', '--results', {str(results)!r}, '--runs', {str(runs)!r}, '--readme', '', '--no-progress']))\n"
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "eval"), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (pidfile.is_file() and pidfile.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        child_pid = int(pidfile.read_text())
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "stopped after" in err and "resume from their checkpoints" in err
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)  # the training run in flight was stopped (and reaped), not orphaned
    inv = json.loads((results / "timing.json").read_text())["invocations"]
    assert len(inv) == 1 and inv[0]["interrupted"] is True and inv[0]["runs"] == 0 and inv[0]["wall_s"] > 0
    (job,) = [j for j in suite.plan(["vlm"], encodings=["mrope"], seeds=1, runs_dir=runs, results_dir=results)]
    spent = json.loads((job.run_dir / "timing.json").read_text())["train"]
    assert spent["wall_s"] >= 0.5  # the stopped attempt's cost is kept for the resumed record
    other = suite.plan(["vlm"], encodings=["videorope"], seeds=1, runs_dir=runs, results_dir=results)[0]
    assert not other.run_dir.exists()  # the queued job never started


def test_the_last_invocation_line_reads_the_log_a_stopped_one_included():
    t = report.timing({}, {})
    t["invocations"] = [
        {"date": "2026-01-01T00:00:00Z", "families": ["points"], "runs": 11, "wall_s": 1800.0},
        {"date": "2026-01-02T00:00:00Z", "families": ["vit"], "runs": 9, "wall_s": 1254.0, "interrupted": True},
    ]
    text = report._timing_text(t)
    assert "last `--suite` invocation (vit, 2026-01-02) took 21 min wall and completed 9 runs, stopped" in text


def test_the_cost_of_the_runs_made_sums_every_run_of_every_look():
    """The first-look estimate (planned runs x mean CPU) and the cost of what was run (each record's own CPU
    seconds) are both reported: a sequential suite runs more than its first look."""
    recs = {"vlm": [{"encoding": "mrope", "seed": s, "timing": {"train": {"cpu_s": 30.0 + s, "wall_s": 31.0},
                                                                "eval": {"cpu_s": 6.0, "wall_s": 7.0}}}
                    for s in range(8)]}
    t = report.timing(recs, {"vlm": 5})
    per_run = [36.0 + s for s in range(8)]
    assert t["families"]["vlm"]["run_cpu_h"] == pytest.approx(sum(per_run) / 3600)
    assert t["run_h"] == pytest.approx(sum(per_run) / 3600 / report.CORES)
    assert t["cpu_h"] == pytest.approx(5 * sum(per_run) / 8 / 3600)  # the first look at the mean cost per run
    text = report._timing_text(t)
    assert f"cost {sum(per_run) / 3600:.2f} CPU-hours" in text and f"vlm {sum(per_run) / 3600 / report.CORES:.2f} h" in text


def test_the_verdict_tally_counts_each_verdict():
    claims = [{"verdict": v} for v in ["agrees"] * 4 + ["disagrees"] * 2 + ["equivalent"] * 3 + ["unresolved", "open"]]
    assert report.verdict_tally(claims) == (
        "Verdicts: 9 of 11 claims decided (4 agree with the paper, 2 disagree, 3 equivalent within the margin); "
        "1 unresolved at their cap, 1 still open.")


def test_committed_claims_are_recomputed_from_the_committed_records():
    """results/claims.json is what the committed records give today: every decision, difference, interval, level
    and p-value (t and exact sign-flip), the runs below their validation floor, the sensitivity and exploratory
    rows and the notes."""
    from aggregate import evaluate_claims
    from protocols import FAMILIES

    recs = {f: suite.load_records(ROOT / "results", f) for f in FAMILIES}
    fresh = evaluate_claims(recs, reps=2)
    report.add_sensitivity(fresh, recs)
    report.add_exploratory(fresh, recs)
    committed = json.loads((ROOT / "results" / "claims.json").read_text())
    assert [c["claim"] for c in fresh] == [c["claim"] for c in committed]
    skip = {"ci95_bootstrap"}  # resampled with the report's replicates; 2 here
    for new, old in zip(fresh, committed):
        assert set(new) - skip == set(old) - skip, new["claim"]
        for k in set(new) - skip:
            assert new[k] == pytest.approx(old[k], rel=1e-9, abs=1e-9) if isinstance(new[k], float) else \
                _close(new[k], old[k]), (new["claim"], k)


def _close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) <= 1e-9 * max(1.0, abs(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def test_claims_history_reads_every_published_version_from_git(tmp_path):
    import subprocess

    def git(*a):
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                            "GIT_COMMITTER_EMAIL": "t@t"})  # fmt: skip

    git("init", "-q")
    (tmp_path / "results").mkdir()
    base = {"claim": "A > B", "family": "vlm", "better": "a", "other": "b", "margin": 10.0, "cap": 20}
    states = [dict(base, metric="extrapolated", protocol=None, verdict="unresolved", diff=3.1, ci95=[-13.4, 19.6],
                   seeds=[0, 1, 2, 3, 4]),
              dict(base, metric="extrapolated", protocol=None, verdict="unresolved", diff=3.1 + 1e-12,
                   ci95=[-13.4, 19.6], seeds=[0, 1, 2, 3, 4]),  # a regeneration: the same state
              dict(base, metric="near", protocol="fe3999b12ba5", verdict="open", diff=3.3, ci95=[-4.3, 11.0],
                   seeds=[0, 1, 2, 3, 4]),
              dict(base, metric="near", protocol="fe3999b12ba5", verdict="unresolved", diff=1.2, ci95=[-5.9, 8.3],
                   seeds=list(range(20)))]  # fmt: skip
    for i, st in enumerate(states):
        (tmp_path / "results" / "claims.json").write_text(json.dumps([st]))
        git("add", "results/claims.json")
        git("commit", "-q", "-m", f"step {i}")
    h = report.claims_history(tmp_path)
    assert len(h["commits"]) == 4
    (item,) = h["claims"]
    assert [v["metric"] for v in item["versions"]] == ["extrapolated", "near"]
    assert [len(v["states"]) for v in item["versions"]] == [1, 2]
    assert item["versions"][0]["first"] == h["commits"][0]["commit"]
    assert item["versions"][0]["last"] == h["commits"][1]["commit"]
    text = report.history_text(h, [states[-1]])
    assert "(earlier version): `extrapolated`" in text and "unresolved +3.1 [-13.4, +19.6] at 5 seeds" in text
    assert "(today's version, its earlier looks): `near`" in text and "open +3.3" in text
    assert "+1.2" not in text  # today's state is the claims table's, not the history's


def test_exploratory_rows_notes_and_bounds_by_hand(tmp_path):
    """A row's own contrast (``extrapolated-in_distribution``) compared between rows, by hand from the outcomes; the
    exploratory rows carry no verdict; an equivalence with both rows near chance is marked."""
    from aggregate import claim_differences, evaluate_claims
    from claims import EXPLORATORY, Claim
    from protocols import FAMILIES

    results = make_results(tmp_path)
    for s in range(5):  # a NoPE row for the exploratory "X > NoPE" comparisons
        write_record(results, "vit", "nope", s, {"nope": vit_ev([0.8, 0.5, 0.4], s, 700)})
    recs = {f: suite.load_records(results, f) for f in FAMILIES}
    drop = Claim(claim="d", paper="p", family="vit", better="lookhere", other="rope",
                 metric="extrapolated-in_distribution", described="d", margin=5.0, cap=10)  # fmt: skip
    (per,) = claim_differences(recs, [drop], records_of=fingerprint())
    for s in range(5):  # (mean of 2x, 4.57x) - 1x, lookhere minus rope; round() as _bits rounds the counts
        acc = {k: [round(a * N) / N for a in v] for k, v in (("lh", [0.9 - 0.025 * s, 0.7 - 0.025 * s,
                                                                       0.6 - 0.025 * s]),
                                                              ("rope", [0.9 - 0.025 * s, 0.5 - 0.025 * s,
                                                                        0.2 - 0.025 * s]))}  # fmt: skip
        want = 100 * (((acc["lh"][1] + acc["lh"][2]) / 2 - acc["lh"][0]) - ((acc["rope"][1] + acc["rope"][2]) / 2
                                                                            - acc["rope"][0]))  # fmt: skip
        assert per[s] == pytest.approx(want)
    entries = evaluate_claims(recs, reps=2)
    report.add_exploratory(entries, recs)
    by = {e["claim"]: e for e in entries}
    rows = {x["claim"]: x for e in entries for x in e.get("exploratory") or []}
    assert {x[1].claim for x in EXPLORATORY if x[1].family == "vit"} <= set(rows)
    lh = rows["LookHere > NoPE at 4.57x"]
    want = [100 * (round((0.6 - 0.025 * s) * N) - round(0.4 * N)) / N for s in range(5)]
    assert lh["verdict"] is None and lh["per_seed"] == pytest.approx(want) and lh["registered_after_data"]
    assert "PaPE-RI robust to SO(3)" in by and "construction" in by["PaPE-RI robust to SO(3)"]["note"]
    assert all(e.get("bound") in (None, "ceiling", "chance") for e in entries)


def test_the_pape_ri_note_states_what_the_records_show():
    """The note on the PaPE-RI claim says its SO(3) - z contrast is exactly 0 on every seed: so do the records."""
    summary = json.loads((ROOT / "results" / "summary.json").read_text())["families"]["points"]["rows"]
    assert summary["pape_ri"]["so3_minus_z"]["per_seed"] and not any(summary["pape_ri"]["so3_minus_z"]["per_seed"])
    assert all(v < 0 for v in summary["pape"]["so3_minus_z"]["per_seed"])
