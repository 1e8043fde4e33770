"""tokentune: eval forward = the unmodified model; training gradient = a slow reference (the full model with a
stop-gradient on every unselected hidden state at every block input); saved bytes ∝ k/L; selection rules; errors."""
import copy

import pytest
import torch
import torch.nn.functional as F

import lowmembp
from lowmembp.methods.tokentune import select_positions, tokentune_state

VOCAB = 53


# ---------------------------------------------------------------------------------------------------- tiny models
def _bert(roberta=False, layers=2, max_pos=160):
    import transformers
    cfg_cls = transformers.RobertaConfig if roberta else transformers.BertConfig
    cfg = cfg_cls(hidden_size=24, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=40,
                  vocab_size=VOCAB, max_position_embeddings=max_pos + 2, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, num_labels=3, type_vocab_size=2, pad_token_id=1)
    cls = transformers.RobertaForSequenceClassification if roberta else transformers.BertForSequenceClassification
    return cls(cfg)


def _llama(head="ForCausalLM", layers=2):
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=24, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=40, vocab_size=VOCAB,
                                   max_position_embeddings=256, num_labels=3, pad_token_id=0)
    return getattr(transformers, f"Llama{head}")(cfg)


def _vit(img=24, patch=4, depth=2, **kw):
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(img_size=img, patch_size=patch, embed_dim=24, depth=depth, num_heads=2, num_classes=5,
                             **kw)


def _randomise(model):
    """Norms start at γ=1, β=0 and biases at 0, which would hide mistakes: give every parameter random values."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))


MODELS = {
    "bert": (lambda: _bert(), "ids"),
    "roberta": (lambda: _bert(roberta=True), "ids"),
    "vit": (lambda: _vit(), "img"),
    "vit_avg": (lambda: _vit(global_pool="avg", class_token=False), "img"),
    "llama": (lambda: _llama(), "ids"),
    "llama_cls": (lambda: _llama("ForSequenceClassification"), "ids"),
}


def build(name, seed=0):
    torch.manual_seed(seed)
    fn, _ = MODELS[name]
    model = fn()
    _randomise(model)
    return model


def batch(name, B=3, L=19, seed=1, pad=True, left_pad=False):
    """Inputs (odd shapes); row 1 right-padded, and for decoders row 2 left-padded when ``left_pad``."""
    g = torch.Generator().manual_seed(seed)
    if MODELS[name][1] == "img":
        return {"x": torch.randn(B, 3, 24, 24, generator=g)}
    pad_id = 1 if name in ("bert", "roberta") else 0
    ids = torch.randint(2, VOCAB, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    if pad:
        mask[1, L - 7:] = 0
        if left_pad:
            mask[2, :4] = 0
    ids = ids.masked_fill(mask == 0, pad_id)
    out = {"input_ids": ids, "attention_mask": mask}
    if name.startswith("llama") and not name.endswith("cls"):
        out["labels"] = ids.masked_fill(mask == 0, -100)
    else:
        out["labels"] = torch.randint(0, 3, (B,), generator=g)
    return out


def loss_of(name, model, inputs):
    """The training loss of a converted model (HF models compute it; timm: a fixed linear functional)."""
    if "x" in inputs:
        y = model(inputs["x"])
        return (y * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum()
    return model(**inputs).loss


# ------------------------------------------------------------------------------------------- the slow reference
def _blocks(name, model):
    if name.startswith("vit"):
        return list(model.blocks)
    if name.startswith("llama"):
        return list(model.model.layers)
    return list(model.base_model.encoder.layer)


def reference_loss(name, model, inputs, positions, valid):
    """The full model, every block input detached on the unselected rows; the head on the selected rows."""
    handles = []

    def pre_hook(module, args):
        h = args[0]
        keep = torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device).scatter_(1, positions, True)
        return (torch.where(keep[..., None], h, h.detach()), *args[1:])

    for blk in _blocks(name, model):
        handles.append(blk.register_forward_pre_hook(pre_hook))
    try:
        def pick(h):  # the selected rows of the last hidden state
            return h.gather(1, positions[..., None].expand(-1, -1, h.shape[-1]))

        def mean(hs):
            w = valid.to(hs.dtype)[..., None]
            return (hs * w).sum(1) / w.sum(1)

        if name.startswith("vit"):
            feats = model.forward_features(inputs["x"])
            pooled = mean(pick(feats))
            y = model.forward_head(pooled[:, None].expand(-1, feats.shape[1], -1))
            return (y * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum()
        ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
        if name.startswith("llama"):
            hs = pick(model.model(input_ids=ids, attention_mask=mask).last_hidden_state)
            if name == "llama":
                logits = model.lm_head(hs)
                nxt = F.pad(labels[:, 1:], (0, 1), value=-100)
                targets = nxt.gather(1, positions).masked_fill(~valid, -100)
                return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
            return F.cross_entropy(model.score(mean(hs)), labels)
        out = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = mean(pick(out))
        if name == "bert":
            logits = model.classifier(model.dropout(model.bert.pooler.activation(model.bert.pooler.dense(pooled))))
        else:
            logits = model.classifier(pooled[:, None])
        return F.cross_entropy(logits, labels)
    finally:
        for h in handles:
            h.remove()


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare_grads(g, gr):
    assert set(g) == set(gr), set(g) ^ set(gr)
    worst = 0.0
    for n in g:
        scale = gr[n].abs().max().item()
        diff = (g[n] - gr[n]).abs().max().item()
        worst = max(worst, diff)
        assert diff <= 2e-5 * max(scale, 1e-3), f"{n}: max diff {diff:.3g} vs scale {scale:.3g}"
    return worst


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


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("k", [1, 5])
def test_gradient_equals_detached_reference(name, k):
    model = build(name)
    ref = copy.deepcopy(model).train()
    inputs = batch(name, left_pad=name.startswith("llama"))
    model = lowmembp.apply(model, "tokentune", k=k, seed=3).train()
    loss = loss_of(name, model, inputs)
    loss.backward()
    sel = tokentune_state(model).last
    assert sel.positions.shape[1] == k
    loss_ref = reference_loss(name, ref, inputs, sel.positions, sel.valid)
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


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_k_at_least_L_is_full_finetuning(name):
    model = build(name)
    plain = copy.deepcopy(model).train()
    inputs = batch(name, L=11)
    model = lowmembp.apply(model, "tokentune", k=64).train()
    loss = model(**inputs).loss
    loss.backward()
    assert tokentune_state(model).last.others.shape[1] == 0
    if name == "llama":  # all positions: exactly the ordinary causal-LM loss
        loss_ref = plain(**inputs).loss
    else:  # all positions, no stop-gradient anywhere: the plain model with a mean-pooled head
        ref_out = plain.bert(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        w = inputs["attention_mask"][..., None].float()
        pooled = (ref_out.last_hidden_state * w).sum(1) / w.sum(1)
        logits = plain.classifier(plain.bert.pooler.activation(plain.bert.pooler.dense(pooled)))
        loss_ref = F.cross_entropy(logits, inputs["labels"])
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    compare_grads(grads(model), grads(plain))


# ----------------------------------------------------------------------------------------------- saved bytes
def saved_bytes(model, fn):
    """Bytes autograd saves during ``fn()``, each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


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


