"""Paper-scale memory estimates without a GPU: one training step of the real timm / transformers code on fake tensors.

    est = estimate("vit-b16", "lora+lowmembp", batch_size=64, dtype="fp16")
    est -> {"model", "method", "batch_size", "seq_len", "dtype", "layers", "saved": <SavedTensorAccountant report>,
            "per_block": {kind: bytes} (one middle block), "peak": <measure_step_peak's result>}

How: the model of :mod:`lowmembp.estimator.zoo` is built on the meta device (timm reads values at construction,
which fake tensors cannot give), the peft methods wrap it there, :func:`to_fake_cpu` moves it into a
:class:`lowmembp.estimator.fake_mode.StepFakeMode` (shapes, dtypes and storages, no data), the other methods are
applied there, and one steady training step (forward, loss, backward, the optimizer's step, its state already made)
runs under the saved-tensor accountant and the peak tracker. Nothing large is allocated; ``device="cpu"`` runs the
same procedure on real tensors (the tests compare the two). The numbers are exact storage bytes of the CPU kernels'
choices under CPU autocast; what they leave out, and why the fake tensors are CPU tensors: docs/measuring.md,
"Limits of the estimates".
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from lowmembp.estimator.fake_mode import StepFakeMode
from lowmembp.estimator.fsdp import fsdp_peak
from lowmembp.estimator.weights import FROZEN_BASE_METHODS, nf4_peak, nf4_weight_bytes, storage_dtype
from lowmembp.estimator.zoo import (MODELS, ModelSpec, block_names, build, compute_loss, image_tokens, make_batch,
                                    model_spec, paper_model_name)
from lowmembp.measurement.kinds import KINDS
from lowmembp.measurement.peak import measure_step_peak, prime_optimizer
from lowmembp.measurement.saved import SavedTensorAccountant
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER
from lowmembp.methods.registry import SPEC_OPTION_MARK, apply, method_options as options_of

# the step's own names, and (first line) the zoo's, FSDP's and NF4's that it has always offered as well
__all__ = ["MODELS", "ModelSpec", "model_spec", "paper_model_name", "build", "block_names", "fsdp_peak",
           "nf4_weight_bytes",
           "estimate", "estimate_by_depth", "full_depth", "DTYPES", "autocast_to", "prepare_model", "to_fake_cpu",
           "make_optimizer", "check_optimizer", "train_step", "extend_by_depth"]

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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
        batch = make_batch(spec, model_, bs, L, (overrides or {}).get("vocab_size"))
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
            with acc, autocast_to(dtype), (counter or contextlib.nullcontext()):
                compute_loss(spec, model_, batch)
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
    tokens = L if spec.family != "timm" else image_tokens(model_)
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
    :func:`estimate` (the built model is cast before any method, as a model loaded in that dtype). The methods are
    applied through this module's ``apply`` (an emulation may patch it: experiments.repro.official_qlora)."""

    names = [n.strip() for n in method.split("+")]  # each with the options written into it ("tokentune@k=4")
    plain = [n.partition(SPEC_OPTION_MARK)[0].strip() for n in names]
    early = "+".join(n for n, p in zip(names, plain) if p in FROZEN_BASE_METHODS)  # peft wraps on the meta device
    late = "+".join(n for n, p in zip(names, plain) if p not in FROZEN_BASE_METHODS + ("baseline",)) or None
    opts_early = {k: v for k, v in method_options.items() if early and k in options_of(early)}
    opts_late = {k: v for k, v in method_options.items() if k not in opts_early}
    built = DTYPES[storage_dtype(weights)]
    model_ = build(spec, layers=layers, overrides=overrides, device="meta" if device == "fake" else "cpu",
                   attention=attention)
    if built is not None:
        model_ = model_.to(built)
    if early:
        model_ = apply(model_, early, **opts_early)
    with mode:
        if device == "fake":
            model_ = to_fake_cpu(model_)
        if late:
            model_ = apply(model_, late, **opts_late)
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
    with (around_forward if around_forward is not None else contextlib.nullcontext()), autocast_to(dtype):
        loss = compute_loss(spec, model, batch)
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)


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


def autocast_to(dtype: str):
    """The CPU autocast of the step's compute dtype (a key of :data:`DTYPES`; fp32: no autocast)."""
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=DTYPES[dtype])

