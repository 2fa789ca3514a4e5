"""From per-run records to ``results/summary.json`` and ``results/claims.json``.

Every cell is :func:`stats.cell` of the per-seed outcome matrices of one row (conditions x test items): the mean
over seeds, the sample std over seeds, ``n`` seeds, ``items`` test items per seed, a Student-t 95 % interval over
the per-seed values and a hierarchical-bootstrap interval beside it. Accuracies are fractions. Per kind of family
(its protocol's evaluator; ``shapes`` reads like ``vit``):

* ``vit``: conditions = the test/train size ratios; ``in_distribution`` = 1x, ``extrapolated`` = the mean over the
  larger sizes, one cell per ratio (``x1.43`` ...);
* ``vlm``: conditions = the video lengths of V-NIAH (and of V-NIAH-D); ``in_distribution`` = V-NIAH over the
  lengths up to the training length, ``extrapolated`` = V-NIAH over the longer ones, ``near`` = over the lengths
  of :data:`protocols.VLM_CLAIM_RANGE` (2-8x the training length, what the claims read), the same three for
  V-NIAH-D (``v_niah_d_...``) and one cell per task and length (``v_niah@16``);
* ``points``: conditions = z rotation at the training point count (``in_distribution``), SO(3) rotation, 2x / 4x
  points; ``extrapolated`` = the mean over the shifted conditions, one cell per condition and ``so3_minus_z``.

Claims (:mod:`claims`) are paired differences (:func:`stats.paired`) of two rows on the same seeds and items, in
percentage points, decided sequentially (:mod:`sequential`: Haybittle-Peto looks, Holm across claims, TOST against
each claim's margin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from claims import CLAIMS, DESIGN, Claim, Design, fingerprint
from protocols import PROTOCOLS, VLM_CLAIM_RANGE
from sequential import decide, select_records
from stats import Cell, cell, paired, unpack_bits

__all__ = ["Condition", "family_matrices", "summarize_family", "Claim", "CLAIMS", "evaluate_claims"]


@dataclass(frozen=True)
class Condition:
    key: str  # the cell name (``x2``, ``v_niah@16``, ``so3``)
    label: str  # for tables and plots


def _vit_conditions(ev: dict) -> list[tuple[Condition, dict]]:
    out = []
    for r in ev["results"]:
        ratio = float(r["ratio"])
        out.append((Condition(f"x{ratio:.3g}", f"x{ratio:.3g} ({r['size']} px)"), r["outcomes"]))
    return out


def _vlm_conditions(ev: dict) -> list[tuple[Condition, dict]]:
    out = []
    for task in ("v_niah", "v_niah_d"):
        entry = ev["tasks"].get(task, {}).get("teacher")
        if entry is None:
            continue
        for L, o in zip(ev["lengths"], entry["outcomes"]):
            out.append((Condition(f"{task}@{L}", f"{task.replace('_', '-').upper()} {L} fr"), o))
    return out


def _points_conditions(ev: dict) -> list[tuple[Condition, dict]]:
    out = []
    for r in ev["results"]:
        if r["condition"] == "rotation":
            key = r["rotation"]
            label = f"{r['rotation']} rotation"
        else:
            key = f"{r['points']}pts"
            label = f"{r['points']} points"
        out.append((Condition(key, label), r["outcomes"]))
    return out


#: per evaluator (what a family's results look like, :attr:`protocols.Protocol.evaluator`)
CONDITIONS: dict[str, Callable[[dict], list[tuple[Condition, dict]]]] = {
    "resolution": _vit_conditions,
    "long_video": _vlm_conditions,
    "points": _points_conditions,
}


def kind(family: str) -> str:
    """The evaluator of ``family``'s protocol: how its records are read (``resolution``, ``long_video``,
    ``points``)."""
    return PROTOCOLS[family].evaluator


def family_matrices(family: str, records: Sequence[dict]) -> tuple[list[Condition], dict[str, dict[int, np.ndarray]]]:
    """The conditions of ``family`` and, per row and seed, the ``(C, items)`` 0/1 outcome matrix."""
    conds: list[Condition] | None = None
    rows: dict[str, dict[int, np.ndarray]] = {}
    for rec in records:
        for name, ev in rec["rows"].items():
            parts = CONDITIONS[kind(family)](ev)
            these = [c for c, _ in parts]
            if conds is None:
                conds = these
            elif these != conds:
                raise ValueError(f"{family}/{name} seed {rec['seed']}: conditions {[c.key for c in these]} differ "
                                 f"from {[c.key for c in conds]}; re-run with the current protocol")  # fmt: skip
            vecs = [unpack_bits(o) for _, o in parts]
            n = {v.size for v in vecs}
            if len(n) != 1:
                raise ValueError(f"{family}/{name} seed {rec['seed']}: conditions hold different item counts {n}")
            rows.setdefault(name, {})[int(rec["seed"])] = np.stack(vecs)
    return conds or [], rows


def _weights(conds: Sequence[Condition], pick: Callable[[Condition], bool]) -> np.ndarray:
    w = np.array([1.0 if pick(c) else 0.0 for c in conds])
    if w.sum() == 0:
        raise ValueError("a summary cell selects no condition")
    return w / w.sum()


def family_selectors(family: str, conds: Sequence[Condition], meta: dict) -> dict[str, np.ndarray]:
    """Named condition weights of a family: ``in_distribution``, ``extrapolated`` and the family's extras."""
    keys = [c.key for c in conds]
    if kind(family) == "resolution":
        base = min(keys, key=lambda k: abs(float(k[1:]) - 1.0))
        return {"in_distribution": _weights(conds, lambda c: c.key == base),
                "extrapolated": _weights(conds, lambda c: float(c.key[1:]) > 1.0 + 1e-9)}  # fmt: skip
    if kind(family) == "long_video":
        T = int(meta["train_frames"])
        lo, hi = VLM_CLAIM_RANGE
        out = {}
        for task, prefix in (("v_niah", ""), ("v_niah_d", "v_niah_d_")):
            if not any(k.startswith(task + "@") for k in keys):
                continue
            def mine(c: Condition, task=task) -> bool:
                return c.key.split("@")[0] == task
            out[prefix + "in_distribution"] = _weights(conds, lambda c, m=mine: m(c) and int(c.key.split("@")[1]) <= T)
            out[prefix + "extrapolated"] = _weights(conds, lambda c, m=mine: m(c) and int(c.key.split("@")[1]) > T)
            out[prefix + "near"] = _weights(
                conds, lambda c, m=mine: m(c) and lo * T <= int(c.key.split("@")[1]) <= hi * T
            )
        return out
    base = meta["train_rotation"]
    out = {"in_distribution": _weights(conds, lambda c: c.key == base),
           "extrapolated": _weights(conds, lambda c: c.key != base)}  # fmt: skip
    if "so3" in keys and base in keys:
        w = np.array([(1.0 if c.key == "so3" else 0.0) - (1.0 if c.key == base else 0.0) for c in conds])
        out["so3_minus_z"] = w
    return out


