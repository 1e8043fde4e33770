"""Records for the tests of experiments.record and the modules around it: a full version-2 Record, and a version-1
record as the job wrote it before schema 2."""
from __future__ import annotations

from experiments import record as R

# a version-1 record as the job wrote it before schema 2 (tweets-lm, lora+lowmembp, 3 steps), trimmed env
V1 = {
    "schema_version": 1, "model": "llama-tiny", "method": "lora+lowmembp", "task": "tweets-lm", "batch_size": 4,
    "seq_len": 32, "dtype": "fp32", "seed": 0, "steps": 3, "epochs": None,
    "options": {"rank": 2, "lr": 0.01, "weight_decay": 0.01, "warmup_steps": 6, "train_split": "train",
                "save_model": None, "grad_accum": 1, "limit": 48, "eval_limit": 8, "max_len": 32,
                "max_memory_mb": None, "config": None, "train_pool": 48, "test_size": 8, "vocab": "bytes"},
    "status": "ok", "message": None,
    "peak_memory": {"bytes": 7910508, "how": "cpu storage tracker (exact bytes)",
                    "by_category": {"parameters": 3506560, "gradients": 0, "optimizer_state": 156384,
                                    "activations": 3981324, "temporaries": 266240, "other": 0}},
    "activation_bytes": {"total": 4024324, "by_kind": {"act": 44032, "norm": 69632, "attention": 868352,
                                                        "linear": 1499136, "product": 1409024, "other": 134148}},
    "step_time_s": {"p20": 0.0446, "p50": 0.0446, "p80": 0.0446, "n": 1, "how": "perf_counter per step"},
    "throughput": {"samples_per_s": 89.59, "tokens_per_s": 2866.9}, "final_loss": 5.6089,
    "metric": {"name": "perplexity", "value": 251.11, "split": "test (8)"},
    "env": {"device": "cpu (x86_64, 1 threads)", "torch": "2.14.1+cu130", "triton": "3.8.0", "timm": "1.0.31",
            "transformers": "5.24.0", "git_commit": None, "hostname": "vm"},
    "started_at": "2026-12-01T08:15:40+00:00", "finished_at": "2026-12-01T08:15:44+00:00",
}



def full_record() -> R.Record:
    return R.Record(
        run=R.RunIdentity(task="mnist5k", model="vit-mnist", method="tokentune", batch_size=4, dtype="fp16", seed=3,
                          steps=5, steps_planned=5, seq_len=17),
        status="ok", started_at="a", finished_at="b", environment=R.Environment(device="cpu", threads=1),
        method_options={"k": 3, "targets": ["qkv", "fc1"]}, hyperparameters=R.HyperParameters(lr=1e-3, max_len=9),
        task_facts={"train_pool": 48, "max_len": 7},
        base=R.BaseWeights(path="b.safetensors", sha256="ab", metric_before=0.5, metadata={"steps": "3"}),
        saved_bytes=R.SavedBytes(total=10, by_kind={"act": 4, "norm": 6}),
        peak=R.Peak(device=R.PeakMemory(bytes=100, how="t", by_category={"activations": 60, "parameters": 40}),
                    host=R.PeakMemory(bytes=7, how="h")),
        step_time_s=R.StepTime(p20=1.0, p50=2.0, p80=3.0, n=4, how="x"),
        throughput=R.Throughput(samples_per_s=2.0, tokens_per_s=34.0), final_loss=0.25,
        metric=R.Metric(name="accuracy", value=0.75, split="test (8)"), notes=["a note"])

