"""The benchmark commands check their --methods / --families before any work: an unknown or empty name is a usage
error (exit 2) that names what is valid, never a traceback after minutes of measuring, nor an empty table."""
import pytest
from script_loader import load_script


def _load(name):
    return load_script(f"benchmarks/{name}.py")


@pytest.mark.parametrize("script", ["compiled_saving", "saved_bytes_methods"])
@pytest.mark.parametrize("argv, needle", [
    (["--families", "vit,gpt"], "unknown family 'gpt'; choose from vit, bert, llama"),
    (["--families", ""], "need at least one name"),
    (["--methods", ""], "need at least one name"),
    (["--methods", "baseline,lowmembpp"], "unknown method 'lowmembpp'"),
    (["--methods", "cce+chunked-ce"], "a model has one loss"),
])
def test_bad_choices_are_usage_errors(script, argv, needle, capsys):
    with pytest.raises(SystemExit) as stop:
        _load(script).main(argv)
    assert stop.value.code == 2
    assert needle in capsys.readouterr().err


def test_cpu_steps_refuses_an_unknown_method(capsys):
    with pytest.raises(SystemExit) as stop:
        _load("cpu_steps").main(["--methods", "baseline", "mesaa"])
    assert stop.value.code == 2
    assert "unknown method 'mesaa'" in capsys.readouterr().err


def test_read_choices_keeps_the_order_and_strips_spaces():
    from experiments.repro.compiled_saving import read_choices

    assert read_choices("lowmembp, baseline", "llama ,vit") == (("lowmembp", "baseline"), ("llama", "vit"))