def _meta(family: str, records: Sequence[dict]) -> dict[str, Any]:
    ev = next(iter(records[0]["rows"].values()))
    if kind(family) == "resolution":
        return {"train_size": ev["train_size"], "patch_size": ev["patch_size"], "num_classes": ev["num_classes"],
                "chance": 1.0 / ev["num_classes"], "ratios": [r["ratio"] for r in ev["results"]],
                "sizes": [r["size"] for r in ev["results"]]}  # fmt: skip
    if kind(family) == "long_video":
        return {"train_frames": ev["train_frames"], "lengths": ev["lengths"], "depths": ev["depths"],
                "samples_per_cell": ev["samples_per_cell"], "chance": ev["chance"]}  # fmt: skip
    return {"train_rotation": ev["train_rotation"], "train_points": ev["train_points"],
            "num_classes": ev["num_classes"], "chance": 1.0 / ev["num_classes"]}  # fmt: skip


def _seeds_of(per_seed: dict[int, np.ndarray]) -> list[int]:
    return sorted(per_seed)


def summarize_family(family: str, records: Sequence[dict], *, reps: int | None = None) -> dict[str, Any]:
    """``{"meta", "conditions", "rows": {row: {cell name: Cell}}}`` of one family."""
    if not records:
        raise ValueError(f"no records for {family}")
    conds, rows = family_matrices(family, records)
    meta = _meta(family, records)
    sel = family_selectors(family, conds, meta)
    kw = {} if reps is None else {"reps": reps}
    out_rows: dict[str, Any] = {}
    for name, per_seed in rows.items():
        seeds = _seeds_of(per_seed)
        mats = [per_seed[s] for s in seeds]
        entry: dict[str, Any] = {"seeds": seeds}
        for key, w in sel.items():
            if key == "so3_minus_z":
                entry[key] = _contrast_cell(mats, w, **kw)
            else:
                entry[key] = cell(mats, w, **kw)
        for i, c in enumerate(conds):
            entry[c.key] = cell(mats, np.eye(len(conds))[i], **kw)
        out_rows[name] = entry
    curves = {}
    for rec in records:  # one curve per trained run (rows that re-evaluate a run share its curve)
        if rec.get("val_curve"):
            curves.setdefault(rec["encoding"], {})[int(rec["seed"])] = rec["val_curve"]
    return {"meta": meta, "conditions": [{"key": c.key, "label": c.label} for c in conds], "rows": out_rows,
            "val_curves": curves}  # fmt: skip


