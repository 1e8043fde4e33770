"""``lowmembp.export(model)``: an ordinary model again — stock classes and parameters, the same eval function.

    model = lowmembp.apply(model, "lora+lowmembp"); train(model)
    lowmembp.export(model).save_pretrained(out)                    # peft adapter: PeftModel.from_pretrained(fresh, out)
    plain = lowmembp.export(model, merge_lora=True)                # LoRA merged: loads strictly into a fresh model

A converted model's parameters are not the stock ones (γ / β folded into the consumers, norms without weights), so
its ``state_dict`` does not load into an unconverted model. The export undoes every conversion (on a deep copy unless
``inplace=True``): the result, in eval, computes the same function (fp32: to rounding), its ``state_dict`` loads
strictly into a fresh unconverted model, and ``save_pretrained`` → ``from_pretrained`` round-trips. Where the stock
form cannot hold the trained state exactly it says so: :class:`ExportError`, or a warning for an untied head.
Converted models get ``save_pretrained`` replaced by one that saves ``export(model)``. What the live model cannot
tell is recorded by the conversions (:mod:`lowmembp.methods.export_record`). Method by method, and the exact-form
rules: docs/save-and-reload.md.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn

# Untie too: a model pickled before the record had its own module finds the record's classes here
from lowmembp.methods.export_record import (RECORD, ActSwap, AttentionPatch, ExportRecord, NormFold, Untie,  # noqa: F401
                                     _text_config)

_TOL = 1e-5  # relative: what counts as "zero to rounding" when a term cannot be expressed in the stock form


class ExportError(RuntimeError):
    """The converted model's trained state has no exact form in the original architecture."""


