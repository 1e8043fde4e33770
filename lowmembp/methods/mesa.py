"""``mesa`` and ``mesa-gelu-ln``: Mesa-style 8-bit activation compression (Pan et al., 2021; docs/design.md#mesa).

- ``mesa``: every ``nn.Linear``, GELU / SiLU activation and LayerNorm / RMSNorm of the model becomes a Mesa layer
  (:mod:`lowmembp.ops.mesa_layers`), and so do attention's two matmuls and its softmax where ``mesa_attention``
  says (``"auto"``: only attention that already runs eagerly; ``"eager"``: switch it to eager first, Mesa's own
  setting; ``"keep"``: never).
- ``mesa-gelu-ln``: only the activations and norms, the comparison of the LowMemoryBP paper's Figure 1.

Each Mesa layer saves an 8-bit copy of what its backward needs, with per-group ranges tracked as an EMA
(``mesa_groups``, ``mesa_momentum``). Range state lives in non-persistent buffers, so checkpoints of a converted model
load into an unconverted one and back. Which layers and attention forms are converted, and how the EMA behaves when
activations grow fast: docs/methods/mesa.md.
"""
from __future__ import annotations

import sys
import types

import torch
import torch.nn as nn

from lowmembp.methods.export_record import record_attention, record_swap
from lowmembp.methods.registry import register
from lowmembp.ops.mesa_layers import (MesaAct, MesaLayerNorm, MesaLinear, MesaMatMul, MesaRMSNorm, MesaSoftmax)
from lowmembp.ops.mesa_quant import MOMENTUM, EMAQuantizer

_EXCLUDES = ("lowmembp", "lowmembp-act", "lowmembp-norm")
_ATTENTION_MODES = ("auto", "eager", "keep")
HF_IMPL = "mesa_eager"
_MESA_ACT_KINDS = ("gelu", "gelu_tanh", "silu")


def _shows_mesa(layers: set, linears: bool) -> bool:
    """Whether layers ``{(module, class name)}`` show Mesa's conversion (with its linears, or without)."""
    mesa = any(module.startswith("lowmembp.ops.mesa_layers") for module, _ in layers)
    return mesa and linears == any(name == "MesaLinear" for _, name in layers)


@register("mesa", "Mesa 8-bit activations: Linear, GELU/SiLU, LayerNorm/RMSNorm inputs and eager attention "
          "(softmax, matmuls) saved in int8 with EMA ranges",
          options={"mesa_groups": 8, "mesa_attention": "auto", "mesa_momentum": MOMENTUM},
          order=30, excludes=("mesa-gelu-ln",) + _EXCLUDES, covers=("mesa-gelu-ln",),
          shown_by=lambda layers: _shows_mesa(layers, linears=True))
def apply_mesa(model: nn.Module, mesa_groups: int = 8, mesa_attention: str = "auto",
               mesa_momentum: float = MOMENTUM) -> nn.Module:
    return convert(model, linears=True, acts=True, norms=True, attention=mesa_attention, groups=mesa_groups,
                   momentum=mesa_momentum)


@register("mesa-gelu-ln", "Mesa 8-bit activations on GELU/SiLU and LayerNorm/RMSNorm only (LowMemoryBP Fig. 1)",
          options={"mesa_groups": 8, "mesa_momentum": MOMENTUM}, order=30, excludes=("mesa",) + _EXCLUDES,
          shown_by=lambda layers: _shows_mesa(layers, linears=False))
def apply_mesa_gelu_ln(model: nn.Module, mesa_groups: int = 8, mesa_momentum: float = MOMENTUM) -> nn.Module:
    return convert(model, linears=False, acts=True, norms=True, attention="keep", groups=mesa_groups,
                   momentum=mesa_momentum)


