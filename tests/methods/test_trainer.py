"""Every method trains through the HF ``Trainer`` at default ``TrainingArguments`` (also with
``gradient_checkpointing=True``) and through ``accelerate``; patched forwards keep the signature the Trainer reads.

The Trainer keeps only the batch keys named in ``inspect.signature(model.forward)`` (``remove_unused_columns``, for
a torch Dataset through its column-removing collator); a forward patched as ``(*args, **kwargs)`` would lose every
input. The batches carry an extra key (``row``) the model does not take, which the Trainer must drop.
"""
import inspect
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import lowmembp  # noqa: E402
from tiny_models import VOCAB, build  # noqa: E402

METHODS = [("baseline", {}), ("lowmembp", {}), ("mesa", {}), ("lora", {}), ("lora+lowmembp", {}),
           ("tokentune", {"k": 3}), ("checkpointing", {})]


class Rows(torch.utils.data.Dataset):
    """Eight tokenised rows of a 3-class task (one padded), as dicts of tensors."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, VOCAB, (8, 7), generator=g)
        self.mask = torch.ones(8, 7, dtype=torch.long)
        self.mask[1, 5:] = 0
        self.labels = torch.randint(0, 3, (8,), generator=g)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "token_type_ids": torch.zeros(7).long(),
                "labels": self.labels[i], "row": i}


def _model(spec, options, name="bert"):
    model, _ = build(name)
    sig = inspect.signature(model.forward)
    model = lowmembp.apply(model, spec, **options)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    assert inspect.signature(inner.forward) == sig
    return model


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
@pytest.mark.parametrize("spec,options,name", [m + ("bert",) for m in METHODS] + [("tokentune", {"k": 3}, "llama_cls")],
                         ids=[m for m, _ in METHODS] + ["tokentune-llama"])
def test_trainer_default_arguments(tmp_path, spec, options, name, checkpointing):
    from transformers import Trainer, TrainingArguments

    model = _model(spec, options, name)
    before = _trainable(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, gradient_checkpointing=checkpointing, save_strategy="no",
                             learning_rate=1e-2)
    result = Trainer(model=model, args=args, train_dataset=Rows()).train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    after = _trainable(model)
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(moved) >= len(before) // 2, f"only {len(moved)} of {len(before)} trainable tensors changed"


@pytest.mark.parametrize("spec,options", METHODS, ids=[m for m, _ in METHODS])
def test_accelerate(spec, options):
    from accelerate import Accelerator

    model = _model(spec, options)
    before = _trainable(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = [{k: v for k, v in Rows()[i].items() if k != "row"} for i in range(8)]
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    accelerator = Accelerator(cpu=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    model.train()
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(loss)
    after = _trainable(accelerator.unwrap_model(model))
    assert sum(not torch.equal(before[n], after[n]) for n in before) >= len(before) // 2


@pytest.mark.parametrize("spec", ["tokentune", "checkpointing", "sac", "chunked-ce", "tokentune+checkpointing"])
def test_patched_forwards_keep_the_signature(spec):
    model, _ = build("llama")
    top, block = inspect.signature(model.forward), inspect.signature(model.model.layers[0].forward)
    model = lowmembp.apply(model, spec, **({"k": 3} if "tokentune" in spec else {}))
    assert inspect.signature(model.forward) == top
    assert inspect.signature(model.model.layers[0].forward) == block
