"""``cce``: Cut Cross-Entropy (Wijmans et al., ICLR 2025) for causal LMs, through the ``cut-cross-entropy`` package.

Hooks the causal LM as ``chunked-ce`` does (lowmembp.methods.chunked_ce): with ``labels``, in training mode with grad
enabled, the decoder runs as usual and the loss is ``cut_cross_entropy.linear_cross_entropy(hidden, lm_head.weight,
targets)`` — the model's own loss (labels shifted by one, ``-100`` ignored, the mean over the counted tokens, or the
sum over ``num_items_in_batch`` when given; Gemma-2's ``final_logit_softcapping`` passed as CCE's ``softcap``), the
output carrying no logits. Without labels, in eval or under ``no_grad`` the model's own forward runs.

The package has two implementations (option ``impl``):

- ``"cce"``: its Triton kernels (CUDA only). The ``B·S × V`` logits are never written to memory: the forward
  computes each token's log-sum-exp block by block in on-chip memory, the backward recomputes the logit blocks and
  skips those whose softmax values are below ``filter_eps`` (``"high"``, the package's default: the input dtype's
  machine epsilon / 32, 2.4e-4 for bf16 and 3.1e-5 for fp16; ``none``: no filtering).
- ``"torch_compile"``: ``torch.compile`` of ``F.cross_entropy((e @ cᵀ).float())`` — runs on the CPU (and on CUDA);
  what it keeps is what inductor generates (on the CPU the logits are materialised: exact, without the kernel's
  saving). The first call compiles (~10 s on a CPU).
- ``"auto"`` (default): ``"cce"`` on CUDA tensors, ``"torch_compile"`` elsewhere. ``impl="cce"`` on a CPU tensor is
  refused at the first training step with the reason, and so is the kernel (``"cce"``, or ``"auto"`` on CUDA) for a
  float32 lm_head input: the package's backward kernel takes bf16 / fp16 only (train in bf16 / fp16 or under autocast,
  or choose ``impl="torch_compile"``). Its gradients are summed block by block in the input dtype (bf16 rounding at
  each of the ~V/128 vocabulary blocks), so they differ from the plain bf16 model's by more than one rounding.

Needs ``pip install cut-cross-entropy`` (the ``cce`` extra; it needs triton, which torch on Linux brings). Refused
for models without a causal-LM head, an lm_head with a bias (CCE's classifier is one matrix) or a LoRA adapter on the
lm_head, exactly as ``chunked-ce`` (whose message it shares). Excludes ``chunked-ce`` and ``liger`` (the same loss
computed another way). Composes with ``lora`` / ``velora``, ``lowmembp``, ``checkpointing``, ``tiled-mlp`` and the
other methods that leave the lm_head a linear.
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
