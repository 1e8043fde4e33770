"""Launching the ops' Triton kernels with little host time: the compiled kernel from a per-signature cache.

``kernel[grid](*args)`` costs 10-30 µs of Python per launch (Triton binds the arguments, works out their
specialisation and looks the compiled kernel up on every call), more than an op's kernel runs on a small tensor. A
:class:`Launcher` does that work once per *signature* — the device, the constexprs, each tensor's dtype and 16-byte
alignment, each integer's Triton specialisation (equal to 1, a multiple of 16, beyond 32 bits) — and then starts
the compiled kernel directly (:func:`lowmembp._compat.triton_compiled_launcher`). Under Triton's interpreter, or
where this Triton's compiled kernel cannot be started that way, every launch is the ordinary ``kernel[grid](...)``.
"""
from __future__ import annotations

import torch

from lowmembp._compat import cuda_current_device, cuda_raw_stream, triton_compiled_launcher


def _arg_key(a):
    """What Triton specialises an argument on: a tensor's dtype and 16-byte alignment; an int's ``== 1``,
    ``% 16 == 0`` and whether it needs 64 bits; a float nothing."""
    if type(a) is int:
        return (a == 1) | ((a & 15) == 0) << 1 | (not -0x80000000 <= a <= 0x7FFFFFFF) << 2
    if type(a) is float:
        return 8
    return a.dtype, a.data_ptr() & 15 == 0


class Launcher:
    """One ``@triton.jit`` kernel's launches. ``launcher(grid0, args, constexprs, num_warps)`` runs the kernel on
    ``grid0`` programs with the runtime arguments ``args`` (the kernel's first parameters, in order; tensors on one
    CUDA device, or CPU tensors under the interpreter) and the constexprs (the remaining parameters, a tuple in
    order). The compiled kernel of each signature is looked up once."""

    __slots__ = ("kernel", "_constexpr_names", "_cache", "direct")

    def __init__(self, kernel):
        self.kernel = kernel
        self._constexpr_names: tuple | None = None
        self._cache: dict = {}
        self.direct = 0  # launches that took the compiled kernel directly (tests, benchmarks)

    def __call__(self, grid0: int, args: tuple, constexprs: tuple, num_warps: int, device: int = -1):
        key = (device, constexprs, num_warps, *map(_arg_key, args))
        launch = self._cache.get(key)
        if launch is not None and device >= 0 and device == cuda_current_device():
            self.direct += 1
            launch(grid0, 1, 1, cuda_raw_stream(device), *args, *constexprs)
            return
        self._launch_slow(key, grid0, args, constexprs, num_warps, device)

    def _names(self) -> tuple:
        if self._constexpr_names is None:
            self._constexpr_names = tuple(self.kernel.arg_names)
        return self._constexpr_names

    def _launch_slow(self, key, grid0, args, constexprs, num_warps, device):
        """The ordinary launch (on the tensors' device); the first one of a CUDA signature caches its compiled
        kernel."""
        names = self._names()[len(args):]
        kwargs = dict(zip(names, constexprs))
        if device < 0:  # CPU tensors: Triton's interpreter
            self.kernel[(grid0,)](*args, **kwargs, num_warps=num_warps)
            return
        with torch.cuda.device(device):
            compiled = self.kernel[(grid0,)](*args, **kwargs, num_warps=num_warps)
        if key not in self._cache and compiled is not None:
            launch = triton_compiled_launcher(compiled)
            if launch is not None:
                self._cache[key] = launch
