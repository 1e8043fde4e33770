"""Architecture adapters: where blocks, norms, activations and the linears fed by each norm sit in timm /
transformers models. ``get_layout(model) -> ModelLayout``; see :mod:`lowmembp.models.layout` for the contract."""
from lowmembp.models.layout import (FAMILIES, ActSite, ModelLayout, NormSite, Site, UnsupportedModelError,
                                    act_kind, get_layout, is_linear_like, norm_kind, register_adapter, unwrap_peft)

__all__ = ["FAMILIES", "ActSite", "ModelLayout", "NormSite", "Site", "UnsupportedModelError", "act_kind",
           "get_layout", "is_linear_like", "norm_kind", "register_adapter", "unwrap_peft"]
