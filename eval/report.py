"""The benchmark suite and its report: every encoding of a family trained and tested under one protocol.

    make bench                                   # = python eval/report.py --suite (every family; runs reused)
    make bench FAMILY=vit                        # one family at a time
    python eval/report.py --suite --families vlm --encodings mrope videorope --seeds 2   # a subset
    python eval/report.py                        # rewrite results/ and the README section from the records
    python eval/report.py --next-look            # the runs the open claims' next look needs (trains nothing)
    python eval/report.py --history              # also rebuild results/claims_history.json from git

Protocols (data, model, steps, test conditions, items per seed, seeds) live in :mod:`protocols`; running in
:mod:`suite` (one durable record per (encoding, seed) under ``results/<family>/runs/``, reused when its
fingerprint matches); statistics in :mod:`stats` (Student-t 95 % intervals over seeds whose test items are
disjoint, hierarchical bootstrap beside them, paired differences for claims); the pre-registered claims in
:mod:`claims`, their sequential decisions in :mod:`sequential`; cells and claims in :mod:`aggregate`; figures in
:mod:`plots`. This file writes ``results/summary.json``, ``results/claims.json``,
``results/protocol.json``, ``results/timing.json``, ``results/<family>/table.md`` and the figures
(``results/claims.png`` among them), and the README
section between ``<!-- results:start -->`` and ``<!-- results:end -->`` (nothing outside the markers changes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from aggregate import evaluate_claims, kind, summarize_family
from claims import CLAIMS, DESIGN, MARGINS
from report_tables import markdown_table, write_json
from plots import heat_grids, plot_claims, plot_points, plot_vit, plot_vlm, plot_vlm_heatmaps
from protocols import FAMILIES, PROTOCOLS, VLM_CLAIM_RANGE, describe
from sequential import next_look_runs
from suite import Job, load_records, plan, record_ok, run_jobs, stop_on_sigterm

__all__ = ["START", "END", "CORES", "report", "timing", "readme_section", "update_readme", "main"]

START, END = "<!-- results:start -->", "<!-- results:end -->"
CORES = 2  # the development machine the estimate is stated for


def _pct(c: dict | None, digits: int = 1) -> str:
    """``mean ± half-width`` of the 95 % interval, in %."""
    if not c or c.get("mean") is None:
        return "–"
    if c.get("ci95") is None:
        return f"{100 * c['mean']:.{digits}f} (1 seed)"
    lo, hi = c["ci95"]
    return f"{100 * c['mean']:.{digits}f} ± {100 * (hi - lo) / 2:.{digits}f}"


def family_table(fam: str, summary: dict[str, Any]) -> str:
    rows, conds = summary["rows"], summary["conditions"]
    if kind(fam) == "resolution":
        cols = [("in_distribution", "1x (in-dist)"), ("extrapolated", "extrapolated (mean > 1x)")]
        cols += [(c["key"], c["key"]) for c in conds if c["key"] != "x1"]
        order = "extrapolated"
    elif kind(fam) == "long_video":
        lo, hi = VLM_CLAIM_RANGE
        cols = [("in_distribution", "V-NIAH in-dist"), ("near", f"V-NIAH {lo}-{hi}x"),
                ("extrapolated", "V-NIAH extrapolated (all > 1x)"), ("v_niah_d_in_distribution", "V-NIAH-D in-dist"),
                ("v_niah_d_near", f"V-NIAH-D {lo}-{hi}x"), ("v_niah_d_extrapolated", "V-NIAH-D extrapolated")]
        L, T = summary["meta"]["lengths"], summary["meta"]["train_frames"]
        cols += [(f"v_niah@{n}", f"{n} fr") for n in L if n > T]
        order = "extrapolated"
    else:
        cols = [("in_distribution", f"{summary['meta']['train_rotation']} (in-dist)"),
                ("extrapolated", "shifted (mean)")]  # fmt: skip
        cols += [(c["key"], c["label"]) for c in conds if c["key"] != summary["meta"]["train_rotation"]]
        cols.append(("so3_minus_z", "SO(3) − z"))
        order = "in_distribution"
    names = sorted(rows, key=lambda r: -(rows[r][order]["mean"]))
    body = [[r, len(rows[r]["seeds"])] + [_pct(rows[r].get(k)) for k, _ in cols] for r in names]
    return markdown_table(["row", "seeds"] + [h for _, h in cols], body)


def _iv(ci: Sequence[float] | None) -> str:
    return "–" if ci is None else f"[{ci[0]:+.1f}, {ci[1]:+.1f}]"


def claims_table(claims: Sequence[dict]) -> str:
    body = []
    for c in claims:
        if c["diff"] is None:
            body.append([c["claim"], c["paper"], f"±{c['margin']:g}", "–", "–", "–", "–",
                         f"not measured ({c['reason']})"])  # fmt: skip
            continue
        look = "–" if c["look"] is None else f"{c['look']} of {len(c['looks'])}"
        rule = "–" if c.get("ci_rule") is None else f"{_iv(c['ci_rule'])} (α {c['alpha_look']:.2g})"
        verdict = f"**{c['verdict']}**" + (" (normal tails)" if c.get("normal_tails") else "")
        body.append([c["claim"], c["paper"], f"±{c['margin']:g}", f"{c['diff']:+.1f}", _iv(c["ci95"]), rule,
                     _pvalues(c), f"{len(c['seeds'])} (look {look}, cap {c['cap']})", verdict])  # fmt: skip
    return markdown_table(["claim", "paper", "margin (points)", "measured difference (points)", "95 % interval",
                           "interval at the look's level", "p: t / exact sign-flip (difference; TOST)",
                           "seeds per row", "verdict"], body)  # fmt: skip


def _pvalues(c: dict) -> str:
    """``p_t / p_sign_flip; p_tost / p_tost_sign_flip`` of a claim's look."""
    if c.get("p_t") is None:
        return "–"
    return (f"{c['p_t']:.2g} / {c['p_sign_flip']:.2g}; {c['p_tost']:.2g} / {c['p_tost_sign_flip']:.2g}")


