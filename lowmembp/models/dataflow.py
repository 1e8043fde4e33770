"""The data-flow adapter: find where each norm's output goes from one traced forward on a tiny input.

For a model no dedicated adapter claims (Gemma 2/3, OLMo2, GPT-2, DistilBERT, DeBERTa-v2, ModernBERT, HF ViT /
DINOv2 / CLIP / SigLIP vision towers, timm EVA / BEiT / Swin v2, your own LLaMA-, BERT- or ViT-like variant ...),
neither a name nor the module tree says which linears read a norm's output. So the model runs once in eval mode under
``torch.no_grad()`` on a sample input (``input_ids`` 2×6 / ``pixel_values``, or ``model.lowmembp_example_inputs``),
with module hooks and a ``TorchFunctionMode`` that follow each norm's output by tensor identity through views only.
Linears called on it directly (*consumers*) get γ/β folded in; a module that reads it otherwise (*receivers*: a
post-norm residual add) gets γ/β re-applied to that argument (:class:`lowmembp.models.fold.ResidualAffine`); any other
reader keeps the norm exact, with the reason. The views followed and the rules in full: docs/models.md#dataflow.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from lowmembp.models.detect import act_kind, in_features, is_linear_like, norm_spec
from lowmembp.models.layout import (DATAFLOW_PRIORITY, ActSite, ModelLayout, NormSite, Site, UnsupportedModelError,
                                    register_adapter)

EXAMPLE_INPUTS_ATTR = "lowmembp_example_inputs"

_ALIAS_OPS = {"view", "reshape", "contiguous", "flatten", "unflatten", "squeeze", "unsqueeze", "expand", "clone",
              "dropout", "feature_dropout", "alpha_dropout", "to", "type", "float", "half", "bfloat16", "double",
              "narrow", "select", "roll", "mean", "detach", "transpose", "permute", "__getitem__", "view_as",
              "reshape_as", "expand_as", "swapaxes", "movedim"}


_META_OPS = {"size", "dim", "numel", "stride", "is_floating_point", "is_contiguous", "data_ptr", "element_size",
             "get_device", "__len__", "is_complex", "storage_offset", "nelement", "ndimension", "has_names",
             "_is_view", "is_inference", "untyped_storage", "requires_grad_", "retain_grad", "register_hook"}


@dataclass
class _NormTrace:
    name: str
    module: nn.Module
    width: int
    consumers: dict = field(default_factory=dict)  # linear name -> list of stacks (module ids) at its calls
    receivers: dict = field(default_factory=dict)  # module name -> arg key
    other: list = field(default_factory=list)  # reasons it cannot be folded


class _Trace:
    def __init__(self, base: nn.Module):
        self.base = base
        self.names = {id(m): n for n, m in base.named_modules()}
        self.norms: dict[int, _NormTrace] = {}
        for n, m in base.named_modules():
            spec = norm_spec(m)
            if spec is not None and n:
                w = getattr(m, "normalized_shape", None)
                width = int(tuple(w)[-1]) if w is not None else int(m.weight.shape[0])
                self.norms[id(m)] = _NormTrace(n, m, width)
        self.linears = {id(m) for m in base.modules() if is_linear_like(m)}
        self.tracked: dict[int, tuple[_NormTrace, int | None]] = {}  # tensor id -> (norm, parent alias id)
        self.keep: list = []  # keep tracked tensors alive (ids stay unique)
        self.stack: list[tuple[nn.Module, dict]] = []  # (module, {tensor id: arg key})
        self.opaque = 0  # > 0 inside a linear or a norm: ops there are not reads of a norm output
        self.linear_calls: dict[int, list] = {}  # linear id -> list of (norm trace | None) per call
        self.module_calls: dict[int, int] = {}
        self.calls_with: dict[int, list[dict]] = {}  # module id -> per call: {arg key: norm trace} of norm outputs
        self.block_order: list[int] = []  # module ids in call order (first call)

    # -- hooks
    def pre(self, module, args, kwargs):
        mid = id(module)
        self.module_calls[mid] = self.module_calls.get(mid, 0) + 1
        if mid not in self.block_order:
            self.block_order.append(mid)
        argmap = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                argmap[id(a)] = i
        for k, a in kwargs.items():
            if isinstance(a, torch.Tensor):
                argmap[id(a)] = k
        if self.opaque == 0:
            got = {}
            for t_id, key in argmap.items():
                if t_id in self.tracked:
                    got[key] = self.tracked[t_id][0]
            self.calls_with.setdefault(mid, []).append(got)
            first = args[0] if args else next(iter(kwargs.values()), None)
            if mid in self.linears:
                hit = self.tracked.get(id(first)) if isinstance(first, torch.Tensor) else None
                self.linear_calls.setdefault(mid, []).append(hit[0] if hit else None)
                if hit:
                    nt = hit[0]
                    ok = first.shape[-1] == nt.width == in_features(module)
                    if ok:
                        nt.consumers.setdefault(self.names[mid], []).append([id(m) for m, _ in self.stack])
                    else:
                        nt.other.append(f"reaches {self.names[mid]} with the channels moved")
                # any other tensor argument of a linear that is a norm output is an unknown read
                for a in list(args[1:]) + list(kwargs.values()):
                    self._read(a, f"argument of {self.names[mid]}")
            elif mid in self.norms:
                for a in list(args) + list(kwargs.values()):
                    h = self.tracked.get(id(a)) if isinstance(a, torch.Tensor) else None
                    if h:
                        h[0].other.append(f"feeds the norm {self.names[mid]}")
        self.stack.append((module, argmap))
        if mid in self.linears or mid in self.norms:
            self.opaque += 1

    def post(self, module, args, kwargs, out):
        mid = id(module)
        if mid in self.linears or mid in self.norms:
            self.opaque -= 1
        self.stack.pop()
        if mid in self.norms and self.opaque == 0 and isinstance(out, torch.Tensor):
            self._track(out, self.norms[mid], None)

    def _track(self, t, nt, parent):
        self.tracked[id(t)] = (nt, parent)
        self.keep.append(t)

    def _chain(self, t):
        ids, cur = [], id(t)
        while cur is not None and cur not in ids:
            ids.append(cur)
            cur = self.tracked[cur][1]
        return ids

    def _read(self, t, what: str) -> None:
        """A read of ``t`` by something other than a consumer linear or an alias op."""
        if not isinstance(t, torch.Tensor):
            if isinstance(t, (list, tuple)):
                for x in t:
                    self._read(x, what)
            return
        hit = self.tracked.get(id(t))
        if hit is None:
            return
        nt = hit[0]
        chain = self._chain(t)
        for module, argmap in reversed(self.stack):
            key = next((argmap[c] for c in chain if c in argmap), None)
            if key is not None:
                name = self.names.get(id(module), "?")
                if id(module) == id(self.base) or id(module) in self.linears:
                    break
                prev = nt.receivers.get(name)
                if prev is not None and prev != key:
                    nt.other.append(f"{name} receives it as two different arguments")
                nt.receivers[name] = key
                return
        where = self.names.get(id(self.stack[-1][0]), "?") if self.stack else "the model"
        nt.other.append(f"its output is read by {what} in {where or type(self.base).__name__} (not a linear layer, "
                        f"and no module received it as an argument)")

    def op(self, func, args, kwargs, out):
        if self.opaque:
            return
        name = getattr(func, "__name__", str(func))
        tensors = [a for a in _flat(args) + _flat(list(kwargs.values())) if isinstance(a, torch.Tensor)]
        hits = [a for a in tensors if id(a) in self.tracked]
        if not hits:
            return
        if name in _META_OPS or not any(isinstance(t, torch.Tensor) for t in _flat([out])):
            if name in _META_OPS or name == "__get__":
                return  # metadata (shape, dtype, size, dim, ...): not a read of the values
        src = hits[0]
        if name in _ALIAS_OPS and len(hits) == 1 and src is args[0] and isinstance(out, torch.Tensor) \
                and out.dim() >= 1 and out.shape[-1] == src.shape[-1] and _keeps_last(name, src, args, kwargs):
            if out is not src:  # (dropout in eval returns its input itself)
                self._track(out, self.tracked[id(src)][0], id(src))
            return
        for h in hits:
            self._read(h, f"{name}")


def _flat(xs):
    out = []
    for x in xs:
        if isinstance(x, (list, tuple)):
            out.extend(_flat(x))
        else:
            out.append(x)
    return out


def _keeps_last(name, src, args, kwargs) -> bool:
    nd = src.dim()
    last = {-1, nd - 1}
    if name in ("transpose", "swapaxes"):
        dims = [a for a in args[1:3]]
        return len(dims) == 2 and not any(d in last for d in dims)
    if name == "permute":
        dims = args[1:] if len(args) > 2 or not isinstance(args[1] if len(args) > 1 else None, (list, tuple)) \
            else args[1]
        dims = list(dims) or list(kwargs.get("dims", []))
        return bool(dims) and dims[-1] in last
    if name == "movedim":
        return False
    if name in ("narrow", "select"):
        d = args[1] if len(args) > 1 else kwargs.get("dim")
        return d not in last
    if name == "roll":
        dims = args[2] if len(args) > 2 else kwargs.get("dims")
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        return dims != [None] and not any(d in last for d in dims)
    if name == "mean":
        d = args[1] if len(args) > 1 else kwargs.get("dim")
        d = d if isinstance(d, (list, tuple)) else [d]
        return None not in d and not any(x in last for x in d)
    if name == "__getitem__":
        idx = args[1] if len(args) > 1 else None
        idx = idx if isinstance(idx, tuple) else (idx,)
        if Ellipsis in idx:
            after = idx[idx.index(Ellipsis) + 1:]
            return not after or _full(after[-1])
        real = [i for i in idx if i is not None]
        return len(real) < nd or _full(real[-1])
    return True


def _full(i) -> bool:
    return isinstance(i, slice) and i == slice(None)


class _Mode(TorchFunctionMode):
    def __init__(self, trace: _Trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self.trace.op(func, args, kwargs, out)
        except Exception:  # pragma: no cover - never let the tracer break the forward
            pass
        return out


# ----------------------------------------------------------------------------------------------------- sample input
def sample_inputs(model: nn.Module, base: nn.Module) -> dict:
    """A tiny input for one traced forward (see the module docstring), or UnsupportedModelError."""
    own = getattr(model, EXAMPLE_INPUTS_ATTR, None) or getattr(base, EXAMPLE_INPUTS_ATTR, None)
    if isinstance(own, dict):
        return own
    p = next(base.parameters(), None)
    if p is None:
        raise UnsupportedModelError(f"{type(base).__name__} has no parameters")
    dtype = p.dtype if p.is_floating_point() else torch.float32
    g = torch.Generator().manual_seed(0)
    cfg = getattr(base, "config", None)
    main = getattr(base, "main_input_name", None)
    if cfg is not None and main == "input_ids":
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        vocab = int(getattr(text, "vocab_size", 0) or 0)
        if vocab < 3:
            raise UnsupportedModelError(f"{type(base).__name__}: config has no vocab_size for a sample input")
        ids = torch.randint(1, min(vocab, 1000), (2, 6), generator=g).to(p.device)
        return {"input_ids": ids}
    if cfg is not None and main == "pixel_values":
        size = getattr(cfg, "image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        ch = getattr(cfg, "num_channels", 3)
        return {"pixel_values": torch.randn(2, ch, *size, generator=g).to(device=p.device, dtype=dtype)}
    pe = getattr(base, "patch_embed", None)
    if pe is not None and hasattr(pe, "img_size"):  # timm vision models
        size = pe.img_size if isinstance(pe.img_size, (list, tuple)) else (pe.img_size,) * 2
        ch = getattr(getattr(pe, "proj", None), "in_channels", 3)
        return {"x": torch.randn(2, ch, *size, generator=g).to(device=p.device, dtype=dtype)}
    raise UnsupportedModelError(
        f"data flow needs a sample input and cannot build one for {type(base).__name__}: set "
        f"model.{EXAMPLE_INPUTS_ATTR} = {{'<forward argument>': <tiny tensor>, ...}} and convert again")


def trace(model: nn.Module, base: nn.Module) -> _Trace:
    """Run the traced forward; the result says, per norm, its consumers, receivers and other readers."""
    if any(p.is_meta or type(p).__name__ == "FakeTensor" for p in base.parameters()):
        raise UnsupportedModelError(f"{type(base).__name__}: data flow runs one forward and needs real weights "
                                    f"(meta / fake tensors given)")
    inputs = sample_inputs(model, base)
    tr = _Trace(base)
    handles = []
    for m in base.modules():
        handles.append(m.register_forward_pre_hook(tr.pre, with_kwargs=True))
        handles.append(m.register_forward_hook(tr.post, with_kwargs=True))
    modes = {m: m.training for m in base.modules()}
    base.eval()
    try:
        with torch.no_grad(), _Mode(tr):
            out = base(**inputs)
    except UnsupportedModelError:
        raise
    except Exception as e:
        raise UnsupportedModelError(f"data flow: the traced forward of {type(base).__name__} on a sample input "
                                    f"({', '.join(inputs)}) failed: {type(e).__name__}: {e}") from e
    finally:
        for h in handles:
            h.remove()
        for m, t in modes.items():
            m.training = t
    for t in _outputs(out):
        hit = tr.tracked.get(id(t))
        if hit is not None:
            hit[0].other.append("its output leaves the model (part of the model's output)")
    return tr


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _outputs(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _outputs(v)]
    return []


# ------------------------------------------------------------------------------------------------------------ layout
def _site(base: nn.Module, name: str, cls=Site, **kw):
    owner_name, _, attr = name.rpartition(".")
    owner = base.get_submodule(owner_name) if owner_name else base
    return cls(owner, attr, name, **kw)


def find_blocks(base: nn.Module) -> list[str]:
    """Names of the transformer blocks: entries of homogeneous ModuleList / Sequential containers whose entries hold
    at least two linear-like modules, innermost containers only, in module order."""
    cands = []
    for name, m in base.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) and len({type(c) for c in m}) == 1:
            kids = list(m)
            if all(sum(1 for x in c.modules() if is_linear_like(x)) >= 2 for c in kids) \
                    and not is_linear_like(kids[0]):
                cands.append(name)
    inner = [c for c in cands if not any(o != c and o.startswith(c + ".") for o in cands)]
    out = []
    for c in inner:
        cont = base.get_submodule(c)
        out.extend(f"{c}.{i}" if c else str(i) for i in range(len(cont)))
    return out


def _attention_of(block: nn.Module, prefix: str) -> str | None:
    best = None
    for n, m in block.named_modules():
        last = n.rsplit(".", 1)[-1].lower()
        if n and ("attn" in last or "attention" in last) and not is_linear_like(m) and norm_spec(m) is None:
            if best is None or n.count(".") < best.count("."):
                best = n
    return f"{prefix}.{best}" if best else None


_MESA_HF_PARAMS = {"module", "query", "key", "value", "attention_mask", "scaling", "dropout", "kwargs"}


def _attention_style(attn: nn.Module | None) -> str | None:
    """``"hf"`` when the attention calls transformers' standard ``eager_attention_forward`` through the attention
    interface (no soft-capping, no head mask), ``"timm"`` for timm's ViT ``Attention``; else None."""
    if attn is None:
        return None
    cfg = getattr(attn, "config", None)
    fn = getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)
    if cfg is not None and hasattr(cfg, "_attn_implementation") and fn is not None:
        try:
            params = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return None
        return "hf" if params <= _MESA_HF_PARAMS and hasattr(cfg, "num_attention_heads") else None
    if type(attn).__name__ == "Attention" and hasattr(attn, "qkv") \
            and type(attn).__module__ in ("timm.models.vision_transformer", "timm.layers.attention"):
        return "timm"
    return None


