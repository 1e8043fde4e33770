"""Smoke test of the installed wheel, run from outside the source tree (.ci/floors): the package imports from
site-packages, a method applies and trains on a tiny model, estimate runs, and the plan command works."""
import os
import subprocess
import sys

import torch
import transformers

import lowmembp
from lowmembp.estimator.step import estimate

assert "site-packages" in lowmembp.__file__, f"lowmembp imported from {lowmembp.__file__}, not the installed wheel"
try:
    import experiments  # noqa: F401
    raise SystemExit("the wheel must not install a top-level 'experiments' package")
except ImportError:
    pass
cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=56, vocab_size=61)
model = lowmembp.apply(transformers.LlamaForCausalLM(cfg), "lora+lowmembp")
ids = torch.randint(0, 61, (2, 7))
model(input_ids=ids, labels=ids).loss.backward()
lowmembp.export(model)
peak = estimate("llama-7b", "lora+lowmembp", batch_size=2, layers=2, seq_len=8, dtype="bf16",
                overrides={"hidden_size": 32, "intermediate_size": 56, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "vocab_size": 61})["peak"]["bytes"]
assert peak > 0
cmd = [sys.executable, "-m", "lowmembp.plan", "--model", "llama-7b", "--batch-size", "2", "--seq-len", "8",
       "--gpu-memory", "80GiB", "--methods", "lora", "--max-methods", "1", "--jobs", "1"]
out = subprocess.run(cmd, capture_output=True, text=True, cwd=os.getcwd())
assert out.returncode == 0, out.stderr[-2000:]
bad = subprocess.run(cmd[:-6] + ["--gpu-memory", "512MiB", "--reserved", "1GiB", "--methods", "lora", "--jobs", "1"],
                     capture_output=True, text=True)
assert bad.returncode == 2 and "not larger than the reserve" in bad.stderr, bad.stderr[-2000:]
print(f"wheel smoke ok: lowmembp from {lowmembp.__file__}, torch {torch.__version__}, transformers "
      f"{transformers.__version__}; estimate peak {peak} bytes")
