"""Tiny random models of every supported family (and their inputs) for the adapter / conversion tests."""
import torch

IMG = (2, 3, 32, 32)
SEQ = (2, 7)
VOCAB = 61


def _vit(**kw):
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, **kw)


def _deit():
    from timm.models.deit import VisionTransformerDistilled
    return VisionTransformerDistilled(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


def _swin(**kw):
    from timm.models.swin_transformer import SwinTransformer
    return SwinTransformer(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(1, 2),
                           num_classes=5, drop_path_rate=0.0, **kw)


def _bert(cls_name="BertForSequenceClassification", roberta=False):
    import transformers
    cfg_cls = transformers.RobertaConfig if roberta else transformers.BertConfig
    cfg = cfg_cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, vocab_size=VOCAB,
                  max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  num_labels=3, type_vocab_size=2)
    return getattr(transformers, cls_name)(cfg)


def _decoder(arch="Llama", head="ForCausalLM", **kw):
    import transformers
    cfg = getattr(transformers, f"{arch}Config")(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=56,
        vocab_size=VOCAB, max_position_embeddings=64, num_labels=3, pad_token_id=0, **kw)
    return getattr(transformers, f"{arch}{head}")(cfg)


# name -> (family, builder, input kind)
FAMILY_BUILDERS = {
    "vit": ("vit", _vit, "img"),
    "vit_avg": ("vit", lambda: _vit(global_pool="avg"), "img"),
    "deit": ("vit", _deit, "img"),
    "swin": ("swin", _swin, "img"),
    "bert": ("bert", _bert, "ids"),
    "bert_mlm": ("bert", lambda: _bert("BertForMaskedLM"), "ids"),
    "roberta": ("bert", lambda: _bert("RobertaForSequenceClassification", roberta=True), "ids"),
    "llama": ("llama", _decoder, "ids"),
    "llama_cls": ("llama", lambda: _decoder(head="ForSequenceClassification"), "ids"),
    "llama_tied": ("llama", lambda: _decoder(tie_word_embeddings=True), "ids"),
    "llama_bare": ("llama", lambda: _decoder(head="Model"), "ids"),
    "mistral": ("llama", lambda: _decoder("Mistral"), "ids"),
    "qwen2": ("llama", lambda: _decoder("Qwen2"), "ids"),
}


def build(name, seed=0):
    """(model in float32, a function returning a fresh input batch)."""
    torch.manual_seed(seed)
    family, fn, kind = FAMILY_BUILDERS[name]
    model = fn()
    _randomise_norms(model)

    def inputs(seed=1):
        g = torch.Generator().manual_seed(seed)
        if kind == "img":
            return {"x": torch.randn(*IMG, generator=g)}
        return {"input_ids": torch.randint(1, VOCAB, SEQ, generator=g)}
    return model, inputs


def _randomise_norms(model):
    """Norms start at γ=1, β=0, which would hide folding mistakes: give them random values. Linear weights get
    std 1.5/√fan_in instead of the 0.02 of a fresh init, so pre-activations spread over a few units as in trained
    models (at init they sit within ±0.3 of zero, where a 2-bit derivative says little)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and not m.weight.is_meta:
                m.weight.normal_(0, 1.5 / m.in_features ** 0.5)
        for m in model.modules():
            name = type(m).__name__
            if "Norm" in name and getattr(m, "weight", None) is not None and m.weight.dim() == 1 \
                    and not m.weight.is_meta:
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.3, 0.3)


def logits(model, batch):
    out = model(**batch)
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


LORA_TARGETS = {
    "vit": ["qkv", "proj", "fc1", "fc2"], "vit_avg": ["qkv", "fc1"], "deit": ["qkv", "fc1"],
    "swin": ["qkv", "fc1", "reduction"],
    "bert": ["query", "value", "dense"], "bert_mlm": ["query", "value"], "roberta": ["query", "key", "dense"],
}


def lora_wrap(model, name, r=4):
    """peft LoRA on the attention and MLP inputs, with a random B so the LoRA branch is not zero."""
    import peft
    targets = LORA_TARGETS.get(name, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"])
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n and not p.is_meta:
                p.normal_(0, 0.1)
    return pm
