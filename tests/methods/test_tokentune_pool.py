"""tokentune's classification head reads what the model's own head reads (``pool="model"``, the default): with every
position selected one training step equals the unconverted model's (loss and gradients, float64); with k < L the
head's input is the model's own pooled feature of the same final hidden states at the selected rows; the facts come
from the adapters (``ModelLayout.head_reads`` / ``head_lead``); errors."""
import copy

import pytest
import torch

import lowmembp
from lowmembp.methods.tokentune import tokentune_state
from lowmembp.models import get_layout
from tokentune_refs import _randomise, _vit, batch, build, grads, loss_of

CLASSIFIERS = ["vit", "vit_avg", "vit_avg_reg", "bert", "roberta", "llama_cls"]


def make(name, seed=0):
    if name == "vit_avg_reg":  # class token + 2 register tokens, pooled by the mean of the patch tokens (3 set apart)
        torch.manual_seed(seed)
        model = _vit(global_pool="avg", reg_tokens=2)
        _randomise(model)
        return model.double()
    return build(name, seed).double()


def inputs_of(name, **kw):
    inputs = batch("vit" if name.startswith("vit") else name, **kw)  # row 1 right-padded (text models)
    if "x" in inputs:
        inputs["x"] = inputs["x"].double()
    return inputs


def assert_same_grads(g, gr):
    assert set(g) == set(gr) and g, set(g) ^ set(gr)
    for n in g:
        torch.testing.assert_close(g[n], gr[n], rtol=1e-9, atol=1e-12 * max(1.0, gr[n].abs().max().item()),
                                   msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_every_position_selected_equals_the_unconverted_training_step(name):
    model = make(name)
    plain = copy.deepcopy(model).train()
    inputs = inputs_of(name)
    model = lowmembp.apply(model, "tokentune", k=512).train()
    loss = loss_of(name, model, inputs)
    loss.backward()
    assert tokentune_state(model).last.others.shape[1] == 0
    loss_ref = loss_of(name, plain, inputs)
    loss_ref.backward()
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-12, atol=1e-12)
    assert_same_grads(grads(model), grads(plain))


def _head_and_feature(name, plain, inputs, positions):
    """(the module whose input is the head's input, that input computed from the plain model's final hidden states:
    the model's own pooling of the rows at ``positions``)."""
    with torch.no_grad():
        if name.startswith("vit"):
            feats = plain.forward_features(inputs["x"])  # final norm applied
            rows = feats.gather(1, positions[..., None].expand(-1, -1, feats.shape[-1]))
            return "head", plain.forward_head(rows, pre_logits=True)
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        if name == "llama_cls":
            h = plain.model(input_ids=ids, attention_mask=mask).last_hidden_state  # final norm applied
            last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # the last real token (right padding in row 1)
            return "score", h[torch.arange(h.shape[0]), last]
        h = plain.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        return ("bert.pooler.dense" if name == "bert" else "classifier.dense"), h[:, 0]  # [CLS] / <s>


@pytest.mark.parametrize("name", CLASSIFIERS)
@pytest.mark.parametrize("k", [4, 6])
def test_head_input_is_the_models_own_pool_of_the_selected_rows(name, k):
    model = make(name)
    plain = copy.deepcopy(model).eval()
    inputs = inputs_of(name)
    model = lowmembp.apply(model, "tokentune", k=k, seed=5).train()
    seen = []
    loss_of(name, model, inputs)  # a first draw, to know the positions' shape (then replayed below)
    sel = tokentune_state(model).last
    L = sel.positions.shape[1] + sel.others.shape[1]
    assert sel.positions.shape[1] == k < L
    path, expect = _head_and_feature(name, plain, inputs, sel.positions)
    handle = model.get_submodule(path).register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    tokentune_state(model).selector = lambda valid, kk, decoder, gen: sel.positions  # the same positions again
    try:
        loss_of(name, model, inputs)
    finally:
        handle.remove()
    got = seen[-1]
    if name == "roberta":  # its head's dense reads features[:, 0] (dropout 0)
        got = got.reshape(expect.shape)
    torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-12)
    if name.startswith("vit_avg"):  # the restriction matters: the pool of every row is another feature
        with torch.no_grad():
            every = plain.forward_head(plain.forward_features(inputs["x"]), pre_logits=True)
        assert (got - every).abs().max() > 1e-4


def test_read_rows_are_always_selected():
    # token-pooled ViT: the class token; avg with register tokens: the 3 prefix rows, first; BERT: [CLS];
    # LLaMA classifier with k = 1: the last real token (the one its head reads), also when left-padded
    for name, k, want in (("vit", 2, [0]), ("vit_avg_reg", 4, [0, 1, 2]), ("bert", 2, [0])):
        model = lowmembp.apply(make(name), "tokentune", k=k, seed=1).train()
        loss_of(name, model, inputs_of(name))
        pos = tokentune_state(model).last.positions
        assert (pos[:, :len(want)] == torch.tensor(want)).all(), pos
    inputs = inputs_of("llama_cls", left_pad=True)
    model = lowmembp.apply(make("llama_cls"), "tokentune", k=1, seed=1).train()
    model(**inputs).loss.backward()
    mask = inputs["attention_mask"]
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    assert torch.equal(tokentune_state(model).last.positions[:, 0], last)


def test_adapters_say_what_the_head_reads():
    facts = {name: (get_layout(make(name)).head_reads, get_layout(make(name)).head_lead)
             for name in CLASSIFIERS + ["llama"]}
    assert facts == {"vit": ("first", 1), "vit_avg": ("pool", 0), "vit_avg_reg": ("pool", 3), "bert": ("first", 1),
                     "roberta": ("first", 1), "llama_cls": ("last", 0), "llama": ("each", 0)}


def test_errors():
    with pytest.raises(ValueError, match="pool must be 'model'"):
        lowmembp.apply(build("bert"), "tokentune", pool="cls")
    with pytest.raises(ValueError, match="k=3 is less than the 4 tokens .* 3 leading .* one token to pool"):
        lowmembp.apply(make("vit_avg_reg"), "tokentune", k=3)
    lowmembp.apply(make("vit_avg_reg"), "tokentune", k=2, pool="mean")  # the mean needs no prefix rows
    with pytest.raises(ValueError, match="for classification heads"):
        lowmembp.apply(build("llama"), "tokentune", pool="mean")
    model = lowmembp.apply(build("bert"), "tokentune", k=3).train()
    tokentune_state(model).selector = lambda valid, k, decoder, gen: torch.tensor([[1, 2, 3]]).expand(3, 3)
    with pytest.raises(ValueError, match="must include the positions the model's head reads"):
        model(**batch("bert"))
    cfg = build("llama_cls").config
    cfg.pad_token_id = None
    import transformers
    nopad = lowmembp.apply(transformers.LlamaForSequenceClassification(cfg), "tokentune", k=3).train()
    with pytest.raises(ValueError, match="no padding token"):
        nopad(input_ids=torch.randint(2, 50, (2, 7)))
