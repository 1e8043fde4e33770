"""Ops: each op family's custom op, autograd, functions and nn.Modules, one file per family.

The families with Triton kernels (``approx_act``, ``ms_norm``, ``mesa_quant``) split by job: ``<op>_reference`` (the
definition and PyTorch reference, the oracle the others equal), ``<op>_triton`` (kernels and launches), ``<op>_cpu``
(the CPU fast path on :mod:`~lowmembp.ops.cpu_kernels`); ``<op>`` dispatches between them and re-exports them.
:mod:`~lowmembp.ops.backend` chooses the backend. The public names are importable from here (``from lowmembp.ops
import regelu2, ms_layer_norm, make_approx``), each submodule imported on first use of a name.

May import: torch, triton (inside the kernels' modules), :mod:`lowmembp._compat`; nothing else of lowmembp.

- :mod:`~lowmembp.ops.approx_act` (``regelu2``, ``resilu2``, ``make_approx``, ``ReGELU2``, ``ReSiLU2``) and
  :mod:`~lowmembp.ops.approx_derive` (their constants); :mod:`~lowmembp.ops.ms_norm` (``ms_layer_norm``,
  ``ms_rms_norm``, ``MSLayerNorm``, ``MSRMSNorm``); :mod:`~lowmembp.ops.mesa_quant` / :mod:`~lowmembp.ops.mesa_layers`
  (``EMAQuantizer``, ``quantize``, ``dequantize``, the Mesa layers); :mod:`~lowmembp.ops.shared_linear`
  (``linear_sharing_input``, ``CastWeightLinear``); :mod:`~lowmembp.ops.cpu_kernels` (the CPU fast paths' C kernels).
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
