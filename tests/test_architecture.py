"""Architecture rules of the ``hybrid`` package, checked from the source text alone.

* No import cycles: the module import graph of ``hybrid/`` and ``model_zoo/``
  (built from the AST of every ``.py`` file, imports under ``if TYPE_CHECKING:``
  included) has no strongly connected component of more than one module and no
  module importing itself.
* ``hybrid.config`` stands alone: it imports only ``hybrid.config.*`` and the
  plain-data modules of :data:`PLAIN_DATA` (``hybrid.layout``, ``hybrid.grid``,
  ``model_zoo.config``, ...; they import only each other), and never torch, so
  configuration files can be checked without the training stack.
* ZeRO stages are defined once: the tuple ``(0, 1, 2, 3)`` appears nowhere (the
  :class:`hybrid.layout.ZeroStage` enum defines it), the offload rule
  (``offload_problem``) is written once, and the packages that reason about
  stages read :data:`hybrid.layout.STAGE_TRAITS` instead of comparing stage
  numbers.
* Every command line parses with :class:`hybrid.argument_parser.ArgumentParser`,
  whose usage errors are one line: no ``argparse.ArgumentParser(`` in
  ``hybrid/``, ``tools/`` or ``benchmarks/`` outside that module, except
  ``benchmarks/gpu/results.py`` (``run_all.sh`` runs it before torch is
  installed, with arguments it writes itself).

Nothing is imported or executed: the rules hold for the files as written.

The import graph counts module-level and function-level imports alike (a
function-level import is still a dependency; it merely runs later), and those
under ``if TYPE_CHECKING:`` too: they never run, but a module that names
another's types depends on it as much, and a cycle of them is a cycle in the
design (:func:`imports_of` leaves them out only when asked for what runs).
``from hybrid.x import y``
is an edge to ``hybrid.x.y`` when that is a module, else to ``hybrid.x``;
importing a package is an edge to its ``__init__`` (the package's own node).
Imports made through ``importlib`` with computed names (the lazy exports of
``hybrid/__init__.py`` and ``hybrid/data/__init__.py``) are not seen.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hybrid"
PACKAGE_DIR = ROOT / PACKAGE
# The packages whose modules form one import graph: model_zoo builds on hybrid and hybrid's trainer and
# checkpoints read model_zoo, so a cycle can run through both.
GRAPH_PACKAGES = (PACKAGE, "model_zoo")


# ---- the module graph ------------------------------------------------------------------

def module_name(path: Path) -> str:
    """``hybrid/a/b.py`` -> ``hybrid.a.b``; ``hybrid/a/__init__.py`` -> ``hybrid.a``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(packages: Tuple[str, ...] = (PACKAGE,)) -> Dict[str, Path]:
    """Every module of ``packages`` (by default ``hybrid``), by dotted name."""
    return {module_name(p): p for package in packages for p in sorted((ROOT / package).rglob("*.py"))}


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement's target module, as written (before resolving submodules)."""

    target: str
    names: Tuple[str, ...]  # the names of a ``from target import ...``; () for ``import target``
    line: int


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST, type_checking: bool = False) -> Iterator[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (their ``else`` still runs);
    ``type_checking``: those bodies too."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _package_of(module: str, path: Path) -> str:
    """The package a relative import in ``module`` starts from (a package is its own)."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imports_of(module: str, path: Path, type_checking: bool = False) -> List[Import]:
    """The imports that run in ``path`` (any nesting depth), with relative ones made absolute;
    ``type_checking``: also those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in _runtime_nodes(tree, type_checking):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = _package_of(module, path).split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append(Import(base, tuple(a.name for a in node.names), node.lineno))
    return found


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def import_graph(files: Dict[str, Path], type_checking: bool = False) -> Dict[str, List[Edge]]:
    """Module -> its edges to the other modules of ``files`` (of their top-level packages);
    ``type_checking``: imports under ``if TYPE_CHECKING:`` are edges too."""
    roots = {module.split(".")[0] for module in files}
    graph: Dict[str, List[Edge]] = {}
    for module, path in files.items():
        edges = []
        for imp in imports_of(module, path, type_checking):
            if imp.target.split(".")[0] not in roots:
                continue
            targets = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in files]
            if len(targets) < len(imp.names) or not imp.names:
                targets.append(imp.target)  # some names are attributes of the module (or package) itself
            edges += [Edge(module, t, imp.line) for t in targets if t in files]
        graph[module] = edges
    return graph


