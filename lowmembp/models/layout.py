"""Where things sit in a model: the contract between architecture adapters and the methods that rewrite models.

``get_layout(model)`` returns a :class:`ModelLayout` for a timm ``VisionTransformer`` (vit_*, deit_*), a timm
``SwinTransformer``, a transformers BERT / RoBERTa model (post-norm) or a LLaMA-like decoder (LLaMA, Mistral, Qwen2:
pre-RMSNorm, q/k/v + gate/up/down projections), with or without a task head, plain or wrapped by peft (``PeftModel``
/ ``LoraModel``; the layout describes the unwrapped model and its sites point into the live, wrapped modules).

Families are recognised by structure (which submodules exist, which ``forward`` a block runs), not by class name alone;
see ``lowmembp/models/timm_models.py`` and ``lowmembp/models/hf_models.py``. Nothing here reads tensor values, so
layouts work on real, meta and fake tensors alike.

Every place is a :class:`Site` — the module that owns it plus the attribute name (``"3"`` for entry 3 of a
``ModuleList`` / ``Sequential``) — so a method can read it (``site.get()``) or replace/wrap it (``site.set(new)``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

FAMILIES = ("vit", "swin", "bert", "llama")


@dataclass(eq=False)
class Site:
    """One place in the module tree: ``getattr(owner, attr)``.

    ``attr`` is a string; entries of a ``ModuleList`` / ``Sequential`` use their index as a string (``"0"``), which
    ``setattr`` understands. ``set`` swaps the module in that place (the old module is not touched); wrapping is
    ``site.set(Wrapper(site.get()))``. ``path`` is the dotted name from the layout's ``base`` (for messages only).
    """
    owner: nn.Module
    attr: str
    path: str = ""

    def get(self) -> nn.Module:
        return getattr(self.owner, self.attr)

    def set(self, module: nn.Module) -> None:
        setattr(self.owner, self.attr, module)

    def __repr__(self) -> str:
        return f"Site({self.path or self.attr})"


@dataclass(eq=False)
class NormSite(Site):
    """A LayerNorm / RMSNorm and everything that reads its output.

    - ``kind``: ``"layernorm"`` (``nn.LayerNorm``: weight γ and optional bias β, ``eps``) or ``"rmsnorm"`` (LLaMA-style:
      ``weight`` γ, ``variance_epsilon``; ``y = γ·x·rsqrt(mean(x²) + eps)``).
    - ``consumers``: the linear layers fed by the norm's output, as :class:`Site` s. ``consumer.get()`` is an
      ``nn.Linear`` or whatever wraps it in place (a peft LoRA ``Linear`` with ``base_layer``, a peft
      ``ModulesToSaveWrapper``). Between the norm and each consumer there are only operations that commute with a
      per-channel affine map: reshapes, permutations, token selection, cyclic shifts, averaging over tokens, and
      dropout (exact at p = 0 or in eval; at p > 0 the β term is no longer dropped after folding — same expectation).
    - ``post_norm``: True for BERT / RoBERTa, where the norm output is also the residual stream.
    - ``residual_consumers``: (post-norm only) the modules that receive this norm's output as their residual argument
      ``input_tensor`` (``BertSelfOutput`` / ``BertOutput``-like: ``forward(hidden_states, input_tensor)``).
    - ``foldable``: True when ``consumers`` + ``residual_consumers`` are *all* readers of the output, so γ and β may be
      moved into them. False when the output also leaves the model (a bare model's last hidden state), feeds a
      non-linear pooling (timm attention pooling, max pooling), or runs through zero padding (Swin windows whose
      resolution is not a multiple of the window size); ``why`` then says which.
    """
    kind: str = "layernorm"
    consumers: list[Site] = field(default_factory=list)
    post_norm: bool = False
    residual_consumers: list[Site] = field(default_factory=list)
    foldable: bool = True
    why: str = ""


@dataclass(eq=False)
class ActSite(Site):
    """An element-wise activation module: ``kind`` ``"gelu"`` (erf form) or ``"silu"``.

    For timm this is the act layer (``Mlp.act``); for transformers it is the module attribute that holds the
    activation (``BertIntermediate.intermediate_act_fn``, ``LlamaMLP.act_fn``). Replace it with ``site.set(...)``.
    Activations of another kind (tanh-approximate GELU, ReLU, ...) are not listed.
    """
    kind: str = "gelu"


@dataclass(eq=False)
class ModelLayout:
    """The map of one model, everything in forward order.

    - ``family``: ``"vit"`` | ``"swin"`` | ``"bert"`` (BERT and RoBERTa) | ``"llama"`` (LLaMA, Mistral, Qwen2, ...).
    - ``model``: the object passed to :func:`get_layout` (possibly a peft wrapper).
    - ``base``: the timm / transformers model with peft unwrapped (a task model such as ``LlamaForCausalLM`` stays a
      task model: ``base`` is what peft wraps, not ``base.model``).
    - ``blocks``: one :class:`Site` per transformer block (ViT ``Block``, Swin ``SwinTransformerBlock``,
      ``BertLayer``, ``LlamaDecoderLayer``), in forward order; wrap one with ``site.set(Wrapper(site.get()))``.
    - ``attentions``: one :class:`Site` per block (``blocks[i]``'s attention module: ``attn``,
      ``attention.self``, ``self_attn``).
    - ``norms``: every norm inside or between blocks that a conversion may touch (embedding LayerNorm of BERT,
      ``norm1``/``norm2`` of ViT/Swin blocks, Swin ``PatchMerging.norm``, LLaMA ``input_layernorm`` /
      ``post_attention_layernorm``), as :class:`NormSite` s. The final norm is *not* in this list.
    - ``final_norm``: the norm that produces the last hidden state (ViT ``norm`` or ``fc_norm``, Swin ``norm``,
      LLaMA ``model.norm``, BERT: the last layer's output LayerNorm), its ``consumers`` being the head's linears, or
      None when the model has none.
    - ``acts``: the GELU / SiLU activation modules (:class:`ActSite`), one per MLP.
    - ``head``: the task head's linear(s) reading the last hidden state (``head``, ``head.fc``, ``lm_head``,
      ``score``, ``classifier``, ``pooler.dense`` ...), empty for a bare backbone.
    """
    family: str
    model: nn.Module
    base: nn.Module
    blocks: list[Site]
    attentions: list[Site]
    norms: list[NormSite]
    acts: list[ActSite]
    final_norm: NormSite | None
    head: list[Site]

    def all_norms(self) -> list[NormSite]:
        """``norms`` plus ``final_norm`` (when there is one)."""
        return self.norms + ([self.final_norm] if self.final_norm is not None else [])


class UnsupportedModelError(TypeError):
    """Raised by :func:`get_layout` for a model no adapter recognises."""


# (family, detector) pairs, tried in order; a detector returns a ModelLayout or None. Filled by the adapter modules.
_ADAPTERS: list[tuple[str, Callable[[nn.Module, nn.Module], ModelLayout | None]]] = []


def register_adapter(family: str):
    """Decorator for ``detect(model, base) -> ModelLayout | None`` (None: not this family)."""
    def deco(fn):
        _ADAPTERS.append((family, fn))
        return fn
    return deco


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The timm / transformers model inside a peft ``PeftModel`` and/or ``LoraModel`` (else ``model`` itself)."""
    for _ in range(4):
        if not (type(model).__module__ or "").startswith("peft"):
            break
        # PeftModel -> LoraModel (a BaseTuner) -> the wrapped model; read children, not attributes (tuners forward
        # unknown attribute look-ups to the wrapped model).
        inner = model._modules.get("base_model") or model._modules.get("model")
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def get_layout(model: nn.Module) -> ModelLayout:
    """The :class:`ModelLayout` of ``model``; :class:`UnsupportedModelError` if no adapter recognises it."""
    from lowmembp.models import hf_models, timm_models  # noqa: F401  (register the adapters)

    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"get_layout expects a torch.nn.Module, got {type(model).__name__}")
    base = unwrap_peft(model)
    problems = []
    for family, detect in _ADAPTERS:
        try:
            layout = detect(model, base)
        except UnsupportedModelError as e:  # recognised the family, but something inside is not supported
            problems.append(f"{family}: {e}")
            continue
        if layout is not None:
            return layout
    detail = ("; ".join(problems) + ". ") if problems else ""
    raise UnsupportedModelError(
        f"no architecture adapter recognises {type(base).__name__} ({type(base).__module__}). {detail}"
        f"Supported families: {', '.join(FAMILIES)} — timm VisionTransformer (vit_*, deit_*), timm SwinTransformer, "
        f"transformers BERT/RoBERTa (post-norm) and LLaMA-like decoders (LLaMA, Mistral, Qwen2), plain or wrapped by "
        f"peft. An adapter (lowmembp/models/, @register_adapter) must provide a ModelLayout: the blocks in forward "
        f"order, each block's attention, every LayerNorm/RMSNorm with the linear layers its output feeds (and for "
        f"post-norm models the modules that take it as residual), the GELU/SiLU activation modules, the final norm "
        f"and the head's linears.")


