"""The tables every evaluation script writes: table cells, GitHub markdown tables and the JSON beside them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["fmt", "markdown_table", "write_json", "write_tables"]


def fmt(value: float | None, scale: float = 100.0, digits: int = 1) -> str:
    """A table cell: ``value * scale`` with ``digits`` decimals, or an en dash for missing values."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value * scale:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table (first column left-aligned, the others right-aligned)."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |",
             "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_json(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
    return path


def write_tables(evals: Sequence[dict], out_dir: str | Path, name: str, markdown: Callable[[Sequence[dict]], str]
                 ) -> dict[str, Path]:  # fmt: skip
    """``<name>.json`` (``{"runs": evals}``) and ``<name>.md`` (``markdown(evals)``) under ``out_dir``: the part
    of every evaluation script's report that is not a figure."""
    if not evals:
        raise ValueError("write_report needs at least one evaluated run")
    out = Path(out_dir)
    paths = {"json": write_json(out / f"{name}.json", {"runs": list(evals)}), "md": out / f"{name}.md"}
    paths["md"].write_text(markdown(evals))
    return paths
