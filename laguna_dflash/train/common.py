"""Shared training plumbing: device/dtype setup, LR schedule, resumable checkpoints."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import MISSING, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..config import flag
from ..distributed import SINGLE, TensorParallel, init_data_parallel

logger = logging.getLogger(__name__)


def arg(text: str, default=MISSING):
    """A config field with ``text`` as its flag's ``--help`` line (``cli.add_dataclass_args``
    appends the default)."""
    return field(default=default, metadata={"help": text})


#: ``--help`` lines of the fields both training configs have (their defaults differ).
SHARED_HELP = {
    "batch_size": "sequences an optimizer step (split over the ranks under torchrun)",
    "steps": "optimizer steps",
    "lr": "peak learning rate of the cosine schedule (AdamW)",
    "warmup": "linear warm-up steps before the cosine decay",
    "device": "cpu, cuda or cuda:N",
    "save_every": "write the resumable training state every N steps",
    "log_every": "show the mean loss of the last N steps every N steps",
    "time_budget_s": "shrink the schedule so training ends within this many seconds",
}


def shared_arg(name: str, default):
    """A field of both training configs, with its :data:`SHARED_HELP` line."""
    return arg(SHARED_HELP[name], default)


def require_at_least(c, **minimums: float) -> None:
    """A ValueError naming the flag of the first field below its minimum (None: unset, allowed)."""
    for name, low in minimums.items():
        value = getattr(c, name)
        if value is not None and not value >= low:
            raise ValueError(f"{flag(name)} must be >= {low}, got {value}")


def require_positive(c, *names: str) -> None:
    """A ValueError naming the flag of the first field that is not > 0 (None: unset, allowed)."""
    for name in names:
        value = getattr(c, name)
        if value is not None and not value > 0:
            raise ValueError(f"{flag(name)} must be > 0, got {value}")


def check_device(device: str) -> None:
    """``--device`` names the CPU or a CUDA device torch can parse (``cudax`` is an error naming
    the flag, not torch's list of every device type)."""
    try:
        device_type = torch.device(device).type
    except RuntimeError:
        device_type = None
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r} is not supported; use cpu, cuda or cuda:N")


def check_out_dir(out: Path) -> None:
    """``--out-dir`` is a directory or can become one: a ValueError naming the flag where it, or
    the nearest of its parents that exists, is a file (before any data is built)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out-dir {out} is a file; pass a directory (new, or one to resume in)")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"--out-dir {out}: {parent} is a file, so no directory can be made there; "
                         "pass a directory path (new, or one to resume in)")


def make_work_dir(out: Path) -> Path:
    """Create ``out/work`` (and ``out``) -> it; a ValueError naming ``--out-dir`` where the
    directory cannot be made (read-only or missing file system, permissions)."""
    work = out / "work"
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out-dir {out}: cannot create {work} ({e.strerror or e}); pass a "
                         "writable directory") from e
    return work


def join_data_parallel(device: torch.device, batch_size: int) -> tuple[TensorParallel, torch.device]:
    """The launch's data-parallel ranks (:data:`SINGLE` in one process) and this rank's device
    (``LOCAL_RANK``'s GPU under a multi-GPU launch); ``--batch-size`` must split evenly."""
    dp = init_data_parallel(device)
    if dp.is_parallel and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if batch_size % dp.world_size:
        raise ValueError(f"--batch-size {batch_size} is not divisible by the {dp.world_size} "
                         "launched ranks; pick a multiple of the rank count")
    return dp, device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op context on CPU (float32 training)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def save_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
               extra: dict | None = None) -> None:
    """Atomically write a resumable training state (weights, optimizer, step, RNG)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "torch_rng": torch.get_rng_state(), "extra": extra or {}}, tmp)
    tmp.replace(path)


def check_run_flags(path: Path, saved: dict | None, run_flags: dict | None) -> None:
    """A resumed run's ``run_flags`` (config fields that shape the run: model, schedule, data
    order) equal those the state at ``path`` was written with (``saved``; None in a state of an
    older version, or where the caller checks none): a ValueError naming each flag that differs
    otherwise (the resumed run would silently mix two runs' settings)."""
    if not saved or run_flags is None:
        return
    diffs = [f"{flag(k)} {saved[k]!r} there, {v!r} now" for k, v in run_flags.items()
             if k in saved and saved[k] != v]
    if diffs:
        raise ValueError(f"{path} is the training state of a run with other flags ({'; '.join(diffs)}); "
                         "resume with that run's flags, or use a new --out-dir (or delete this file "
                         "to start over)")


def load_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               run_flags: dict | None = None) -> tuple[int, dict]:
    """Resume from ``path`` if it exists: returns (next step, extra); (0, {}) otherwise.
    ``run_flags``: checked against the ones the state was written with (:func:`check_run_flags`)."""
    if not path.is_file():
        return 0, {}
    state = torch.load(path, map_location="cpu", weights_only=False)
    check_run_flags(path, state.get("extra", {}).get("run_flags"), run_flags)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0]
        raise ValueError(
            f"{path} is the training state of another model ({first}); its run used other model "
            "flags: resume with the same flags, or use a new --out-dir (or delete this file to "
            "start over)"
        ) from e
    torch.set_rng_state(state["torch_rng"])
    logger.info("resumed from %s at step %d", path, state["step"])
    return int(state["step"]), state.get("extra", {})


