"""The paper configs train as the official code runs them (issue #33 item 1).

Every setting of a training recipe (experiments/configs/*.yaml) carries a comment: ``official: OFF <path>:<line>``
(the official file and line it comes from) or ``ours: <why>`` (a deliberate difference, or a setting of our own).
:data:`OFFICIAL` holds, per recipe, the official values as read in those files (yyyyychen/LowMemoryBP@bb2980f), each
with the file and line it was read at. The tests check that

- every setting line of every recipe is cited (official or ours), and every ``official:`` citation of a recipe names a
  file and line that :data:`OFFICIAL` also cites for that setting (no stale line numbers between the two);
- the training job, reading the recipe exactly as it reads a config (``experiments.args.parse_args``; only the paper
  task's data check is stubbed, since the data is not here), uses the official values: learning rate (after the
  batch/512 scaling of the ViT recipes), batch, accumulation, epochs or steps, warm-up, weight decay, dtype, sequence
  length and the method's options (rank, alpha, dropout, targets, NF4);
- each paper sweep (config/paper/*.yaml) builds, per cell, the command line the pipeline runs
  (``workflow/sweep_config.cell_argv``) and the job resolves it to the official values of the recipe the cell belongs
  to: Fig. 1 trains LoRA on q and v (timm's fused ``qkv``), each LLaMA cell the learning rate of its own script;
- recipes the official repositories do not have (ViT-L LoRA, Swin-T LoRA, BERT-large TokenTune) say they are ours.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from experiments.args import parse_args

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow"))
import sweep_config  # noqa: E402

CONFIGS = ROOT / "experiments" / "configs"
PAPER = ROOT / "config" / "paper"
VIT = "experiments/vit_exp/configs/cifar100/"
LLAMA = "experiments/llama_exp/scripts/"
ROBERTA = "experiments/roberta_exp/scripts/finetune_roberta.sh"
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _vit(cfg_file: str, *, lora: bool, large: bool = False, targets=None) -> dict:
    """The official ViT values of one config file, cited at its lines (the ViT-L file has its own numbering)."""
    f = VIT + cfg_file
    if large:
        lines = dict(batch=3, epochs=69, warmup=30, lr=59, wd=61, amp=65)
    elif lora:
        lines = dict(batch=2, epochs=92, warmup=37, lr=82, wd=84, amp=88)
    else:
        lines = dict(batch=2, epochs=77, warmup=37, lr=67, wd=69, amp=73)
    out = {
        "batch_size": (64, f"{f}:{lines['batch']}"), "epochs": (100, f"{f}:{lines['epochs']}"),
        "warmup_epochs": (10, f"{f}:{lines['warmup']}"),
        "lr": ((1e-2 if lora else 1e-4) * 64 / 512, f"{f}:{lines['lr']}"),  # × batch / 512: vit_exp/main.py:49
        "weight_decay": (0.1, f"{f}:{lines['wd']}"), "dtype": ("fp16", f"{f}:{lines['amp']}"),
    }
    if lora:
        out.update({"rank": (4, f"{f}:54"), "alpha": (4, "experiments/vit_exp/model/lora.py:140-143"),
                    "targets": (targets, f"{f}:45-53")})
    return out


def _llama(script: str, lr: float) -> dict:
    f = LLAMA + script
    return {
        "batch_size": (4, f"{f}:41"), "grad_accum": (4, f"{f}:42"), "steps": (10000, f"{f}:43"),
        "lr": (lr, f"{f}:44"), "warmup_steps": (0, f"{f}:38-39"), "weight_decay": (0.0, f"{f}:47"),
        "dtype": ("bf16", f"{f}:36"), "max_len": (640, f"{f}:9-10"), "rank": (64, f"{f}:30"),
        "alpha": (16, f"{f}:31"), "dropout": (0.1, f"{f}:32"), "targets": (LLAMA_LINEARS, f"{f}:33"),
        "quantize": ("nf4", f"{f}:35,37"), "double_quant": (True, f"{f}:34"),
    }


# recipe -> {setting: (the official value as the job must use it, "path:line" it was read at)}
OFFICIAL = {
    "vit-b16-cifar100-lora-qv.yaml": _vit("lora_qv_ViT_B_baseline.yaml", lora=True, targets="qkv"),
    "vit-b16-cifar100-lora.yaml": _vit("lora_all_ViT_B_baseline.yaml", lora=True,
                                       targets=["qkv", "proj", "fc1", "fc2"]),
    "vit-b16-cifar10-lora.yaml": {k: (v, c.replace("cifar100/", "cifar10/")) for k, (v, c) in _vit(
        "lora_all_ViT_B_baseline.yaml", lora=True, targets=["qkv", "proj", "fc1", "fc2"]).items()},
    "vit-b16-cifar100-full.yaml": _vit("fulltuning_ViT_B_baseline.yaml", lora=False),
    "vit-l16-cifar100-full.yaml": _vit("fulltuning_ViT_L_baseline.yaml", lora=False, large=True),
    "llama-7b-alpaca-lora.yaml": _llama("finetune_llama_7b.sh", 2e-4),
    "llama-7b-alpaca-lora-lowmembp.yaml": _llama("finetune_llama_7b_mergeln.sh", 1e-4),
    "llama-13b-alpaca-lora.yaml": _llama("finetune_llama_13b.sh", 1e-4),
    "roberta-base-glue-sst2-lora.yaml": {
        "batch_size": (32, f"{ROBERTA}:13"), "epochs": (30, f"{ROBERTA}:15"), "lr": (5e-4, f"{ROBERTA}:14"),
        "warmup_epochs": (3.0, f"{ROBERTA}:16"), "weight_decay": (0.01, f"{ROBERTA}:17"),
        "dtype": ("fp32", f"{ROBERTA}:6-28"), "max_len": (256, f"{ROBERTA}:12"), "rank": (64, f"{ROBERTA}:22"),
        "alpha": (16, f"{ROBERTA}:23"), "dropout": (0.0, "experiments/roberta_exp/run_glue.py:220-221"),
        "targets": (["query", "key"], "experiments/roberta_exp/run_glue.py:493"),
    },
}
OURS = ("vit-l16-cifar100-lora.yaml", "swin-t-cifar100-lora.yaml", "bert-large-glue-sst2-tokentune.yaml")
OPTIONS = ("rank", "alpha", "dropout", "targets", "quantize", "double_quant", "k")


def _resolve(argv: list[str], monkeypatch, tmp_path) -> object:
    """The job's settings for ``argv``, read as the job reads them; only the paper task's data check is skipped."""
    from types import SimpleNamespace

    from experiments import tasks

    real_get = tasks.get

    def get(name):  # the task as the job gets it, less its data check
        task = real_get(name)
        if isinstance(task, SimpleNamespace):  # built per call (cifar10/100, glue-*)
            return SimpleNamespace(**dict(vars(task), check=lambda cfg: None))
        monkeypatch.setattr(task, "check", lambda cfg: None)
        return task

    monkeypatch.setattr(tasks, "get", get)
    cfg, _ = parse_args(argv + ["--out", str(tmp_path / "r.json"), "--device", "cpu"])
    return cfg


def _used(cfg, key: str):
    if key in OPTIONS:
        return cfg.method_options.get(key)
    return getattr(cfg, key)


def _check(cfg, official: dict, where: str) -> None:
    for key, (value, cited) in official.items():
        got = _used(cfg, key)
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-12), f"{where}: {key} is {got!r}, official {value!r} ({cited})"
        else:
            assert got == value, f"{where}: {key} is {got!r}, official {value!r} ({cited})"


def _setting_lines(path: Path) -> list[tuple[str, str]]:
    """(key, comment) of every setting line of a recipe (top level and under options:)."""
    out = []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip() or line.strip() == "options:":
            continue
        m = re.match(r"\s*([a-z_]+):\s*[^#]*?(?:#\s*(.*))?$", line)
        assert m, f"{path.name}: cannot read the line {line!r}"
        out.append((m.group(1), m.group(2) or ""))
    return out


def test_every_recipe_is_known_here():
    assert {p.name for p in CONFIGS.glob("*.yaml")} == set(OFFICIAL) | set(OURS)


@pytest.mark.parametrize("name", sorted(set(OFFICIAL) | set(OURS)))
def test_every_setting_is_cited(name):
    lines = _setting_lines(CONFIGS / name)
    assert lines
    for key, comment in lines:
        assert comment.startswith(("official: OFF ", "ours")), f"{name}: {key} has no 'official:' / 'ours:' comment"
    header = (CONFIGS / name).read_text().split("\nmodel:")[0]
    if name in OURS:
        assert "OUR OWN SETTING" in header and all(c.startswith("ours") for _, c in lines), name
    else:
        assert "OFF = yyyyychen/LowMemoryBP@bb2980f" in header, name


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_the_citations_are_the_official_lines(name):
    """Each official value of the test is cited by the recipe at the same file and line, and the other way round
    every ``official:`` citation of a checked setting names the line the test holds."""
    cites = dict(_setting_lines(CONFIGS / name))
    for key, (_, cited) in OFFICIAL[name].items():
        key_in_file = "lr_base" if key == "lr" and "lr_base" in cites else key
        assert key_in_file in cites, f"{name}: {key} is not set (the job's default would be used)"
        assert cites[key_in_file].startswith(f"official: OFF {cited}"), \
            f"{name}: {key_in_file} cites {cites[key_in_file]!r}, the official value is at {cited}"


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_the_job_uses_the_official_values(name, monkeypatch, tmp_path):
    cfg = _resolve(["--config", str(CONFIGS / name)], monkeypatch, tmp_path)
    _check(cfg, OFFICIAL[name], name)


def _cells(config: Path):
    conf = sweep_config.fill_defaults(yaml.safe_load(config.read_text()))
    for (task, model, method, bs, seed, opt), (sweep, sw) in sweep_config.cells(conf).items():
        yield sweep, sw, sweep_config.cell_argv(sw, task, model, method, bs, seed, optimizer=opt), (task, model, method)


# paper sweep -> the recipe its cells must train with; settings the sweep sets itself (steps) are left out
SWEEP_RECIPES = {
    ("fig1.yaml", "fig1"): "vit-b16-cifar100-lora-qv.yaml",
    ("vit-cifar.yaml", "vit-b-full"): "vit-b16-cifar100-full.yaml",
    ("vit-cifar.yaml", "vit-l-full"): "vit-l16-cifar100-full.yaml",
    ("vit-cifar.yaml", "vit-b-lora-qv"): "vit-b16-cifar100-lora-qv.yaml",
    ("vit-cifar.yaml", "vit-b-lora-all"): "vit-b16-cifar100-lora.yaml",
    ("llama-qlora-alpaca.yaml", "llama-7b-qlora"): "llama-7b-alpaca-lora.yaml",
    ("llama-qlora-alpaca.yaml", "llama-7b-qlora-lowmembp"): "llama-7b-alpaca-lora-lowmembp.yaml",
    ("llama-qlora-alpaca.yaml", "llama-13b-qlora"): "llama-13b-alpaca-lora.yaml",
    ("roberta-glue.yaml", "roberta-lora"): "roberta-base-glue-sst2-lora.yaml",
}
OUR_SWEEPS = {("vit-cifar.yaml", "vit-l-lora-ours"), ("bert-large-tokentune.yaml", "accuracy"),
              ("bert-large-tokentune.yaml", "memory")}


def test_every_paper_sweep_is_known_here():
    found = {(p.name, s) for p in PAPER.glob("*.yaml") for s in yaml.safe_load(p.read_text())["sweeps"]}
    assert found == set(SWEEP_RECIPES) | OUR_SWEEPS


@pytest.mark.parametrize("config", sorted({c for c, _ in SWEEP_RECIPES}))
def test_each_paper_cell_trains_its_official_recipe(config, monkeypatch, tmp_path):
    n = 0
    for sweep, sw, argv, (task, model, method) in _cells(PAPER / config):
        recipe = SWEEP_RECIPES.get((config, sweep))
        if recipe is None:
            continue
        assert sw["train_config"] == f"experiments/configs/{recipe}"
        cfg = _resolve(argv, monkeypatch, tmp_path)
        official = dict(OFFICIAL[recipe])
        if sw.get("steps"):  # a timing run sets its own length; the rest of the recipe stays the official one
            official.pop("epochs", None)
            official.pop("steps", None)
            assert cfg.steps == sw["steps"]
        _check(cfg, official, f"{config} {sweep} {task} {model} {method}")
        n += 1
    assert n


def test_fig1_trains_lora_on_q_and_v():
    """Fig. 1's bars are the lora_qv setting (experiments/repro/fig1.py): the sweep's every cell adapts timm's fused qkv
    only, as the reproduction's default setting does."""
    from experiments.repro.fig1 import DEFAULT_SETTING, SETTINGS

    assert DEFAULT_SETTING == "lora_qv"
    conf = yaml.safe_load((CONFIGS / "vit-b16-cifar100-lora-qv.yaml").read_text())
    assert conf["options"]["targets"] == SETTINGS["lora_qv"][0] == "qkv"
    cells = list(_cells(PAPER / "fig1.yaml"))
    assert {m for *_, (_, _, m) in cells} == {"lora", "lora+checkpointing", "lora+mesa-gelu-ln", "lora+lowmembp"}
    assert all(sw["train_config"].endswith("vit-b16-cifar100-lora-qv.yaml") for _, sw, _, _ in cells)


