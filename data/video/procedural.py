"""Procedural video: moving sprites over a drifting texture, any length and resolution, frame ``t`` a pure
function of ``(seed, t)``."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .decode import Clip

__all__ = ["ProceduralVideo", "procedural_video"]


_SHAPES = ("disc", "square", "triangle", "ring", "cross")


def _shape_mask(kind: str, s: int) -> np.ndarray:
    c = (np.arange(s) + 0.5) / s * 2 - 1  # pixel centres in [-1, 1]
    y, x = np.meshgrid(c, c, indexing="ij")
    r = np.hypot(y, x)
    if kind == "disc":
        return r <= 1.0
    if kind == "square":
        return np.ones((s, s), dtype=bool)
    if kind == "triangle":
        return (y >= -1.0) & (np.abs(x) <= (y + 1) / 2)
    if kind == "ring":
        return (r <= 1.0) & (r >= 0.5)
    return (np.abs(x) <= 0.3) | (np.abs(y) <= 0.3)  # cross


def _bounce(p0: np.ndarray, v: np.ndarray, t: np.ndarray, span: int) -> np.ndarray:
    """Positions of points moving at speed v and reflecting off [0, span]: a triangle wave in closed form."""
    if span <= 0:
        return np.zeros((t.size, p0.size))
    m = np.mod(p0[None] + v[None] * t[:, None], 2 * span)  # (T, n)
    return np.where(m <= span, m, 2 * span - m)


class ProceduralVideo:
    """Sprites (discs, squares, triangles, rings, crosses) bouncing over a slowly drifting random texture.

    Any length (``frames(indices)`` takes arbitrary frame numbers) and any resolution. Frame ``t`` is a
    pure function of ``(seed, t)``, so a longer video extends a shorter one of the same seed. The texture
    is a tile of twice the frame size (smooth colour blobs plus grain) that wraps around as it drifts.
    """

    def __init__(
        self,
        *,
        height: int = 32,
        width: int = 32,
        seed: int = 0,
        num_sprites: int = 3,
        sprite_size: int | None = None,
        fps: float = 25.0,
        speed: float = 1.0,
    ):
        if height < 1 or width < 1:
            raise ValueError(f"height and width must be positive, got {height}x{width}")
        if num_sprites < 0:
            raise ValueError(f"num_sprites must be >= 0, got {num_sprites}")
        if not fps > 0:
            raise ValueError(f"fps must be positive, got {fps}")
        self.height, self.width, self.fps = int(height), int(width), float(fps)
        rng = np.random.default_rng(seed)
        th, tw = 2 * self.height, 2 * self.width
        coarse = rng.uniform(30, 200, size=(6, 6, 3))  # periodic bilinear upsampling of a 6x6 colour grid
        gy, gx = np.arange(th) * 6 / th, np.arange(tw) * 6 / tw
        y0, x0 = gy.astype(int), gx.astype(int)
        wy, wx = (gy - y0)[:, None, None], (gx - x0)[None, :, None]
        y1, x1 = (y0 + 1) % 6, (x0 + 1) % 6
        smooth = (
            coarse[y0][:, x0] * (1 - wy) * (1 - wx)
            + coarse[y0][:, x1] * (1 - wy) * wx
            + coarse[y1][:, x0] * wy * (1 - wx)
            + coarse[y1][:, x1] * wy * wx
        )
        self.texture = np.clip(smooth + rng.normal(0, 10, size=(th, tw, 3)), 0, 255).astype(np.uint8)
        self.drift = rng.uniform(-0.4, 0.4, size=2) * speed  # pixels per frame (y, x)
        s = int(sprite_size) if sprite_size is not None else max(3, min(self.height, self.width) // 4)
        self.sprite_size = s = min(s, self.height, self.width)
        kinds = rng.integers(0, len(_SHAPES), size=num_sprites)
        self.masks = [_shape_mask(_SHAPES[k], s) for k in kinds]
        self.colors = rng.integers(0, 256, size=(num_sprites, 3)).astype(np.uint8)
        self.p0 = rng.uniform(0, 1, size=(num_sprites, 2)) * [self.height - s, self.width - s]
        angle = rng.uniform(0, 2 * np.pi, size=num_sprites)
        mag = rng.uniform(0.3, 1.5, size=num_sprites) * speed * max(1.0, min(self.height, self.width) / 32)
        self.velocity = np.stack([np.sin(angle), np.cos(angle)], axis=1) * mag[:, None]

    def frames(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """(T, H, W, 3) uint8 frames for the given frame numbers (any non-negative integers)."""
        t = np.asarray(indices, dtype=np.int64).reshape(-1)
        if t.size and t.min() < 0:
            raise ValueError("frame numbers must be non-negative")
        H, W = self.height, self.width
        th, tw = self.texture.shape[:2]
        off = np.round(self.drift[None] * t[:, None]).astype(np.int64)  # (T, 2)
        rows = (off[:, 0:1] + np.arange(H)[None]) % th  # (T, H)
        cols = (off[:, 1:2] + np.arange(W)[None]) % tw  # (T, W)
        out = self.texture[rows[:, :, None], cols[:, None, :]]  # (T, H, W, 3)
        s = self.sprite_size
        tf = t.astype(np.float64)
        py = np.round(_bounce(self.p0[:, 0], self.velocity[:, 0], tf, H - s)).astype(np.int64)  # (T, n)
        px = np.round(_bounce(self.p0[:, 1], self.velocity[:, 1], tf, W - s)).astype(np.int64)
        dy, dx = np.nonzero(np.ones((s, s), dtype=bool))
        frame_ids = np.arange(t.size)[:, None]
        for k, mask in enumerate(self.masks):
            m = mask[dy, dx]
            yy = py[:, k : k + 1] + dy[m][None]  # (T, P)
            xx = px[:, k : k + 1] + dx[m][None]
            out[frame_ids, yy, xx] = self.colors[k]
        return out

    def clip(self, num_frames: int, *, start: int = 0) -> Clip:
        """``num_frames`` consecutive frames from ``start`` as a Clip, timestamps ``index / fps``."""
        if num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {num_frames}")
        idx = np.arange(start, start + num_frames, dtype=np.int64)
        return Clip(self.frames(idx), idx / self.fps, idx, self.fps, start + num_frames, "procedural", "procedural")


def procedural_video(num_frames: int, height: int = 32, width: int = 32, *, seed: int = 0, **options: Any) -> Clip:
    """Shorthand for ``ProceduralVideo(height=, width=, seed=, **options).clip(num_frames)``."""
    return ProceduralVideo(height=height, width=width, seed=seed, **options).clip(num_frames)
