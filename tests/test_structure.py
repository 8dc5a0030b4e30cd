"""The repository keeps the structure design.md §7 describes: the rules are checked here, on the sources.

- No import cycles among the package's modules, imports inside functions included. The graph is built from every
  module's source with `ast`: relative imports are resolved, `from P import x` is an edge to the submodule `P.x`
  when there is one and to `P` otherwise, imports under `if TYPE_CHECKING:` are left out (they never run), and
  the implicit import of a module's parent packages adds no edge (a package's `__init__` is a node of its own).
  The lazy root (`__getattr__` and `importlib`) adds no edge either: that is its point.
- `hf/` is the only room that imports Transformers. Two public tools beside the rooms also do, because what they
  do is about Transformers models: `embedded_models.py` loads them (`AutoModelForCausalLM`, inside its loaders)
  and `fidelity.py` compares a cache with `DynamicCache` (at module level). They are leaves: no module of the
  package imports them, so importing the cache or any room never imports them. Every other module imports
  Transformers nowhere, not even inside a function.
- `core/`, `ops/`, `stores/`, `quant/` and `policies/` import each other only (and the leaf modules `paths` and
  `version`); of other packages, torch, plus `safetensors` (the quantiser's grid cache) and `cuda` (the kernel
  loader's `cuda-python`). The kernel ops import without Transformers, checked in a fresh interpreter.
- The package root is lazy (PEP 562): `import shadowkv_cache` loads only the root and its version.
- Comments, docstrings and the Markdown beside the code cite design.md's sections (which must exist), never the
  documents that preceded it, nor text files that are not in the repository.
- No module of the package is over 350 lines.
- Tests that load a real model's weights are marked `slow`, so that `make test-fast` leaves them out.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import shadowkv_cache

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "shadowkv_cache"
MAX_MODULE_LINES = 350

# Rooms that must not know models: they import each other, these leaf modules and these packages only.
LOWER_ROOMS = ("core", "ops", "stores", "quant", "policies")
LEAF_MODULES = ("shadowkv_cache.paths", "shadowkv_cache.version")
LOWER_ROOM_PACKAGES = {"torch", "safetensors", "cuda"}
# Public tools beside the rooms that import Transformers (see the module docstring).
TRANSFORMERS_TOOLS = ("shadowkv_cache.embedded_models", "shadowkv_cache.fidelity")

# Folders whose comments, docstrings and Markdown must not cite what lies outside the repository.
DOC_FOLDERS = ("src", "tests", "benchmarks", "examples", "kernels")
FORBIDDEN_CITATIONS = (
    re.compile(r"\bSPEC\b"),  # the specification design.md replaced
    re.compile(r"\bseeds?/"),  # the folder of the documents the project started from
)
TEXT_FILE = re.compile(r"[\w./-]*\w\.txt\b")
DESIGN_SECTION = re.compile(r"design\.md §(\d+)")
DOC_SUFFIXES = (".py", ".cu", ".cuh", ".md")

# Fixtures and functions that load real weights (SmolLM2, Gemma 3 270M).
REAL_MODEL_LOADERS = {"load_smollm2", "load_gemma3_270m"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def in_room(name: str, *rooms: str) -> bool:
    return any(name == f"shadowkv_cache.{r}" or name.startswith(f"shadowkv_cache.{r}.") for r in rooms)


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


class ImportCollector(ast.NodeVisitor):
    """Every import statement that can run: `(node, inside a function)`, without `if TYPE_CHECKING:` bodies."""

    def __init__(self):
        self.found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
        self.depth = 0

    def visit_If(self, node: ast.If) -> None:
        if ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self.depth > 0))


@functools.cache
def imports_of(name: str) -> tuple[tuple[str, bool], ...]:
    """`(absolute name, inside a function)` of what module `name` imports: for `from P import x`, `P.x`."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    collector = ImportCollector()
    collector.visit(parsed(path))
    found = []
    for node, nested in collector.found:
        if isinstance(node, ast.Import):
            found += [(alias.name, nested) for alias in node.names]
            continue
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module
        found += [(f"{base}.{alias.name}", nested) for alias in node.names]
    return tuple(found)


def package_edges(name: str) -> set[str]:
    """Modules of the package that module `name` imports (a submodule when one is named, else its parent)."""
    edges = set()
    for target, _ in imports_of(name):
        while target and target not in MODULES:
            target = target.rpartition(".")[0]  # `from P import f` names P.f, which is not a module: P
        if target and target != name:
            edges.add(target)
    return edges


