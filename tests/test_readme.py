"""The README's Python blocks run as written, each in a fresh interpreter (the mechanism, the preludes and the
``<!-- no-run -->`` opt-out: tests/doc_blocks.py); its size stays that of a front page."""
from __future__ import annotations

import re

import pytest

from doc_blocks import ROOT, blocks, run_block

pytestmark = pytest.mark.slow  # the full suite only: runs the README's code blocks

README = ROOT / "README.md"
BLOCKS = blocks(README)


def test_the_readme_has_a_quick_start_block():
    assert BLOCKS and all(b.run for b in BLOCKS), "every README block runs (a no-run block belongs in docs/)"
    first = BLOCKS[0].code
    assert "import timm" in first and "import torch" in first  # the quick start imports what it uses
    assert "lowmembp.apply(" in first


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "README.md is the front page: move the details into docs/"
    for command in ("bash .ci/setup && . .venv/bin/activate && snakemake --cores all",
                    ".venv/bin/python -m pytest -n 2 ",
                    '.venv/bin/python -m pytest -n 2 --dist loadfile -m "" --durations=20',
                    "python -m lowmembp.plan --model llama-7b --gpu-memory 24GiB --batch-size 4 --seq-len 2048",
                    "python -m experiments.repro "):
        assert command in text, command


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_readme_block_runs(block, tmp_path):
    run_block(block, tmp_path)


def test_the_readme_links_resolve():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if "://" not in t]
    assert any(t.startswith("docs/") for t in local), "the README links into the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, missing