class _SaveExported:
    """The ``save_pretrained`` of a converted model: saves ``export(model)`` (picklable, deepcopy-safe)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        if kwargs.get("state_dict") is not None:
            raise ExportError("save_pretrained(state_dict=...) on a lowmembp-converted model would write the folded "
                              "weights; call lowmembp.export(model).save_pretrained(dir) (no state_dict)")
        kwargs.pop("state_dict", None)
        exported = export(self.model)
        n_bias = sum(1 for n, _ in exported.named_parameters() if ".lora_B." in n and n.endswith(".bias"))
        with warnings.catch_warnings():
            if n_bias:  # peft 0.21 takes every 1-D lora_B tensor for an ungathered ZeRO-3 shard, lora_bias ones too
                warnings.filterwarnings("ignore",
                                        message=rf"Adapter '.*': {n_bias} LoRA tensor\(s\) have invalid shape")
            return exported.save_pretrained(save_directory, *args, **kwargs)


def guard_save(*models: nn.Module) -> None:
    """Make ``save_pretrained`` of each converted model (peft wrapper, transformers model) save the exported form."""
    for m in models:
        if m is not None and callable(getattr(type(m), "save_pretrained", None)):
            object.__setattr__(m, "save_pretrained", _SaveExported(m))


# ---------------------------------------------------------------------------------------------------------- export
def export(model: nn.Module, merge_lora: bool = False, inplace: bool = False) -> nn.Module:
    """An ordinary model computing what the converted ``model`` computes (docs/save-and-reload.md).

    ``merge_lora``: merge peft LoRA adapters into the weights and return the unwrapped timm / transformers model;
    otherwise a peft model keeps its adapters (save them with ``save_pretrained``). ``inplace``: change ``model``
    itself (no copy; the converted model is gone). Raises :class:`ExportError` where no exact stock form exists."""
    from lowmembp.models.layout import unwrap_peft

    if not isinstance(model, nn.Module):
        raise TypeError(f"export expects a torch.nn.Module, got {type(model).__name__}")
    model = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model  # torch.compile
    if not inplace:
        model = copy.deepcopy(model)
    for m in model.modules():  # nn.Module.compile (the 'compile' method): an ordinary eager model comes back
        if m.__dict__.get("_compiled_call_impl") is not None:
            m._compiled_call_impl = None
    base = unwrap_peft(model)
    rec: ExportRecord | None = base.__dict__.get(RECORD)
    _remove_tokentune(model)
    _remove_checkpointing(model, base)
    _remove_tiled_mlp(model)
    _remove_compact(model)
    deltas: dict[tuple[int, str], tuple[nn.Module, torch.Tensor, torch.Tensor]] = {}
    if rec is not None:
        for f in rec.folds:
            _unfold(base, f, deltas)
        for a in reversed(rec.acts):
            _put_back(base, a)
        for at in reversed(rec.attentions):  # the last record of a shared config holds the value before the first
            _unpatch_attention(base, at)
        _retie(base, rec)
    _plain_linears(model)
    _unshare_lora_inputs(model)
    leftovers = sorted({type(m).__name__ for m in base.modules() if (type(m).__module__ or "").startswith("lowmembp.")})
    if leftovers:
        raise ExportError(f"this model holds {', '.join(leftovers)} but no record of the conversion (converted by an "
                          f"older lowmembp, or the modules were placed by hand): export cannot restore the originals")
    model = _finish_lora(model, deltas, merge_lora)
    for m in {id(x): x for x in (model, base, unwrap_peft(model))}.values():
        for key in (RECORD, "_lowmembp_methods", "lowmembp_report", "_checkpointing", "_tiled_mlp",
                    "_mesa_converted", "_lowmembp_compile", "save_pretrained"):
            m.__dict__.pop(key, None)
    return model


def _get(base: nn.Module, path: str) -> nn.Module:
    try:
        return base.get_submodule(path)
    except AttributeError as e:
        raise ExportError(f"the converted module {path!r} is gone (the model was changed after conversion): {e}")


def _set(base: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(base.get_submodule(parent) if parent else base, attr, module)


def _leaves(m: nn.Module, path: str):
    """(path, plain linear) for every linear that folding touched in consumer ``m`` (LoRA A layers excluded)."""
    orig = m._modules.get("original_module")
    if isinstance(orig, nn.Module):  # ModulesToSaveWrapper: the original and every trainable copy
        yield from _leaves(orig, f"{path}.original_module")
        for k, c in (m._modules.get("modules_to_save") or {}).items():
            yield from _leaves(c, f"{path}.modules_to_save.{k}")
        return
    base_layer = m._modules.get("base_layer")
    if isinstance(base_layer, nn.Module) and hasattr(m, "lora_A"):
        yield from _leaves(base_layer, f"{path}.base_layer")
        return
    if not isinstance(getattr(m, "weight", None), torch.Tensor):
        raise ExportError(f"{path}: {type(m).__name__} has no weight to un-fold")
    yield path, m


def _lora_layers(m: nn.Module):
    if isinstance(m._modules.get("original_module"), nn.Module):
        for c in [m.original_module, *(m._modules.get("modules_to_save") or {}).values()]:
            yield from _lora_layers(c)
    elif hasattr(m, "lora_A") and isinstance(m._modules.get("base_layer"), nn.Module):
        yield m


def _is_conv1d(lin: nn.Module) -> bool:
    """transformers ``Conv1D`` (GPT-2): ``x @ W + b``, W stored in×out."""
    return type(lin).__name__ == "Conv1D" and hasattr(lin, "nf")


def _out_in(lin: nn.Module) -> torch.Tensor:
    """The weight as an out×in float64 matrix."""
    w = lin.weight.detach().double()
    return w.t() if _is_conv1d(lin) else w


def _is_zero(v: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """|v| within rounding of ``scale`` (the sum of magnitudes v came from) in parameters of ``dtype``."""
    tol = max(_TOL, 2 * torch.finfo(dtype).eps) if dtype.is_floating_point else _TOL
    return bool((v.abs() <= tol * scale + 1e-30).all())


def _full_precision(base: nn.Module, path: str, lin: nn.Module) -> nn.Module:
    """A consumer leaf that is an NF4 ``Linear4bit`` (``lora`` with ``quantize="nf4"`` quantised it after the fold,
    lowmembp.methods.qlora) becomes an ``nn.Linear`` holding its dequantised weight: a folded 4-bit weight has no
    un-folded 4-bit form, the full-precision one is exact (same function). Other leaves are returned as they are."""
    if type(getattr(lin, "weight", None)).__name__ != "Params4bit":
        return lin
    import bitsandbytes as bnb
    data, qs = lin.weight.data, lin.weight.quant_state
    if getattr(qs, "packing_format_for_cpu", False):  # bitsandbytes repacked it for CPU inference
        data, qs = bnb.functional._convert_weight_packed_for_cpu_inverse(data, qs)
    w = bnb.functional.dequantize_4bit(data, qs).to(qs.dtype)
    new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device=w.device, dtype=w.dtype)
    new.weight = nn.Parameter(w, requires_grad=False)
    if lin.bias is not None:
        new.bias = nn.Parameter(lin.bias.detach().clone().to(w.dtype), requires_grad=False)
    _set(base, path, new)
    owner, _, child = path.rpartition(".")
    if child == "base_layer":  # the LoRA layer may merge again: drop qlora's refusal (an instance attribute)
        _get(base, owner).__dict__.pop("merge", None)
    return new


def _unfold(base: nn.Module, f: NormFold, deltas: dict) -> None:
    consumers = {p: _get(base, p) for p in f.consumers}
    leaves = [(p, _full_precision(base, p, lin), f.stock_bias.get(cp, True)) for cp, c in consumers.items()
              for p, lin in _leaves(c, cp)]
    ref = leaves[0][1].weight if leaves else None
    g0 = None if f.gamma is None or f.gamma.is_meta else f.gamma.double().cpu()
    b0 = None if f.beta is None or f.beta.is_meta else f.beta.double().cpu()
    post = bool(f.residuals)
    if post:
        receivers = [_get(base, p) for p in f.residuals]
        ras = [r._modules.get("residual_affine") for r in receivers]
        if any(ra is None for ra in ras):
            raise ExportError(f"{f.path}: a residual_affine recorded at conversion is gone")
        gamma = None if ras[0].weight is None else ras[0].weight.detach().double().cpu()
        beta = None if ras[0].bias is None else ras[0].bias.detach().double().cpu()
        for ra in ras[1:]:
            for a, b in ((ra.weight, gamma), (ra.bias, beta)):
                if (a is None) != (b is None) or (a is not None and not torch.allclose(a.detach().double().cpu(), b)):
                    raise ExportError(f"{f.path}: its residual affines were trained apart; one norm cannot hold both")
    else:
        n = _out_in(leaves[0][1]).shape[1] if leaves else None
        gamma = g0 if f.gamma is not None else None
        if gamma is None and f.gamma is not None:  # recorded on meta: any γ is exact for a pre-norm site
            gamma = torch.ones(n, dtype=torch.float64)
        beta = b0 if f.beta is not None else None
        if beta is None and f.beta is not None:
            beta = torch.zeros(n, dtype=torch.float64)
    inv = None
    if gamma is not None:
        zero = gamma == 0
        if post and bool(zero.any()):  # the residual needs this γ as it is: W'·diag(1/γ) must not read those channels
            readers = [(p, _out_in(lin)) for p, lin, _ in leaves]
            readers += [(f"{cp}.lora_A.{k}", a.weight) for cp, c in consumers.items() for layer in _lora_layers(c)
                        for k, a in layer.lora_A.items()]
            for p, w in readers:
                if not bool((w.detach()[:, zero.to(w.device)] == 0).all()):
                    raise ExportError(f"{f.path}: γ has zeros on the residual path, but {p} was trained to read those "
                                      f"channels; no stock (γ, W) gives W·diag(γ) = W'")
            inv = torch.where(zero, torch.zeros_like(gamma), 1.0 / torch.where(zero, torch.ones_like(gamma), gamma))
        else:  # pre-norm: any nonzero γ is exact; a zero entry becomes 1
            gamma = torch.where(zero, torch.ones_like(gamma), gamma)
            inv = 1.0 / gamma
    if beta is not None:
        beta = _fit_beta(f, leaves, inv, beta, post)
    for p, lin, had_bias in leaves:
        _unfold_linear(lin, inv, beta, had_bias, p)
    for cp, c in consumers.items():
        for layer in _lora_layers(c):
            _unfold_lora(layer, inv, beta, cp, deltas)
    # the stock norm: the recorded module with the chosen (γ, β)
    stock = copy.deepcopy(f.original)
    for name, val, folded in (("weight", gamma, f.gamma), ("bias", beta, f.beta)):
        p0 = getattr(f.original, name, None)
        if not isinstance(p0, torch.Tensor) or val is None:
            continue
        # Gemma-like norms hold w with γ = 1 + w: keep the offset between the folded γ and the module's parameter
        offset = (0.0 if folded is None or folded.is_meta or p0.is_meta
                  else folded.double().cpu() - p0.detach().double().cpu())
        new = (val - offset).to(device=ref.device if ref is not None else p0.device,
                                dtype=ref.dtype if ref is not None else p0.dtype)
        setattr(stock, name, nn.Parameter(new, requires_grad=p0.requires_grad))
    _set(base, f.path, stock)
    from lowmembp.models.fold import remove_residual_affine

    for r in (_get(base, p) for p in f.residuals):
        remove_residual_affine(r)


def _fit_beta(f: NormFold, leaves, inv, beta, post: bool) -> torch.Tensor:
    """β such that every consumer without a stock bias gets a zero bias back (``W'·(β/γ) = b'``), closest to
    ``beta``."""
    rows = [(_out_in(lin).cpu(), lin.bias.detach().double().cpu(), p)
            for p, lin, had in leaves if not had and lin.bias is not None]
    if not rows:
        return beta
    dtype = leaves[0][1].weight.dtype
    M = torch.cat([w for w, _, _ in rows])
    c = torch.cat([b for _, b, _ in rows])
    x = beta * inv if inv is not None else beta.clone()
    scale = M.abs() @ x.abs() + c.abs()
    if _is_zero(c - M @ x, scale, dtype):
        return beta
    if not post:
        x = x + torch.linalg.pinv(M) @ (c - M @ x)
        scale = M.abs() @ x.abs() + c.abs()
        if _is_zero(c - M @ x, scale, dtype):
            return x / inv if inv is not None else x
    raise ExportError(f"{f.path}: {', '.join(p for *_, p in rows)} had no bias before lowmembp folded β into it, and "
                      f"training moved that bias to where no β of the norm reproduces it; the stock model cannot "
                      f"express it (freeze those biases while training, or export to a model whose linear has a bias)")


def _unfold_linear(lin: nn.Module, inv, beta, had_bias: bool, path: str) -> None:
    w = lin.weight
    with torch.no_grad():
        wd = _out_in(lin)
        W = wd * inv.to(wd.device) if inv is not None else wd
        if lin.bias is not None:
            b = lin.bias.detach().double()
            if beta is not None:
                b = b - W @ beta.to(wd.device)
            if not had_bias:
                scale = lin.bias.detach().double().abs() + W.abs() @ (beta.abs().to(wd.device)
                                                                          if beta is not None else 0)
                if not _is_zero(b, scale, w.dtype):
                    raise ExportError(f"{path}: the bias lowmembp created while folding is {b.abs().max():.3g} away "
                                      f"from zero after un-folding; the stock layer has no bias")
                lin.register_parameter("bias", None)
            else:
                lin.bias.copy_(b.to(lin.bias.dtype))
        w.copy_((W.t() if _is_conv1d(lin) else W).to(w.dtype))


def _unfold_lora(layer: nn.Module, inv, beta, path: str, deltas: dict) -> None:
    """``A = A'·diag(1/γ)``; the term ``B·(A_bias − A·β)`` a stock LoRA cannot hold goes to ``deltas``."""
    for name, a in layer.lora_A.items():
        if not isinstance(a, nn.Linear):
            raise ExportError(f"{path}.lora_A.{name} is {type(a).__name__}, not a Linear")
        with torch.no_grad():
            ad = a.weight.detach().double()
            A = ad * inv.to(ad.device) if inv is not None else ad
            ab = a.bias.detach().double() if a.bias is not None else torch.zeros(ad.shape[0], dtype=ad.dtype,
                                                                                   device=ad.device)
            ax = A @ beta.to(ad.device) if beta is not None else torch.zeros_like(ab)
            r = ab - ax
            a.weight.copy_(A.to(a.weight.dtype))
            a.register_parameter("bias", None)
            B = layer.lora_B[name].weight.detach().double()
            c = B @ r
            scale = B.abs() @ (ab.abs() + ax.abs())
            key = (id(layer), name)
            if key in deltas:
                c, scale = c + deltas[key][1], scale + deltas[key][2]
            deltas[key] = (layer, c, scale, a.weight.dtype)


