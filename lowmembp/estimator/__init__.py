"""The estimator: a whole training step of a paper-scale model on fake tensors, on the CPU, nothing large allocated.

- :mod:`~lowmembp.estimator.zoo`: the paper-model zoo (``MODELS``, ``ModelSpec``, ``build``, ``block_names``), a
  random batch and the loss of a step;
- :mod:`~lowmembp.estimator.step`: the fake step (``estimate``, ``estimate_by_depth``);
- :mod:`~lowmembp.estimator.fsdp`: one rank's peak under FSDP2 (``fsdp_peak``);
- :mod:`~lowmembp.estimator.weights`: the weights' precision (``WEIGHTS``, ``auto_weights``) and NF4 (QLoRA) bases
  (``nf4_weight_bytes``, ``nf4_peak``);
- :mod:`~lowmembp.estimator.fake_mode`: the fake-tensor mode the steps run under;
- :mod:`~lowmembp.estimator.hf_config`: a transformers ``config.json`` on disk as a model to estimate.

May import: :mod:`lowmembp.methods`, :mod:`lowmembp.models`, :mod:`lowmembp.measurement`, :mod:`lowmembp._compat`,
torch, timm, transformers, peft. Never the planner, which builds on it.

    from lowmembp.estimator import estimate
    estimate("llama-7b", "lora+lowmembp", batch_size=4, seq_len=2048)
"""
from __future__ import annotations

import importlib

# name -> the module that defines it (imported when the name is first used)
_WHERE = {
    **dict.fromkeys(("MODELS", "ModelSpec", "model_spec", "paper_model_name", "build", "block_names"), "zoo"),
    **dict.fromkeys(("DTYPES", "estimate", "estimate_by_depth", "extend_by_depth", "full_depth", "prepare_model",
                     "to_fake_cpu"), "step"),
    "fsdp_peak": "fsdp",
    **dict.fromkeys(("WEIGHTS", "auto_weights", "frozen_base", "nf4_peak", "nf4_weight_bytes"), "weights"),
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
