"""Multi-process training jobs (``torchrun``, ``--distributed ddp|fsdp``): the process group, the model's wrapping,
each rank's rows of a global batch, the reductions the record needs, and who writes it.

    torchrun --nproc-per-node 2 -m experiments.train --task mnist5k --method lowmembp --batch-size 8 \
        --distributed ddp --out r.json

- **Batch.** ``--batch-size`` is the *global* batch. Every rank draws the same global batch (the same seeded
  permutation, collated once, so text is padded as in one process) and keeps rows ``[r·b/N, (r+1)·b/N)``; ``b`` must
  divide by ``N``. With a loss that is a mean over samples (classification), DDP's average of the ranks' gradients
  is the one-process gradient of the whole batch, so the loss curve is one process's up to the order of the sums.
  A token-mean loss (the LM tasks) is averaged per rank, as DDP always does: equal to one process's only when the
  ranks hold equally many target tokens.
- **Wrapping.** The methods are applied to the plain model first (``lowmembp.apply``), then ``ddp``:
  ``DistributedDataParallel``; ``fsdp``: FSDP2 ``fully_shard`` on every transformer block (the model layout's
  blocks, taken before the methods, so a checkpointing wrapper ends up around a sharded block), then on the root.
- **Randomness.** Every rank seeds as one process would. TokenTune's selection draws the positions of the whole
  global batch on every rank (the ranks' padding masks are gathered) and keeps its own rows: the same positions as
  one process. Mesa reduces its batch statistics over the ranks (``lowmembp.ops.mesa_quant``).
- **Record.** Only rank 0 writes it (and ``--save-model``). Loss: the mean of the ranks' losses; samples and
  tokens: sums over ranks, so the throughput is global (global samples / rank 0's step time: the ranks run in lock
  step). Peak: each rank measures its own (DDP: the storage tracker; FSDP: the CPU allocator's events, because FSDP2
  frees and re-allocates unsharded parameters by resizing storages, which a dispatch mode does not see; on CUDA
  the allocator's peak); the record's ``distributed`` section keeps every rank's, their max and mean, and
  ``peak.device`` is the largest rank's. Evaluation runs on every rank over the whole test split (FSDP needs every
  rank in every forward); rank 0's metric is recorded.
- **Failures.** A rank whose step fails while the others wait in a collective ends the job: rank 0 writes an error
  record when it is the one that failed; otherwise torchrun stops the group and the pipeline's crash guard writes it.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

MODES = ("ddp", "fsdp")
TIMEOUT_MIN = 10  # a collective that waits longer than this fails (a rank died) instead of hanging forever


def env_world() -> tuple[int, int, int]:
    """(world size, rank, local rank) from torchrun's environment; (1, 0, 0) outside it."""
    def num(name, default):
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default
    return num("WORLD_SIZE", 1), num("RANK", 0), num("LOCAL_RANK", 0)


def check(mode: str | None, batch_size: int | None) -> str | None:
    """The reason the settings cannot run (None: they can): a mode without torchrun, torchrun without a mode, a
    global batch that does not split evenly."""
    world, _, _ = env_world()
    if mode is None:
        if world > 1:
            return (f"started with {world} processes (WORLD_SIZE={world}, torchrun) but without --distributed: give "
                    f"--distributed ddp or fsdp (or run one process)")
        return None
    if mode not in MODES:
        return f"--distributed must be one of {', '.join(MODES)}, got {mode!r}"
    if "WORLD_SIZE" not in os.environ:
        return (f"--distributed {mode} needs the environment torchrun sets (WORLD_SIZE, RANK, MASTER_ADDR): run "
                f"`torchrun --nproc-per-node N -m experiments.train ... --distributed {mode}`")
    if batch_size is not None and batch_size % world:
        return (f"--batch-size {batch_size} is the global batch and must divide by the {world} processes: give a "
                f"multiple of {world}")
    return None


@dataclass
class Context:
    """This process's place in the job; ``mode`` None is the ordinary one-process run (every method a no-op)."""
    mode: str | None = None
    world: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: str | None = None

    @property
    def active(self) -> bool:
        return self.mode is not None

    @property
    def writes(self) -> bool:
        """Whether this process writes the record and the weights."""
        return self.rank == 0

    # -- data ---------------------------------------------------------------------------------------------
    def rows(self, batch: dict, batch_size: int) -> dict:
        """This rank's rows of a collated global batch (every tensor whose first dimension is the batch)."""
        if not self.active:
            return batch
        per = batch_size // self.world
        lo = self.rank * per
        return {k: v[lo:lo + per] if hasattr(v, "shape") and v.dim() > 0 and v.shape[0] == batch_size else v
                for k, v in batch.items()}

    def reduce_step(self, loss: float, tokens: int | None) -> tuple[float, int | None]:
        """(mean loss over ranks, token sum over ranks) — one all-reduce."""
        if not self.active:
            return loss, tokens
        import torch
        import torch.distributed as dist

        t = torch.tensor([loss, 0.0 if tokens is None else float(tokens)], dtype=torch.float64,
                         device=self.comm_device())
        dist.all_reduce(t)
        return float(t[0]) / self.world, None if tokens is None else int(round(float(t[1])))

    def gather(self, value: float) -> list[float]:
        """``value`` of every rank, in rank order (every rank gets the list)."""
        if not self.active:
            return [value]
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64, device=self.comm_device())
        parts = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return [float(p) for p in parts]

    def comm_device(self):
        import torch

        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    # -- the model ----------------------------------------------------------------------------------------
    def wrap(self, model, blocks, device):
        """``model`` (methods applied, on ``device``) wrapped for this mode; ``blocks``: the transformer blocks
        (modules inside it) that FSDP2 shards one by one before the root."""
        if not self.active:
            return model
        _replay_tokentune_globally(model, self)
        if self.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids)
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        return model


