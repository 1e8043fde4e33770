"""The sweep config is checked against the training job's own registries when the Snakefile is parsed
(workflow/sweep_config.py): every bad entry is refused by `snakemake -n` with a message naming it and what is valid."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow"))
import sweep_config  # noqa: E402

GOOD = {
    "sweeps": {
        "a": {"tasks": [{"task": "mnist5k", "model": "vit-mnist"}], "methods": ["baseline", "lora+lowmembp"],
              "batch_sizes": [8], "steps": 3, "train_args": ["--eval-limit", "64"],
              "method_options": {"lora": {"rank": 4}, "tokentune": {"k": 8}}},
        "lm": {"tasks": [{"task": "tweets-lm", "model": "llama-tiny"}], "methods": ["lora"], "batch_sizes": [4],
               "init": "b"},
    },
    "bases": {"b": {"task": "tweets-lm", "model": "llama-tiny", "batch_size": 4, "steps": 3,
                    "train_args": ["--train-split", "pretrain"]}},
}
# (what to break, the words the message must contain)
BAD = {
    "misspelt method": (lambda c: c["sweeps"]["a"]["methods"].append("lowmemby"),
                        ["sweeps.a.methods", "unknown method 'lowmemby'", "valid names:", "lowmembp"]),
    "excluded combination": (lambda c: c["sweeps"]["a"]["methods"].append("mesa+lowmembp"),
                             ["sweeps.a.methods", "cannot be combined with", "'mesa+lowmembp'"]),
    "unknown model": (lambda c: c["sweeps"]["a"]["tasks"].append({"task": "mnist5k", "model": "vit-huge"}),
                      ["sweeps.a.tasks", "model 'vit-huge' does not train on task 'mnist5k'", "vit-mnist"]),
    "bad method option": (lambda c: c["sweeps"]["a"]["method_options"].update(lora={"rnak": 4}),
                          ["sweeps.a.method_options.lora", "option 'rnak' is not taken by method 'lora'", "rank"]),
    "option of the wrong type": (lambda c: c["sweeps"]["a"]["method_options"].update(tokentune={"k": "many"}),
                                 ["sweeps.a.method_options.tokentune", "--k", "'many'"]),
    "base trained with lowmembp": (lambda c: c["bases"]["b"].update(method="lowmembp"),
                                   ["bases.b", "method 'lowmembp' changes the model's weights", "baseline"]),
    "unknown task": (lambda c: c["sweeps"]["a"]["tasks"].append({"task": "glue-stsb", "model": "bert-large"}),
                     ["sweeps.a.tasks", "unknown task 'glue-stsb'", "glue-sst2"]),
    "bad train_args flag": (lambda c: c["sweeps"]["a"]["train_args"].extend(["--lr", "fast"]),
                            ["sweeps.a", "refuses its arguments", "--lr", "'fast'"]),
    "unknown train_args option": (lambda c: c["sweeps"]["a"]["train_args"].extend(["--rnak", "4"]),
                                  ["sweeps.a (method baseline)", "--rnak is neither a flag", "method 'baseline'"]),
    "pipeline flag in train_args": (lambda c: c["sweeps"]["a"]["train_args"].extend(["--seed", "3"]),
                                    ["sweeps.a.train_args", "--seed is set by the pipeline from seeds"]),
    "unknown base": (lambda c: c["sweeps"]["lm"].update(init="nope"),
                     ["sweeps.lm", "init 'nope' is not under `bases:` (bases: b)"]),
    "unknown reproduction": (lambda c: c.setdefault("repro", {}).update(names=["fig2"]),
                             ["repro.names", "'fig2'", "block-breakdown"]),
    "one method written two ways": (lambda c: c["sweeps"]["a"]["methods"].extend(["tokentune@k=4",
                                                                                  "tokentune@k=4.0"]),
                                    ["sweeps.a.methods", "'tokentune@k=4.0' trains the same as 'tokentune@k=4'",
                                     "write it one way"]),
    "methods in another order": (lambda c: c["sweeps"]["a"]["methods"].append("lowmembp+lora"),
                                 ["'lowmembp+lora' trains the same as 'lora+lowmembp' (sweeps.a)"]),
    "missing train_config": (lambda c: c["sweeps"]["a"].update(train_config="experiments/configs/nope.yaml"),
                             ["sweeps.a.train_config", "no such file"]),
}


def checked(cfg: dict) -> None:
    cfg = sweep_config.fill_defaults(copy.deepcopy(cfg))
    sweep_config.check(cfg, ROOT)


def test_a_good_config_passes():
    checked(GOOD)


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_entry_is_named_with_what_is_valid(case):
    cfg = copy.deepcopy(GOOD)
    BAD[case][0](cfg)
    with pytest.raises(sweep_config.ConfigError) as err:
        checked(cfg)
    for words in BAD[case][1]:
        assert words in str(err.value), (case, str(err.value))


def test_snakemake_dry_run_refuses_every_bad_entry_at_once(tmp_path):
    """The check runs when the Snakefile is parsed: `snakemake -n` fails before planning anything, naming them all."""
    cfg = copy.deepcopy(GOOD)
    cases = ["misspelt method", "excluded combination", "unknown model", "bad method option",
             "base trained with lowmembp", "unknown task"]
    for case in cases:
        BAD[case][0](cfg)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory",
                        str(tmp_path), "-n", "--configfile", str(bad)], capture_output=True, text=True, timeout=300,
                       env=env)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Job stats" not in out
    for case in cases:
        for words in BAD[case][1]:
            assert words in out, (case, out[-3000:])


def _weights_after(method: str, family: str) -> tuple[bool, bool]:
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    import tiny_models

    import lowmembp

    model, _ = tiny_models.build(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    after = lowmembp.apply(model, method).state_dict()
    same_names = set(after) == set(before)
    return same_names, same_names and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("family", ["vit", "llama"])
def test_methods_refused_for_bases_are_exactly_those_that_change_the_weights(family):
    """A base is saved with --save-model and loaded strictly with --init into a fresh model: a method whose converted
    model's state dict differs from the plain model's (names or values) must not train one; every other may."""
    from lowmembp.methods.registry import list_methods, list_methods_changing_weights

    changes, applied = set(), set()
    for m in list_methods():
        try:
            same_names, same_values = _weights_after(m, family)
        except (ValueError, RuntimeError, ImportError):  # not for this family / needs a GPU
            continue
        applied.add(m)
        if not (same_names and same_values):
            changes.add(m)
    assert {"baseline", "lora", "lowmembp"} <= applied
    assert changes == set(list_methods_changing_weights()) & applied


def test_cell_command_line_reads_back_with_the_jobs_parser():
    from experiments.args import _split_extra, build_parser

    cfg = sweep_config.fill_defaults(copy.deepcopy(GOOD))
    argv = sweep_config.cell_argv(cfg["sweeps"]["a"], "mnist5k", "vit-mnist", "lora+lowmembp", 8, 2, "b.safetensors")
    ns, extra = build_parser().parse_known_args(argv)
    assert (ns.model, ns.task, ns.method, ns.batch_size, ns.seed, ns.steps, ns.init) == \
        ("vit-mnist", "mnist5k", "lora+lowmembp", 8, 2, 3, "b.safetensors")
    assert _split_extra(extra) == {"rank": "4"}  # lora's option; tokentune's is not this method's
