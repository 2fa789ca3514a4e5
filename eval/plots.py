"""The benchmark's figures, from ``results/summary.json``: each states the training size or length, the test items
and seeds behind every point, chance level, and draws the 95 % intervals (Student-t over seeds, :mod:`stats`).

* ``vit/resolution.png``: top-1 against test size / training size, one line per row, shaded intervals;
* ``vlm/accuracy_vs_length.png``: V-NIAH and V-NIAH-D exact match against video length, training length marked;
* ``vlm/heatmap_<row>.png``: depth x length grids (mean over seeds), the training length as a vertical line;
* ``points/conditions.png``: top-1 per test condition, one group of bars per row, interval whiskers;
* ``claims.png`` (from ``results/claims.json``): every claim's difference with its 95 % interval (thick) and the
  interval at the level its look used (thin), against its ``+-margin`` band and 0, the verdict beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

__all__ = ["plot_vit", "plot_vlm", "plot_vlm_heatmaps", "plot_points", "plot_claims"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _order(rows: dict[str, Any], key: str) -> list[str]:
    return sorted(rows, key=lambda r: -(rows[r][key]["mean"] if rows[r].get(key) else 0.0))


def _band(ax, x, cells, color, label, ls="-"):
    m = [100 * c["mean"] for c in cells]
    lo = [100 * (max(0.0, c["ci95"][0]) if c["ci95"] else c["mean"]) for c in cells]
    hi = [100 * (min(1.0, c["ci95"][1]) if c["ci95"] else c["mean"]) for c in cells]
    ax.plot(x, m, ls, marker="o", ms=3, color=color, label=label, lw=1.4)
    ax.fill_between(x, lo, hi, color=color, alpha=0.15, lw=0)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def _n_text(rows: dict[str, Any], key: str) -> str:
    seeds = sorted({rows[r][key]["n"] for r in rows})
    items = sorted({rows[r][key]["items"] for r in rows})
    return f"{'/'.join(map(str, seeds))} seeds x {'/'.join(map(str, items))} test items per seed"


def plot_vit(vit: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    meta, rows = vit["meta"], vit["rows"]
    conds = [c["key"] for c in vit["conditions"]]
    x = meta["ratios"]
    fig, ax = plt.subplots(figsize=(8.6, 5.0))
    cmap = plt.get_cmap("tab20")
    for k, r in enumerate(_order(rows, "extrapolated")):
        _band(ax, x, [rows[r][c] for c in conds], cmap(k % 20), r, "--" if "+" in r else "-")
    ax.axhline(100 * meta["chance"], color="grey", lw=1, ls=":", label=f"chance ({100 * meta['chance']:.0f} %)")
    ax.axvline(1.0, color="k", lw=1, ls="--")
    g = meta["train_size"] // meta["patch_size"]
    ax.set_xlabel(f"test size / training size (trained at {meta['train_size']} px = {g}x{g} patches, dashed)")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(f"ViT resolution extrapolation: mean and 95 % interval over {_n_text(rows, 'in_distribution')}",
                 fontsize=9)  # fmt: skip
    ax.set_xticks(x, [f"{v:.3g}" for v in x])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    return _save(fig, path)


def plot_vlm(vlm: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    meta, rows = vlm["meta"], vlm["rows"]
    L = meta["lengths"]
    tasks = [t for t in ("v_niah", "v_niah_d") if any(f"{t}@{n}" in rows[r] for r in rows for n in L)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.0 * len(tasks), 4.4), squeeze=False, sharey=True)
    cmap = plt.get_cmap("tab10")
    for ax, t in zip(axes[0], tasks):
        for k, r in enumerate(_order(rows, "extrapolated")):
            _band(ax, L, [rows[r][f"{t}@{n}"] for n in L], cmap(k % 10), r, "--" if "+" in r else "-")
        ax.axvline(meta["train_frames"], color="k", ls="--", lw=1)
        ax.axhline(100 * meta["chance"], color="grey", lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(L, [str(n) for n in L])
        ax.set_xlabel(f"video length (frames; trained at {meta['train_frames']}, dashed; chance dotted)")
        ax.set_title(f"{t.replace('_', '-').upper()}: mean, 95 % interval; {_n_text(rows, 'in_distribution')}",
                     fontsize=8)  # fmt: skip
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("teacher-forced exact match (%)")
    axes[0][-1].legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    return _save(fig, path)


def plot_vlm_heatmaps(grids: dict[str, dict[str, Any]], meta: dict[str, Any], out: Path) -> list[Path]:
    """``grids[row][task]`` = ``[depth][length]`` mean accuracy over seeds; one figure per row."""
    plt = _plt()
    L, D = meta["lengths"], meta["depths"]
    paths = []
    for r, by_task in sorted(grids.items()):
        tasks = sorted(by_task)
        fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks) + 1.0, 3.9), squeeze=False,
                                 constrained_layout=True)  # fmt: skip
        for ax, t in zip(axes[0], tasks):
            g = [[100 * v for v in row] for row in by_task[t]["grid"]]
            im = ax.imshow(g, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="upper")
            ax.set_xticks(range(len(L)), [str(n) for n in L])
            ax.set_yticks(range(len(D)), [f"{d:.1f}" for d in D])
            j = sum(1 for n in L if n <= meta["train_frames"]) - 0.5
            ax.axvline(j, color="k", lw=2)
            ax.text(j - 0.1, len(D) - 0.55, f"trained ≤ {meta['train_frames']} fr |", fontsize=7, ha="right",
                    va="bottom", color="k")  # fmt: skip
            for i in range(len(D)):
                for k in range(len(L)):
                    ax.text(k, i, f"{g[i][k]:.0f}", ha="center", va="center", fontsize=6)
            ax.set_xlabel("video length (frames)")
            ax.set_ylabel("needle depth")
            ax.set_title(f"{r} {t.replace('_', '-').upper()} ({by_task[t]['seeds']} seeds x "
                         f"{meta['samples_per_cell']} needles/cell)", fontsize=8)  # fmt: skip
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.9, label="exact match (%), mean over seeds")
        paths.append(_save(fig, out / f"heatmap_{r}.png"))
    return paths


def plot_points(pts: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    meta, rows = pts["meta"], pts["rows"]
    conds = pts["conditions"]
    order = _order(rows, "in_distribution")
    fig, ax = plt.subplots(figsize=(8.6, 4.4))
    width = 0.8 / max(1, len(order))
    cmap = plt.get_cmap("tab10")
    for k, r in enumerate(order):
        xs = [i + (k - (len(order) - 1) / 2) * width for i in range(len(conds))]
        cells = [rows[r][c["key"]] for c in conds]
        m = [100 * c["mean"] for c in cells]
        err = [[100 * (c["mean"] - max(0.0, c["ci95"][0])) if c["ci95"] else 0.0 for c in cells],
               [100 * (min(1.0, c["ci95"][1]) - c["mean"]) if c["ci95"] else 0.0 for c in cells]]  # fmt: skip
        ax.bar(xs, m, width, yerr=err, capsize=2, color=cmap(k % 10), label=r)
    ax.axhline(100 * meta["chance"], color="grey", lw=1, ls=":", label=f"chance ({100 * meta['chance']:.0f} %)")
    ax.set_xticks(range(len(conds)), [c["label"] for c in conds])
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(f"Point clouds, trained with {meta['train_rotation']} rotations at {meta['train_points']} points: "
                 f"mean, 95 % interval; {_n_text(rows, 'in_distribution')}", fontsize=8)  # fmt: skip
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return _save(fig, path)


def heat_grids(records: Sequence[dict]) -> dict[str, dict[str, Any]]:
    """Per row and task, the depth x length grid averaged over the seeds of the VLM records."""
    acc: dict[str, dict[str, list]] = {}
    for rec in records:
        for r, ev in rec["rows"].items():
            for t, entry in ev["tasks"].items():
                if "teacher" in entry:
                    acc.setdefault(r, {}).setdefault(t, []).append(entry["teacher"]["grid"])
    out: dict[str, dict[str, Any]] = {}
    for r, by_task in acc.items():
        for t, grids in by_task.items():
            mean = [[sum(g[i][j] for g in grids) / len(grids) for j in range(len(grids[0][0]))]
                    for i in range(len(grids[0]))]  # fmt: skip
            out.setdefault(r, {})[t] = {"grid": mean, "seeds": len(grids)}
    return out


VERDICT_COLORS = {"agrees": "tab:green", "disagrees": "tab:red", "equivalent": "tab:blue", "unresolved": "tab:orange",
                  "open": "tab:gray", "not measured": "lightgray"}  # fmt: skip


def plot_claims(claims: Sequence[dict[str, Any]], path: Path, *, span: float = 60.0) -> Path:
    """One line per claim (top to bottom in registry order): the margin band, the interval at the look's level
    (thin, clipped to ``+-span`` points with an arrow where it goes further), the 95 % interval (thick) and the
    difference (dot), coloured by verdict."""
    plt = _plt()
    n = len(claims)
    fig, ax = plt.subplots(figsize=(9.0, 0.42 * n + 1.4))
    for i, c in enumerate(claims):
        y = n - 1 - i
        ax.add_patch(plt.Rectangle((-c["margin"], y - 0.32), 2 * c["margin"], 0.64, color="0.88", lw=0, zorder=0))
        color = VERDICT_COLORS.get(c["verdict"], "k")
        tail = c["verdict"] if c.get("look") is None else f"{c['verdict']}, look {c['look']}, {len(c['seeds'])} seeds"
        ax.text(span * 1.02, y, tail, va="center", fontsize=7, color=color)
        if c.get("diff") is None:
            continue
        if c.get("ci_rule"):
            lo, hi = c["ci_rule"]
            ax.plot([max(lo, -span), min(hi, span)], [y, y], color=color, lw=1, zorder=2)
            for end, edge in ((lo, -span), (hi, span)):
                if abs(end) > span:
                    ax.annotate("", (edge, y), (edge - 3 * (edge > 0) + 3 * (edge < 0), y),
                                arrowprops={"arrowstyle": "->", "color": color, "lw": 1})  # fmt: skip
        if c.get("ci95"):
            ax.plot([max(c["ci95"][0], -span), min(c["ci95"][1], span)], [y, y], color=color, lw=4, zorder=3)
        ax.plot([c["diff"]], [y], "o", color="k", ms=4, zorder=4)
    ax.axvline(0, color="k", lw=1)
    ax.set_yticks(range(n), [c["claim"] for c in reversed(claims)], fontsize=7)
    ax.set_xlim(-span, span)
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlabel("paired difference, claimed better minus other (points); grey: ±margin")
    ax.set_title("Paper claims: 95 % interval (thick), interval at the look's level (thin), per-claim margin",
                 fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.subplots_adjust(right=0.78)
    return _save(fig, path)
