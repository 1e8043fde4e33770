"""The architectures beyond the paper's four convert exactly (norm γ/β perturbed), save fewer bytes, get
LoRA on every block's attention and MLP projections; conversions are verified per site; composition, dtype,
DataParallel and ``targets`` checks; no method compares family names."""
import copy
import pathlib
import re

import pytest
import torch
import torch.nn as nn

import lowmembp
from lowmembp.measurement.saved import SavedTensorAccountant
from lowmembp.models import get_layout
from tiny_models import MORE_BUILDERS, build, logits

NAMES = list(MORE_BUILDERS)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _loss(model, batch):
    return logits(model, batch).float().pow(2).mean()


def _saved(model, batch):
    model.train()
    acc = SavedTensorAccountant(model)
    with acc:
        loss = _loss(model, batch)
    loss.backward()
    return acc.report()["total"]


@pytest.mark.parametrize("name", NAMES)
def test_lowmembp_exact_and_saves_less(name):
    model, inputs = build(name)
    model.eval()
    batch = inputs()
    norms = [m for m in model.modules() if "Norm" in type(m).__name__ and getattr(m, "bias", None) is not None]
    assert all(float(m.bias.abs().max()) > 0 for m in norms)  # β perturbed off its init (γ too: tiny_models)
    with torch.no_grad():
        ref = logits(model, batch)
    conv = lowmembp.apply(copy.deepcopy(model), "lowmembp")
    conv.eval()
    with torch.no_grad():
        out = logits(conv, batch)
    assert _rel(out, ref) <= 1e-5
    rep = get_layout(conv).base.lowmembp_report
    assert rep["acts"], rep  # every architecture here has a GELU-like / SiLU activation
    listed = {s["site"] for s in rep["sites"]}
    assert set(rep["norms"]) | {p for p, _ in rep["kept"]} <= listed
    assert all(s["status"] in ("converted", "kept") for s in rep["sites"])
    assert _saved(conv, batch) < _saved(copy.deepcopy(model), batch)


@pytest.mark.parametrize("name", NAMES)
def test_lora_adapts_attention_and_mlp_of_every_block(name):
    model, _ = build(name)
    lay = get_layout(model)
    pm = lowmembp.apply(model, "lora")
    adapted = [n for n, m in pm.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)]
    for b in lay.blocks:
        mine = [a for a in adapted if re.search(rf"(^|\.){re.escape(b.path)}\.", a)]
        assert any(re.search(r"att|attn|attention", a) for a in mine), (b.path, mine)
        assert any(re.search(r"mlp|ffn|intermediate|output\.dense|fc|lin", a) for a in mine), (b.path, mine)
    if name == "phi3":
        leaves = {a.rsplit(".", 1)[-1] for a in adapted}
        assert leaves == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


@pytest.mark.parametrize("name", NAMES)
def test_lora_then_lowmembp_exact(name):
    """peft-wrapped (LoRA with a random B, so the branch is not zero): folding reaches the LoRA A layers too."""
    model, inputs = build(name)
    batch = inputs()
    pm = lowmembp.apply(model, "lora")
    with torch.no_grad():
        for k, p in pm.named_parameters():
            if "lora_B" in k:
                p.normal_(0, 0.1)
    pm.eval()
    with torch.no_grad():
        ref = logits(pm, batch)
    conv = lowmembp.apply(copy.deepcopy(pm), "lowmembp")
    conv.eval()
    with torch.no_grad():
        assert _rel(logits(conv, batch), ref) <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_mesa_eager_attention_exact_in_eval_and_trains(name):
    """Mesa with every reachable attention switched to the eager path: eval forward unchanged, a training step runs
    (attention that is not reachable — layout.attention_style None — is left as it is)."""
    model, inputs = build(name)
    model.eval()
    batch = inputs()
    with torch.no_grad():
        ref = logits(model, batch)
    conv = lowmembp.apply(copy.deepcopy(model), "mesa", mesa_attention="eager")
    conv.eval()
    with torch.no_grad():
        assert _rel(logits(conv, batch), ref) <= 1e-5
    conv.train()
    _loss(conv, batch).backward()
    assert any(p.grad is not None for p in conv.parameters())


def test_float64_models_run_or_are_refused():
    model, inputs = build("gpt2")
    batch = inputs()
    for method in ("checkpointing", "lora"):
        m = lowmembp.apply(copy.deepcopy(model).double(), method)
        m.train()
        logits(m, batch).pow(2).mean().backward()
    for method in ("mesa", "lowmembp", "lowmembp-act"):
        with pytest.raises(TypeError, match="float64"):
            lowmembp.apply(copy.deepcopy(model).double(), method)