# ------------------------------------------------------------------------------------------------ composition
def test_with_peft_lora():
    from peft import LoraConfig, get_peft_model
    name = "bert"
    base = build(name)
    inputs = batch(name)
    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=["query", "key", "value", "dense"], init_lora_weights=False)
    peft_model = get_peft_model(base, cfg)
    ref = copy.deepcopy(peft_model)
    eval_in = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        expect = ref.eval()(**eval_in).logits
    model = lowmembp.apply(peft_model, "tokentune", k=5, seed=1)
    with torch.no_grad():
        assert torch.equal(model.eval()(**eval_in).logits, expect)
    model.train()
    model(**inputs).loss.backward()
    sel = tokentune_state(model).last
    ref.train()
    reference_loss(name, ref.get_base_model(), inputs, sel.positions, sel.valid).backward()
    g = grads(model)
    assert g and all("lora_" in n for n in g)
    compare_grads(g, grads(ref))


@pytest.mark.parametrize("name,how", [("vit", "timm"), ("llama", "transformers"), ("bert", "registry"),
                                      ("vit", "registry")])
def test_checkpointing_after_keeps_the_gradient(name, how):
    model = build(name)
    inputs = batch(name)
    plain = lowmembp.apply(copy.deepcopy(model), "tokentune", k=5, seed=2).train()
    loss_of(name, plain, inputs).backward()
    if how == "registry":
        model = lowmembp.apply(model, "tokentune+checkpointing", k=5, seed=2).train()
    else:
        model = lowmembp.apply(model, "tokentune", k=5, seed=2).train()
        if how == "timm":
            model.set_grad_checkpointing(True)
        else:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert all(tokentune_state(model).checkpoint_flags())
    loss_of(name, model, inputs).backward()
    compare_grads(grads(model), grads(plain))
    # next draw of the same seeded generator on both: the same positions; checkpointing keeps less
    assert saved_bytes(model, lambda: loss_of(name, model, inputs)) < \
        0.5 * saved_bytes(plain, lambda: loss_of(name, plain, inputs))


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


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
@pytest.mark.parametrize("spec", ["lora+tokentune", "lowmembp+tokentune", "lora+lowmembp+tokentune"])
def test_composes_through_the_registry(name, spec):
    """Eval output = the model converted without tokentune; training gradient = the detached reference built on
    that same conversion (ReGELU2 / MS norms / LoRA included)."""
    other = spec.replace("+tokentune", "")
    torch.manual_seed(4)
    converted = lowmembp.apply(build(name), other)  # the same model without tokentune
    if "lora" in spec:  # peft starts B at 0: give the adapters values so that their gradients are not trivial
        with torch.no_grad():
            for n, p in converted.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    ref = copy.deepcopy(converted)
    model = lowmembp.apply(converted, "tokentune", k=5, seed=6)
    inputs = batch(name, left_pad=True)
    eval_in = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        a = model.eval()(**eval_in) if "x" not in inputs else model.eval()(inputs["x"])
        b = ref.eval()(**eval_in) if "x" not in inputs else ref.eval()(inputs["x"])
    a, b = (a.logits, b.logits) if hasattr(a, "logits") else (a, b)
    assert torch.equal(a, b)
    model.train()
    ref.train()
    loss = loss_of(name, model, inputs)
    loss.backward()
    sel = tokentune_state(model).last
    inner = ref.get_base_model() if hasattr(ref, "get_base_model") else ref
    loss_ref = reference_loss(name, inner, inputs, sel.positions, sel.valid)
    loss_ref.backward()
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-5, atol=1e-6)
    worst = compare_grads(grads(model), grads(ref))
    print(f"{spec} {name}: max grad diff {worst:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bert", "vit", "llama"])