def test_each_llama_cell_has_the_learning_rate_of_its_script(monkeypatch, tmp_path):
    """7B: 2e-4 plain (finetune_llama_7b.sh:44), 1e-4 with LowMemoryBP (finetune_llama_7b_mergeln.sh:44); 13B: 1e-4
    both (finetune_llama_13b{,_mergeln}.sh:44)."""
    lrs = {(model, method): _resolve(argv, monkeypatch, tmp_path).lr
           for _, _, argv, (_, model, method) in _cells(PAPER / "llama-qlora-alpaca.yaml")}
    assert lrs == {("llama-7b", "lora"): 2e-4, ("llama-7b", "lora+lowmembp"): 1e-4,
                   ("llama-13b", "lora"): 1e-4, ("llama-13b", "lora+lowmembp"): 1e-4}


def test_the_paper_sweeps_pass_the_pipeline_check():
    for config in sorted(PAPER.glob("*.yaml")):
        sweep_config.check(sweep_config.fill_defaults(yaml.safe_load(config.read_text())))


def test_lora_dropout_reaches_peft():
    """The recipes' ``dropout`` option (LLaMA 0.1) is peft's lora_dropout on every adapter; 0 keeps it out."""
    import torch.nn as nn

    import lowmembp
    from tiny_models import _decoder

    model = lowmembp.apply(_decoder().float(), "lora", rank=4, dropout=0.1)
    drops = [m.lora_dropout["default"] for m in model.modules() if hasattr(m, "lora_dropout")]
    assert drops and all(isinstance(d, nn.Dropout) and d.p == 0.1 for d in drops)
    model = lowmembp.apply(_decoder().float(), "lora", rank=4)
    assert all(isinstance(m.lora_dropout["default"], nn.Identity)
               for m in model.modules() if hasattr(m, "lora_dropout"))
    with pytest.raises(ValueError, match="dropout must be a number in"):
        lowmembp.apply(_decoder().float(), "lora", dropout=1.5)
