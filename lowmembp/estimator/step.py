"""Paper-scale memory estimates without a GPU: the real timm / transformers code on fake tensors.

    est = estimate("vit-b16", "lora+lowmembp", batch_size=64, dtype="fp16")
    est -> {"model", "method", "batch_size", "seq_len", "dtype", "layers", "saved": <memory.SavedTensorAccountant
            report>, "per_block": {kind: bytes} (one middle block), "peak": <peak.measure_step_peak result>}

How: the model is built on the meta device (timm calls ``.item()`` at construction, which fake tensors refuse; real
runs build on the CPU), ``lora`` (peft) wraps it there, then :func:`to_fake_cpu` (``to_empty``'s result, made faster)
moves it into a ``FakeTensorMode`` (:class:`lowmembp.estimator.fake_mode.StepFakeMode`; fake tensors carry shapes,
dtypes and
storages but no data), the remaining methods are applied there, and one training step (forward, loss, backward, fused
AdamW step: no per-tensor temporaries) runs for real on the fake tensors, under the saved-tensor accountant (forward)
and the peak tracker (whole step), after the optimizer state is created by one step on zero gradients (so the measured
step is a steady one). Nothing large is allocated; ViT-B at batch 64 takes a few seconds on one core.
``device="cpu"`` runs the identical procedure on real tensors (small configs: the tests compare the two).

Numbers are exact storage bytes of the CPU kernels' choices under CPU autocast (flash attention saves q, k, v, o and
the log-sum-exp, as on a GPU). Not included: CUDA allocator rounding and caching, cuBLAS/cuDNN workspaces, the CUDA
context, the data loader, and what the GPU autocast casts differently. Code that reads a value back from a fake
tensor (``.item()``) fails here, as it would under any fake mode: the ops of this package do not (Mesa draws its seed
from a real CPU generator and, on fake tensors, allocates its codes without computing them).

Offloading (``offload``): its copies are made on the fake host, so the device storages die as on a GPU, and the peak
tracker counts the copies as host memory (``peak["host"]``). The tensors are fake *CPU* tensors: FakeTensorMode makes
``device="cuda"`` fake tensors and runs their forward, but torch 2.14's autograd engine refuses their backward
without a GPU (``hasPrimaryContext expects a valid device index``). ``liger`` refuses fake tensors (its Triton
kernels need a GPU): its figures come from a GPU run.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowmembp.estimator.fake_mode import StepFakeMode
from lowmembp.measurement.saved import SavedTensorAccountant
from lowmembp.measurement.kinds import KINDS
from lowmembp.measurement.peak import measure_step_peak, prime_optimizer
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER
from lowmembp.estimator.weights import (FROZEN_BASE_METHODS, WEIGHTS, nf4_peak, nf4_weight_bytes,  # noqa: F401
                                        storage_dtype)

__all__ = ["MODELS", "ModelSpec", "model_spec", "paper_model_name",
           "estimate", "estimate_by_depth", "full_depth", "build", "block_names", "DTYPES",
           "nf4_weight_bytes", "fsdp_peak", "prepare_model", "make_optimizer",
           "train_step", "extend_by_depth"]

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# peft wraps the model on the meta device, before to_empty (docs/design.md#fake-tensors)
_PEFT_METHODS = FROZEN_BASE_METHODS


@dataclass(frozen=True)
class ModelSpec:
    """A paper model: how to build it and its paper setting (batch size, sequence length, dtype)."""
    family: str                 # "timm" | "bert" | "roberta" | "llama"
    arch: str                   # timm name, or a key of _HF_CONFIGS
    batch_size: int
    seq_len: int | None = None  # tokens (HF); timm: from the image size
    dtype: str = "bf16"
    num_classes: int = 100
    kwargs: dict = field(default_factory=dict)


MODELS: dict[str, ModelSpec] = {
    "vit-b16": ModelSpec("timm", "vit_base_patch16_224", 64, dtype="fp16"),
    "vit-l16": ModelSpec("timm", "vit_large_patch16_224", 64, dtype="fp16"),
    "swin-t": ModelSpec("timm", "swin_tiny_patch4_window7_224", 128, dtype="fp16", num_classes=1000),
    "deit-ti": ModelSpec("timm", "deit_tiny_patch16_224", 128, dtype="fp16", num_classes=1000),
    "deit-s": ModelSpec("timm", "deit_small_patch16_224", 128, dtype="fp16", num_classes=1000),
    "deit-b": ModelSpec("timm", "deit_base_patch16_224", 128, dtype="fp16", num_classes=1000),
    "bert-large": ModelSpec("bert", "bert-large", 32, seq_len=128, dtype="fp32", num_classes=2),
    "roberta-base": ModelSpec("roberta", "roberta-base", 32, seq_len=256, dtype="fp32", num_classes=2),
    "llama-7b": ModelSpec("llama", "llama-7b", 4, seq_len=512, dtype="bf16"),
    "llama-13b": ModelSpec("llama", "llama-13b", 4, seq_len=512, dtype="bf16"),
}

# The paper models' names of the 0.1 releases, with underscores; accepted for one more release with a
# DeprecationWarning (:func:`model_spec`). The names are those of the tasks and the training job: ``vit-b16``.
_OLD_NAMES = {name.replace("-", "_"): name for name in MODELS if "-" in name}


def paper_model_name(name: str) -> str | None:
    """``name`` as a key of :data:`MODELS` (an old underscore spelling warns and maps), or None if it names none."""
    if name in MODELS:
        return name
    if name in _OLD_NAMES:
        warnings.warn(f"the paper model {name!r} is now spelled {_OLD_NAMES[name]!r} (as in the tasks and the "
                      "training job); the old spelling goes in the next release", DeprecationWarning, stacklevel=3)
        return _OLD_NAMES[name]
    return None


def model_spec(model: str | ModelSpec) -> ModelSpec:
    """The :class:`ModelSpec` of a paper model's name (a key of :data:`MODELS`), or ``model`` itself if it is one."""
    if not isinstance(model, str):
        return model
    name = paper_model_name(model)
    if name is None:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


