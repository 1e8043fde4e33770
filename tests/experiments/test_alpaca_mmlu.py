"""alpaca's MMLU 5-shot (lm-eval): without lm-eval or its data on disk, a clear message says what to do."""
from types import SimpleNamespace

import pytest

from experiments.tasks import alpaca
from experiments.tasks.base import MissingData


def test_message_names_what_is_missing(tmp_path):
    cfg = SimpleNamespace(data_dir=str(tmp_path))
    why = alpaca.mmlu_unavailable(cfg)
    assert why.startswith("MMLU 5-shot not run: ")
    try:
        import lm_eval  # noqa: F401
        assert str(tmp_path / "mmlu") in why and "cais/mmlu" in why and "HF_DATASETS_CACHE" in why
    except ImportError:
        assert "pip install lm-eval" in why
    with pytest.raises(MissingData, match="MMLU 5-shot not run"):
        alpaca.mmlu_5shot(None, None, cfg)


def test_data_check_after_lm_eval(tmp_path, monkeypatch):
    """With lm-eval importable, an empty <data>/mmlu is still 'not on disk'."""
    import sys
    monkeypatch.setitem(sys.modules, "lm_eval", SimpleNamespace())
    (tmp_path / "mmlu").mkdir()
    why = alpaca.mmlu_unavailable(SimpleNamespace(data_dir=str(tmp_path)))
    assert "its data is not on disk" in why and str(tmp_path / "mmlu") in why
    (tmp_path / "mmlu" / "cais___mmlu").mkdir()
    assert alpaca.mmlu_unavailable(SimpleNamespace(data_dir=str(tmp_path))) is None
