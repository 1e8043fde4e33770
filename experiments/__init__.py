"""Experiments: the training job (``python -m experiments.train``), its tasks and the sweep configs."""
