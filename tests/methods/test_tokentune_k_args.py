"""Issue #20 item 4 on the command line: TokenTune's ``--k`` is read as its registry entry declares (``kinds``: a
count or a fraction), ``--k 0.3`` the official scripts' ``--prefix_length 0.3``, ``--k 16`` a count; values the method
refuses (0, -1, 1.5, text) stop the job at once with status 2; ``k`` written into the method spec
(``tokentune@k=4``) is the same option, given once."""
from __future__ import annotations

import pytest
import torch

from experiments import train
from experiments.args import ArgError, parse_args

BASE = ["--task", "mnist5k", "--batch-size", "4", "--limit", "32", "--eval-limit", "8", "--no-progress",
        "--device", "cpu"]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def options(tmp_path, *extra):
    cfg, _ = parse_args([*BASE, "--out", str(tmp_path / "r.json"), *map(str, extra)])
    return cfg.method, cfg.method_options


@pytest.mark.parametrize("text, value", [("0.3", 0.3), ("16", 16), ("1", 1), ("0.05", 0.05), ("4.0", 4.0)])
def test_k_reads_as_a_count_or_a_fraction(tmp_path, text, value):
    _, opts = options(tmp_path, "--method", "tokentune", "--k", text)
    assert opts["k"] == value
    assert type(opts["k"]) is type(value)  # 0.3 a fraction, 16 a count (int("0.3") was an error); 4.0: apply counts 4


def test_a_fraction_from_a_config_file_and_in_the_spec(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("method: tokentune\noptions: {k: 0.3}\n")
    assert options(tmp_path, "--config", conf)[1] == {"k": 0.3}
    assert options(tmp_path, "--method", "tokentune@k=0.3") == ("tokentune@k=0.3", {"k": 0.3})
    assert options(tmp_path, "--method", "lora@rank=2+tokentune@k=8", "--seed", "1") == \
        ("lora@rank=2+tokentune@k=8", {"rank": 2, "k": 8})
    # the config file's k gives way to the spec's (the spec names the cell)
    assert options(tmp_path, "--config", conf, "--method", "tokentune@k=4")[1] == {"k": 4}


@pytest.mark.parametrize("extra, needle", [
    (["--method", "tokentune", "--k", "0"], "got 0"),
    (["--method", "tokentune", "--k", "-1"], "got -1"),
    (["--method", "tokentune", "--k", "1.5"], "got 1.5"),
    (["--method", "tokentune", "--k", "0.0"], "got 0.0"),
    (["--method", "tokentune", "--k", "many"], "cannot read 'many' as int or float"),
    (["--method", "tokentune@k=0"], "got 0"),
    (["--method", "tokentune@k=4", "--k", "4"], "fixed by the method spec 'tokentune@k=4'"),
    (["--method", "tokentune@rank=4"], "'tokentune' does not take option(s) rank"),
    (["--method", "tokentune@k"], "write options as name@option=value"),
    (["--method", "tokentune@k=1/2"], "write options as name@option=value"),
])
def test_bad_k_stops_the_job_at_once(tmp_path, capsys, extra, needle):
    out = tmp_path / "r.json"
    assert train.main([*BASE, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert not out.exists()
    with pytest.raises(ArgError):
        parse_args([*BASE, "--out", str(out), *extra])


def test_the_fraction_reaches_the_model(tmp_path):
    """A 2-step run with --k 0.5: the record keeps k = 0.5, and TokenTune took 1 + int(0.5 * 16) = 9 of the 17
    tokens per image (the class token plus half of the 16 patches)."""
    import json

    import lowmembp
    from lowmembp.methods.tokentune import tokentune_state

    out = tmp_path / "r.json"
    assert train.main([*BASE, "--out", str(out), "--method", "tokentune", "--k", "0.5", "--steps", "2"]) == 0
    rec = json.loads(out.read_text())
    assert rec["status"] == "ok" and rec["method_options"] == {"k": 0.5}
    from experiments.tasks import mnist5k

    cfg, task = parse_args([*BASE, "--out", str(tmp_path / "s.json"), "--method", "tokentune", "--k", "0.5"])
    model = lowmembp.apply(task.build(cfg.model, cfg).model, cfg.method, **cfg.method_options)
    model.train()
    model(torch.randn(2, 1, 28, 28))
    assert tokentune_state(model).last.positions.shape == (2, 1 + int(0.5 * (mnist5k.SEQ_LEN - 1)))
