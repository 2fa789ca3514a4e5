"""iRPE's faster forms (lattice bucket/bias tables, per-head chunk bias), registered for
:class:`vlpe.encodings.irpe.IRPE`; each equals :meth:`IRPE.score` (the written form; the per-head form runs
its per-head builder), checked in tests/test_fast_forms_registry.py and tests/test_fast_attention.py."""

from __future__ import annotations

from torch import Tensor

from ..encodings.base import Context, LatticeBias
from ..encodings.irpe import IRPE
from .registry import fast_form

__all__ = ["irpe_lattice", "irpe_heads"]


def _has_lattice(enc: IRPE) -> bool:
    """Bias mode, or the contextual key term alone of one part (the query term reads the keys)."""
    return enc.mode == "bias" or (enc.rpe_on == "k" and enc.parts == 1)


@fast_form(IRPE, "lattice", when=_has_lattice)
def irpe_lattice(enc: IRPE, ctx: Context, layer: int) -> LatticeBias | None:
    """The offset table of the grid (buckets depend on grid offsets only, so any grid qualifies): bias mode
    as float tables (the learned scalar of each offset's bucket, both sides and parts summed as in ``score``);
    the contextual key term as the bucket table with ``values`` = ``q @ table_k`` (one part: not ``cross``)."""
    enc.check_layer(layer)
    if not _has_lattice(enc):
        return None
    pos = ctx.pos
    h, w = pos.grid
    T = enc.offset_buckets(h, w, pos.device)  # (P, 2h-1, 2w-1) query-minus-key
    keys_side = T.flip(-2, -1)  # I(i, j) at key-minus-query offsets
    planes = (None,) * enc.num_heads
    if enc.mode == "contextual":
        table_k, scale = enc.table_k[layer], enc.head_dim**-0.5  # (H', Dh, K)

        def values(q: Tensor, head: int) -> Tensor:  # (B, m, Dh) -> (B, m, K), as score's q @ table
            return (q * scale) @ table_k[head if table_k.shape[0] > 1 else 0].to(q.dtype)

        return LatticeBias(keys_side, planes, values=values, prefix_bucket=enc.grid_buckets)
    table, prefix = None, None
    for side, buckets in (("k", keys_side), ("q", T)):  # I(j, i) of the query side: the reversed offset
        if side not in enc.rpe_on:
            continue
        r = getattr(enc, f"table_{side}")[layer]  # (H', P*K)
        for part in range(enc.parts):
            off = part * enc.num_buckets
            term, pre = r[:, buckets[part] + off], r[:, enc.grid_buckets + off]  # (H', 2h-1, 2w-1), (H',)
            table = term if table is None else table + term
            prefix = pre if prefix is None else prefix + pre
    return LatticeBias(table, planes, prefix_bias=prefix)


@fast_form(IRPE, "heads")
def irpe_heads(enc: IRPE, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice):
    """The int64 bucket indices and the ``q @ table`` products once per chunk, then one gather per head (the
    builder ``score`` runs for all heads at once); a shared bias table gives one bias for every head. iRPE's
    bias has one bucket for every prefix pair (its own rule, not a zero bias)."""
    return enc._bias_of_heads(q, k, ctx, layer, rows)
