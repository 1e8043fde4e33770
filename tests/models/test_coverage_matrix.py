"""The coverage matrix of docs/models.md (architecture × method), generated here from the live code on the tiny random
models of tests/tiny_models.py (γ/β perturbed). Every cell either converts with the eval forward unchanged
(relative error ≤ 1e-5) and a training step (forward + backward) that runs, or is refused with a clear error —
never another exception.

Regenerate the docs/models.md block after a change:
``LOWMEMBP_WRITE_MATRIX=1 pytest tests/models/test_coverage_matrix.py``.
"""
import copy
import os
import pathlib
import re
import warnings

import pytest
import torch

import lowmembp
from lowmembp.models import UnsupportedModelError, get_layout
from tiny_models import MORE_BUILDERS, build, logits

pytestmark = pytest.mark.slow  # the full suite only: every method x 20 architectures (~120 s)

ARCHS = ["vit", "swin", "bert", "llama"] + list(MORE_BUILDERS)
METHODS = ["lowmembp", "lowmembp-act", "lowmembp-norm", "mesa", "checkpointing", "lora", "tokentune"]
PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"
START, END = "<!-- coverage-matrix:start -->", "<!-- coverage-matrix:end -->"


def _cell(name: str, method: str, refusals: dict) -> str:
    model, inputs = build(name)
    model.eval()
    batch = inputs()
    with torch.no_grad():
        ref = logits(model, batch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out_model = lowmembp.apply(copy.deepcopy(model), method, **({"k": 4} if method == "tokentune" else {}))
    except (TypeError, ValueError, UnsupportedModelError) as e:
        msg = str(e)
        assert len(msg) > 20, msg
        short = re.sub(r"^.*it cannot run \S+: ", "", msg)
        short = re.sub(r"model type '[^']+'", "model type", short)
        short = short if len(short) <= 220 else short[:217] + "..."
        key = refusals.setdefault(short, len(refusals) + 1)
        return f"refused ({key})"
    out_model.eval()
    with torch.no_grad():
        out = logits(out_model, batch)
    err = float((out - ref).norm() / ref.norm())
    assert err <= 1e-5, (name, method, err)
    out_model.train()  # and a training step runs
    logits(out_model, batch).float().pow(2).mean().backward()
    if method.startswith("lowmembp"):
        rep = get_layout(out_model).base.lowmembp_report
        parts = []
        if method != "lowmembp-act":
            parts.append(f"{len(rep['norms'])} norms" + (f", {len(rep['kept'])} kept" if rep["kept"] else ""))
        if method != "lowmembp-norm":
            parts.append(f"{len(rep['acts'])} acts" + (f", {len(rep['skipped_acts'])} kept"
                                                         if rep["skipped_acts"] else ""))
        return "✓ " + "; ".join(parts)
    if method == "mesa":
        done = getattr(out_model, "_mesa_converted", {})
        return f"✓ {done.get('linear', 0)} lin, {done.get('norm', 0)} norms, {done.get('attention', 0)} attn"
    if method == "checkpointing":
        return f"✓ {getattr(out_model, '_checkpointing', {}).get('how', '?')}"
    if method == "lora":
        n = sum(1 for m in out_model.modules() if hasattr(m, "lora_A") and len(m.lora_A))
        return f"✓ {n} linears"
    return "✓"


def matrix() -> str:
    refusals: dict = {}
    rows = ["| architecture | " + " | ".join(METHODS) + " |", "|---" * (len(METHODS) + 1) + "|"]
    for name in ARCHS:
        model, _ = build(name)
        lay = get_layout(model)
        label = f"{name} ({lay.origin})"
        rows.append(f"| {label} | " + " | ".join(_cell(name, m, refusals) for m in METHODS) + " |")
    notes = [f"({i}) {msg}" for msg, i in sorted(refusals.items(), key=lambda kv: kv[1])]
    return "\n".join(rows) + "\n\nRefusals: " + " ".join(notes) + "\n"


def test_coverage_matrix_matches_the_docs():
    table = matrix()
    text = PAGE.read_text()
    assert START in text and END in text, "docs/models.md lacks the coverage-matrix markers"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    current = rest.split(END, 1)[0].strip("\n")
    if os.environ.get("LOWMEMBP_WRITE_MATRIX"):
        PAGE.write_text(f"{head}{START}\n{table}{END}{tail}")
        return
    assert current == table.strip("\n"), ("the coverage matrix of docs/models.md is stale; regenerate it with "
                                         "LOWMEMBP_WRITE_MATRIX=1 pytest tests/models/test_coverage_matrix.py\n"
                                         + table)


def test_add_a_family():
    """The "How to add a family" example of docs/models.md: a toy model, its adapter tried before the built-in ones."""
    import torch.nn as nn

    from lowmembp.models import ModelLayout, NormSite, Site, register_adapter, unregister_adapter

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.up = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x):
            return x + self.up(self.ln(x))

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    def detect_toy(model, base):
        if type(base).__name__ != "Toy":
            return None
        blocks = [Site(base.blocks, str(i), f"blocks.{i}") for i in range(len(base.blocks))]
        norms = [NormSite(b.get(), "ln", f"{b.path}.ln", consumers=[Site(b.get(), "up", f"{b.path}.up")])
                 for b in blocks]
        return ModelLayout("toy", model, base, blocks, attentions=[], norms=norms, acts=[], final_norm=None, head=[],
                           checkpoint_switch=None, tokentune=None, tokentune_why="toy blocks have no TokenTune driver")

    register_adapter("toy")(detect_toy)
    try:
        torch.manual_seed(0)
        toy = Toy()
        for b in toy.blocks:
            nn.init.uniform_(b.ln.weight, 0.5, 1.5)
            nn.init.uniform_(b.ln.bias, -0.5, 0.5)
        x = torch.randn(3, 8)
        ref = toy(x)
        lay = get_layout(toy)
        assert lay.family == "toy" and lay.lora_targets() == r"(?:blocks\.\d+\.up)"
        conv = lowmembp.apply(toy, "lowmembp-norm")
        assert float((conv(x) - ref).norm() / ref.norm()) <= 1e-5
        assert conv.lowmembp_report["norms"] == ["blocks.0.ln", "blocks.1.ln"]
        with __import__("pytest").raises(TypeError, match="no TokenTune driver"):
            lowmembp.apply(Toy(), "tokentune")
        pm = lowmembp.apply(Toy(), "lora")
        assert sum(1 for m in pm.modules() if hasattr(m, "lora_A") and len(m.lora_A)) == 2
    finally:
        unregister_adapter(detect_toy)
