"""Point-cloud extrapolation: a trained point transformer under test rotations and larger point counts.

    python eval/points.py --run runs/points_rope --run runs/points_pape_ri
    python eval/points.py --run runs/points_rope --rotations z so3 --factors 2 4 8 --grouping tokens

The protocols of the benchmark (the ``points`` protocol of ``eval/protocols.py``), on the run's own validation
set (same shapes, same seeds):

* rotations (``--rotations``, default ``z so3``): the validation set at the training point count with
  z-aligned rotations (the training augmentation of the default configs) and with uniform SO(3) rotations
  (ModelNet40 z/SO3; the test of rotation-invariant encodings such as PaPE-RI);
* point counts (``--factors``, default 2 4 8): the validation set with the training rotation at 2x, 4x, 8x
  the training point count (``data.points.point_count_protocol``). ``--grouping`` says what the tokenizer
  does with the extra points: ``tokens`` (default) takes ``factor x num_groups`` FPS groups of the trained
  ``group_size``, so the encoder sees ``factor`` times as many tokens, densely placed (the point-cloud
  analogue of testing a ViT at a higher resolution); ``fixed`` keeps the trained groups (same tokens, each
  group a smaller patch of the denser cloud); ``extent`` keeps the number of groups and takes
  ``factor x group_size`` neighbours, so tokens and patch extents match training and only the sampling
  density changes.

Reported per condition: top-1 (overall accuracy), class-mean accuracy (as ModelNet40), ECE (15 bins) and
NLL. Writes ``points.json`` and ``points.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.utils.data import DataLoader, Subset

from classification import classification_metrics, predict
from report_tables import fmt, markdown_table, write_tables
from runs import load_run, pick_device

__all__ = ["GROUPINGS", "evaluate_points_run", "markdown", "write_report", "main"]

GROUPINGS = ("tokens", "fixed", "extent")
ROTATIONS = ("none", "z", "so3")


def _tokenizer_for(trained: tuple[int, int], factor: int, grouping: str) -> tuple[int, int]:
    """(num_groups, group_size) at ``factor`` times the training point count, from the trained pair."""
    G, k = trained
    if grouping == "tokens":
        return G * factor, k
    if grouping == "extent":
        return G, k * factor
    return G, k


def evaluate_points_run(
    run_dir: str | Path,
    *,
    rotations: Sequence[str] = ("z", "so3"),
    factors: Sequence[int] = (2, 4, 8),
    grouping: str = "tokens",
    samples_per_class: int | None = None,
    data_seed: int | None = None,
    limit: int | None = None,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    bf16: bool = False,
    progress: bool = True,
) -> dict:
    """Metrics of one exported point-transformer run under each test rotation and point count (a dict)."""
    from data.points import point_count_protocol
    from train.points_setup import build_datasets, collate

    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {list(GROUPINGS)}, got {grouping!r}")
    for r in rotations:
        if r not in ROTATIONS:
            raise ValueError(f"rotations must be among {list(ROTATIONS)}, got {r!r}")
    factors = [int(f) for f in factors]
    if any(f < 1 for f in factors):
        raise ValueError(f"factors must be positive integers (multiples of the training point count), got {factors}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of samples, got {limit}")
    device = pick_device(device if device is None else str(device))
    run = load_run(run_dir, script="points", device=device)
    cfg, model = run.cfg, run.model
    tok = model.tokenizer
    trained = (tok.num_groups, tok.group_size)
    train_rot, train_points = cfg.data.rotation, cfg.data.num_points
    _, base = build_datasets(cfg.data, val_only=True)  # the training-time validation set
    if samples_per_class is not None or data_seed is not None:  # another draw of the validation stream
        changes: dict[str, int] = {}
        if samples_per_class is not None:
            if isinstance(samples_per_class, bool) or not isinstance(samples_per_class, int) or samples_per_class < 1:
                raise ValueError(f"samples_per_class must be a positive integer, got {samples_per_class!r}")
            changes["samples_per_class"] = samples_per_class
        if data_seed is not None:
            if isinstance(data_seed, bool) or not isinstance(data_seed, int) or data_seed < 0:
                raise ValueError(f"data_seed must be a non-negative integer, got {data_seed!r}")
            changes["seed"] = data_seed
        base = base.variant(**changes)

    conditions: list[tuple[str, str, int, int]] = [("rotation", r, train_points, 1) for r in rotations]
    by_count = point_count_protocol(base, train_points=train_points, factors=factors)
    conditions += [("points", train_rot, n, n // train_points) for n in by_count]
    done: dict[tuple[str, int], dict] = {}
    results = []
    try:
        for kind, rot, n, factor in conditions:
            groups, group_size = _tokenizer_for(trained, factor, grouping)
            key = (rot, n)
            if key not in done:
                ds = (by_count[n] if n != train_points else base).variant(rotation=rot)
                if limit is not None:
                    ds = Subset(ds, range(min(limit, len(ds))))
                tok.num_groups, tok.group_size = groups, group_size
                loader = DataLoader(ds, batch_size=batch_size, collate_fn=collate)
                desc = f"{run.name} {rot} {n} pts"
                logits, labels = predict(model, loader, device, desc=desc, progress=progress, bf16=bf16)
                done[key] = classification_metrics(logits, labels)
            results.append({"condition": kind, "rotation": rot, "points": n, "factor": factor,
                            "groups": groups, "group_size": group_size, **done[key]})
    finally:
        tok.num_groups, tok.group_size = trained
    return {
        "run": str(run_dir),
        "name": run.name,
        "encoding": cfg.model.encoding,
        "encoding_options": cfg.model.encoding_options,
        "dataset": cfg.data.dataset,
        "num_classes": run.num_classes,
        "train_rotation": train_rot,
        "train_points": train_points,
        "num_groups": trained[0],
        "group_size": trained[1],
        "grouping": grouping,
        "data_seed": base.seed,
        "samples_per_class": base.samples_per_class,
        "results": results,
    }


def markdown(evals: Sequence[dict]) -> str:
    """One table per protocol: rows are runs, cells top-1 % (class-mean %)."""
    out = ["# Point-cloud extrapolation\n\n",
           "Cells: top-1 % (class-mean %) / ECE %. Same weights, no fine-tuning.\n"]
    for kind, title in (("rotation", "Test rotation (training point count)"),
                        ("points", "Point count (training rotation)")):
        cols = [r for r in evals[0]["results"] if r["condition"] == kind]
        if not cols:
            continue
        if kind == "rotation":
            head = [f"{r['rotation']}" for r in cols]
        else:
            head = [f"{r['points']} pts (x{r['factor']}, {r['groups']}x{r['group_size']})" for r in cols]
        rows = []
        for ev in evals:
            cells: list[Any] = [ev["name"], ev["encoding"], ev["train_rotation"]]
            for r in (r for r in ev["results"] if r["condition"] == kind):
                cells.append(f"{fmt(r['acc'])} ({fmt(r['class_mean_acc'])}) / {fmt(r['ece'])}")
            rows.append(cells)
        out += [f"\n## {title}\n\n", markdown_table(["run", "encoding", "train rotation"] + head, rows)]
    groupings = sorted({ev["grouping"] for ev in evals})
    out.append(f"\nGrouping at larger point counts: {', '.join(groupings)} (see eval/points.py).\n")
    return "".join(out)


def write_report(evals: Sequence[dict], out_dir: str | Path) -> dict[str, Path]:
    """``points.json`` and ``points.md`` under ``out_dir``."""
    out = Path(out_dir)
    paths = write_tables(evals, out, "points", markdown)
    return paths


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--run", action="extend", nargs="+", required=True,
                   help="a train/points.py out_dir (config.yaml + model.safetensors); repeat for several runs")
    p.add_argument("--rotations", nargs="+", default=["z", "so3"], choices=ROTATIONS)
    p.add_argument("--factors", type=int, nargs="+", default=[2, 4, 8], help="multiples of the training point count")
    p.add_argument("--grouping", default="tokens", choices=GROUPINGS)
    p.add_argument("--out", default="outputs/points", help="output folder")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N validation samples")
    p.add_argument("--samples-per-class", type=int, default=None,
                   help="test samples per class (default: the run's validation set)")
    p.add_argument("--data-seed", type=int, default=None,
                   help="seed of the test draw (default the run's validation seed; the benchmark gives each seed its own)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    evals = [
        evaluate_points_run(run, rotations=args.rotations, factors=args.factors, grouping=args.grouping,
                            samples_per_class=args.samples_per_class, data_seed=args.data_seed, limit=args.limit, batch_size=args.batch_size, device=args.device, bf16=args.bf16,
                            progress=not args.no_progress)
        for run in args.run
    ]
    paths = write_report(evals, args.out)
    print(markdown(evals))
    print("wrote " + ", ".join(str(v) for v in paths.values()))
    return evals


if __name__ == "__main__":
    main()
