"""Reference formulations that the benchmarks time against the library's forms (not part of the library).

:class:`PaPENaive`: PaPE as the reference's naive widening (``3M + 2`` extra q/k channels), the form
:class:`vlpe.encodings.pape.PaPE` folds into ``1 + P(P+1)/2 + P``; ``benchmarks/encoding_cost.py`` runs it as
``pape_naive`` beside ``pape``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vlpe.encodings.base import Context
from vlpe.encodings.pape import PaPE, _pad_width

__all__ = ["PaPENaive"]


class PaPENaive(PaPE):
    """PaPE in the reference's naive widened form (DTU-PAS/parabolic-position-encoding ``pape_naive.py``):
    per head ``q~_i = [q_i, -sum_m a_im u_im^2, a_i, 2 a_i u_i, sum_m b_im u_im, b_i]`` against
    ``k~_j = [k_j, 1, -u_j^2, u_j, 1, -u_j]`` with ``u = W_h p`` (M values), i.e. ``3M + 2`` extra channels
    (152 at M = 50) where :class:`PaPE` appends ``1 + P(P+1)/2 + P``.

    Same parameters, same logits (``tests/test_pape.py`` checks the two against each other); not registered. It
    exists so ``benchmarks/encoding_cost.py`` can time the folded form against the formulation it replaces.
    """

    @property
    def extra_width(self) -> int:
        return 3 * self.num_parabolas + 2

    def widen(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        self._check_layer(layer)
        x = self._tokens(q)  # (B, N, C)
        B, N, _ = x.shape
        H, M = self.num_heads, self.num_parabolas
        with torch.autocast(q.device.type, enabled=False):
            x = x.to(self.coeff_a.dtype)
            a = F.softplus(x @ self.coeff_a[layer]).view(B, N, H, M).transpose(1, 2)  # (B, H, N, M)
            b = (x @ self.coeff_b[layer]).view(B, N, H, M).transpose(1, 2)  # (B, H, N, M)
            u = torch.einsum("bna,hma->bhnm", ctx["coords"], self.position[layer])  # (B', H, N, M)
            u = u.expand(B, -1, -1, -1)
            one = torch.ones_like(u[..., :1])
            qf = torch.cat([-(a * u * u).sum(-1, keepdim=True), a, 2 * a * u, (b * u).sum(-1, keepdim=True), b], -1)
            kf = torch.cat([one, -u * u, u, one, -u], dim=-1)  # (B, H, N, 3M + 2)
            if ctx["keep"] is not None:
                qf, kf = qf * ctx["keep"], kf * ctx["keep"]
        pad = _pad_width(q.shape[-1], qf.shape[-1])
        qf, kf = F.pad(qf.to(q.dtype), (0, pad)), F.pad(kf.to(k.dtype), (0, pad))
        return torch.cat([q, qf], dim=-1), torch.cat([k, kf], dim=-1)  # (B, H, N, Dh + 3M + 2 + pad)
