"""``alpaca`` with ``llama-7b`` / ``llama-13b``: instruction tuning on the 52k Stanford Alpaca examples (the paper's
LLaMA runs). Metric: perplexity of the responses of a fixed 500-example held-out split. The paper's own evaluation,
MMLU 5-shot, runs through ``lm-eval`` (task ``mmlu``, ``num_fewshot=5``) after each evaluation when lm-eval is
installed and the MMLU data is on disk (``<data>/mmlu``: a Hugging Face datasets cache holding ``cais/mmlu``, read
offline); its accuracy (%) or the reason it did not run is the record's ``task_facts.mmlu_5shot``
(:func:`mmlu_unavailable` says what is missing). QLoRA (NF4 base weights) is the ``lora`` option ``quantize: nf4``
(bitsandbytes; config/paper/llama-qlora-alpaca.yaml sets it).

Data: ``<data>/alpaca/alpaca_data.json`` (from github.com/tatsu-lab/stanford_alpaca). Weights:
``<data>/weights/llama-7b/`` (a transformers ``save_pretrained`` directory with the tokenizer).
"""
from __future__ import annotations

import json
import os

from experiments.tasks import paper_models
from experiments.tasks.base import MissingData, Setup, count_mask, lm_loss, lm_perplexity, split_indices, subsample

NAME = "alpaca"
MODELS = ("llama-7b", "llama-13b")
METRIC = "perplexity"
DEFAULTS = dict(steps=10000, lr=2e-4, max_len=512, eval_limit=500)
N_TEST = 500
PROMPT = ("Below is an instruction that describes a task{ctx}. Write a response that appropriately completes the "
          "request.\n\n### Instruction:\n{instruction}\n\n{inp}### Response:\n")


def _file(cfg):
    return paper_models.data_dir(cfg) / "alpaca" / "alpaca_data.json"


def check(cfg) -> None:
    if not _file(cfg).is_file():
        raise MissingData(
            f"Alpaca data not found: expected {_file(cfg)}. Fetch it on a machine with internet: `curl -L -o "
            f"{_file(cfg)} https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/main/alpaca_data.json` and "
            f"copy it here (or set --data-dir / LOWMEMBP_DATA_DIR)")
    paper_models.check_weights(cfg, cfg.model)


def _mmlu_dir(cfg):
    return paper_models.data_dir(cfg) / "mmlu"


def mmlu_unavailable(cfg) -> str | None:
    """Why MMLU 5-shot cannot run here, with what to do; None when it can (lm-eval installed, data on disk)."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return "MMLU 5-shot not run: lm-eval is not installed (pip install lm-eval==0.4.13)"
    d = _mmlu_dir(cfg)
    if not d.is_dir() or not any(d.iterdir()):
        return (f"MMLU 5-shot not run: its data is not on disk (expected a Hugging Face datasets cache holding "
                f"cais/mmlu under {d}; fill it on a machine with internet: HF_DATASETS_CACHE={d} python -c "
                f"\"import datasets; datasets.load_dataset('cais/mmlu', 'all')\", then copy {d} here)")
    return None


def mmlu_5shot(model, tokenizer, cfg, limit: int | None = None) -> float:
    """MMLU 5-shot accuracy (%) of ``model`` through lm-eval's ``mmlu`` task, offline from ``<data>/mmlu``;
    ``limit``: questions per subject (None: all). MissingData with :func:`mmlu_unavailable`'s message otherwise."""
    why = mmlu_unavailable(cfg)
    if why:
        raise MissingData(why)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    env = {"HF_DATASETS_CACHE": str(_mmlu_dir(cfg)), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        was_training = model.training
        model.eval()
        res = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer), tasks=["mmlu"], num_fewshot=5,
                              limit=limit)
        model.train(was_training)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 100.0 * float(res["results"]["mmlu"]["acc,none"])


def build(model_name: str, cfg) -> Setup:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = json.loads(_file(cfg).read_text())
    src = paper_models.hf_source(cfg, model_name)
    tokenizer = AutoTokenizer.from_pretrained(src)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.dtype, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    train_idx, test_idx = split_indices(len(rows), N_TEST)
    train_idx = subsample(train_idx, cfg.limit, cfg.seed).tolist()
    test_idx = subsample(test_idx, cfg.eval_limit, 0).tolist()
    max_len = cfg.max_len
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    def encode(row):
        inp = f"### Input:\n{row['input']}\n\n" if row.get("input") else ""
        prompt = PROMPT.format(ctx=", paired with an input that provides further context" if inp else "",
                               instruction=row["instruction"], inp=inp)
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (p + r)[:max_len]
        labels = ([-100] * len(p) + r)[:max_len]
        return ids, labels

    def collate(items):
        enc = [encode(rows[i]) for i in items]
        width = max(len(ids) for ids, _ in enc)
        ids = torch.full((len(enc), width), pad, dtype=torch.long)
        labels = torch.full((len(enc), width), -100, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for row, (x, y) in enumerate(enc):
            ids[row, : len(x)] = torch.tensor(x)
            labels[row, : len(y)] = torch.tensor(y)
            mask[row, : len(x)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    # filled by evaluate (the record copies info at build time; this dict is shared, so it shows the last result)
    mmlu = {"status": mmlu_unavailable(cfg) or "runs after each evaluation", "accuracy": None}

    def evaluate(net, batches):
        value = lm_perplexity(net, batches)
        if mmlu_unavailable(cfg) is None:
            mmlu["accuracy"] = mmlu_5shot(net, tokenizer, cfg, limit=cfg.eval_limit)
            mmlu["status"] = f"lm-eval mmlu, 5-shot, limit {cfg.eval_limit} per subject"
        return value

    return Setup(model=model, train=train_idx, test=test_idx, collate=collate, loss=lm_loss, evaluate=evaluate,
                 metric=METRIC, seq_len=max_len, tokens=count_mask("attention_mask"),
                 info={"train_pool": len(train_idx), "test_size": len(test_idx), "max_len": max_len,
                       "mmlu_5shot": mmlu})
