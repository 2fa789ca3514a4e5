"""Resolution extrapolation: trained ViTs evaluated with the same weights, no fine-tuning, at larger test sizes.

    python eval/resolution.py --run runs/vit_rope --run runs/vit_lookhere
    python eval/resolution.py --run runs/vit_rope --ratios 1 2 4.57 --limit 500 --out outputs/resolution

The protocol of LookHere / RoPE-ViT / PaPE (the benchmark runs it as the ``vit`` protocol of
``eval/protocols.py``): a model trained at size ``T`` is tested at ``T * r`` for the LookHere ratios
``r`` = 1, 1.43, 1.71, 2, 2.29, 3.43, 4.57 (224 -> 224 ... 1024), each size rounded to a multiple of the patch size, so the field of view is fixed and only the pixel density
and the number of patch tokens grow. How a test image of side ``S`` is made (``--protocol``; ``auto`` picks
the first of each line):

* Shapes-HR (``data.dataset: shapes``): ``render`` draws every sample again at ``S`` (true detail, the
  ImageNet-HR analogue); ``resize`` upsamples the render at ``T`` (no new detail).
* 28 px sets (Fashion-MNIST, MNIST-5k, digits): ``resize``, a plain antialiased bicubic resize of the whole
  image to ``S x S`` (the training view at 1x: these images are centred objects on a blank field, and the
  0.875 centre crop would cut them at every size); ``crop`` is the PaPE pipeline below.
* Class folders (ImageNet-style): ``crop``, the PaPE / DeiT pipeline: short side to ``int(S * 256/224)``,
  centre crop ``S`` (``--crop-ratio 1`` is RoPE-ViT's ``--eval-crop-ratio 1.0``); ``resize`` resizes to
  ``S x S`` as the training script's validation does.

Reported per size: top-1, expected calibration error (15 bins), NLL, and on Shapes-HR the accuracy per
object-size quintile (LookHere). Writes ``resolution.json``, ``resolution.md`` and ``resolution.png``
(accuracy and ECE against the test/train size ratio, one line per run) to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from classification import classification_metrics, group_accuracy, predict
from report_tables import fmt, markdown_table, write_tables
from runs import load_run, pick_device

__all__ = ["PROTOCOLS", "resolve_protocol", "test_dataset", "size_bins", "evaluate_run", "write_report", "main"]

PROTOCOLS = ("auto", "render", "resize", "crop")
SCALINGS = ("linear", "ntk", "yarn")  # training-free RoPE scaling at the test size (--scaling)
_ARRAY_SETS = ("fashion_mnist", "mnist5k", "digits")
_ALLOWED = {  # dataset -> its protocols, the default first
    "shapes": ("render", "resize"),
    "folder": ("crop", "resize"),
    **{d: ("resize", "crop") for d in _ARRAY_SETS},
}


def resolve_protocol(dataset: str, protocol: str) -> str:
    """The concrete protocol for ``dataset`` (``auto`` -> its default; see the module docstring)."""
    if dataset not in _ALLOWED:
        raise ValueError(f"no resolution protocol for dataset {dataset!r}; known: {sorted(_ALLOWED)}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {list(PROTOCOLS)}, got {protocol!r}")
    allowed = _ALLOWED[dataset]
    if protocol == "auto":
        return allowed[0]
    if protocol not in allowed:
        raise ValueError(f"protocol {protocol!r} does not apply to {dataset!r}; use one of {list(allowed)} or auto")
    return protocol


class _Resized(Dataset):
    """``(image, label)`` items of ``base`` resized to ``size`` (antialiased bicubic)."""

    def __init__(self, base: Dataset, size: int) -> None:
        self.base, self.size = base, size

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        from data.transforms import resize

        x, y = self.base[i]
        return resize(x, self.size), y


def test_dataset(data, size: int, protocol: str, *, crop_ratio: float = 224 / 256) -> Dataset:
    """The test split of the run's ``data`` section at test side ``size`` under a resolved ``protocol``.

    Never the training-time validation set: that is the tail of the training split when ``data.holdout > 0``.
    The test split is ``train.vit_setup.build_datasets(data, split="test")``'s: the official test split of Fashion-MNIST /
    MNIST-5k / digits, the ``val/`` class folder, ``Shapes(split="test", num_samples=data.shapes_test)`` (read from
    the render cache when ``data.shapes_cache``); ``data.val_limit`` keeps its first images, as it always has.
    Checked against (``tests/test_vit_holdout.py``, ``tests/test_eval.py``): the test split's own images.
    """
    from data.transforms import eval_transform
    from train.vit_setup import build_datasets

    if data.dataset == "folder":
        from data.images import ImageFolder

        if data.root is None:
            raise ValueError("the run's config has data.dataset=folder but no data.root")
        root = Path(data.root)
        classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())  # the training label order
        opts: dict[str, Any] = (
            {"transform": eval_transform(size, crop_ratio=crop_ratio)} if protocol == "crop" else {"size": size}
        )
        val: Dataset = ImageFolder(root / "val", classes=classes, channels=data.channels, **opts)
        return Subset(val, range(min(data.val_limit, len(val)))) if data.val_limit is not None else val
    if protocol == "render" or (protocol == "resize" and data.dataset in _ARRAY_SETS):
        return build_datasets(data, size=size, split="test")[1]  # rendered at / resized from the source
    if protocol == "resize":  # shapes: the render at the training size, upsampled
        return _Resized(build_datasets(data, split="test")[1], size)
    # crop on an in-memory image set: the PaPE pipeline on the stored images
    val = build_datasets(data, size=None, split="test")[1]
    base = copy.copy(val.dataset if isinstance(val, Subset) else val)
    base.transform, base.size = eval_transform(size, crop_ratio=crop_ratio), None
    return Subset(base, val.indices) if isinstance(val, Subset) else base


def size_bins(dataset: Dataset) -> tuple[torch.Tensor, int] | None:
    """Object-size bin of every item (Shapes-HR only) and the number of bins, else None."""
    from data.shapes import Shapes

    indices: Sequence[int] = range(len(dataset))  # type: ignore[arg-type]
    base = dataset
    while isinstance(base, (Subset, _Resized)):
        if isinstance(base, Subset):
            indices = [base.indices[i] for i in indices]
            base = base.dataset
        else:
            base = base.base
    if not isinstance(base, Shapes):
        return None
    return torch.tensor([base.size_bin(int(i)) for i in indices], dtype=torch.long), base.size_bins


def evaluate_run(
    run_dir: str | Path,
    ratios: Sequence[float] | None = None,
    *,
    protocol: str = "auto",
    crop_ratio: float = 224 / 256,
    limit: int | None = None,
    offset: int = 0,
    scaling: str | None = None,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    workers: int = 0,
    by_size: bool = True,
    bf16: bool = False,
    progress: bool = True,
) -> dict:
    """Top-1 / ECE / NLL of one exported ViT run at every test size; a JSON-ready dict.

    ``ratios`` (default the LookHere ratios) multiply the training size; each test size is rounded to a
    multiple of the patch size. ``offset`` / ``limit`` evaluate test-split images ``offset .. offset+limit-1``
    (:func:`test_dataset`, never the training-time validation set; the benchmark gives every seed its own slice).
    ``scaling`` (``linear`` / ``ntk`` / ``yarn``) applies that training-free RoPE scaling at every test size, with
    factor = test grid / training grid per axis (:func:`vlpe.encodings.functional.scaling.resolution_scaling`);
    the model must hold a rotary encoding. The batch shrinks as ``batch_size * (T/S)^2`` so a batch holds about the
    same number of tokens at every size.
    """
    from vlpe.encodings import set_scaling
    from vlpe.encodings.functional.scaling import resolution_scaling

    from data.transforms import LOOKHERE_RATIOS, eval_resolutions
    from train.vit_setup import collate

    device = pick_device(device if device is None else str(device))
    ratios = [float(r) for r in (LOOKHERE_RATIOS if ratios is None else ratios)]
    run = load_run(run_dir, script="vit", device=device)
    cfg, model = run.cfg, run.model
    train_size, patch = cfg.data.img_size, cfg.model.patch_size
    protocol = resolve_protocol(cfg.data.dataset, protocol)
    sizes = eval_resolutions(train_size, ratios=ratios, multiple_of=patch)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of images, got {limit}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative image index, got {offset!r}")
    if scaling is not None and scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {list(SCALINGS)} or None, got {scaling!r}")
    train_grid = (train_size // patch, train_size // patch)
    done: dict[int, dict] = {}
    results = []
    for ratio, size in zip(ratios, sizes):
        if size not in done:
            ds = test_dataset(cfg.data, size, protocol, crop_ratio=crop_ratio)
            n = len(ds)  # type: ignore[arg-type]
            if offset or limit is not None:
                if offset >= n:
                    raise ValueError(f"offset {offset} is past the {n} test images of {run_dir}")
                stop = n if limit is None else min(n, offset + limit)
                ds = Subset(ds, range(offset, stop))  # type: ignore[arg-type]
            if scaling is not None:
                grid = (size // patch, size // patch)
                set_scaling(model, resolution_scaling(train_grid, grid, scaling) if grid != train_grid else None)
            bs = max(1, int(batch_size * (train_size / size) ** 2))
            loader = DataLoader(ds, batch_size=bs, collate_fn=collate, num_workers=workers)
            logits, labels = predict(model, loader, device, desc=f"{run.name} {size}px", progress=progress, bf16=bf16)
            metrics: dict[str, Any] = classification_metrics(logits, labels)
            bins = size_bins(ds) if by_size else None
            if bins is not None:
                metrics["acc_by_size_bin"] = group_accuracy(logits.argmax(-1) == labels, *bins)
            done[size] = metrics
            if scaling is not None:
                set_scaling(model, None)
        grid = size // patch
        results.append({"ratio": ratio, "size": size, "grid": [grid, grid],
                        "tokens": grid * grid + model.num_prefix, **done[size]})
    base = next((r["acc"] for r in results if r["size"] == train_size), None)
    for r in results:
        r["drop"] = None if base is None else r["acc"] - base
    return {
        "run": str(run_dir),
        "name": run.name if scaling is None else f"{run.name}+{scaling}",
        "encoding": cfg.model.encoding,
        "encoding_options": cfg.model.encoding_options,
        "dataset": cfg.data.dataset,
        "num_classes": run.num_classes,
        "train_size": train_size,
        "patch_size": patch,
        "protocol": protocol,
        "crop_ratio": crop_ratio if protocol == "crop" else None,
        "scaling": scaling,
        "offset": offset,
        "results": results,
    }


def _label(ev: dict) -> str:
    return ev["name"] if ev["encoding"] in ev["name"] else f"{ev['name']} ({ev['encoding']})"


def markdown(evals: Sequence[dict]) -> str:
    """Top-1, drop vs the training size, ECE, and (Shapes-HR) accuracy by object-size quintile."""
    ratios = [r["ratio"] for r in evals[0]["results"]]
    head = ["run", "encoding", "train px"] + [f"x{r:.3g}" for r in ratios]

    def table(key: str, digits: int = 1) -> str:
        rows = [[ev["name"], ev["encoding"], ev["train_size"]] + [fmt(r[key], digits=digits) for r in ev["results"]]
                for ev in evals]
        return markdown_table(head, rows)

    sizes = "; ".join(f"{ev['name']}: " + ", ".join(str(r["size"]) for r in ev["results"]) for ev in evals)
    out = ["# Resolution extrapolation\n\n",
           f"Same weights, no fine-tuning; test sizes (px) {sizes}. "
           f"Protocols: {', '.join(sorted({ev['name'] + '=' + ev['protocol'] for ev in evals}))}.\n",
           "\n## Top-1 accuracy (%)\n\n", table("acc"),
           "\n## Change in top-1 vs the training size (points)\n\n", table("drop"),
           "\n## Expected calibration error (%, 15 bins)\n\n", table("ece", 2)]
    binned = [ev for ev in evals if "acc_by_size_bin" in ev["results"][0]]
    if binned:
        k = len(binned[0]["results"][0]["acc_by_size_bin"])
        rows = [[f"{ev['name']} x{r['ratio']:.3g} ({r['size']} px)"] + [fmt(a) for a in r["acc_by_size_bin"]]
                for ev in binned for r in ev["results"]]
        out += [f"\n## Top-1 (%) by object-size bin (1 = smallest of {k})\n\n",
                markdown_table(["run / size"] + [f"Q{i + 1}" for i in range(k)], rows)]
    return "".join(out)


def plot(evals: Sequence[dict], path: Path) -> Path:
    """Accuracy and ECE against the test/train size ratio, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_ece) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ev in evals:
        x = [r["ratio"] for r in ev["results"]]
        ax_acc.plot(x, [100 * r["acc"] for r in ev["results"]], marker="o", label=_label(ev))
        ax_ece.plot(x, [100 * r["ece"] for r in ev["results"]], marker="o", label=_label(ev))
    for ax, name in ((ax_acc, "top-1 accuracy (%)"), (ax_ece, "ECE (%, 15 bins)")):
        ax.set_xlabel("test size / training size")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    ax_acc.set_title("Resolution extrapolation (same weights)")
    ax_acc.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(evals: Sequence[dict], out_dir: str | Path) -> dict[str, Path]:
    """``resolution.json``, ``resolution.md`` and ``resolution.png`` under ``out_dir``."""
    out = Path(out_dir)
    paths = write_tables(evals, out, "resolution", markdown)
    paths["png"] = plot(evals, out / "resolution.png")
    return paths


