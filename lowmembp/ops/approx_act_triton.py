"""The approximate activations' Triton kernels and their launches (CUDA tensors; CPU ones under the interpreter).

One kernel per op call, launched from :mod:`lowmembp.ops.launch`'s cache. The forward's flag byte (NaN / +inf seen
anywhere) is an OR over every program: each program ORs its own flag into a per-stream int32 workspace (only when it
saw one), then takes a ticket; the program that takes the last ticket moves the total into the flag byte and zeroes
the workspace for the next call. No fill or copy launches, and the workspace is back at zero after every launch (so a
CUDA graph replays it as it is). The codes and gradients equal the reference's
(:mod:`~lowmembp.ops.approx_act_reference`) bit for bit; the forward output agrees with it to fp32 rounding of
erf/exp/tanh.
"""
from __future__ import annotations

import os

import torch

from lowmembp._compat import cuda_raw_stream
from lowmembp.ops.approx_act_reference import (_BITS_OF_COUNT, _GELU, _KIND_ID, _NEG_ZERO, _TABLES, _UNBOUNDED, _bits,
                                               _bits_of, _consts32, _kind, _slope_rows)
from lowmembp.ops.launch import Launcher

try:  # triton is optional on CPU-only installs; the reference path needs none of it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing or broken
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _act_fwd_kernel(x_ptr, y_ptr, code_ptr, t_ptr, ws_ptr, n, nbytes,
                        KIND: tl.constexpr, BITS: tl.constexpr, NT: tl.constexpr, NEG_ZERO: tl.constexpr,
                        UNBOUNDED: tl.constexpr, WRITE_CODES: tl.constexpr, BLOCK: tl.constexpr,
                        TILES: tl.constexpr):
        # One program: TILES tiles of BLOCK groups of 8 consecutive elements (a group fills BITS code bytes), each a
        # [BLOCK, 8] tile; the flags are gathered per element over the tiles and reduced once per program.
        pid = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, 8)
        kb = tl.arange(0, 4)
        seen = tl.zeros([BLOCK, 8], dtype=tl.int32)
        for i in range(TILES):
            grp = (pid * TILES + i) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            idx = grp[:, None] * 8 + lane[None, :]
            mask = idx < n
            x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if KIND == 0:  # gelu (erf)
                y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))  # 1/√2
            elif KIND == 1:  # gelu_tanh: 0.5·x·(1 + tanh(u)) = x·sigmoid(2u) (no libdevice tanh in the interpreter)
                u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # √(2/π)
                y = x / (1.0 + tl.exp(-2.0 * u))
            elif KIND == 2:  # quick_gelu
                y = x / (1.0 + tl.exp(-1.702 * x))
            elif KIND == 3:  # silu
                y = x / (1.0 + tl.exp(-x))
            elif KIND == 4:  # relu
                y = tl.where(x > 0.0, x, 0.0)
            else:  # relu2
                r = tl.where(x > 0.0, x, 0.0)
                y = r * r
            finite = tl.abs(x) < float("inf")  # false for ±inf and NaN
            if NEG_ZERO:
                special = tl.where(x < 0.0, -0.0, x)
            else:
                special = tl.where(x < 0.0, 0.0, x)
            y = tl.where(finite, y, special)
            tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=mask)
            if WRITE_CODES:
                code = tl.zeros([BLOCK, 8], dtype=tl.int32)
                for j in tl.static_range(NT):
                    code += (x > tl.load(t_ptr + j)).to(tl.int32)
                code = tl.where(mask, code, 0)
                word = tl.sum(code << (lane[None, :] * BITS), axis=1)  # disjoint bits: sum == or (int32 wraps)
                byte = (word[:, None] >> (kb[None, :] * 8)) & 0xFF
                bidx = grp[:, None] * BITS + kb[None, :]
                tl.store(code_ptr + bidx, byte.to(tl.uint8), mask=(kb[None, :] < BITS) & (bidx < nbytes))
                seen = seen | tl.where(mask & (x != x), 1, 0)
                if UNBOUNDED:
                    seen = seen | tl.where(mask & (x == float("inf")), 2, 0)
        if WRITE_CODES:
            if UNBOUNDED:  # two bits from different elements: the max of each, then or
                flag = tl.max(tl.max(seen & 1, axis=1), axis=0) | tl.max(tl.max(seen & 2, axis=1), axis=0)
            else:
                flag = tl.max(tl.max(seen, axis=1), axis=0)
            tl.atomic_or(ws_ptr, flag, mask=flag != 0)
            ticket = tl.atomic_add(ws_ptr + 1, 1)  # acq_rel: the OR above is seen by whoever takes the last ticket
            if ticket == tl.num_programs(0) - 1:
                total = tl.atomic_xchg(ws_ptr, 0)
                tl.store(code_ptr + nbytes, total.to(tl.uint8))
                tl.atomic_xchg(ws_ptr + 1, 0)

    @triton.jit
    def _act_bwd_kernel(dy_ptr, code_ptr, s_ptr, dx_ptr, n, nbytes,
                        BITS: tl.constexpr, NS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        grp = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        lane = tl.arange(0, 8)
        idx = grp[:, None] * 8 + lane[None, :]
        mask = idx < n
        kb = tl.arange(0, 4)
        bidx = grp[:, None] * BITS + kb[None, :]
        byte = tl.load(code_ptr + bidx, mask=(kb[None, :] < BITS) & (bidx < nbytes), other=0).to(tl.int32)
        word = tl.sum(byte << (kb[None, :] * 8), axis=1)
        code = (word[:, None] >> (lane[None, :] * BITS)) & (NS - 1)
        flag = tl.load(code_ptr + nbytes).to(tl.int32)  # the flag byte after the codes
        s = tl.load(s_ptr + flag * NS + code, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + idx, (dy * s).to(dx_ptr.dtype.element_ty), mask=mask)

    _FWD = Launcher(_act_fwd_kernel)
    _BWD = Launcher(_act_bwd_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_INTERPRET = _interpreting()  # set before triton is imported, so fixed for the process


def _launch_cfg(groups: int) -> tuple[int, int, int]:
    """(BLOCK groups of 8 elements per tile, TILES tiles per program, num_warps). The interpreter pays per program:
    one big block. On a GPU 4096-element tiles, four per program on large tensors: a quarter of the programs, so a
    quarter of the forward's flag reductions and atomic tickets."""
    if _INTERPRET:
        return max(16, min(triton.next_power_of_2(max(groups, 1)), 1 << 12)), 1, 4
    return 512, (4 if groups >= 512 * 4 * 512 else 1), 8


def _need_triton():
    if triton is None:
        raise RuntimeError("approx_act: the Triton backend was selected but triton is not importable; "
                           "install triton or set LOWMEMBP_BACKEND=torch")


_WORKSPACE: dict = {}


def _workspace(like: torch.Tensor, index: int) -> torch.Tensor:
    """The forward kernel's flag workspace on ``like``'s device for the current stream: two int32 zeros (the OR of the
    programs' flags, the ticket counter), made once per (device, stream); the kernel leaves them at zero."""
    key = (index, cuda_raw_stream(index)) if index >= 0 else (index, 0)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = _WORKSPACE[key] = torch.zeros(2, dtype=torch.int32, device=like.device)
    return ws


def _fwd_triton(x: torch.Tensor, kind: str, thresholds, with_codes: bool):
    _need_triton()
    bits = _BITS_OF_COUNT[len(thresholds) + 1]
    xc = x if x.is_contiguous() else x.contiguous()
    n = xc.numel()
    nbytes = (n * bits + 7) >> 3
    y = torch.empty_like(xc)
    packed = xc.new_empty(nbytes + 1 if with_codes else 0, dtype=torch.uint8)
    if n:
        dev = xc.get_device()
        t = _device_table(("t", tuple(thresholds)), xc, dev)
        ws = _workspace(xc, dev) if with_codes else t
        block, tiles, warps = _launch_cfg((n + 7) >> 3)
        _FWD(-(-((n + 7) >> 3) // (block * tiles)), (xc, y, packed if with_codes else y, t, ws, n, nbytes),
             (_KIND_ID[kind], bits, len(thresholds), kind in _NEG_ZERO, kind in _UNBOUNDED, with_codes, block, tiles),
             warps, dev)
    elif with_codes:
        packed.zero_()  # no element: the flag byte alone, 0
    return y, packed


def _device_table(key: tuple, like: torch.Tensor, dev: int) -> torch.Tensor:
    """A small fp32 constant tensor (thresholds or a slope table) on ``like``'s device, made once per device."""
    full = (key, dev)
    t = _TABLES.get(full)
    if t is None:
        kind, values = key
        rows = values if kind == "t" else _slope_rows(values)
        t = _TABLES[full] = torch.tensor(rows, dtype=torch.float32, device=like.device)
    return t


def _bwd_triton(dy: torch.Tensor, packed: torch.Tensor, s32) -> torch.Tensor:
    _need_triton()
    bits = _BITS_OF_COUNT.get(len(s32)) or _bits_of(len(s32), "slopes")
    dyc = dy if dy.is_contiguous() else dy.contiguous()
    n = dyc.numel()
    nbytes = (n * bits + 7) >> 3
    if packed.numel() != nbytes + 1:
        raise ValueError(f"approx_act backward: expected {nbytes + 1} saved bytes for {n} elements at {bits} bits, "
                         f"got {packed.numel()}")
    dx = torch.empty_like(dyc)
    if n:
        dev = dyc.get_device()
        block, _, warps = _launch_cfg((n + 7) >> 3)
        _BWD(-(-((n + 7) >> 3) // block), (dyc, packed, _device_table(("s", tuple(s32)), dyc, dev), dx, n, nbytes),
             (bits, len(s32), block), warps, dev)
    return dx


def forward_triton(x: torch.Tensor, kind=_GELU, with_codes: bool = True, bits: int = 2):
    """Triton forward: (y, packed codes + flag byte) — the same bytes as :func:`forward_reference`."""
    kind = _kind(kind)
    return _fwd_triton(x, kind, _consts32(kind, _bits(bits))[0], with_codes)


def backward_triton(dy: torch.Tensor, packed: torch.Tensor, kind=_GELU, bits: int = 2) -> torch.Tensor:
    """Triton backward: ``dx = dy · s[code]``, bitwise equal to :func:`backward_reference`."""
    return _bwd_triton(dy, packed, _consts32(_kind(kind), _bits(bits))[1])
