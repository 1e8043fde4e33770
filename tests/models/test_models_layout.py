"""Architecture adapters: every family is found by structure, with the right sites, plain and peft-wrapped."""
import pytest
import torch
import torch.nn as nn

from lowmembp.models import UnsupportedModelError, get_layout

from tiny_models import FAMILY_BUILDERS, build, lora_wrap


@pytest.mark.parametrize("name", sorted(FAMILY_BUILDERS))
def test_layout_sites_resolve(name):
    model, _ = build(name)
    lay = get_layout(model)
    assert lay.family == FAMILY_BUILDERS[name][0]
    assert lay.base is model
    n = len(lay.blocks)
    assert n >= 2 and len(lay.attentions) == n
    # every site resolves to a module; norms are norms, consumers are linears reading the norm's width
    for s in lay.blocks + lay.attentions:
        assert isinstance(s.get(), nn.Module)
    for ns in lay.all_norms():
        norm = ns.get()
        width = norm.weight.shape[0]
        for c in ns.consumers:
            lin = c.get()
            assert isinstance(lin, nn.Linear) and lin.in_features == width, (ns, c)
    assert all(a.kind in ("gelu", "silu") for a in lay.acts) and len(lay.acts) == n
    per_block = 2 if lay.family != "bert" else 2  # bert: embedding LN + attention-output LN per layer (minus last)
    assert len(lay.norms) >= per_block * n - (1 if lay.family == "bert" else 0)
    assert lay.final_norm is not None
    # forward order: block sites are distinct and in module order
    mods = [s.get() for s in lay.blocks]
    order = [m for m in model.modules() if any(m is x for x in mods)]
    assert order == mods


@pytest.mark.parametrize("name", sorted(FAMILY_BUILDERS))
def test_site_set_replaces_in_container(name):
    model, _ = build(name)
    lay = get_layout(model)
    s = lay.blocks[-1]
    old = s.get()
    wrapper = nn.Sequential(old) if lay.family in ("vit",) else old  # ViT blocks take one tensor: wrap it
    s.set(wrapper)
    assert s.get() is wrapper
    s.set(old)
    assert get_layout(model).blocks[-1].get() is old


@pytest.mark.parametrize("name", ["vit", "llama", "roberta", "swin"])
def test_layout_through_peft(name):
    model, _ = build(name)
    peft_model = lora_wrap(model, name)
    lay = get_layout(peft_model)
    assert lay.base is model and lay.model is peft_model
    # consumers are the live (LoRA-wrapped where targeted) modules inside the model
    wrapped = [c for ns in lay.norms for c in ns.consumers if hasattr(c.get(), "base_layer")]
    assert wrapped, "LoRA targets should appear as consumers"


def test_heads_and_final_norm():
    model, _ = build("llama")
    lay = get_layout(model)
    assert [s.attr for s in lay.head] == ["lm_head"] and lay.final_norm.foldable
    bare, _ = build("llama_bare")
    lb = get_layout(bare)
    assert lb.head == [] and not lb.final_norm.foldable and "bare" in lb.final_norm.why
    bert, _ = build("bert")
    lb = get_layout(bert)
    assert not lb.final_norm.foldable and lb.final_norm.post_norm
    assert all(ns.post_norm and len(ns.residual_consumers) == 1 for ns in lb.norms)
    vit, _ = build("vit")
    assert [s.attr for s in get_layout(vit).head] == ["head"]


def test_unsupported_model_error_names_families():
    with pytest.raises(UnsupportedModelError) as e:
        get_layout(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    msg = str(e.value)
    for word in ("vit", "swin", "bert", "llama", "adapter", "blocks", "norm"):
        assert word in msg


def test_llama_like_with_extra_norms_goes_through_data_flow():
    """A layer the llama adapter refuses (an extra norm) is mapped by data flow; the refusal is kept as a note."""
    model, _ = build("llama")
    layer = model.model.layers[0]
    layer.pre_feedforward_layernorm = type(layer.input_layernorm)(layer.input_layernorm.weight.shape[0])
    lay = get_layout(model)
    assert lay.origin == "dataflow"
    assert any("pre_feedforward_layernorm" in n for n in lay.notes)
    by_path = {n.path: n for n in lay.all_norms()}
    assert "model.layers.0.pre_feedforward_layernorm" not in by_path  # never called: not part of the forward
    assert {c.path for c in by_path["model.layers.0.input_layernorm"].consumers} == {
        f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")}


def test_layout_on_meta_device():
    with torch.device("meta"):
        model, _ = build("qwen2")
    lay = get_layout(model)
    assert lay.family == "llama" and lay.norms[0].consumers[0].get().weight.is_meta


def test_layout_module_imports_no_adapter():
    """detect.py is a leaf, layout.py imports no adapter module (no import cycle); adapters register by priority."""
    import pathlib
    import re

    import lowmembp.models.layout as layout_mod
    from lowmembp.models.layout import _ADAPTERS
    src = pathlib.Path(layout_mod.__file__).read_text()
    assert not re.search(r"import.*(hf_models|timm_models|dataflow)", src)
    detect_src = (pathlib.Path(layout_mod.__file__).parent / "detect.py").read_text()
    assert not re.search(r"^\s*(from lowmembp|import lowmembp)", detect_src, re.M)
    prios = [a[0] for a in _ADAPTERS]
    assert prios == sorted(prios, reverse=True) and _ADAPTERS[-1][2] == "dataflow"
