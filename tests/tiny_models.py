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


_TOK = dict(bos_token_id=1, eos_token_id=2)


def _hf(cfg_name, model_name, **kw):
    import transformers
    return getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw))


_ENC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48)
_VIS = dict(_ENC, image_size=32, patch_size=8)


def _timm(module, cls, **kw):
    import importlib
    return getattr(importlib.import_module(f"timm.models.{module}"), cls)(num_classes=5, **kw)


# architectures without a dedicated adapter (most go through data flow). name -> (model
# family as reported by the layout, builder, input kind: "ids" = input_ids, "img" = timm x, "pix" = pixel_values)
MORE_BUILDERS = {
    "gemma": ("llama", lambda: _decoder("Gemma", head_dim=8, **_TOK), "ids"),
    "gemma2": ("gemma2", lambda: _decoder("Gemma2", head_dim=8, **_TOK), "ids"),
    "gemma3": ("gemma3_text", lambda: _hf("Gemma3TextConfig", "Gemma3ForCausalLM", hidden_size=32,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=56, vocab_size=VOCAB, head_dim=8,
                                          max_position_embeddings=64, pad_token_id=0, **_TOK), "ids"),
    "phi3": ("llama", lambda: _decoder("Phi3", **_TOK), "ids"),
    "olmo2": ("olmo2", lambda: _decoder("Olmo2", **_TOK), "ids"),
    "stablelm": ("llama", lambda: _decoder("StableLm", **_TOK), "ids"),
    "gpt2": ("gpt2", lambda: _hf("GPT2Config", "GPT2LMHeadModel", n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB,
                                 n_positions=64, bos_token_id=1, eos_token_id=2), "ids"),
    "distilbert": ("distilbert", lambda: _hf("DistilBertConfig", "DistilBertForSequenceClassification", dim=32,
                                             n_layers=2, n_heads=2, hidden_dim=48, vocab_size=VOCAB,
                                             max_position_embeddings=40, num_labels=3, dropout=0.0,
                                             attention_dropout=0.0), "ids"),
    "debertav2": ("deberta-v2", lambda: _hf("DebertaV2Config", "DebertaV2ForSequenceClassification", **_ENC,
                                            vocab_size=VOCAB, max_position_embeddings=40, num_labels=3,
                                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "ids"),
    "electra": ("bert", lambda: _hf("ElectraConfig", "ElectraForSequenceClassification", embedding_size=16, **_ENC,
                                    vocab_size=VOCAB, max_position_embeddings=40, num_labels=3,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "ids"),
    "modernbert": ("modernbert", lambda: _hf("ModernBertConfig", "ModernBertForSequenceClassification", **_ENC,
                                             vocab_size=VOCAB, max_position_embeddings=64, num_labels=3,
                                             global_attn_every_n_layers=1, local_attention=16, pad_token_id=0, **_TOK,
                                             cls_token_id=1, sep_token_id=2), "ids"),
    "hf_vit": ("vit", lambda: _hf("ViTConfig", "ViTForImageClassification", **_VIS, num_labels=5), "pix"),
    "dinov2": ("dinov2", lambda: _hf("Dinov2Config", "Dinov2ForImageClassification", hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=32,
                                     patch_size=8, num_labels=5), "pix"),
    "clip_vision": ("clip_vision_model", lambda: _hf("CLIPVisionConfig", "CLIPVisionModel", **_VIS), "pix"),
    "siglip_vision": ("siglip_vision_model", lambda: _hf("SiglipVisionConfig", "SiglipVisionModel", **_VIS), "pix"),
    "eva": ("eva", lambda: _timm("eva", "Eva", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
            "img"),
    "beit": ("beit", lambda: _timm("beit", "Beit", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
             "img"),
    "swinv2": ("swintransformerv2", lambda: _timm("swin_transformer_v2", "SwinTransformerV2", img_size=32,
                                                  patch_size=4, window_size=4, embed_dim=16, depths=(2, 2),
                                                  num_heads=(1, 2)), "img"),
}


def build(name, seed=0):
    """(model in float32, a function returning a fresh input batch)."""
    torch.manual_seed(seed)
    family, fn, kind = FAMILY_BUILDERS.get(name) or MORE_BUILDERS[name]
    model = fn()
    _randomise_norms(model)

    def inputs(seed=1):
        g = torch.Generator().manual_seed(seed)
        if kind == "img":
            return {"x": torch.randn(*IMG, generator=g)}
        if kind == "pix":
            return {"pixel_values": torch.randn(*IMG, generator=g)}
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
            elif type(m).__name__ == "Conv1D" and not m.weight.is_meta:  # GPT-2: weight is in×out
                m.weight.normal_(0, 1.5 / m.weight.shape[0] ** 0.5)
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
    if getattr(out, "logits", None) is not None:
        return out.logits
    if getattr(out, "pooler_output", None) is not None:  # vision towers: both outputs must stay
        return torch.cat([out.last_hidden_state.flatten(1), out.pooler_output.flatten(1)], 1)
    return out.last_hidden_state


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