_HF_CONFIGS = {
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                       vocab_size=30522, max_position_embeddings=512),
    "roberta-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                         vocab_size=50265, max_position_embeddings=514, pad_token_id=1),
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                     num_hidden_layers=32, vocab_size=32000, max_position_embeddings=2048),
    "llama-13b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=40,
                      num_hidden_layers=40, vocab_size=32000, max_position_embeddings=2048),
}


def build(spec: ModelSpec, *, layers: int | None = None, overrides: dict | None = None,
          device: str = "meta", attention: str = "sdpa") -> nn.Module:
    """The model of ``spec`` on ``device`` (meta: no memory; ``layers``: keep only that many blocks; ``overrides``:
    config changes, e.g. a smaller width for tests; ``attention``: ``"sdpa"`` (fused: flash on CPU) or ``"eager"``
    (softmax and matmuls, as timm / transformers did before fused attention))."""
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    model = _build(spec, layers, dict(overrides or {}), device, attention)
    if spec.family == "timm":
        for m in model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = attention == "sdpa"
    return model


def _build(spec, layers, overrides, device, attention):
    with torch.device(device):
        if spec.family == "timm":
            import timm
            kw = dict(spec.kwargs, **overrides)
            if layers is not None:
                if "swin" in spec.arch:
                    raise ValueError("layers=: Swin's depth is per stage; pass overrides={'depths': (...)} instead")
                kw["depth"] = layers
            try:
                return timm.create_model(spec.arch, pretrained=False, num_classes=spec.num_classes, **kw)
            except RuntimeError as e:  # timm releases whose __init__ reads a value (drop-path rates by .item())
                if device != "meta" or "meta" not in str(e):
                    raise
            with torch.device("cpu"):  # built for real, then moved: the same shapes, more time and memory
                return timm.create_model(spec.arch, pretrained=False, num_classes=spec.num_classes, **kw).to("meta")
        if spec.family == "hf":
            from lowmembp.estimator.hf_config import build_from_config
            return build_from_config(spec.arch, layers=layers, overrides=overrides, attention=attention,
                                     num_labels=spec.num_classes)
        cfg = dict(_HF_CONFIGS[spec.arch], **overrides)
        if layers is not None:
            cfg["num_hidden_layers"] = layers
        if spec.family == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM
            return LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation=attention))
        if spec.family == "bert":
            from transformers import BertConfig, BertForSequenceClassification
            return BertForSequenceClassification(BertConfig(**cfg, num_labels=spec.num_classes,
                                                            attn_implementation=attention))
        if spec.family == "roberta":
            from transformers import RobertaConfig, RobertaForSequenceClassification
            return RobertaForSequenceClassification(RobertaConfig(**cfg, num_labels=spec.num_classes,
                                                                  attn_implementation=attention))
    raise ValueError(f"unknown model family {spec.family!r}")


