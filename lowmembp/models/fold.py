"""Folding a norm's affine map (γ, β) into the linear layers that read its output (docs/design.md#ms-norms).

A consumer computed ``W·(γ⊙y + β) + b``; after folding it computes ``W'·y + b'`` with ``W' = W·diag(γ)`` and
``b' = b + W·β``: the same function of the normalised ``y``, so the norm before it can drop its affine map and its
output can be the very tensor the linear saves. Arithmetic in float64, cast back to the weight dtype. A peft LoRA
layer's ``lora_A`` reads the same input and is folded too (``A' = A·diag(γ)`` and a new bias ``A·β``), leaving B and
its gradients unchanged; a post-norm residual gets γ/β re-applied instead (:class:`ResidualAffine`). Parameters are
updated in place, on real, meta and fake tensors alike. What is refused, tied weights, and how gradients map back by
the chain rule: docs/design.md#ms-norms.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _fold_conv1d(lin: nn.Module, gamma, beta, where: str, shared: set[int]) -> None:
    """transformers ``Conv1D`` (GPT-2): ``y = x @ W + b`` with W in×out, so ``W' = diag(γ)·W``, ``b' = b + βᵀ·W``."""
    _check_weight(lin, where)
    w = lin.weight
    if id(w) in shared:
        w = nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
        lin.weight = w
    with torch.no_grad():
        wd = w.detach().double()
        if beta is not None:
            shift = beta.detach().double() @ wd
            if lin.bias is None:
                lin.bias = nn.Parameter(w.new_zeros(w.shape[1]), requires_grad=w.requires_grad)
            lin.bias.copy_((lin.bias.detach().double() + shift).to(lin.bias.dtype))
        if gamma is not None:
            w.copy_((wd * gamma.detach().double()[:, None]).to(w.dtype))


def _check_weight(lin: nn.Linear, where: str) -> None:
    w = lin.weight
    if not (isinstance(w, torch.Tensor) and w.is_floating_point()) or type(w).__name__ in ("Params4bit", "Int8Params"):
        raise TypeError(f"{where}: cannot fold a norm into a {type(w).__name__} weight of dtype {w.dtype} "
                        f"(quantised layers, e.g. bitsandbytes 4/8-bit, are not supported: "
                        f"convert before quantising; for "
                        f"QLoRA apply both in one call, lowmembp.apply(model, 'lora+lowmembp', quantize='nf4'), "
                        f"which folds first and quantises after)")


def _fold_linear(lin: nn.Linear, gamma, beta, where: str, shared: set[int]) -> None:
    _check_weight(lin, where)
    w = lin.weight
    if id(w) in shared:  # tied (e.g. lm_head and embed_tokens): give this linear its own copy
        w = nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
        lin.weight = w
    with torch.no_grad():
        wd = w.detach().double()
        if beta is not None:
            shift = wd @ beta.detach().double()
            if lin.bias is None:
                lin.bias = nn.Parameter(w.new_zeros(w.shape[0]), requires_grad=w.requires_grad)
            lin.bias.copy_((lin.bias.detach().double() + shift).to(lin.bias.dtype))
        if gamma is not None:
            w.copy_((wd * gamma.detach().double()).to(w.dtype))


def fold_into(module: nn.Module, gamma, beta, where: str = "", shared: set[int] | None = None) -> None:
    """Fold ``(γ, β)`` into ``module`` — an ``nn.Linear``, a peft LoRA ``Linear`` or a ``ModulesToSaveWrapper``."""
    shared = shared or set()
    if gamma is None and beta is None:
        return
    if isinstance(getattr(module, "original_module", None), nn.Module):  # peft ModulesToSaveWrapper
        fold_into(module.original_module, gamma, beta, where, shared)
        for name, copy in getattr(module, "modules_to_save", {}).items():
            fold_into(copy, gamma, beta, f"{where}[{name}]", shared)
        return
    if isinstance(module, nn.Linear) and not hasattr(module, "lora_A"):
        _fold_linear(module, gamma, beta, where, shared)
        return
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        _fold_conv1d(module, gamma, beta, where, shared)
        return
    base = getattr(module, "base_layer", None)
    if isinstance(base, nn.Module) and hasattr(module, "lora_A"):
        if getattr(module, "merged", False):
            raise RuntimeError(f"{where}: LoRA adapters are merged into the base weight; unmerge them before "
                               f"converting (peft: model.unmerge_adapter())")
        # VeLoRA changes only A's backward (a compressed input): it folds as plain LoRA
        variants = {k: v for k, v in (getattr(module, "lora_variant", {}) or {}).items()
                    if getattr(v, "__name__", type(v).__name__) != "VeloraLinearVariant"}
        dora = [k for k, v in (getattr(module, "use_dora", {}) or {}).items() if v]
        if variants or dora:
            raise NotImplementedError(f"{where}: LoRA variants ({', '.join(list(variants) or dora)}: DoRA, ...) "
                                      f"depend on the base weight's column norms; only plain LoRA can be folded")
        fold_into(base, gamma, beta, f"{where}.base_layer", shared)
        for name, a in module.lora_A.items():
            if not isinstance(a, nn.Linear):
                raise NotImplementedError(f"{where}.lora_A[{name}] is {type(a).__name__}, not a Linear")
            _fold_linear(a, gamma, beta, f"{where}.lora_A.{name}", shared)
        return
    raise NotImplementedError(f"{where}: cannot fold a norm into {type(module).__name__}; expected nn.Linear, a "
                              f"peft LoRA Linear or a peft ModulesToSaveWrapper")


def shared_parameters(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (tied weights)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


class ResidualAffine(nn.Module):
    """``x ↦ γ⊙x + β`` on the residual path of a post-norm block whose norm became an MS-norm (BERT / RoBERTa).

    Installed on the module that receives the norm output as its residual argument (``BertSelfOutput`` /
    ``BertOutput``: ``forward(hidden_states, input_tensor)``) as the child ``residual_affine`` plus a forward
    pre-hook that maps ``input_tensor`` through it. Saves for backward: ``x`` (the MS-norm output, the storage the
    next linear saves anyway: 0 extra bytes) when γ is trainable; nothing else per element.
    """
    memory_kind = "norm"

    def __init__(self, gamma: torch.Tensor | None, beta: torch.Tensor | None):
        super().__init__()
        self.weight = None if gamma is None else nn.Parameter(gamma.detach().clone(), gamma.requires_grad)
        self.bias = None if beta is None else nn.Parameter(beta.detach().clone(), beta.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and self.bias is not None:
            return torch.addcmul(self.bias, x, self.weight)
        if self.weight is not None:
            return x * self.weight
        return x + self.bias if self.bias is not None else x


def _residual_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    ra = module.residual_affine
    key = module.__dict__.get("_lowmembp_residual_arg", 1)
    if isinstance(key, str):
        if key in kwargs:
            return args, {**kwargs, key: ra(kwargs[key])}
        raise TypeError(f"{type(module).__name__}: expected the normalised input as keyword argument {key!r} (as "
                        f"in the forward lowmembp traced)")
    if key != 1:
        if len(args) > key:
            return args[:key] + (ra(args[key]),) + tuple(args[key + 1:]), kwargs
        raise TypeError(f"{type(module).__name__}: expected the normalised input as positional argument {key} (as "
                        f"in the forward lowmembp traced)")
    if len(args) >= 2:
        return (args[0], ra(args[1])) + tuple(args[2:]), kwargs
    if "input_tensor" in kwargs:
        return args, {**kwargs, "input_tensor": ra(kwargs["input_tensor"])}
    raise TypeError(f"{type(module).__name__}: expected the residual as the second argument or 'input_tensor'")


def install_residual_affine(receiver: nn.Module, gamma, beta, arg: int | str = 1) -> None:
    """Re-apply ``(γ, β)`` to the residual argument of ``receiver`` (see :class:`ResidualAffine`): positional
    argument ``arg`` (default 1, BERT's ``input_tensor``, also found by that keyword) or the keyword ``arg``."""
    if gamma is None and beta is None:
        return
    if hasattr(receiver, "residual_affine"):
        raise RuntimeError(f"{type(receiver).__name__} already has a residual_affine (converted twice?)")
    receiver.residual_affine = ResidualAffine(gamma, beta)
    if arg != 1:
        object.__setattr__(receiver, "_lowmembp_residual_arg", arg)
    receiver.register_forward_pre_hook(_residual_pre_hook, with_kwargs=True)


def remove_residual_affine(receiver: nn.Module) -> None:
    """Undo :func:`install_residual_affine` on ``receiver`` (the export's way back to the stock model)."""
    receiver._modules.pop("residual_affine", None)
    receiver.__dict__.pop("_lowmembp_residual_arg", None)
    for k in [k for k, h in receiver._forward_pre_hooks.items() if h is _residual_pre_hook]:
        receiver._forward_pre_hooks.pop(k)
        getattr(receiver, "_forward_pre_hooks_with_kwargs", {}).pop(k, None)