def test_gemma_effective_gamma_and_sandwich_norms_kept():
    model, _ = build("gemma2")
    lay = get_layout(model)
    norms = {n.path: n for n in lay.all_norms()}
    n0 = norms["model.layers.0.input_layernorm"]
    assert n0.gamma_offset == 1.0 and n0.foldable
    g, _ = n0.affine()
    assert torch.allclose(g, n0.get().weight + 1)
    for kept in ("post_attention_layernorm", "post_feedforward_layernorm"):
        ns = norms[f"model.layers.0.{kept}"]
        assert not ns.foldable and ns.why, (kept, ns.why)  # feeds the residual add, not a linear: kept exact


def test_post_norm_receivers_found_by_data_flow():
    """DistilBERT: the residual re-application goes where the norm output enters a module and meets an add."""
    model, _ = build("distilbert")
    lay = get_layout(model)
    assert lay.origin == "dataflow"
    norms = {n.path: n for n in lay.all_norms()}
    out0 = norms["distilbert.transformer.layer.0.output_layer_norm"]
    assert out0.foldable and [r.path for r in out0.residual_consumers] == ["distilbert.transformer.layer.1"]
    assert out0.consumers == []  # q/k/v run inside the receiver: they see γ/β re-applied
    sa = norms["distilbert.transformer.layer.0.sa_layer_norm"]  # read by the add of the block that made it
    assert not sa.foldable and "add" in sa.why


def test_conversion_check_names_a_wrong_site():
    """A consumer whose forward is not the plain linear (bias used twice): folding β is wrong, the check says where."""
    from lowmembp.methods._verify import ConversionCheckError

    class TwiceBias(nn.Linear):
        def forward(self, x):
            return nn.functional.linear(x, self.weight, 2 * self.bias)

    toy = _toy()
    toy.blocks[1].up = TwiceBias(16, 32)
    toy.lowmembp_example_inputs = {"x": torch.randn(2, 5, 16)}
    with pytest.raises(ConversionCheckError, match=r"blocks\.1\.ln -> blocks\.1\.up"):
        lowmembp.apply(toy, "lowmembp-norm")


@pytest.mark.parametrize("name", ["vit", "bert", "llama", "gpt2", "gemma2", "hf_vit"])
def test_composition_checked_against_the_model(name):
    with pytest.raises(ValueError, match="cannot be combined") as one:
        lowmembp.apply(build(name)[0], "mesa+lowmembp")
    with pytest.raises(ValueError, match="cannot be combined") as two:
        lowmembp.apply(lowmembp.apply(build(name)[0], "lowmembp"), "mesa")
    core = str(one.value).split(" (")[0]
    assert str(two.value).startswith(core)
    with pytest.raises(ValueError, match="cannot be combined"):
        lowmembp.apply(lowmembp.apply(build(name)[0], "mesa"), "lowmembp-act")


def test_float64_refused_at_apply_and_parallel_wrappers():
    model, _ = build("llama")
    with pytest.raises(TypeError, match="float64"):
        lowmembp.apply(model.double(), "lowmembp")
    with pytest.raises(TypeError, match="before wrapping"):
        lowmembp.apply(nn.DataParallel(build("vit")[0]), "lowmembp")
    with pytest.raises(TypeError, match="before wrapping"):
        get_layout(nn.DataParallel(build("vit")[0]))


def test_single_string_target_is_one_name():
    pm = lowmembp.apply(build("vit")[0], "lora", targets="qkv")
    adapted = {n.rsplit(".", 1)[-1] for n, m in pm.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)}
    assert adapted == {"qkv"}


def test_no_method_compares_family_names():
    root = pathlib.Path(lowmembp.__file__).parent / "methods"
    hits = [f"{p.name}: {line.strip()}" for p in root.glob("*.py") for line in p.read_text().splitlines()
            if re.search(r"family\s*(==|!=|in\b|not in\b)", line)]
    assert not hits, hits


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.up, self.act, self.down = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.ln(x))))


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x).mean(1))


def _toy():
    torch.manual_seed(0)
    toy = _Toy()
    for m in toy.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return toy


def test_unknown_architecture_converts_through_data_flow_or_is_refused():
    toy = _toy()
    with pytest.raises(TypeError, match="sample input"):
        lowmembp.apply(copy.deepcopy(toy), "lowmembp")
    x = torch.randn(2, 5, 16)
    toy.lowmembp_example_inputs = {"x": x}
    ref = toy(x)
    conv = lowmembp.apply(toy, "lowmembp")
    assert _rel(conv(x), ref) <= 1e-5
    assert len(conv.lowmembp_report["norms"]) == 3