def tails_text(claims: Sequence[dict]) -> str:
    """Which decisions rest on the t distribution's tails, and which runs below their validation floor they use."""
    rest = [c for c in claims if c.get("normal_tails")]
    text = ("Beside every look's Student-t p-values (what the rule reads) stand the exact sign-flip permutation "
            "p-values of the same hypotheses (`eval/stats.py` `sign_flip_p`: every one of the 2^n sign vectors of "
            "the n per-seed differences, no normal tails assumed); n seeds allow nothing below 2 / 2^n (0.0625 at 5 "
            "seeds, 0.002 at 10). ")  # fmt: skip
    if rest:
        text += ("Decisions whose exact test does not reach the level the rule used, so that they rest on normal "
                 "tails: " + "; ".join(f"{c['claim']} ({c['verdict']}, {len(c['seeds'])} seeds, level "
                                       f"{c['alpha_look']:.2g}, exact p {_exact(c):.2g})" for c in rest) + ". ")
    else:
        text += "Every decision's exact test reaches the level the rule used. "
    failed = [(c["claim"], f) for c in claims for f in c.get("failed_runs") or []]
    if failed:
        text += ("Runs below their family's validation floor (`claims.FAILED_RUN_FLOORS`; `Design.failed_runs` = "
                 "`keep`: they count like every run) inside a decision's seeds: " + "; ".join(
                     f"{name}: {f['encoding']} seed {f['seed']} (validation {f['validation']:.2f})"
                     for name, f in failed) + ".")  # fmt: skip
    return text.rstrip()


def _exact(c: dict) -> float:
    return c["p_tost_sign_flip"] if c["verdict"] == "equivalent" else c["p_sign_flip"]


def sensitivity_table(claims: Sequence[dict]) -> str:
    """The sensitivity rows (:data:`claims.SENSITIVITY`): each claim re-decided on another metric, beside it."""
    body = []
    for c in claims:
        for a in c.get("sensitivity") or []:
            if a.get("diff") is None:
                continue
            body.append([c["claim"], a["analysis"], f"`{a['metric']}`", f"{a['diff']:+.1f}", _iv(a["ci95"]),
                         _pvalues(a), str(a["seeds"]), f"{a['verdict']}" + (" (normal tails)" if a.get("normal_tails")
                                                                              else ""),
                         f"{c['verdict']} (`{c['metric']}`)"])  # fmt: skip
    if not body:
        return ""
    return markdown_table(["claim", "analysis", "metric", "difference (points)", "95 % interval",
                           "p: t / exact sign-flip (difference; TOST)", "seeds per row", "verdict (same rule)",
                           "registered verdict"], body)  # fmt: skip


def verdict_tally(claims: Sequence[dict]) -> str:
    """One sentence counting the verdicts: how many claims are decided, and how."""
    order = ("agrees", "disagrees", "equivalent", "unresolved", "open")
    count = {v: sum(c["verdict"] == v for c in claims) for v in order}
    decided = count["agrees"] + count["disagrees"] + count["equivalent"]
    return (f"Verdicts: {decided} of {len(claims)} claims decided ({count['agrees']} agree with the paper, "
            f"{count['disagrees']} disagree, {count['equivalent']} equivalent within the margin); "
            f"{count['unresolved']} unresolved at their cap, {count['open']} still open.")


def design_text(claims: Sequence[dict]) -> str:
    """The sequential design in words, from :data:`claims.DESIGN` (README)."""
    d = DESIGN
    fp = claims[0]["protocol"] if claims else "–"
    final = 1 - d.interim * (len(d.looks) - 1)
    return (f"Each claim is a paired difference of two rows (same seeds, same test items), pre-registered in "
            f"`eval/claims.py` with the paper's direction and an equivalence margin (±{MARGINS['top1']:g} points of "
            f"top-1, ±{MARGINS['v_niah']:g} of V-NIAH exact match: the principle is stated there). Seeds come in "
            f"looks of {', '.join(map(str, d.looks))} per row, each claim up to its cap; a look is taken once "
            f"every claim it tests has its seeds (a row not yet measured holds it back), for all of them at once. "
            f"At a look a claim is "
            f"`agrees` / `disagrees` when Holm's step-down across the {len(claims)} claims (family-wise α "
            f"{d.alpha:g} for the sign decisions) rejects no difference at the look's Haybittle-Peto level ("
            f"{d.interim:g} of the claim's level at an interim look, the remaining {final:.2f} at its cap), "
            f"`equivalent` when the TOST interval at that level lies inside ±margin, `unresolved` when its cap is "
            f"reached undecided, `open` below the cap (more seeds: `python eval/report.py --next-look` lists them). "
            f"The 95 % interval is the plain Student-t one over the look's seeds; the interval at the look's level "
            f"is the one the rule reads. Decisions use the records of claims protocol `{fp}` (records written before "
            f"it count for the first look of this protocol only). These are small CPU-sized models, not the papers' settings; the "
            f"protocols were fixed before the comparison and are not tuned toward any sign, except where the claims' "
            f"history below shows a claim changed after its data were published. Per-seed differences: "
            f"`results/claims.json` (`per_seed`).")  # fmt: skip


