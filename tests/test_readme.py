"""The README's Python snippets run as written (issue #19.5): every ```python block of README.md is executed in a
fresh interpreter (so a snippet that registers something leaves this process alone).

What the test changes, and why (nothing else is touched):
- a snippet that continues from a model the text describes (``model.save_pretrained(out)``, the measuring tools)
  gets a tiny prelude that makes those names (CONTEXTS below): a 1-layer LLaMA from a transformers config, a small
  MLP; the snippet's own lines run unchanged after it;
- pretrained weights are not downloaded (no network at test time): ``pretrained=True`` becomes ``pretrained=False``
  and ViT-B/16 becomes ViT-Ti/16 (same code path, 20x fewer parameters);
- ``estimate("llama_7b", ...)`` builds 1 block at 32 tokens (``layers=1, seq_len=32``) instead of 32 blocks at 512
  (about a minute on 2 shared cores).
A new snippet needs no entry here if it runs on its own; if it needs a model from the text, add a prelude.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), flags=re.S | re.M)

SUBSTITUTIONS = [
    ("pretrained=True", "pretrained=False"),
    ('"vit_base_patch16_224"', '"vit_tiny_patch16_224"'),
    ('estimate("llama_7b", "lora+lowmembp", rank=64)', 'estimate("llama_7b", "lora+lowmembp", rank=64, layers=1, seq_len=32)'),
]

TINY_LLAMA = """
import copy, tempfile
import torch, transformers, peft, lowmembp
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
fresh_base = transformers.LlamaForCausalLM(cfg)
model = lowmembp.apply(copy.deepcopy(fresh_base), "lora+lowmembp", rank=2)
out = tempfile.mkdtemp()
"""

TINY_MLP = """
import torch, lowmembp
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
x, y, device = torch.randn(4, 8), torch.randint(0, 4, (4,)), "cpu"
loss_fn = torch.nn.functional.cross_entropy
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
def step():
    loss_fn(model(x), y).backward()
"""

# first line of a snippet -> the prelude that makes the names it continues from
CONTEXTS = {
    "model.save_pretrained(out)": TINY_LLAMA,
    "from lowmembp.measurement.saved import SavedTensorAccountant": TINY_MLP,
}


def _program(snippet: str) -> str:
    for old, new in SUBSTITUTIONS:
        snippet = snippet.replace(old, new)
    first = snippet.lstrip().splitlines()[0] if snippet.strip() else ""
    prelude = next((p for key, p in CONTEXTS.items() if first.startswith(key)), "")
    return textwrap.dedent(prelude) + "\n" + snippet


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 3
    assert "import timm" in SNIPPETS[0] and "import torch" in SNIPPETS[0]  # the quick start imports what it uses


@pytest.mark.parametrize("i", range(len(SNIPPETS)), ids=lambda i: SNIPPETS[i].strip().splitlines()[0][:40])
def test_readme_snippet_runs(i, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(_program(SNIPPETS[i]))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env=env)
    assert p.returncode == 0, f"README snippet {i} failed:\n{SNIPPETS[i]}\n--- stderr:\n{p.stderr[-3000:]}"
