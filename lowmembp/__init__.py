"""lowmembp: memory-efficient fine-tuning of Transformers, methods side by side.

    import lowmembp
    model = lowmembp.apply(model, "lora+lowmembp")   # one call on your own timm / transformers model
    lowmembp.methods()                               # {name: description}
"""
from lowmembp.methods import apply, methods

__version__ = "0.1.0"
__all__ = ["apply", "methods", "__version__"]