def convert(model: nn.Module, *, linears: bool, acts: bool, norms: bool, attention: str, groups: int,
            momentum: float = MOMENTUM) -> nn.Module:
    """Swap the chosen layers of ``model`` for Mesa layers in place; return ``model``.

    ``momentum`` is set on every Mesa range tracker of the model (those converted before included).

    Records what was converted in ``model._mesa_converted`` (counts by layer kind).
    """
    from lowmembp.models import get_layout

    if attention not in _ATTENTION_MODES:
        raise ValueError(f"mesa_attention must be one of {_ATTENTION_MODES}, got {attention!r}")
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"mesa_groups must be a positive integer, got {groups!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"mesa_momentum must be a number in [0, 1) (0.9 is Mesa's; 0 uses each batch's own range), "
                         f"got {momentum!r}")
    layout = get_layout(model)
    bad = {p.dtype for p in layout.base.parameters() if p.is_floating_point()} - {torch.float32, torch.float16,
                                                                                  torch.bfloat16}
    if bad:  # refuse now, not in the first training forward (Mesa's 8-bit quantiser takes 16/32-bit floats)
        raise TypeError(f"mesa: parameters of dtype {', '.join(sorted(map(str, bad)))} are not supported (Mesa "
                        f"quantises float32, float16 and bfloat16 activations): convert model.float() first")
    done = {"linear": 0, "act": 0, "norm": 0, "attention": 0}
    if attention != "keep":
        for site in layout.attentions:
            if not hasattr(site.get(), "mesa_qk"):
                record_attention(layout.base, site.get())  # lowmembp.methods.export undoes it
            done["attention"] += _convert_attention(site.get(), layout, attention)
    if acts:
        for site in layout.acts:
            m = site.get()
            if isinstance(m, MesaAct):
                continue
            kind = site.kind
            if kind not in _MESA_ACT_KINDS:  # quick_gelu, relu, relu2: no Mesa layer; kept exact
                continue
            record_swap(layout.base, m)  # lowmembp.methods.export puts it back
            site.set(_placed(MesaAct(kind, groups), m, site.owner, layout.base))
            done["act"] += 1
    if norms:
        for site in layout.all_norms():
            m = site.get()
            if isinstance(m, (MesaLayerNorm, MesaRMSNorm)):
                continue
            if site.gamma_offset:  # Gemma's (1 + w) form: MesaRMSNorm multiplies by its weight as stored
                continue
            if site.kind in ("layernorm", "rmsnorm"):
                record_swap(layout.base, m)  # lowmembp.methods.export puts it back
            if site.kind == "layernorm" and isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
                site.set(MesaLayerNorm.from_layernorm(m, groups))
            elif site.kind == "rmsnorm" and getattr(m, "bias", None) is None and site.eps is not None \
                    and getattr(m, "weight", None) is not None:
                site.set(MesaRMSNorm(m.weight, site.eps, groups))
            else:
                continue
            done["norm"] += 1
    if linears:
        for parent in list(layout.model.modules()):
            kids = list(parent.named_children())
            for i, (name, child) in enumerate(kids):
                if type(child) is nn.Linear:
                    nxt = kids[i + 1][1] if isinstance(parent, nn.Sequential) and i + 1 < len(kids) else None
                    if getattr(nxt, "inplace", False) is True:  # e.g. Linear -> ReLU(inplace=True) (Swin v2
                        continue  # cpb_mlp): a custom Function's output may not be modified in place; kept
                    setattr(parent, name, MesaLinear.from_linear(child, groups))
                    done["linear"] += 1
    for q in model.modules():
        if isinstance(q, EMAQuantizer):
            q.momentum = float(momentum)
    object.__setattr__(model, "_mesa_converted", done)
    return model


def _device_near(*modules: nn.Module) -> torch.device | None:
    """The device of the first parameter, else buffer, of the first of ``modules`` that has one."""
    for mod in modules:
        for t in mod.parameters():
            return t.device
        for t in mod.buffers():
            return t.device
    return None


def _placed(new: nn.Module, *near: nn.Module) -> nn.Module:
    """``new`` on the device of the modules it joins (``near``, searched in order). MesaAct and the attention's Mesa
    layers own no weight to take a device from (MesaLinear / MesaLayerNorm / MesaRMSNorm put their range tracker
    beside their weight): converted after ``model.cuda()``, their EMA buffers would otherwise stay on the CPU."""
    dev = _device_near(*near)
    return new if dev is None else new.to(dev)


# ---------------------------------------------------------------------------------------------------------- attention
def _add_attention_modules(attn: nn.Module, heads: int) -> None:
    attn.mesa_qk = _placed(MesaMatMul(heads), attn)
    attn.mesa_softmax = _placed(MesaSoftmax(heads), attn)
    attn.mesa_av = _placed(MesaMatMul(heads), attn)