def _retie(base: nn.Module, rec: ExportRecord) -> None:
    untied = []
    for u in rec.unties:
        mine, other = _get(base, u.path), _get(base, u.tied_to)
        a, b = mine.weight.detach(), other.weight.detach()
        if a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=_TOL, atol=_TOL * float(b.abs().max())):
            mine.weight = other.weight
        else:
            untied.append(u)
    cfg = getattr(base, "config", None)
    if untied:
        warnings.warn(f"lowmembp.methods.export: {', '.join(u.path for u in untied)} "
                      f"no longer equal(s) the weight it was tied "
                      f"to ({', '.join(u.tied_to for u in untied)}) after training; exported untied with "
                      f"tie_word_embeddings=False (save_pretrained/from_pretrained round-trip; a fresh tied model "
                      f"cannot hold it)", stacklevel=3)
        return
    for key, val in rec.tie_config.items():
        c = cfg if key == "" else _text_config(cfg)
        if c is not None:
            c.tie_word_embeddings = val


def _unshare_lora_inputs(model: nn.Module) -> None:
    from lowmembp.ops.shared_linear import CastWeightLinear
    for m in model.modules():
        if type(m) is CastWeightLinear:
            m.__class__ = nn.Linear
        if hasattr(m, "lora_A") and getattr(m, "cast_input_dtype_enabled", True) is False:
            m.cast_input_dtype_enabled = True


