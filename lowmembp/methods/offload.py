"""``offload``: activation offloading — saved tensors go to host memory in the forward, come back in the backward.

Exact (the same values come back); device memory falls and host memory rises by the same bytes, and both are
reported. torchtune's ``OffloadActivations`` and ``torch.autograd.graph.save_on_cpu`` are the references
(docs/design.md#peers). The forward of the module that runs the block loop runs under ``saved_tensors_hooks`` that
move every saved tensor of at least ``min_bytes`` (default 1024), parameters and buffers excepted, to the host: on
CUDA into pinned memory on a side stream, on fake tensors as a fake host copy, on the CPU not at all but counted as
host bytes, so every device shows the split a GPU run has. A :class:`HostLedger` on the model follows the host bytes;
:func:`lowmembp.measurement.peak.measure_step_peak` reports them as ``peak["host"]`` (its tracker joins
:data:`HOST_LISTENERS`). Where, what, the streams and how it composes with ``checkpointing`` and ``sac``:
docs/methods/offload.md.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from lowmembp._compat import top_saved_tensors_hooks
from lowmembp.methods.registry import register

# Who is told of each storage the method keeps in host memory (``listener(tensor)``): a running peak tracker of
# lowmembp.measurement.peak adds itself, so that it counts those bytes as host memory. (The measurement room sits
# above the methods: it listens here; the method never imports it.)
HOST_LISTENERS: list = []


def _note_host(t: torch.Tensor) -> None:
    for listener in tuple(HOST_LISTENERS):
        listener(t)


@register("offload", "saved activations to host memory (pinned, side stream on CUDA; accounted on CPU; option "
                     "min_bytes)", options={"min_bytes": 1024}, order=55, excludes=("tokentune",))
def apply_offload(model: nn.Module, min_bytes: int = 1024) -> nn.Module:
    from lowmembp.models import get_layout

    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"offload: min_bytes must be a non-negative integer (bytes), got {min_bytes!r}")
    layout = get_layout(model)
    if not layout.blocks:
        raise ValueError(f"offload: no transformer blocks found in {type(layout.base).__name__}")
    trunk = block_loop_owner(layout)
    if getattr(trunk, "_lowmembp_offload", None) is not None:
        raise RuntimeError("offload: this model is already offloading")
    ledger = HostLedger()
    offloader = Offloader(model, min_bytes, ledger)
    object.__setattr__(trunk, "_lowmembp_offload", offloader)
    trunk.forward = _OffloadedForward(trunk, offloader, trunk.__dict__.get("forward"))
    for s in layout.head:
        head = s.get()
        if any(m is head for m in trunk.modules()):
            head.forward = _NoOffloadForward(head, head.__dict__.get("forward"))
    object.__setattr__(model, "_lowmembp_host_ledger", ledger)
    return model


def block_loop_owner(layout) -> nn.Module:
    """The module whose forward runs the blocks: the parent of the module holding ``layout.blocks``."""
    container = layout.blocks[0].owner
    for m in layout.base.modules():
        if any(child is container for child in m.children()):
            return m
    return container


class HostLedger:
    """Live host bytes of offloaded storages and their peak: a storage counts once, from its first offload until
    autograd lets go of the last saved tensor that holds it (on a GPU that is when its pinned copy is freed)."""

    def __init__(self):
        self.current = 0
        self.peak = 0
        self._holds: dict[int, list] = {}  # storage key -> [bytes, number of saved tensors holding it]

    def add(self, t: torch.Tensor, held) -> None:
        st = t.untyped_storage()
        key = StorageWeakRef(st).cdata
        entry = self._holds.get(key)
        if entry is None:
            entry = self._holds[key] = [int(st.nbytes()), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(held, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._holds.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._holds[key]
            self.current -= entry[0]

    def reset_peak(self) -> None:
        self.peak = self.current


class _Held:
    """What autograd keeps for one offloaded tensor: the host tensor and where it must go back to."""
    __slots__ = ("host", "device", "moved", "__weakref__")

    def __init__(self, host, device, moved):
        self.host, self.device, self.moved = host, device, moved


class Offloader:
    """The pack / unpack pair (chained with the hooks active around it) for one model."""

    def __init__(self, model: nn.Module, min_bytes: int, ledger: HostLedger):
        self.model_ref = weakref.ref(model)
        self.min_bytes = min_bytes
        self.ledger = ledger
        self._stream = None
        self._outer = None
        self._skip: set[int] = set()
        self._copies: dict = {}

    # -- one forward ------------------------------------------------------------------------------------------------
    def hooks(self):
        """Enter at the start of the offloaded forward: remember the outer hooks and the parameters' storages."""
        self._outer = top_saved_tensors_hooks()
        model = self.model_ref()
        self._skip = set()
        if model is not None:
            for t in list(model.parameters()) + list(model.buffers()):
                try:
                    self._skip.add(StorageWeakRef(t.untyped_storage()).cdata)
                except NotImplementedError:  # "Cannot access storage of ...": a tensor with none, nothing to skip
                    pass
        self._copies = {}
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def done(self) -> None:
        self._copies = {}

    def pack(self, t):
        if self._outer is not None:
            t = self._outer[0](t)
        if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter) or t.layout != torch.strided:
            return t
        if t.numel() * t.element_size() < self.min_bytes:
            return t
        try:
            key = StorageWeakRef(t.untyped_storage()).cdata
        except NotImplementedError:  # a strided tensor without storage (functorch's wrappers): kept as it is
            return t
        if key in self._skip:
            return t
        view = (key, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        entry = self._copies.get(view)
        held = entry[1]() if entry is not None and not entry[0].expired() else None
        if held is None:
            held = self._offload(t)
            # The storage's weak reference keeps its address from being reused while the entry lives: without it a
            # new tensor the allocator puts where a freed, offloaded one was (same shape: the next block's) would
            # find the old copy here and be restored with the old values in the backward.
            self._copies[view] = (StorageWeakRef(t.untyped_storage()), weakref.ref(held))
        return held

    def unpack(self, p):
        if isinstance(p, _Held):
            p = self._restore(p)
        if self._outer is not None:
            p = self._outer[1](p)
        return p

    # -- moving -----------------------------------------------------------------------------------------------------
    def _offload(self, t: torch.Tensor) -> _Held:
        fake = type(t).__name__ == "FakeTensor"
        if t.device.type == "cpu" and not fake:
            _note_host(t)                # already host memory: nothing moves; it is accounted as host bytes
            # an alias without grad_fn: holding t itself would tie the graph to itself (a cycle autograd never frees)
            held = _Held(t.detach(), t.device, False)
            self.ledger.add(t, held)
            return held
        if t.is_cuda and not fake:
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host = _empty_like(t, "cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)
        else:  # fake tensors (estimates) and other devices: a plain copy to the host
            host = _empty_like(t, "cpu")
            host.copy_(t)
        _note_host(host)
        held = _Held(host, t.device, True)
        self.ledger.add(host, held)
        return held

    def _restore(self, held: _Held) -> torch.Tensor:
        if not held.moved:
            return held.host
        if held.device.type == "cuda" and type(held.host).__name__ != "FakeTensor":
            stream = self._side_stream(held.device)
            with torch.cuda.stream(stream):
                dev = _empty_like(held.host, held.device)
                dev.copy_(held.host, non_blocking=True)
            main = torch.cuda.current_stream(held.device)
            main.wait_stream(stream)
            dev.record_stream(main)
            return dev
        dev = _empty_like(held.host, held.device)
        return dev.copy_(held.host)

    def _side_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream


def _empty_like(t: torch.Tensor, device, pin_memory: bool = False) -> torch.Tensor:
    """An empty tensor like ``t`` on ``device`` with ``t``'s strides where they are dense (a transposed saved tensor
    comes back transposed: SAC's recomputation, for one, must see the same layout, or its ops differ)."""
    if _dense(t):
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device, pin_memory=pin_memory)
    return torch.empty(t.size(), dtype=t.dtype, device=device, pin_memory=pin_memory)


def _dense(t: torch.Tensor) -> bool:
    """Do ``t``'s elements fill its memory span exactly (any dim order, no gaps, no overlap)?"""
    expected = 1
    for i in sorted(range(t.dim()), key=t.stride):
        if t.size(i) == 1:
            continue
        if t.stride(i) != expected:
            return False
        expected *= t.size(i)
    return True


class _OffloadedForward:
    """Instance-level forward of the block-loop module under the offload hooks (picklable)."""

    def __init__(self, module: nn.Module, offloader: Offloader, inner):
        self.module, self.offloader, self.inner = module, offloader, inner

    def __call__(self, *args, **kwargs):
        fn = self.inner or functools.partial(type(self.module).forward, self.module)
        if not (self.module.training and torch.is_grad_enabled()):
            return fn(*args, **kwargs)
        try:
            with self.offloader.hooks():
                return fn(*args, **kwargs)
        finally:
            self.offloader.done()


def _keep(t):
    return t


class _NoOffloadForward:
    """Instance-level forward of a head linear: its saved tensors stay where they are (no-op hooks)."""

    def __init__(self, module: nn.Module, inner):
        self.module, self.inner = module, inner

    def __call__(self, *args, **kwargs):
        fn = self.inner or functools.partial(type(self.module).forward, self.module)
        outer = top_saved_tensors_hooks()
        if not torch.is_grad_enabled() or outer is None or not isinstance(getattr(outer[0], "__self__", None),
                                                                          Offloader):
            return fn(*args, **kwargs)
        off = outer[0].__self__
        pack = off._outer[0] if off._outer is not None else _keep
        unpack = off._outer[1] if off._outer is not None else _keep
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(*args, **kwargs)
