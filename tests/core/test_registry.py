"""Each registry's protocol is checked at ``register()``: an entry that cannot be called the
way the extension point calls it fails where it is registered, naming the mismatch."""

from __future__ import annotations

from typing import Protocol

import pytest

from nemo_d3s.backends.engines import ROLLOUT_ENGINES
from nemo_d3s.core.advantages import ADVANTAGE_ESTIMATORS
from nemo_d3s.core.losses import POLICY_LOSSES
from nemo_d3s.core.registry import Registry, signature_mismatch
from nemo_d3s.core.sample_selection import SAMPLE_SELECTORS
from nemo_d3s.core.schedules import SCHEDULES
from nemo_d3s.core.token_selection import TOKEN_SELECTORS
from nemo_d3s.distributed.topk import DISTRIBUTED_TOKEN_SCOPES
from nemo_d3s.tasks.base import TASKS


class _Rule(Protocol):
    def __call__(self, a: int, b: int, *, c: int) -> int: ...


class _Factory(Protocol):
    def __call__(self, **options) -> object: ...


def test_signature_mismatch_by_hand():
    assert signature_mismatch(lambda x, y, *, c: 0, _Rule) is None  # positional names free
    assert signature_mismatch(lambda x, y, *, c, d=1: 0, _Rule) is None  # extra, defaulted
    assert signature_mismatch(lambda *args, **kw: 0, _Rule) is None
    assert "takes 1 positional" in signature_mismatch(lambda a, *, c: 0, _Rule)
    assert "keyword argument(s) c" in signature_mismatch(lambda a, b: 0, _Rule)
    assert "requires 'd'" in signature_mismatch(lambda a, b, *, c, d: 0, _Rule)
    assert "not callable" in signature_mismatch(3, _Rule)

    class Task:  # a class whose constructor takes named options is a factory
        def __init__(self, n_eval: int = 8, seed: int = 0) -> None: ...

    class NeedsPositional:
        def __init__(self, path, /) -> None: ...

    assert signature_mismatch(Task, _Factory) is None
    assert "requires 'path'" in signature_mismatch(NeedsPositional, _Factory)


def test_register_refuses_a_callable_that_does_not_follow_the_protocol():
    reg = Registry("thing", _Rule)
    with pytest.raises(TypeError, match=r"thing 'bad' does not take the keyword argument\(s\) c"):
        reg.register("bad")(lambda a, b: 0)
    assert "bad" not in reg
    reg.register("good")(lambda a, b, *, c: a + b + c)
    assert (
        reg.get("good")(1, 2, c=3) == 6
        and reg.signature == "_Rule(a: int, b: int, *, c: int) -> int"
    )


@pytest.mark.parametrize(
    "registry",
    [
        SAMPLE_SELECTORS,
        TOKEN_SELECTORS,
        POLICY_LOSSES,
        ADVANTAGE_ESTIMATORS,
        SCHEDULES,
        DISTRIBUTED_TOKEN_SCOPES,
        ROLLOUT_ENGINES,
    ],
    ids=lambda r: r.kind,
)
def test_every_registry_checks_its_protocol(registry):
    # every registered entry follows it (they were checked when registered) ...
    for name in registry.names():
        assert signature_mismatch(registry.get(name), registry.protocol) is None, name
    # ... and a one-argument function is refused, leaving the table as it was
    before = registry.names()
    with pytest.raises(TypeError, match=f"{registry.kind} 'not_conforming'"):
        registry.register("not_conforming")(lambda x, *, unknown_required: x)
    assert registry.names() == before


def test_task_factories_follow_theirs():
    for name in TASKS.names():
        assert signature_mismatch(TASKS.get(name), TASKS.protocol) is None, name
    with pytest.raises(TypeError, match="requires 'path'"):
        TASKS.register("positional_only")(lambda path, /: path)
    assert "positional_only" not in TASKS