def _finish_lora(model: nn.Module, deltas: dict, merge: bool) -> nn.Module:
    live = {k: v for k, v in deltas.items() if not _is_zero(v[1], v[2], v[3])}
    is_peft = callable(getattr(model, "merge_and_unload", None)) and hasattr(model, "peft_config")
    if merge:
        for (_, name), (layer, c, *_) in live.items():
            lin = layer.get_base_layer()
            if lin.bias is None:
                raise ExportError(f"{type(layer).__name__} on a linear without bias: its trained LoRA A bias term "
                                  f"B·(A_bias − A·β) cannot be merged exactly (export with merge_lora=False)")
            with torch.no_grad():
                lin.bias.add_((c * layer.scaling[name]).to(lin.bias.dtype))
        return model.merge_and_unload() if is_peft else model
    if not live:
        return model
    if not is_peft:
        raise ExportError("a trained LoRA A bias term remains but the model is not a peft model; use merge_lora=True")
    names = {name for (_, name) in live}
    for layer in model.modules():
        if not (hasattr(layer, "lora_B") and isinstance(layer._modules.get("base_layer"), nn.Module)):
            continue
        for name in names & set(layer.lora_B.keys()):
            lb = layer.lora_B[name]
            c = live.get((id(layer), name), (None, None))[1]
            if lb.bias is None:
                lb.register_parameter("bias", nn.Parameter(lb.weight.new_zeros(lb.out_features),
                                                           requires_grad=lb.weight.requires_grad))
            if c is not None:
                with torch.no_grad():
                    lb.bias.add_(c.to(lb.bias.dtype))
            layer.lora_bias[name] = True
    for name in names:
        model.peft_config[name].lora_bias = True
    return model


