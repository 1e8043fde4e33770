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

import re
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from lowmembp.models.detect import (act_kind, in_features, is_conv1d, is_linear_like, is_plain_linear,  # noqa: F401
                                    norm_eps, norm_kind, norm_spec)

# the families with a dedicated adapter; anything else goes through the data-flow adapter (lowmembp/models/dataflow.py)
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
    eps: float | None = None
    gamma_offset: float | None = None
    residual_args: list = field(default_factory=list)  # per residual consumer: positional index or keyword name

    def __post_init__(self):
        if self.eps is None or self.gamma_offset is None:
            spec = norm_spec(self.get())
            if spec is not None:
                self.kind = spec[0]
                self.eps = spec[1] if self.eps is None else self.eps
                self.gamma_offset = spec[2] if self.gamma_offset is None else self.gamma_offset
            else:
                self.eps = norm_eps(self.get()) if self.eps is None else self.eps
                self.gamma_offset = 0.0 if self.gamma_offset is None else self.gamma_offset

    def affine(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The effective (γ, β) of the live norm: ``weight + gamma_offset`` (Gemma's ``1 + w``) and ``bias``."""
        norm = self.get()
        w, b = getattr(norm, "weight", None), getattr(norm, "bias", None)
        w = w if isinstance(w, torch.Tensor) else None
        b = b if isinstance(b, torch.Tensor) else None
        if w is not None and self.gamma_offset:
            w = w + self.gamma_offset
        elif w is None and self.gamma_offset not in (0.0, 1.0):
            raise ValueError(f"{self.path}: norm without weight but γ offset {self.gamma_offset}")
        return w, b

    def width(self) -> int | None:
        norm = self.get()
        shape = getattr(norm, "normalized_shape", None)
        if shape is not None:
            return int(tuple(shape)[-1]) if not isinstance(shape, int) else int(shape)
        w = getattr(norm, "weight", None)
        return int(w.shape[0]) if isinstance(w, torch.Tensor) else getattr(norm, "hidden_size", None)


@dataclass(eq=False)
class ActSite(Site):
    """An element-wise activation module; ``kind`` is one of ``lowmembp.models.detect.ACT_KINDS``: ``"gelu"`` (erf
    form), ``"gelu_tanh"``, ``"quick_gelu"``, ``"silu"``, ``"relu"``, ``"relu2"`` (squared ReLU).

    For timm this is the act layer (``Mlp.act``); for transformers it is the module attribute that holds the
    activation (``BertIntermediate.intermediate_act_fn``, ``LlamaMLP.act_fn``). Replace it with ``site.set(...)``.
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

    What the methods need, so that no method has to know a family:

    - ``projections``: the attention and MLP linears of every block (fused or not: ``qkv``, ``qkv_proj``,
      ``gate_up_proj``, GPT-2's ``Conv1D`` ``c_attn`` ...); default: every linear-like module inside ``blocks``.
      :meth:`lora_targets` turns them into peft ``target_modules``.
    - ``attention_style``: how Mesa may reach the attention matmuls — ``"timm"`` (timm ``Attention`` with
      ``fused_attn``), ``"hf"`` (transformers ``eager_attention_forward`` through the attention interface) or None
      (attention left as it is).
    - ``checkpoint_switch``: the library's own gradient-checkpointing switch — ``"timm"`` (``set_grad_checkpointing``),
      ``"transformers"`` (``gradient_checkpointing_enable``) or None (the checkpointing method wraps each block).
    - ``tokentune``: the TokenTune training-forward driver for this model (``"vit"``, ``"bert"``, ``"llama"``, keys of
      ``lowmembp.models.tokentune_families.DRIVERS``) or None, then ``tokentune_why`` says what is missing.
    - ``head_reads``: which rows of the last hidden state the task head reads (what TokenTune selects and hands to
      it in training): ``"first"`` (position 0: BERT's pooler, RoBERTa's classification head, timm's class-token
      pool), ``"last"`` (the last non-padding token by ``input_ids`` and ``config.pad_token_id``:
      transformers' ``*ForSequenceClassification`` decoders, :func:`lowmembp.models.hf_models.last_token_positions`),
      ``"pool"`` (the model pools the tokens itself: timm ``global_pool`` avg/max/avgmax or attention pooling),
      ``"each"`` (every position: causal LM, timm ``global_pool=''``) or None (not known).
    - ``head_lead``: for ``"pool"``, the leading rows (class / register tokens) the pool sets apart; they must be
      the first rows of what it is given (0: none).
    - ``origin``: ``"adapter"`` or ``"dataflow"`` (found by the traced forward of :mod:`lowmembp.models.dataflow`).
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
    projections: list[Site] | None = None
    attention_style: str | None = None
    checkpoint_switch: str | None = None
    tokentune: str | None = None
    tokentune_why: str = ""
    head_reads: str | None = None
    head_lead: int = 0
    origin: str = "adapter"
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.projections is None:
            self.projections = block_linears(self.blocks)

    def all_norms(self) -> list[NormSite]:
        """``norms`` plus ``final_norm`` (when there is one)."""
        return self.norms + ([self.final_norm] if self.final_norm is not None else [])

    def lora_targets(self) -> str:
        """peft ``target_modules``: a regular expression matching exactly the ``projections`` (block indices
        generalised to ``\\d+``), relative to ``base``."""
        pats = []
        for s in self.projections:
            pat = re.sub(r"(^|\\\.)\d+(\\\.|$)", r"\1\\d+\2", re.escape(s.path))
            if pat not in pats:
                pats.append(pat)
        return "(?:" + "|".join(pats) + ")" if pats else ""


def block_linears(blocks: list[Site]) -> list[Site]:
    """Every linear-like module inside each block (peft wrappers counted once, their inner linears not), as Sites
    whose path starts with the block's path; continuous-position-bias MLPs (Swin v2 ``cpb_mlp``) are left out."""
    out = []
    for b in blocks:
        blk = b.get()
        skip: list[str] = []
        for name, m in blk.named_modules():
            if not name or any(name == s or name.startswith(s + ".") for s in skip):
                continue
            if is_linear_like(m):
                skip.append(name)
                if "cpb" in name or "rel_pos" in name or "relative_position" in name:
                    continue
                owner_name, _, attr = name.rpartition(".")
                owner = blk.get_submodule(owner_name) if owner_name else blk
                out.append(Site(owner, attr, f"{b.path}.{name}" if b.path else name))
    return out


class UnsupportedModelError(TypeError):
    """Raised by :func:`get_layout` for a model no adapter recognises."""


# (priority, sequence number, family, detector); tried by priority (highest first), then registration order. A
# detector returns a ModelLayout, None (not this family) or raises UnsupportedModelError (this family, but refused).
_ADAPTERS: list[tuple[float, int, str, Callable[[nn.Module, nn.Module], ModelLayout | None]]] = []
USER_PRIORITY = 100  # the default: a user's own adapter goes before the built-in ones
BUILTIN_PRIORITY = 50
DATAFLOW_PRIORITY = 0  # the data-flow adapter: last


def register_adapter(family: str, priority: float = USER_PRIORITY):
    """Decorator for ``detect(model, base) -> ModelLayout | None`` (None: not this family).

    Adapters are tried by ``priority``, highest first (user adapters 100 by default, the built-in ones 50, the
    data-flow adapter 0), so an adapter you register goes before the library's own for the same model."""
    def deco(fn):
        _ADAPTERS.append((float(priority), len(_ADAPTERS), family, fn))
        _ADAPTERS.sort(key=lambda a: (-a[0], a[1]))
        return fn
    return deco


def unregister_adapter(fn) -> None:
    """Remove an adapter registered with :func:`register_adapter` (tests, notebooks)."""
    _ADAPTERS[:] = [a for a in _ADAPTERS if a[3] is not fn]


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


def refuse_parallel_wrapper(model: nn.Module) -> None:
    """DataParallel / DistributedDataParallel: convert the model before wrapping it (clear error)."""
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise UnsupportedModelError(
            f"the model is wrapped by {type(model).__name__}: apply lowmembp before wrapping — convert "
            f"model.module (lowmembp.apply(model.module, ...)) and wrap the result again")


def get_layout(model: nn.Module) -> ModelLayout:
    """The :class:`ModelLayout` of ``model``; :class:`UnsupportedModelError` if no adapter recognises it."""
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"get_layout expects a torch.nn.Module, got {type(model).__name__}")
    refuse_parallel_wrapper(model)
    base = unwrap_peft(model)
    problems = []
    for _, _, family, detect in list(_ADAPTERS):
        try:
            layout = detect(model, base)
        except UnsupportedModelError as e:  # recognised the family, but something inside is not supported
            problems.append(f"{family}: {e}")
            continue
        if layout is not None:
            if problems:
                layout.notes.extend(problems)
            return layout
    detail = ("; ".join(problems) + ". ") if problems else ""
    raise UnsupportedModelError(
        f"no architecture adapter recognises {type(base).__name__} ({type(base).__module__}). {detail}"
        f"Dedicated adapters: {', '.join(FAMILIES)} — timm VisionTransformer (vit_*, deit_*), timm SwinTransformer, "
        f"transformers BERT/RoBERTa (post-norm) and LLaMA-like decoders; other models are traced (data flow). An "
        f"adapter (lowmembp/models/, @register_adapter; docs/models.md#how-to-add-a-family) "
        f"must provide a ModelLayout: "
        f"the blocks in forward order, each block's attention, every LayerNorm/RMSNorm with the linear layers its "
        f"output feeds (and for post-norm models the modules that take it as residual), the activation modules, the "
        f"final norm and the head's linears.")


def site(owner: nn.Module, attr: str, prefix: str = "", cls=Site, **kw):
    """A :class:`Site` (or ``cls``) for ``owner.attr`` whose path is ``prefix.attr``."""
    return cls(owner, str(attr), f"{prefix}.{attr}" if prefix else str(attr), **kw)
