"""What the two-process tests run in each spawned process (importable by ``torch.multiprocessing.spawn``): the
training job under torchrun's environment, Mesa gradients under DDP, one FSDP2 step's per-rank peak."""
from __future__ import annotations

import json
import os
from pathlib import Path


def torchrun_env(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives a worker."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


def run_jobs(rank: int, world: int, jobs: list) -> None:
    """``jobs``: (name, port, arguments) in order; every process runs every job (each joins its own group)."""
    import torch

    torch.set_num_threads(1)
    for name, port, args in jobs:
        torchrun_env(rank, world, port)
        JOBS[name](rank, world, *args)


def train_job(rank: int, world: int, argv: list[str]) -> None:
    from experiments import train

    rc = train.main(argv)
    if rc != 0:
        raise SystemExit(f"rank {rank}: the training job exited {rc}")


def mesa_batches(steps: int = 3, batch: int = 8):
    import torch

    g = torch.Generator().manual_seed(7)
    scale = torch.ones(batch, 1, 1, 1)
    scale[batch // 2:] = 4.0  # the second rank's rows have a wider range: its own EMA would differ from the batch's
    return [(torch.randn(batch, 1, 28, 28, generator=g) * scale, torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def mesa_gradients(model, batches, rows=slice(None)):
    """Forward/backward on each batch (the EMA ranges move at λ = 0.9 each time); the last one's gradients."""
    import torch.nn.functional as F

    for x, y in batches:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[rows]), y[rows]).backward()
    return {n.removeprefix("module."): p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def mesa_model():
    import torch

    import lowmembp
    from experiments.tasks.mnist5k import vit_mnist

    torch.manual_seed(3)
    return lowmembp.apply(vit_mnist(), "mesa", mesa_momentum=0.9).train()


def mesa_job(rank: int, world: int, out: str, reduce: bool) -> None:
    """Mesa under DDP on rank's rows of each global batch; rank 0 saves the gradients and EMA ranges."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lowmembp.ops.mesa_quant as mq

    dist.init_process_group("gloo")
    try:
        if not reduce:  # what the code did before: each rank's own statistics
            mq.reduce_over_ranks = lambda mn, mx: (mn, mx)
        model = mesa_model()
        ddp = DistributedDataParallel(model)
        per = 8 // world
        grads = mesa_gradients(ddp, mesa_batches(), slice(rank * per, (rank + 1) * per))
        alphas = {n: b.clone() for n, b in model.named_buffers() if n.endswith("alpha")}
        if rank == 0:
            torch.save({"grads": grads, "alphas": alphas}, out)
    finally:
        dist.destroy_process_group()


def fsdp_peak_job(rank: int, world: int, out: str, method: str, batch: int) -> None:
    """One steady FSDP2 step of :data:`tests.test_estimate_fsdp.SPEC` on rank's rows; every rank writes its peak."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    import lowmembp
    from experiments.distributed import fsdp_cpu_peak
    from lowmembp.estimator.step import block_names, build
    from estimator.test_estimate_fsdp import SPEC

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = build(SPEC, device="cpu")
        blocks = [model.get_submodule(n) for n in block_names(model)]
        if method != "baseline":
            model = lowmembp.apply(model, method)
        for b in blocks:
            fully_shard(b)
        fully_shard(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)  # as estimate() steps
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(batch, 3, 32, 32, generator=g)
        y = torch.randint(0, SPEC.num_classes, (batch,), generator=g)

        def step():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # optimizer state exists: a steady step, as estimate() measures
        peak = fsdp_cpu_peak(model, opt, step)
        Path(f"{out}.{rank}").write_text(json.dumps(peak))
    finally:
        dist.destroy_process_group()


JOBS = {"train": train_job, "mesa": mesa_job, "fsdp_peak": fsdp_peak_job}


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def spawn(jobs: list, world: int = 2) -> None:
    """Run ``jobs`` [(name, args)] in ``world`` fresh processes (spawned), each job in its own process group."""
    import torch.multiprocessing as mp

    ports = free_ports(len(jobs))
    mp.spawn(run_jobs, args=(world, [(name, port, args) for (name, args), port in zip(jobs, ports)]),
             nprocs=world, join=True)
