"""Images of any size to patch tokens and their (row, col) positions."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from ..positions import Positions
from ._common import Fit, PrefixTokens, check_finite_samples, check_fit, patches_along, to_pair

__all__ = ["ImageTokenizer"]


class ImageTokenizer(nn.Module):
    """Convolutional patch embedding (ViT) for any ``H x W``, returning tokens and their :class:`~vlpe.Positions`.

    Input: a tensor ``(B, C, H, W)`` (one size for the whole batch) or a list of ``(C, H_i, W_i)`` tensors
    (NaFlex-style batches of different sizes). Output: tokens ``(B, P + N, dim)`` and positions with
    coordinates ``(row, col)`` in patch units, where ``P = num_prefix``.

    * Same-size batches: ``N = h * w`` tokens in row-major order; ``Positions.grid(h, w, prefix=P)``
      (``pos.grid == (h, w)``, batch dimension 1, broadcast over the samples).
    * Lists of different sizes: sample ``i`` gives its ``h_i * w_i`` tokens in row-major order, packed at
      the front and zero-padded to the longest sample; ``pos.valid`` (B, P + N_max) marks the real tokens,
      padding sits at coordinate 0 and ``pos.grid`` is None (no common grid). A list whose images all have
      the same size is stacked and tokenized as a tensor batch (and so gets a grid).
    * Prefix tokens: ``num_prefix`` learned tokens (CLS first, then registers) are prepended and described
      by ``pos.prefix``. With ``num_prefix=0`` (default) the model adds its own prefix, e.g. with
      :func:`vlpe.tokenizers.prepend_prefix`, which keeps tokens and positions in step.
    * Values: NaN or infinite pixels raise ``ValueError`` naming the sample (one reduction and one
      device-to-host read per call; ``check_finite=False`` skips it where the data is known to be clean).
    * Sizes: an image smaller than one patch along either side raises ``ValueError``. A side that is not a
      multiple of the patch raises (``fit='raise'``, default), drops the bottom/right remainder
      (``fit='crop'``, what a strided convolution does silently) or zero-pads the bottom/right edge up
      to the next multiple (``fit='pad'``, timm's ``dynamic_img_pad``).
    """

    def __init__(
        self,
        *,
        dim: int,
        patch_size: int | Sequence[int] = 16,
        in_chans: int = 3,
        num_prefix: int = 0,
        fit: Fit = "raise",
        bias: bool = True,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        if dim < 1 or in_chans < 1:
            raise ValueError(f"dim and in_chans must be >= 1, got dim={dim}, in_chans={in_chans}")
        self.patch_size = to_pair(patch_size, "patch_size")
        self.in_chans = in_chans
        self.dim = dim
        self.fit = check_fit(fit)
        self.check_finite = bool(check_finite)
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias)
        self.prefix = PrefixTokens(num=num_prefix, dim=dim)

    @property
    def num_prefix(self) -> int:
        return self.prefix.num

    def grid_size(self, height: int, width: int) -> tuple[int, int]:
        """Patch grid ``(h, w)`` of an ``height x width`` image under this tokenizer's ``fit`` rule."""
        ph, pw = self.patch_size
        who = type(self).__name__
        return (
            patches_along(height, ph, self.fit, axis="height", who=who),
            patches_along(width, pw, self.fit, axis="width", who=who),
        )

    def no_weight_decay(self) -> set[str]:
        return {"prefix.tokens"} if self.num_prefix else set()

    # ------------------------------------------------------------------ forward
    def forward(self, images: Tensor | Sequence[Tensor]) -> tuple[Tensor, Positions]:
        if isinstance(images, Tensor):
            if images.dim() != 4:
                raise ValueError(
                    f"{type(self).__name__} expects images (B, C, H, W) or a list of (C, H, W) tensors, "
                    f"got a tensor of shape {tuple(images.shape)}"
                )
            tokens, pos = self._same_size(images)
        elif isinstance(images, (list, tuple)):
            tokens, pos = self._mixed_sizes(list(images))
        else:
            raise ValueError(
                f"{type(self).__name__} expects a tensor or a list of tensors, got {type(images).__name__}"
            )
        return self.prefix(tokens, pos)

    def _check_finite(self, images: Sequence[Tensor]) -> None:
        if self.check_finite:
            check_finite_samples(images, type(self).__name__, "image")

    def _check_channels(self, c: int) -> None:
        if c != self.in_chans:
            raise ValueError(
                f"{type(self).__name__} was built for in_chans={self.in_chans}, got images with {c} channels"
            )

    def _embed(self, x: Tensor, h: int, w: int) -> Tensor:
        """Fit ``x`` (B, C, H, W) to ``h x w`` whole patches and embed: (B, h * w, dim)."""
        ph, pw = self.patch_size
        H, W = x.shape[-2:]
        if (H, W) != (h * ph, w * pw):
            if self.fit == "crop":
                x = x[..., : h * ph, : w * pw]
            else:  # pad bottom / right with zeros
                x = F.pad(x, (0, w * pw - W, 0, h * ph - H))
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, h * w, dim)

    def _same_size(self, x: Tensor) -> tuple[Tensor, Positions]:
        self._check_channels(x.shape[1])
        self._check_finite([x])
        h, w = self.grid_size(x.shape[-2], x.shape[-1])
        tokens = self._embed(x, h, w)  # (B, h * w, dim)
        return tokens, Positions.grid(h, w, device=x.device)

    def _mixed_sizes(self, images: list[Tensor]) -> tuple[Tensor, Positions]:
        if not images:
            raise ValueError(f"{type(self).__name__} got an empty list of images")
        for i, img in enumerate(images):
            if not isinstance(img, Tensor) or img.dim() != 3:
                shape = tuple(img.shape) if isinstance(img, Tensor) else type(img).__name__
                raise ValueError(f"{type(self).__name__}: list entry {i} must be a (C, H, W) tensor, got {shape}")
            self._check_channels(img.shape[0])
        if all(img.shape == images[0].shape for img in images):
            return self._same_size(torch.stack(images))
        self._check_finite([img.unsqueeze(0) for img in images])
        sizes = [self.grid_size(img.shape[-2], img.shape[-1]) for img in images]
        # one convolution per distinct input size (batches usually hold few sizes)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, img in enumerate(images):
            groups.setdefault(tuple(img.shape), []).append(i)
        per_sample: list[Tensor | None] = [None] * len(images)
        for members in groups.values():
            h, w = sizes[members[0]]
            out = self._embed(torch.stack([images[i] for i in members]), h, w)  # (g, h * w, dim)
            for i, t in zip(members, out.unbind(0)):
                per_sample[i] = t
        tokens = pad_sequence(per_sample, batch_first=True)  # (B, N_max, dim)
        device = tokens.device
        coords = pad_sequence(
            [Positions.grid(h, w, device=device).coords[0] for h, w in sizes], batch_first=True
        )  # (B, N_max, 2)
        lengths = torch.tensor([h * w for h, w in sizes], device=device)  # (B,)
        valid = torch.arange(tokens.shape[1], device=device) < lengths[:, None]  # (B, N_max)
        return tokens, Positions(coords, valid=valid, axes=("h", "w"))
