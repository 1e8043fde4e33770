"""``liger``: Liger-Kernel's own patching of a transformers model (PyPI ``liger-kernel`` 0.8.x; docs/design.md#peers).

Liger replaces, on the model instance, the RMSNorm / LayerNorm, the SwiGLU / GeGLU MLP and the causal LM's lm_head +
cross-entropy (fused: the logits are never materialised) with exact Triton kernels. The method runs Liger's own
dispatcher with Liger's defaults, so what is measured is the package as its users get it; the names that Liger's
patch functions rebind process-wide are restored after the call, so no other model changes (Liger's RoPE, patched
only that way, is therefore not used). Refused without CUDA and on fake or meta tensors (its kernels run neither in
Triton's interpreter nor on fake tensors), for timm models and model types Liger has no patch for, and when
``liger-kernel`` is missing. Applied first (order 5, before peft wraps the model); excludes ``lowmembp*``, ``mesa*``,
``chunked-ce`` and ``tokentune``. In full: docs/methods/liger.md.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from lowmembp.methods.registry import register

NO_GPU = ("liger: needs a CUDA GPU — Liger-Kernel's Triton kernels do not run under Triton's interpreter "
          "(TRITON_INTERPRET=1 fails in its RMSNorm/LayerNorm) nor on fake tensors, so there is no CPU path and no "
          "paper-scale estimate; run it on a GPU machine")


@register("liger", "Liger-Kernel's Triton RMSNorm/LayerNorm, SwiGLU, RoPE, fused linear CE (GPU only; transformers "
                   "families Liger patches)", order=5,
          excludes={**dict.fromkeys(("lowmembp", "lowmembp-act", "lowmembp-norm", "mesa", "mesa-gelu-ln", "tokentune"),
                                    ""),
                    "chunked-ce": "both compute the causal-LM loss from lm_head's input without keeping the full "
                                  "logits (liger with its fused linear cross-entropy) and a model has one loss: "
                                  "choose one"})
def apply_liger(model: nn.Module) -> nn.Module:
    from lowmembp.models import get_layout

    base = get_layout(model).base
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type is None or not (type(base).__module__ or "").startswith("transformers"):
        raise ValueError(f"liger: Liger-Kernel patches transformers models only; {type(base).__name__} "
                         f"({type(base).__module__}) has no Liger patch")
    if not torch.cuda.is_available():
        raise RuntimeError(NO_GPU + " (no CUDA device here)")
    if any(p.is_meta or type(p).__name__ == "FakeTensor" for p in base.parameters()):
        raise RuntimeError(NO_GPU + " (the model is on fake or meta tensors)")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
    except ImportError as e:
        raise ImportError("liger: liger-kernel is not installed; pip install 'lowmembp[gpu]' "
                          "(liger-kernel 0.8.x)") from e
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(f"liger: Liger-Kernel has no patch for model type {model_type!r} ({type(base).__name__}); "
                         f"it patches: {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}")
    before = _globals_snapshot(base)
    try:
        _apply_liger_kernel_to_instance(model=base)
    finally:
        _restore_globals(before, base)
    object.__setattr__(model, "_liger", {"model_type": model_type})
    return model


def _globals_snapshot(base: nn.Module):
    """What Liger's ``apply_liger_kernel_to_*`` may rebind beyond the instance: every loaded ``transformers`` module's
    globals and ``torch.nn.functional``'s (``modeling_llama.LlamaRMSNorm = LigerRMSNorm``, ``LlamaMLP``,
    ``apply_rotary_pos_emb``, ``nn.functional.cross_entropy``), and the ``forward`` of the classes of the model's own
    modeling modules (``Llama4ForCausalLM.forward = ...`` even when given an instance)."""
    import sys

    mods = [m for name, m in list(sys.modules.items())
            if m is not None and (name == "transformers" or name.startswith("transformers."))]
    mods.append(torch.nn.functional)
    module_dicts = [(m, dict(vars(m))) for m in mods]
    own = {type(m).__module__ for m in base.modules()}
    classes = {}
    for name in own:
        mod = sys.modules.get(name)
        for v in list(vars(mod).values()) if mod is not None else ():
            if isinstance(v, type) and v.__module__ == name:
                classes[v] = v.__dict__.get("forward")
    return module_dicts, classes


def _restore_globals(before, base: nn.Module) -> None:
    """Undo Liger's process-wide rebinds, so that only ``base`` carries Liger's kernels: without this every model of
    the family built later in the process (and, through the module-level ``apply_rotary_pos_emb``, every one built
    before) would silently run Liger's modules — a different model, and Triton kernels on CPU models. A class-level
    ``forward`` patch of ``base``'s own class moves onto the instance. What Liger patches only at module level (its
    RoPE, for LLaMA-like models; its plain cross-entropy where that is the default) is therefore not used: those
    models keep transformers' rotary embedding / loss, exact either way."""
    import types

    module_dicts, classes = before
    for m, d in module_dicts:
        now = vars(m)
        for k, v in list(now.items()):
            if k in d and d[k] is not v:
                setattr(m, k, d[k])
    for cls, fwd in classes.items():
        new = cls.__dict__.get("forward")
        if new is fwd:
            continue
        if isinstance(base, cls) and "forward" not in base.__dict__ and new is not None:
            base.forward = types.MethodType(new, base)
        if fwd is None:
            delattr(cls, "forward")
        else:
            setattr(cls, "forward", fwd)
