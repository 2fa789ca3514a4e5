"""Videos to tubelet tokens and their (t, row, col) positions, optionally in real time."""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..positions import Positions
from ._common import Fit, PrefixTokens, check_finite_samples, check_fit, patches_along, to_pair

__all__ = ["VideoTokenizer"]


class VideoTokenizer(nn.Module):
    """Tubelet embedding (ViViT / VideoMAE): a ``Conv3d`` over ``t x p x p`` blocks of a video.

    Input: ``video`` ``(B, C, T, H, W)`` (channels first, the ``Conv3d`` layout) and optional
    ``timestamps`` ``(B, T)`` or ``(T,)``: the time of every input frame in seconds. Output: tokens
    ``(B, P + t' * h * w, dim)`` in (time, row, col) row-major order and ``Positions.video(t', h, w)``
    (``pos.grid == (t', h, w)``, axes ``("t", "h", "w")``), ``P = num_prefix`` learned prefix tokens first
    (as in :class:`ImageTokenizer`).

    Time coordinate of a tubelet:
        * without timestamps: its index ``0, 1, ...`` (tubelet units);
        * with timestamps: the ``time_reduce`` of its frames' timestamps, ``'mean'`` (default; for evenly
          spaced frames this is Qwen3-VL's ``(first + last) / 2``) or ``'first'`` (Qwen2.5-VL's start of
          the temporal patch), times ``time_scale`` (tokens per second) when given, else in seconds.
          E.g. ``time_scale=2`` gives Qwen2.5-VL's 0.5 s per time unit (unrounded).
        Rows and columns are always patch indices.

    Sizes follow ``fit`` along every axis (see :class:`ImageTokenizer`): an input smaller than one
    tubelet raises; ``'crop'`` drops trailing frames / bottom-right pixels; ``'pad'`` repeats the last
    frame (and its timestamp) up to a whole tubelet, as Qwen-VL processors do, and zero-pads space.
    NaN or infinite pixels or timestamps raise ``ValueError`` naming the sample (one device-to-host read per
    call for both; ``check_finite=False`` skips it, and then NaN timestamps reach the positions unchecked).
    """

    def __init__(
        self,
        *,
        dim: int,
        patch_size: int | Sequence[int] = 16,
        tubelet_size: int = 2,
        in_chans: int = 3,
        num_prefix: int = 0,
        fit: Fit = "raise",
        time_scale: float | None = None,
        time_reduce: Literal["mean", "first"] = "mean",
        bias: bool = True,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        if dim < 1 or in_chans < 1 or tubelet_size < 1:
            raise ValueError(
                f"dim, in_chans and tubelet_size must be >= 1, got {dim}, {in_chans}, {tubelet_size}"
            )
        if time_reduce not in ("mean", "first"):
            raise ValueError(f"time_reduce must be 'mean' or 'first', got {time_reduce!r}")
        if time_scale is not None and not time_scale > 0:
            raise ValueError(f"time_scale (tokens per second) must be > 0 or None, got {time_scale}")
        self.patch_size = to_pair(patch_size, "patch_size")
        self.tubelet_size = int(tubelet_size)
        self.in_chans = in_chans
        self.dim = dim
        self.fit = check_fit(fit)
        self.time_scale = time_scale
        self.time_reduce = time_reduce
        self.check_finite = bool(check_finite)
        kernel = (self.tubelet_size, *self.patch_size)
        self.proj = nn.Conv3d(in_chans, dim, kernel_size=kernel, stride=kernel, bias=bias)
        self.prefix = PrefixTokens(num=num_prefix, dim=dim)

    @property
    def num_prefix(self) -> int:
        return self.prefix.num

    def no_weight_decay(self) -> set[str]:
        return {"prefix.tokens"} if self.num_prefix else set()

    def grid_size(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Tubelet grid ``(t, h, w)`` of a ``frames x height x width`` video under this tokenizer's ``fit``."""
        who = type(self).__name__
        ph, pw = self.patch_size
        return (
            patches_along(frames, self.tubelet_size, self.fit, axis="frames", who=who),
            patches_along(height, ph, self.fit, axis="height", who=who),
            patches_along(width, pw, self.fit, axis="width", who=who),
        )

    def forward(self, video: Tensor, timestamps: Tensor | None = None) -> tuple[Tensor, Positions]:
        if not isinstance(video, Tensor) or video.dim() != 5:
            shape = tuple(video.shape) if isinstance(video, Tensor) else type(video).__name__
            raise ValueError(f"{type(self).__name__} expects a video (B, C, T, H, W), got {shape}")
        B, C, T, H, W = video.shape
        if C != self.in_chans:
            raise ValueError(
                f"{type(self).__name__} was built for in_chans={self.in_chans}, got {C} channels "
                f"(the layout is (B, C, T, H, W))"
            )
        t, h, w = self.grid_size(T, H, W)
        times = None if timestamps is None else self._tubelet_times(timestamps, B, T, t)
        if self.check_finite:
            self._check_values(video, timestamps)
        tt, (ph, pw) = self.tubelet_size, self.patch_size
        x = video
        if T > t * tt:  # crop trailing frames
            x = x[:, :, : t * tt]
        elif T < t * tt:  # pad by repeating the last frame
            x = torch.cat([x, x[:, :, -1:].expand(-1, -1, t * tt - T, -1, -1)], dim=2)
        if self.fit == "crop":
            x = x[..., : h * ph, : w * pw]
        elif (H, W) != (h * ph, w * pw):
            x = F.pad(x, (0, w * pw - W, 0, h * ph - H))
        tokens = self.proj(x).flatten(2).transpose(1, 2)  # (B, t * h * w, dim)
        pos = Positions.video(t, h, w, timestamps=times, device=video.device, validate=False)  # checked above
        return self.prefix(tokens, pos)

    def _check_values(self, video: Tensor, timestamps: Tensor | None) -> None:
        """``ValueError`` naming the first sample with a NaN/inf pixel or timestamp: one device-to-host read for
        both (the timestamps' check rides on the video's, as :func:`check_finite_samples` does for pixels)."""
        if timestamps is None:
            check_finite_samples([video], type(self).__name__, "video")
            return
        ts = torch.as_tensor(timestamps, device=video.device)
        ts = ts.unsqueeze(0) if ts.dim() == 1 else ts  # (B | 1, T), shape checked by _tubelet_times
        bad = torch.stack([
            ~torch.isfinite(video).flatten(1).all(1),  # (B,)
            (~torch.isfinite(ts).all(1)).expand(video.shape[0]),  # (B,)
        ])  # (2, B)
        if not bool(bad.any()):
            return
        bad_video, bad_time = bad.cpu().tolist()
        if any(bad_video):
            check_finite_samples([video], type(self).__name__, "video")
        raise ValueError(
            f"{type(self).__name__}: timestamps of sample {bad_time.index(True)} hold NaN or infinite values; every "
            f"frame needs a finite time in seconds (or build with check_finite=False)"
        )

    def _tubelet_times(self, timestamps: Tensor, B: int, T: int, t: int) -> Tensor:
        """Per-frame ``timestamps`` (B | 1, T) in seconds -> per-tubelet time coordinates (B | 1, t)."""
        ts = torch.as_tensor(timestamps)
        if ts.dtype == torch.bool or ts.is_complex():
            raise ValueError(
                f"{type(self).__name__}: timestamps must be real numbers (one time in seconds per frame), got "
                f"dtype {ts.dtype}"
            )
        if not ts.is_floating_point():
            ts = ts.float()
        if ts.dim() == 1:
            ts = ts.unsqueeze(0)
        if ts.dim() != 2 or ts.shape[1] != T or ts.shape[0] not in (1, B):
            raise ValueError(
                f"{type(self).__name__}: timestamps must be (B, T) = ({B}, {T}) or ({T},), one time in seconds "
                f"per input frame, got {tuple(ts.shape)}"
            )
        tt = self.tubelet_size
        if T > t * tt:
            ts = ts[:, : t * tt]
        elif T < t * tt:
            ts = torch.cat([ts, ts[:, -1:].expand(-1, t * tt - T)], dim=1)  # repeated frames keep their time
        ts = ts.reshape(ts.shape[0], t, tt)  # (B, t, tt)
        times = ts.mean(-1) if self.time_reduce == "mean" else ts[..., 0]  # (B, t)
        return times if self.time_scale is None else times * self.time_scale

    def extra_repr(self) -> str:
        return f"time_scale={self.time_scale}, time_reduce={self.time_reduce!r}, fit={self.fit!r}"
