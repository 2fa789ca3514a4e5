"""``python eval/properties.py``: every registered encoding side by side (step 4 of ``make demo``).

For each name in :func:`vlpe.encodings.available` (or ``--only``) the demo

1. builds the encoding as the property tests do (``dim=64, num_heads=4`` unless its example declares a size,
   ``depth=2``, the first of its ``supported_axes``, its declared ``example`` options),
2. runs the property kit over every property (:func:`vlpe.testing.property_report`), one table row each,
3. plots the attention of the centre patch over the patch grid at two resolutions, one panel per head,
   to ``<out>/attention_<name>.png``, and the head-averaged pattern of every encoding to
   ``<out>/overview.png``.

What the plots show: every token carries the same content vector ``c`` (random, fixed seed, norm
``sqrt(head_dim)`` per head), the encoding's ``embed`` hook (absolute encodings) is applied to it, and
``q = k =`` the result, split into heads (identity projections). So the only thing that varies between
tokens is position: ``softmax`` over keys of :func:`vlpe.attention_logits` for the centre query. A random
``c`` (rather than all ones) gives every rotary frequency pair some weight, so for RoPE the map is
``sum_m |c_m|^2 cos(theta_m . delta)``, peaked at the query. Learned encodings are shown at their
initialisation; ``mix`` hooks (PEG) act between blocks and are not part of these single-layer maps.

Positions: 2-axis encodings get an ``s x s`` grid; 3-axis ones (video, multimodal ``(t, h, w)``) one
frame ``(0, h, w)`` of ``s x s``; both with a CLS token first, as in the property kit (left out of the
softmax). 1-axis ones (decoders) get a sequence of ``s * s`` tokens, drawn as curves. Other axis counts
are skipped with a note.

Building, checking or plotting an encoding that fails prints the error in its row and the demo goes on,
but exits with status 1 at the end (a claimed property that fails counts as a failure).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from vlpe.attention import attention_logits
from vlpe.encodings import available, build, get
from vlpe.encodings.base import Encoding
from vlpe.positions import Positions
from vlpe.testing import CHECKS, example, property_report

__all__ = ["main", "build_for_demo", "demo_positions", "attention_map", "Row"]

DEPTH = 2  # the size is the kit's: dim 64, 4 heads unless the encoding's example declares its own
DEFAULT_SIZES = (8, 16)
PROPERTIES = tuple(sorted(CHECKS)) + ("errors",)
_SHORT = {"zero_init": "zero", "rotation_invariant": "rot_inv", "extrapolation": "extrap", "fp32_angles": "fp32"}


def build_for_demo(name: str) -> Encoding:
    """``name`` in its declared example configuration (as the property kit builds it), in eval mode."""
    return example(name, depth=DEPTH).eval()


def demo_positions(num_axes: int, size: int) -> tuple[Positions, tuple[int, ...], int]:
    """Positions for a ``size``-resolution plot, the plotted shape, and the row-major index of the query
    among the non-prefix tokens.

    Like the property kit: one CLS prefix token for images and video, none for 1D sequences. Raises
    ``ValueError`` for axis counts the demo cannot draw (anything but 1, 2, 3).
    """
    if num_axes == 2:
        pos, shape = Positions.grid(size, size, prefix=1), (size, size)
    elif num_axes == 3:
        pos, shape = Positions.grid_nd((1, size, size), prefix=1, axes=("t", "h", "w")), (size, size)
    elif num_axes == 1:
        pos, shape = Positions.grid_nd((size * size,)), (size * size,)
    else:
        raise ValueError(f"the demo draws 1, 2 or 3 coordinate axes, not {num_axes}")
    centre = 0
    for s in shape:
        centre = centre * s + s // 2
    return pos, shape, centre


def content_vector(dim: int, num_heads: int, *, seed: int = 0) -> Tensor:
    """``(dim,)``: random, each head's slice scaled to norm ``sqrt(head_dim)`` (logit ``sqrt(Dh)`` at offset 0)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(num_heads, dim // num_heads, generator=g)  # (H, Dh)
    c = c / c.norm(dim=-1, keepdim=True) * math.sqrt(dim // num_heads)
    return c.reshape(dim)


@torch.no_grad()
def attention_map(enc: Encoding, size: int, *, seed: int = 0) -> tuple[Tensor, tuple[int, ...], int]:
    """Attention probabilities of the centre query over the patch keys, ``(H, *shape)``, with shape and query index.

    Content is the same for every token (see the module docstring), so the map is the encoding's alone. The
    softmax runs over the patch keys only (the CLS key is left out), so every map sums to 1 over the grid.
    """
    pos, shape, centre = demo_positions(enc.num_axes, size)
    N, H = pos.num_tokens, enc.num_heads
    x = content_vector(enc.dim, H, seed=seed).expand(1, N, enc.dim)  # (1, N, C)
    x = enc.embed(x, enc.prepare(pos))  # absolute encodings add their table
    q = x.reshape(1, N, H, enc.dim // H).transpose(1, 2)  # (1, H, N, Dh)
    logits = attention_logits(enc, q, q, pos)  # (1, H, N, N)
    p = pos.prefix
    probs = logits[0, :, p + centre, p:].float().softmax(dim=-1)  # (H, N - prefix)
    return probs.reshape(H, *shape), shape, centre


# --------------------------------------------------------------------------- plotting
# Each 2D map is drawn relative to its own peak (colour 0 = probability 0, 1 = the map's maximum), so a
# uniform map is flat yellow; titles give the peak as a multiple of uniform attention (1.0x = flat).
# Maps are tiled into one image per figure (one Axes): matplotlib spends its time per Axes, not per pixel.


def _peak(probs: Tensor) -> float:
    return float(probs.max()) * probs.numel()


def _upsample(a: Tensor, side: int) -> Tensor:
    """Nearest-neighbour resize of a square map to ``side x side``."""
    idx = torch.arange(side) * a.shape[0] // side
    return a[idx][:, idx]


def _mosaic(panels: list[list[Tensor]], side: int, gap: int = 2) -> Tensor:
    """Rows x cols of square maps (each scaled to its peak, resized to ``side``), NaN gaps between them."""
    rows, cols = len(panels), max(len(r) for r in panels)
    out = torch.full((rows * (side + gap) - gap, cols * (side + gap) - gap), float("nan"))
    for i, row in enumerate(panels):
        for j, m in enumerate(row):
            y, x = i * (side + gap), j * (side + gap)
            out[y : y + side, x : x + side] = _upsample(m / m.max().clamp_min(1e-30), side)
    return out


def _query_xy(shape: tuple[int, ...], centre: int, side: int, i: int, j: int, gap: int = 2) -> tuple[float, float]:
    """Pixel position of the query cell's centre in panel (i, j) of a mosaic."""
    cell = side / shape[0]
    r, c = divmod(centre, shape[1])
    return j * (side + gap) + (c + 0.5) * cell - 0.5, i * (side + gap) + (r + 0.5) * cell - 0.5


def _imshow(ax, image: Tensor) -> None:
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    ax.imshow(image.numpy(), cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
    for spine in ax.spines.values():
        spine.set_visible(False)


def plot_encoding(name: str, maps: list[tuple[int, Tensor, tuple[int, ...], int]], path: Path, hooks: str) -> None:
    """One row per resolution, one column per head (curves per head for 1D encodings)."""
    from matplotlib.figure import Figure

    heads = maps[0][1].shape[0]
    title = f"{name} ({hooks or 'no hooks'}): attention of the centre query, content fixed"
    if len(maps[0][2]) == 1:  # 1D: one panel per length, one curve per head
        fig = Figure(figsize=(4.0 * len(maps), 2.8))
        axes = fig.subplots(1, len(maps), squeeze=False)[0]
        for ax, (_, probs, shape, centre) in zip(axes, maps):
            for h in range(heads):
                ax.plot(probs[h].numpy(), lw=0.8, label=f"head {h} ({_peak(probs[h]):.1f}x)")
            ax.axvline(centre, color="red", lw=0.6)
            ax.set_title(f"L = {shape[0]} tokens", fontsize=8)
            ax.tick_params(labelsize=6)
            ax.legend(fontsize=6)
        fig.suptitle(title, fontsize=9)
        fig.subplots_adjust(top=0.8, bottom=0.1, left=0.06, right=0.98)
        fig.savefig(path, dpi=80)
        return
    side = max(m[2][0] for m in maps)
    fig = Figure(figsize=(1.6 * heads + 0.8, 1.6 * len(maps) + 0.6))
    ax = fig.add_axes((0.1, 0.02, 0.88, 0.86))
    _imshow(ax, _mosaic([[probs[h] for h in range(heads)] for _, probs, _, _ in maps], side))
    marks = [_query_xy(m[2], m[3], side, i, h) for i, m in enumerate(maps) for h in range(heads)]
    ax.scatter([x for x, _ in marks], [y for _, y in marks], marker="x", color="red", s=14, linewidths=1)
    middle = side / 2 - 0.5
    ax.set_xticks([h * (side + 2) + middle for h in range(heads)], [f"head {h}" for h in range(heads)], fontsize=7)
    ax.set_yticks([i * (side + 2) + middle for i in range(len(maps))], [f"{s}x{s}" for s, *_ in maps], fontsize=7)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    peaks = "; ".join(f"{s}x{s}: " + " ".join(f"{_peak(p[h]):.1f}" for h in range(heads)) for s, p, *_ in maps)
    fig.suptitle(f"{title}\npeak vs uniform per head: {peaks}", fontsize=7)
    fig.savefig(path, dpi=80)


def plot_overview(entries: list[tuple[str, Tensor, tuple[int, ...], int]], path: Path) -> None:
    """Head-averaged map at the largest resolution, one tile per encoding (curves for 1D encodings)."""
    from matplotlib.figure import Figure

    flat = [e for e in entries if len(e[2]) == 2]
    lines = [e for e in entries if len(e[2]) == 1]
    cols = max(1, min(6, len(flat)))
    rows = math.ceil(len(flat) / cols)
    side = max((e[2][0] for e in flat), default=1)
    height = 2.0 * rows + (2.0 if lines else 0.0) + 0.4
    fig = Figure(figsize=(2.0 * cols + 0.4, height))
    if flat:
        top = 1.0 - 0.4 / height
        bottom = (2.0 / height) if lines else 0.02
        ax = fig.add_axes((0.02, bottom, 0.96, top - bottom))
        tiles = [[e[1].mean(0) for e in flat[r * cols : (r + 1) * cols]] for r in range(rows)]
        _imshow(ax, _mosaic(tiles, side, gap=side // 3))
        ax.set_xticks([])
        ax.set_yticks([])
        g = side // 3
        for k, (name, probs, shape, centre) in enumerate(flat):
            i, j = divmod(k, cols)
            x, y = _query_xy(shape, centre, side, i, j, gap=g)
            ax.scatter([x], [y], marker="x", color="red", s=12, linewidths=1)
            ax.text(j * (side + g) + side / 2, i * (side + g) - 0.8, f"{name} ({_peak(probs.mean(0)):.1f}x)",
                    ha="center", va="bottom", fontsize=7)
    if lines:
        ax = fig.add_axes((0.08, 0.12 * 2.0 / height + 0.02, 0.88, 1.4 / height))
        for name, probs, shape, centre in lines:
            ax.plot(probs.mean(0).numpy(), lw=0.8, label=name)
        ax.axvline(lines[0][3], color="red", lw=0.6)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=6)
    fig.suptitle("attention of the centre query, mean over heads, content fixed (position only)", fontsize=9)
    fig.savefig(path, dpi=80)


# --------------------------------------------------------------------------- the job
@dataclass
class Row:
    name: str
    axes: str = "?"
    hooks: str = ""
    report: dict[str, str] = field(default_factory=dict)
    plot: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.errors) or any(v.startswith("FAIL") for v in self.report.values())


def _cell(value: str | None) -> str:
    if value is None:
        return "?"
    if value == "ok":
        return "ok"
    if value.startswith("FAIL"):
        return "FAIL"
    return "yes" if value.startswith("holds") else "-"


def run_one(name: str, sizes: Sequence[int], out: Path, plots: bool) -> tuple[Row, tuple | None]:
    row = Row(name)
    try:
        enc = build_for_demo(name)
    except Exception as e:  # noqa: BLE001 - reported in the row, counted as a failure
        row.errors.append(f"build: {type(e).__name__}: {e}")
        return row, None
    row.axes, row.hooks = str(enc.num_axes), ",".join(enc.hooks)
    try:
        torch.manual_seed(0)
        row.report = property_report(enc, all_properties=True)
    except Exception as e:  # noqa: BLE001
        row.errors.append(f"properties: {type(e).__name__}: {e}")
    enc.eval()
    if not plots:
        row.plot = "off"
        return row, None
    if enc.num_axes not in (1, 2, 3):
        row.plot = f"skipped ({enc.num_axes} axes)"
        return row, None
    try:
        maps = []
        for s in sizes:
            probs, shape, centre = attention_map(enc, s)
            if not torch.isfinite(probs).all():
                raise ValueError(f"non-finite attention at size {s}")
            maps.append((s, probs, shape, centre))
        path = out / f"attention_{name}.png"
        plot_encoding(name, maps, path, row.hooks)
        row.plot = path.name
        return row, (name, *maps[-1][1:])
    except Exception as e:  # noqa: BLE001
        row.errors.append(f"plot: {type(e).__name__}: {e}")
        row.plot = "ERROR"
        return row, None


def format_table(rows: list[Row]) -> str:
    head = ["encoding", "axes", "hooks"] + [_SHORT.get(p, p) for p in PROPERTIES] + ["plot"]
    body = [
        [r.name, r.axes, r.hooks or "-"]
        + [("ERROR" if r.errors and not r.report else _cell(r.report.get(p))) for p in PROPERTIES]
        + [r.plot or "-"]
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*b) for b in body]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python eval/properties.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="encodings to run (default: all registered)")
    parser.add_argument("--out", type=Path, default=Path("outputs/properties"),
                        help="plot folder (default: outputs/properties)")
    parser.add_argument("--sizes", nargs="+", type=int, default=list(DEFAULT_SIZES), help="grid sides (default: 8 16)")
    parser.add_argument("--no-plots", action="store_true", help="property table only")
    args = parser.parse_args(argv)
    if any(s < 1 for s in args.sizes):
        parser.error(f"--sizes must be >= 1, got {args.sizes}")

    from tqdm import tqdm

    t0 = time.perf_counter()
    names = list(args.only) if args.only else available()
    plots = not args.no_plots
    if plots:
        args.out.mkdir(parents=True, exist_ok=True)
    rows, overview = [], []
    for name in tqdm(names, desc="encodings", unit="enc", file=sys.stderr):
        row, entry = run_one(name, args.sizes, args.out, plots)
        rows.append(row)
        if entry is not None:
            overview.append(entry)
    failures = [r for r in rows if r.failed]
    if overview:
        try:
            plot_overview(overview, args.out / "overview.png")
        except Exception:  # noqa: BLE001
            failures.append(Row("overview", errors=[traceback.format_exc(limit=2)]))

    print(format_table(rows))
    print(
        "properties: ok = claimed and holds, FAIL = claimed but fails, yes = holds though unclaimed, "
        "- = does not hold"
    )
    for r in rows:
        for msg in r.errors + [f"{p}: {v}" for p, v in r.report.items() if v.startswith("FAIL")]:
            print(f"  {r.name}: {msg}")
    if plots and overview:
        print(f"plots: {args.out}/attention_<name>.png, {args.out}/overview.png")
    print(f"{len(rows)} encodings in {time.perf_counter() - t0:.1f} s, {len(failures)} with failures")
    if failures:
        print("FAILED: " + ", ".join(r.name for r in failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
