"""Programmatic dependent launch (PDL) for the decode-path Triton kernels, on by default (sm90+).

A batch-1 decode step on the H200 is ~460 short kernels (docs/PERFORMANCE.md); each boundary
costs a launch ramp and a drain. With PDL (sm90+) a kernel launched with ``launch_pdl=True`` may
be scheduled as soon as every program of the previous kernel has executed
``griddepcontrol.launch_dependents`` (or exited), and its programs run until they execute
``griddepcontrol.wait``, which returns once the previous kernel has completed and its writes are
visible. Kernels that opt in here follow three rules:

1. Every program executes ``gdc_wait`` exactly once, unconditionally, before it reads anything
   the previous kernel may write and before it writes anything. So a PDL kernel completes only
   after its predecessor did, and completion stays ordered along the stream.
2. ``gdc_launch_dependents`` comes after ``gdc_wait`` in every program. So when a PDL kernel is
   launched, the kernel two back has completed (every program of the one in between has passed
   its wait). One exception: ``paged_attention(early_signal=True)``, where attention and its
   split merge signal first, is only used when the launch after the merge reads nothing but
   weights before its wait (the staged o_proj, kernels/staged_gemv.py).
3. Before its wait a program reads only tensors that no kernel of the forward writes (weights,
   the routing bias, the RoPE tables) or, through L2 (``.cg``, never a possibly stale L1 line),
   data written by a kernel at least two launches back when the kernel in between is one of
   these kernels (rule 2) or was launched normally. Examples: the GEMV MoE's down kernel reads
   the expert ids of the routing kernel before it waits for the gate_up kernel; the Q/K norm +
   RoPE + cache kernel reads the positions and slots, and paged attention the metadata and the
   K/V cache at positions before each request's first query, before their waits (the metadata
   is built before the first layer; the cache rows of this forward's own positions are the only
   ones the kernel just before attention writes).

Kernels launched normally (torch, torch.compile, cuBLAS) keep full stream ordering either way,
and a PDL kernel after one of them simply launches when that one's programs exit.

``USE_PDL`` switches it on for every Triton kernel of the decode, verify and drafter steps: the
skinny GEMM (Q|K|V|gate, o_proj, router), the Q/K norm + RoPE + cache kernel and the Q|K|V|gate
GEMM with that work in its epilogue (kernels/qkv_norm_rope_cache.py), paged attention and
its split merge, the routing kernel, the GEMV and fused MoE kernels, the residual add + RMSNorm
kernel, the staged o_proj GEMV (Gluon), and the drafter's context K-norm + RoPE + cache kernel:
every launch of a batch-1 target decode layer. On the H200 at Laguna-XS-2.1 size it took the batch-1 decode graph replay from
2.54 to 2.39 ms with the two norm chains still torch.compile'd (normal launches), greedy tokens
unchanged (docs/PERFORMANCE.md, "Fifth pass").
``python benchmarks/profile_decode_xs.py --switch laguna_dflash.kernels.pdl:USE_PDL=False``
A/Bs it (the profile re-captures the graphs). Under the CPU interpreter (no ``griddepcontrol``)
and below sm90 it is off whatever the switch says.
"""

from __future__ import annotations

import functools

import torch

USE_PDL = True


@functools.cache
def _is_sm90_or_newer(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def active(device: torch.device, interpret: bool) -> bool:
    """:data:`USE_PDL`, where programmatic dependent launch exists (compiled, CUDA sm90+)."""
    return USE_PDL and not interpret and device.type == "cuda" and _is_sm90_or_newer(device.index)


def launch_options(pdl: bool) -> dict:
    """The launch keyword of a kernel call: ``{"launch_pdl": True}`` or nothing."""
    return {"launch_pdl": True} if pdl else {}
