"""The full-fine-tuning levers' rows for the prepared GPU run, in the order they should be measured when its time
runs short: the other packages' optimizers (lowmembp.methods.optim_levers) and CompAct (lowmembp.methods.compact).

    from gpu_full_ft_levers import full_ft_lever_configs
    full_ft_lever_configs(smoke)          # the rows of the run's full_ft part (gpu_run_steps.step_configs has them)

Each row is a :class:`gpu_run_steps.StepConfig` of the ``full_ft`` part (a cell of the training job on generated
data, :func:`gpu_run_steps.job_argv`), the 4-layer LLaMA-7B of the llama part's AdamW rows (bf16 weights and
autocast, batch 1 × 640), one per optimizer; CompAct's rows at batch 4 × 640 (its saving is in the activations,
which batch 1 leaves small), beside AdamW at that batch. Each row is a configuration of its own, built and stepped
alone (``<config>-<optimizer or method>``): a row's peak is then its own, with no other model resident. Rows the
GPU has to say something about come first: the paged AdamW of the official QLoRA recipe
(its states outside PyTorch's allocator: the run's resident bytes), GaLore layer-wise (GaLore's memory figure),
torchao's CPU offload (CUDA only), torchao's low-bit states (compiled on first use), then the rest. On the CPU
(the run's dry run) the job refuses ``adamw-cpu-offload`` with its reason (:func:`gpu_run_steps.job_refuses`).
"""
from __future__ import annotations

from gpu_run_steps import LLAMA_FULL_METHOD, LLAMA_SMOKE, StepConfig

__all__ = ["PRIORITY", "full_ft_lever_configs"]

# (config, method, optimizer, batch size), most wanted first
PRIORITY = (
    ("llama7b-4layers-full", LLAMA_FULL_METHOD, "paged-adamw", 1),
    ("llama7b-4layers-full", LLAMA_FULL_METHOD, "galore-adamw-layerwise", 1),
    ("llama7b-4layers-full", LLAMA_FULL_METHOD, "adamw-cpu-offload", 1),
    ("llama7b-4layers-full", LLAMA_FULL_METHOD, "adamw8bit-torchao", 1),
    ("llama7b-4layers-full-b4", "baseline", "adamw", 4),
    ("llama7b-4layers-full-b4", "compact", "adamw", 4),
    ("llama7b-4layers-full-b4", "compact+lowmembp", "adamw", 4),
    ("llama7b-4layers-full-b4", "lowmembp", "adamw", 4),
    ("llama7b-4layers-full", LLAMA_FULL_METHOD, "adamw4bit-torchao", 1),
    ("llama7b-4layers-full", LLAMA_FULL_METHOD, "adamw-fp8-torchao", 1),
    ("llama7b-4layers-full", LLAMA_FULL_METHOD, "apollo-adamw", 1),
    ("llama7b-4layers-full", LLAMA_FULL_METHOD, "adafactor", 1),
    ("llama7b-4layers-full", LLAMA_FULL_METHOD, "paged-adamw8bit", 1),
    ("llama7b-4layers-full", LLAMA_FULL_METHOD, "galore-adamw", 1),
)


def full_ft_lever_configs(smoke: bool) -> list[StepConfig]:
    """The rows of :data:`PRIORITY` (``smoke``: the dry run's tiny widths, 2 layers, 16 tokens)."""
    llama = dict(seq_len=16 if smoke else 640, dtype="bf16", layers=2 if smoke else 4, weights="bf16")
    return [StepConfig("full_ft", f"{config}-{opt if method == LLAMA_FULL_METHOD and opt != 'adamw' else method}",
                       "llama-7b", method, {}, batch_size=2 if smoke and bs > 1 else bs,
                       overrides=dict(LLAMA_SMOKE) if smoke else None, lora_targets="none (full fine-tuning)",
                       optimizer=opt, **llama)
            for config, method, opt, bs in PRIORITY]