def block_names(model: nn.Module) -> list[str]:
    """Qualified names of the transformer blocks, in order (timm Block / SwinTransformerBlock, HF *Layer)."""
    out = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if re.search(r"(^|\.)(blocks|layers|layer)\.\d+$", name) and re.search(r"(Block|Layer)$", cls) \
                and "Stage" not in cls:
            out.append(name)
    return out


def estimate(model: str | ModelSpec, method: str = "baseline", *, batch_size: int | None = None,
             seq_len: int | None = None, dtype: str | None = None, layers: int | None = None,
             overrides: dict | None = None, device: str = "fake", peak: bool = True, seed: int = 0,
             attention: str = "sdpa", flops: bool = False, world_size: int = 1, weights: str = "fp32",
             optimizer: str = DEFAULT_OPTIMIZER, **method_options) -> dict:
    """Saved-for-backward bytes (whole model and one middle block) and the peak of one training step.

    ``model``: a key of :data:`MODELS` or a :class:`ModelSpec`; ``batch_size``/``seq_len``/``dtype`` default to the
    paper setting; ``layers``: build only that many blocks; ``device``: ``"fake"`` (no allocation) or ``"cpu"``
    (real tensors, same procedure); ``peak=False`` skips the training step (saved bytes only, one forward);
    ``attention``: ``"sdpa"`` (default) or ``"eager"`` (see :func:`build`); ``flops=True``: also count the FLOPs
    of the measured step (forward, backward with any recomputation) with
    :func:`lowmembp.measurement.flops.step_flop_counter`
    (result key ``"flops"``; ``None`` otherwise). A :class:`ModelSpec` of family ``"hf"`` is a transformers
    config.json on disk (:func:`lowmembp.estimator.hf_config.hf_spec`).

    ``weights``: the dtype the model's parameters are stored in. ``"fp32"`` (default): fp32 weights, computed in
    ``dtype`` under autocast, as the training job trains; ``"bf16"`` / ``"fp16"``: the model loaded in that dtype
    (``from_pretrained(torch_dtype=...)``), so frozen weights, gradients and AdamW state of trained weights take 2
    bytes an element — peft's LoRA / LoRA-FA adapters stay fp32, as peft makes them on a 16-bit base
    (``autocast_adapter_dtype``); ``"nf4"``: QLoRA, the frozen base linears of a LoRA-family method in 4 bits, the
    rest in bf16 (:func:`lowmembp.estimator.weights.nf4_peak`).

    ``optimizer``: a name of :data:`lowmembp.methods.optimizers.OPTIMIZERS`, its states as that optimizer holds
    them: ``"adamw"`` (fp32 states), ``"adamw8bit"`` (bitsandbytes' 8-bit states and their per-block absmax, run on
    the fake tensors: bitsandbytes' own code makes them; its step adds no temporaries, as its CUDA kernel updates in
    place — its CPU fallback dequantises each parameter's states to fp32 first, which the estimate leaves out),
    ``"adamw-fused-backward"`` (each parameter stepped inside the backward and its gradient freed: the peak's
    gradients are those in flight, never all of them).

    ``world_size=N`` (> 1): the peak of one rank of FSDP2 training (``fully_shard`` per block, then the root; see
    :func:`fsdp_peak`) with ``batch_size`` samples *per rank* (activations stay per rank; the training job's
    ``--batch-size`` is the global batch, N times this).
    """
    spec = model_spec(model)
    if device not in ("fake", "cpu"):
        raise ValueError(f"device must be 'fake' or 'cpu', got {device!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer (processes sharing the model), got {world_size!r}")
    dtype = dtype or spec.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    bs = batch_size or spec.batch_size
    L = seq_len or spec.seq_len
    check_optimizer(optimizer)
    torch.manual_seed(seed)
    mode = StepFakeMode(allow_non_fake_inputs=True) if device == "fake" else contextlib.nullcontext()
    model_ = prepare_model(spec, method, mode, layers=layers, overrides=overrides, device=device,
                           attention=attention, weights=weights, **method_options)
    opt = make_optimizer(model_, optimizer)  # outside the mode: bitsandbytes reads its quantisation maps back
    with mode:
        batch = _batch(spec, model_, bs, L, (overrides or {}).get("vocab_size"))
        acc = SavedTensorAccountant(model_)

        def step():
            train_step(spec, model_, batch, opt, dtype, around_forward=acc)

        counter = None
        if flops:
            from lowmembp.measurement.flops import step_flop_counter
            counter, plain_step = step_flop_counter(), step

            def step():
                with counter:
                    plain_step()

        if peak:
            prime_optimizer(opt)
            pk = measure_step_peak(model_, opt, step, warmup=0, external=tuple(batch.values()))
        else:
            with acc, _autocast(dtype), (counter or contextlib.nullcontext()):
                _loss(spec, model_, batch)
            pk = None
    blocks = block_names(model_)
    if pk is not None and weights == "nf4":
        if world_size > 1:
            raise ValueError("weights='nf4' with world_size > 1 is not modelled (FSDP2 of 4-bit weights)")
        pk = nf4_peak(pk, model_)
    if pk is not None and world_size > 1:
        pk = fsdp_peak(pk, model_, opt, blocks, world_size)
    per_block = dict.fromkeys(KINDS, 0)
    if blocks:
        mid = blocks[len(blocks) // 2] + "."
        for row in acc.table():
            if row["module"].startswith(mid):
                per_block[row["kind"]] += row["bytes"]
    tokens = L if spec.family != "timm" else _timm_tokens(model_)
    return {"model": spec.arch, "method": method, "batch_size": bs, "seq_len": tokens, "dtype": dtype,
            "weights": weights, "optimizer": optimizer, "layers": len(blocks), "saved": acc.report(),
            "per_block": per_block, "peak": pk,
            "flops": int(counter.get_total_flops()) if counter is not None else None}


def prepare_model(spec: ModelSpec, method: str, mode, *, layers: int | None = None, overrides: dict | None = None,
                  device: str = "fake", attention: str = "sdpa", weights: str = "fp32",
                  **method_options) -> nn.Module:
    """:func:`estimate`'s model before its step: built (meta device for ``device="fake"``, else the CPU), the peft
    methods applied there, then inside ``mode`` (the ``FakeTensorMode``, or a null context on the CPU) moved to fake
    CPU storage, the other methods applied, in train mode. The caller seeds torch and enters ``mode`` again for the
    step (the planner runs several steps on one such model: :mod:`lowmembp.plan.steps`). ``weights``: see
    :func:`estimate` (the built model is cast before any method, as a model loaded in that dtype)."""
    import lowmembp
    from lowmembp.methods.registry import method_options as options_of

    from lowmembp.methods.registry import SPEC_OPTION_MARK

    names = [n.strip() for n in method.split("+")]  # each with the options written into it ("tokentune@k=4")
    plain = [n.partition(SPEC_OPTION_MARK)[0].strip() for n in names]
    early = "+".join(n for n, p in zip(names, plain) if p in _PEFT_METHODS)
    late = "+".join(n for n, p in zip(names, plain) if p not in _PEFT_METHODS + ("baseline",)) or None
    opts_early = {k: v for k, v in method_options.items() if early and k in options_of(early)}
    opts_late = {k: v for k, v in method_options.items() if k not in opts_early}
    built = DTYPES[storage_dtype(weights)]
    model_ = build(spec, layers=layers, overrides=overrides, device="meta" if device == "fake" else "cpu",
                   attention=attention)
    if built is not None:
        model_ = model_.to(built)
    if early:
        model_ = lowmembp.apply(model_, early, **opts_early)
    with mode:
        if device == "fake":
            model_ = to_fake_cpu(model_)
        if late:
            model_ = lowmembp.apply(model_, late, **opts_late)
        elif opts_late:
            raise TypeError(f"options {sorted(opts_late)} given but no method takes them")
        model_.train()
    return model_


def to_fake_cpu(model: nn.Module) -> nn.Module:
    """``model.to_empty(device="cpu")`` for a meta-device model inside a fake mode, each dense tensor made by
    ``empty_strided`` from its own size and strides (what ``empty_like`` makes of it), not by ``empty_like``, which
    the fake mode runs only after turning the meta tensor into a fake one (half of a LoRA model's build)."""
    from lowmembp._compat import is_non_overlapping_and_dense as dense

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if not dense(t):
            return torch.empty_like(t, device="cpu")
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")

    return model._apply(fresh)


def make_optimizer(model: nn.Module, optimizer: str = DEFAULT_OPTIMIZER) -> torch.optim.Optimizer | None:
    """:func:`estimate`'s optimizer over the trainable parameters (``None`` when there are none): ``optimizer`` a
    name of :data:`lowmembp.methods.optimizers.OPTIMIZERS`; torch's AdamW in its fused form (no per-tensor
    temporaries), also per parameter inside the backward. Make it outside the fake mode (bitsandbytes reads its
    quantisation maps back at construction). On fake tensors, APOLLO, Adafactor, torchao's low-bit AdamW and its
    CPU offload are stand-ins with their packages' states and step temporaries
    (:mod:`lowmembp.estimator.optim_standins`): their own steps read values back or need CUDA."""
    from lowmembp.methods.optimizers import make_optimizer as make

    check_optimizer(optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    from lowmembp._compat import is_fake

    if is_fake(params[0]):  # optimizers whose own step cannot run on fake tensors: their states and temporaries
        from lowmembp.estimator.optim_standins import standin
        from lowmembp.methods.optim_levers import projection_weights

        opt = standin(params, optimizer, targets=projection_weights(model), lr=1e-4, weight_decay=0.1)
        if opt is not None:
            return opt
    kw = {"fused": True} if optimizer in ("adamw", "adamw-fused-backward") else {}
    return make(params, optimizer, lr=1e-4, weight_decay=0.1, model=model, **kw)


def check_optimizer(optimizer: str) -> None:
    """ValueError naming the choices unless ``optimizer`` is one of them."""
    from lowmembp.methods.optimizers import check_optimizer as check

    check(optimizer)


def train_step(spec: ModelSpec, model: nn.Module, batch: dict, opt, dtype: str, around_forward=None) -> None:
    """:func:`estimate`'s training step: the loss under autocast (inside ``around_forward``, e.g. the saved-tensor
    accountant), backward, the optimizer step, gradients set to ``None``."""
    with (around_forward if around_forward is not None else contextlib.nullcontext()), _autocast(dtype):
        loss = _loss(spec, model, batch)
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _shard_bytes(t: torch.Tensor, n: int = 1) -> int:
    """Bytes of one rank's FSDP2 shard of ``t``: dim 0 split in n, padded to equal chunks (0-d tensors whole)."""
    if n == 1 or t.dim() == 0:
        return t.numel() * t.element_size()
    rest = t.numel() // t.shape[0] if t.shape[0] else 0
    return -(-t.shape[0] // n) * rest * t.element_size()


def fsdp_peak(pk: dict, model: nn.Module, optimizer, blocks: list[str], n: int) -> dict:
    """One rank's peak under FSDP2 (``fully_shard`` on each of ``blocks``, then the root) from the one-process
    peak ``pk`` of the same per-rank batch, by category:

    - parameters: every parameter sharded (dim 0 in n padded chunks), plus the root's own parameters (outside the
      blocks: embeddings, final norm, head) whole — FSDP2 keeps the root's group gathered from its forward to the end
      of its backward — plus the largest block's parameters whole (the block being computed), twice when the peak
      falls in the backward (FSDP2 prefetches the next block's all-gather there); buffers stay whole;
    - gradients: those alive at the peak, sharded, plus — when the peak falls inside the blocks' backward (more
      gradients alive than the root's own) — the largest block's trainable gradients twice: unsharded, and their
      reduce-scatter copy;
    - optimizer state: sharded like its parameters (0-d ``step`` counters whole);
    - activations: unchanged (per rank);
    - temporaries: unchanged, plus the collectives' staging buffers at their worst: a block's flat all-gather output
      before it is copied out into the parameters and, in the backward, a block's flat reduce-scatter input — one
      block's parameters each (``staging_bytes`` in the result). Whether they are alive at the peak depends on when
      the collective finishes: a two-process CPU run measured each rank's peak anywhere between the modelled peak
      without them and with both, run to run (``tests/estimator/test_estimate_fsdp.py``), so the planner counts them.

    Not modelled: padding beyond dim 0, CUDA streams' overlap."""
    prefixes = tuple(b + "." for b in blocks)
    named = list(model.named_parameters())
    whole = sum(_shard_bytes(p) for _, p in named)
    shard = sum(_shard_bytes(p, n) for _, p in named)
    root = [p for name, p in named if not name.startswith(prefixes)]
    root_gathered = sum(_shard_bytes(p) - _shard_bytes(p, n) for p in root)
    per_block = [[p for name, p in named if name.startswith(b + ".")] for b in blocks]
    block_params = max((sum(_shard_bytes(p) for p in ps) for ps in per_block), default=0)
    block_grads = max((sum(_shard_bytes(p) for p in ps if p.requires_grad) for ps in per_block), default=0)
    trainable = [p for _, p in named if p.requires_grad]
    g_whole = sum(_shard_bytes(p) for p in trainable)
    g_shard = sum(_shard_bytes(p, n) for p in trainable)
    state = [v for s in (optimizer.state.values() if optimizer is not None else ()) for v in s.values()
             if isinstance(v, torch.Tensor)]
    cats = dict(pk["by_category"])
    old = {k: cats.get(k, 0) for k in ("parameters", "gradients", "optimizer_state")}
    grads = old["gradients"]
    root_grads = sum(_shard_bytes(p) for p in root if p.requires_grad)
    backward = grads > 0
    in_blocks = grads > root_grads
    staging = block_params * (2 if backward else 1)
    new = {"parameters": old["parameters"] - whole + shard + root_gathered + block_params * (2 if backward else 1),
           "gradients": (grads * g_shard // g_whole if g_whole else 0) + (2 * block_grads if in_blocks else 0),
           "optimizer_state": (sum(_shard_bytes(v, n) for v in state) if old["optimizer_state"] else 0),
           "temporaries": cats.get("temporaries", 0) + staging}
    old["temporaries"] = cats.get("temporaries", 0)
    cats.update(new)
    out = dict(pk, by_category=cats)
    out["bytes"] = int(pk["bytes"] - sum(old.values()) + sum(new.values()))
    out["how"] = (f"{pk['how']}; one rank of {n} under FSDP2 (parameters, gradients and optimizer state sharded, "
                  f"the root's parameters and the gathered blocks' whole; lowmembp.estimator.step.fsdp_peak)")
    out["world_size"] = n
    out["staging_bytes"] = staging
    return out


def full_depth(model: str | ModelSpec, overrides: dict | None = None) -> int:
    """The number of transformer blocks of the full model (built on the meta device: no memory)."""
    spec = model_spec(model)
    return len(block_names(build(spec, overrides=overrides, device="meta")))


def estimate_by_depth(model: str | ModelSpec, method: str = "baseline", *, layers: int | None = None,
                      shallow: tuple[int, int] = (2, 3), **kwargs) -> dict:
    """:func:`estimate` of a ``layers``-block model (default: the full depth) from two shallow builds.

    Every block of a ViT / DeiT / BERT / LLaMA is the same, so each byte count — saved bytes by kind, storages,
    the peak and its split by category — grows by the same amount per block: ``f(L) = f(a) + (f(b) − f(a))·(L − a)
    / (b − a)`` with ``(a, b) = shallow``. That holds from two blocks on where the step's peak falls at the same
    point for every depth (measured for every configuration of :mod:`experiments.repro`: equal to the byte to full-depth
    runs, and tested). It does not hold from one block: there the peak can fall in another phase of the step (BERT-
    large full fine-tuning at batch 8 peaks in the optimizer step with one block, in the backward with two or more),
    so the default is (2, 3). Not for models whose depth is per stage (Swin: ``layers=`` is refused there).
    ``per_block`` comes from the deeper build (one middle block, the same at any depth).
    """
    a, b = shallow
    if not 1 <= a < b:
        raise ValueError(f"shallow must be two depths 1 <= a < b, got {shallow!r}")
    depth = layers if layers is not None else full_depth(model, kwargs.get("overrides"))
    if depth <= b:
        return estimate(model, method, layers=depth, **kwargs)
    lo = estimate(model, method, layers=a, **kwargs)
    hi = estimate(model, method, layers=b, **kwargs)
    return extend_by_depth(lo, hi, (a, b), depth)


def extend_by_depth(lo: dict, hi: dict, shallow: tuple[int, int], depth: int) -> dict:
    """:func:`estimate_by_depth`'s extension of two results (of ``shallow = (a, b)`` blocks) to ``depth`` blocks:
    every integer grows by its whole per-block change (``ValueError`` if it is not whole); ``per_block``,
    ``batch_size``, ``seq_len`` and non-integers are the deeper result's."""
    a, b = shallow

    def extend(x, y, key=None):
        if key == "per_block":
            return y
        if isinstance(x, dict):
            return {k: extend(x[k], y[k], k) for k in y}
        if isinstance(x, int) and not isinstance(x, bool) and key != "batch_size" and key != "seq_len":
            step, rem = divmod(y - x, b - a)
            if rem:
                raise ValueError(f"estimate_by_depth: {key} changes by {y - x} bytes over {b - a} blocks, not a "
                                 "whole number per block; use estimate(layers=...) at full depth")
            return y + step * (depth - b)
        return y

    out = extend(lo, hi)
    out["layers"] = depth
    if out.get("peak") is not None:
        out["peak"]["how"] += f" (extrapolated to {depth} blocks from {a} and {b})"
    return out


def _autocast(dtype: str):
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=DTYPES[dtype])


def _timm_tokens(model: nn.Module) -> int | None:
    base = getattr(model, "base_model", None)
    base = getattr(base, "model", model)
    pe = getattr(base, "patch_embed", None)
    n = getattr(pe, "num_patches", None)
    if n is None:
        return None
    return n + getattr(base, "num_prefix_tokens", 0)


def _batch(spec: ModelSpec, model: nn.Module, bs: int, L: int | None, vocab: int | None = None) -> dict:
    if spec.family == "timm":
        base = getattr(getattr(model, "base_model", None), "model", model)
        size = getattr(base, "default_cfg", {}).get("input_size", (3, 224, 224))
        img = getattr(getattr(base, "patch_embed", None), "img_size", None)
        hw = tuple(img) if img is not None else tuple(size[1:])
        return {"x": torch.randn(bs, 3, *hw), "y": torch.randint(0, spec.num_classes, (bs,))}
    if spec.family == "hf":
        from lowmembp.estimator.hf_config import CAUSAL_LM, vocab_size
        vocab, causal = vocab or vocab_size(model), spec.kwargs.get("head") == CAUSAL_LM
    else:
        vocab, causal = vocab or _HF_CONFIGS[spec.arch]["vocab_size"], spec.family == "llama"
    ids = torch.randint(3, vocab, (bs, L))
    if causal:
        return {"input_ids": ids, "labels": ids.clone()}
    return {"input_ids": ids, "attention_mask": torch.ones(bs, L, dtype=torch.long),
            "labels": torch.randint(0, spec.num_classes, (bs,))}


def _loss(spec: ModelSpec, model: nn.Module, batch: dict) -> torch.Tensor:
    if spec.family == "timm":
        return F.cross_entropy(model(batch["x"]), batch["y"])
    return model(**batch).loss
