"""Measurement: what a real training step costs, on the device it runs on.

- :mod:`~lowmembp.measurement.saved`: the saved-for-backward accountant (bytes by op kind, storage-deduplicated);
  :mod:`~lowmembp.measurement.kinds`: the op kinds it attributes bytes to;
- :mod:`~lowmembp.measurement.peak`: a whole step's peak by category (parameters, gradients, optimizer state,
  activations, temporaries), from a storage tracker, the CUDA allocator or the compiled CPU allocator;
- :mod:`~lowmembp.measurement.timing`: step time (warm-up, percentiles, interleaved comparisons);
- :mod:`~lowmembp.measurement.capture`: a whole training step captured in a CUDA graph or compiled with
  ``reduce-overhead`` and replayed (static input buffers, warm-up on a side stream), the host out of fast steps;
- :mod:`~lowmembp.measurement.flops`: a step's FLOPs by torch's own formulas;
- :mod:`~lowmembp.measurement.fidelity`: a method's gradient against exact backprop's (cosine, relative error) per
  parameter tensor and per block depth.

May import: torch, :mod:`lowmembp._compat`, :mod:`lowmembp.methods` (to recognise a compiled model). Never the
estimator or the planner, which build on it. Import the submodules directly
(``from lowmembp.measurement.peak import measure_step_peak``); this package imports none of them.
"""
