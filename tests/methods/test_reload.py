"""Checkpoints of converted models reload exactly the usual way: ``save_pretrained`` on a converted
(trained) model → stock ``from_pretrained`` / ``PeftModel.from_pretrained(fresh_base, dir)`` gives the same logits.

The reference failure: peft's own ``save_pretrained`` on a ``lora+lowmembp`` model writes A with γ folded in, and the
fresh base applies γ again (checked here, so these tests can tell a silent mismatch from an exact reload).
"""
import warnings

import pytest

import lowmembp
from lowmembp.methods.export import ExportError
from test_export import TOL, eval_logits, rel, train
from tiny_models import build

peft = pytest.importorskip("peft")


def converted_trained(name, method):
    model, inputs = build(name)
    model = train(lowmembp.apply(model, method), inputs(2))
    return model, inputs, eval_logits(model, inputs(3))


@pytest.mark.parametrize("name", ["llama", "llama_tied", "bert"])
def test_full_finetune_save_pretrained_from_pretrained(name, tmp_path):
    model, inputs, want = converted_trained(name, "lowmembp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # llama_tied: head and embedding trained apart -> untied
        model.save_pretrained(tmp_path)  # the converted model's save_pretrained saves the export
    back = type(model).from_pretrained(tmp_path).eval()
    assert not [m for m in back.modules() if type(m).__module__.startswith("lowmembp")]
    assert rel(eval_logits(back, inputs(3)), want) <= TOL
    assert rel(eval_logits(model, inputs(3)), want) == 0  # saving did not change the converted model


@pytest.mark.parametrize("name", ["llama", "bert", "vit"])
def test_lora_adapter_reloads_into_a_fresh_base(name, tmp_path):
    model, inputs, want = converted_trained(name, "lora+lowmembp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", getattr(getattr(peft.utils, "warning", None), "PeftWarning", UserWarning))
        model.save_pretrained(tmp_path / "adapter")
    fresh, _ = build(name)  # the same base weights the run started from, never converted
    back = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    assert rel(eval_logits(back, inputs(3)), want) <= TOL

    # what a plain peft save of the converted model gives: γ applied twice (the bug this guards against)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft also takes the 1-D folded lora_A biases for ungathered ZeRO-3 shards
        peft.PeftModel.save_pretrained(model, tmp_path / "naive")
    naive = peft.PeftModel.from_pretrained(build(name)[0], tmp_path / "naive").eval()
    assert rel(eval_logits(naive, inputs(3)), want) > 1e-3


def test_exported_adapter_config_carries_lora_bias_only_when_needed(tmp_path):
    import json
    for name, needed in (("bert", True), ("llama", False)):  # LayerNorm β gives LoRA A a bias; RMSNorm has no β
        model, _, _ = converted_trained(name, "lora+lowmembp")
        model.save_pretrained(tmp_path / name)
        cfg = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert cfg["lora_bias"] is needed


def test_save_pretrained_with_a_converted_state_dict_is_refused(tmp_path):
    model, _, _ = converted_trained("bert", "lowmembp")
    with pytest.raises(ExportError, match="folded weights"):
        model.save_pretrained(tmp_path, state_dict=model.state_dict())


def test_exported_model_saves_like_a_stock_one(tmp_path):
    """export(model).save_pretrained writes what a fresh model's save_pretrained writes: the same files and keys."""
    from safetensors.torch import load_file
    model, inputs, want = converted_trained("llama", "lowmembp")
    lowmembp.export(model).save_pretrained(tmp_path / "ex")
    build("llama")[0].save_pretrained(tmp_path / "stock")
    assert sorted(p.name for p in (tmp_path / "ex").iterdir()) == sorted(p.name for p in (tmp_path / "stock").iterdir())
    a, b = load_file(tmp_path / "ex" / "model.safetensors"), load_file(tmp_path / "stock" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("name", ["bert", "vit"])
def test_lora_applied_after_lowmembp_in_a_separate_call(name, tmp_path):
    """LoRA placed on already-folded linears: A reads the MS-norm output; its stock form is A·diag(1/γ) plus a bias."""
    model, inputs = build(name)
    model = lowmembp.apply(lowmembp.apply(model, "lowmembp"), "lora")
    model = train(model, inputs(2))
    want = eval_logits(model, inputs(3))
    model.save_pretrained(tmp_path)
    back = peft.PeftModel.from_pretrained(build(name)[0], tmp_path).eval()
    assert rel(eval_logits(back, inputs(3)), want) <= TOL


def test_trainer_save_model_reloads_exactly(tmp_path):
    """transformers.Trainer.save_model (a lora+lowmembp run's checkpoint) -> PeftModel.from_pretrained(fresh base)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model, inputs, want = converted_trained("bert", "lora+lowmembp")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    transformers.Trainer(model=model, args=args).save_model(str(tmp_path / "saved"))
    back = peft.PeftModel.from_pretrained(build("bert")[0], tmp_path / "saved").eval()
    assert rel(eval_logits(back, inputs(3)), want) <= TOL


def _more():
    import tiny_models
    return sorted(getattr(tiny_models, "MORE_BUILDERS", {}))  # the architectures beyond the paper's four


# Architectures of _more() that a method refuses, with the error it must raise: (name, method) -> exception type.
# Empty: every architecture of tiny_models.MORE_BUILDERS converts under lowmembp and lora+lowmembp; a refusal is a
# regression and fails the test (it used to be turned into a skip).
EXPECTED_REFUSALS: dict[tuple[str, str], type[Exception]] = {}


def _apply(name, model, method):
    if (name, method) in EXPECTED_REFUSALS:
        with pytest.raises(EXPECTED_REFUSALS[name, method]):
            lowmembp.apply(model, method)
        pytest.skip(f"{method} refuses {name} (expected)")
    return lowmembp.apply(model, method)


@pytest.mark.parametrize("name", _more())
def test_more_architectures_reload_exactly(name, tmp_path):
    """Full fine-tuning: export -> save_pretrained -> from_pretrained (transformers) or a strict state_dict load (timm).
    Linears that had no bias before folding (GPT-2's lm_head, StableLM's q/k/v) are frozen: trained, their folded
    bias has no stock form (test_export.py checks that refusal)."""
    model, inputs = build(name)
    model = _apply(name, model, "lowmembp")
    base = model
    for f in base.__dict__["_lowmembp_export"].folds:
        for p, had in f.stock_bias.items():
            if not had:
                base.get_submodule(p).requires_grad_(False)
    model = train(model, inputs(2))
    want = eval_logits(model, inputs(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tied heads trained apart are exported untied
        exported = lowmembp.export(model)
    assert not [m for m in exported.modules() if type(m).__module__.startswith("lowmembp")]
    if hasattr(exported, "save_pretrained"):
        exported.save_pretrained(tmp_path)
        back = type(exported).from_pretrained(tmp_path)
    else:
        back = build(name, seed=7)[0]
        back.load_state_dict(exported.state_dict(), strict=True)
    assert rel(eval_logits(back.eval(), inputs(3)), want) <= TOL


@pytest.mark.parametrize("name", _more())
def test_more_architectures_lora_adapter_reloads(name, tmp_path):
    model, inputs = build(name)
    model = train(_apply(name, model, "lora+lowmembp"), inputs(2))
    want = eval_logits(model, inputs(3))
    model.save_pretrained(tmp_path)
    back = peft.PeftModel.from_pretrained(build(name)[0], tmp_path).eval()
    assert rel(eval_logits(back, inputs(3)), want) <= TOL
