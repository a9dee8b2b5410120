"""Weight-only fp8 for the drafter's streamed weights (``SpeculativeConfig.draft_quantization``).

A weight ``W [N, K]`` is stored as ``Wq [N, K]`` float8_e4m3fn and one fp32 scale a row::

    scale[n] = max_k |W[n, k]| / 448        (448: e4m3's largest finite value)
    Wq[n, k] = e4m3(W[n, k] / scale[n])     (round to nearest even; |W / scale| <= 448)

and a product reads ``y[m, n] = scale[n] * sum_k x[m, k] Wq[n, k]`` (activations stay in the
model's dtype: W8A16). At batch 1 the drafter block streams its weights once and the lm_head's
(its ~0.33 ms block at XS-2.1 size read 0.21 ms of weight bytes, and each of its lm_heads 411 MB:
docs/PERFORMANCE.md, sixty-eighth and sixty-ninth passes), so one byte an element instead of two
halves what those weights cost where the kernel streams fp8 at the bf16 rate (not everywhere:
below). Only drafts change, never the output: the verify is the
target's, in its own dtype (speculative decoding stays lossless; acceptance may move a little,
measured on the demo pair by ``benchmarks/bench_draft_quantization.py``).

Quantized: each drafter layer's MLP ``gate_up_proj`` and the drafter's use of the shared lm_head
(an fp8 copy of the target's; the target keeps its own): where the fp8 skinny GEMM beats the bf16
one at the XS-2.1 drafter's 4-row shapes on an H200 (lm_head 55.7 against 94.8 us, gate|up 12.0
against 17.7). Not quantized: ``o_proj`` and ``down_proj`` (N 2048 x K 8192: 10.6 against 10.8
us, not worth the drafts' rounding; docs/PERFORMANCE.md, seventieth pass), the Q|K|V|gate
projection (the head GEMM with the norm / RoPE / cache-write epilogue,
``kernels/qkv_norm_rope_cache.py``), the context path (``fc`` and the context K/V GEMM), norms
and embeddings.

The fp8 kernel pays only in one launch of at most 16 rows. Past that (batch 5 and more at
K = 3) it runs 16-row blocks, each widening the weight's tiles again, and on the H200 it took
1.2-7x cuBLAS's time on the bf16 weight at 48-256 rows (``benchmarks/bench_fp8_rows.py``,
docs/PERFORMANCE.md, seventy-first pass). So a quantized weight keeps its unquantized tensor
(:class:`Fp8Linear`'s ``weight_unquantized``; the lm_head's is the target's own) and a CUDA
launch of more than 16 rows multiplies that one with cuBLAS, as the drafter as loaded does.
Elsewhere (the CPU, a bias, the batch-invariant scope) every row count takes the dequantized
weight: the fp8 values, so the acceptance benchmark on the CPU measures fp8 at every batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import batch_invariant, skinny_gemm
from . import fusion

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# (submodule of a drafter layer, attribute) of each projection quantize_drafter stores in fp8
QUANTIZED_PROJECTIONS: tuple[tuple[str, str], ...] = (("mlp", "gate_up_proj"),)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> (``Wq [N, K]`` float8_e4m3fn, ``scale [N]``
    float32), on weight's device (module docstring). An all-zero row gets scale 1."""
    amax = weight.detach().float().abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (weight.detach().float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    return quantized.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize_rows(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale[n] * Wq[n]`` as a ``[N, K]`` tensor of ``dtype`` (one rounding of each product)."""
    return (quantized.float() * scale[:, None]).to(dtype)


# The 16-row blocks' tile where no unquantized weight is given: the best of the eight
# bench_fp8_rows.py timed at the XS-2.1 lm_head and gate|up at 48, 192 and 256 rows on the H200
# (all six cells; 1.5-2x faster than the config derived from the bf16 table), still slower
# than cuBLAS on bf16 there.
ROWS_CONFIG = skinny_gemm.SkinnyConfig(block_n=128, block_k=128, split_k=1, num_warps=2, num_stages=4,
                                       use_dot=True, evict_first=True, x_bcast=True)


def fp8_linear(x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, glu: bool = False,
               unquantized: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ (scale * Wq) [N, K]^T (+ bias)`` -> ``[M, N]`` in x's dtype; ``glu``: the
    SwiGLU ``silu(g) * u`` of ``[g | u]`` -> ``[M, N / 2]``.

    On CUDA (no bias, outside ``batch_invariant.scope``): ``M <= 16``, the skinny GEMM
    streaming the fp8 weight in one launch (with ``glu``, the SwiGLU as its epilogue); more
    rows, ``F.linear`` on ``unquantized [N, K]`` (x's dtype: the weight before quantization)
    where given (module docstring), else the skinny GEMM on 16-row blocks
    (``skinny_gemm_rows`` at :data:`ROWS_CONFIG`, ``MAX_ROW_BLOCKS * 16`` rows a launch; the
    SwiGLU after it): never a dequantized copy of the weight, which for the lm_head would be a
    transient 1.2 GB at XS-2.1 size. Otherwise (CPU, a bias, the batch-invariant scope)
    ``F.linear`` (or ``batch_invariant.linear``) on the dequantized weight at every ``M``: the
    same values as the kernel's, another summation order."""
    m = x.shape[0]
    if (x.is_cuda and bias is None and not batch_invariant.is_active()
            and not (torch.is_grad_enabled() and x.requires_grad)
            and skinny_gemm.can_use(x[: skinny_gemm.MAX_M], quantized, scale)):
        if m <= skinny_gemm.MAX_M:
            return skinny_gemm.skinny_gemm(x, quantized, glu=glu, scale=scale)
        if unquantized is not None:
            y = F.linear(x, unquantized)
            return fusion.silu_mul(y) if glu else y
        cfg = ROWS_CONFIG
        step = skinny_gemm.MAX_ROW_BLOCKS * skinny_gemm.MAX_M
        parts = [skinny_gemm.skinny_gemm_rows(x[i : i + step], quantized, cfg, scale=scale)
                 for i in range(0, m, step)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
    else:
        weight = dequantize_rows(quantized, scale, x.dtype)
        y = batch_invariant.linear(x, weight, bias) if batch_invariant.is_active() else F.linear(x, weight, bias)
    return fusion.silu_mul(y) if glu else y


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` (no bias) whose weight is stored as fp8 rows with scales: ``weight``
    ``[N, K]`` float8_e4m3fn and ``weight_scale [N]`` float32 (buffers, not trained), and
    ``weight_unquantized`` the layer's own weight, kept for CUDA launches past 16 rows
    (:func:`fp8_linear`; not saved with the state dict). Callers that take a layer's ``weight``
    pass ``weight_scale`` and ``weight_unquantized`` along (``layers.gate_up_silu``)."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        if layer.bias is not None:
            raise ValueError("fp8 draft quantization covers bias-free projections; this layer has a "
                             "bias (leave draft_quantization unset)")
        quantized, scale = quantize_rows(layer.weight)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.register_buffer("weight", quantized)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_unquantized", layer.weight.detach(), persistent=False)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale,
                          unquantized=self.weight_unquantized).view(*x.shape[:-1], -1)


def quantize_drafter(drafter: nn.Module) -> int:
    """Quantize ``drafter``'s streamed weights in place (module docstring): every layer's
    :data:`QUANTIZED_PROJECTIONS` (``mlp.gate_up_proj``) become :class:`Fp8Linear` and the
    drafter keeps an fp8 copy of the shared lm_head (``lm_head_fp8``; of its draft vocabulary's
    rows only where ``set_draft_vocab`` set one: models/draft_vocab.py). Inference only,
    after ``layers.fuse_for_inference``. Memory grows by the fp8 copies (the unquantized
    weights stay for launches past 16 rows). Returns the bytes of weights the drafter's
    forward no longer reads in bf16 in a launch of up to 16 rows (what one block and one
    lm_head stream less there)."""
    saved = 0
    for layer in drafter.layers:
        for path, name in QUANTIZED_PROJECTIONS:
            owner = layer.get_submodule(path)
            old = getattr(owner, name)
            setattr(owner, name, Fp8Linear(old))
            saved += old.weight.numel() * (old.weight.element_size() - 1)
            del old
    # the draft vocabulary's rows where one is set (models/draft_vocab.py), else the whole lm_head
    head = drafter.lm_head_weight if drafter.draft_head is None else drafter.draft_head
    drafter.lm_head_fp8 = quantize_rows(head)
    saved += head.numel() * (head.element_size() - 1)
    if any(p.is_cuda for p in drafter.parameters()):
        torch.cuda.empty_cache()  # quantize_rows' float32 temporaries, before the KV cache is sized
    return saved