def strongly_connected(graph: Dict[str, List[Edge]]) -> List[List[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    components: List[List[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted({e.target for e in graph[root]})))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted({e.target for e in graph[child]}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def shortest_cycle(graph: Dict[str, List[Edge]], start: str, within: Set[str]) -> List[Edge]:
    """The shortest chain of imports from ``start`` back to itself, inside ``within``."""
    previous: Dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in graph[node]:
                if edge.target not in within:
                    continue
                if edge.target == start:
                    chain = [edge]
                    while chain[0].source != start:
                        chain.insert(0, previous[chain[0].source])
                    return chain
                if edge.target not in previous:
                    previous[edge.target] = edge
                    following.append(edge.target)
        frontier = following
    return []


def find_cycles(graph: Dict[str, List[Edge]]) -> List[Tuple[List[str], List[Edge]]]:
    """Each cyclic component (members, one shortest cycle through its first member)."""
    found = []
    for component in strongly_connected(graph):
        self_loop = any(e.target == component[0] for e in graph[component[0]])
        if len(component) > 1 or self_loop:
            found.append((component, shortest_cycle(graph, component[0], set(component))))
    return found


def describe_cycle(members: List[str], chain: List[Edge], files: Dict[str, Path]) -> str:
    steps = "\n".join(f"    {e.source} -> {e.target}   ({files[e.source].relative_to(ROOT)}:{e.line})"
                      for e in chain)
    return f"  cycle among {len(members)} module(s): {', '.join(members)}\n  for example:\n{steps}"


# ---- the tests -------------------------------------------------------------------------

def test_cycle_finder_sees_what_it_must():
    """The finder's own rules, on a made-up graph: a 3-cycle, a self-import, and an acyclic tail."""
    graph = {m: [] for m in "abcdef"}
    for s, t in (("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("e", "e"), ("d", "f")):
        graph[s].append(Edge(s, t, 1))
    cycles = find_cycles(graph)
    assert sorted(members for members, _ in cycles) == [["a", "b", "c"], ["e"]]
    chains = {tuple(members): [(e.source, e.target) for e in chain] for members, chain in cycles}
    assert chains[("a", "b", "c")] == [("a", "b"), ("b", "c"), ("c", "a")]
    assert chains[("e",)] == [("e", "e")]


def test_imports_are_resolved_as_python_runs_them(tmp_path):
    """Relative imports, submodules named in ``from`` imports, and TYPE_CHECKING blocks."""
    code = ("from typing import TYPE_CHECKING\n"
            "from . import sibling\n"
            "from .sibling import thing\n"
            "from hybrid.pkg import sibling as s2, CONSTANT\n"
            "if TYPE_CHECKING:\n"
            "    from hybrid.other import Hidden\n"
            "else:\n"
            "    import hybrid.shown\n"
            "def f():\n"
            "    from ..top import x\n")
    path = tmp_path / "mod.py"
    path.write_text(code)
    found = [(i.target, i.names) for i in imports_of("hybrid.pkg.mod", path)]
    assert sorted(found) == sorted([
        ("typing", ("TYPE_CHECKING",)), ("hybrid.pkg", ("sibling",)), ("hybrid.pkg.sibling", ("thing",)),
        ("hybrid.pkg", ("sibling", "CONSTANT")), ("hybrid.shown", ()), ("hybrid.top", ("x",))])
    files = {"hybrid.pkg.mod": path, "hybrid.pkg": path, "hybrid.pkg.sibling": path, "hybrid.shown": path,
             "hybrid.top": path}
    targets = sorted({e.target for e in import_graph(files)["hybrid.pkg.mod"]})
    # "sibling" resolves to the submodule; CONSTANT to the package; the TYPE_CHECKING import is absent.
    assert targets == ["hybrid.pkg", "hybrid.pkg.sibling", "hybrid.shown", "hybrid.top"]


def test_type_checking_imports_are_edges_when_asked(tmp_path):
    """The cycle test's graph counts what ``if TYPE_CHECKING:`` imports: a type-level dependency is one."""
    path = tmp_path / "mod.py"
    path.write_text("from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n"
                    "    from model_zoo.other import Hidden\n"
                    "    import hybrid.typed\n")
    files = {"hybrid.pkg.mod": path, "model_zoo.other": path, "hybrid.typed": path}
    assert import_graph(files)["hybrid.pkg.mod"] == []
    targets = sorted(e.target for e in import_graph(files, type_checking=True)["hybrid.pkg.mod"])
    assert targets == ["hybrid.typed", "model_zoo.other"]


def test_the_graph_spans_both_packages():
    """Edges run both ways between hybrid and model_zoo, so a cycle through the two would be seen."""
    graph = import_graph(source_files(GRAPH_PACKAGES), type_checking=True)
    crossing = {(e.source.split(".")[0], e.target.split(".")[0]) for edges in graph.values() for e in edges}
    assert {("hybrid", "model_zoo"), ("model_zoo", "hybrid")} <= crossing


def test_no_import_cycles():
    """No cycle among the modules of hybrid/ and model_zoo/, imports under ``if TYPE_CHECKING:`` included."""
    files = source_files(GRAPH_PACKAGES)
    cycles = find_cycles(import_graph(files, type_checking=True))
    report = "\n".join(describe_cycle(members, chain, files) for members, chain in cycles)
    where = " and ".join(f"{p}/" for p in GRAPH_PACKAGES)
    if cycles:
        print(f"{len(cycles)} import cycle(s) in {where}:\n{report}")
    assert not cycles, f"import cycles in {where}, type-level ones included (break each by moving the shared " \
                       f"piece into a module both sides can import, or by passing a narrower object):\n{report}"


# Modules of plain data and rules (no torch): what configuration code may read besides itself.
PLAIN_DATA = ("hybrid.layout", "hybrid.compression", "hybrid.argument_parser", "hybrid.tokenizer_files", "hybrid.grid",
              "hybrid.tp_units", "model_zoo.config", "model_zoo.presets")


def _imports_outside(prefixes, allowed):
    """Imports of torch, hybrid or model_zoo, by the modules under ``prefixes``, of anything not under ``allowed``."""
    bad = []
    for module, path in source_files(GRAPH_PACKAGES).items():
        if not any(module == p or module.startswith(p + ".") for p in prefixes):
            continue
        for imp in imports_of(module, path):
            if imp.target.split(".")[0] not in GRAPH_PACKAGES + ("torch",):
                continue
            if not any(imp.target == a or imp.target.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)}:{imp.line} imports {imp.target}")
    return bad


def test_config_depends_only_on_itself_and_plain_data():
    bad = _imports_outside(("hybrid.config",), ("hybrid.config",) + PLAIN_DATA)
    assert not bad, f"hybrid.config may import only hybrid.config.* and {', '.join(PLAIN_DATA)} (no torch, no " \
                    "other part of hybrid):\n  " + "\n  ".join(bad)
    bad = _imports_outside(PLAIN_DATA, PLAIN_DATA)
    assert not bad, "the plain-data modules may import only each other (no torch):\n  " + "\n  ".join(bad)


def _literal_sequences(tree: ast.AST) -> Iterator[ast.expr]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            yield node


def _int_values(node: ast.expr) -> Optional[Tuple[int, ...]]:
    values = []
    for elt in node.elts:
        if not (isinstance(elt, ast.Constant) and type(elt.value) is int):
            return None
        values.append(elt.value)
    return tuple(values)


def test_zero_stages_are_enumerated_only_by_the_enum():
    """No module restates the list of stages (``(0, 1, 2, 3)``): iterate ``ZeroStage`` instead."""
    bad = []
    for path in source_files().values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _literal_sequences(tree):
            if _int_values(node) == (0, 1, 2, 3):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "the ZeRO stages (0, 1, 2, 3) are restated; use hybrid.layout.ZeroStage / ZERO_STAGES:\n  " \
                    + "\n  ".join(bad)


def test_offload_rule_is_defined_once():
    definitions = []
    for path in source_files().values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        definitions += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(tree)
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "offload_problem"]
    assert len(definitions) == 1 and definitions[0].startswith("hybrid/layout.py:"), \
        f"offload_problem must be defined exactly once, in hybrid/layout.py; found: {definitions}"


# A stage compared with a number: ``stage == 0``, ``zero_stage > 0``, ``stage in (1, 2)``, ``stage not in (0,)``.
STAGE_COMPARISON = re.compile(r"stage\s*(==|!=|<=|>=|<|>|not\s+in|in)\s*[\(\[\{]?\s*\d")


def code_without_strings_and_comments(text: str) -> str:
    """``text`` with comments and string literals (docstrings too) blanked, lines kept where they were."""
    lines = text.splitlines(keepends=True)
    blank = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in blank:
            continue
        (row, col), (end_row, end_col) = tok.start, tok.end
        for r in range(row, end_row + 1):
            line = lines[r - 1]
            lo = col if r == row else 0
            hi = end_col if r == end_row else len(line.rstrip("\r\n"))
            lines[r - 1] = line[:lo] + " " * (hi - lo) + line[hi:]
    return "".join(lines)


def test_stage_comparison_pattern():
    hits = ["stage == 0", "zero_stage > 0", "cfg.stage in (1, 2)", "stage not in (0, 1, 2)", "self.stage>=1"]
    misses = ["stage == ZeroStage.DISABLED", "traits.optimizer_states", "# stage == 3", "stage_count == n"]
    assert all(STAGE_COMPARISON.search(code_without_strings_and_comments(h)) for h in hits)
    assert not any(STAGE_COMPARISON.search(code_without_strings_and_comments(m)) for m in misses)


@pytest.mark.parametrize("package", ["hybrid/engine", "hybrid/plan", "hybrid/checkpoint", "hybrid/convert"])
def test_no_literal_stage_comparisons(package):
    """These packages ask STAGE_TRAITS what a stage partitions rather than comparing stage numbers."""
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        code = code_without_strings_and_comments(path.read_text(encoding="utf-8"))
        for lineno, line in enumerate(code.splitlines(), 1):
            if STAGE_COMPARISON.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not bad, "literal ZeRO stage comparisons (use hybrid.layout.STAGE_TRAITS / ZeroStage):\n  " \
                    + "\n  ".join(bad)


# The command-line folders, and the one script run before torch is installed (it imports only the standard library).
COMMAND_DIRS = ("hybrid", "tools", "benchmarks")
BEFORE_INSTALL = "benchmarks/gpu/results.py"
PARSER_MODULE = "hybrid/argument_parser.py"


def test_every_command_line_uses_the_one_line_parser():
    bad = []
    for folder in COMMAND_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in (PARSER_MODULE, BEFORE_INSTALL):
                continue
            code = code_without_strings_and_comments(path.read_text(encoding="utf-8"))
            bad += [f"{rel}:{n}" for n, line in enumerate(code.splitlines(), 1) if "argparse.ArgumentParser(" in line]
    assert not bad, "use hybrid.argument_parser.ArgumentParser (usage errors in one line), not argparse's:\n  " \
                    + "\n  ".join(bad)


# The page that maps the layers; every path it names in backticks must exist.
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
DOC_PATH = re.compile(r"`((?:hybrid|model_zoo|tests|tools|benchmarks|docs|launch_scripts)/[\w/.\-]*)`")


def test_the_architecture_page_names_only_paths_that_exist():
    named = sorted(set(DOC_PATH.findall(ARCHITECTURE_DOC.read_text(encoding="utf-8"))))
    assert len(named) > 20, "the pattern no longer finds the page's paths"
    missing = [p for p in named if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names paths that do not exist (moved or renamed?): {missing}"