def main(argv: Sequence[str] | None = None) -> list[dict]:
    from data.transforms import LOOKHERE_RATIOS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--run", action="extend", nargs="+", required=True,
                   help="a train/vit.py out_dir (config.yaml + model.safetensors); repeat for several runs")
    p.add_argument("--ratios", type=float, nargs="+", default=list(LOOKHERE_RATIOS),
                   help="test size / training size (default the LookHere ratios 1 ... 4.57)")
    p.add_argument("--out", default="outputs/resolution", help="output folder")
    p.add_argument("--protocol", default="auto", choices=PROTOCOLS)
    p.add_argument("--crop-ratio", type=float, default=224 / 256, help="crop protocol: crop side / resized short side")
    p.add_argument("--limit", type=int, default=None, help="evaluate N test images (from --offset)")
    p.add_argument("--offset", type=int, default=0, help="index of the first test image evaluated")
    p.add_argument("--scaling", nargs="+", default=["none"], choices=["none", *SCALINGS],
                   help="training-free RoPE scaling at the test size; several: one evaluation each")
    p.add_argument("--batch-size", type=int, default=64, help="batch at the training size (scaled down with size)")
    p.add_argument("--device", default="auto")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (rendering Shapes-HR is CPU-bound)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    p.add_argument("--no-size-bins", action="store_true", help="skip the per-object-size accuracy (Shapes-HR)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    evals = [
        evaluate_run(run, args.ratios, protocol=args.protocol, crop_ratio=args.crop_ratio, limit=args.limit,
                     offset=args.offset, scaling=None if sc == "none" else sc, batch_size=args.batch_size,
                     device=args.device, workers=args.workers, by_size=not args.no_size_bins, bf16=args.bf16,
                     progress=not args.no_progress)
        for run in args.run
        for sc in args.scaling
    ]
    paths = write_report(evals, args.out)
    print(markdown(evals))
    print("wrote " + ", ".join(str(v) for v in paths.values()))
    return evals


if __name__ == "__main__":
    main()
