"""Circle-RoPE (``circlerope``): a hand-computed example from the paper's construction, an independent slow loop in
float64 (``math`` only), and the geometric facts the design claims (every vision token at distance ``r`` from the
text position ``(s, s, s)``, in the plane orthogonal to the text diagonal).

The released code (lose4578/CircleRoPE @ 063fb2c, ``code/circle_rope.py``, run outside this repository) gives the
same ids to fp32 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_mm_helpers import MERGE, batch, tokens

import vlpe
from vlpe.encodings import multimodal as mm

S2, S6 = math.sqrt(2), math.sqrt(6)


def test_hand_computed_two_token_image():
    """A 1 x 2 image after 4 text tokens, r = 10, alpha = 0.5: centred columns -0.5, 0.5 have polar angles pi, 0
    (normalised: 2 pi, 0) and raster shares 0, pi, so angles pi and pi / 2: circle points (-10, 0) and (0, 10), in
    the plane basis u = (-1, 1, 0) / sqrt 2, v = (-1, -1, 2) / sqrt 6 for (w, h, t)."""
    types, _, grid = batch([tokens(4, ("img", (1, 2, 4)), 2)])
    ids, deltas = mm.position_ids("circlerope", types, grid)
    want = torch.tensor([
        [4.0, 4.0 - 10 / S2, 4.0 + 10 / S2],  # (t, h, w) of (-10, 0)
        [4.0 + 20 / S6, 4.0 - 10 / S6, 4.0 - 10 / S6],  # (0, 10)
    ], dtype=torch.float64)
    assert torch.allclose(ids[:, 0, 4:6].T.double(), want, atol=1e-5)
    nxt = 4 + 20 / S6 + 1  # the unit's largest id + 1
    assert torch.allclose(ids[:, 0, 6].double(), torch.full((3,), nxt, dtype=torch.float64), atol=1e-5)
    assert abs(deltas.item() - (nxt + 2 - 8)) < 1e-5


def reference_ids(parts, radius=10.0, alpha=0.5):
    """One token at a time, in float64: text advances by one on all axes; every unit (image, or video frame) is
    placed by the construction above and text resumes at its largest id + 1."""
    out, s = [], 0.0
    u, v = (-1 / S2, 1 / S2, 0.0), (-1 / S6, -1 / S6, 2 / S6)

    def text(n):
        nonlocal s
        for _ in range(n):
            out.append((s, s, s))
            s += 1

    def unit(H, W):
        nonlocal s
        pts = [(j - (W - 1) / 2, i - (H - 1) / 2) for i in range(H) for j in range(W)]
        polar = [math.atan2(y, x) for x, y in pts]
        lo, hi = min(polar), max(polar)
        top = -math.inf
        for n, a in enumerate(polar):
            spread = (a - lo) / (hi - lo) * 2 * math.pi if hi > lo else a
            ang = alpha * spread + (1 - alpha) * n / (H * W) * 2 * math.pi
            cx, cy = radius * math.cos(ang), radius * math.sin(ang)
            w, h, t = (cx * u[a_] + cy * v[a_] for a_ in range(3))
            out.append((s + t, s + h, s + w))
            top = max(top, t, h, w)
        s += top + 1

    for p in parts:
        if isinstance(p, int):
            text(p)
        elif p[0] == "img":
            unit(p[1][1] // MERGE, p[1][2] // MERGE)
        else:  # Qwen3-VL frames: timestamp text, <vs>, the frame, <ve>
            for _ in range(p[1][0]):
                text(p[2] + 1)
                unit(p[1][1] // MERGE, p[1][2] // MERGE)
                text(1)
    return torch.tensor(out, dtype=torch.float64).T  # (3, S)


SAMPLES = [
    [4, ("img", (1, 4, 6)), 3],
    [3, ("img", (1, 8, 12)), 2, ("frames", (3, 4, 4), 2), 2],
    [1, ("frames", (2, 8, 4), 3), 1, ("img", (1, 2, 2)), 3, ("img", (1, 2, 10)), 1],
]


@pytest.mark.parametrize("radius,alpha", [(10.0, 0.5), (3.5, 0.0), (7.0, 1.0)])
def test_matches_the_loop(radius, alpha):
    samples = [tokens(*p) for p in SAMPLES]
    types, mask, grid = batch(samples)
    ids, deltas = mm.position_ids("circlerope", types, grid, attention_mask=mask, radius=radius, alpha=alpha)
    for b, parts in enumerate(SAMPLES):
        ref = reference_ids(parts, radius, alpha)
        real = mask[b].bool()
        assert (ids[:, b, real].double() - ref).abs().max() < 1e-4
        nxt = ref[0, -1].item() + 1  # every sample ends with text: the next position follows its last id
        assert abs(deltas[b].item() - (nxt - ref.shape[1])) < 1e-4


def test_every_vision_token_is_on_the_circle_orthogonal_to_the_text_diagonal():
    types, mask, grid = batch([tokens(*SAMPLES[1])])
    ids, _ = mm.position_ids("circlerope", types, grid, radius=6.0, dtype=torch.float64)
    vision = types[0] > 0
    # the running position s of each unit: the id all three axes share right before it (text), + 1
    prev = torch.nonzero(vision[1:] & ~vision[:-1]).flatten()  # last text token before each unit
    starts = ids[0, 0, prev] + 1
    for k, first in enumerate(prev + 1):
        last = first
        while last + 1 < vision.numel() and vision[last + 1]:
            last += 1
        off = ids[:, 0, first : last + 1] - starts[k]  # (3, n) offsets from (s, s, s)
        assert torch.allclose(off.sum(0), torch.zeros(off.shape[1], dtype=torch.float64), atol=1e-9)
        assert torch.allclose(off.norm(dim=0), torch.full((off.shape[1],), 6.0, dtype=torch.float64), atol=1e-9)


def test_circle_options_refused():
    types, _, grid = batch([tokens(4, ("img", (1, 2, 4)), 2)])
    with pytest.raises(ValueError, match="alpha must be a number from 0 to 1"):
        mm.position_ids("circlerope", types, grid, alpha=1.5)
    with pytest.raises(ValueError, match="radius must be a positive number"):
        mm.position_ids("circlerope", types, grid, radius=0)
    with pytest.raises(ValueError, match="does not take option"):
        mm.position_ids("circlerope", types, grid, dff_rate=0.5)


def test_circlerope_tables_and_encoding():
    """Chunked [16, 24, 24] tables of the float ids, and the registered encoding rotating with them."""
    types, mask, grid = batch([tokens(*SAMPLES[0])])
    ids, _ = mm.position_ids("circlerope", types, grid)
    cos, sin = mm.rotary("circlerope", ids, head_dim=128)
    amap = torch.tensor([0] * 16 + [1] * 24 + [2] * 24)
    k = torch.arange(64, dtype=torch.float64)
    ang = ids.double()[amap].permute(1, 2, 0) * 1e6 ** (-2 * k / 128)
    assert (cos.double() - torch.cat([ang.cos()] * 2, -1)).abs().max() < 2e-5
    enc = vlpe.encodings.build("circlerope", dim=4 * 128, num_heads=4)
    q, k_ = torch.randn(2, 1, 4, ids.shape[-1], 128)
    got = enc.rotate(q, k_, enc.prepare(vlpe.Positions(ids.permute(1, 2, 0))), 0)
    want = mm.apply_rotary_pos_emb(q, k_, cos, sin)
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