def _convert_attention(attn: nn.Module, layout, mode: str) -> int:
    if hasattr(attn, "mesa_qk"):
        return 0
    if _is_timm_window_attention(attn):  # Swin, as Mesa's Swin demo (docs/methods/mesa.md)
        if mode == "auto" and getattr(attn, "fused_attn", False):
            return 0
        attn.fused_attn = False
        _add_attention_modules(attn, attn.num_heads)
        attn.forward = types.MethodType(_timm_window_mesa_forward, attn)
        return 1
    if layout.attention_style == "timm" and _is_timm_vit_attention(attn):
        if mode == "auto" and getattr(attn, "fused_attn", False):
            return 0
        attn.fused_attn = False
        _add_attention_modules(attn, attn.num_heads)
        attn.forward = types.MethodType(_timm_mesa_forward, attn)
        return 1
    if layout.attention_style == "hf":
        config = getattr(attn, "config", None)
        if config is None:
            return 0
        impl = getattr(config, "_attn_implementation", None)
        if impl not in ("eager", HF_IMPL) and not (mode == "eager" and impl in (None, "sdpa")):
            return 0
        _register_hf()
        _add_attention_modules(attn, config.num_attention_heads)
        if impl != HF_IMPL:
            config._attn_implementation = HF_IMPL
        return 1
    return 0


def _is_timm_vit_attention(attn: nn.Module) -> bool:
    return type(attn).__name__ == "Attention" and type(attn).__module__.startswith("timm") and hasattr(attn, "qkv")


def _is_timm_window_attention(attn: nn.Module) -> bool:
    return (type(attn).__name__ == "WindowAttention" and type(attn).__module__ == "timm.models.swin_transformer"
            and hasattr(attn, "qkv") and hasattr(attn, "_get_rel_pos_bias"))


def _timm_window_mesa_forward(self, x, mask=None):
    """timm Swin ``WindowAttention.forward``'s eager path with Mesa matmuls and softmax (same order of operations)."""
    B_, N, _ = x.shape
    qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q = q * self.scale
    attn = self.mesa_qk(q, k.transpose(-2, -1))
    attn = attn + self._get_rel_pos_bias()
    if mask is not None:
        num_win = mask.shape[0]
        attn = attn.view(-1, num_win, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.num_heads, N, N)
    attn = self.mesa_softmax(attn)
    attn = self.attn_drop(attn)
    x = self.mesa_av(attn, v)
    x = x.transpose(1, 2).reshape(B_, N, -1)
    return self.proj_drop(self.proj(x))


def _timm_mesa_forward(self, x, attn_mask=None, is_causal=False):
    """timm ``Attention.forward``'s eager path with Mesa matmuls and softmax (same order of operations)."""
    from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask

    B, N, C = x.shape
    gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
    qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = self.q_norm(q), self.k_norm(k)
    q = q * self.scale
    attn = self.mesa_qk(q, k.transpose(-2, -1))
    attn = maybe_add_mask(attn, resolve_self_attn_mask(N, attn, attn_mask, is_causal))
    attn = self.mesa_softmax(attn)
    attn = self.attn_drop(attn)
    x = self.mesa_av(attn, v)
    x = x.transpose(1, 2).reshape(B, N, getattr(self, "attn_dim", C))
    x = self.norm(x)
    if gate is not None:
        x = x * gate
    return self.proj_drop(self.proj(x))


def _hf_mesa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' eager attention (BERT / LLaMA form) with Mesa matmuls and softmax; other modules: their own."""
    if not hasattr(module, "mesa_qk"):
        return sys.modules[type(module).__module__].eager_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    import torch.nn.functional as F

    if scaling is None:
        scaling = query.size(-1) ** -0.5
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = module.mesa_qk(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = module.mesa_softmax(scores, out_dtype=query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = module.mesa_av(probs, value)
    return out.transpose(1, 2).contiguous(), probs


_registered = False


def _register_hf() -> None:
    """Register ``mesa_eager`` with transformers' attention and mask interfaces (the masks are eager's)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(HF_IMPL, _hf_mesa_attention)
    AttentionMaskInterface.register(HF_IMPL, eager_mask)
    _registered = True
