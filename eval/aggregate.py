"""From per-run records to ``results/summary.json`` and ``results/claims.json``.

Every cell is :func:`stats.cell` of the per-seed outcome matrices of one row (conditions x test items): the mean
over seeds, the sample std over seeds, ``n`` seeds, ``items`` test items per seed, a Student-t 95 % interval over
the per-seed values and a hierarchical-bootstrap interval beside it. Accuracies are fractions. Per family:

* ``vit``: conditions = the test/train size ratios; ``in_distribution`` = 1x, ``extrapolated`` = the mean over the
  larger sizes, one cell per ratio (``x1.43`` ...);
* ``vlm``: conditions = the video lengths of V-NIAH (and of V-NIAH-D); ``in_distribution`` = V-NIAH over the
  lengths up to the training length, ``extrapolated`` = V-NIAH over the longer ones, the same two for V-NIAH-D
  (``v_niah_d_in_distribution`` / ``v_niah_d_extrapolated``) and one cell per task and length (``v_niah@16``);
* ``points``: conditions = z rotation at the training point count (``in_distribution``), SO(3) rotation, 2x / 4x
  points; ``extrapolated`` = the mean over the shifted conditions, one cell per condition and ``so3_minus_z``.

Claims are paired differences (:func:`stats.paired`) of two rows on the same seeds and items, in percentage
points, with the verdict from the t interval (:func:`stats.verdict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from stats import Cell, cell, paired, seeds_needed, unpack_bits, verdict

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


CONDITIONS: dict[str, Callable[[dict], list[tuple[Condition, dict]]]] = {
    "vit": _vit_conditions,
    "vlm": _vlm_conditions,
    "points": _points_conditions,
}


def family_matrices(family: str, records: Sequence[dict]) -> tuple[list[Condition], dict[str, dict[int, np.ndarray]]]:
    """The conditions of ``family`` and, per row and seed, the ``(C, items)`` 0/1 outcome matrix."""
    conds: list[Condition] | None = None
    rows: dict[str, dict[int, np.ndarray]] = {}
    for rec in records:
        for name, ev in rec["rows"].items():
            parts = CONDITIONS[family](ev)
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
    if family == "vit":
        base = min(keys, key=lambda k: abs(float(k[1:]) - 1.0))
        return {"in_distribution": _weights(conds, lambda c: c.key == base),
                "extrapolated": _weights(conds, lambda c: float(c.key[1:]) > 1.0 + 1e-9)}  # fmt: skip
    if family == "vlm":
        T = int(meta["train_frames"])
        out = {}
        for task, prefix in (("v_niah", ""), ("v_niah_d", "v_niah_d_")):
            if not any(k.startswith(task + "@") for k in keys):
                continue
            def mine(c: Condition, task=task) -> bool:
                return c.key.split("@")[0] == task
            out[prefix + "in_distribution"] = _weights(conds, lambda c, m=mine: m(c) and int(c.key.split("@")[1]) <= T)
            out[prefix + "extrapolated"] = _weights(conds, lambda c, m=mine: m(c) and int(c.key.split("@")[1]) > T)
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
    if family == "vit":
        return {"train_size": ev["train_size"], "patch_size": ev["patch_size"], "num_classes": ev["num_classes"],
                "chance": 1.0 / ev["num_classes"], "ratios": [r["ratio"] for r in ev["results"]],
                "sizes": [r["size"] for r in ev["results"]]}  # fmt: skip
    if family == "vlm":
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


@dataclass(frozen=True)
class Claim:
    """``better`` beats ``other`` on ``metric`` (a selector name or a condition key of ``family``); with
    ``contrast`` the compared quantity is the row's own contrast (e.g. ``so3_minus_z``)."""

    claim: str
    paper: str
    family: str
    better: str
    other: str
    metric: str
    described: str  # what the difference measures, in words


#: The precision every claim must reach: a 95 % half-width of at most this many percentage points. Each claim
#: records whether it does (``precision_met``) and, from its per-seed spread, how many seeds would (``seeds_needed``).
PRECISION = 3.0

