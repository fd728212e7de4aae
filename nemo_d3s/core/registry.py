"""One registry per extension point, one call signature per registry.

A registry maps a name to a callable. Looking up an unknown name raises a ``ValueError``
that lists the known names, so a typo in a Hydra override fails at start-up with a useful
message rather than deep inside a training step.
"""

from __future__ import annotations

from typing import Callable, Dict, Generic, Iterator, TypeVar

T = TypeVar("T", bound=Callable)


class Registry(Generic[T]):
    """A named table of implementations of one extension point.

    ``kind`` names the extension point in error messages (e.g. "sample selection rule").
    ``signature`` documents the call signature every entry must follow.
    """

    def __init__(self, kind: str, signature: str = "") -> None:
        self.kind = kind
        self.signature = signature
        self._entries: Dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")``. Registering a name twice is an error."""

        def deco(fn: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return deco

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
