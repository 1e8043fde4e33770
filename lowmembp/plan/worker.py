"""The planner's worker processes: what each needs before its first row.

Imported first (:mod:`lowmembp.plan.pool`: in the fork server, or in this process before it forks the workers),
before the modules it preloads, so that what it sets holds for every worker; :func:`init` then runs in each worker.
"""
import logging
import warnings

# bitsandbytes' notice about its optional CPU 4-bit kernel is dropped by lowmembp/__init__.py (imported first)


def init() -> None:
    """One thread per worker (the workers are the parallelism), no warnings from the methods' fake steps (nor
    transformers' log lines, e.g. "use_cache=True is incompatible with gradient checkpointing" once per worker:
    said of a training run, not of an estimate; transformers sets its logger's level when first imported, so this
    runs after that). ``gc.freeze()``: what the worker starts with (torch, transformers, peft: ~580 000 objects) is
    left out of the collector's full passes, which otherwise walk it all again every few dozen rows (~0.4 s each;
    0.7-0.8 s of full passes in 32 LLaMA-7B rows, 0.1 s frozen). The collector then runs every 50 000 allocations
    instead of 700: a row allocates ~100 000 objects (fake tensors, modules, weak references), and collecting every
    700 costs ~10 % of the rows' CPU time (the full LLaMA-7B plan: 92 CPU s in the rows at 700, 83 at 50 000, the
    rows identical). Reference cycles (the models of finished rows) are still collected, a little later."""
    import gc

    import torch
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
