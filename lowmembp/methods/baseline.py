"""``baseline``: the model as it is — the reference every other method is compared with."""
from lowmembp.methods.registry import register


@register("baseline", "the unmodified model (the reference for every comparison)", order=0)
def apply_baseline(model):
    return model
