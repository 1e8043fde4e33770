"""Mesa-style 8-bit activation compression (Pan et al., 2021): per-group int8 with EMA ranges, stochastic rounding.

Saved for backward: the uint8 codes, 1 byte per element, plus two fp32 scalars per group (the step α/255 and the
minimum β); the backward dequantises (``x̂ = q·(α/255) + β``) and runs the layer's exact backward on it. Rounding:
``q = clamp(floor((x − β)·(255/α) + u), 0, 255)`` with u a counter-based hash of (seed, element index), the same bits
on every backend; a CUDA graph's replay rounds anew (the seed is read from the device). Groups, the EMA ranges
(:class:`EMAQuantizer`), the hash and the seed: docs/design.md#mesa.

Routes: the custom ops ``lowmembp::mesa_quantize`` / ``lowmembp::mesa_dequantize`` for traced and fake calls; eager
calls go to the backend directly (:func:`lowmembp.ops.backend.eager_backend`): Triton on CUDA
(:mod:`~lowmembp.ops.mesa_quant_triton`), the CPU fast path (:mod:`~lowmembp.ops.mesa_quant_cpu`), the PyTorch
reference elsewhere (:mod:`~lowmembp.ops.mesa_quant_reference`). fp32, fp16 and bf16 inputs, computed in fp32.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from lowmembp.ops import cpu_kernels
from lowmembp.ops.backend import (
    SUPPORTED_FLOAT_DTYPES,
    backend_for,
    check_float_input,
    eager_backend,
    is_shape_only,
    stream_capturing,
)
from lowmembp.ops.mesa_quant_cpu import dequantize_cpu, quantize_cpu
from lowmembp.ops.mesa_quant_reference import (DEFAULT_CHUNK, chunk_size, dequantize_ref, get_chunk_size, hash_uniform,
                                               quantize_ref, set_chunk_size)
from lowmembp.ops.mesa_quant_triton import _dequantize_triton, _quantize_triton

__all__ = ["MOMENTUM", "QTensor", "EMAQuantizer", "quantize", "dequantize", "draw_seed_tensor", "group_layout",
           "channel_groups", "group_min_max", "reduce_over_ranks", "ema_update", "hash_uniform", "DEFAULT_CHUNK",
           "get_chunk_size", "set_chunk_size", "chunk_size", "quantize_ref", "dequantize_ref", "quantize_cpu",
           "dequantize_cpu"]

_WARN_EVERY_CUDA = 64  # a CUDA quantiser checks its skipped-update counter (a device sync) every this many calls

MOMENTUM = 0.9
_MIN_RANGE = 1e-12  # a constant group (α = 0) quantises to β exactly


# ----------------------------------------------------------------------------------------------------------- groups
def group_layout(x: torch.Tensor, mode: str, num_groups: int | None = None) -> tuple[int, int]:
    """``(inner, G)`` for ``x``: ``mode="head"`` for [B, H, N, D] (G = H) or ``"channel"`` (G groups of the last
    dim)."""
    if mode == "head":
        if x.dim() != 4:
            raise ValueError(f"per-head quantisation needs a [B, H, N, D] tensor, got shape {tuple(x.shape)}")
        return x[0, 0].numel(), x.shape[1]
    if mode == "channel":
        c = x.shape[-1]
        g = channel_groups(c, num_groups or 1)
        return c // g, g
    raise ValueError(f"group mode must be 'head' or 'channel', got {mode!r}")


def channel_groups(channels: int, wanted: int) -> int:
    """The number of channel groups actually used: ``gcd(channels, wanted)`` (groups must divide the channels)."""
    if wanted < 1:
        raise ValueError(f"the number of channel groups must be >= 1, got {wanted}")
    a, b = channels, int(wanted)  # Euclid by hand: math.gcd does not take the SymInt a compiled graph passes here
    while b:
        a, b = b, a % b
    return a


def group_min_max(x: torch.Tensor, inner: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group minimum and maximum of ``x`` (fp32, shape [G])."""
    x3 = x.detach().reshape(-1, groups, inner)
    return x3.amin(dim=(0, 2)).float(), x3.amax(dim=(0, 2)).float()