def external_imports(name: str) -> set[tuple[str, bool]]:
    """Top-level names of the other packages module `name` imports, with whether the import is in a function."""
    return {
        (target.partition(".")[0], nested)
        for target, nested in imports_of(name)
        if not target.startswith("shadowkv_cache")
    }


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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


def cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One import cycle inside a strongly connected component, as `a -> b -> ... -> a`."""
    members = set(component)
    path, seen = [component[0]], {component[0]: 0}
    while True:
        nxt = min(m for m in graph[path[-1]] if m in members)
        if nxt in seen:
            return [*path[seen[nxt] :], nxt]
        seen[nxt] = len(path)
        path.append(nxt)


def test_the_import_graph_is_built_from_every_module():
    """The graph sees the package's real imports (a guard against a checker that would find nothing)."""
    graph = {name: package_edges(name) for name in MODULES}
    assert len(graph) >= 50
    assert "shadowkv_cache.ops.loader" in graph["shadowkv_cache.ops.temporal_scan"]  # from .loader import ...
    assert "shadowkv_cache.prefix" in graph["shadowkv_cache.hf.cache"]  # from .. import prefix
    assert "shadowkv_cache.hf.microbatch" in graph["shadowkv_cache.hf.cache"]  # from . import microbatch
    assert "shadowkv_cache.hf.cache" not in graph["shadowkv_cache"]  # the lazy root imports it on first use
    assert not any(edge.startswith("shadowkv_cache.hf") for edge in graph["shadowkv_cache"])
    assert ("torch", False) in external_imports("shadowkv_cache.ops.temporal_scan")
    assert ("transformers", True) in external_imports("shadowkv_cache.embedded_models")  # inside its loaders


def test_no_import_cycles():
    graph = {name: package_edges(name) for name in MODULES}
    cycles = [" -> ".join(cycle_through(c, graph)) for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(cycles)


def test_only_hf_and_the_model_tools_import_transformers():
    offenders = sorted(
        f"{name} ({'inside a function' if nested else 'module level'})"
        for name in MODULES
        if not in_room(name, "hf") and name not in TRANSFORMERS_TOOLS
        for package, nested in external_imports(name)
        if package == "transformers"
    )
    assert not offenders, f"only hf/ imports Transformers (design.md §7); also: {offenders}"
    importers = sorted(name for name in MODULES for edge in package_edges(name) if edge in TRANSFORMERS_TOOLS)
    assert not importers, f"{TRANSFORMERS_TOOLS} are public tools, not parts of the package; imported by {importers}"


def test_the_lower_rooms_import_each_other_and_torch_only():
    wrong = []
    for name in MODULES:
        if not in_room(name, *LOWER_ROOMS):
            continue
        wrong += [f"{name} -> {e}" for e in package_edges(name) if not (in_room(e, *LOWER_ROOMS) or e in LEAF_MODULES)]
        wrong += [
            f"{name} -> {p}"
            for p, _ in external_imports(name)
            if p not in sys.stdlib_module_names and p not in LOWER_ROOM_PACKAGES
        ]
    assert not wrong, "core/, ops/, stores/, quant/ and policies/ import torch and each other only:\n" + "\n".join(
        sorted(wrong)
    )


def run_python(code: str) -> dict:
    """Run `code` in a fresh interpreter that imports this process's `shadowkv_cache`; returns its JSON line."""
    source = str(Path(shadowkv_cache.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_kernel_ops_and_lower_rooms_import_without_transformers():
    names = [name for name in MODULES if in_room(name, *LOWER_ROOMS)]
    assert "shadowkv_cache.ops.temporal_scan" in names and "shadowkv_cache.policies.quantized_keys" in names
    code = f"""
import importlib, json, sys
pulled = []
for name in {names!r}:
    importlib.import_module(name)
    if "transformers" in sys.modules and not pulled:
        pulled.append(name)
print(json.dumps({{"first_to_import_transformers": pulled, "loaded": sorted(sys.modules)}}))
"""
    result = run_python(code)
    assert result["first_to_import_transformers"] == []
    assert set(names) <= set(result["loaded"])


def test_the_package_root_is_lazy():
    code = """
import json, sys
import shadowkv_cache
own = sorted(m for m in sys.modules if m.split(".")[0] == "shadowkv_cache")
transformers_at_import = "transformers" in sys.modules
cache = shadowkv_cache.ShadowKVCache
from transformers import Cache
print(json.dumps({
    "own": own,
    "transformers_at_import": transformers_at_import,
    "is_cache": issubclass(cache, Cache),
    "missing": [n for n in shadowkv_cache.__all__ if getattr(shadowkv_cache, n, None) is None],
    "in_dir": "ShadowKVCache" in dir(shadowkv_cache),
}))
"""
    result = run_python(code)
    assert result["own"] == ["shadowkv_cache", "shadowkv_cache.version"]
    assert result["transformers_at_import"] is False
    assert result["is_cache"] and result["in_dir"]
    assert result["missing"] == []


def documentation_files() -> list[Path]:
    """The Python, CUDA and Markdown files of `DOC_FOLDERS`, each once (src/shadowkv_cache/kernels is a link)."""
    found = {p.resolve() for folder in DOC_FOLDERS for p in (ROOT / folder).rglob("*") if p.suffix in DOC_SUFFIXES}
    return sorted(found)


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """`(line, text)` of each comment and docstring of a Python or CUDA file; all of a Markdown file."""
    text = path.read_text()
    if path.suffix == ".md":
        return list(enumerate(text.splitlines(), start=1))
    if path.suffix in (".cu", ".cuh"):
        return [(text.count("\n", 0, m.start()) + 1, m.group()) for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S)]
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def repository_text_files() -> set[str]:
    names = set()
    for _, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "build")]
        names |= {f for f in files if f.endswith(".txt")}
    return names


