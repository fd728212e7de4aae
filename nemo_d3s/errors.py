"""The errors a user sees as one ``error:`` line (exit code 2); a leaf every layer may import.

- :class:`ConfigError`: a configuration value, or a file the configuration names (a model
  folder, a checkpoint), is wrong; the message names the dotted key or the file and field.
- :class:`RunError`: a fault of the run's environment or files (a busy or unwritable output
  directory, a corrupt checkpoint, a full disk); the message names the path or key.

They live here, not in ``config.py`` or ``trainer/faults.py``, so that the file-format layer
and the backends can raise them without importing the layers above them
(``docs/architecture.md``). ``nemo_d3s.config.ConfigError`` and
``nemo_d3s.trainer.faults.RunError`` are the same classes, re-exported.
"""

from __future__ import annotations

__all__ = ["ConfigError", "RunError"]


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the dotted key."""


class RunError(RuntimeError):
    """A fault of the run's environment or files; the message names the path or key."""
