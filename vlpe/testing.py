"""Property kit: behavioural checks any encoding can be run through, a user's own included.

Each encoding declares the properties it claims (``Encoding.claims``); :func:`check` runs one claim (on the
encoding as built and, every claim but ``zero_init``, again with randomised parameters),
:func:`property_report` runs all of them plus the error-behaviour checks every encoding must pass (and
:func:`check_scaling` for every encoding that takes training-free RoPE scaling). The
test suite runs every claim of every registered encoding, so a new encoding is tested the moment it is
registered::

    from vlpe.testing import property_report
    print(property_report(vlpe.encodings.build("rope", dim=64, num_heads=4)))

The checks only use the public hooks and :func:`vlpe.attention_logits`; none of them knows how a
particular encoding is implemented.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch
from torch import Tensor

from .attention import attend, attention_logits
from .encodings import build, get
from .encodings.base import Encoding
from .positions import Positions

__all__ = [
    "CHECKS",
    "AS_BUILT",
    "example",
    "examples",
    "PropertyFailure",
    "check",
    "check_scaling",
    "takes_scaling",
    "property_report",
    "probe",
    "effects",
    "random_qk",
    "randomize_parameters",
    "sample_positions",
    "grid_positions",
    "max_difference",
]


class PropertyFailure(AssertionError):
    """A claimed property does not hold; the message says by how much."""


def max_difference(a: Tensor, b: Tensor) -> float:
    """Largest ``|a - b|`` of two effects, masked logits included.

    An entry masked in both (the same infinity, e.g. ``-inf`` logits of an attention mask) is equal; an entry
    masked in one and not the other (or masked with opposite signs) is an infinite difference; a NaN anywhere
    gives NaN. Plain subtraction would turn two equal masks into ``-inf - (-inf) = NaN``.

    Args:
        a, b: tensors of one shape.

    Returns:
        The largest difference (0.0 for empty tensors), ``inf`` where the masks differ.
    """
    if not a.numel():
        return 0.0
    a, b = a.double(), b.double()
    both_masked = torch.isinf(a) & (a == b)
    return (a - b).abs().masked_fill(both_masked, 0.0).max().item()


def _largest_finite(t: Tensor) -> float:
    """The largest finite ``|t|`` (masked ``-inf`` logits left out), 0.0 if there is none."""
    finite = t.double().abs()
    finite = finite[torch.isfinite(finite)]
    return finite.max().item() if finite.numel() else 0.0


def _close(a: Tensor, b: Tensor, atol: float, what: str) -> None:
    err = max_difference(a, b)
    if not math.isfinite(err) or err > atol:
        why = " (an entry masked in one and not in the other)" if err == math.inf else ""
        raise PropertyFailure(f"{what}: max abs difference {err:.3g} > {atol:.1g}{why}")


def example(name: str, *, dim: int | None = None, num_heads: int | None = None, depth: int = 2,
            **overrides) -> Encoding:
    """The encoding ``name`` in its declared example configuration (``Encoding.example``), at a small size:
    what the property kit, the demo and the benchmarks run. ``overrides`` replace example options.

    The size is ``dim=64, num_heads=4`` unless the example declares its own ``dim`` / ``num_heads`` (an encoding
    that rotates a fraction of the head needs a wider head for its rotation to show); given ones win."""
    cls = get(name)
    opts = {**cls.example, **overrides}
    size = {"dim": opts.pop("dim", 64), "num_heads": opts.pop("num_heads", 4)}
    size["dim"] = size["dim"] if dim is None else dim
    size["num_heads"] = size["num_heads"] if num_heads is None else num_heads
    if "num_axes" not in opts and cls.supported_axes:
        opts["num_axes"] = cls.supported_axes[0]
    return build(name, depth=depth, **size, **opts)


def examples(name: str, **kwargs) -> list[tuple[str, Encoding]]:
    """``(label, encoding)`` for every example configuration of ``name`` (``Encoding.examples()``: one, or one per
    wrapped encoding for a wrapper such as RPE-2D)."""
    configs = get(name).examples()
    out = []
    for opts in configs:
        label = name if len(configs) == 1 else name + "[" + ",".join(f"{k}={v}" for k, v in opts.items()) + "]"
        out.append((label, example(name, **{**opts, **kwargs})))
    return out


def _acts_on_tokens(enc: Encoding, pos: Positions) -> tuple[bool, bool]:
    """``(embed, mix)``: whether the encoding's plan at ``pos`` has these token pieces."""
    plan = enc.prepare(pos).plan
    return plan.embed, "mix" in plan.pieces


