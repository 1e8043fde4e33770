"""Architecture adapters: where blocks, norms, activations and the linears fed by each norm sit in timm /
transformers models. ``get_layout(model) -> ModelLayout``; see :mod:`lowmembp.models.layout` for the contract.

TokenTune's per-family training forwards live here too (``tokentune_families``, on ``rows``), imported by the method
when used.

Importing this package registers the built-in adapters (timm, transformers) and the data-flow adapter (last);
``layout.py`` itself imports none of them (no import cycle).

May import: torch, timm, transformers, peft (each where an adapter needs it), :mod:`lowmembp._compat`. Never the
ops, methods, measurement, estimator or planner rooms (tests/test_layering.py)."""
from lowmembp.models.detect import ACT_KINDS, act_kind, is_linear_like, norm_kind, norm_spec
from lowmembp.models.layout import (BUILTIN_PRIORITY, DATAFLOW_PRIORITY, FAMILIES, USER_PRIORITY, ActSite,
                                    ModelLayout, NormSite, Site, UnsupportedModelError, get_layout, register_adapter,
                                    unregister_adapter, unwrap_peft)
from lowmembp.models import hf_models, timm_models  # noqa: F401,E402  (register the built-in adapters)
from lowmembp.models import dataflow  # noqa: F401,E402  (register the data-flow adapter, priority 0)

__all__ = ["ACT_KINDS", "BUILTIN_PRIORITY", "DATAFLOW_PRIORITY", "FAMILIES", "USER_PRIORITY", "ActSite",
           "ModelLayout", "NormSite", "Site", "UnsupportedModelError", "act_kind", "get_layout", "is_linear_like",
           "norm_kind", "norm_spec", "register_adapter", "unregister_adapter", "unwrap_peft"]
