"""benchmarks/profile_step.py: a training-job cell profiled, its host ops and (on a GPU) kernels per step."""
import json

import pytest

from script_loader import load_script

profile_step = load_script("benchmarks/profile_step.py")
CELL = ("tiny=--task mnist5k --model vit-mnist --method lowmembp --batch-size 2 --device cpu --threads 1 --steps 10 "
        "--no-progress")


@pytest.mark.slow
def test_a_cpu_cell_is_profiled(tmp_path):
    assert profile_step.main(["--out", str(tmp_path), "--warmup", "1", "--steps", "1", "--top", "5",
                              "--cell", CELL]) == 0
    facts = json.loads((tmp_path / "tiny.json").read_text())
    assert facts["step_wall_s"] > 0 and facts["device_busy_s"] is None and len(facts["host_ops"]) == 5
    names = [r["name"] for r in json.loads((tmp_path / "tiny.json").read_text())["host_ops"]]
    assert all(isinstance(n, str) and n for n in names)
    md = (tmp_path / "tiny.md").read_text()
    assert md.startswith("# tiny") and "| op (host) | calls / step | self host µs / step |" in md


def test_a_failing_cell_fails_the_run_and_the_others_go_on(tmp_path):
    assert profile_step.main(["--out", str(tmp_path), "--cell", "bad=--task nope --model vit-mnist"]) == 1


@pytest.mark.parametrize("argv", [[], ["--cell", "noequals"], ["--cell", "x="], ["--cell", CELL, "--steps", "0"]])
def test_bad_arguments_exit_2(argv, tmp_path):
    with pytest.raises(SystemExit) as e:
        profile_step.parse_args(["--out", str(tmp_path)] + argv)
    assert e.value.code == 2
