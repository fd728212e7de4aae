"""The errors a user sees as one ``error:`` line (exit code 2); a leaf every layer may import.
:class:`ConfigError`: a configuration value, or a file it names, is wrong (the message names the
dotted key or the file and field). :class:`RunError`: a fault of the run's environment or files
(busy output folder, corrupt checkpoint, full disk), naming the path or key. ``nemo_d3s.config`` and
``nemo_d3s.trainer.faults`` re-export them."""

from __future__ import annotations

__all__ = ["ConfigError", "RunError"]


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the dotted key."""


class RunError(RuntimeError):
    """A fault of the run's environment or files; the message names the path or key."""
