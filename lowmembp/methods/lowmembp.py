"""``lowmembp``, ``lowmembp-act``, ``lowmembp-norm``: LowMemoryBP (Yang et al., ICML 2024) as one call on a real model.

    model = lowmembp.apply(model, "lowmembp")          # or "lora+lowmembp", "lowmembp-act", "lowmembp-norm"

``lowmembp-act`` replaces activations by their approximate-backward forms (erf-GELU → ``ReGELU2``, SiLU →
``ReSiLU2``, others through ``approx_act.make_approx``): exact forward, 2-bit codes saved instead of the input.
``lowmembp-norm`` replaces every foldable LayerNorm / RMSNorm by an MS norm without affine and folds γ and β into
every linear that reads it (:mod:`lowmembp.models.fold`, in float64; LoRA branches too), so the norm and the next
linear save one tensor between them. ``lowmembp`` does both, then checks every converted site against the original
(:mod:`lowmembp.methods._verify`); ``lowmembp_report`` lists each site, converted or kept, and why. Option
``norm_dtype``: the dtype the MS norms emit and save. Exact in the forward (fp32: to rounding) except where the report
says otherwise. The math: docs/design.md#approx-act and #ms-norms; the exceptions, the refusals and ``norm_dtype``:
docs/methods/lowmembp.md.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from lowmembp.methods.export import guard_save
from lowmembp.methods.export_record import record_act, record_fold
from lowmembp.methods.registry import register
from lowmembp.models import UnsupportedModelError, get_layout
from lowmembp.models.fold import fold_into, install_residual_affine, shared_parameters

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


def _ms_norm_like(ns, out_dtype: str = "auto") -> nn.Module:
    """The MS norm taking the place of the norm at site ``ns`` (kind, width and eps from the layout)."""
    from lowmembp.ops.ms_norm import MSLayerNorm, MSRMSNorm
    width, eps = ns.width(), ns.eps
    if width is None or eps is None:
        raise UnsupportedModelError(f"{ns.path}: cannot read the width / eps of {type(ns.get()).__name__}")
    new = (MSLayerNorm((width,), eps=eps, out_dtype=out_dtype) if ns.kind == "layernorm"
           else MSRMSNorm(width, eps=eps, out_dtype=out_dtype))
    w = getattr(ns.get(), "weight", None)
    return new.to(w.device) if isinstance(w, torch.Tensor) and not w.is_meta else new


def _untie_config(base: nn.Module) -> None:
    cfg = getattr(base, "config", None)
    if cfg is None:
        return
    for c in (cfg, getattr(cfg, "get_text_config", lambda: None)()):
        if c is not None and getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False


def _approx_for(kind: str):
    """The module replacing an activation of ``kind``, or (None, why) when this build cannot convert it."""
    from lowmembp.ops import approx_act
    if kind == "gelu":
        return approx_act.ReGELU2(), ""
    if kind == "silu":
        return approx_act.ReSiLU2(), ""
    make = getattr(approx_act, "make_approx", None)
    if make is None:
        return None, f"no approximate {kind} in lowmembp.ops.approx_act (make_approx missing)"
    try:
        return make(kind), ""
    except (ValueError, NotImplementedError) as e:
        return None, f"make_approx({kind!r}) refused: {e}"


def convert(model: nn.Module, *, acts: bool = True, norms: bool = True, share_lora_inputs: bool = True,
            verify: bool = True, norm_dtype: str = "auto") -> nn.Module:
    """Convert ``model`` in place (docs/methods/lowmembp.md); returns it, with ``lowmembp_report`` on the base.

    ``verify`` (default True): every converted site is checked against a copy of the original on random inputs
    (lowmembp.methods._verify); a mismatch raises naming the site. ``norm_dtype``: the MS norms' output dtype
    (``"auto"``, ``"fp32"`` or ``"input"``)."""
    from lowmembp.methods._verify import check_act, check_norm, snapshot_norm
    from lowmembp.ops.ms_norm import check_out_dtype

    check_out_dtype(norm_dtype, "lowmembp: norm_dtype")
    wide = norm_dtype != "auto"

    lay = get_layout(model)
    _refuse_twice(lay.base, acts, norms)
    from lowmembp._compat import detect_fake_mode, is_fake
    verify = verify and not any(p.is_meta or is_fake(p) for p in lay.base.parameters()) \
        and detect_fake_mode() is None
    _refuse_dtype(lay.base)
    report = {"family": lay.family, "origin": lay.origin, "norms": [], "kept": [], "acts": [], "skipped_acts": [],
              "sites": []}
    sites = report["sites"]
    if norms:
        shared = shared_parameters(lay.base)
        untied = False
        for ns in lay.all_norms():
            if not ns.foldable or not (ns.consumers or ns.residual_consumers):
                why = ns.why or "no known readers"
                report["kept"].append((ns.path, why))
                sites.append({"site": ns.path, "what": "norm", "status": "kept", "why": why})
                continue
            norm = ns.get()
            gamma, beta = ns.affine()
            snap = snapshot_norm(ns) if verify else None
            record_fold(lay.base, norm, gamma, beta, [c.get() for c in ns.consumers],
                        [r.get() for r in ns.residual_consumers])  # what lowmembp.methods.export needs to undo this
            for c in ns.consumers:
                lin = c.get()
                untied |= any(id(p) in shared for p in lin.parameters())
                fold_into(lin, gamma, beta, c.path, shared)
                if wide and type(lin) is nn.Linear:  # save the norm's wide output itself, not autocast's copy
                    from lowmembp.ops.shared_linear import CastWeightLinear
                    lin.__class__ = CastWeightLinear
                    lin.save_wide_input = True
            for i, r in enumerate(ns.residual_consumers):
                arg = ns.residual_args[i] if i < len(ns.residual_args) else 1
                install_residual_affine(r.get(), gamma, beta, arg=arg)
            ns.set(_ms_norm_like(ns, norm_dtype))
            if snap is not None:
                check_norm(ns, snap)
            report["norms"].append(ns.path)
            sites.append({"site": ns.path, "what": "norm", "status": "converted",
                          "into": [c.path for c in ns.consumers] + [r.path + " (residual)"
                                                                   for r in ns.residual_consumers]})
        if untied:
            _untie_config(lay.base)
        if share_lora_inputs and any(hasattr(m, "lora_A") for m in lay.base.modules()):
            from lowmembp.ops.shared_linear import share_lora_inputs as _share
            _share(lay.base, save_wide_inputs=wide)
    if acts:
        for a in lay.acts:
            old = a.get()
            new, why = _approx_for(a.kind)
            if new is None:
                report["skipped_acts"].append((a.path, why))
                sites.append({"site": a.path, "what": f"act:{a.kind}", "status": "kept", "why": why})
                continue
            record_act(lay.base, old)  # lowmembp.methods.export puts it back
            a.set(new)
            if verify:
                check_act(a, old)
            report["acts"].append(a.path)
            sites.append({"site": a.path, "what": f"act:{a.kind}", "status": "converted"})
        if not report["acts"]:
            warnings.warn(f"lowmembp: no convertible activation found in this {lay.family} model "
                          f"({'; '.join(w for _, w in report['skipped_acts']) or 'none of a known kind'}); "
                          f"activations left as they are", stacklevel=3)
    object.__setattr__(lay.base, "lowmembp_report", report)
    guard_save(lay.model, lay.base)  # save_pretrained saves lowmembp.export(model), not the folded weights
    return model


def _refuse_dtype(base: nn.Module) -> None:
    bad = {p.dtype for p in base.parameters() if p.is_floating_point()} - {torch.float32, torch.float16,
                                                                            torch.bfloat16}
    if bad:
        raise UnsupportedModelError(
            f"lowmembp: parameters of dtype {', '.join(map(str, sorted(bad, key=str)))} are not supported (MS norms "
            f"and the approximate activations run in float32, float16 and bfloat16): convert model.float() (or "
            f".half() / .bfloat16()) first")


_OPTS = {"share_lora_inputs": True, "norm_dtype": "auto"}


def _check_options(share_lora_inputs=True, norm_dtype="auto"):
    from lowmembp.ops.ms_norm import check_out_dtype
    check_out_dtype(norm_dtype, "lowmembp: norm_dtype")


@register("lowmembp", "LowMemoryBP: ReGELU2/ReSiLU2 activations + MS-LayerNorm/MS-RMSNorm with γ/β folded into the "
          "next linears (exact forward, less activation memory; option norm_dtype)", options=_OPTS, order=20,
          excludes=("lowmembp-act", "lowmembp-norm", "mesa-gelu-ln"), parts=("lowmembp-act", "lowmembp-norm"),
          check=_check_options, changes_weights=True)
def apply_lowmembp(model, share_lora_inputs=True, norm_dtype="auto"):
    return convert(model, acts=True, norms=True, share_lora_inputs=share_lora_inputs, norm_dtype=norm_dtype)


@register("lowmembp-norm", "LowMemoryBP norms only: LayerNorm/RMSNorm→MS-norms with γ/β folded into the next "
          "linears (option norm_dtype)", options=_OPTS, order=20, excludes=("lowmembp", "mesa-gelu-ln"),
          check=_check_options, shown_by=lambda layers: any(name in ("MSLayerNorm", "MSRMSNorm") for _, name in layers),
          changes_weights=True)
def apply_lowmembp_norm(model, share_lora_inputs=True, norm_dtype="auto"):
    return convert(model, acts=False, norms=True, share_lora_inputs=share_lora_inputs, norm_dtype=norm_dtype)


@register("lowmembp-act", "LowMemoryBP activations only: GELU→ReGELU2, SiLU→ReSiLU2 (2-bit codes saved)",
          order=20, excludes=("lowmembp", "mesa-gelu-ln"),
          shown_by=lambda layers: any(module.startswith("lowmembp.ops.approx_act") for module, _ in layers))
def apply_lowmembp_act(model):
    return convert(model, acts=True, norms=False)
