"""``cce``: Cut Cross-Entropy (Wijmans et al., ICLR 2025) for causal LMs, through the ``cut-cross-entropy`` package.

With a large vocabulary the ``B·S × V`` logits are among a step's largest tensors; CCE computes the lm_head and the
loss without materialising them. The causal LM is hooked as ``chunked-ce`` hooks it (lowmembp.methods.chunked_ce):
with ``labels``, in training with grad enabled, the loss is ``linear_cross_entropy(hidden, lm_head.weight, targets)``,
the model's own loss (shifted labels, ``-100`` ignored, Gemma-2's soft-capping), and the output carries no logits;
otherwise the model's own forward runs. Option ``impl``: ``"cce"`` (the package's Triton kernels: CUDA, bf16 / fp16
lm_head inputs), ``"torch_compile"`` (``torch.compile`` of the plain loss; on the CPU it keeps the logits) or
``"auto"`` (the kernel on CUDA, else the compiled path); ``filter_eps`` is the kernel's gradient filter. Refused for
models without a causal-LM head, an lm_head with a bias or a LoRA adapter on it; excludes ``chunked-ce`` and
``liger``. Needs ``pip install cut-cross-entropy``. In full, with measured figures: docs/methods/cce.md.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from lowmembp.methods.chunked_ce import _ChunkedCEForward, causal_lm_head
from lowmembp.methods.registry import register

IMPLS = ("auto", "cce", "torch_compile")


def check_cce(impl="auto", filter_eps="high"):
    if impl not in IMPLS:
        raise ValueError(f"cce: impl must be one of {', '.join(IMPLS)} (auto: the Triton kernel on CUDA, "
                         f"torch_compile elsewhere), got {impl!r}")
    if not (filter_eps in ("high", "auto", "none", None)
            or (isinstance(filter_eps, (int, float)) and not isinstance(filter_eps, bool) and filter_eps >= 0)):
        raise ValueError(f"cce: filter_eps must be 'high' (the package's default), 'auto', 'none' or a number >= 0, "
                         f"got {filter_eps!r}")


# The other methods that compute the causal-LM loss themselves: a model has one loss, so one of them at a time.
LOSS_CONFLICTS = {
    "chunked-ce": "both compute the causal-LM loss from lm_head's input without keeping the full logits (cce with "
                  "its own kernel, chunked-ce chunk by chunk) and a model has one loss: choose one (cce: the Triton "
                  "kernel on CUDA; chunked-ce: exact on any device)",
    "liger": "both compute the causal-LM loss from lm_head's input without keeping the full logits (liger with its "
             "fused linear cross-entropy) and a model has one loss: choose one",
}


@register("cce", "Cut Cross-Entropy (cut-cross-entropy package) for causal LMs: lm_head + loss without the logits "
                 "(impl auto/cce/torch_compile, filter_eps)",
          options={"impl": "auto", "filter_eps": "high"}, order=45, excludes=LOSS_CONFLICTS,
          kinds={"filter_eps": (float, str)}, check=check_cce)
def apply_cce(model: nn.Module, impl: str = "auto", filter_eps="high") -> nn.Module:
    from lowmembp.models import get_layout

    check_cce(impl, filter_eps)
    try:
        import cut_cross_entropy  # noqa: F401
    except ImportError as e:
        raise ImportError("cce needs the cut-cross-entropy package: pip install cut-cross-entropy "
                          "(or pip install 'lowmembp[cce]')") from e
    layout = get_layout(model)
    base = layout.base
    head = causal_lm_head(base, layout, "cce")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"cce: the lm_head of {type(base).__name__} has a bias; Cut Cross-Entropy's classifier is one "
                         f"matrix without bias (use chunked-ce, which takes a bias)")
    softcap = getattr(getattr(base, "config", None), "final_logit_softcapping", None)
    object.__setattr__(base, "_lowmembp_cce", {"impl": impl, "filter_eps": filter_eps})
    inner = base.__dict__.get("forward")
    base.forward = _CCEForward(base, head, impl, filter_eps, softcap, inner)
    return model


def resolve_impl(impl: str, device: torch.device) -> str:
    """The implementation that runs for tensors on ``device``; a RuntimeError for the Triton kernel off CUDA."""
    if impl == "auto":
        return "cce" if device.type == "cuda" else "torch_compile"
    if impl == "cce" and device.type != "cuda":
        raise RuntimeError(f"cce: impl='cce' is Cut Cross-Entropy's Triton kernel, which runs on CUDA GPUs only; the "
                           f"tensors are on {device.type!r}. Use impl='torch_compile' (or 'auto', the default) there")
    return impl


# cut-cross-entropy 25.1.1's backward kernel (cce_backward.py, cce_backward_kernel) asserts "Backwards requires
# embeddings to be bf16 or fp16": its Triton kernel takes float32 only in the forward (the log-sum-exp).
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def check_kernel_dtype(dtype: torch.dtype) -> None:
    """A RuntimeError, saying what to do, where the Triton kernel would get lm_head inputs it cannot differentiate."""
    if dtype not in KERNEL_DTYPES:
        raise RuntimeError(f"cce: Cut Cross-Entropy's Triton kernel (impl='cce'; 'auto' picks it on CUDA) computes "
                           f"gradients for bfloat16 / float16 inputs only (cut-cross-entropy's backward asserts it), "
                           f"and lm_head's input here is {str(dtype).replace('torch.', '')}. Train in bf16 / fp16 "
                           f"(model.to(torch.bfloat16), or torch.autocast('cuda', dtype=torch.bfloat16) around the "
                           f"forward), or use impl='torch_compile' (exact in float32, but it may keep the logits)")


def compiles_loss(model: nn.Module) -> bool:
    """True when ``model`` carries ``cce`` whose loss runs ``torch.compile`` off CUDA (``impl`` ``"auto"`` or
    ``"torch_compile"``): a step to measure as a compiled one (a dispatch-mode tracker cannot run its full graph)."""
    for m in model.modules():
        cce = m.__dict__.get("_lowmembp_cce")
        if cce is not None and (cce["impl"] == "torch_compile" or cce["impl"] == "auto" and not any(
                p.is_cuda for p in m.parameters())):
            return True
    return False


class _CCEForward(_ChunkedCEForward):
    """The causal LM's instance-level forward: chunked-ce's, with Cut Cross-Entropy's loss."""

    def __init__(self, base, head, impl, filter_eps, softcap, inner):
        super().__init__(base, head, None, inner)
        self.impl, self.filter_eps, self.softcap = impl, filter_eps, softcap

    def loss(self, hidden, targets, denominator):
        from cut_cross_entropy import linear_cross_entropy

        impl = resolve_impl(self.impl, hidden.device)
        weight = self.head.weight
        dtype = hidden.dtype
        if torch.is_autocast_enabled(hidden.device.type):  # the matmul autocast would run for the lm_head
            dtype = torch.get_autocast_dtype(hidden.device.type)
        if impl == "cce" and (hidden.requires_grad or weight.requires_grad):
            check_kernel_dtype(dtype)  # refused before the forward, not by an assert in the backward
        filter_eps = None if self.filter_eps == "none" else self.filter_eps
        with torch.autocast(hidden.device.type, enabled=False):
            loss = linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, softcap=self.softcap,
                                        reduction="mean" if denominator is None else "sum",
                                        filter_eps=filter_eps, impl=impl)
        return loss if denominator is None else loss / denominator
