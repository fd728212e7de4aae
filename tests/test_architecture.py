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
    "fault_points": set(),
    "files": {"files_staging"},
    "files_staging": set(),
    "versions": {"errors"},
    "core": {"core", "errors"},
    "distributed": {"distributed", "core", "errors"},
    "formats": {"formats", "errors", "files"},
    "tasks": {"tasks", "core", "errors"},
    "backends": {"backends", "core", "distributed", "formats", "errors", "files", "fault_points"},
    # beside backends: D3S inside another project's trainer (TRL); the math below it only
    "integrations": {"integrations", "core", "distributed", "errors", "versions"},
    # the config: its sections judge names against the registries below it
    "config_section": {"errors"},
    "config_d3s": {"config_section", "core", "distributed", "errors"},
    "config_schema": {"config_section", "core", "distributed", "backends", "errors"},
    "config": {"config_section", "config_d3s", "config_schema", "core", "errors"},
    # the run and the entry points
    "trainer": {
        *("trainer", "config", "backends", "core", "distributed", "formats", "tasks"),
        *("errors", "files", "versions", "fault_points"),
    },
    "convert": {
        *("convert", "trainer", "backends", "core", "formats", "errors", "files", "versions"),
    },
    "dry_run": {
        *("dry_run", "trainer", "config", "backends", "core", "formats", "errors", "files"),
    },
    # the self-check drives the others' CUDA paths, the trainer's entry point included
    "selfcheck": {
        *("selfcheck", "train", "trainer", "convert", "dry_run", "backends", "core"),
        *("distributed", "formats", "files", "errors", "config", "versions", "fault_points"),
    },
    "train": {"trainer", "dry_run", "config", "distributed", "errors", "versions"},
}
# package -> module prefixes outside nemo_d3s it must not import
FORBIDDEN_EXTERNAL: Dict[str, Set[str]] = {
    "core": {"torch.distributed", "megatron", "transformers", "vllm"},
    "distributed": {"megatron", "transformers", "vllm"},
    "formats": {"torch.distributed", "megatron", "transformers", "vllm"},
    "errors": {"torch"},
    "fault_points": {"torch"},
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
    # (the Megatron builder imports the CPU compatibility layer only off CUDA)
    assert "nemo_d3s.backends.megatron.cpu_compat" in GRAPH["nemo_d3s.backends.megatron.build"]
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


def test_every_package_has_its_row():
    # a new package states what it may import (docs/architecture.md's table is this dict)
    assert {_layer(m) for m in MODULES if m != "nemo_d3s"} - set(ALLOWED) == set()


def _without_parentheses(text: str) -> str:
    while True:
        bare = re.sub(r"\([^()]*\)", "", text)
        if bare == text:
            return bare
        text = bare


def _documented_table(doc: str) -> Dict[str, Set[str]]:
    """docs/architecture.md's import table: package -> the nemo_d3s packages its second column
    names in backticks outside parentheses (``nothing``: none), the package itself added."""
    lines = doc.splitlines()
    head = lines.index(
        "| package | imports from nemo_d3s | outside packages it uses | must not import |"
    )
    table: Dict[str, Set[str]] = {}
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        (name,) = re.findall(r"`([\w/.]+)`", _without_parentheses(cells[0]))
        pkg = name.removesuffix(".py").removesuffix("/")
        assert pkg not in table, f"two rows for {pkg}"
        names = set(re.findall(r"`(\w+)`", _without_parentheses(cells[1])))
        assert names or cells[1] == "nothing", line
        table[pkg] = names | {pkg}
    return table


def test_the_documented_table_is_allowed():
    # docs/architecture.md's table states ALLOWED row by row (a package may import itself)
    doc = (PKG.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = _documented_table(doc)
    assert sorted(table) == sorted(ALLOWED)
    assert {p: sorted(table[p]) for p in table} == {p: sorted(ALLOWED[p] | {p}) for p in ALLOWED}


def test_the_table_reader_reads_names_outside_parentheses():
    # guards the reader: a name in parentheses is prose, "nothing" is the empty row
    doc = (
        "| package | imports from nemo_d3s | outside packages it uses | must not import |\n"
        "|---|---|---|---|\n"
        "| `a.py` (about `x`) | nothing | | |\n"
        "| `b/` | `a`, `c` (the `d` of it (`e`)) | | |\n"
        "\n| `z/` | `a` | | |\n"
    )
    assert _documented_table(doc) == {"a": {"a"}, "b": {"a", "b", "c"}}


def _defined_private() -> Dict[str, Set[str]]:
    """Private name (one leading underscore) -> the modules that define it (functions,
    classes, assignments to names or attributes)."""
    out: Dict[str, Set[str]] = {}
    for m, p in MODULES.items():
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names: List[str] = []
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [n.name]
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    for x in ast.walk(t):
                        names += [x.id] if isinstance(x, ast.Name) else []
                        names += [x.attr] if isinstance(x, ast.Attribute) else []
            for name in names:
                if _private(name):
                    out.setdefault(name, set()).add(m)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_crossings(path: Path, me: str, defined: Dict[str, Set[str]]) -> List[str]:
    """Where the module at ``path`` reaches a private name of another nemo_d3s module: an
    import of a ``_name`` or of a ``_module``, or ``obj._name`` (obj not self / cls) of a
    private name this module does not define itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    bad: List[str] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parent = package.split(".")
                parent = parent[: len(parent) - (n.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            if not base.startswith("nemo_d3s"):
                continue
            for a in n.names:
                if _private(a.name) or any(_private(part) for part in base.split(".")):
                    bad.append(f"{me}:{n.lineno} imports {base}.{a.name}")
        elif isinstance(n, ast.Import):
            bad += [
                f"{me}:{n.lineno} imports {a.name}"
                for a in n.names
                if a.name.startswith("nemo_d3s") and any(_private(x) for x in a.name.split("."))
            ]
        elif isinstance(n, ast.Attribute) and _private(n.attr):
            owner = n.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if n.attr in defined and me not in defined[n.attr]:
                bad.append(f"{me}:{n.lineno} reaches {ast.unparse(n)} ({sorted(defined[n.attr])})")
    return bad


def test_no_private_name_crosses_a_module():
    # a name another module uses is a seam: public, with a docstring (ruff's PLC2701 refuses
    # private imports from other packages; this covers nemo_d3s's own modules)
    defined = _defined_private()
    bad = [b for m, p in MODULES.items() for b in _private_crossings(p, m, defined)]
    assert bad == []


def test_the_private_name_check_sees_each_kind_of_crossing(tmp_path):
    # guards the checker: an imported _name, an imported _module and obj._name all count
    src = tmp_path / "m.py"
    src.write_text(
        "from nemo_d3s.a import _f\nfrom nemo_d3s._b import g\nimport nemo_d3s._c\n"
        "def h(x):\n    self = x\n    return x._peer(), self._own()\n"
    )
    defined = {"_peer": {"nemo_d3s.other"}, "_own": {"nemo_d3s.other"}}
    bad = _private_crossings(src, "nemo_d3s.m", defined)
    assert [b.split(" ", 1)[1] for b in bad] == [
        "imports nemo_d3s.a._f",
        "imports nemo_d3s._b.g",
        "imports nemo_d3s._c",
        "reaches x._peer (['nemo_d3s.other'])",
    ]


def test_every_seam_has_a_docstring():
    # what one module imports from another (a function or class of the package) says in a line
    # what it is for
    defs: Dict[tuple, ast.AST] = {}
    for m, p in MODULES.items():
        for n in ast.parse(p.read_text(encoding="utf-8")).body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs[(m, n.name)] = n
    bare = set()
    for m, p in MODULES.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if not isinstance(n, ast.ImportFrom):
                continue
            base = n.module or ""
            if n.level:
                parent = package.split(".")
                parent = parent[: len(parent) - (n.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            for a in n.names:
                node = defs.get((base, a.name))
                if node is not None and base != m and ast.get_docstring(node) is None:
                    bare.add(f"{base}.{a.name}")
    assert sorted(bare) == []


MAX_DOCSTRING_SHARE = 0.15  # torchtitan, NeMo-RL, verl, TRL: 11-17% of their lines


def _docstring_lines(path: Path) -> int:
    n = 0
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                n += first.end_lineno - first.lineno + 1
    return n


def test_docstrings_stay_a_minor_share_of_the_package():
    # module docstrings say what a module is for and its contract; history belongs in git
    doc = sum(_docstring_lines(p) for p in MODULES.values())
    total = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in MODULES.values())
    assert doc / total <= MAX_DOCSTRING_SHARE, f"{doc} of {total} lines are docstrings"