def timing(records: dict[str, list[dict]], planned: dict[str, int]) -> dict[str, Any]:
    """CPU cost per family from the records: the estimate for the planned suite (every row at the protocol's
    first-look seeds) on ``CORES`` idle cores, and what the runs made so far cost (every look taken; each run's own
    CPU seconds, every attempt of a resumed run included)."""
    fams: dict[str, Any] = {}
    total = 0.0
    spent = 0.0
    complete = True
    for fam in FAMILIES:
        recs = records.get(fam, [])
        tr = [r["timing"]["train"]["cpu_s"] for r in recs if "train" in r.get("timing", {})]
        ev = [r["timing"]["eval"]["cpu_s"] for r in recs if "eval" in r.get("timing", {})]
        wall = [sum(r["timing"][k]["wall_s"] for k in ("train", "eval") if k in r["timing"]) for r in recs
                if r.get("timing")]  # fmt: skip
        if not recs:
            complete = False
            fams[fam] = {"runs": 0, "planned": planned.get(fam, 0)}
            continue
        mt, me = (sum(tr) / len(tr) if tr else 0.0), (sum(ev) / len(ev) if ev else 0.0)
        n = planned.get(fam, len(recs))
        complete &= len(recs) >= n
        fams[fam] = {"runs": len(recs), "planned": n, "train_cpu_s": mt, "eval_cpu_s": me,
                     "wall_s_per_run": sum(wall) / len(wall) if wall else None, "cpu_h": n * (mt + me) / 3600,
                     "run_cpu_h": (sum(tr) + sum(ev)) / 3600,
                     "per_run": {f"{r['encoding']}_seed{r['seed']}": r.get("timing") for r in recs}}  # fmt: skip
        total += n * (mt + me)
        spent += sum(tr) + sum(ev)
    return {"families": fams, "cores": CORES, "cpu_h": total / 3600, "estimate_h": total / 3600 / CORES,
            "run_cpu_h": spent / 3600, "run_h": spent / 3600 / CORES, "complete": complete}  # fmt: skip


