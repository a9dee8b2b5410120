"""Rotary position embeddings: default and YaRN, full or partial, NeoX (rotate-half) layout.

Every Laguna / Qwen3 / DFlash layer rotates the first ``rotary_dim = head_dim * partial`` channels
of Q and K with pairs ``(i, i + rotary_dim/2)`` and passes the rest through. YaRN folds its
magnitude factor ``mscale`` into cos/sin; the softmax scale stays ``head_dim ** -0.5``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import fusion

# the fewest positions a table is built with (growth doubles): fewer rebuilds for short runs;
# the tests set it to 1, so that a table exactly as long as asked for is what they index
MIN_TABLE_POSITIONS = 256


@dataclass(frozen=True)
class RopeSpec:
    """Resolved RoPE settings of one layer type."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    # YaRN magnitude when attention_factor is absent and BOTH are set (transformers' rule):
    # (0.1 * mscale * ln s + 1) / (0.1 * mscale_all_dim * ln s + 1)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, params: dict, head_dim: int, max_position_embeddings: int) -> RopeSpec:
        """Build from an HF rope-parameters dict (``rope_type``/``type``, ``rope_theta``, ...)."""
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "yarn", "linear"):
            raise ValueError(
                f"rope_type={rope_type!r} is not supported; supported: default, yarn, linear"
            )
        if "rope_theta" not in params:
            raise ValueError(f"rope parameters {params} lack 'rope_theta'; add it to config.json")
        if rope_type != "default" and params.get("factor") is None:
            # transformers refuses this too; running it as factor 1 would silently drop the scaling
            raise ValueError(
                f"config.json rope_parameters {params} has rope_type={rope_type!r} but no 'factor'; "
                "add the scaling factor (YaRN: max_position_embeddings / "
                "original_max_position_embeddings) or set rope_type to 'default'"
            )
        return cls(
            head_dim=head_dim,
            theta=float(params["rope_theta"]),
            rope_type=rope_type,
            partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0) or 1.0),
            factor=float(params.get("factor", 1.0) or 1.0),
            original_max_position_embeddings=params.get(
                "original_max_position_embeddings", max_position_embeddings
            ),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )


def rope_inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` float32 and the cos/sin magnitude scale."""
    dim = spec.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    inv_extra = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "default":
        return inv_extra, 1.0
    if spec.rope_type == "linear":
        return inv_extra / spec.factor, 1.0
    # YaRN: blend interpolated (1/s) and extrapolated frequencies with a linear ramp over the
    # dimensions whose wavelength falls between beta_fast and beta_slow rotations of L0.
    s = spec.factor
    l0 = spec.original_max_position_embeddings

    def corr(num_rotations: float) -> float:
        return dim * math.log(l0 / (num_rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    lo, hi = corr(spec.beta_fast), corr(spec.beta_slow)
    if spec.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
    extra_mask = 1.0 - ramp
    inv_freq = (inv_extra / s) * (1.0 - extra_mask) + inv_extra * extra_mask
    return inv_freq, yarn_magnitude(spec)


def yarn_magnitude(spec: RopeSpec) -> float:
    """The YaRN cos/sin scale, as transformers computes it (vLLM ignores ``attention_factor``
    and ``mscale``; every release's ``attention_factor`` equals the default, so both agree there):
    an explicit ``attention_factor`` as is; else, with both ``mscale`` and ``mscale_all_dim``
    set, the ratio of their magnitudes; else ``0.1 ln s + 1`` (1 for ``s <= 1``)."""
    if spec.attention_factor is not None:
        return float(spec.attention_factor)

    def magnitude(m: float = 1.0) -> float:
        return 1.0 if spec.factor <= 1 else 0.1 * m * math.log(spec.factor) + 1.0

    if spec.mscale and spec.mscale_all_dim:
        return magnitude(float(spec.mscale)) / magnitude(float(spec.mscale_all_dim))
    return magnitude()


class RotaryEmbedding:
    """cos/sin tables for one :class:`RopeSpec`, grown on demand (not a module: no weights).

    Tables are ``[max_positions, rotary_dim]`` float32 on ``device``; ``apply`` casts to the input
    dtype, as the references do.
    """

    def __init__(self, spec: RopeSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.inv_freq, self.mscale = rope_inv_freq(spec)
        self.cos = torch.empty(0, spec.rotary_dim, device="cpu")
        self.sin = torch.empty(0, spec.rotary_dim, device="cpu")

    def ensure(self, num_positions: int) -> None:
        """Make the tables cover positions ``0 .. num_positions-1`` (call outside hot loops)."""
        if self.cos.shape[0] >= num_positions:
            return
        n = max(num_positions, 2 * self.cos.shape[0], MIN_TABLE_POSITIONS)
        pos = torch.arange(n, dtype=torch.float32, device="cpu")
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * self.mscale).to(self.device)
        self.sin = (emb.sin() * self.mscale).to(self.device)

    def to(self, device: torch.device | str) -> RotaryEmbedding:
        self.device = torch.device(device)
        self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)
        return self

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [N, heads, head_dim]`` at ``positions [N]`` (int64); returns a new tensor."""
        return fusion.rope(x, self.cos, self.sin, positions, self.spec.rotary_dim)