def _contrast_cell(mats: Sequence[np.ndarray], w: np.ndarray, **kw) -> Cell:
    """A within-row contrast (e.g. SO(3) minus z accuracy): the weighted sum of condition accuracies per seed."""
    return paired(mats, mats, w, np.zeros_like(w), **kw)


# ------------------------------------------------------------------------------------------------------------
# claims
# ------------------------------------------------------------------------------------------------------------


def _claim_values(cl: Claim, conds, rows, sel, seeds: list[int], **kw) -> Cell:
    """The paired cell of ``cl`` over ``seeds``: per-seed ``better - other`` on the claim's metric (fractions)."""
    a = [rows[cl.better][s] for s in seeds]
    b = [rows[cl.other][s] for s in seeds]
    keys = [c.key for c in conds]
    if cl.metric in sel:
        w = sel[cl.metric]
    elif "-" in cl.metric and all(part in sel for part in cl.metric.split("-", 1)):  # a row's own contrast
        first, second = cl.metric.split("-", 1)
        w = sel[first] - sel[second]
    elif cl.metric in keys:
        w = np.eye(len(conds))[keys.index(cl.metric)]
    else:
        raise ValueError(f"claim {cl.claim!r}: metric {cl.metric!r} is neither a summary cell nor a condition")
    if (w < 0).any():  # a within-row contrast compared between the rows: w . acc(A) - w . acc(B)
        stacked = [np.concatenate([x, y]) for x, y in zip(a, b)]  # (2C, items): A's conditions, then B's
        both = np.concatenate([w, -w])
        return paired(stacked, stacked, both, np.zeros_like(both), **kw)
    return paired(a, b, w, **kw)


def claim_differences(records: dict[str, Sequence[dict]], claims: Sequence[Claim], *,
                      records_of: str) -> list[dict[int, float]]:  # fmt: skip
    """Per claim, the per-seed differences ``{seed: points}`` on its metric over every seed common to its two rows,
    from the records of claims protocol ``records_of`` (:func:`sequential.select_records`); ``{}`` when a row is
    missing. No decision: what a sensitivity analysis reads."""
    used, _ = select_records(records, current=records_of)
    cache: dict[str, tuple] = {}
    out = []
    for cl in claims:
        recs = used.get(cl.family) or []
        if not recs:
            out.append({})
            continue
        if cl.family not in cache:
            conds, rows = family_matrices(cl.family, recs)
            cache[cl.family] = (conds, rows, family_selectors(cl.family, conds, _meta(cl.family, recs)))
        conds, rows, sel = cache[cl.family]
        seeds = sorted(set(rows.get(cl.better, {})) & set(rows.get(cl.other, {})))
        if not seeds:
            out.append({})
            continue
        c = _claim_values(cl, conds, rows, sel, seeds, reps=2)
        out.append(dict(zip(seeds, (100 * v for v in c["per_seed"]))))
    return out


def row_means(records: dict[str, Sequence[dict]], cl: Claim, seeds: Sequence[int], *,
              records_of: str) -> dict[str, float] | None:
    """The mean over ``seeds`` of each of ``cl``'s two rows on its metric (points), and the family's chance level
    (``chance``, points); None for a contrast metric or a missing row."""
    used, _ = select_records(records, current=records_of)
    recs = used.get(cl.family) or []
    if not recs:
        return None
    conds, rows = family_matrices(cl.family, recs)
    meta = _meta(cl.family, recs)
    sel = family_selectors(cl.family, conds, meta)
    keys = [c.key for c in conds]
    w = sel.get(cl.metric, np.eye(len(conds))[keys.index(cl.metric)] if cl.metric in keys else None)
    if w is None or (w < 0).any() or any(r not in rows or not set(seeds) <= set(rows[r]) for r in (cl.better,
                                                                                                    cl.other)):
        return None
    out = {r: float(np.mean([100 * rows[r][s].mean(axis=1) @ w for s in seeds])) for r in (cl.better, cl.other)}
    return {**out, "chance": 100 * float(meta["chance"])}


