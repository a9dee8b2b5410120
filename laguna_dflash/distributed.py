"""Tensor parallelism over ``torch.distributed``: which shard a rank holds, and the collectives.

Megatron-style sharding (README.md, "Tensor parallelism"): Q|K|V|gate, gate|up and
the experts' gate|up are column-parallel (each rank holds ``1 / world_size`` of the heads or of
the intermediate width), ``o_proj`` and every ``down`` are row-parallel and followed by one
all-reduce, the embedding and the lm_head hold ``1 / world_size`` of the vocabulary (the
embedding's rows summed by an all-reduce, the logits gathered). Norms and the MoE router are
replicated. The DFlash drafter's layers are sharded the same way where their heads and MLP
width divide ``world_size`` (``draft_tensor_parallel_size`` 1 replicates them), its ``fc`` and
norms replicated. With expert parallelism (``expert_parallel``,
vLLM's ``--enable-expert-parallel``) each rank holds ``num_experts / world_size`` whole routed
experts instead of every expert's ``1 / world_size`` width: the router stays replicated, a rank
computes only the (token, expert) pairs routed to its experts, and the MoE's one all-reduce sums
the ranks' partial outputs as before. After each all-reduce every rank holds the same bits,
so each rank's scheduler, sampler and acceptance make the same decisions from the same inputs;
the engine broadcasts what only rank 0 knows (:meth:`TensorParallel.broadcast_object`).

Ranks are processes launched like torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``): NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def is_rank_zero() -> bool:
    """This process reports results (prints, progress bars): the only one, or rank 0 of a
    torchrun-style launch (``RANK`` unset or 0)."""
    return os.environ.get("RANK", "0") == "0"


@dataclass(frozen=True)
class Split:
    """This rank's part of an on-disk tensor.

    Along ``dim`` the disk tensor is the concatenation of ``len(segments)`` parts (e.g. Q|K|V
    rows, gate|up rows) whose local sizes are ``segments`` (one part of the whole ``dim`` when
    empty); each part is split into ``world_size`` equal chunks and the rank holds chunk
    ``rank`` of every part, concatenated in order.
    """

    dim: int
    rank: int
    world_size: int
    segments: tuple[int, ...] = ()

    def disk_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The full on-disk shape whose shard has ``local_shape``."""
        shape = list(local_shape)
        shape[self.dim] *= self.world_size
        return tuple(shape)

    def read(self, source: Any) -> torch.Tensor:
        """This rank's chunk of ``source`` (a safetensors slice or a tensor of the disk shape);
        only the chunk's bytes are read from a safetensors slice."""
        shape = source.get_shape() if hasattr(source, "get_shape") else source.shape
        pieces, offset = [], 0
        for size in self.segments or (shape[self.dim] // self.world_size,):
            start = offset + self.rank * size
            index = (slice(None),) * self.dim + (slice(start, start + size),)
            pieces.append(source[index])
            offset += size * self.world_size
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


@dataclass(frozen=True)
class TensorParallel:
    """A rank's place in the tensor-parallel group. ``world_size == 1`` (the default,
    :data:`SINGLE`): every collective is the identity and nothing is sharded."""

    rank: int = 0
    world_size: int = 1
    group: Any = field(default=None, compare=False)  # a dist.ProcessGroup when world_size > 1
    # host-side messages (rank 0's requests and clock): a gloo group, so they never touch a GPU
    # stream, with a timeout long enough for an idle server's followers
    control_group: Any = field(default=None, compare=False)
    # the routed experts split by expert (whole experts a rank) instead of by intermediate width
    expert_parallel: bool = False

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that talks to users (logs results, serves HTTP) and whose
        host-side measurements decide for all (adaptive K)."""
        return self.rank == 0

    def shard_size(self, size: int, what: str) -> int:
        """``size / world_size``; a clear error when ``what`` does not divide."""
        if size % self.world_size:
            raise ValueError(
                f"{what}={size} is not divisible by tensor_parallel_size={self.world_size}; pick a "
                "tensor_parallel_size that divides it (--tensor-parallel-size)")
        return size // self.world_size

    @property
    def shards_experts(self) -> bool:
        """Routed experts are split by expert index (expert parallelism over several ranks)."""
        return self.expert_parallel and self.is_parallel

    def expert_shard(self, num_experts: int) -> tuple[int, int]:
        """``(first, count)``: the routed experts this rank holds, ``first .. first + count - 1``
        (all of them without expert parallelism); a clear error when they do not divide."""
        if not self.shards_experts:
            return 0, num_experts
        if num_experts % self.world_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by tensor_parallel_size="
                f"{self.world_size} with --enable-expert-parallel; pick a tensor_parallel_size "
                "that divides it (--tensor-parallel-size) or drop --enable-expert-parallel")
        count = num_experts // self.world_size
        return self.rank * count, count

    def split(self, dim: int, segments: tuple[int, ...] = ()) -> Split | None:
        """The loader's :class:`Split` of a sharded parameter along ``dim`` (None unsharded)."""
        if not self.is_parallel:
            return None
        return Split(dim, self.rank, self.world_size, tuple(segments))

    # ---- collectives (identity on one rank) ----------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks (in place when contiguous); every rank gets the same bits."""
        if not self.is_parallel:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on each rank -> ``[..., world_size * n]``, rank ``r``'s at ``r*n``."""
        if not self.is_parallel:
            return x
        x = x.contiguous()
        if dist.get_backend(self.group) == "nccl":  # one buffer, capturable in a CUDA graph
            out = torch.empty((self.world_size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable; host to host over the control group)."""
        if not self.is_parallel:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def exchange(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor]) -> None:
        """Send ``outgoing[p]`` to rank ``p`` and receive rank ``p``'s into ``incoming[p]``, all
        at once (host tensors, point to point over the control group; the two sides must agree on
        the shapes). Returns when every message has arrived."""
        if not self.is_parallel:
            assert not outgoing and not incoming, "one rank has no peers"
            return
        works = [dist.isend(t.contiguous(), dst=p, group=self.control_group) for p, t in outgoing.items()]
        works += [dist.irecv(t, src=p, group=self.control_group) for p, t in incoming.items()]
        for work in works:
            work.wait()

    def barrier(self) -> None:
        """Wait for every rank (host side, over the control group: no GPU stream involved)."""
        if self.is_parallel:
            dist.barrier(group=self.control_group)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the ranks (e.g. KV blocks that fit on every GPU)."""
        if not self.is_parallel:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TensorParallel()
# How long a follower rank waits for rank 0's next message (a server may idle for days).
CONTROL_TIMEOUT = datetime.timedelta(days=7)
# (default group, its gloo control group): made once per process group (every rank together),
# shared by every engine the process builds on it
_control_groups: tuple[Any, Any] | None = None


def shutdown() -> None:
    """Tear down this process's process group and its control group (registered at exit by
    :func:`init_tensor_parallel`; call it first where a launcher ends a rank otherwise)."""
    global _control_groups
    _control_groups = None  # no reference to a group may outlive the teardown below
    if dist.is_initialized():
        dist.destroy_process_group()


def init_tensor_parallel(world_size: int, device: torch.device,
                         expert_parallel: bool = False) -> TensorParallel:
    """Join (or start) the default process group of a torchrun-style launch and return this
    rank's :class:`TensorParallel`; ``world_size == 1``: :data:`SINGLE`, no process group.

    ``device``: CUDA (NCCL; rank ``r`` takes GPU ``LOCAL_RANK``) or CPU (gloo).
    ``expert_parallel``: split the routed experts by expert over the ranks (a no-op on one)."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size={world_size}; it must be at least 1")
    if world_size == 1:
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        # every process would load the whole model onto the same device; unless the caller
        # joined the launch's process group itself (data parallelism: an engine per rank)
        if launched > 1 and not dist.is_initialized():
            raise ValueError(
                f"this process is one of WORLD_SIZE={launched} launched ranks but "
                f"tensor_parallel_size=1; pass --tensor-parallel-size {launched} "
                "(LLM(..., tensor_parallel_size=...)) or launch one process")
        if expert_parallel:
            logger.info("expert parallelism over one rank: every expert stays on this device")
        return SINGLE
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is None and not dist.is_initialized():
        raise ValueError(
            f"tensor_parallel_size={world_size} needs one process per rank: launch with "
            f"`torchrun --nproc-per-node {world_size} ...` (or set RANK, WORLD_SIZE, MASTER_ADDR "
            "and MASTER_PORT), or use tensor_parallel_size=1")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        # torn down before the interpreter's own teardown: a process group still alive there
        # (its gloo / NCCL threads) can abort the exiting process (SIGABRT, seen under torchrun)
        atexit.register(shutdown)
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} but the launch has {dist.get_world_size()} "
            f"processes; pass --tensor-parallel-size {dist.get_world_size()} or launch "
            f"{world_size} processes")
    global _control_groups
    if _control_groups is None or _control_groups[0] is not dist.group.WORLD:
        _control_groups = (dist.group.WORLD, dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))
    rank = dist.get_rank()
    logger.info("rank %d of %d (%s)%s", rank, world_size, dist.get_backend(),
                ", experts split by expert" if expert_parallel else "")
    return TensorParallel(rank, world_size, dist.group.WORLD, _control_groups[1], expert_parallel)


def init_data_parallel(device: torch.device) -> TensorParallel:
    """The processes of a torchrun-style launch as data-parallel replicas (drafter training:
    each rank its part of every batch, gradients summed with :meth:`TensorParallel.all_reduce`);
    one process: :data:`SINGLE`. Joins the launch's process group as
    :func:`init_tensor_parallel` does (NCCL on CUDA, one GPU a rank by ``LOCAL_RANK``; gloo on
    CPU), so an engine a rank builds later runs alone on its device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return init_tensor_parallel(world_size, device) if world_size > 1 else SINGLE