def test_gradient_equals_reference_on_cuda(name):
    """The same check on the GPU kernels (SDPA with boolean masks, GQA, a CUDA generator)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(name).cuda()
    ref = copy.deepcopy(model).train()
    inputs = {k: v.cuda() for k, v in batch(name, left_pad=name == "llama").items()}
    model = lowmembp.apply(model, "tokentune", k=5, seed=3).train()
    loss_of(name, model, inputs).backward()
    sel = tokentune_state(model).last
    assert sel.positions.is_cuda
    reference_loss(name, ref, inputs, sel.positions, sel.valid).backward()
    g, gr = grads(model), grads(ref)
    for n in g:
        torch.testing.assert_close(g[n], gr[n], rtol=1e-3, atol=1e-5 * max(gr[n].abs().max().item(), 1e-3))


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


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_of_a_converted_model_run_on_their_own_parameters(name, how):
    import io
    model = lowmembp.apply(build(name), "tokentune", k=4, seed=1).train()
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    inputs = batch(name)
    loss_of(name, twin, inputs).backward()
    assert not grads(model), "the copy's training forward reached the original's parameters"
    assert grads(twin)
    loss_of(name, model, inputs).backward()  # same seed, same draw: identical gradients
    compare_grads(grads(twin), grads(model))


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
def test_training_steps_lower_the_loss(name):
    """A few AdamW steps on one batch (fresh positions every step) lower the ordinary full-sequence loss."""
    model = lowmembp.apply(build(name), "tokentune", k=4, seed=0)
    inputs = batch(name)
    y = torch.randint(0, 5, (3,), generator=torch.Generator().manual_seed(2))

    def eval_loss():
        model.eval()
        with torch.no_grad():
            if "x" in inputs:
                return F.cross_entropy(model(inputs["x"]), y).item()
            return model(**inputs).loss.item()

    before = eval_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(15):
        loss = F.cross_entropy(model(inputs["x"]), y) if "x" in inputs else model(**inputs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = eval_loss()
    assert after < 0.9 * before, (before, after)


@pytest.mark.parametrize("spec", ["tokentune", "tokentune+checkpointing"])
def test_vit_drop_path_drops_a_sample_for_all_its_rows(spec):
    """Stochastic depth decides per sample: drawn once per block for the selected and the unselected rows, in timm's
    order, so with the same global RNG state the gradient equals the reference's (which runs timm's DropPath)."""
    torch.manual_seed(0)
    model = _vit(drop_path_rate=0.5, depth=3)
    _randomise(model)
    ref = copy.deepcopy(model).train()
    inputs = batch("vit", B=6)
    model = lowmembp.apply(model, spec, k=5, seed=3).train()  # private generator: global RNG left alone
    torch.manual_seed(11)
    loss = loss_of("vit", model, inputs)
    loss.backward()
    sel = tokentune_state(model).last
    torch.manual_seed(11)
    loss_ref = reference_loss("vit", ref, inputs, sel.positions, sel.valid)
    loss_ref.backward()
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-5, atol=1e-6)
    compare_grads(grads(model), grads(ref))
    tokentune_state(model).selector = lambda valid, k, decoder, gen: sel.positions  # same positions again
    torch.manual_seed(11)
    assert loss_of("vit", model, inputs).item() == loss.item()
    torch.manual_seed(12)  # another draw of the masks alone changes the loss: they do matter here
    assert abs(loss_of("vit", model, inputs).item() - loss.item()) > 1e-4