def failed_runs(cl: Claim, records: Sequence[dict], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """The runs behind ``cl``'s two rows at ``seeds`` whose last validation accuracy is below the family's floor
    (:data:`claims.FAILED_RUN_FLOORS`): ``{"encoding", "seed", "validation"}`` each. Under the design's
    ``failed_runs == "keep"`` they count like any run; the report names them beside the decision."""
    from claims import FAILED_RUN_FLOORS

    rows = {r.name: r.encoding for r in PROTOCOLS[cl.family].rows}
    encs = {rows.get(cl.better, cl.better), rows.get(cl.other, cl.other)}
    floor, want = FAILED_RUN_FLOORS[cl.family], set(seeds)
    out = []
    for r in records:
        curve = r.get("val_curve") or []
        if r.get("encoding") in encs and int(r.get("seed", -1)) in want and curve and curve[-1][1] < floor:
            out.append({"encoding": r["encoding"], "seed": int(r["seed"]), "validation": float(curve[-1][1])})
    return sorted(out, key=lambda d: (d["encoding"], d["seed"]))


def evaluate_claims(records: dict[str, Sequence[dict]], claims: Sequence[Claim] = CLAIMS, *,
                    reps: int | None = None, design: Design = DESIGN,
                    records_of: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """One entry per registered claim, in points: the sequential decision (:func:`sequential.decide`) from the
    records of the current claims protocol (:func:`sequential.select_records`; the refused ones are listed in
    ``refused`` of every entry's family), with ``diff``, ``ci95`` (95 % t interval), ``ci95_bootstrap``,
    ``per_seed``, ``seed_sd`` over the seeds of the look the verdict was reached at. Rows or families not measured
    give ``verdict: "not measured"`` with the reason. ``records_of``: the claims protocol whose records are read
    (default: the one of ``claims`` and ``design``; a sensitivity analysis reads the registered protocol's)."""
    kw = {} if reps is None else {"reps": reps}
    fp = fingerprint(tuple(claims), design)
    used, refused = select_records(records, design=design, current=records_of or fp)
    cache: dict[str, tuple] = {}
    bases, per_seed, reasons, row_seeds = [], [], [], []
    for cl in claims:
        bases.append({"claim": cl.claim, "paper": cl.paper, "family": cl.family, "better": cl.better,
                      "other": cl.other, "direction": f"{cl.better} > {cl.other}", "metric": cl.metric,
                      "measures": cl.described, "margin": cl.margin, "cap": cl.cap, "protocol": fp})  # fmt: skip
        recs = used.get(cl.family) or []
        if cl.family not in cache and recs:
            conds, rows = family_matrices(cl.family, recs)
            cache[cl.family] = (conds, rows, family_selectors(cl.family, conds, _meta(cl.family, recs)))
        rows = cache[cl.family][1] if recs else {}
        missing = [r for r in (cl.better, cl.other) if r not in rows]
        row_seeds.append({r: sorted(rows.get(r, {})) for r in (cl.better, cl.other)})
        if not recs or missing:
            per_seed.append(None)
            reasons.append(f"no {cl.family} results" if not recs else f"no runs of {', '.join(missing)}")
            continue
        conds, rows, sel = cache[cl.family]
        seeds = sorted(set(rows[cl.better]) & set(rows[cl.other]))
        if not seeds:
            per_seed.append(None)
            reasons.append(f"no seed common to {cl.better} and {cl.other}")
            continue
        c = _claim_values(cl, conds, rows, sel, seeds, reps=2)  # per-seed values only; the bootstrap is below
        per_seed.append(dict(zip(seeds, (100 * v for v in c["per_seed"]))))
        reasons.append(None)
    decisions = decide(per_seed, tuple(claims), design=design)
    out = []
    for cl, base, dec, reason, have in zip(claims, bases, decisions, reasons, row_seeds):
        entry = {**base, "row_seeds": have}
        if dec["verdict"] == "not measured":
            out.append({**entry, "verdict": "not measured", "reason": reason, "diff": None, "ci95": None,
                        "seeds": [], "look": None})  # fmt: skip
            continue
        conds, rows, sel = cache[cl.family]
        c = _claim_values(cl, conds, rows, sel, dec["seeds"], **kw)
        ps = [100 * v for v in c["per_seed"]]
        out.append({**entry, "verdict": dec["verdict"], "diff": dec["diff"], "ci95": dec["ci95"],
                    "half_width": None if dec["ci95"] is None else (dec["ci95"][1] - dec["ci95"][0]) / 2,
                    "seeds": dec["seeds"], "look": dec["look"], "looks": list(design.looks),
                    "alpha_look": dec["alpha_look"], "ci_rule": dec["ci_rule"], "ci_tost": dec["ci_tost"],
                    "next_look": dec["next_look"], "ci95_bootstrap": [100 * x for x in c["ci95_bootstrap"]],
                    "items_per_seed": c["items"], "per_seed": ps,
                    "seed_sd": float(np.std(ps, ddof=1)) if len(ps) > 1 else None,
                    **{k: dec[k] for k in ("p_t", "p_tost", "p_sign_flip", "p_tost_sign_flip", "sign_flip_floor",
                                           "normal_tails") if k in dec},
                    "failed_runs": failed_runs(cl, used.get(cl.family) or [], dec["seeds"])})  # fmt: skip
    for e in out:
        e["refused"] = [r for r in refused if r.startswith(e["family"] + "/")]
    return out
