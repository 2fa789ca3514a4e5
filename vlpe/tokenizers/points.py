"""Point clouds to group tokens: farthest point sampling, kNN grouping and a small PointNet."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from ..encodings.base import fp32
from ..positions import Positions
from ._common import PrefixTokens

__all__ = ["PointTokenizer", "farthest_point_sample", "knn_indices", "gather_points", "invariant_local_features"]

Start = Literal["far", "first", "random"]
Local = Literal["offsets", "invariant"]
LOCALS = ("offsets", "invariant")
INVARIANT_FEATURES = 4  # channels of invariant_local_features


def gather_points(x: Tensor, idx: Tensor) -> Tensor:
    """``x`` (B, P, F) at indices ``idx`` (B, ...) -> (B, ..., F)."""
    B = x.shape[0]
    flat = idx.reshape(B, -1)  # (B, M)
    out = x.gather(1, flat.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, M, F)
    return out.reshape(*idx.shape, x.shape[-1])


def _zero_padding(xyz: Tensor, valid: Tensor | None) -> Tensor:
    """``xyz`` with padding points (``valid`` False) at the origin: whatever they hold (NaN included) never
    reaches a distance, a mean or a max of the real points."""
    return xyz if valid is None else xyz.masked_fill(~valid.unsqueeze(-1), 0.0)


def start_index(xyz: Tensor, valid: Tensor | None = None, *, start: Start = "far") -> Tensor:
    """First FPS centre per cloud, (B,) long.

    ``'far'``: the real point farthest from the cloud's mean (independent of point order, so FPS is
    permutation invariant up to exact distance ties); ``'first'``: the first real point; ``'random'``: a
    uniformly random real point (augmentation).
    """
    B, P, _ = xyz.shape
    real = torch.ones(B, P, dtype=torch.bool, device=xyz.device) if valid is None else valid
    xyz = _zero_padding(xyz, valid)
    if start == "first":
        return real.to(torch.int8).argmax(dim=1)  # first True
    if start == "random":
        score = torch.rand(B, P, device=xyz.device)
    elif start == "far":
        pts = fp32(xyz)
        w = real.to(pts.dtype).unsqueeze(-1)  # (B, P, 1)
        mean = (pts * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1)  # (B, 1, 3)
        score = ((pts - mean) ** 2).sum(-1)  # (B, P)
    else:
        raise ValueError(f"start must be 'far', 'first' or 'random', got {start!r}")
    return score.masked_fill(~real, -1.0).argmax(dim=1)


@torch.no_grad()
def farthest_point_sample(
    xyz: Tensor, num_samples: int, *, valid: Tensor | None = None, start: Tensor | None = None
) -> Tensor:
    """Farthest point sampling: indices (B, G) of ``num_samples`` centres per cloud.

    Centre ``i + 1`` is the real point whose squared distance to the nearest of centres ``0..i`` is largest
    (first index on ties); centre 0 is ``start`` (B,) (default: the first real point). Vectorised over the
    batch: one iteration of tensor ops per centre. Padding points (``valid`` False) are never chosen while
    real points remain; a cloud with fewer than ``num_samples`` real points repeats real points after
    using them all. Distances are fp32 (fp64 kept).
    """
    if xyz.dim() != 3:
        raise ValueError(f"xyz must be (B, P, D), got {tuple(xyz.shape)}")
    B, P, _ = xyz.shape
    if not 1 <= num_samples <= P:
        raise ValueError(f"num_samples must be in [1, P={P}] (the number of points), got {num_samples}")
    pts = fp32(_zero_padding(xyz, valid))
    if valid is None:
        dist = torch.full((B, P), float("inf"), dtype=pts.dtype, device=pts.device)
    else:
        dist = torch.full((B, P), float("inf"), dtype=pts.dtype, device=pts.device).masked_fill(~valid, -1.0)
    if start is None:
        start = start_index(xyz, valid, start="first")
    batch = torch.arange(B, device=pts.device)
    idx = torch.empty(B, num_samples, dtype=torch.long, device=pts.device)
    far = start.to(device=pts.device, dtype=torch.long)  # (B,)
    for i in range(num_samples):
        idx[:, i] = far
        if i == num_samples - 1:
            break
        centre = pts[batch, far]  # (B, D)
        dist = torch.minimum(dist, ((pts - centre[:, None]) ** 2).sum(-1))  # (B, P); padding stays -1
        far = dist.argmax(dim=1)
    return idx


def invariant_local_features(nbrs: Tensor, centres: Tensor, *, eps: float = 1e-12) -> Tensor:
    """Rotation- and translation-invariant description (B, G, k, 4) of each neighbour of each group, fp32.

    ``nbrs`` (B, G, k, A) are a group's neighbours p_j (the centre itself among them), ``centres`` (B, G, A)
    its centre c; m is the mean of the k neighbours. Per neighbour: ``[|p_j - c|, |p_j - m|, |m - c|,
    cos angle(p_j - c, m - c)]``. The local reference (the sampled centre and the neighbourhood's mean) is the
    one of RIConv (Zhang et al., "Rotation Invariant Convolutions for 3D Point Clouds Deep Learning", 3DV
    2019), whose features are distances and angles of the same triangle (p_j, c, m); its three sides
    determine it, and the cosine is kept as an explicit angle feature. Every entry is a norm or a normalised
    dot product of differences of points, so it is unchanged by any rotation or reflection (any A) and any
    translation of the cloud. The cosine is 0 where either vector has zero length (the centre as its own
    neighbour, or a group whose mean is its centre): the division is by ``max(|p_j - c| |m - c|, eps)``,
    which keeps ``|cos| <= 1`` and never gives NaN (gradients included: a zero vector's norm has gradient 0).
    Checked in ``tests/test_points_invariant_features.py`` against hand-computed numbers and, through a
    whole model, against logits of rotated and translated clouds.
    """
    p = fp32(nbrs)  # (B, G, k, A)
    c = fp32(centres).unsqueeze(2)  # (B, G, 1, A)
    m = p.mean(dim=2, keepdim=True)  # (B, G, 1, A)
    to_p, from_m, to_m = p - c, p - m, m - c  # (B, G, k, A), (B, G, k, A), (B, G, 1, A)
    d_pc = torch.linalg.vector_norm(to_p, dim=-1)  # (B, G, k)
    d_pm = torch.linalg.vector_norm(from_m, dim=-1)  # (B, G, k)
    d_mc = torch.linalg.vector_norm(to_m, dim=-1)  # (B, G, 1)
    cos = (to_p * to_m).sum(-1) / (d_pc * d_mc).clamp_min(eps)  # (B, G, k); 0 when either vector is 0
    return torch.stack([d_pc, d_pm, d_mc.expand_as(d_pc), cos], dim=-1)  # (B, G, k, 4)


@torch.no_grad()
def knn_indices(xyz: Tensor, centres: Tensor, k: int, *, valid: Tensor | None = None) -> Tensor:
    """Indices (B, G, k) of the ``k`` real points of ``xyz`` (B, P, D) nearest to each of ``centres`` (B, G, D).

    Nearest first. Exact distances (no ``|a|^2 + |b|^2 - 2ab`` cancellation), fp32. Padding points are
    ranked after every real point.
    """
    P = xyz.shape[1]
    if not 1 <= k <= P:
        raise ValueError(f"group size k must be in [1, P={P}] (the number of points), got {k}")
    d = torch.cdist(fp32(centres), fp32(xyz), compute_mode="donot_use_mm_for_euclid_dist")  # (B, G, P)
    if valid is not None:
        d = d.masked_fill(~valid[:, None, :], float("inf"))
    return d.topk(k, dim=-1, largest=False, sorted=True).indices  # (B, G, k)


class PointTokenizer(nn.Module):
    """Point-cloud group tokens (Point-BERT / Point-MAE): FPS centres, kNN groups, a mini-PointNet per group.

    Input: ``xyz`` (B, P, 3) (any coordinate count ``num_axes``), optional per-point ``features``
    (B, P, in_features) (colour, normals) and ``valid`` (B, P) bool for padded clouds. Padding points may
    hold anything (NaN included): they are moved to the origin before sampling. Real points must be finite
    and every cloud needs at least one: both are checked in one small reduction per call (one device-to-host
    read; the encodings downstream read nothing back). Output: tokens
    (B, num_prefix + G, dim) and ``Positions.points`` of the G group centres (B, num_prefix + G, 3) in the
    input's units, ``num_prefix`` learned prefix tokens first (coordinate 0). With ``valid`` given,
    ``pos.valid`` marks group ``j`` of cloud ``b`` real iff ``j`` < its number of real points (groups beyond
    that repeat centres); without it ``pos.valid`` is None.

    Each group is the ``group_size`` nearest real points of its centre, centred on it; the embedding is a
    shared MLP per point, max-pooled, the pooled feature concatenated back to every point, a second MLP and
    a max pool (two-stage mini-PointNet, LayerNorm instead of BatchNorm so padding cannot leak through batch
    statistics). The output depends on the set of points, not their order, when ``start='far'`` (default);
    ``start='random'`` draws the first centre at random in training (augmentation) and uses ``'far'`` in
    eval. Positions carry no gradient (centres are detached); tokens do, through the centred neighbourhoods.

    ``local`` chooses what the first MLP sees of each neighbour: ``'offsets'`` (default) its raw centred
    coordinates p_j - c (``num_axes`` numbers, as Point-BERT / Point-MAE; they turn with the cloud, so no
    model on them is rotation invariant), ``'invariant'`` the 4 rotation- and translation-invariant numbers of
    :func:`invariant_local_features` (distances to the centre and to the neighbourhood mean, the mean's
    distance to the centre and one cosine: RIConv's local reference, Zhang et al., 3DV 2019). FPS from the
    ``'far'`` start and kNN are rotation equivariant, so with ``'invariant'`` the tokens are unchanged by a
    rotation or translation of the cloud (up to exact distance ties) and the positions turn with it: a model
    is then rotation invariant if its position encoding is (``nope``, ``pape_ri``, ``alibi``).
    """

    def __init__(
        self,
        *,
        dim: int,
        num_groups: int = 64,
        group_size: int = 32,
        in_features: int = 0,
        num_axes: int = 3,
        hidden: int = 128,
        num_prefix: int = 0,
        start: Start = "far",
        local: Local = "offsets",
    ) -> None:
        super().__init__()
        if min(dim, num_groups, group_size, num_axes, hidden) < 1 or in_features < 0:
            raise ValueError(
                f"dim, num_groups, group_size, num_axes, hidden must be >= 1 and in_features >= 0, got "
                f"{dim}, {num_groups}, {group_size}, {num_axes}, {hidden}, {in_features}"
            )
        if start not in ("far", "first", "random"):
            raise ValueError(f"start must be 'far', 'first' or 'random', got {start!r}")
        if local not in LOCALS:
            raise ValueError(f"local must be one of {list(LOCALS)} (the per-neighbour input), got {local!r}")
        self.dim, self.num_groups, self.group_size = dim, num_groups, group_size
        self.in_features, self.num_axes, self.start, self.local = in_features, num_axes, start, local
        geometry = num_axes if local == "offsets" else INVARIANT_FEATURES
        self.first = nn.Sequential(
            nn.Linear(geometry + in_features, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, hidden)
        )
        self.second = nn.Sequential(
            nn.Linear(2 * hidden, 2 * hidden), nn.LayerNorm(2 * hidden), nn.GELU(), nn.Linear(2 * hidden, dim)
        )
        self.prefix = PrefixTokens(num=num_prefix, dim=dim)

    @property
    def num_prefix(self) -> int:
        return self.prefix.num

    def no_weight_decay(self) -> set[str]:
        return {"prefix.tokens"} if self.num_prefix else set()

    def group(self, xyz: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Centre indices (B, G) and neighbour indices (B, G, k) into the P points (nearest first)."""
        mode = "far" if self.start == "random" and not self.training else self.start  # random starts only train
        start = start_index(xyz, valid, start=mode)
        centre_idx = farthest_point_sample(xyz, self.num_groups, valid=valid, start=start)  # (B, G)
        centres = gather_points(xyz, centre_idx)  # (B, G, A)
        nbr_idx = knn_indices(xyz, centres, self.group_size, valid=valid)  # (B, G, k)
        if valid is not None:  # padding neighbours (clouds with < k real points) -> the nearest, a real point
            real = gather_points(valid.unsqueeze(-1), nbr_idx).squeeze(-1)  # (B, G, k)
            nbr_idx = torch.where(real, nbr_idx, nbr_idx[..., :1])
        return centre_idx, nbr_idx

    def forward(
        self, xyz: Tensor, features: Tensor | None = None, *, valid: Tensor | None = None
    ) -> tuple[Tensor, Positions]:
        who = type(self).__name__
        if not isinstance(xyz, Tensor) or xyz.dim() != 3 or xyz.shape[-1] != self.num_axes:
            shape = tuple(xyz.shape) if isinstance(xyz, Tensor) else type(xyz).__name__
            raise ValueError(f"{who} expects xyz (B, P, {self.num_axes}), got {shape}")
        B, P, _ = xyz.shape
        if P < max(self.num_groups, self.group_size):
            raise ValueError(
                f"{who} needs at least num_groups={self.num_groups} and group_size={self.group_size} points "
                f"per cloud, got P={P}; pad the cloud (with valid=) or build with fewer/smaller groups"
            )
        if (features is None) != (self.in_features == 0) or (
            features is not None and tuple(features.shape) != (B, P, self.in_features)
        ):
            got = None if features is None else tuple(features.shape)
            raise ValueError(f"{who} was built for in_features={self.in_features}: features must be "
                             f"{'None' if not self.in_features else (B, P, self.in_features)}, got {got}")
        if valid is not None:
            valid = torch.as_tensor(valid, dtype=torch.bool, device=xyz.device)
            if tuple(valid.shape) != (B, P):
                raise ValueError(f"{who}: valid must be (B, P) = ({B}, {P}), got {tuple(valid.shape)}")
            xyz = _zero_padding(xyz, valid)
            if features is not None:
                features = _zero_padding(features, valid)
        self._check_values(xyz, features, valid)
        centre_idx, nbr_idx = self.group(xyz, valid)
        centres = gather_points(xyz, centre_idx)  # (B, G, A)
        if self.local == "offsets":
            local = gather_points(xyz, nbr_idx) - centres.unsqueeze(2)  # (B, G, k, A)
        else:
            local = invariant_local_features(gather_points(xyz, nbr_idx), centres)  # (B, G, k, 4), fp32
        if features is not None:
            feats = gather_points(features, nbr_idx)  # (B, G, k, F)
            if self.local != "offsets":
                feats = feats.to(local.dtype)
            local = torch.cat([local, feats], dim=-1)  # (B, G, k, A + F) or (B, G, k, 4 + F)
        f = self.first(local.to(self.first[0].weight.dtype))  # (B, G, k, h)
        pooled = f.amax(dim=2, keepdim=True)  # (B, G, 1, h)
        f = self.second(torch.cat([pooled.expand_as(f), f], dim=-1))  # (B, G, k, dim)
        tokens = f.amax(dim=2)  # (B, G, dim)
        group_valid = None
        if valid is not None:
            count = valid.sum(1, keepdim=True)  # (B, 1)
            group_valid = torch.arange(self.num_groups, device=xyz.device) < count  # (B, G)
        pos = Positions.points(centres.detach(), valid=group_valid, validate=False)  # _check_values did it
        return self.prefix(tokens, pos)

    @staticmethod
    def _check_values(xyz: Tensor, features: Tensor | None, valid: Tensor | None) -> None:
        """``ValueError`` for a NaN/inf real point (or feature) or a cloud without real points: one read."""
        finite = torch.isfinite(xyz).all(-1)  # (B, P)
        if features is not None:
            finite &= torch.isfinite(features).all(-1)
        real = torch.ones_like(finite) if valid is None else valid
        bad_point = (real & ~finite).any(1)  # (B,)
        empty = ~real.any(1)  # (B,)
        flags = torch.stack([bad_point, empty])  # (2, B)
        if not bool(flags.any()):
            return
        bad_point, empty = flags.cpu().tolist()
        if any(empty):
            raise ValueError(
                f"PointTokenizer: cloud {empty.index(True)} has no real points (valid is all False); drop "
                f"empty clouds from the batch"
            )
        raise ValueError(
            f"PointTokenizer: cloud {bad_point.index(True)} has NaN or infinite real points (or features); "
            f"fix the data or mark those points valid=False"
        )

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, group_size={self.group_size}, start={self.start!r}, "
            f"local={self.local!r}"
        )
