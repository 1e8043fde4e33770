"""A whole training step taken out of the host's hands: captured once in a CUDA graph and replayed, or compiled with
``torch.compile(mode="reduce-overhead")``.

    def train_step(batch):    # forward, backward, a capturable optimizer's step (AdamW(fused=True)); returns the loss
        loss = loss_fn(model(batch["x"]), batch["y"]); loss.backward(); optimizer.step()
        return loss.detach()

    step = CapturedStep(train_step, mode="cuda-graphs", zero_grad=lambda: optimizer.zero_grad(set_to_none=True))
    loss = step(batch)    # the first call warms up and captures; later ones copy ``batch`` in and replay the graph

For small, fast steps the host's Python (module calls, op dispatch, kernel launches) takes as long as the device's
work; a replay launches the whole step at once. CUDA only; the step must be capturable (static shapes, no host
synchronisation inside), and every call returns the same loss tensor, overwritten by the next. The recipe and what
a step must be, in full: docs/performance/host-time.md#taking-the-host-out-captured-steps.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

__all__ = ["CAPTURE_MODES", "check_capture", "StaticInputs", "CapturedStep"]

CAPTURE_MODES = ("none", "cuda-graphs", "reduce-overhead")


def check_capture(mode: str, device: torch.device | str) -> None:
    """ValueError saying what is valid when ``mode`` is not one of :data:`CAPTURE_MODES`, or when it captures and
    ``device`` is not a CUDA device."""
    if mode not in CAPTURE_MODES:
        raise ValueError(f"capture mode {mode!r}: choose one of {', '.join(CAPTURE_MODES)}")
    if mode != "none" and torch.device(device).type != "cuda":
        raise ValueError(f"capture mode {mode!r} needs a CUDA device (CUDA graphs replay on a GPU), got "
                         f"{torch.device(device)}; use 'none' on a CPU")


class StaticInputs:
    """Fixed input buffers of a captured step: a clone of ``example`` (a dict of tensors) that every call refills in
    place (:meth:`fill`), so the graph always reads the same addresses."""

    def __init__(self, example: Mapping[str, torch.Tensor]):
        self.tensors = {k: v.detach().clone() for k, v in example.items()}

    def fill(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``batch`` into the buffers (non-blocking); ValueError naming the key when the keys, a shape or a
        dtype differ from the example's: a captured step has static shapes."""
        if set(batch) != set(self.tensors):
            raise ValueError(f"captured step: the batch has keys {sorted(batch)}, the captured one "
                             f"{sorted(self.tensors)}")
        for k, v in batch.items():
            buf = self.tensors[k]
            if tuple(v.shape) != tuple(buf.shape) or v.dtype != buf.dtype:
                raise ValueError(f"captured step: batch[{k!r}] is {tuple(v.shape)} {v.dtype}, the captured one "
                                 f"{tuple(buf.shape)} {buf.dtype}: a captured step has static shapes (drop the last "
                                 "partial batch, pad to a fixed length)")
            buf.copy_(v, non_blocking=True)
        return self.tensors


class _CudaGraphs:
    """The torch.cuda calls of a capture, in one place (the tests pass a CPU stand-in with the same methods)."""

    @staticmethod
    def warm_up(fn: Callable[[], object], n: int, zero_grad: Callable[[], None]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(n):
                zero_grad()
                fn()
        torch.cuda.current_stream().wait_stream(side)

    @staticmethod
    def capture(fn: Callable[[], torch.Tensor]):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out


class CapturedStep:
    """``step(batch) -> loss``: ``fn(batch) -> loss tensor`` (forward, backward, optimizer step) run as ``mode``
    (docs/performance/host-time.md#taking-the-host-out-captured-steps). ``zero_grad`` sets the gradients to None
    (before each warm-up step and before the capture; never between replays). The first call warms up and captures on
    ``batch`` (``warmup`` extra steps on it), then replays; ``captures`` counts the captures (1 after the first
    call)."""

    def __init__(self, fn: Callable[[dict], torch.Tensor], *, mode: str = "cuda-graphs", warmup: int = 3,
                 zero_grad: Callable[[], None] = lambda: None, graphs=None):
        if mode not in CAPTURE_MODES:
            check_capture(mode, "cuda")  # the error message
        if warmup < 1 and mode == "cuda-graphs":
            raise ValueError("CapturedStep: cuda-graphs needs at least one warm-up step (the lazy state: optimizer "
                             "moments, the autograd engine's streams, cuBLAS workspaces)")
        self.fn, self.mode, self.warmup, self.zero_grad = fn, mode, warmup, zero_grad
        self.graphs = graphs or _CudaGraphs()
        self.static: StaticInputs | None = None
        self.graph = self.out = None
        self.captures = 0
        self._compiled = None

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.mode == "none":
            return self.fn(dict(batch))
        if self.mode == "reduce-overhead":
            if self._compiled is None:
                self._compiled = torch.compile(self.fn, mode="reduce-overhead")
                self.captures += 1
            torch.compiler.cudagraph_mark_step_begin()
            return self._compiled(dict(batch))
        if self.graph is None:
            self.static = StaticInputs(batch)
            inputs = self.static.tensors
            self.graphs.warm_up(lambda: self.fn(inputs), self.warmup, self.zero_grad)
            self.zero_grad()  # the captured backward allocates the gradients in the graph's pool
            self.graph, self.out = self.graphs.capture(lambda: self.fn(inputs))
            self.captures += 1
        self.static.fill(batch)
        self.graph.replay()
        return self.out
