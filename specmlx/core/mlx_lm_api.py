"""The parts of mlx-lm specmlx uses that are not its public API, in one place.

mlx-lm moves its internals between minor versions; pyproject.toml declares the range that is
tested, and tests/test_mlx_lm_api.py fails loudly, by name, when one of these moves. The
recurrent seams that recurrent.py records (each mixer's recurrence function) are checked
there too.
"""

from __future__ import annotations

from mlx_lm.utils import _get_classes, maybe_set_recommended_wired_limit

__all__ = ["model_classes", "set_wired_limit"]


def model_classes(config: dict) -> tuple[type, type]:
    """(Model class, ModelArgs class) mlx-lm would load ``config`` with; ValueError or
    KeyError for an architecture it does not know."""
    return _get_classes(config)


def set_wired_limit() -> int | None:
    """Keep the weights wired (resident) on a Mac, as mlx-lm's generate does; returns the
    old limit to restore, None where the device reports none (the CPU backend)."""
    return maybe_set_recommended_wired_limit()