def _prefix_for(enc: Encoding) -> int:
    return 0 if enc.num_axes == 1 else 1


def grid_positions(enc: Encoding, shape: tuple[int, ...] | None = None, *, prefix: int | None = None) -> Positions:
    """A regular grid matching the encoding's axis count: 1D sequence, 2D image, 3D video grid."""
    prefix = _prefix_for(enc) if prefix is None else prefix
    if shape is None:
        shape = {1: (12,), 2: (5, 6), 3: (3, 4, 4)}.get(enc.num_axes, (3,) * enc.num_axes)
    return Positions.grid_nd(shape, prefix=prefix)


def sample_positions(enc: Encoding, n: int = 24, *, seed: int = 0, scale: float = 4.0) -> Positions:
    """Continuous random coordinates (no grid, no prefix)."""
    g = torch.Generator().manual_seed(seed)
    return Positions(torch.randn(1, n, enc.num_axes, generator=g, dtype=torch.float64).float() * scale)


def randomize_parameters(enc: Encoding, *, seed: int = 0, scale: float = 0.3) -> Encoding:
    """Every floating parameter of ``enc`` drawn from ``N(0, scale^2)`` in place (and ``enc`` returned), so that
    zero-initialised tables and per-layer terms become visible to a check; deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in enc.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)
    return enc


def random_qk(enc: Encoding, n: int, *, batch: int = 1, seed: int = 0, dtype=torch.float32) -> tuple[Tensor, Tensor]:
    """Random ``q, k`` of shape (B, H, N, Dh)."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, enc.num_heads, n, enc.head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def probe(enc: Encoding, pos: Positions, *, seed: int = 0, layers: int | None = None) -> Tensor:
    """Every hook of ``enc`` in a tiny fixed-weight residual attention stack; returns tokens (B, N, C).

    Used to compare whole effects (embed + rotate + widen + score + values + mix) between encodings.
    """
    g = torch.Generator().manual_seed(seed)
    C, H = enc.dim, enc.num_heads
    layers = min(enc.depth, 2) if layers is None else layers
    x = torch.randn(pos.batch, pos.num_tokens, C, generator=g)
    w = torch.randn(layers, 3, C, C, generator=g) / math.sqrt(C)
    ctx = enc.prepare(pos)
    plan = ctx.plan
    x = enc.embed(x, ctx) if plan.embed else x
    for layer in range(layers):
        q, k, v = (
            (x @ w[layer, i]).reshape(x.shape[0], x.shape[1], H, -1).transpose(1, 2) for i in range(3)
        )  # (B, H, N, Dh)
        out = attend(q, k, v, enc=enc, ctx=ctx, layer=layer, backend="eager")
        x = x + out.transpose(1, 2).reshape(x.shape)
        x = enc.mix(x, ctx, layer) if plan[layer].mix else x
    return x


# --------------------------------------------------------------------------- effects
def effects(enc: Encoding, pos: Positions, q: Tensor, k: Tensor, x: Tensor) -> dict[str, Tensor]:
    """Everything an encoding does at ``pos``, as tensors: the logits (rotate/widen/score) and, for
    encodings acting on tokens, what ``embed`` adds and what every ``mix`` returns (all rows: prefix first).

    The property checks compare these, so ``embed``/``mix`` encodings are held to their claims too.
    """
    out = {"logits": attention_logits(enc, q, k, pos)}
    ctx = enc.prepare(pos)
    plan = ctx.plan
    if plan.embed:  # the difference at fp32 or better: bf16 tokens cancel to their rounding
        wide = torch.promote_types(x.dtype, torch.float32)
        out["embed"] = enc.embed(x, ctx).to(wide) - x.to(wide)
    for layer in range(enc.depth):
        if plan[layer].mix:
            out[f"mix{layer}"] = enc.mix(x, ctx, layer)
    return out


