"""The point-cloud test protocols: rotations (z-aligned train / SO(3) test, ...) and larger point counts."""

from __future__ import annotations

from typing import Sequence

from .._util import check_choice, check_positive_int
from .dataset import PointCloudDataset

__all__ = ["ROTATION_PROTOCOLS", "rotation_protocol", "point_count_protocol"]


ROTATION_PROTOCOLS = {"z/z": ("z", "z"), "z/so3": ("z", "so3"), "so3/so3": ("so3", "so3")}


def rotation_protocol(
    train: PointCloudDataset, test: PointCloudDataset, protocol: str = "z/so3"
) -> tuple[PointCloudDataset, PointCloudDataset]:
    """The (train, test) pair of a rotation protocol: "z/z", "z/so3" (z-aligned train, SO(3) test), "so3/so3"."""
    check_choice("protocol", protocol, tuple(ROTATION_PROTOCOLS))
    r_train, r_test = ROTATION_PROTOCOLS[protocol]
    return train.variant(rotation=r_train), test.variant(rotation=r_test)


def point_count_protocol(
    test: PointCloudDataset, *, train_points: int | None = None, factors: Sequence[int] = (1, 2, 4, 8)
) -> dict[int, PointCloudDataset]:
    """Test sets at ``factor * train_points`` points (default 1x, 2x, 4x, 8x), keyed by the point count."""
    base = check_positive_int("train_points", test.num_points if train_points is None else train_points)
    out = {}
    for f in factors:
        f = check_positive_int("factor", f)
        out[base * f] = test.variant(num_points=base * f)
    return out
