"""The property table and attention plots (eval/properties.py, step 4 of the demo job): files written,
failures reported with a non-zero exit, and the plotted maps are the position-only attention they claim to be
(checked against closed forms)."""

from __future__ import annotations

import math

import pytest
import torch
from matplotlib.image import imread

import properties as demo  # eval/properties.py (pytest's pythonpath)


def test_demo_writes_plots_and_table(tmp_path, capsys):
    rc = demo.main(["--only", "nope", "rope", "rope1d", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("attention_nope.png", "attention_rope.png", "attention_rope1d.png", "overview.png"):
        img = imread(tmp_path / name)
        assert img.ndim == 3 and min(img.shape[:2]) > 100, name
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert rows["nope"][-1] == "attention_nope.png" and rows["rope"][-1] == "attention_rope.png"
    assert all("FAIL" not in rows[n] and "ERROR" not in rows[n] for n in ("nope", "rope", "rope1d"))
    assert rows["nope"][3:10] == ["ok", "yes", "ok", "ok", "ok", "ok", "ok"]  # nope claims all but fp32
    assert "0 with failures" in out


def test_demo_reports_a_failing_encoding_and_exits_nonzero(tmp_path, capsys):
    rc = demo.main(["--only", "nope", "no_such_encoding", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "no_such_encoding: build: ValueError: unknown encoding" in out
    assert (tmp_path / "attention_nope.png").exists()  # the others still ran
    assert demo.main(["--only", "nope", "--no-plots", "--out", str(tmp_path / "none")]) == 0
    assert not (tmp_path / "none").exists()


def test_nope_map_is_uniform():
    probs, shape, centre = demo.attention_map(demo.build_for_demo("nope"), 6)
    assert shape == (6, 6) and centre == 3 * 6 + 3 and probs.shape == (4, 6, 6)
    torch.testing.assert_close(probs, torch.full_like(probs, 1 / 36))


def test_rope_map_matches_the_closed_form():
    """q = k = c at every token: logit(delta) = Dh^-1/2 * sum_m |c_m|^2 cos(theta_m . delta), with pair m =
    channels (m, m + Dh/2), the first Dh/4 pairs reading rows and the rest columns, theta = 100 ** (-k / (Dh/4))."""
    enc = demo.build_for_demo("rope")
    size, H, Dh = 8, enc.num_heads, enc.head_dim
    probs, shape, centre = demo.attention_map(enc, size)
    c = demo.content_vector(enc.dim, H).reshape(H, Dh).double()
    assert torch.allclose(c.norm(dim=-1), torch.full((H,), math.sqrt(Dh), dtype=torch.float64))
    P = Dh // 4
    for h in range(H):
        weights = [c[h, m] ** 2 + c[h, m + Dh // 2] ** 2 for m in range(Dh // 2)]
        logits = torch.empty(size, size, dtype=torch.float64)
        for r in range(size):
            for col in range(size):
                dr, dc = r - size // 2, col - size // 2
                logits[r, col] = sum(
                    weights[m] * math.cos((dr if m < P else dc) * 100.0 ** (-(m % P) / P)) for m in range(Dh // 2)
                ) / math.sqrt(Dh)
        expected = logits.flatten().softmax(0).reshape(size, size)
        torch.testing.assert_close(probs[h].double(), expected, atol=1e-6, rtol=1e-5)
        assert probs[h].argmax().item() == centre


def test_one_axis_maps_peak_at_the_query_and_positions_per_axis_count():
    probs, shape, centre = demo.attention_map(demo.build_for_demo("rope1d"), 4)
    assert shape == (16,) and centre == 8 and probs.shape[1:] == (16,)
    assert (probs.argmax(-1) == centre).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[0]))
    pos, shape, centre = demo.demo_positions(3, 4)
    assert pos.prefix == 1 and pos.grid == (1, 4, 4) and shape == (4, 4) and centre == 10
    assert pos.coords[0, 1 + centre].tolist() == [0.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="1, 2 or 3"):
        demo.demo_positions(4, 4)


def test_the_demo_table_of_every_registered_encoding_has_no_failure(tmp_path, capsys):
    """The demo builds each encoding as the property kit does, at the size its example declares: every registered
    encoding's row holds (the table the demo stops on)."""
    rc = demo.main(["--no-plots", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and " 0 with failures" in out, out[-2000:]
