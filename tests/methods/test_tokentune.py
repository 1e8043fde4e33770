"""tokentune: eval forward = the unmodified model; training gradient = the slow reference (tokentune_refs); saved
bytes ∝ k/L; selection rules; errors."""
import copy

import pytest
import torch
import torch.nn.functional as F

import lowmembp
from lowmembp.methods.tokentune import select_positions, tokentune_state
from tokentune_refs import (MODELS, VOCAB, _bert, _blocks, _llama, _vit, batch, build, compare_grads, grads, loss_of,
                            reference_loss, saved_bytes)


# ------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(MODELS))
def test_eval_forward_equals_unmodified(name):
    model = build(name)
    ref = copy.deepcopy(model).eval()
    inputs = batch(name, left_pad=name == "llama_cls")
    inputs.pop("labels", None)
    model = lowmembp.apply(model, "tokentune", k=4).eval()
    with torch.no_grad():
        a = model(**inputs) if "x" not in inputs else model(inputs["x"])
        b = ref(**inputs) if "x" not in inputs else ref(inputs["x"])
    a, b = (a.logits, b.logits) if hasattr(a, "logits") else (a, b)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name,pool", [(n, "model") for n in MODELS]
                         + [(n, "mean") for n in MODELS if n not in ("llama", "llama_qwen3")])  # LM: per position
@pytest.mark.parametrize("k", [1, 5])
def test_gradient_equals_detached_reference(name, k, pool):
    model = build(name)
    ref = copy.deepcopy(model).train()
    inputs = batch(name, left_pad=name.startswith("llama"))
    model = lowmembp.apply(model, "tokentune", k=k, seed=3, pool=pool).train()
    loss = loss_of(name, model, inputs)
    loss.backward()
    sel = tokentune_state(model).last
    assert sel.positions.shape[1] == k
    loss_ref = reference_loss(name, ref, inputs, sel.positions, sel.valid, pool=pool)
    loss_ref.backward()
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-5, atol=1e-6)  # the forward is exact
    worst = compare_grads(grads(model), grads(ref))
    print(f"{name} k={k}: loss {loss.item():.6f} vs {loss_ref.item():.6f}, max grad diff {worst:.2e}")


def test_selection_changes_the_gradient():
    """The reference is sensitive to the selection: a different set of positions gives other gradients."""
    name = "bert"
    model = build(name)
    ref = copy.deepcopy(model).train()
    inputs = batch(name)
    model = lowmembp.apply(model, "tokentune", k=4, seed=0).train()
    loss_of(name, model, inputs).backward()
    sel = tokentune_state(model).last
    shifted = torch.where(sel.positions > 0, (sel.positions % 10) + 1, sel.positions).sort(1).values
    shifted[:, 1:] = torch.tensor([2, 5, 8])  # other real positions than the ones chosen (unless equal by chance)
    if torch.equal(shifted, sel.positions):
        shifted[:, 1:] = torch.tensor([3, 6, 9])
    reference_loss(name, ref, inputs, shifted, torch.ones_like(sel.valid)).backward()
    g, gr = grads(model), grads(ref)
    assert max((g[n] - gr[n]).abs().max().item() for n in g) > 1e-4


def test_padding_never_selected_and_first_last_always():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        B, L = 5, 23
        valid = torch.ones(B, L, dtype=torch.bool)
        for b in range(B):
            lo = int(torch.randint(0, 6, (1,), generator=g))
            hi = L - int(torch.randint(0, 6, (1,), generator=g))
            valid[b, :lo] = False
            valid[b, hi:] = False
        for decoder in (False, True):
            k = 1 + trial % 9
            pos = select_positions(valid, k, decoder=decoder, generator=g)
            assert pos.shape == (B, k)
            assert valid.gather(1, pos).all(), "a padding position was selected"
            assert (pos.sort(1).values.diff(dim=1) > 0).all(), "positions repeat"
            first = valid.to(torch.uint8).argmax(1)
            last = L - 1 - valid.flip(1).to(torch.uint8).argmax(1)
            assert (pos == first[:, None]).any(1).all()
            if decoder and k >= 2:
                assert (pos == last[:, None]).any(1).all()


def test_short_sequences_use_every_real_token_and_flag_the_fill():
    model = lowmembp.apply(build("bert"), "tokentune", k=15).train()
    inputs = batch("bert", L=19)  # row 1 has 12 real tokens
    model(**inputs).loss.backward()
    sel = tokentune_state(model).last
    mask = inputs["attention_mask"].bool()
    assert torch.equal(sel.valid, mask.gather(1, sel.positions))
    assert sel.valid[1].sum() == 12 and sel.valid[0].all()


def test_selection_follows_seed_and_global_rng():
    inputs = batch("bert")
    picks = []
    for seed in (7, 7, 8):
        model = lowmembp.apply(build("bert"), "tokentune", k=6, seed=seed).train()
        model(**inputs)
        picks.append(tokentune_state(model).last.positions)
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])
    model = lowmembp.apply(build("bert"), "tokentune", k=6).train()
    torch.manual_seed(5)
    model(**inputs)
    a = tokentune_state(model).last.positions
    torch.manual_seed(5)
    model(**inputs)
    assert torch.equal(a, tokentune_state(model).last.positions)


