"""One registry per extension point, one call signature per registry.

A registry maps a name to a callable. Looking up an unknown name raises a ``ValueError``
that lists the known names, so a typo in a Hydra override fails at start-up with a useful
message rather than deep inside a training step.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Dict, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T", bound=Callable)


class Registry(Generic[T]):
    """A named table of implementations of one extension point.

    ``kind`` names the extension point in error messages (e.g. "sample selection rule").
    ``signature`` documents the call signature every entry must follow.
    ``defaults`` are the properties every entry has (e.g. ``needs_entropy=True``); an entry
    overrides them at registration, and callers ask ``prop(name, key)`` instead of comparing
    names, so a new entry says what it needs in one place.
    """

    def __init__(self, kind: str, signature: str = "", **defaults: Any) -> None:
        self.kind = kind
        self.signature = signature
        self.defaults: Dict[str, Any] = dict(defaults)
        self._entries: Dict[str, T] = {}
        self._props: Dict[str, Dict[str, Any]] = {}

    def register(self, name: str, **props: Any) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name", prop=value)``. Registering a name twice,
        or a property the registry does not declare, is an error."""
        unknown = sorted(set(props) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r}: unknown properties {unknown}; known: "
                f"{sorted(self.defaults)}"
            )

        def deco(fn: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            self._props[name] = {**self.defaults, **props}
            return fn

        return deco

    def properties(self, name: str) -> Mapping[str, Any]:
        """The entry's properties (registry defaults overridden at registration); read-only."""
        self.get(name)  # unknown name -> the listing error
        return MappingProxyType(self._props[name])

    def prop(self, name: str, key: str) -> Any:
        props = self.properties(name)
        if key not in props:
            raise KeyError(f"{self.kind} registry has no property {key!r}; known: {sorted(props)}")
        return props[key]

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
