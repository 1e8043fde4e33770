"""The planner's command line never guesses: bad input exits 2 with a message that says what to do (a sequence
length of 0, an option value a method refuses, an option for a method not planned), a combination spelled with
``+`` is planned as that exact combination, and a tiny model's table is in a unit that reads (not 0.000396 GiB)."""
import json

import pytest

from lowmembp.plan import make_plan
from lowmembp.plan.__main__ import main
from lowmembp.plan.report import unit_for


@pytest.fixture
def tiny_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 56,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 61,
        "max_position_embeddings": 64}))
    return tmp_path


def _args(config, *more):
    return ["--model", str(config), "--batch-size", "2", "--seq-len", "16", "--gpu-memory", "4MiB", "--jobs", "1",
            "--reserved", "0", *more]


@pytest.mark.parametrize("flag, value", [("--seq-len", "0"), ("--seq-len", "-5")])
def test_a_sequence_length_below_one_is_refused(tiny_config, capsys, flag, value):
    args = _args(tiny_config, "--methods", "lora")
    args[args.index(flag) + 1] = value
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "seq_len must be a positive integer (--seq-len)" in err and f"got {value}" in err, err
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        make_plan("llama-7b", batch_size=4, seq_len=0)
    with pytest.raises(ValueError, match="image_size must be a positive integer"):
        make_plan("vit-b16", batch_size=4, image_size=0)


@pytest.mark.parametrize("option, words", [
    ("lora.rank=-3", "option lora.rank=-3: lora: rank must be a positive integer, got -3"),
    ("lora.rank=0", "option lora.rank=0: lora: rank must be a positive integer"),
    ("lora.ranks=4", "option lora.ranks: 'lora' has no option 'ranks'; its options: rank"),
    ("tokentune.k=4", "option tokentune.k: 'tokentune' is in no planned combination; add it to the methods"),
    ("lorra.rank=4", "option lorra.rank: unknown method 'lorra'"),
    ("checkpointing.every=0", "checkpointing: every must be a positive integer"),
])
def test_an_option_the_plan_cannot_use_is_an_error_naming_it(tiny_config, capsys, option, words):
    methods = "lora,checkpointing" if option.startswith("checkpointing") else "lora"
    assert main(_args(tiny_config, "--methods", methods, "--option", option)) == 2
    captured = capsys.readouterr()
    assert words in captured.err and captured.out == "", captured.err


def test_a_combination_with_plus_is_planned_as_written(tiny_config, capsys):
    assert main(_args(tiny_config, "--methods", "lowmembp+lora", "--json")) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert sorted(r["method"] for r in rows) == ["baseline", "lora+lowmembp"]
    assert all(r["status"] == "ok" for r in rows)
    assert main(_args(tiny_config, "--methods", "lora,lora+checkpointing", "--json")) == 0
    assert sorted(r["method"] for r in json.loads(capsys.readouterr().out)["rows"]) == [
        "baseline", "lora", "lora+checkpointing"]
    assert main(_args(tiny_config, "--methods", "lora+nosuch")) == 2
    assert "unknown method 'nosuch'" in capsys.readouterr().err
    assert main(_args(tiny_config, "--methods", "lora+liger")) == 2
    assert "liger cannot be planned" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(_args(tiny_config, "--methods", "lora+lowmembp", "--exclude", "lora"))
    assert e.value.code == 2 and "exactly the entries named" in capsys.readouterr().err


def test_the_table_picks_its_unit(tiny_config, capsys):
    assert unit_for([3 * 2**30, 5 * 2**20]) == ("GiB", 2**30)
    assert unit_for([415_000, 2**20]) == ("MiB", 2**20)
    assert unit_for([3000]) == ("KiB", 2**10) and unit_for([]) == ("KiB", 2**10)
    assert main(_args(tiny_config, "--methods", "lora")) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    assert "peak KiB" in header and "GiB" not in header, header  # ~400 KiB peaks
    assert "0.000" not in out