def _tokens(enc: Encoding, n: int, *, seed: int = 0, batch: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(batch, n, enc.dim, generator=g)


def _rows(name: str, t: Tensor, idx: Tensor) -> Tensor:
    """Restrict an effect to the token subset ``idx`` (queries and keys for logits)."""
    if name == "logits":
        return t[:, :, idx][:, :, :, idx]
    return t[:, idx]


# --------------------------------------------------------------------------- checks
def check_relative(enc: Encoding, *, atol: float = 1e-4) -> None:
    """Patch-patch effects are unchanged when every non-prefix token moves by the same offset.

    (Prefix tokens sit at no position, so their logits with moved patches may change.)
    """
    pos = grid_positions(enc)
    p = pos.prefix
    q, k = random_qk(enc, pos.num_tokens)
    x = _tokens(enc, pos.num_tokens)
    idx = torch.arange(p, pos.num_tokens)
    base = effects(enc, pos, q, k, x)
    for offset in ([3.0] * enc.num_axes, [(-1.0) ** a * (a + 2.5) for a in range(enc.num_axes)]):
        moved = effects(enc, pos.shifted(offset), q, k, x)
        for name, t in base.items():
            _close(_rows(name, moved[name], idx), _rows(name, t, idx), atol, f"relative: {name} changed under the shift {offset}")


def check_extrapolation(enc: Encoding, *, atol: float = 1e-4) -> None:
    """Effects on a small grid equal the matching sub-block of a larger grid (same q/k/tokens per position)."""
    A = enc.num_axes
    small_shape = {1: (6,), 2: (3, 4), 3: (2, 3, 3)}.get(A, (2,) * A)
    big_shape = tuple(s + 2 + a for a, s in enumerate(small_shape))
    big = grid_positions(enc, big_shape)
    small = grid_positions(enc, small_shape)
    q, k = random_qk(enc, big.num_tokens)
    x = _tokens(enc, big.num_tokens)
    # indices of the small grid's tokens inside the big one (prefix first)
    inside = torch.ones(big.num_tokens - big.prefix, dtype=torch.bool)
    for a, s in enumerate(small_shape):
        inside &= big.patch_coords[0, :, a] < s
    idx = torch.cat([torch.arange(big.prefix), big.prefix + inside.nonzero().squeeze(1)])
    big_fx = effects(enc, big, q, k, x)
    small_fx = effects(enc, small, q[:, :, idx], k[:, :, idx], x[:, idx])
    for name, t in small_fx.items():
        _close(t, _rows(name, big_fx[name], idx), atol, f"extrapolation: {name} on grid {small_shape} differs from its block in {big_shape}")
def check_neutral(enc: Encoding, *, atol: float = 1e-5) -> None:
    """After ``neutralize()``, the whole effect (probe output) equals ``nope`` exactly."""
    neutral = copy.deepcopy(enc).eval()
    with torch.no_grad():
        neutral.neutralize()
    _compare_with_nope(neutral, atol, "neutral")


def check_zero_init(enc: Encoding, *, atol: float = 1e-5) -> None:
    """A freshly built encoding has exactly the effect of ``nope``."""
    _compare_with_nope(enc, atol, "zero_init")


def _compare_with_nope(enc: Encoding, atol: float, what: str) -> None:
    nope = build("nope", dim=enc.dim, num_heads=enc.num_heads, depth=enc.depth, num_axes=enc.num_axes)
    for pos in (grid_positions(enc),) + ((sample_positions(enc),) if not enc.needs_grid else ()):
        with torch.no_grad():
            _close(probe(enc.eval(), pos), probe(nope, pos), atol, f"{what}: output differs from nope at {pos}")


def _random_rotation(A: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(A, A, generator=g, dtype=torch.float64)
    qm, r = torch.linalg.qr(m)
    qm = qm * torch.sign(torch.diagonal(r))
    if torch.linalg.det(qm) < 0:
        qm[:, 0] = -qm[:, 0]
    return qm


def check_rotation_invariant(enc: Encoding, *, atol: float = 1e-4) -> None:
    """Effects are unchanged when continuous coordinates rotate by a random rotation about the origin."""
    pos = sample_positions(enc)
    q, k = random_qk(enc, pos.num_tokens)
    x = _tokens(enc, pos.num_tokens)
    base = effects(enc, pos, q, k, x)
    for seed in (1, 2):
        rot = _random_rotation(enc.num_axes, seed)
        turned = pos.with_coords((pos.coords.double() @ rot.T).float(), keep_grid=False)
        for name, t in effects(enc, turned, q, k, x).items():
            _close(t, base[name], atol, f"rotation_invariant: {name} changed (seed {seed})")


def check_fp32_angles(enc: Encoding, *, rel_tol: float = 5e-2) -> None:
    """Under bf16 autocast, and for a copy cast with ``.to(torch.bfloat16)`` (bf16 inputs), effects at
    large coordinates stay close to fp32.

    Angles or distances computed in bf16 at coordinates ~500 (or from frequencies rounded to bf16 by the
    cast) are off by radians; bf16 matmuls alone stay within a few percent.
    """
    pos = grid_positions(enc).shifted([500.0] * enc.num_axes)
    q, k = random_qk(enc, pos.num_tokens)
    x = _tokens(enc, pos.num_tokens)
    ref = effects(enc, pos, q, k, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = effects(enc, pos, q, k, x)
    # the cast copy gets bf16 inputs; small tokens, so what embed adds is not lost in the bf16 rounding of x
    small = x * 1e-2
    cast = copy.deepcopy(enc).to(torch.bfloat16)
    bf16 = effects(cast, pos, q.bfloat16(), k.bfloat16(), small.bfloat16())
    ref_small = effects(enc, pos, q, k, small) if any(_acts_on_tokens(enc, pos)) else ref
    for how, out, base in (("bf16-autocast", low, ref), ("a .to(torch.bfloat16) copy's", bf16, ref_small)):
        for name, t in base.items():
            err = max_difference(out[name], t) / max(_largest_finite(t), 1e-6)
            if not math.isfinite(err) or err > rel_tol:
                raise PropertyFailure(f"fp32_angles: {how} {name} off by {err:.3g} (relative) > {rel_tol}")


def check_errors(enc: Encoding) -> None:
    """Mismatched positions raise ``ValueError`` (always checked, not a claim)."""
    pos = grid_positions(enc)
    q, k = random_qk(enc, pos.num_tokens + 1)
    _expect_value_error(lambda: attention_logits(enc, q, k, pos), "a token count that does not match positions")
    wrong_axes = Positions(torch.zeros(1, pos.num_tokens, enc.num_axes + 1))
    q, k = random_qk(enc, pos.num_tokens)
    _expect_value_error(lambda: enc.prepare(wrong_axes), f"positions with {enc.num_axes + 1} axes")


def takes_scaling(enc: Encoding) -> bool:
    """True when ``enc`` takes training-free RoPE scaling in its current configuration (``set_scaling``)."""
    return callable(getattr(enc, "set_scaling", None)) and bool(getattr(enc, "accepts_scaling", True))


def check_scaling(enc: Encoding, *, atol: float = 1e-4) -> None:
    """Training-free scaling (``set_scaling``), checked for any encoding that takes it:

    ``linear`` with factors ``s`` (scalar, and one per axis) at coordinates ``s * p`` equals no scaling at ``p``;
    ``yarn`` and ``ntk`` with factor 1 equal no scaling; a factor 2 changes the logits; ``set_scaling(None)``
    restores them; parameters and ``state_dict`` keys never change; bad configs raise ValueError.
    """
    enc = copy.deepcopy(enc).eval()
    enc.set_scaling(None)
    A = enc.num_axes
    pos = grid_positions(enc)
    q, k = random_qk(enc, pos.num_tokens)
    base = attention_logits(enc, q, k, pos)
    state = {n: t.detach().clone() for n, t in enc.state_dict().items()}
    per_axis = [1.5 + 0.5 * a for a in range(A)]
    for factor in (2.0, per_axis):
        enc.set_scaling({"type": "linear", "factor": factor})
        s = torch.as_tensor(factor, dtype=torch.float64).expand(A)
        far = pos.with_coords((pos.coords.double() * s).float(), keep_grid=False)
        _close(attention_logits(enc, q, k, far), base, atol, f"scaling: linear {factor} at s * p differs from none at p")
    orig = [3.0] * A
    for cfg in ({"type": "yarn", "factor": 1.0, "original_size": orig}, {"type": "ntk", "factor": 1.0}):
        enc.set_scaling(cfg)
        _close(attention_logits(enc, q, k, pos), base, atol, f"scaling: {cfg['type']} with factor 1 differs from none")
    for cfg in ({"type": "linear", "factor": 2.0}, {"type": "yarn", "factor": 2.0, "original_size": orig},
                {"type": "ntk", "factor": 2.0}):
        enc.set_scaling(cfg)
        err = max_difference(attention_logits(enc, q, k, pos), base)
        if not err > 1e-3:
            raise PropertyFailure(f"scaling: {cfg['type']} with factor 2 leaves the logits unchanged ({err:.2g})")
    enc.set_scaling(None)
    _close(attention_logits(enc, q, k, pos), base, 0.0, "scaling: set_scaling(None) does not restore the logits")
    after = enc.state_dict()
    if sorted(after) != sorted(state) or any(not torch.equal(after[n], state[n]) for n in state):
        raise PropertyFailure("scaling: set_scaling changed the parameters or state_dict keys")
    bad = (
        ({"type": "cubic", "factor": 2.0}, "an unknown scaling type"),
        ({"type": "linear", "factor": 0.0}, "a zero factor"),
        ({"type": "linear", "factor": -2.0}, "a negative factor"),
        ({"type": "linear", "factor": {A: 2.0}}, f"a factor for axis {A} of {A}"),
        ({"type": "linear", "factor": [2.0] * (A + 1)}, f"{A + 1} factors for {A} axes"),
        ({"type": "linear", "factor": 2.0, "beta": 3}, "an unknown key"),
        ({"type": "yarn", "factor": 2.0}, "YaRN without original_size"),
    )
    for cfg, what in bad:
        _expect_value_error(lambda: enc.set_scaling(cfg), f"scaling with {what}")
    if enc.scaling is not None:
        raise PropertyFailure("scaling: a rejected config was kept")


def _expect_value_error(fn: Callable[[], object], what: str) -> None:
    try:
        fn()
    except ValueError:
        return
    raise PropertyFailure(f"errors: {what} did not raise ValueError")


CHECKS: dict[str, Callable[[Encoding], None]] = {
    "relative": check_relative,
    "extrapolation": check_extrapolation,
    "neutral": check_neutral,
    "zero_init": check_zero_init,
    "rotation_invariant": check_rotation_invariant,
    "fp32_angles": check_fp32_angles,
}


#: claims about the encoding as built, checked on its own parameters only (randomising them is the point's opposite)
AS_BUILT = frozenset({"zero_init"})


def _has_parameters(enc: Encoding) -> bool:
    return any(p.is_floating_point() for p in enc.parameters())


def check(enc: Encoding, claim: str, *, randomized: bool = True) -> None:
    """Run the check for ``claim`` on ``enc`` (eval mode); raises :class:`PropertyFailure` if it fails.

    With ``randomized`` (default) every claim except those in :data:`AS_BUILT` (``zero_init``) is checked a second
    time on a copy of ``enc`` whose floating parameters are drawn by :func:`randomize_parameters` (seed 0): a
    freshly built encoding's learned tables are often zero, and a claim checked only there proves nothing about
    what those tables do once trained. ``enc`` itself is left as it was.
    """
    if claim not in CHECKS:
        raise ValueError(f"unknown property {claim!r}; properties are {sorted(CHECKS)}")
    was_training = enc.training
    enc.eval()
    try:
        CHECKS[claim](enc)
        if randomized and claim not in AS_BUILT and _has_parameters(enc):
            trained = randomize_parameters(copy.deepcopy(enc), seed=0)
            try:
                CHECKS[claim](trained)
            except PropertyFailure as e:
                raise PropertyFailure(
                    f"{e} (with randomized parameters, vlpe.testing.randomize_parameters(enc, seed=0): the claim "
                    f"holds for the built parameters only)"
                ) from None
    finally:
        enc.train(was_training)


def property_report(enc: Encoding, *, all_properties: bool = False) -> dict[str, str]:
    """``{property: 'ok' | 'FAIL: ...' | 'holds (unclaimed)' | 'no'}`` for the claims (or every property), each
    checked by :func:`check` (as built and with randomised parameters)."""
    report: dict[str, str] = {}
    for claim in sorted(CHECKS):
        claimed = claim in enc.claims
        if not claimed and not all_properties:
            continue
        try:
            check(enc, claim)
            report[claim] = "ok" if claimed else "holds (unclaimed)"
        except (PropertyFailure, NotImplementedError, ValueError) as e:
            report[claim] = f"FAIL: {e}" if claimed else "no"
    try:
        check_errors(enc)
        report["errors"] = "ok"
    except PropertyFailure as e:
        report["errors"] = f"FAIL: {e}"
    if takes_scaling(enc):
        try:
            check_scaling(enc)
            report["scaling"] = "ok"
        except PropertyFailure as e:
            report["scaling"] = f"FAIL: {e}"
    return report