@register_adapter("dataflow", DATAFLOW_PRIORITY)
def detect_dataflow(model: nn.Module, base: nn.Module) -> ModelLayout | None:
    if not any(norm_spec(m) for m in base.modules()) and not any(act_kind(m) for m in base.modules()):
        raise UnsupportedModelError(f"{type(base).__name__} has no LayerNorm / RMSNorm and no activation module of "
                                    f"a known kind (gelu, gelu_tanh, quick_gelu, silu, relu, relu2)")
    tr = trace(model, base)
    block_names = find_blocks(base)
    if not block_names:
        raise UnsupportedModelError(f"{type(base).__name__}: no transformer blocks found (a ModuleList / Sequential "
                                    f"of modules of one class, each holding linear layers)")
    blocks = [_site(base, b) for b in block_names]
    attentions = []
    for b in blocks:
        a = _attention_of(b.get(), b.path)
        if a is not None:
            attentions.append(_site(base, a))
    order = {mid: i for i, mid in enumerate(tr.block_order)}
    last_block = max((order.get(id(b.get()), -1) for b in blocks), default=-1)
    in_block = tuple(b + "." for b in block_names)
    norms, final = [], None
    traced = sorted(tr.norms.values(), key=lambda nt: order.get(id(nt.module), 1 << 30))
    for nt in traced:
        if id(nt.module) not in order:
            continue  # never called: not part of this forward
        ns = _norm_site(base, tr, nt)
        is_final = final is None and order[id(nt.module)] > last_block and not nt.name.startswith(in_block)
        if is_final:
            final = ns
        else:
            norms.append(ns)
    acts = []
    for name, m in base.named_modules():
        kind = act_kind(m)
        if kind and name and id(m) in order and not _inside_linear(base, name, tr):
            acts.append(_site(base, name, ActSite, kind=kind))
    head = final.consumers if final is not None else []
    st = _attention_style(attentions[0].get() if attentions else None)
    if st is not None and not all(_attention_style(a.get()) == st for a in attentions):
        st = None
    switch = "transformers" if getattr(base, "supports_gradient_checkpointing", False) else \
        ("timm" if hasattr(base, "set_grad_checkpointing") else None)
    family = getattr(getattr(base, "config", None), "model_type", None) or type(base).__name__.lower()
    return ModelLayout(
        family, model, base, blocks, attentions, norms, acts, final, head, attention_style=st,
        checkpoint_switch=switch, tokentune=None, origin="dataflow",
        tokentune_why="mapped by data flow, which finds the norms and linears but not the block's computation; "
                      "TokenTune needs a per-family training-forward driver (lowmembp/models/tokentune_families.py)")


