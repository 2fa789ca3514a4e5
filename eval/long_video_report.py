"""Summaries and reports of long-video retrieval grids: means of a depth x length grid, tables and heatmaps.

:func:`summarize` reduces a ``[depth][length]`` accuracy grid to per-length and per-depth means, the overall
mean, and the in-distribution (lengths up to the training length) and extrapolated means;
:func:`markdown` tabulates evaluations (``eval/long_video.py --run`` and ``--hf-model`` alike) per task and
scoring, :func:`heatmap` draws one panel per task and scoring, and :func:`write_report` writes
``long_video.json``, ``long_video.md`` and ``heatmap_<run>.png`` per run. The tasks (:data:`TASKS`) and the
report names of the scorings live here too, in the order the report shows them, and the default needle depths
(:data:`DEFAULT_DEPTHS`) that both evaluations (``eval/long_video.py`` and ``eval/hf_long_video.py``) share.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch

from report_tables import fmt, markdown_table, write_tables

__all__ = ["TASKS", "REPORT_SCORINGS", "DEFAULT_DEPTHS", "summarize", "markdown", "heatmap", "write_report"]


TASKS = ("v_niah", "v_niah_d")
# every scoring a report shows: "choice" is the multiple-choice log-likelihood of --hf-model (eval/hf_long_video.py)
REPORT_SCORINGS = {"teacher": "teacher-forced", "generate": "greedy generation", "choice": "multiple choice"}
DEFAULT_DEPTHS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # LongVA / HoPE: depth step 0.2


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def summarize(grid: list[list[float]], lengths: Sequence[int], train_frames: int) -> dict[str, Any]:
    """Means of a depth x length grid: overall, per length, in-distribution (<= training length), extrapolated."""
    per_length = [_mean([row[j] for row in grid]) for j in range(len(lengths))]
    ind = [a for L, a in zip(lengths, per_length) if L <= train_frames]
    ext = [a for L, a in zip(lengths, per_length) if L > train_frames]
    return {
        "grid": grid,
        "per_length": per_length,
        "per_depth": [_mean(row) for row in grid],
        "mean": _mean(per_length),
        "in_distribution": _mean(ind),
        "extrapolated": _mean(ext),
    }


def markdown(evals: Sequence[dict]) -> str:
    """Per task and scoring: accuracy per length (mean over depths), in-distribution vs extrapolated."""
    out = ["# Long-video retrieval (V-NIAH / V-NIAH-D)\n\n",
           "Accuracy (%: exact match, or the best-scored option for multiple choice), mean over depths per length; "
           "in-distribution = lengths up to the training length, extrapolated = longer. Same weights, no "
           "fine-tuning.\n"]  # fmt: skip
    lengths = sorted({L for ev in evals for L in ev["lengths"]})  # the union: runs may differ
    tasks = [t for t in TASKS if any(t in ev["tasks"] for ev in evals)]
    for t in tasks:
        for s in REPORT_SCORINGS:  # a table per scoring, with the evaluations that have it (--run / --hf-model)
            have = [ev for ev in evals if s in ev["tasks"].get(t, {})]
            if not have:
                continue
            head = ["run", "variant", "train frames"] + [f"{L} fr" for L in lengths]
            head += ["mean", "in-dist", "extrap"]
            rows = []
            for ev in have:
                r = ev["tasks"][t][s]
                acc = dict(zip(ev["lengths"], r["per_length"]))
                rows.append([ev["name"], ev["variant"], ev["train_frames"], *(fmt(acc.get(L)) for L in lengths),
                             fmt(r["mean"]), fmt(r["in_distribution"]), fmt(r["extrapolated"])])  # fmt: skip
            out += [f"\n## {t.replace('_', '-').upper()}, {REPORT_SCORINGS[s]}\n\n", markdown_table(head, rows)]
        agreeing = [ev for ev in evals if "agreement" in ev["tasks"].get(t, {})]
        if agreeing:
            agree = ", ".join(f"{ev['name']} {fmt(ev['tasks'][t]['agreement'])}" for ev in agreeing)
            out.append(f"\nAgreement of the two scorings on {t.replace('_', '-').upper()} (% of samples): {agree}.\n")
    return "".join(out)


def heatmap(ev: dict, path: Path, *, title: str | None = None) -> Path:
    """Depth x length heatmaps of one evaluation: one panel per (task, scoring); a dashed line marks the
    training length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, s) for t in ev["tasks"] for s in REPORT_SCORINGS if s in ev["tasks"][t]]
    fig, axes = plt.subplots(1, len(panels), figsize=(2.9 * len(panels) + 1.0, 3.4), squeeze=False,
                             layout="constrained")
    lengths, depths = ev["lengths"], ev["depths"]
    im = None
    for k, (ax, (t, s)) in enumerate(zip(axes[0], panels)):
        grid = torch.tensor(ev["tasks"][t][s]["grid"], dtype=torch.float64) * 100
        im = ax.imshow(grid.numpy(), vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths] if k == 0 else [], fontsize=7)
        ind = [j for j, L in enumerate(lengths) if L <= ev["train_frames"]]
        if ind and ind[-1] < len(lengths) - 1:
            ax.axvline(ind[-1] + 0.5, color="k", ls="--", lw=1)
        ax.set_xlabel("frames")
        if k == 0:
            ax.set_ylabel("needle depth")
        r = ev["tasks"][t][s]
        ax.set_title(f"{t.replace('_', '-').upper()} {s}\nin {fmt(r['in_distribution'])} / ext {fmt(r['extrapolated'])}",
                     fontsize=8)  # fmt: skip
    fig.suptitle(title or f"{ev['name']} ({ev['variant']}), trained at {ev['train_frames']} frames", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy (%)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(evals: Sequence[dict], out_dir: str | Path) -> dict[str, Path]:
    """``long_video.json``, ``long_video.md`` and ``heatmap_<run>.png`` per run under ``out_dir``."""
    out = Path(out_dir)
    paths = write_tables(evals, out, "long_video", markdown)
    for ev in evals:
        paths[f"heatmap_{ev['name']}"] = heatmap(ev, out / f"heatmap_{ev['name']}.png")
    return paths
