"""Ops: each file holds one op family's custom op, autograd, functions and nn.Modules.

The families with Triton kernels (``approx_act``, ``ms_norm``, ``mesa_quant``) split the rest by job, one file each,
named after the op: ``<op>_reference`` (the op's definition and PyTorch reference, the oracle the others equal),
``<op>_triton`` (the Triton kernels and their launches) and ``<op>_cpu`` (the CPU fast path, on the C kernels of
:mod:`~lowmembp.ops.cpu_kernels`); ``<op>`` dispatches between them and re-exports their public functions.

The public names are importable from here (``from lowmembp.ops import regelu2, ms_layer_norm, make_approx``); the
submodules (and triton with them) are imported on first use of a name, not when ``lowmembp.ops`` is imported.
:mod:`~lowmembp.ops.backend` chooses between an op's Triton kernel and its PyTorch reference.

May import: torch, triton (inside the kernels' modules), :mod:`lowmembp._compat`. Nothing else of lowmembp: every
other room builds on the ops.

- :mod:`~lowmembp.ops.approx_act`: ``regelu2``, ``resilu2``, ``make_approx``, ``ApproxAct``, ``ReGELU2``,
  ``ReSiLU2`` (exact forward, k-bit backward; the function ``approx_act.approx_act(x, kind, bits)``);
  :mod:`~lowmembp.ops.approx_derive`: ``derive`` (their constants, from the paper's objective)
- :mod:`~lowmembp.ops.ms_norm`: ``ms_layer_norm``, ``ms_rms_norm``, ``MSLayerNorm``, ``MSRMSNorm``
- :mod:`~lowmembp.ops.mesa_quant` / :mod:`~lowmembp.ops.mesa_layers`: ``EMAQuantizer``, ``quantize``,
  ``dequantize`` and the Mesa layers
- :mod:`~lowmembp.ops.shared_linear`: ``linear_sharing_input``, ``CastWeightLinear``, ``share_lora_inputs``
- :mod:`~lowmembp.ops.cpu_kernels`: the CPU fast paths' C kernels (compiled on first use, loaded with ctypes)
"""
from __future__ import annotations

import importlib

_WHERE = {
    "regelu2": "approx_act", "resilu2": "approx_act", "make_approx": "approx_act",
    "ApproxAct": "approx_act", "ReGELU2": "approx_act", "ReSiLU2": "approx_act",
    "derive": "approx_derive",
    "ms_layer_norm": "ms_norm", "ms_rms_norm": "ms_norm", "MSLayerNorm": "ms_norm", "MSRMSNorm": "ms_norm",
    "EMAQuantizer": "mesa_quant", "quantize": "mesa_quant", "dequantize": "mesa_quant",
    "MesaLinear": "mesa_layers", "MesaAct": "mesa_layers", "MesaLayerNorm": "mesa_layers",
    "MesaRMSNorm": "mesa_layers", "MesaSoftmax": "mesa_layers", "MesaMatMul": "mesa_layers",
    "linear_sharing_input": "shared_linear", "CastWeightLinear": "shared_linear", "share_lora_inputs": "shared_linear",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
