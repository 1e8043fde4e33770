"""lowmembp.cache: the one place that says where per-machine artefacts go, read by the CPU kernels and mnist5k."""
from pathlib import Path

from lowmembp import cache
from lowmembp.ops.cpu_kernels import build


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(cache.ENV_VAR, raising=False)
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "lowmembp"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "lowmembp"
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(cache.ENV_VAR, "")  # empty: as if unset
    assert cache.cache_dir() == tmp_path / "xdg" / "lowmembp"
    assert not (tmp_path / "xdg").exists()  # answering creates nothing


def test_users_read_the_one_definition():
    from experiments.tasks import mnist5k

    assert build.cache_dir is cache.cache_dir
    assert mnist5k.cache_dir is cache.cache_dir
    assert isinstance(cache.cache_dir(), Path)
