"""Running the ```python blocks of README.md and docs/**/*.md as tests (tests/test_readme.py, tests/test_docs.py).

Every ```python block runs as written, each in a fresh interpreter (so a block that registers something leaves the
test process alone), from the repository root. What changes, and why (nothing else is touched):

- a block that continues from a model the text describes (``model.save_pretrained(out)``, the measuring tools) gets
  a tiny prelude that makes those names (CONTEXTS below, keyed by text of the block's first line): a 1-layer LLaMA
  from a transformers config, a small MLP; the block's own lines run unchanged after it;
- pretrained weights are not downloaded (no network at test time): ``pretrained=True`` becomes ``pretrained=False``
  and ViT-B/16 becomes ViT-Ti/16 (same code path, 20x fewer parameters);
- ``estimate("llama-7b", ...)`` builds 1 block at 32 tokens instead of 32 blocks at 512.

**Opting out.** A block that needs a GPU or a download is not run when the line right above its opening fence is
``<!-- no-run -->``; tests/test_docs.py checks that such a block does need one (it names CUDA or a hub download).
A new block needs no entry here if it runs on its own; if it continues from a model in the text, add a prelude.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_RUN = "<!-- no-run -->"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)

SUBSTITUTIONS = [
    ("pretrained=True", "pretrained=False"),
    ('"vit_base_patch16_224"', '"vit_tiny_patch16_224"'),
    ('estimate("llama-7b", "lora+lowmembp", rank=64)',
     'estimate("llama-7b", "lora+lowmembp", rank=64, layers=1, seq_len=32)'),
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

# a block whose first line contains the key -> the prelude that makes the names it continues from
CONTEXTS = {
    "model.save_pretrained(out)": TINY_LLAMA,
    "import SavedTensorAccountant": TINY_MLP,  # the measuring tools (whichever module they are imported from)
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    run: bool  # False: marked <!-- no-run -->

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every ```python block of a Markdown file, in order, with whether it is to run."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        out.append(Block(path, text.count("\n", 0, m.start()) + 1, m.group(1), before != NO_RUN))
    return out


def program(code: str) -> str:
    """The block as it runs: substitutions applied, the prelude of its first line (if any) before it."""
    for old, new in SUBSTITUTIONS:
        code = code.replace(old, new)
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    prelude = next((p for key, p in CONTEXTS.items() if key in first), "")
    return textwrap.dedent(prelude) + "\n" + code


def run_block(block: Block, tmp_path: Path, timeout: int = 300) -> None:
    """Run one block in a fresh interpreter from the repository root; fail with its stderr."""
    script = tmp_path / "block.py"
    script.write_text(program(block.code))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env=env)
    assert p.returncode == 0, f"{block.name} failed:\n{block.code}\n--- stderr:\n{p.stderr[-3000:]}"