def _put_back(base: nn.Module, swap: ActSwap) -> None:
    """The recorded original in its place again, holding the live parameters of the module that replaced it."""
    live = _get(base, swap.path)
    orig = swap.original
    for name, p in live._parameters.items():
        if name in orig._parameters and p is not None:
            orig._parameters[name] = p
    _set(base, swap.path, orig)


def _unpatch_attention(base: nn.Module, at: AttentionPatch) -> None:
    attn = _get(base, at.path)
    for name in ("mesa_qk", "mesa_softmax", "mesa_av"):
        attn._modules.pop(name, None)
    attn.__dict__.pop("forward", None)
    if at.fused_attn is not None:
        attn.fused_attn = at.fused_attn
    cfg = getattr(attn, "config", None)
    if cfg is not None and at.attn_implementation is not None:
        cfg._attn_implementation = at.attn_implementation


def _plain_linears(model: nn.Module) -> None:
    """Mesa's linears (it converts only exact ``nn.Linear`` s) back to ``nn.Linear``, same parameters."""
    from lowmembp.ops.mesa_layers import MesaLinear
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is MesaLinear:
                lin = nn.Linear.__new__(nn.Linear)
                nn.Module.__init__(lin)
                lin.in_features, lin.out_features = child.in_features, child.out_features
                lin.weight, lin.bias = child.weight, child.bias
                setattr(parent, name, lin)


