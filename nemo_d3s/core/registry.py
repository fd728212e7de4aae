"""One registry per extension point, one call signature (a ``typing.Protocol``) per registry. An
entry with the wrong signature fails when registered, naming what is wrong; an unknown name raises a
ValueError listing the known names."""

from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import Any, Callable, Dict, Generic, Iterator, List, Mapping, Optional, TypeVar

__all__ = ["Registry", "signature_mismatch"]

T = TypeVar("T", bound=Callable)

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _protocol_signature(protocol: type) -> inspect.Signature:
    sig = inspect.signature(protocol.__call__)
    return sig.replace(parameters=list(sig.parameters.values())[1:])  # drop self


def signature_mismatch(fn: Callable, protocol: type) -> Optional[str]:
    """None when ``fn`` can be called as ``protocol.__call__`` says, else what is wrong: positional
    parameters in order (names free), keyword-only ones by name or ``**kwargs``, and nothing
    required that the protocol does not pass."""
    if not callable(fn):
        return f"is not callable ({type(fn).__name__})"
    try:
        have = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None
    want = _protocol_signature(protocol)
    hp = list(have.parameters.values())
    wp = list(want.parameters.values())
    h_pos = [p for p in hp if p.kind in _POSITIONAL]
    h_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in hp)
    h_varkw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in hp)
    h_names = {p.name for p in hp if p.kind in _BY_NAME}
    w_pos = [p for p in wp if p.kind in _POSITIONAL]
    w_kw = [p.name for p in wp if p.kind is inspect.Parameter.KEYWORD_ONLY]
    w_varkw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in wp)
    problems: List[str] = []
    if len(h_pos) < len(w_pos) and not h_varargs:
        problems.append(
            f"takes {len(h_pos)} positional argument(s), the protocol passes {len(w_pos)}"
        )
    missing = [n for n in w_kw if n not in h_names and not h_varkw]
    if missing:
        problems.append(f"does not take the keyword argument(s) {', '.join(missing)}")
    for i, p in enumerate(hp):
        if p.default is not inspect.Parameter.empty or p.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            continue
        given = (p.kind in _POSITIONAL and i < len(w_pos)) or (
            p.kind in _BY_NAME and (p.name in w_kw or w_varkw)
        )
        if not given:
            problems.append(f"requires {p.name!r}, which the protocol does not pass")
    return "; ".join(problems) or None


class Registry(Generic[T]):
    """A named table of implementations of one extension point. ``kind`` names it in errors;
    ``defaults`` are the properties every entry has, overridden at registration and read with
    ``prop(name, key)``, so callers never compare names."""

    def __init__(self, kind: str, protocol: type, **defaults: Any) -> None:
        if not callable(getattr(protocol, "__call__", None)):
            raise TypeError(f"{kind}: the protocol must define __call__")
        self.kind = kind
        self.protocol = protocol
        # (annotations are strings under ``from __future__ import annotations``: unquoted)
        self.signature = f"{protocol.__name__}{_protocol_signature(protocol)}".replace("'", "")
        self.defaults: Dict[str, Any] = dict(defaults)
        self._entries: Dict[str, T] = {}
        self._props: Dict[str, Dict[str, Any]] = {}

    def register(self, name: str, **props: Any) -> Callable[[T], T]:
        """Decorator ``@REGISTRY.register("name", prop=value)``; a duplicate name, an undeclared
        property or a signature mismatch (TypeError) is an error."""
        unknown = sorted(set(props) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r}: unknown properties {unknown}; known: "
                f"{sorted(self.defaults)}"
            )

        def deco(fn: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            why = signature_mismatch(fn, self.protocol)
            if why is not None:
                raise TypeError(f"{self.kind} {name!r} {why}; expected {self.signature}")
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