def test_documentation_cites_only_what_the_repository_holds():
    design = ROOT / "docs" / "design.md"
    assert design.is_file()
    sections = {int(n) for n in re.findall(r"^## (\d+)\.", design.read_text(), re.M)}
    text_files = repository_text_files()
    files = documentation_files()
    assert any(p.suffix == ".cu" for p in files) and any(p.name == "test_structure.py" for p in files)
    wrong = []
    for path in files:
        for line, text in comments_and_docstrings(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            wrong += [f"{where}: {m.group()!r}" for pattern in FORBIDDEN_CITATIONS for m in pattern.finditer(text)]
            wrong += [
                f"{where}: {m.group()!r} is not in the repository"
                for m in TEXT_FILE.finditer(text)
                if m.group().rpartition("/")[2] not in text_files
            ]
            wrong += [f"{where}: design.md has no §{n}" for n in DESIGN_SECTION.findall(text) if int(n) not in sections]
    assert not wrong, "\n".join(wrong)


def test_no_module_is_over_350_lines():
    lengths = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in (ROOT / "src").rglob("*.py")}
    assert lengths
    long = {str(p): n for p, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def marks_slow(decorators: list[ast.expr]) -> bool:
    return any("pytest.mark.slow" in ast.unparse(d) for d in decorators)


def loaders_called(node: ast.AST) -> set[str]:
    """Real-model loaders that `node` names, except under `with pytest.raises(...)` (a call meant to fail)."""
    if isinstance(node, ast.With) and any("pytest.raises" in ast.unparse(item.context_expr) for item in node.items):
        return set()
    own = {node.id} if isinstance(node, ast.Name) else {node.attr} if isinstance(node, ast.Attribute) else set()
    return (own & REAL_MODEL_LOADERS).union(*(loaders_called(child) for child in ast.iter_child_nodes(node)))


def fixtures_of(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any("pytest.fixture" in ast.unparse(d) for d in node.decorator_list)
    }


def test_tests_that_load_real_weights_are_marked_slow():
    """A test loads real weights when it, or a fixture it asks for at any depth, calls a real-model loader (other
    than under `pytest.raises`: a loader that must fail before it reads anything)."""
    tests = ROOT / "tests"
    conftest = fixtures_of(parsed(tests / "conftest.py"))
    unmarked = []
    for path in sorted(tests.glob("test_*.py")):
        tree = parsed(path)
        fixtures = {**conftest, **fixtures_of(tree)}
        loading = set()
        while True:  # fixtures that load, directly or through the fixtures they ask for
            more = {
                name
                for name, node in fixtures.items()
                if loaders_called(node) or {a.arg for a in node.args.args} & loading
            }
            if more <= loading:
                break
            loading |= more
        module_slow = any(
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            and "pytest.mark.slow" in ast.unparse(node.value)
            for node in tree.body
        )
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            loads = loaders_called(node) or {a.arg for a in node.args.args} & loading
            if loads and not (module_slow or marks_slow(node.decorator_list)):
                unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, f"load real weights but are not marked slow: {unmarked}"


def test_the_real_model_loaders_keep_their_names():
    """The check above knows the loaders by name: they must still be `embedded_models`' functions."""
    defined = {node.name for node in parsed(PACKAGE / "embedded_models.py").body if isinstance(node, ast.FunctionDef)}
    assert REAL_MODEL_LOADERS <= defined