def _remove_tokentune(model: nn.Module) -> None:
    for m in model.modules():
        d = m.__dict__
        if "_tokentune_attr" in d:
            attr, orig = d.pop("_tokentune_attr"), d.pop("_tokentune_original", None)
            d.pop("_tokentune_fn", None)
            d.pop(attr, None)
            if orig is not None:
                d[attr] = orig
        d.pop("_tokentune", None)


def _remove_checkpointing(model: nn.Module, base: nn.Module) -> None:
    for m in model.modules():
        d = m.__dict__
        if d.pop("_lowmembp_checkpointed", False):
            inner = d.pop("_lowmembp_inner_forward", None)
            d.pop("forward", None)
            if inner is not None:
                d["forward"] = inner
    how = (model.__dict__.get("_checkpointing") or {}).get("how")
    if how == "timm" and hasattr(base, "set_grad_checkpointing"):
        base.set_grad_checkpointing(False)
    elif how == "transformers" and hasattr(base, "gradient_checkpointing_disable"):
        base.gradient_checkpointing_disable()


def _remove_tiled_mlp(model: nn.Module) -> None:
    """``tiled-mlp``'s instance-level MLP calls removed (an earlier override they wrapped put back)."""
    for m in model.modules():
        d = m.__dict__
        tiled = d.pop("_lowmembp_tiled_mlp", None)
        if tiled is not None:
            d.pop(tiled["attr"], None)
            if tiled["inner"] is not None:
                d[tiled["attr"]] = tiled["inner"]


def _remove_compact(model: nn.Module) -> None:
    """``compact``'s instance-level linear forwards removed (the class's own forward back)."""
    for m in model.modules():
        if m.__dict__.pop("_compact", None) is not None:
            m.__dict__.pop("forward", None)


__all__ = ["export", "ExportError", "guard_save"]