def block_modules(model) -> list:
    """The transformer blocks of the plain model (before the methods), in forward order."""
    from lowmembp.models.layout import get_layout

    return [site.get() for site in get_layout(model).blocks]


def unwrap(model):
    """The model inside a DDP wrapper (FSDP2 shards in place: the model itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def full_state_dict(model) -> dict:
    """The whole model's state dict on every rank (FSDP2's shards gathered; collective: call it on every rank)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in unwrap(model).state_dict().items()}


class _Weights:
    """What ``experiments.weights.save_weights`` needs of a model: its (gathered) state dict."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def weights_of(model, ctx: Context):
    """What ``--save-model`` writes: the model itself (one process), DDP's inner module, or FSDP2's gathered
    weights (a collective: every rank calls it, rank 0 writes)."""
    if ctx.mode == "fsdp":
        return _Weights(full_state_dict(model))
    return unwrap(model)


def _local(t):
    """A tensor's local storage holder (a DTensor's shard)."""
    return getattr(t, "_local_tensor", t)


def fsdp_cpu_peak(model, optimizer, step, *, warmup: int = 0, external: tuple = ()) -> dict:
    """Peak bytes of one step of an FSDP2 model on this rank's CPU: the local shards (parameters, buffers,
    optimizer state) alive before the step plus the peak of the CPU allocator's events during it
    (``torch.profiler``, ``profile_memory``: it sees the unsharded parameters FSDP2 brings back by resizing
    storages, which the dispatch-mode tracker does not)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from lowmembp.measurement.peak import allocator_events_peak

    for _ in range(warmup):
        step()

    def nbytes(tensors) -> int:
        seen, total = set(), 0
        for t in tensors:
            st = _local(t).untyped_storage()
            key = StorageWeakRef(st).cdata
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
        return total

    params = nbytes(list(model.parameters()) + list(model.buffers()))
    opt = 0
    if optimizer is not None:
        opt = nbytes([v for s in optimizer.state.values() for v in s.values() if hasattr(v, "untyped_storage")
                      or hasattr(v, "_local_tensor")])
    peak = allocator_events_peak(step)
    total = params + opt + peak
    return {"bytes": total, "how": "cpu allocator events (torch.profiler profile_memory), this rank's FSDP2 shards",
            "by_category": {"parameters": params, "optimizer_state": opt, "step_allocations": peak}}


def peak_measure(ctx: Context, device):
    """The peak measurement of a rank's step: None (``lowmembp.measurement.peak.measure_step_peak``) but for FSDP2 on
    CPU."""
    if ctx.mode == "fsdp" and device.type == "cpu":
        return fsdp_cpu_peak
    return None


def _replay_tokentune_globally(model, ctx: Context) -> None:
    """A TokenTune model: draw each step's positions for the whole global batch and keep this rank's rows."""
    try:
        from lowmembp.methods.tokentune import tokentune_state

        state = tokentune_state(model)
    except ValueError:  # not a TokenTune model
        return
    if state.selector is not None:
        return  # the user's own selector stays

    def select(valid, k, decoder, generator):
        import torch
        import torch.distributed as dist

        from lowmembp.methods.tokentune import select_positions

        mine = valid.to(torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(ctx.world)]
        dist.all_gather(parts, mine)  # the ranks' batches have the same length: the global batch was padded once
        every = select_positions(torch.cat(parts).bool(), k, decoder=decoder, generator=generator)
        b = valid.shape[0]
        return every[ctx.rank * b:(ctx.rank + 1) * b]

    state.selector = select


def start(mode: str | None, device_kind: str) -> Context:
    """Join the process group (torchrun's environment) for ``mode``; the one-process context when ``mode`` is None.
    ``device_kind``: ``"cuda"`` (NCCL, one GPU per local rank) or ``"cpu"`` (gloo)."""
    if mode is None:
        return Context()
    import torch
    import torch.distributed as dist

    world, rank, local = env_world()
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=TIMEOUT_MIN))
    return Context(mode=mode, world=world, rank=rank, local_rank=local, backend=backend)


def stop(ctx: Context) -> None:
    if ctx.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def section(ctx: Context, batch_size: int, peak_bytes: float | None, how: str) -> dict | None:
    """The record's ``distributed`` section (every rank calls it: the peaks are gathered)."""
    if not ctx.active:
        return None
    peaks = ctx.gather(-1.0 if peak_bytes is None else float(peak_bytes))
    known = [int(p) for p in peaks if p >= 0]
    return {"mode": ctx.mode, "world_size": ctx.world, "backend": ctx.backend,
            "batch_per_rank": batch_size // ctx.world,
            "peak_bytes_max": max(known) if len(known) == len(peaks) else None,
            "peak_bytes_mean": sum(known) / len(known) if len(known) == len(peaks) else None,
            "peak_bytes_by_rank": known if len(known) == len(peaks) else [], "peak_how": how}
