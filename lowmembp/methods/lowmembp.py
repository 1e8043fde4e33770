"""``lowmembp``, ``lowmembp-act``, ``lowmembp-norm``: LowMemoryBP (Yang et al., ICML 2024) as one call on a real model.

    model = lowmembp.apply(model, "lowmembp")          # or "lora+lowmembp", "lowmembp-act", "lowmembp-norm"

- ``lowmembp-act`` (the paper's "activation" variant): every erf-GELU → ``ReGELU2``, every SiLU → ``ReSiLU2``
  (lowmembp.ops.approx_act): exact forward, 2-bit codes saved instead of the input.
- ``lowmembp-norm`` (the paper's "mergeln" variant): every LayerNorm / RMSNorm the adapter can fold →
  ``MSLayerNorm`` / ``MSRMSNorm`` (lowmembp.ops.ms_norm, no affine), with γ and β folded into every linear that reads
  the norm (lowmembp.models.fold: float64, cast back; peft LoRA branches folded too), the final norm folded into the
  head (ViT ``head`` — after token/avg pooling, ``fc_norm`` or ``norm`` — Swin ``head.fc``, LLaMA ``lm_head`` /
  ``score``; tied embeddings are untied), and for post-norm BERT / RoBERTa the affine re-applied on the residual
  path (``lowmembp.models.fold.ResidualAffine``).
- ``lowmembp``: both.

Exact in the forward (fp32: to rounding) with these stated exceptions, which are kept or reported, never silent:

- Norms whose output leaves the model or meets non-linear pooling keep their original module (exact): BERT's last
  LayerNorm (the last hidden state is the model output and the input of pooler/classifier), a bare backbone's final
  norm, ViT attention / max pooling, Swin blocks padded to the window size. See ``model.lowmembp_report["kept"]``.
- Dropout with p > 0 between a norm and its readers (BERT's embedding dropout, ``lora_dropout``, ViT ``head_drop``)
  now drops the normalised value before β is added back: equal in expectation, not sample by sample.
- The backbone's intermediate hidden states that are norm outputs (BERT ``output_hidden_states``) and a task
  model's final normalised hidden state (LLaMA ``hidden_states[-1]``) no longer include γ/β. Logits are unchanged.
- After conversion W', b' (and LoRA A', its new bias) are free parameters (see lowmembp.models.fold); build the
  optimizer after converting (folded parameters are updated in place, but new biases are new parameters).

Refuses: a model no adapter recognises (UnsupportedModelError naming the families), a model that already holds MS
norms (for the norm half) or ReGELU2/ReSiLU2 (for the act half), merged or DoRA LoRA layers, quantised weights.
Works on real, meta and fake tensors (no data-dependent Python).
"""
from __future__ import annotations

import warnings

import torch.nn as nn

from lowmembp.export import guard_save, record_act, record_fold
from lowmembp.methods.registry import register
from lowmembp.models import get_layout
from lowmembp.models.fold import fold_into, install_residual_affine, norm_affine, shared_parameters

_MS_NORMS = ("MSLayerNorm", "MSRMSNorm")
_APPROX_ACTS = ("ReGELU2", "ReSiLU2")


def _refuse_twice(base: nn.Module, acts: bool, norms: bool) -> None:
    names = {type(m).__name__ for m in base.modules()}
    if norms and names & set(_MS_NORMS):
        raise RuntimeError("this model already has MS norms (lowmembp or lowmembp-norm was applied); folding γ/β "
                           "again would be wrong — convert the original model once")
    if acts and names & set(_APPROX_ACTS):
        raise RuntimeError("this model already has ReGELU2/ReSiLU2 activations (lowmembp or lowmembp-act was "
                           "applied); convert the original model once")


def _ms_norm_like(norm: nn.Module, kind: str) -> nn.Module:
    from lowmembp.ops.ms_norm import MSLayerNorm, MSRMSNorm
    if kind == "layernorm":
        return MSLayerNorm(tuple(norm.normalized_shape), eps=norm.eps)
    hidden = norm.weight.shape[0] if getattr(norm, "weight", None) is not None else norm.hidden_size
    return MSRMSNorm(hidden, eps=norm.variance_epsilon)


