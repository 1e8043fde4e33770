"""The paper's models, loaded from local files (or, with ``--download``, from the Hugging Face hub).

Local layout under the data directory (``--data-dir``, else ``$LOWMEMBP_DATA_DIR``, else ``./data``):

    <data>/weights/<model>/        e.g. data/weights/vit-b16/model.safetensors, data/weights/roberta-base/config.json

timm models (vit-b16, vit-l16, swin-t): the hub repo's ``model.safetensors`` (or ``pytorch_model.bin``) of the timm
checkpoint named below. transformers models: a ``save_pretrained`` directory (config.json, weights, tokenizer).
Fetch once, on a machine with internet, e.g.

    huggingface-cli download timm/vit_base_patch16_224.augreg_in21k --local-dir data/weights/vit-b16
    huggingface-cli download FacebookAI/roberta-base --local-dir data/weights/roberta-base
"""
from __future__ import annotations

import os
from pathlib import Path

from experiments.tasks.base import MissingData

TIMM = {  # our name -> timm model name (hub repo timm/<name>)
    "vit-b16": "vit_base_patch16_224.augreg_in21k",
    "vit-l16": "vit_large_patch16_224.augreg_in21k",
    "swin-t": "swin_tiny_patch4_window7_224.ms_in22k",
}
HF = {  # our name -> hub repo
    "roberta-base": "FacebookAI/roberta-base",
    "bert-large": "google-bert/bert-large-uncased",
    "llama-7b": "huggyllama/llama-7b",
    "llama-13b": "huggyllama/llama-13b",
}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json", "open_clip_pytorch_model.bin")


def data_dir(cfg) -> Path:
    return Path(cfg.data_dir or os.environ.get("LOWMEMBP_DATA_DIR") or "data")


def weights_dir(cfg, model: str) -> Path:
    return data_dir(cfg) / "weights" / model


def _hub_id(model: str) -> str:
    return f"timm/{TIMM[model]}" if model in TIMM else HF[model]


def check_weights(cfg, model: str) -> None:
    if cfg.download:
        return
    where = weights_dir(cfg, model)
    if not any((where / f).is_file() for f in WEIGHT_FILES):
        raise MissingData(
            f"weights for {model} not found in {where}/ (looked for {', '.join(WEIGHT_FILES[:2])}). Fetch them on a "
            f"machine with internet: `huggingface-cli download {_hub_id(model)} --local-dir {where}` and copy that "
            f"directory here (or set --data-dir / LOWMEMBP_DATA_DIR to the directory holding weights/{model}/), "
            f"or pass --download to fetch from the hub at run time")


def timm_model(cfg, model: str, num_classes: int):
    import timm

    if cfg.download:
        return timm.create_model(TIMM[model], pretrained=True, num_classes=num_classes)
    where = weights_dir(cfg, model)
    file = next(where / f for f in WEIGHT_FILES if (where / f).is_file())
    return timm.create_model(TIMM[model], pretrained=True, num_classes=num_classes,
                             pretrained_cfg_overlay={"file": str(file)})


def hf_source(cfg, model: str) -> str:
    return HF[model] if cfg.download else str(weights_dir(cfg, model))
