"""The layering of docs/architecture.md, checked on the source (ast only, nothing imported).

- No import cycle among nemo_d3s's modules, counting imports inside functions (a lazy import
  that closes a cycle is still a cycle); only ``if TYPE_CHECKING:`` imports are left out.
  A module named by a string, ``"nemo_d3s.pkg.module:Attr"`` (how
  ``trainer/backend_registry.py`` names the backends it imports when a run picks one), counts
  as an import too.
- Imports point down: each package imports only the packages below it (``ALLOWED``), and
  the layers that must stay free of a framework do not import it (``FORBIDDEN_EXTERNAL``).
- No module is longer than ``MAX_LINES`` lines as committed: formatted lines, since CI keeps
  the tree ``ruff format``ted at line-length 100 (``ruff format --check .`` in ``.ci/run``),
  so a module cannot get under the limit by packing lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

import pytest

PKG = Path(__file__).resolve().parent.parent / "nemo_d3s"
MAX_LINES = 455  # "about 450" formatted lines: a module longer than this is split

# package (first component under nemo_d3s) -> the nemo_d3s packages it may import
ALLOWED: Dict[str, Set[str]] = {
    "errors": set(),
    "files": {"files_staging"},
    "files_staging": set(),
    "versions": {"errors"},
    "core": {"core", "errors"},
    "distributed": {"distributed", "core", "errors"},
    "formats": {"formats", "errors", "files"},
    "tasks": {"tasks", "core", "errors"},
    "backends": {"backends", "core", "distributed", "formats", "errors", "files"},
    # beside backends: D3S inside another project's trainer (TRL); the math below it only
    "integrations": {"integrations", "core", "distributed", "errors", "versions"},
}
# package -> module prefixes outside nemo_d3s it must not import
FORBIDDEN_EXTERNAL: Dict[str, Set[str]] = {
    "core": {"torch.distributed", "megatron", "transformers", "vllm"},
    "distributed": {"megatron", "transformers", "vllm"},
    "formats": {"torch.distributed", "megatron", "transformers", "vllm"},
    "errors": {"torch"},
    "files": {"torch"},
    "files_staging": {"torch"},
    "integrations": {"megatron", "vllm"},
    # the start-up check reads distribution metadata only: importing the packages it judges
    # would be the crash it exists to prevent
    "versions": {"torch", "megatron", "transformer_engine", "vllm"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: Dict[str, Path] = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


# "nemo_d3s.pkg.module:Attr": a lazy import by name (importlib), read as an import
_BY_NAME = re.compile(r"^(nemo_d3s(?:\.\w+)+):\w+$")


def _imports(path: Path) -> List[str]:
    """Every module ``path`` imports (absolute names; ``from a import b`` names ``a.b`` when
    that is a module of the package, else ``a``), at any depth except TYPE_CHECKING blocks,
    and every module it names as ``"nemo_d3s.pkg.module:Attr"``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: List[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _BY_NAME.match(node.value)
            if m:
                out.append(m.group(1))
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append(sub if sub in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


GRAPH: Dict[str, Set[str]] = {
    m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_graph_sees_imports_by_name():
    # the backend registry imports the backends when a run picks one, by "module:Class"
    deps = GRAPH["nemo_d3s.trainer.backend_registry"]
    assert {"nemo_d3s.backends.megatron", "nemo_d3s.backends.megatron.config"} <= deps
    assert {"nemo_d3s.backends.hf", "nemo_d3s.backends.hf.config"} <= deps
    # config.py's sections check names against the registries by plain imports
    assert "nemo_d3s.core.losses" in GRAPH["nemo_d3s.config_schema"]
    assert "nemo_d3s.distributed.topk" in GRAPH["nemo_d3s.config_d3s"]


def test_the_graph_sees_imports_inside_functions():
    # guards the checker itself: the converter's verify imports transformers inside a function
    assert "nemo_d3s.formats.spec" in GRAPH["nemo_d3s.backends.megatron.backend"]
    assert any(
        i.startswith("transformers") for i in _imports(MODULES["nemo_d3s.convert.verify_logits"])
    )
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_point_down(layer):
    bad = []
    for m, deps in GRAPH.items():
        if _layer(m) != layer:
            continue
        bad += [f"{m} -> {d}" for d in sorted(deps) if _layer(d) not in ALLOWED[layer]]
        for name in _imports(MODULES[m]):
            if any(
                name == f or name.startswith(f + ".") for f in FORBIDDEN_EXTERNAL.get(layer, ())
            ):
                bad.append(f"{m} -> {name}")
    assert bad == []


def test_no_backend_imports_the_layers_above():
    above = {"config", "trainer", "convert", "dry_run", "train"}
    bad = [
        f"{m} -> {d}"
        for m, deps in GRAPH.items()
        if _layer(m) == "backends"
        for d in deps
        if _layer(d) in above
    ]
    assert bad == []


def test_only_integrations_import_trl():
    # TRL is an optional extra: the package imports without it, and no layer but
    # integrations/ (and nothing that the run layers import) depends on it.
    bad = [
        f"{m} -> {name}"
        for m, p in MODULES.items()
        if _layer(m) != "integrations"
        for name in _imports(p)
        if name == "trl" or name.startswith("trl.") or name.startswith("nemo_d3s.integrations")
    ]
    assert bad == []


def test_no_module_is_too_long():
    # counts the lines of the files as committed, which CI keeps formatted (ruff format --check)
    long = {
        m: n
        for m, p in MODULES.items()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_errors_have_one_home_and_their_old_names_still_work():
    from nemo_d3s import config, errors
    from nemo_d3s.trainer import faults

    assert config.ConfigError is errors.ConfigError and faults.RunError is errors.RunError
    assert GRAPH["nemo_d3s.errors"] == set()
