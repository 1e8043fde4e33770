"""Forcing an op backend in a test: ``force_backend(monkeypatch, "torch")`` (None: the default rule).

The ops read ``LOWMEMBP_BACKEND`` once, at import; a test sets the routes it works out
(:func:`lowmembp.ops.backend.routes_for`, an invalid name included) for its duration, and the environment variable
too, for the processes it starts."""
from lowmembp.ops import backend


def force_backend(monkeypatch, name):
    if name is None:
        monkeypatch.delenv(backend.ENV, raising=False)
    else:
        monkeypatch.setenv(backend.ENV, name)
    monkeypatch.setattr(backend, "_routes", backend.routes_for(name))