CLAIMS: tuple[Claim, ...] = (
    Claim("LookHere > 2D RoPE at 4.57x the training resolution",
          "Fuller et al., NeurIPS 2024: +21.7 points top-1 over 2D RoPE at 1024 px after training at 224 px",
          "vit", "lookhere", "rope", "x4.57", "top-1 at 4.57x, LookHere minus RoPE"),
    Claim("PaPE > LookHere at 4.57x", "Øhrstrøm et al. 2026: up to +10.5 points over the next-best encoding "
          "(LookHere) at 4.57x", "vit", "pape", "lookhere", "x4.57", "top-1 at 4.57x, PaPE minus LookHere"),
    Claim("CPVT/PEG holds at higher resolution where APE drops",
          "Chu et al., ICLR 2023: PEG keeps its accuracy at larger test sizes, interpolated APE degrades",
          "vit", "peg", "ape", "extrapolated", "top-1 averaged over the test sizes above 1x, PEG minus APE"),
    Claim("VideoRoPE > MRoPE on V-NIAH", "Wei et al., ICML 2025: V-NIAH 91.1 vs 78.7 for M-RoPE",
          "vlm", "videorope", "mrope", "extrapolated", "V-NIAH beyond the training length, VideoRoPE minus MRoPE"),
    Claim("VideoRoPE > MRoPE on V-NIAH-D", "Wei et al., ICML 2025: V-NIAH-D 87.1 vs 74.7 for M-RoPE",
          "vlm", "videorope", "mrope", "v_niah_d_extrapolated",
          "V-NIAH-D beyond the training length, VideoRoPE minus MRoPE"),
    Claim("HoPE > MRoPE", "Li et al., NeurIPS 2025: HoPE retrieves better than M-RoPE beyond the training length",
          "vlm", "hope_video", "mrope", "extrapolated", "V-NIAH beyond the training length, HoPE minus MRoPE"),
    Claim("MRoPE-I > MRoPE", "Huang et al., ICLR 2026: interleaved allocation extrapolates better than chunked "
          "M-RoPE", "vlm", "mrope_i", "mrope", "extrapolated", "V-NIAH beyond the training length, MRoPE-I minus MRoPE"),
    Claim("PaPE-RI robust to SO(3)", "Øhrstrøm et al. 2026: the rotation-invariant variant keeps its accuracy under "
          "rotations it was not trained on", "points", "pape_ri", "pape", "so3_minus_z",
          "change of top-1 from z to unseen SO(3) test rotations, PaPE-RI minus PaPE"),
)  # fmt: skip


def evaluate_claims(records: dict[str, Sequence[dict]], claims: Sequence[Claim] = CLAIMS, *,
                    reps: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """``[{"claim", "paper", "diff", "ci95", "verdict", ...}]`` in percentage points; rows or families not measured
    give ``verdict: "not measured"`` with the reason."""
    kw = {} if reps is None else {"reps": reps}
    out = []
    cache: dict[str, tuple] = {}
    for cl in claims:
        base = {"claim": cl.claim, "paper": cl.paper, "family": cl.family, "better": cl.better, "other": cl.other,
                "metric": cl.metric, "measures": cl.described}  # fmt: skip
        recs = records.get(cl.family) or []
        if not recs:
            out.append({**base, "diff": None, "ci95": None, "verdict": "not measured",
                        "reason": f"no {cl.family} results"})  # fmt: skip
            continue
        if cl.family not in cache:
            conds, rows = family_matrices(cl.family, recs)
            cache[cl.family] = (conds, rows, family_selectors(cl.family, conds, _meta(cl.family, recs)))
        conds, rows, sel = cache[cl.family]
        missing = [r for r in (cl.better, cl.other) if r not in rows]
        if missing:
            out.append({**base, "diff": None, "ci95": None, "verdict": "not measured",
                        "reason": f"no runs of {', '.join(missing)}"})  # fmt: skip
            continue
        seeds = sorted(set(rows[cl.better]) & set(rows[cl.other]))
        a = [rows[cl.better][s] for s in seeds]
        b = [rows[cl.other][s] for s in seeds]
        keys = [c.key for c in conds]
        if cl.metric in sel:
            w = sel[cl.metric]
        elif cl.metric in keys:
            w = np.eye(len(conds))[keys.index(cl.metric)]
        else:
            raise ValueError(f"claim {cl.claim!r}: metric {cl.metric!r} is neither a summary cell nor a condition")
        if (w < 0).any():  # a within-row contrast compared between the rows: w . acc(A) - w . acc(B)
            stacked = [np.concatenate([x, y]) for x, y in zip(a, b)]  # (2C, items): A's conditions, then B's
            both = np.concatenate([w, -w])
            c = paired(stacked, stacked, both, np.zeros_like(both), **kw)
        else:
            c = paired(a, b, w, **kw)
        ci = None if c["ci95"] is None else [100 * c["ci95"][0], 100 * c["ci95"][1]]
        hw = None if ci is None else (ci[1] - ci[0]) / 2
        sd = float(np.std(100 * np.asarray(c["per_seed"]), ddof=1)) if len(c["per_seed"]) > 1 else None
        out.append({**base, "diff": 100 * c["mean"], "ci95": ci, "half_width": hw,
                    "precision_target": PRECISION, "precision_met": hw is not None and hw <= PRECISION,
                    "seed_sd": sd, "seeds_needed": None if sd is None else seeds_needed(sd, PRECISION),
                    "ci95_bootstrap": [100 * x for x in c["ci95_bootstrap"]], "seeds": seeds,
                    "items_per_seed": c["items"], "per_seed": [100 * x for x in c["per_seed"]],
                    "verdict": verdict(c["ci95"])})  # fmt: skip
    return out