def reduce_over_ranks(mn: torch.Tensor, mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Data parallel (``torch.distributed`` initialised, more than one process): the minimum and maximum over every
    rank's batch (one all-reduce), so that every rank's EMA follows the statistics of the whole global batch, as one
    process with that batch would (DDP's broadcast of rank 0's buffers then changes nothing). Otherwise unchanged.
    Every rank must quantise the same sites in the same order, as data-parallel training does."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or is_shape_only(mn):
        return mn, mx
    both = torch.cat([-mn, mx])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return -both[:mn.numel()], both[mn.numel():]


def ema_update(alpha: torch.Tensor, beta: torch.Tensor, count: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor,
               momentum: float = MOMENTUM) -> torch.Tensor:
    """In place: the first call sets α = max − min, β = min; later ``α ← λα + (1−λ)(max−min)``, same for β.

    ``count`` (a 0-d int64 tensor) counts the updates. A batch whose statistics are not all finite (min, max and
    their difference, every group) leaves α, β and ``count`` unchanged. Returns that verdict as a 0-d bool tensor
    (True: updated); no host synchronisation happens (``torch.where``).
    """
    first = count == 0
    rng = mx - mn
    ok = torch.isfinite(rng).all() & torch.isfinite(mn).all()
    alpha.copy_(torch.where(ok, torch.where(first, rng, momentum * alpha + (1 - momentum) * rng), alpha))
    beta.copy_(torch.where(ok, torch.where(first, mn, momentum * beta + (1 - momentum) * mn), beta))
    count.add_(ok.to(count.dtype))
    return ok


# ------------------------------------------------------------------------------------------------------- the format
@dataclass
class QTensor:
    """An 8-bit tensor: ``codes`` (uint8, the shape of the original), per-group ``step`` = α/255 and ``beta`` (fp32)."""
    codes: torch.Tensor
    step: torch.Tensor
    beta: torch.Tensor
    inner: int
    groups: int
    dtype: torch.dtype

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.step, self.beta

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def quantize(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
             seed: int | torch.Tensor | None = None) -> QTensor:
    """Quantise ``x`` to 8 bits with per-group range ``alpha`` and minimum ``beta`` (fp32 [G]), stochastic rounding.

    ``seed``: an int or a 0-d integer tensor; ``None`` draws one (:func:`draw_seed_tensor`)."""
    check_float_input(x, "mesa quantize")
    _check_groups(x, inner, groups, alpha, beta)
    alpha = alpha.detach().float().clamp_min(_MIN_RANGE)
    scale = 255.0 / alpha  # [G], fresh and contiguous
    step = alpha / 255.0
    beta = beta.detach().float().clone()
    backend = eager_backend(x)
    if backend is not None:  # a kernel without the custom op's dispatch
        if seed is None:  # a CUDA graph being captured: drawn on the device, so that every replay draws anew
            seed = draw_seed_tensor(x.device) if stream_capturing() else int(draw_seed_tensor())
        elif not (backend == "triton" and isinstance(seed, torch.Tensor) and seed.device == x.device):
            seed = int(seed)
        codes = _quantize_on(backend, x.detach().contiguous(), scale, beta, inner, groups, seed)
        return QTensor(codes, step, beta, inner, groups, x.dtype)
    if seed is None:  # traced: on x's device (a compiled CUDA graph then replays a fresh draw)
        seed = draw_seed_tensor(x.device)
    elif not isinstance(seed, torch.Tensor):
        seed = torch.tensor(int(seed), dtype=torch.int64)
    codes = _mesa_quantize_op(x.detach(), scale, beta, inner, groups, seed)
    return QTensor(codes, step, beta, inner, groups, x.dtype)


def dequantize(qt: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x̂ = q·step + β`` per group, in ``dtype`` (default: the dtype that was quantised)."""
    backend = eager_backend(qt.codes)
    if backend is not None:  # a kernel without the custom op's dispatch
        return _dequantize_on(backend, qt.codes.contiguous(), qt.step, qt.beta, qt.inner, qt.groups, dtype or qt.dtype)
    return _mesa_dequantize_op(qt.codes, qt.step, qt.beta, qt.inner, qt.groups, dtype or qt.dtype)


@torch.library.custom_op("lowmembp::mesa_quantize", mutates_args=())
def _mesa_quantize_op(x: torch.Tensor, scale: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
                      seed: torch.Tensor) -> torch.Tensor:
    """uint8 codes of x (x's shape): Triton or the reference; ``seed`` a 0-d integer tensor (any device: on x's
    CUDA device the Triton kernel reads it there, without a host synchronisation)."""
    backend = backend_for(x)
    if not (backend == "triton" and seed.device == x.device):
        seed = int(seed)
    return _quantize_on(backend, x.contiguous(), scale, beta, inner, groups, seed)


@_mesa_quantize_op.register_fake
def _(x, scale, beta, inner, groups, seed):
    return torch.empty(x.shape, dtype=torch.uint8, device=x.device)


@torch.library.custom_op("lowmembp::mesa_dequantize", mutates_args=())
def _mesa_dequantize_op(codes: torch.Tensor, step: torch.Tensor, beta: torch.Tensor, inner: int, groups: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """``q·step[g] + β[g]`` in ``dtype`` (codes' shape)."""
    return _dequantize_on(backend_for(codes), codes.contiguous(), step, beta, inner, groups, dtype)


@_mesa_dequantize_op.register_fake
def _(codes, step, beta, inner, groups, dtype):
    return torch.empty(codes.shape, dtype=dtype, device=codes.device)


def draw_seed_tensor(device=None) -> torch.Tensor:
    """A 0-d int64 seed in [0, 2³¹ − 1) from torch's default generator of ``device`` (default the CPU's; traceable:
    no ``.item()``; on a CUDA device graph-safe: a captured CUDA graph draws a new one at every replay)."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=device or "cpu")


def _check_groups(x, inner, groups, alpha, beta):
    if inner * groups == 0 or x.numel() % (inner * groups) != 0:
        raise ValueError(f"mesa quantize: {x.numel()} elements do not split into groups of inner={inner} x G={groups}")
    if alpha.numel() != groups or beta.numel() != groups:
        raise ValueError(f"mesa quantize: alpha/beta need {groups} entries, got {alpha.numel()}/{beta.numel()}")



def _quantize_on(backend: str, x, scale, beta, inner, groups, seed) -> torch.Tensor:
    """Quantise on ``backend`` (``lowmembp.ops.backend.backend_for``); x contiguous; ``seed`` an int (or, for
    Triton, a 0-d integer tensor on x's device)."""
    if backend == "triton":
        return _quantize_triton(x, scale, beta, inner, groups, seed)
    if backend == "cpu":
        return quantize_cpu(x, scale, beta, inner, groups, seed)
    return quantize_ref(x, scale, beta, inner, groups, seed)


def _dequantize_on(backend: str, codes, step, beta, inner, groups, dtype) -> torch.Tensor:
    """Dequantise on ``backend``; codes contiguous."""
    if backend == "triton":
        return _dequantize_triton(codes, step, beta, inner, groups, dtype)
    if backend == "cpu":
        return dequantize_cpu(codes, step, beta, inner, groups, dtype)
    return dequantize_ref(codes, step, beta, inner, groups, dtype)


# ------------------------------------------------------------------------------------------------------ the module
class EMAQuantizer(nn.Module):
    """Holds one tensor site's EMA ranges (buffers ``alpha``, ``beta``, ``count``; not in the state dict).

    ``mode="head"`` (per head of [B, H, N, D]) or ``"channel"`` (``num_groups`` channel groups, reduced to a divisor
    of the channel count). In training mode :meth:`pack` updates the EMA with the batch before quantising; in eval
    mode it uses the stored ranges (or, before any training step, the batch's own range).
    """

    def __init__(self, num_groups: int, mode: str = "channel", momentum: float = MOMENTUM):
        super().__init__()
        if mode not in ("head", "channel"):
            raise ValueError(f"EMAQuantizer mode must be 'head' or 'channel', got {mode!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"EMA momentum must be in [0, 1), got {momentum}")
        self.mode, self.num_groups, self.momentum = mode, int(num_groups), float(momentum)
        self.register_buffer("alpha", torch.zeros(self.num_groups), persistent=False)
        self.register_buffer("beta", torch.zeros(self.num_groups), persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("skipped", torch.zeros((), dtype=torch.int64), persistent=False)  # non-finite batches
        self._updated = False  # whether an EMA update has happened (known without reading ``count`` back)
        self._warned = False
        self._calls = 0

    def extra_repr(self) -> str:
        return f"mode={self.mode}, groups={self.num_groups}, momentum={self.momentum}"

    def pack(self, x: torch.Tensor) -> QTensor:
        inner, groups = group_layout(x, self.mode, self.num_groups)
        if groups != self.alpha.numel():
            if self.mode == "head":
                raise ValueError(f"EMAQuantizer built for {self.alpha.numel()} heads got {groups} heads")
            # fewer channel groups than asked (gcd): resize once, before the first update
            self._resize(groups, x.device)
        seed = None
        if self.training and self._fusable(x):
            seed = draw_seed_tensor()  # the one draw of the call, as quantize makes it below
            qt = self._pack_cpu(x.detach(), inner, groups, seed)
            if qt is not None:
                return qt
        with torch.no_grad():
            mn, mx = group_min_max(x, inner, groups)
            if self.training:
                mn, mx = reduce_over_ranks(mn, mx)  # torchrun/DDP: the global batch's statistics
                ok = ema_update(self.alpha, self.beta, self.count, mn, mx, self.momentum)
                self.skipped.add_((~ok).to(self.skipped.dtype))
                self._updated = True
                alpha, beta = self.alpha, self.beta
                if not torch.compiler.is_compiling():
                    self._maybe_warn(x)
            else:
                started = self.count > 0
                alpha = torch.where(started, self.alpha, mx - mn)
                beta = torch.where(started, self.beta, mn)
        return quantize(x, alpha, beta, inner, groups, seed)

    def _fusable(self, x: torch.Tensor) -> bool:
        """Whether :meth:`_pack_cpu` may run: a plain eager CPU tensor on the CPU fast path, fp32 CPU ranges, int64
        counters, and no data-parallel group of more than one process (whose statistics are all-reduced)."""
        if eager_backend(x) != "cpu" or x.numel() == 0 or x.dtype not in SUPPORTED_FLOAT_DTYPES:
            return False
        buf = self._buffers  # (not Module.__getattr__: this runs on every call)
        a, b, c, k = buf["alpha"], buf["beta"], buf["count"], buf["skipped"]
        if not (a.dtype is b.dtype is torch.float32 and c.dtype is k.dtype is torch.int64):
            return False
        if not (a.is_cpu and b.is_cpu and c.is_cpu and k.is_cpu and a.is_contiguous() and b.is_contiguous()
                and a.numel() == b.numel() and c.numel() == k.numel() == 1):
            return False
        dist = torch.distributed
        return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)

    def _pack_cpu(self, x: torch.Tensor, inner: int, groups: int, seed: torch.Tensor) -> QTensor | None:
        """Training-mode :meth:`pack` in one C call (:func:`lowmembp.ops.cpu_kernels.mesa_pack8`): the same ranges,
        counters, codes, step and β bit for bit as :func:`group_min_max`, :func:`ema_update` and :func:`quantize`.
        None where the ATen ops must run instead (no C kernels; a -0.0 at a group's min or max), nothing changed."""
        xc = x.contiguous()
        codes = torch.empty_like(xc, dtype=torch.uint8)  # contiguous as xc
        step, beta, scale = (xc.new_empty(groups, dtype=torch.float32) for _ in range(3))
        s = int(seed)
        buf = self._buffers  # checked by _fusable; pack made alpha's size the groups
        flags = cpu_kernels.mesa_pack8_trusted(xc, xc.numel(), inner, groups, buf["alpha"], buf["beta"],
                                               buf["count"], buf["skipped"], self.momentum, _MIN_RANGE, s, step,
                                               beta, scale, codes)
        if flags is None or flags & cpu_kernels.PACK8_AMBIGUOUS:
            return None
        if not self._updated:
            self._updated = True
        if flags & cpu_kernels.PACK8_NAN:  # a NaN code: ATen's conversion decides it (the eager ops)
            codes = quantize_cpu(xc, scale, beta, inner, groups, s)
        if flags & cpu_kernels.PACK8_SKIPPED and not self._warned:  # the skipped counter, read by the C call
            self._warn_skipped()
        return QTensor(codes, step, beta, inner, groups, x.dtype)

    def _maybe_warn(self, x: torch.Tensor) -> None:
        """Warn once if a batch's statistics were non-finite (CPU: every call; CUDA: every 64th, one sync)."""
        if self._warned or is_shape_only(self.skipped) or stream_capturing():  # no value to read (fake / meta
            return  # buffers), or none to read now (a CUDA graph being captured: no host synchronisation)
        self._calls += 1
        if x.device.type != "cpu" and self._calls % _WARN_EVERY_CUDA:
            return
        if int(self.skipped) > 0:
            self._warn_skipped()

    def _warn_skipped(self) -> None:
        self._warned = True
        warnings.warn(f"mesa EMAQuantizer({self.extra_repr()}): a batch with non-finite statistics (inf/NaN, "
                      f"or a range that overflows fp32) was seen; it did not update the EMA ranges, which keep "
                      f"their last finite values (skipped updates so far: {int(self.skipped)}; this warning is "
                      f"shown once per quantiser)", RuntimeWarning, stacklevel=5)

    def _resize(self, groups: int, device) -> None:
        if getattr(self, "_updated", False):
            raise ValueError(f"EMAQuantizer: channel groups changed from {self.alpha.numel()} to {groups} "
                             "after training started (the layer saw inputs of another width)")
        self.alpha = torch.zeros(groups, device=device)
        self.beta = torch.zeros(groups, device=device)
