"""lowmembp: memory-efficient fine-tuning of Transformers, methods side by side.

    import lowmembp
    model = lowmembp.apply(model, "lora+lowmembp")   # one call on your own timm / transformers model
    lowmembp.methods()                               # {name: description}
    lowmembp.export(model).save_pretrained(out)      # an ordinary model again (γ/β restored, LoRA kept or merged)
"""
from lowmembp.methods import apply, methods
from lowmembp.export import export  # noqa: E402  (the function shadows the submodule name, as methods() does)

__version__ = "0.1.0"
__all__ = ["apply", "methods", "export", "__version__"]