def report(results: Path, *, readme: Path | None, families: Sequence[str] = FAMILIES,
           reps: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Aggregate the records of ``families`` (the others keep their entries in summary.json)."""
    summary_path = results / "summary.json"
    old = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary: dict[str, Any] = {"families": dict(old.get("families", {}))}
    records = {fam: load_records(results, fam) for fam in FAMILIES}
    for fam in families:
        if not records[fam]:
            summary["families"].pop(fam, None)
            continue
        s = summarize_family(fam, records[fam], reps=reps)
        summary["families"][fam] = s
        out = results / fam
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(f"# {PROTOCOLS[fam].title}\n\nCells: mean ± half-width of the 95 % interval "
                                      f"over seeds (%).\n\n" + family_table(fam, s))  # fmt: skip
        if kind(fam) == "resolution":
            plot_vit(s, out / "resolution.png")
        elif kind(fam) == "long_video":
            plot_vlm(s, out / "accuracy_vs_length.png")
            plot_vlm_heatmaps(heat_grids(records[fam]), s["meta"], out)
        else:
            plot_points(s, out / "conditions.png")
    write_json(summary_path, summary)
    claims = evaluate_claims({f: records[f] for f in FAMILIES}, reps=reps)
    add_sensitivity(claims, {f: records[f] for f in FAMILIES})
    add_exploratory(claims, {f: records[f] for f in FAMILIES})
    write_json(results / "claims.json", claims)
    plot_claims(claims, results / "claims.png")
    write_json(results / "protocol.json", {f: describe(PROTOCOLS[f]) for f in FAMILIES})
    planned = {f: len(PROTOCOLS[f].encodings) * PROTOCOLS[f].seeds for f in FAMILIES}
    t = timing(records, planned)
    prev = json.loads((results / "timing.json").read_text()) if (results / "timing.json").is_file() else {}
    t["invocations"] = prev.get("invocations", [])
    write_json(results / "timing.json", t)
    hist = results / "claims_history.json"
    history = json.loads(hist.read_text()) if hist.is_file() else None
    audit = provenance_audit(records, (history or {}).get("said_clean"))
    write_json(results / "provenance.json", audit)
    section = readme_section(summary, claims, t, history=history, provenance=audit)
    (results / "README.md").write_text(section)
    if readme is not None:
        update_readme(readme, section)
    return {"summary": summary, "claims": claims, "timing": t}


def add_sensitivity(claims: list[dict], records: dict[str, list[dict]], *, design=DESIGN) -> None:
    """Attach to every registered claim the rows of each sensitivity analysis that re-reads it
    (:data:`claims.SENSITIVITY`), under ``sensitivity``. A row is read at the registered decision's seeds (its
    look) and by the rule's levels there: a sign decision when ``p_t`` passes the level the registered claim was
    tested at (``alpha_look``: the Holm level it passed, or the one it would have needed), ``equivalent`` when
    ``p_tost`` passes the look's equivalence level (Bonferroni over the claims), else ``undecided at this look``.
    The sequence of looks is not replayed: the seeds run were chosen by the registered decisions."""
    import numpy as np

    from aggregate import claim_differences
    from claims import SENSITIVITY, fingerprint, sensitivity_claims
    from sequential import tails
    from stats import t_interval

    for name in SENSITIVITY:
        alt = sensitivity_claims(name, CLAIMS)
        values = claim_differences(records, alt, records_of=fingerprint())
        for c, cl, per in zip(claims, alt, values):
            if cl.metric == c["metric"] or c.get("alpha_look") is None or not per:  # no look taken: nothing to read
                continue
            xs = [per[k] for k in c["seeds"] if k in per]
            if len(xs) != len(c["seeds"]) or len(xs) < 2:
                continue
            n = len(xs)
            equiv_level = design.fraction(n, cl.cap) * design.alpha / len(CLAIMS)
            diff = sum(xs) / n
            t = tails(np.asarray(xs), cl.margin, "", None)
            if t["p_t"] <= c["alpha_look"]:
                verdict = "agrees" if diff > 0 else "disagrees"
            else:
                verdict = "equivalent" if t["p_tost"] <= equiv_level else "undecided at this look"
            signed = verdict in ("agrees", "disagrees")
            exact = t["p_sign_flip"] if signed else t["p_tost_sign_flip"]
            level = c["alpha_look"] if signed else equiv_level
            c.setdefault("sensitivity", []).append({
                "analysis": name, "registered_after_data": True, "metric": cl.metric, "verdict": verdict,
                "diff": diff, "ci95": list(t_interval(xs)[2:]), "seeds": n, "level_sign": c["alpha_look"],
                "level_equivalence": equiv_level, "p_t": t["p_t"], "p_tost": t["p_tost"],
                "p_sign_flip": t["p_sign_flip"], "p_tost_sign_flip": t["p_tost_sign_flip"],
                "normal_tails": None if verdict.startswith("undecided") else bool(exact > level),
                "per_seed": xs})  # fmt: skip


def add_exploratory(claims: list[dict], records: dict[str, list[dict]]) -> None:
    """Attach to the registered claims what :data:`claims.NOTES` says they test in fact (``note``), whether an
    ``equivalent`` verdict sits where both rows are within the margin of the ceiling or of chance (``bound``: the
    verdict then says little about the encodings), and the comparisons of :data:`claims.EXPLORATORY` beside them
    (``exploratory``: difference, 95 % interval, t and exact sign-flip p-values over every seed the two rows share;
    no verdict)."""
    import numpy as np

    from aggregate import claim_differences, row_means
    from claims import EXPLORATORY, NOTES, fingerprint
    from sequential import tails
    from stats import t_interval

    fp = fingerprint()
    by = {c["claim"]: c for c in claims}
    for name, note in NOTES.items():
        if name in by:
            by[name]["note"] = note
    for c, cl in zip(claims, CLAIMS):
        if c["verdict"] != "equivalent":
            continue
        means = row_means(records, cl, c["seeds"], records_of=fp)
        if means is None:
            continue
        lo, hi = min(means[cl.better], means[cl.other]), max(means[cl.better], means[cl.other])
        c["row_means"] = {cl.better: means[cl.better], cl.other: means[cl.other]}
        c["bound"] = ("ceiling" if lo >= 100 - cl.margin else "chance" if hi <= means["chance"] + cl.margin else None)
    values = claim_differences(records, [e for _, e, _ in EXPLORATORY], records_of=fp)
    for (name, e, why), per in zip(EXPLORATORY, values):
        if name not in by or len(per) < 2:
            continue
        xs = np.array([per[k] for k in sorted(per)])
        t = tails(xs, e.margin, "", None)
        by[name].setdefault("exploratory", []).append({
            "claim": e.claim, "family": e.family, "better": e.better, "other": e.other, "metric": e.metric,
            "measures": e.described, "why": why, "registered_after_data": True, "verdict": None,
            "seeds": sorted(per), "diff": float(xs.mean()), "ci95": list(t_interval(xs)[2:]), "p_t": t["p_t"],
            "p_sign_flip": t["p_sign_flip"], "p_tost": t["p_tost"], "p_tost_sign_flip": t["p_tost_sign_flip"],
            "per_seed": xs.tolist()})  # fmt: skip


def exploratory_table(claims: Sequence[dict]) -> str:
    """The exploratory comparisons beside the registered claims they re-read."""
    body = [[c["claim"], e["claim"], e["measures"], f"{e['diff']:+.1f}", _iv(e["ci95"]),
             f"{e['p_t']:.2g} / {e['p_sign_flip']:.2g}", str(len(e["seeds"])), f"{c['verdict']} ({c['diff']:+.1f})"]
            for c in claims for e in c.get("exploratory") or []]  # fmt: skip
    if not body:
        return ""
    return markdown_table(["registered claim", "exploratory comparison", "measures", "difference (points)",
                           "95 % interval", "p: t / exact sign-flip", "seeds per row", "registered verdict"], body)


def notes_text(claims: Sequence[dict]) -> str:
    """The notes on what registered claims test, and the equivalences at a ceiling or at chance."""
    out = [f"- {c['claim']}: {c['note']}." for c in claims if c.get("note")]
    for c in claims:
        if c.get("bound"):
            rows = ", ".join(f"{r} {v:.1f} %" for r, v in c["row_means"].items())
            where = "the ceiling" if c["bound"] == "ceiling" else "chance"
            out.append(f"- {c['claim']}: `equivalent` with both rows within the margin of {where} ({rows}): the "
                       f"verdict stands as registered, but the task leaves no room for a difference here.")
    return "\n".join(out)


def readme_section(summary: dict[str, Any], claims: Sequence[dict], t: dict[str, Any], *,
                   history: dict[str, Any] | None = None, provenance: dict[str, Any] | None = None) -> str:  # fmt: skip
    lines = ["## Results", "",
             "Measured by `make bench` (`python eval/report.py --suite`; `make bench FAMILY=vit` runs one family). "
             "Every row of a family is trained and tested under the same protocol; cells are the mean over seeds ± "
             "the half-width of a 95 % Student-t interval over the per-seed values (%). Seed k of every row is "
             "tested on the same items and different seeds on disjoint items, so the interval carries both the "
             "seed-to-seed variation and the test-item sampling noise (`eval/stats.py`). Records of every run: "
             "`results/<family>/runs/`; all numbers: `results/summary.json`, `results/claims.json`.", "",
             "Reproducibility: a run repeated on the same machine gives the same record, item for item. Across "
             "machines it does not: a record re-run on another machine (another CPU) differed in 78 of its 2,016 "
             "item outcomes and moved one cell by 5.9 points (floating-point kernels differ between CPUs and "
             "thread counts, and training amplifies the differences), so a rerun elsewhere agrees within the "
             "intervals, not item for item. Every record stores where it came from (`provenance`: commit, torch / "
             "DeepSpeed / transformers versions, CPU model, threads).", ""]  # fmt: skip
    figs = {"resolution": "![accuracy vs resolution](results/{fam}/resolution.png)",
            "long_video": "![accuracy vs length](results/{fam}/accuracy_vs_length.png)",
            "points": "![point-cloud conditions](results/{fam}/conditions.png)"}  # fmt: skip
    for fam in FAMILIES:
        p = PROTOCOLS[fam]
        s = summary["families"].get(fam)
        lines += [f"### {p.title}", ""]
        lines += [f"- {c}" for c in p.choices] + [f"- Seeds: {p.seeds} per row.", ""]
        if s is None:
            lines += ["Not measured yet: run `make bench FAMILY=" + fam + "`.", ""]
            continue
        lines += [family_table(fam, s), "", figs[kind(fam)].format(fam=fam), ""]
        conv = convergence(s)
        if conv:
            lines += [conv, ""]
    lines += ["### Do the measurements agree with the papers?", "", design_text(claims), "", verdict_tally(claims), "",
              claims_table(claims), "", tails_text(claims), "",
              "![every claim's interval against its margin](results/claims.png)", ""]
    notes = notes_text(claims)
    if notes:
        lines += ["What some verdicts rest on:", "", notes, ""]
    expl = exploratory_table(claims)
    if expl:
        lines += ["#### Exploratory comparisons (named after the data were seen; no verdict)", "",
                  "Each re-reads a registered claim the way its paper tested it, over every seed the two rows share; "
                  "`eval/claims.py` `EXPLORATORY` says why. Deciding them needs seeds not yet run.", "", expl, ""]
    sens = sensitivity_table(claims)
    if sens:
        from claims import SENSITIVITY

        lines += ["#### Sensitivity rows (named after the data were seen; the registered verdicts above decide)", "",
                  " ".join(f"`{k}`: {what}." for k, (what, _) in SENSITIVITY.items())
                  + " Each row is read at the registered decision's seeds and by the rule's levels at that look (the "
                  "sign test at the Holm level the registered claim had there, TOST at the look's equivalence "
                  "level); the looks are not replayed, since the seeds run were chosen by the registered "
                  "decisions.", "", sens, ""]  # fmt: skip
    if history:
        text = history_text(history, claims)
        if text:
            lines += ["#### History of the claims (`results/claims_history.json`, from `git log -- "
                      "results/claims.json`)", "",
                      "Every earlier version of a claim that published a verdict or a difference, and the earlier "
                      "looks of today's version, with the commit that published each state. A version is the "
                      "claim's rows, metric, margin, cap and claims protocol; protocols before `fe3999b12ba5` read "
                      "other records (the ViT and point records of the first protocol are in `results/archive/v1`).",
                      "", text, ""]  # fmt: skip
    if provenance:
        lines += [provenance_text(provenance), ""]
    lines += ["### Cost", "", _timing_text(t), ""]
    return "\n".join(lines).rstrip() + "\n"


def convergence(s: dict[str, Any]) -> str:
    """One sentence on how far training had converged: validation accuracy gained over the last quarter of the
    steps (from each run's logged validation curve), per row and overall."""
    gains: dict[str, list[float]] = {}
    span = None
    for row, by_seed in s.get("val_curves", {}).items():
        for curve in by_seed.values():
            end = curve[-1] if curve else None
            earlier = [c for c in curve if end and c[0] <= 0.75 * end[0]]
            if end and earlier:
                gains.setdefault(row, []).append(100 * (end[1] - earlier[-1][1]))
                span = (earlier[-1][0], end[0])
    if not gains or span is None:
        return ""
    allg = [g for v in gains.values() for g in v]
    worst = max(gains, key=lambda r: sum(gains[r]) / len(gains[r]))
    return (f"Convergence: over the last quarter of training (steps {span[0]} to {span[1]}) the validation "
            f"accuracy changed by {sum(allg) / len(allg):+.1f} points on average over {len(allg)} runs (largest: "
            f"{worst}, {sum(gains[worst]) / len(gains[worst]):+.1f}).")  # fmt: skip


def _timing_text(t: dict[str, Any]) -> str:
    parts = []
    for fam, d in t["families"].items():
        if not d.get("runs"):
            parts.append(f"{fam}: no runs yet ({d['planned']} planned)")
            continue
        parts.append(f"{fam}: {d['runs']}/{d['planned']} runs, {d['train_cpu_s']:.0f} s train + "
                     f"{d['eval_cpu_s']:.0f} s evaluation CPU per run")  # fmt: skip
    text = "One thread per run, CPU seconds measured by the suite: " + "; ".join(parts) + "."
    scope = "the whole planned suite" if t["complete"] else "the planned suite (families without runs excluded)"
    text += (f" Estimated cost of {scope} (every row at its first-look seeds): {t['cpu_h']:.2f} CPU-hours, i.e. "
             f"{t['estimate_h']:.2f} h on {t['cores']} idle cores.")  # fmt: skip
    if t.get("run_cpu_h"):
        ran = {f: d["run_cpu_h"] for f, d in t["families"].items() if d.get("run_cpu_h")}
        text += (f" The runs made so far (every look taken) cost {t['run_cpu_h']:.2f} CPU-hours, i.e. "
                 f"{t['run_h']:.2f} h on {t['cores']} idle cores (" + ", ".join(
                     f"{f} {h / t['cores']:.2f} h" for f, h in ran.items()) + ").")  # fmt: skip
    if t.get("invocations"):
        last = t["invocations"][-1]
        text += (f" The last `--suite` invocation ({'+'.join(last['families'])}, {last['date'][:10]}) took "
                 f"{last['wall_s'] / 60:.0f} min wall and completed {last['runs']} runs"
                 + (", stopped before the end" if last.get("interrupted") else "") + " (runs present are reused).")
    from claims import fingerprint

    mine = [i for i in t.get("invocations", []) if i.get("claims_protocol") == fingerprint() and i.get("runs")]
    if mine:
        by: dict[str, float] = {}
        for i in mine:
            key = "+".join(i["families"])
            by[key] = by.get(key, 0.0) + i["wall_s"]
        text += (f" Measured under this claims protocol: {len(mine)} `--suite` invocations that ran something, "
                 f"{sum(i['wall_s'] for i in mine) / 3600:.2f} h wall in all (" + ", ".join(
                     f"{k} {v / 3600:.2f} h" for k, v in by.items()) + "; `results/timing.json`, `invocations`).")
    return text


def update_readme(path: Path, section: str) -> bool:
    """Replace the text between the markers (appending the markers at the end when absent); True if changed."""
    text = path.read_text() if path.is_file() else ""
    s, e = text.find(START), text.find(END)
    if (s < 0) != (e < 0) or (s >= 0 and e < s) or text.count(START) > 1 or text.count(END) > 1:
        raise ValueError(f"{path}: expected one {START!r} followed by one {END!r}, or neither")
    body = f"{START}\n{section.rstrip()}\n{END}"
    if s < 0:
        new = text + ("" if text.endswith("\n") or not text else "\n") + ("\n" if text else "") + body + "\n"
    else:
        new = text[:s] + body + text[e + len(END):]
    if new != text:
        path.write_text(new)
    return new != text


ROOT = Path(__file__).resolve().parents[1]

#: what identifies a version of a claim in its history: its rows, metric, margin, cap and claims protocol
VERSION_KEYS = ("family", "better", "other", "metric", "margin", "cap", "protocol")


def claims_history(repo: Path, path: str = "results/claims.json") -> dict[str, Any]:
    """Every version of every claim ever published in ``path``, read from git: one entry per commit that changed
    the file (oldest first), a claim's *version* being its :data:`VERSION_KEYS` (a claim renamed keeps its
    history when its rows stay). Each version lists the states it was published with (verdict, difference,
    interval, seeds), a state kept once until it changes, with the commit and date that first showed it. A claim
    is identified by its wording (``claim``), which no commit changed while its rows, metric or family did.

    Args:
        repo (Path): the git checkout.
        path (str): the claims file inside it.

    Returns:
        dict[str, Any]: ``{"source", "commits": [{"commit", "date", "subject"}], "claims": [{"claim", "versions":
        [{**VERSION_KEYS, "first", "last", "states": [...]}]}]}``, claims in order of first publication.
    """
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout

    commits = []
    for line in git("log", "--reverse", "--format=%H%x09%cs%x09%s", "--", path).splitlines():
        sha, date, subject = line.split("\t", 2)
        commits.append({"commit": sha[:7], "date": date, "subject": subject[:200]})
    claims: dict[str, dict[str, Any]] = {}
    for c in commits:
        try:
            entries = json.loads(git("show", f"{c['commit']}:{path}"))
        except subprocess.CalledProcessError:  # the file deleted in this commit
            continue
        for e in entries:
            item = claims.setdefault(e.get("claim"), {"claim": e.get("claim"), "versions": []})
            key = {k: e.get(k) for k in VERSION_KEYS}
            vs = item["versions"]
            if not vs or {k: vs[-1][k] for k in VERSION_KEYS} != key:
                vs.append({**key, "first": c["commit"], "last": c["commit"], "states": []})
            v = vs[-1]
            v["last"] = c["commit"]
            seeds = e.get("seeds") or []
            r6 = lambda x: None if x is None else round(float(x), 6)  # noqa: E731  (regenerations differ at 1e-15)
            state = {"verdict": e.get("verdict"), "diff": r6(e.get("diff")),
                     "ci95": None if e.get("ci95") is None else [r6(x) for x in e["ci95"]],
                     "seeds": len(seeds) if isinstance(seeds, list) else seeds}  # fmt: skip
            if not v["states"] or {k: v["states"][-1][k] for k in state} != state:
                v["states"].append({**state, "commit": c["commit"], "date": c["date"]})
    import re

    clean: dict[str, list[str]] = {}  # code commit -> the results commits whose message calls its runs clean
    for line in git("log", "--format=%h%x09%s", "--", "results").splitlines():
        sha, subject = line.split("\t", 1)
        for code in re.findall(r"commit ([0-9a-f]{7,40}),? clean", subject):
            clean.setdefault(code[:7], []).append(sha)
    return {"source": f"git log -- {path}", "commits": commits, "claims": list(claims.values()),
            "said_clean": clean}  # fmt: skip


def provenance_audit(records: dict[str, list[dict]], said_clean: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """What the records say of where they came from, per family: how many carry a ``provenance``, how many were
    written from a dirty tree and how many of those name the files (``dirty_files``), how many record numpy and
    scipy versions; per (code commit, dirty) the records; and the dirty records whose code commit a results
    commit's message calls clean (``said_clean``: from :func:`claims_history`)."""
    out: dict[str, Any] = {}
    for fam, recs in records.items():
        prov = [r.get("provenance") for r in recs]
        groups: dict[str, int] = {}
        for pv in prov:
            key = "none" if not pv else f"{(pv.get('commit') or '?')[:7]} {'dirty' if pv.get('dirty') else 'clean'}"
            groups[key] = groups.get(key, 0) + 1
        dirty = [pv for pv in prov if pv and pv.get("dirty")]
        contra = {}
        for pv in dirty:
            c = (pv.get("commit") or "")[:7]
            if said_clean and c in said_clean:
                contra.setdefault(c, {"records": 0, "said_clean_by": said_clean[c]})["records"] += 1
        out[fam] = {"records": len(recs), "with_provenance": sum(bool(pv) for pv in prov), "dirty": len(dirty),
                    "dirty_naming_files": sum(pv.get("dirty_files") is not None for pv in dirty),
                    "with_numpy_scipy": sum(bool(pv and pv.get("numpy") and pv.get("scipy")) for pv in prov),
                    "by_commit": groups, "dirty_but_said_clean": contra}  # fmt: skip
    return out


def provenance_text(audit: dict[str, Any]) -> str:
    """The provenance audit in one paragraph (README)."""
    parts = []
    for fam, a in audit.items():
        part = (f"{fam}: {a['records']} records, {a['with_provenance']} with provenance, {a['dirty']} written from a "
                f"dirty tree ({a['dirty_naming_files']} naming the files), {a['with_numpy_scipy']} with numpy / scipy "
                f"versions")  # fmt: skip
        for c, d in a["dirty_but_said_clean"].items():
            part += (f"; {d['records']} dirty records at commit {c}, whose runs the message of "
                     f"{', '.join(d['said_clean_by'])} calls clean")
        parts.append(part)
    return ("Provenance of the records (`results/provenance.json`; records written from now on also name the files "
            "that made a tree dirty and the numpy and scipy versions, which none of those counted here does): "
            + "; ".join(parts) + ". A dirty record without its "
            "files cannot be checked further: its tree may have differed from the commit in any tracked file.")


def history_text(history: dict[str, Any], claims: Sequence[dict]) -> str:
    """The earlier versions of the registered claims and what each published (README), from
    ``results/claims_history.json``: one line per version that is not today's, the claim's states in order."""
    now = {c["claim"]: c for c in claims}
    lines = []
    for item in history.get("claims", []):
        cur = now.get(item["claim"])
        if cur is None:
            continue
        old = [v for v in item["versions"] if {k: v[k] for k in VERSION_KEYS} != {k: cur.get(k) for k in VERSION_KEYS}]
        mine = [v for v in item["versions"] if v not in old]
        for v in old + [dict(v, states=v["states"][:-1], today=True) for v in mine[-1:]]:
            shown = [s for s in v["states"] if s["verdict"] != "not measured"]
            if not shown:
                continue
            states = "; ".join(f"{s['verdict']} {s['diff']:+.1f} {_iv(s['ci95'])} at {s['seeds']} seeds "
                               f"({s['commit']}, {s['date']})" for s in shown)  # fmt: skip
            what = "today's version, its earlier looks" if v.get("today") else "earlier version"
            lines.append(f"- {item['claim']} ({what}): `{v['metric']}` of {v['family']} under claims protocol "
                         f"`{v['protocol'] or 'none (before the pre-registered design)'}`, published "
                         f"{v['first']} ... {v['last']}: {states}.")  # fmt: skip
    return "\n".join(lines)


def next_look_jobs(claims: Sequence[dict], families: Sequence[str], *, runs_dir: Path,
                   results_dir: Path) -> list[Job]:  # fmt: skip
    """The jobs (one per encoding and seed) of the runs the open claims' next look needs, in ``families``."""
    want = {}
    for fam, row, seed in next_look_runs(claims, CLAIMS):
        if fam in families:
            enc = next((r.encoding for r in PROTOCOLS[fam].rows if r.name == row), row)
            want[(fam, enc, seed)] = Job(PROTOCOLS[fam], enc, seed, runs_dir, results_dir)
    return [want[k] for k in sorted(want, key=lambda k: (k[2], k[0], k[1]))]  # seed-major


def log_invocation(results: Path, *, families: Sequence[str], jobs: int, runs: int, wall_s: float,
                   interrupted: bool = False) -> None:  # fmt: skip
    """Append one ``--suite`` invocation (families, runs it completed, wall seconds, the claims protocol, the
    machine, whether it was stopped before the end) to ``results/timing.json``'s ``invocations``: the measured cost
    of ``make bench`` is the sum of its invocations under one protocol, resumed and stopped ones included."""
    from claims import fingerprint
    from suite import provenance

    path = results / "timing.json"
    t = json.loads(path.read_text()) if path.is_file() else {}
    prov = provenance(1)
    t.setdefault("invocations", []).append({
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "families": list(families), "jobs": jobs,
        "runs": runs, "wall_s": round(wall_s, 1), "claims_protocol": fingerprint(), "commit": prov["commit"],
        "cpu": prov["cpu"], "cores": os.cpu_count(), **({"interrupted": True} if interrupted else {})})  # fmt: skip
    write_json(path, t)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--suite", action="store_true", help="train and evaluate what is missing, then report")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--encodings", nargs="+", default=None,
                   help="configs to run (default: the protocol's rows; 'all': rows + extras)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per encoding (default: the protocol's)")
    p.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1), help="runs at a time (one thread each)")
    p.add_argument("--runs", default=str(ROOT / "runs" / "bench"), help="where the (scratch) runs go")
    p.add_argument("--results", default=str(ROOT / "results"), help="where the records and the report go")
    p.add_argument("--readme", default=str(ROOT / "README.md"), help="README to update ('' to skip)")
    p.add_argument("--fresh", action="store_true", help="retrain and re-evaluate every planned run")
    p.add_argument("--first-look", action="store_true",
                   help="run the protocol's first seeds only (default: then the looks the open claims need, "
                        "sequentially, until every claim of these families is decided, at its cap or waiting)")
    p.add_argument("--reevaluate", action="store_true",
                   help="evaluate again every planned run whose weights are under --runs (after a change to the "
                        "evaluation code; the training is reused, runs without weights keep their records)")
    p.add_argument("--next-look", action="store_true",
                   help="print the runs (family, row, seed) the open claims' next look needs, from results/claims.json")
    p.add_argument("--history", action="store_true",
                   help="rebuild results/claims_history.json from git log -- results/claims.json (trains nothing), "
                        "then report")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    results = Path(args.results)
    if args.next_look:
        entries = json.loads((results / "claims.json").read_text())
        for fam, row, seed in next_look_runs(entries, CLAIMS):
            enc = next((r.encoding for r in PROTOCOLS[fam].rows if r.name == row), row)
            print(f"{fam} {row} seed {seed}" + (f" (a run of {enc})" if enc != row else ""))
        return 0
    readme = Path(args.readme) if args.readme else None
    if args.history:
        write_json(results / "claims_history.json", claims_history(ROOT))
    failed: list[str] = []
    if args.suite:
        jobs = plan(args.families, encodings=args.encodings, seeds=args.seeds, runs_dir=Path(args.runs),
                    results_dir=results)  # fmt: skip
        if not jobs:
            p.error("nothing to run: no config matches --families / --encodings")
        sequential = args.encodings is None and args.seeds is None and not args.first_look
        t0 = time.perf_counter()
        done: set[str] = set()  # the jobs of this invocation that now have a record
        interrupted = False
        try:
            with stop_on_sigterm():
                while jobs:
                    todo = [j for j in jobs if args.fresh or not record_ok(j)]
                    print(f"[suite] {len(jobs)} jobs ({len(todo)} to run): " + ", ".join(
                        f"{fam} {sum(j.family == fam for j in jobs)}" for fam in args.families), flush=True)  # fmt: skip
                    try:
                        failed += run_jobs(jobs, jobs_at_once=args.jobs, fresh=args.fresh, reevaluate=args.reevaluate,
                                           progress=not args.no_progress)  # fmt: skip
                    finally:
                        done |= {j.key for j in todo if record_ok(j)}
                    if failed or not sequential:
                        break
                    # the next look: the seeds the open claims of these families need (none once every claim is
                    # decided, at its cap, or waiting for a look that another family's rows hold back)
                    claims = evaluate_claims({f: load_records(results, f) for f in FAMILIES}, reps=2)
                    jobs = next_look_jobs(claims, args.families, runs_dir=Path(args.runs), results_dir=results)
                    args.fresh = False  # --fresh redoes the first planned runs only
                    waiting = sorted({fam for fam, _, _ in next_look_runs(claims, CLAIMS)} - set(args.families))
                    if not jobs and waiting:
                        print(f"[suite] the next look waits for runs of {', '.join(waiting)} "
                              "(make bench FAMILY=...)", flush=True)  # fmt: skip
        except KeyboardInterrupt:
            interrupted = True
        wall = time.perf_counter() - t0
        log_invocation(results, families=args.families, jobs=args.jobs, runs=len(done), wall_s=wall,
                       interrupted=interrupted)  # fmt: skip
        if interrupted:
            print(f"[suite] stopped after {wall / 60:.1f} min ({len(done)} runs completed, logged in "
                  f"{results / 'timing.json'}); the runs in flight resume from their checkpoints next time; "
                  "no report written", file=sys.stderr)  # fmt: skip
            return 130
        for f in failed:
            print(f"[suite] {f}", file=sys.stderr)
    out = report(results, readme=readme, families=args.families)
    print((results / "README.md").read_text())
    return 1 if failed or not out else 0


if __name__ == "__main__":
    sys.exit(main())