def module_path(root: nn.Module, target: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is target:
            return name
    return "?"


# ---- small structural predicates shared by the adapters -------------------------------------------------------------

_GELU_NAMES = {"GELU", "GELUActivation", "ReGELU2"}
_SILU_NAMES = {"SiLU", "SiLUActivation", "Swish", "ReSiLU2"}


def act_kind(m: nn.Module) -> str | None:
    """``"gelu"`` for an erf-form GELU module, ``"silu"`` for SiLU, else None (tanh-GELU, ReLU, ... are not listed)."""
    name = type(m).__name__
    if name in _GELU_NAMES and getattr(m, "approximate", "none") == "none":
        return "gelu"
    if name in _SILU_NAMES:
        return "silu"
    return None


def norm_kind(m: nn.Module) -> str | None:
    """``"layernorm"`` / ``"rmsnorm"`` for a norm over the last dimension (already-converted MS norms included)."""
    name = type(m).__name__
    if isinstance(m, nn.LayerNorm) or name == "MSLayerNorm":
        return "layernorm"
    if name == "MSRMSNorm":
        return "rmsnorm"
    w = getattr(m, "weight", None)
    # LLaMA-style RMSNorm: a 1-D weight γ, ``variance_epsilon``, no bias (Gemma's (1 + γ) form uses ``eps``).
    if name.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and w is not None and w.dim() == 1 \
            and getattr(m, "bias", None) is None:
        return "rmsnorm"
    return None


def is_linear_like(m: nn.Module) -> bool:
    """``nn.Linear``, or a peft wrapper around one (LoRA ``Linear`` with ``base_layer``, ``ModulesToSaveWrapper``)."""
    if isinstance(m, nn.Linear):
        return True
    inner = getattr(m, "base_layer", None) or getattr(m, "original_module", None)
    return isinstance(inner, nn.Module) and is_linear_like(inner)


def site(owner: nn.Module, attr: str, prefix: str = "", cls=Site, **kw):
    """A :class:`Site` (or ``cls``) for ``owner.attr`` whose path is ``prefix.attr``."""
    return cls(owner, str(attr), f"{prefix}.{attr}" if prefix else str(attr), **kw)