def _untie_config(base: nn.Module) -> None:
    cfg = getattr(base, "config", None)
    if cfg is None:
        return
    for c in (cfg, getattr(cfg, "get_text_config", lambda: None)()):
        if c is not None and getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False


def convert(model: nn.Module, *, acts: bool = True, norms: bool = True, share_lora_inputs: bool = True) -> nn.Module:
    """Convert ``model`` in place (see the module docstring); returns it, with ``lowmembp_report`` on the base."""
    lay = get_layout(model)
    _refuse_twice(lay.base, acts, norms)
    report = {"family": lay.family, "norms": [], "kept": [], "acts": [], "skipped_acts": []}
    if norms:
        shared = shared_parameters(lay.base)
        untied = False
        for ns in lay.all_norms():
            if not ns.foldable or not (ns.consumers or ns.residual_consumers):
                report["kept"].append((ns.path, ns.why or "no known readers"))
                continue
            norm = ns.get()
            gamma, beta = norm_affine(norm)
            record_fold(lay.base, norm, gamma, beta, [c.get() for c in ns.consumers],
                        [r.get() for r in ns.residual_consumers])  # what lowmembp.export needs to undo this
            for c in ns.consumers:
                lin = c.get()
                untied |= any(id(p) in shared for p in lin.parameters())
                fold_into(lin, gamma, beta, c.path, shared)
            for r in ns.residual_consumers:
                install_residual_affine(r.get(), gamma, beta)
            ns.set(_ms_norm_like(norm, ns.kind))
            report["norms"].append(ns.path)
        if untied:
            _untie_config(lay.base)
        if share_lora_inputs and any(hasattr(m, "lora_A") for m in lay.base.modules()):
            from lowmembp.ops.shared_linear import share_lora_inputs as _share
            _share(lay.base)
    if acts:
        from lowmembp.ops.approx_act import ReGELU2, ReSiLU2
        for a in lay.acts:
            record_act(lay.base, a.get())  # lowmembp.export puts it back
            a.set(ReGELU2() if a.kind == "gelu" else ReSiLU2())
            report["acts"].append(a.path)
        if not lay.acts:
            warnings.warn(f"lowmembp: no erf-GELU or SiLU activation found in this {lay.family} model "
                          f"(tanh-GELU, ReLU, ... are not converted); activations left as they are", stacklevel=3)
    object.__setattr__(lay.base, "lowmembp_report", report)
    guard_save(lay.model, lay.base)  # save_pretrained saves lowmembp.export(model), not the folded weights
    return model


_OPTS = {"share_lora_inputs": True}


@register("lowmembp", "LowMemoryBP: ReGELU2/ReSiLU2 activations + MS-LayerNorm/MS-RMSNorm with γ/β folded into the "
          "next linears (exact forward, less activation memory)", options=_OPTS, order=20,
          excludes=("lowmembp-act", "lowmembp-norm", "mesa-gelu-ln"))
def apply_lowmembp(model, share_lora_inputs=True):
    return convert(model, acts=True, norms=True, share_lora_inputs=share_lora_inputs)


@register("lowmembp-act", "LowMemoryBP activations only: GELU→ReGELU2, SiLU→ReSiLU2 (2-bit codes saved)",
          order=20, excludes=("lowmembp", "mesa-gelu-ln"))
def apply_lowmembp_act(model):
    return convert(model, acts=True, norms=False)


@register("lowmembp-norm", "LowMemoryBP norms only: LayerNorm/RMSNorm→MS-norms with γ/β folded into the next linears",
          options=_OPTS, order=20, excludes=("lowmembp", "mesa-gelu-ln"))
def apply_lowmembp_norm(model, share_lora_inputs=True):
    return convert(model, acts=False, norms=True, share_lora_inputs=share_lora_inputs)
