"""The base of the run config's sections: each checks its own fields in ``validate()``, run by
``__post_init__``, so a section is checked where it is built; messages name the dotted key
(``trainer.lr=0.0: learning rate must be > 0``)."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any, ClassVar

from nemo_d3s.errors import ConfigError

__all__ = ["Section", "known", "require"]


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """ConfigError ``key=value: why`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def known(key: str, value: str, registry: Any) -> None:
    """Check ``value`` against a registry of the lower layers (``core.registry.Registry``)."""
    if value not in registry:
        raise ConfigError(f"{key}={value!r}: unknown; known: {', '.join(registry.names())}")


class Section:
    """A config section: ``KEY`` is its dotted place in the run config; ``validate()``
    checks its own fields (messages name ``KEY.field``) and runs when it is built."""

    KEY: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        raise NotImplementedError

    def _check(self, ok: bool, name: str, why: str) -> None:
        require(ok, f"{self.KEY}.{name}", getattr(self, name), why)

    def _built(self, build: Any) -> Any:
        """Build a lower layer's object that judges these settings; its ValueError becomes a
        ConfigError under this section's key (``KEY.field ...`` when it starts with a field)."""
        try:
            return build()
        except ConfigError:
            raise
        except (ValueError, TypeError) as e:
            msg = str(e)
            head = re.split(r"[ =]", msg, maxsplit=1)[0]
            named = head in {f.name for f in fields(self)}  # type: ignore[arg-type]
            raise ConfigError(f"{self.KEY}.{msg}" if named else f"{self.KEY}: {msg}") from None