def balance_moe_(model: torch.nn.Module, rate: float, dp: TensorParallel = SINGLE) -> None:
    """Aux-loss-free load balancing (arXiv 2408.15664): nudge each MoE layer's
    ``e_score_correction_bias`` up for under-loaded experts and down for over-loaded ones.
    Data parallel: the loads are summed over the ranks first (the whole batch's load), so every
    rank's biases move alike."""
    for module in model.modules():
        ids = getattr(module, "last_expert_ids", None)
        if ids is None:
            continue
        load = dp.all_reduce(torch.bincount(ids.reshape(-1), minlength=module.num_experts).float())
        with torch.no_grad():
            module.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))
        module.last_expert_ids = None


def run_training(
    desc: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[int], torch.Tensor],
    *,
    steps: int,
    lr: float,
    warmup: int,
    state_path: Path,
    save_every: int,
    log_every: int,
    time_budget_s: float | None = None,
    after_step: Callable[[], None] | None = None,
    on_save: Callable[[], None] | None = None,
    dp: TensorParallel = SINGLE,
    generator: torch.Generator | None = None,
    run_flags: dict | None = None,
) -> tuple[list[float], float]:
    """The shared optimisation loop: cosine LR, grad clip 1.0, resumable state, progress bar.

    With ``time_budget_s`` the schedule is re-planned from the measured step rate so training
    (and its LR decay) ends within the budget. The budget covers the whole run: a resumed run
    starts with the seconds already spent and the schedule already planned (both in the
    training state), so its learning rates continue the interrupted run's instead of jumping
    back to a plan over ``steps``. Returns (losses, seconds of the whole run).

    Data parallelism (``dp``, :func:`~laguna_dflash.distributed.init_data_parallel`): each
    rank's ``loss_fn`` returns its part of the step's loss (the parts sum to the whole batch's
    loss), so the gradients and the loss are summed over the ranks before clipping; every rank
    then takes the same optimizer step. Rank 0 alone writes states, saves and shows progress;
    the time budget follows rank 0's clock.

    ``generator``: the generator ``loss_fn`` draws its data from (batch rows, anchors). Its
    state is part of the training state, as are the losses so far, so a resumed run draws the
    batches an uninterrupted run would draw next and returns the whole run's losses.

    ``run_flags``: the config fields a resumed run must keep (flag name -> value); saved in the
    training state, and a resume with other values is a ValueError naming them.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    start, extra = load_state(state_path, model, optimizer, run_flags)
    if start and generator is not None:
        if "generator" in extra:
            generator.set_state(extra["generator"])
        else:  # a state written before the generator was saved: the data restart from the top
            logger.warning("%s holds no data-generator state; the resumed run redraws its "
                           "batches from the first one", state_path)
    losses: list[float] = list(extra.get("losses", []))[:start]
    t0 = time.perf_counter() - float(extra.get("elapsed_s", 0.0)) if start else time.perf_counter()
    total = min(steps, int(extra.get("planned_steps", steps))) if time_budget_s and start else steps
    t_mark, step_mark = time.perf_counter(), start
    bar = tqdm(total=total, desc=desc, initial=start, disable=not dp.is_driver)
    step = start
    while step < total:
        if time_budget_s and step >= start + 8:
            rate = (time.perf_counter() - t_mark) / (step - step_mark) if step > step_mark else 0.0
            if rate > 0:
                remaining = max(0.0, time_budget_s - (time.perf_counter() - t0))
                total = dp.broadcast_object(min(steps, step + int(remaining / rate)))
                bar.total = total
        if step == start + 3:
            t_mark, step_mark = time.perf_counter(), step
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, total, lr, warmup)
        loss = loss_fn(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if dp.is_parallel:
            loss = sum_over_ranks(params, loss, dp)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if after_step is not None:
            after_step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"{desc} diverged at step {step} (loss {losses[-1]}); lower --lr")
        if (step + 1) % log_every == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-log_every:]):.3f}")
        if (step + 1) % save_every == 0 and dp.is_driver:
            extra = {"losses": list(losses), "elapsed_s": time.perf_counter() - t0,
                     "planned_steps": total, "run_flags": run_flags}
            if generator is not None:
                extra["generator"] = generator.get_state()
            save_state(state_path, model, optimizer, step + 1, extra)
            if on_save is not None:
                on_save()
        step += 1
        bar.update(1)
    bar.close()
    return losses, time.perf_counter() - t0


def sum_over_ranks(params: list[torch.Tensor], loss: torch.Tensor, dp: TensorParallel) -> torch.Tensor:
    """Sum every parameter's gradient and ``loss`` over the data-parallel ranks, in one
    all-reduce of one flat buffer (a parameter without a gradient counts as zeros) -> the
    summed loss (detached)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss.detach().reshape(1).float()])
    flat = dp.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g).to(g.dtype)
        offset += g.numel()
    return flat[-1]
