"""lowmembp: memory-efficient fine-tuning of Transformers, methods side by side.

    import lowmembp
    model = lowmembp.apply(model, "lora+lowmembp")   # one call on your own timm / transformers model
    lowmembp.methods()                               # {name: description}
    lowmembp.export(model).save_pretrained(out)      # an ordinary model again (γ/β restored, LoRA kept or merged)
    lowmembp.plan("llama_7b", gpu_memory="24GiB", batch_size=4, seq_len=2048)   # what fits my GPU? (lowmembp/plan)
"""
from lowmembp.methods import apply, methods
from lowmembp.export import export  # noqa: E402  (the function shadows the submodule name, as methods() does)
from lowmembp.plan import plan  # noqa: E402  (the function shadows the subpackage name; python -m lowmembp.plan)

__version__ = "0.1.0"
__all__ = ["apply", "methods", "export", "plan", "__version__"]
