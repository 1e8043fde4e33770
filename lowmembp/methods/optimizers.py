"""The optimizer's memory levers, chosen beside the methods: AdamW with its usual states, with 8-bit states, or stepped
inside the backward.

    opt = make_optimizer(model.parameters(), "adamw-fused-backward", lr=1e-4, weight_decay=0.01)
    loss.backward()      # each parameter is stepped, and its gradient freed, as soon as the gradient is accumulated
    opt.step()           # the usual loop still works: step() and zero_grad() find nothing left to do

In full fine-tuning the gradients and AdamW's two states often outweigh the activations. :data:`OPTIMIZERS`:
``adamw``, ``adamw8bit`` (bitsandbytes' block-wise 8-bit states; not exact), ``adamw-fused-backward``
(:class:`FusedBackwardAdamW`: each parameter stepped from its post-accumulate-grad hook and its gradient freed, so
the gradients never all live at once; exact, but no accumulation, global-norm clipping or ``GradScaler``), and the
other packages' levers built by :mod:`lowmembp.methods.optim_levers` (GaLore, APOLLO, Adafactor, torchao, paged
AdamW). In full, with measured figures: docs/methods/optimizers.md, docs/methods/optim-levers.md.

May import: torch; bitsandbytes (``adamw8bit`` only, on first use); :mod:`lowmembp.methods.optim_levers`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from lowmembp.methods import optim_levers

__all__ = ["OPTIMIZERS", "DEFAULT_OPTIMIZER", "make_optimizer", "FusedBackwardAdamW", "FusedBackwardOptimizer",
           "adamw8bit_state_bytes", "frees_gradients", "check_optimizer", "optimizer_name", "steps_in_backward"]

OPTIMIZERS = {
    "adamw": "torch.optim.AdamW: fp32 states (8 bytes per trained element), stepped after the backward",
    "adamw8bit": "bitsandbytes AdamW8bit: block-wise 8-bit states (2 bytes per element + an fp32 absmax per 256)",
    "adamw-fused-backward": "AdamW stepped per parameter inside the backward; each gradient freed once used (exact)",
    **{name: lever.description for name, lever in optim_levers.LEVERS.items()},
}
DEFAULT_OPTIMIZER = "adamw"  # what a run uses unless told otherwise (the pipeline's record paths leave it out)
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller tensors keep fp32 states
BNB_BLOCKSIZE = 256       # bitsandbytes' block-wise 8-bit optimizers: one absmax per 256 elements
BNB_QMAP_BYTES = 2 * 256 * 4  # the two quantisation maps (signed, unsigned), fp32, shared by every parameter


def check_optimizer(spec: str) -> str:
    """The optimizer name of ``spec`` (a key of :data:`OPTIMIZERS`, GaLore / APOLLO options written in:
    ``"galore-adamw@rank=64"``); ValueError naming the choices otherwise."""
    return optim_levers.check_optimizer(spec, OPTIMIZERS)


def optimizer_name(spec: str) -> str:
    """``"galore-adamw@rank=64"`` -> ``"galore-adamw"`` (not checked)."""
    return optim_levers.split_optimizer(spec)[0]


def steps_in_backward(spec: str) -> bool:
    """Whether the optimizer ``spec`` steps each parameter inside the backward and frees its gradient (then no
    accumulation over micro-batches, no fp16 scaler, no data-parallel reduction before the step)."""
    return optim_levers.steps_in_backward(spec)


def make_optimizer(params: Iterable[torch.Tensor], name: str = DEFAULT_OPTIMIZER, *, lr: float = 1e-3,
                   weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   model: torch.nn.Module | None = None, **kw) -> torch.optim.Optimizer:
    """The optimizer ``name`` (a key of :data:`OPTIMIZERS`, options written in for GaLore / APOLLO) over ``params``
    (tensors; those without ``requires_grad`` are left out). ``kw`` goes to the underlying optimizer (torch's
    AdamW: ``foreach``, ``fused``; bitsandbytes: ``min_8bit_size``, ...). ``model``: where GaLore / APOLLO find
    the matrices they project (the blocks' attention and MLP linears; without it every 2-D tensor of ``params``).
    Every result has the usual ``step()``, ``zero_grad()``, ``state_dict()``, ``param_groups`` (so
    learning-rate schedulers work)."""
    try:
        base = check_optimizer(name)
    except ValueError as err:
        raise ValueError(f"unknown optimizer {name!r}; {err}") from None
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("make_optimizer: no parameter requires a gradient")
    common = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
    if base in optim_levers.LEVERS:
        return optim_levers.build_lever(params, name, model=model, **common, **kw)
    if name == "adamw":
        return torch.optim.AdamW(params, **common, **kw)
    if name == "adamw8bit":
        return _adamw8bit(params, **common, **kw)
    return FusedBackwardAdamW(params, **common, **kw)


def _adamw8bit(params, **kw):
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise ImportError("optimizer 'adamw8bit' needs bitsandbytes: pip install 'bitsandbytes>=0.45,<0.51' "
                          "(the project's extra 'optim')") from err
    # bitsandbytes builds its two quantisation maps with .tolist() at construction, which a fake-tensor mode refuses:
    # on fake parameters, construct it outside the mode (the step itself runs on fake tensors)
    return bnb.optim.AdamW8bit(params, **kw)


def adamw8bit_state_bytes(numel: int, *, min_8bit_size: int = BNB_MIN_8BIT_SIZE,
                          blocksize: int = BNB_BLOCKSIZE) -> int:
    """Bytes of bitsandbytes ``AdamW8bit``'s states for one parameter of ``numel`` elements (its ``init_state``):
    two uint8 states and two fp32 absmax vectors of ``ceil(numel / blocksize)``; below ``min_8bit_size`` two fp32
    states. The two shared quantisation maps (:data:`BNB_QMAP_BYTES`) are not included."""
    if numel < min_8bit_size:
        return 2 * 4 * numel
    return 2 * numel + 2 * 4 * -(-numel // blocksize)


def frees_gradients(optimizer) -> bool:  # also FusedBackwardOptimizer (GaLore's layer-wise form): a subclass
    """Whether ``optimizer`` steps inside the backward and frees each gradient (no gradient outlives it)."""
    return isinstance(optimizer, FusedBackwardAdamW)


class FusedBackwardAdamW(torch.optim.Optimizer):
    """AdamW stepped inside the backward: one ``torch.optim.AdamW`` per parameter, run from the parameter's
    post-accumulate-grad hook, after which the gradient is set to ``None``.

    Looks like one optimizer to the training loop: ``param_groups`` (one group; a learning-rate scheduler's changes
    reach every parameter at its next step), ``state`` (keyed by parameter, AdamW's own ``step``/``exp_avg``/
    ``exp_avg_sq``), ``state_dict()``/``load_state_dict()`` (the same layout as a ``torch.optim.AdamW`` over the
    same parameters: checkpoints move between the two). ``step()`` steps only the parameters whose gradient is
    still there (normally none: the hooks have consumed them), so a loop written for ``adamw`` runs unchanged;
    ``zero_grad()`` drops any gradient left. :meth:`remove` takes the hooks off (the optimizer then does nothing
    until :meth:`attach`)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, **kw):
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("FusedBackwardAdamW: no parameter requires a gradient")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("FusedBackwardAdamW: a parameter is given twice")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._kw = dict(kw)
        self._inner: dict[torch.Tensor, torch.optim.AdamW] = {}
        self._handles: list = []
        self._link()
        self.attach()

    def _link(self) -> None:
        """One AdamW per parameter, its state the shared ``self.state`` (so state_dict sees it)."""
        group = self.param_groups[0]
        self._inner = {}
        for p in group["params"]:
            inner = torch.optim.AdamW([p], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                      weight_decay=group["weight_decay"], **self._kw)
            inner.state = self.state
            self._inner[p] = inner

    def attach(self) -> None:
        """Register the hooks (done by the constructor)."""
        if not self._handles:
            self._handles = [p.register_post_accumulate_grad_hook(self.step_param)
                             for p in self.param_groups[0]["params"]]

    def remove(self) -> None:
        """Take the hooks off."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def optimizer_of(self, p: torch.Tensor) -> torch.optim.Optimizer:
        """Parameter ``p``'s own optimizer."""
        return self._inner[p]

    def step_param(self, p: torch.Tensor) -> None:
        """Step parameter ``p`` now and free its gradient (what its hook does); no-op without a gradient."""
        if p.grad is None:
            return
        inner = self._inner[p]
        g, mine = self.param_groups[0], inner.param_groups[0]
        for k in ("lr", "betas", "eps", "weight_decay"):
            mine[k] = g[k]
        inner.step()
        p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        """Step the parameters whose gradients the hooks have not consumed (normally none); returns the closure's
        loss when one is given (the closure's backward then steps through the hooks)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                self.step_param(p)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()  # load_state_dict replaces self.state


class FusedBackwardOptimizer(FusedBackwardAdamW):
    """:class:`FusedBackwardAdamW`'s hooks around another optimizer class: ``inner(p, lr=, betas=, eps=,
    weight_decay=)`` builds parameter ``p``'s own optimizer (GaLore's layer-wise recipe: one ``GaLoreAdamW`` per
    parameter, stepped from its post-accumulate-grad hook, the gradient then freed). The state is keyed by
    parameter as the inner class keeps it (not necessarily AdamW's layout)."""

    def __init__(self, params: Iterable[torch.Tensor], inner, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        self._make_inner = inner
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def _link(self) -> None:
        group = self.param_groups[0]
        self._inner = {}
        for p in group["params"]:
            inner = self._make_inner(p, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                     weight_decay=group["weight_decay"])
            inner.state = self.state
            self._inner[p] = inner
