"""How the runtime reaches the training package: by entry point, never by import.

Why: imports point one way (``training`` uses this package, not the reverse), yet two things
the runtime offers need training code: ``chatchat-policybert tune``'s training steps and the
demo's offline model. ``training`` declares them in the entry-point group :data:`GROUP`
(setup.cfg); where the training extras are not installed the entry point is missing or cannot
import, and the command says in one line what to install.
"""

from __future__ import annotations

from typing import Any

from chatchat_policybert.errors import InputError

GROUP = "chatchat_policybert.training"
"""``tune``: the module training ``tune``'s query towers (a
:class:`chatchat_policybert.deploy.query_tune.QueryTrainer`); ``demo-model``: the function building the demo's offline
model."""
INSTALL = "pip install -c constraints.txt '.[chatchat,train]'"


def load_training(name: str, needed_by: str) -> Any:
    """What the training package declares as ``name`` in :data:`GROUP`; an :class:`InputError` saying what
    ``needed_by`` needs installed where there is none or it cannot import."""
    from importlib.metadata import entry_points

    advice = f"{needed_by} needs the training package: {INSTALL}"
    found = entry_points(group=GROUP, name=name)
    if not found:
        raise InputError(f"{advice} (no '{name}' in entry-point group {GROUP})")
    try:
        return next(iter(found)).load()
    except ImportError as exc:
        raise InputError(f"{advice} ({exc})") from None