def test_k_at_least_L_is_full_finetuning_llama_lm():
    """Every position selected: exactly the ordinary causal-LM loss and gradients (the classifiers:
    test_tokentune_pool.py)."""
    name = "llama"
    model = build(name)
    plain = copy.deepcopy(model).train()
    inputs = batch(name, L=11)
    model = lowmembp.apply(model, "tokentune", k=64).train()
    loss = model(**inputs).loss
    loss.backward()
    assert tokentune_state(model).last.others.shape[1] == 0
    loss_ref = plain(**inputs).loss
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    compare_grads(grads(model), grads(plain))


def test_pool_mean_with_k_at_least_L_is_the_mean_pooled_model():
    """``pool="mean"`` (the earlier behaviour): all positions, no stop-gradient anywhere — the plain model with its
    head fed the mean of the real tokens."""
    model = build("bert")
    plain = copy.deepcopy(model).train()
    inputs = batch("bert", L=11)
    model = lowmembp.apply(model, "tokentune", k=64, pool="mean").train()
    loss = model(**inputs).loss
    loss.backward()
    ref_out = plain.bert(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    w = inputs["attention_mask"][..., None].float()
    pooled = (ref_out.last_hidden_state * w).sum(1) / w.sum(1)
    logits = plain.classifier(plain.bert.pooler.activation(plain.bert.pooler.dense(pooled)))
    loss_ref = F.cross_entropy(logits, inputs["labels"])
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    compare_grads(grads(model), grads(plain))


# ----------------------------------------------------------------------------------------------- saved bytes
@pytest.mark.parametrize("name", ["bert", "llama", "vit"])
def test_saved_bytes_scale_with_k(name):
    L = 128
    if name == "vit":
        inputs = {"x": torch.randn(2, 3, 44, 44)}  # 11×11 patches + class token = 122 tokens

        def make():
            return _vit(img=44, depth=3)
    else:
        inputs = batch(name, B=2, L=L, pad=False)

        def make():
            return _bert(layers=3) if name == "bert" else _llama(layers=3)
    torch.manual_seed(0)
    full_model = make().train()
    full = saved_bytes(full_model, lambda: loss_of(name, full_model, inputs))
    by_k = {}
    for k in (8, 16, 32):
        torch.manual_seed(0)
        model = lowmembp.apply(make(), "tokentune", k=k, seed=0).train()
        by_k[k] = saved_bytes(model, lambda: loss_of(name, model, inputs))
    n_tok = 122 if name == "vit" else L
    print(f"{name} L={n_tok}: full {full} B; " + ", ".join(f"k={k}: {b} B ({b / full:.2f})" for k, b in by_k.items()))
    assert by_k[8] < by_k[16] < by_k[32] < full
    d1, d2 = by_k[16] - by_k[8], by_k[32] - by_k[16]
    assert 1.6 < d2 / d1 < 2.4, (d1, d2)  # linear in k
    per_token = d1 / 8
    floor = by_k[8] - 8 * per_token
    assert per_token * L > 2.5 * floor, (per_token, floor)  # the row-wise part dominates a full-length model
    assert by_k[16] < 0.45 * full


# ----------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("k", [0, -3, 2.5, True, "16"])
def test_bad_k(k):
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        lowmembp.apply(build("bert"), "tokentune", k=k)


def test_unsupported_models():
    import transformers
    from timm.models.swin_transformer import SwinTransformer
    mlm = transformers.BertForMaskedLM(_bert().config)
    with pytest.raises(TypeError, match="sequence classification"):
        lowmembp.apply(mlm, "tokentune")
    swin = SwinTransformer(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(2,), num_heads=(1,))
    with pytest.raises(TypeError, match="tokentune supports the families"):
        lowmembp.apply(swin, "tokentune")
    with pytest.raises(Exception, match="no architecture adapter"):
        lowmembp.apply(torch.nn.Linear(3, 3), "tokentune")
    model = lowmembp.apply(build("llama"), "tokentune", k=4).train()
    with pytest.raises(TypeError, match="output_attentions"):
        model(input_ids=torch.randint(2, VOCAB, (1, 6)), output_attentions=True)
    with pytest.raises(ValueError, match="2-D attention_mask"):
        model(input_ids=torch.randint(2, VOCAB, (1, 6)), attention_mask=torch.ones(1, 1, 6, 6))


@pytest.mark.parametrize("name", ["vit", "llama"])
def test_frozen_pre_norm_keeps_only_the_selected_rows_of_its_input(name):
    """Trainable pre-norm: its input over all L rows is kept (its γ/β get gradient from every key/value). Frozen
    (LoRA-style): only the k selected rows — at least blocks·B·(L−k)·d floats less."""
    B, L, k, blocks, d = 2, 40, 6, 2, 24
    inputs = ({"x": torch.randn(B, 3, 24, 24)} if name == "vit" else batch(name, B=B, L=L, pad=False))
    if name == "vit":
        L = 37  # 6×6 patches + class token
    counts = []
    for freeze in (False, True):
        model = lowmembp.apply(build(name), "tokentune", k=k, seed=0).train()
        for blk in _blocks(name, model):
            for p in (blk.norm1 if name == "vit" else blk.input_layernorm).parameters():
                p.requires_grad_(not freeze)
        counts.append(saved_bytes(model, lambda: loss_of(name, model, inputs)))
    rows = blocks * B * (L - k) * d * 4  # the unselected rows of each norm's input, fp32
    # at least those rows go; at most those plus one full normalised copy (HF's RMSNorm keeps it for γ's gradient)
    # and per-row statistics
    assert rows <= counts[0] - counts[1] <= rows + blocks * B * L * (d + 4) * 4, (counts, rows)
