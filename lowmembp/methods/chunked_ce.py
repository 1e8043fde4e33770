"""``chunked-ce``: an exact chunked lm_head + cross-entropy for causal LMs (docs/design.md#peers).

A causal LM's training forward with ``labels`` normally computes the full ``B × S × V`` logits, upcasts them to fp32
and keeps them (and the log-softmax) for backward — at 32k–128k vocabularies often the largest tensors of the step.
Here the model's ``forward`` is wrapped on the instance: with ``labels`` given, in training mode with grad enabled,
the decoder runs as usual, then :func:`lowmembp.ops.chunked_ce.chunked_linear_cross_entropy` computes the loss
``chunk`` tokens at a time (the logits of one chunk alive at a time, recomputed in backward) and the output carries
the loss and no logits. Without labels, in eval or under ``no_grad`` the model's own forward runs (logits as usual).

The loss is the model's own: labels shifted by one, ``-100`` ignored, mean over the remaining tokens (or the sum over
``num_items_in_batch`` when that is passed, as transformers does). Gradients equal the plain ones to rounding.

Option ``chunk`` (default 1024 tokens). Refused for models without a causal-LM head: the task model must be one of
transformers' causal-LM classes whose output embedding (``get_output_embeddings()``) is a plain ``nn.Linear`` read
directly from the decoder's last hidden state (the layout's head), or a linear whose forward is exactly that and
which only saves something else for backward (``computes_linear``: Mesa's ``MesaLinear``; with ``mesa`` the head is
then computed here, its weight's gradient exact and its input kept by this op, not in 8 bits). A LoRA adapter on the
lm_head is refused (its weight is not one matrix); the default ``lora`` targets leave the lm_head alone.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from lowmembp.methods.registry import register


@register("chunked-ce", "exact chunked lm_head + cross-entropy for causal LMs: never the full logits (option chunk)",
          options={"chunk": 1024}, order=45)
def apply_chunked_ce(model: nn.Module, chunk: int = 1024) -> nn.Module:
    from lowmembp.models import get_layout

    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunked-ce: chunk must be a positive number of tokens, got {chunk!r}")
    layout = get_layout(model)
    base = layout.base
    head = causal_lm_head(base, layout)
    object.__setattr__(base, "_lowmembp_chunked_ce", {"chunk": chunk})
    inner = base.__dict__.get("forward")
    base.forward = _ChunkedCEForward(base, head, chunk, inner)
    return model


def causal_lm_head(base: nn.Module, layout, method: str = "chunked-ce") -> nn.Linear:
    """The lm_head linear of a transformers causal LM, or a ValueError (naming ``method``) that says why ``base`` is
    not one."""
    name = type(base).__name__
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        causal = name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    except ImportError:  # pragma: no cover - transformers moved the table
        causal = name.endswith("ForCausalLM")
    get_out = getattr(base, "get_output_embeddings", None)
    out_emb = get_out() if causal and callable(get_out) else None
    if not causal or out_emb is None:
        raise ValueError(f"{method}: {name} has no causal-LM head (it needs a transformers *ForCausalLM model "
                         "whose loss is the shifted next-token cross-entropy); use it on LLaMA-like causal LMs only")
    heads = [s.get() for s in layout.head]
    one_matrix = type(out_emb) is nn.Linear or getattr(type(out_emb), "computes_linear", False)
    if out_emb not in heads or not one_matrix:
        raise ValueError(f"{method}: the output embedding of {name} is {type(out_emb).__name__}, not a plain "
                         "nn.Linear read from the last hidden state (a transform in between, or a LoRA adapter on "
                         f"lm_head); {method} computes lm_head as one matrix — leave lm_head out of the LoRA targets")
    if not callable(getattr(base, "get_decoder", None)) or base.get_decoder() is base:
        raise ValueError(f"{method}: {name}.get_decoder() does not give the decoder below the head")
    return out_emb


class _ChunkedCEForward:
    """Instance-level forward of the causal LM (picklable; see checkpointing's ``_CheckpointedForward``)."""

    def __init__(self, base, head, chunk, inner):
        self.base, self.head, self.chunk, self.inner = base, head, chunk, inner

    @property
    def __signature__(self):  # what inspect.signature (the HF Trainer) reads: the replaced forward's parameters
        from lowmembp.methods._signature import original_signature
        return original_signature(self.base, "forward", self.inner)

    def __call__(self, *args, labels=None, **kwargs):
        base = self.base
        plain = self.inner or (lambda *a, **k: type(base).forward(base, *a, **k))
        if labels is None or len(args) > 1 or not (base.training and torch.is_grad_enabled()):
            return plain(*args, labels=labels, **kwargs)
        if args:
            kwargs["input_ids"] = args[0]
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("logits_to_keep", None)
        denominator = kwargs.pop("num_items_in_batch", None)
        out = base.get_decoder()(**kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        # the model's own shift: position i predicts labels[i + 1]; the last position predicts nothing (-100)
        targets = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1).to(hidden.device)
        loss = self.loss(hidden.reshape(-1, hidden.shape[-1]), targets, denominator)
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))

    def loss(self, hidden, targets, denominator):
        """The loss of the ``N × D`` last hidden states against ``N`` targets (-100: ignored): the mean over the
        counted targets, or their sum over ``denominator`` when given."""
        from lowmembp.ops.chunked_ce import chunked_linear_cross_entropy

        head = self.head
        return chunked_linear_cross_entropy(hidden, head.weight, head.bias, targets, chunk=self.chunk,
                                            denominator=denominator)
