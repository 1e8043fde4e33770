"""tokentune, the method: eval forward = the unmodified model; training gradient = the slow reference
(tokentune_refs: the full model with a stop-gradient on every unselected row at every block input); the head reads
what the model's own head reads (``pool="model"``); selection rules (counts and fractions of the real tokens);
composition with lora / lowmembp / checkpointing, copies, training, DropPath, the GPU; saved bytes ∝ k/L; errors.
The command line's ``--k``: tests/experiments/test_train_args.py."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F

import lowmembp
from lowmembp.methods.tokentune import select_positions, tokentune_state
from lowmembp.models import get_layout
from tokentune_refs import (MODELS, VOCAB, _bert, _blocks, _llama, _randomise, _vit, batch, build, compare_grads, grads,
                            loss_of, reference_loss, saved_bytes)

# ------------------------------------------------------------------------------- eval forward and training gradient
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
    """Every position selected: exactly the ordinary causal-LM loss and gradients (the classifiers: the head's
    section below)."""
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
    """``pool="mean"`` with every position selected: no stop-gradient anywhere — the plain model with its head fed
    the mean of the real tokens."""
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


# ---------------------------------------------------------------------------------------------- selection by fraction
@pytest.mark.parametrize("name, forced", [("bert", 1), ("llama", 2)])
def test_fraction_selects_forced_plus_share_of_the_rest(name, forced):
    model = lowmembp.apply(build(name), "tokentune", k=0.3, seed=0).train()
    inputs = batch(name, L=23, pad=False)  # every row 23 real tokens
    out = model(**inputs)
    out.loss.backward()
    sel = tokentune_state(model).last
    expected = forced + int(0.3 * (23 - forced))  # BERT 1 + 6 = 7, LLaMA 2 + 6 = 8
    assert sel.positions.shape == (3, expected)
    assert sel.valid.all()
    assert (sel.positions[:, 0] == 0).all()  # the first token, always
    if forced == 2:
        assert (sel.positions[:, -1] == 22).all()  # decoders: the last token too


def test_fraction_counts_from_the_longest_row_and_never_picks_padding():
    model = lowmembp.apply(build("bert"), "tokentune", k=0.5, seed=0).train()
    inputs = batch("bert", L=19)  # row 1 right-padded to 12 real tokens
    model(**inputs).loss.backward()
    sel = tokentune_state(model).last
    assert sel.positions.shape[1] == 1 + int(0.5 * 18)
    mask = inputs["attention_mask"].bool()
    assert torch.equal(sel.valid, mask.gather(1, sel.positions))


def test_integer_valued_float_is_a_count_and_bad_fractions_are_refused():
    model = lowmembp.apply(build("bert"), "tokentune", k=4.0).train()
    assert tokentune_state(model).k == 4 and isinstance(tokentune_state(model).k, int)
    for k in (0.0, 1.5, -0.3):
        with pytest.raises(ValueError, match="fraction 0 < k < 1"):
            lowmembp.apply(build("bert"), "tokentune", k=k)


# ------------------------------------------------------------------------- the head reads what the model's head reads
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


def test_pool_and_head_errors():
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
        elif hasattr(model, "activation_checkpointing_enable"):  # the newer transformers 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # older releases (5.17, the GPU machine's, has only the old name)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(tokentune_state(model).checkpoint_flags())
    loss_of(name, model, inputs).backward()
    compare_grads(grads(model), grads(plain))
    # next draw of the same seeded generator on both: the same positions; checkpointing keeps less
    assert saved_bytes(model, lambda: loss_of(name, model, inputs)) < \
        0.5 * saved_bytes(plain, lambda: loss_of(name, plain, inputs))


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


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_of_a_converted_model_run_on_their_own_parameters(name, how):
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
