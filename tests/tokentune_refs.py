"""Shared pieces of the tokentune tests: tiny models with odd shapes, inputs, the slow reference (the full model with a
stop-gradient on every unselected hidden state at every block input), gradient comparison, saved-bytes counting."""
import torch
import torch.nn.functional as F

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


def _llama(head="ForCausalLM", layers=2, arch="Llama"):
    import transformers
    extra = {"head_dim": 6} if arch == "Qwen3" else {}
    cfg = getattr(transformers, f"{arch}Config")(hidden_size=24, num_hidden_layers=layers, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=40, vocab_size=VOCAB,
                                                 max_position_embeddings=256, num_labels=3, pad_token_id=0, **extra)
    return getattr(transformers, f"{arch}{head}")(cfg)


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
    "llama_qwen3": (lambda: _llama(arch="Qwen3"), "ids"),  # LLaMA-like with per-head q/k RMSNorm before RoPE
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


def reference_loss(name, model, inputs, positions, valid, pool="model"):
    """The full model, every block input detached on the unselected rows; the head on the selected rows.

    ``pool="model"``: the model's own head on the selected rows: BERT / RoBERTa / LLaMA classifiers read one token
    (token 0 / the last non-padding one), which is selected, so that is the model's own forward and loss, unchanged;
    timm's ``forward_head`` pools the selected rows (ascending). ``pool="mean"``: the mean of the selected rows."""
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

        if pool == "model" and name.startswith("vit"):
            y = model.forward_head(pick(model.forward_features(inputs["x"])))
            return (y * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum()
        if pool == "model" and not (name.startswith("llama") and not name.endswith("cls")):
            return model(**inputs).loss  # the head reads a selected token: the model's own forward
        if name.startswith("vit"):
            feats = model.forward_features(inputs["x"])
            pooled = mean(pick(feats))
            y = model.forward_head(pooled[:, None].expand(-1, feats.shape[1], -1))
            return (y * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum()
        ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
        if name.startswith("llama"):
            hs = pick(model.model(input_ids=ids, attention_mask=mask).last_hidden_state)
            if not name.endswith("cls"):
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
    """Every gradient equal to fp32 rounding: 2e-5 of its own scale, plus 1e-6 of the largest gradient of the model
    (a gradient that is zero in exact arithmetic — a lone query's softmax — carries rounding noise of the others)."""
    assert set(g) == set(gr), set(g) ^ set(gr)
    top = max(t.abs().max().item() for t in gr.values())
    worst = 0.0
    for n in g:
        scale = gr[n].abs().max().item()
        diff = (g[n] - gr[n]).abs().max().item()
        worst = max(worst, diff)
        assert diff <= 2e-5 * scale + 1e-6 * top, f"{n}: max diff {diff:.3g} vs scale {scale:.3g} (top {top:.3g})"
    return worst



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