def _inside_linear(base, name, tr) -> bool:
    parts = name.split(".")
    for i in range(1, len(parts)):
        m = base.get_submodule(".".join(parts[:i]))
        if id(m) in tr.linears:
            return True
    return False


def _norm_site(base: nn.Module, tr: _Trace, nt: _NormTrace) -> NormSite:
    why = list(dict.fromkeys(nt.other))
    receivers = {}
    for name, key in nt.receivers.items():
        mod = base.get_submodule(name)
        calls = tr.calls_with.get(id(mod), [])
        if not calls or any(c.get(key) is not nt for c in calls):
            why.append(f"{name} receives it in some calls and other tensors in others")
        receivers[name] = key
    recv_ids = {id(base.get_submodule(n)) for n in receivers}
    consumers = []
    for lin, stacks in nt.consumers.items():
        mod = base.get_submodule(lin)
        calls = tr.linear_calls.get(id(mod), [])
        if any(c is not nt for c in calls):
            why.append(f"{lin} also reads other inputs (a shared linear)")
            continue
        if any(any(r in st for r in recv_ids) for st in stacks):
            continue  # called inside a receiver: it sees γ/β re-applied, nothing to fold
        consumers.append(_site(base, lin))
    if not consumers and not receivers and not why:
        why.append("no reader found in the traced forward")
    ns = _site(base, nt.name, NormSite, consumers=consumers, post_norm=bool(receivers),
               residual_consumers=[_site(base, n) for n in receivers], residual_args=list(receivers.values()))
    if why:
        ns.foldable, ns.why = False, "; ".join(why)
    return ns
