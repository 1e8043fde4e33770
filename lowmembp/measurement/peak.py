"""Peak memory of one whole training step (forward, backward, optimizer step), by category.

    peak = measure_step_peak(model, optimizer, step)   # step() runs forward + backward + optimizer.step + zero_grad
    peak -> {"bytes": int, "how": str, "by_category": {"parameters", "gradients", "optimizer_state",
             "activations", "temporaries", "other"}}

On CUDA the allocator's ``max_memory_allocated`` over the step; for a compiled model on the CPU the allocator's own
events (:func:`profiler_peak`); otherwise, on the CPU and on fake tensors, :class:`StorageTracker`: a dispatch mode
that follows every tensor storage until it dies and keeps the running total, its peak and the split by category at
the peak, in exact storage bytes (the CPU allocator's event log agrees with it to the byte). Host memory that
``offload`` reports is taken out of the device total and returned as ``"host"``. One untracked warm-up step runs
first, so that the measured step is a steady one. What each category holds, and what the tracker cannot see:
docs/measuring.md; why not torch's ``MemTracker``: docs/design.md#fake-tensors.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from lowmembp._compat import TorchDispatchMode, current_graph_task_id, storage_key, tree_flatten
from lowmembp.methods.offload import HOST_LISTENERS

__all__ = ["StorageTracker", "measure_step_peak", "prime_optimizer", "profiler_peak", "CATEGORIES", "PHASES",
           "DEVICE_QUERY", "HOST"]

# answers a tensor's device (most ops on fake tensors: autograd and autocast asking): no storage, no FLOPs, so the
# trackers pass it straight through (here, lowmembp.estimator.fake_mode and lowmembp.plan.steps)
DEVICE_QUERY = torch.ops.prim.device.default

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
# the phases of a step a peak can fall in (StorageTracker.peak_phase): the forward through the blocks, the head and
# the loss after the last block, the backward (recomputation included), the optimizer's step
PHASES = ("forward", "loss", "backward", "optimizer")
HOST = "host"  # not a category: host storages are kept out of the device total


class StorageTracker(TorchDispatchMode):
    """Live tensor storages, their running total and its peak, by category (docs/measuring.md)."""

    def __init__(self):
        super().__init__()
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = 0
        self.peak_by_category = dict.fromkeys(CATEGORIES, 0)
        self._live: dict[int, list] = {}   # storage key -> [nbytes, category, weakref]
        self._in_opt = False
        self._handles: list = []
        self.host = 0             # live host bytes (see to_host), their peak, and their value at the device peak
        self.host_peak = 0
        self.host_at_peak = 0
        self._fwd_phase = "forward"  # "loss" once the last block's forward returned (watch_phases)
        self.peak_phase = None       # the phase the peak fell in (PHASES), after watch_phases
        self.saved = 0               # live bytes of storages autograd saved for backward (saved_hooks), at the peak
        self.peak_saved = 0
        self._saved_keys: set[int] = set()

    # -- registration ---------------------------------------------------------------------------------------
    def track(self, t: torch.Tensor, category: str) -> None:
        """Count ``t``'s storage under ``category`` (re-tag it if already counted)."""
        st = _storage(t) if isinstance(t, torch.Tensor) else None
        if st is not None:
            self.count_storage(st, storage_key(st), category)

    def count_storage(self, st, key: int, category: str) -> None:
        """Count storage ``st`` (``key``: its address, what ``StorageWeakRef(st).cdata`` is) under ``category``."""
        entry = self._live.get(key)
        if entry is not None:
            if entry[1] != category and HOST not in (entry[1], category):
                self.current[entry[1]] -= entry[0]
                self.current[category] += entry[0]
                entry[1] = category
            return
        nbytes = int(st.nbytes())
        ref = weakref.ref(st, lambda _r, key=key: self.free_storage(key))
        self._live[key] = [nbytes, category, ref]
        if category == HOST:
            self._add_host(nbytes)
            return
        self.current[category] += nbytes
        self.total += nbytes
        if self.total > self.peak:
            self.peak = self.total
            self.peak_by_category = dict(self.current)
            self.host_at_peak = self.host
            self.peak_saved = self.saved
            self.peak_phase = self.phase()

    def phase(self) -> str:
        """The phase of the step running now (:data:`PHASES`; "forward" and "loss" apart only after
        :meth:`watch_phases`)."""
        if self._in_opt:
            return "optimizer"
        if current_graph_task_id() != -1:
            return "backward"
        return self._fwd_phase

    def watch_phases(self, model: nn.Module, last_block: nn.Module | None = None) -> None:
        """Tell the forward from the loss: "forward" from the start of ``model``'s forward, "loss" once
        ``last_block``'s forward has returned (the head and the loss; hooks removed on exit)."""
        def start(*_):
            self._fwd_phase = "forward"

        def end(*_):
            self._fwd_phase = "loss"

        self._handles.append(model.register_forward_pre_hook(start))
        if last_block is not None:
            self._handles.append(last_block.register_forward_hook(end))

    def saved_hooks(self):
        """``saved_tensors_hooks`` marking what autograd saves for backward (enter around the forward): those
        storages (made in the forward, or the batch) are counted in :attr:`saved` while alive (still under their
        category). An outer pair of hooks in force (an accountant's) still runs: these call it."""
        from lowmembp._compat import top_saved_tensors_hooks

        outer = top_saved_tensors_hooks()

        def pack(t):
            self.mark_saved(t)
            return outer[0](t) if outer is not None else t

        def unpack(x):
            return outer[1](x) if outer is not None else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def mark_saved(self, t) -> None:
        """Count ``t``'s storage as saved for backward (see :meth:`saved_hooks`)."""
        self.mark_saved_storage(self.key_of(t) if isinstance(t, torch.Tensor) else None)

    def mark_saved_storage(self, key: int | None) -> None:
        """:meth:`mark_saved` of the storage counted under ``key``: only one made in the forward, or the batch."""
        entry = self._live.get(key) if key is not None else None
        if entry is not None and key not in self._saved_keys and entry[1] in ("activations", "other"):
            self._saved_keys.add(key)
            self.saved += entry[0]

    def to_host(self, t: torch.Tensor) -> None:
        """Move ``t``'s storage out of the device total into the host bytes (counted from now until it dies)."""
        key = self.key_of(t)
        if key is None:
            return
        if key not in self._live:
            self.track(t, HOST)
        else:
            self.move_to_host(key)

    def move_to_host(self, key: int) -> None:
        """:meth:`to_host` of the storage counted under ``key`` (nothing if none is, or it is already host)."""
        entry = self._live.get(key)
        if entry is not None and entry[1] != HOST:
            self.current[entry[1]] -= entry[0]
            self.total -= entry[0]
            entry[1] = HOST
            self._add_host(entry[0])

    def _add_host(self, nbytes: int) -> None:
        self.host += nbytes
        self.host_peak = max(self.host_peak, self.host)

    def track_external(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                       *tensors: torch.Tensor) -> None:
        """Register what exists before the step: parameters, buffers, gradients, optimizer state, the batch."""
        if model is not None:
            for p in model.parameters():
                self.track(p, "parameters")
                if p.grad is not None:
                    self.track(p.grad, "gradients")
            for b in model.buffers():
                self.track(b, "parameters")
        if optimizer is not None:
            self.track_optimizer_state(optimizer)
        for t in tensors:
            self.track(t, "other")

    def watch(self, model: nn.Module) -> None:
        """Tag each trainable parameter's ``.grad`` as a gradient once accumulated (removed on exit)."""
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda p: self.track(p.grad, "gradients") if p.grad is not None else None))

    def category_of(self, key: int) -> str | None:
        """The category of the storage counted under ``key`` ("host" for host memory), or None if none is."""
        entry = self._live.get(key)
        return None if entry is None else entry[1]

    @contextlib.contextmanager
    def in_optimizer_step(self):
        """Count what is made inside this block as an optimizer step's (temporaries), as the step hooks do."""
        self._in_opt = True
        try:
            yield
        finally:
            self._in_opt = False

    def track_optimizer_state(self, optimizer) -> None:
        """Count ``optimizer``'s state tensors as optimizer state."""
        for state in optimizer.state.values():
            for v in state.values():
                for t in _state_tensors(v):
                    self.track(t, "optimizer_state")

    def free_storage(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if key in self._saved_keys:
            self._saved_keys.discard(key)
            self.saved -= entry[0] if entry is not None else 0
        if entry is not None and entry[1] == HOST:
            self.host -= entry[0]
        elif entry is not None:
            self.current[entry[1]] -= entry[0]
            self.total -= entry[0]

    # -- mode -----------------------------------------------------------------------------------------------
    def __enter__(self):
        self._start()
        return super().__enter__()

    def __exit__(self, *exc):
        self._stop()
        return super().__exit__(*exc)

    def _start(self) -> None:
        """Everything but the dispatch mode itself: the optimizer hooks, and the offloading's host storages reaching
        :meth:`to_host` (:data:`lowmembp.methods.offload.HOST_LISTENERS`)."""
        def pre(opt, args, kwargs):
            self._in_opt = True
            for group in opt.param_groups:  # what the optimizer steps is a gradient (also one stepped, and freed,
                for p in group["params"]:   # inside the backward: lowmembp.methods.optimizers)
                    if p.grad is not None:
                        self.track(p.grad, "gradients")

        def post(opt, args, kwargs):
            self._in_opt = False
            self.track_optimizer_state(opt)

        self._handles += [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        HOST_LISTENERS.append(self.to_host)

    def _stop(self) -> None:
        if self.to_host in HOST_LISTENERS:
            HOST_LISTENERS.remove(self.to_host)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is DEVICE_QUERY:
            return out
        self._note(out)
        return out

    def _note(self, out) -> None:
        """Track the storages of an op's outputs that are not tracked yet (activations, or temporaries)."""
        if self._in_opt:
            cat = "temporaries"
        elif current_graph_task_id() != -1:
            cat = "temporaries"
        else:
            cat = "activations"
        if isinstance(out, torch.Tensor):
            outs = (out,)
        elif type(out) in (tuple, list) and not any(type(o) in (tuple, list, dict) for o in out):
            outs = out
        else:
            outs = tree_flatten(out)[0]
        for t in outs:
            st = _storage(t) if isinstance(t, torch.Tensor) else None
            if st is not None and storage_key(st) not in self._live:
                self.count_storage(st, storage_key(st), cat)

    @staticmethod
    def key_of(t):
        """The address of ``t``'s storage (``StorageWeakRef(storage).cdata``), or None where it has none."""
        st = _storage(t)
        return None if st is None else storage_key(st)


def _storage(t: torch.Tensor):
    """``t``'s untyped storage, or None for a tensor that has none to count: torch raises ``NotImplementedError``
    ("Cannot access storage of ...") for sparse and MKL-DNN tensors and functorch's batched / grad wrappers. Any
    other exception is a real failure and propagates."""
    try:
        return t.untyped_storage()
    except NotImplementedError:
        return None


def measure_step_peak(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: Callable[[], object], *,
                      warmup: int = 1, external: tuple = ()) -> dict:
    """Peak memory of ``step()`` (one training step) after ``warmup`` untracked steps (docs/measuring.md).

    ``external``: other tensors alive during the step that should count (the input batch, made outside
    ``step``). Returns the record's ``peak_memory`` object.
    """
    for _ in range(warmup):
        step()
    device = _device_of(model)
    fake = any(type(p).__name__ == "FakeTensor" for p in model.parameters())
    ledger = getattr(model, "_lowmembp_host_ledger", None)
    if device.type == "cuda" and not fake:
        if ledger is not None:
            ledger.reset_peak()
        out = _cuda_peak(model, optimizer, step, device)
        if ledger is not None:
            out["host"] = {"bytes": int(ledger.peak), "by_category": {"activations": int(ledger.peak)},
                           "at_device_peak": None,
                           "how": "offload ledger: live pinned host copies"}
        return out
    if not fake and _is_compiled(model):
        return _compiled_cpu_peak(model, optimizer, step, external)
    if not fake and _opaque_step(optimizer):
        out = _compiled_cpu_peak(model, optimizer, step, external)
        out["how"] = ("cpu allocator events (torch.profiler profile_memory): the optimizer's CPU step allocates "
                      "inside one op or a compiled kernel, unseen by the storage tracker")
        return out
    tracker = StorageTracker()
    tracker.track_external(model, optimizer, *external)
    tracker.watch(model)
    with tracker:
        step()
    how = "fake-tensor storage tracker (exact bytes)" if fake else "cpu storage tracker (exact bytes)"
    out = {"bytes": int(tracker.peak), "how": how, "by_category": {k: int(v) for k, v in
                                                                    tracker.peak_by_category.items()}}
    if ledger is not None or tracker.host_peak:
        out["host"] = {"bytes": int(tracker.host_peak), "by_category": {"activations": int(tracker.host_peak)},
                       "at_device_peak": int(tracker.host_at_peak),
                       "how": "storages the offload method keeps in host memory" + (
                           " (on the CPU they stay where they are: counted as host, not device)" if not fake else "")}
    return out


def _state_tensors(v) -> list[torch.Tensor]:
    """The tensors of one optimizer-state entry: itself (a tensor subclass: the tensors it is made of), or those an
    object in the state holds as attributes (GaLore's and APOLLO's projector keeps its projection matrix as
    ``ortho_matrix``: a tensor or a list of tensors)."""
    if isinstance(v, torch.Tensor):
        if type(v) is not torch.Tensor and hasattr(v, "__tensor_flatten__"):  # a tensor subclass (torchao's
            names, _ = v.__tensor_flatten__()                               # low-bit states): its own tensors
            return [t for n in names for t in _state_tensors(getattr(v, n))]
        return [v]
    if isinstance(v, (int, float, str, bool)) or v is None or not hasattr(v, "__dict__"):
        return []
    out = []
    for a in vars(v).values():
        out += [a] if isinstance(a, torch.Tensor) else [t for t in a if isinstance(t, torch.Tensor)] \
            if isinstance(a, (list, tuple)) else []
    return out


def prime_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """Create the optimizer's state without a training step: one step on zero gradients, then drop them.

    Makes the next step a steady one (state allocated before the forward) at the cost of one optimizer step
    instead of a whole warm-up step. AdamW with zero gradients still decays the weights; only use it to measure.
    """
    if optimizer is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _opaque_step(optimizer) -> bool:
    """Whether ``optimizer``'s step runs a kernel whose own allocations a dispatch mode cannot see (bitsandbytes'
    8-bit update: on the CPU it dequantises each parameter's two states to fp32 inside one op), or cannot run under
    one (torchao's low-bit optimizers: a ``torch.compile``'d step, which refuses a dispatch mode)."""
    return optimizer is not None and type(optimizer).__module__.startswith(("bitsandbytes", "torchao"))


def _gradient_bytes(model: nn.Module, optimizer) -> int:
    """The gradients' share of an allocator peak: one per trainable parameter, or, when the optimizer steps each
    parameter inside the backward and frees its gradient, the largest one (those in flight)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    from lowmembp.methods.optimizers import frees_gradients

    if frees_gradients(optimizer):
        return max((_nbytes([p]) for p in trainable), default=0)
    return _nbytes(trainable)


def _is_compiled(model: nn.Module) -> bool:
    from lowmembp.methods.cce import compiles_loss
    from lowmembp.methods.compile import is_compiled
    return is_compiled(model) or compiles_loss(model)  # cce's torch_compile loss (the CPU's): a compiled step too


def _compiled_cpu_peak(model, optimizer, step, external) -> dict:
    """A compiled step on CPU: the CPU allocator's own events. (The dispatch-mode tracker would measure eager ops:
    under a dispatch mode Dynamo runs the original Python code, not the compiled graphs.)"""
    base, peak = _profiled_peak(model, optimizer, step, external)
    total = base + peak
    params = _nbytes(list(model.parameters()) + list(model.buffers()))
    grads = _gradient_bytes(model, optimizer)
    opt = 0
    if optimizer is not None:
        opt = _nbytes([t for s in optimizer.state.values() for v in s.values() for t in _state_tensors(v)])
    return {"bytes": total, "how": "cpu allocator events (torch.profiler profile_memory; compiled step)",
            "by_category": {"parameters": params, "gradients": grads, "optimizer_state": opt,
                            "activations_and_temporaries": max(total - params - grads - opt, 0)}}


def _cuda_peak(model, optimizer, step, device) -> dict:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = int(torch.cuda.max_memory_allocated(device))
    params = _nbytes(list(model.parameters()) + list(model.buffers()))
    grads = _gradient_bytes(model, optimizer)
    opt = 0
    if optimizer is not None:
        opt = _nbytes([t for s in optimizer.state.values() for v in s.values() for t in _state_tensors(v)])
    rest = max(peak - params - grads - opt, 0)
    how = "cuda max_memory_allocated" + ("; compiled step" if _is_compiled(model) else "")
    return {"bytes": peak, "how": how, "reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "by_category": {"parameters": params, "gradients": grads, "optimizer_state": opt,
                            "activations_and_temporaries": rest},
            "device_resident": _driver_resident(peak, device)}


def _driver_resident(peak: int, device) -> dict:
    """What the device holds beyond PyTorch's caching allocator at the end of the step, from the driver's
    free-memory figure (``torch.cuda.mem_get_info``): ``outside`` = used − reserved (the CUDA context, library
    workspaces, and memory allocated outside the allocator: bitsandbytes' paged optimizer states in CUDA unified
    memory, resident unless the driver has paged them out); ``bytes`` = the allocator's peak plus that."""
    free, total = torch.cuda.mem_get_info(device)
    outside = int(total - free - torch.cuda.memory_reserved(device))
    return {"bytes": peak + max(outside, 0), "outside_allocator": outside,
            "how": "max_memory_allocated + (total - free - memory_reserved) after the step (torch.cuda.mem_get_info)"}


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        key = StorageWeakRef(st).cdata
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def profiler_peak(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: Callable[[], object], *,
                  warmup: int = 1, external: tuple = ()) -> int:
    """Peak bytes of ``step()`` on CPU from the allocator's own events (``torch.profiler``, ``profile_memory``).

    Independent of the dispatch-mode tracker (it sees every allocation of the CPU allocator, in time order), slower,
    real tensors only: the tests check the tracker and the fake-tensor estimate against it.
    """
    for _ in range(warmup):
        step()
    base, peak = _profiled_peak(model, optimizer, step, external)
    return base + peak


def _profiled_peak(model, optimizer, step, external) -> tuple[int, int]:
    """(bytes alive before ``step()``: parameters, buffers, optimizer state, ``external``; the peak of the CPU
    allocator's running total of allocations minus frees during ``step()``)."""
    live = list(model.parameters()) + list(model.buffers()) + [t for t in external if isinstance(t, torch.Tensor)]
    if optimizer is not None:
        live += [t for s in optimizer.state.values() for v in s.values() for t in _state_tensors(v)]
    return _nbytes(live), allocator_events_peak(step)


def allocator_events_peak(step: Callable[[], object]) -> int:
    """The peak of the CPU allocator's running total (allocations minus frees) during ``step()``, from
    ``torch.profiler``'s memory events: bytes above what was alive before the step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak
