"""The import graph of the tree (parsed with ``ast``, nothing imported): no import circles, no
arrow from a lower layer to a higher one, no service importing another.

Every import counts: module level, function-local and ``if TYPE_CHECKING:`` ones alike.
Layers, lowest first (``LAYERS``; a module belongs to its longest listed prefix):

0. engine base: ``specdec`` (package), ``specdec.config``, ``specdec.errors``, ``specdec.engine_api``
1. engine layers: ``specdec.kv``, ``specdec.sample``, ``specdec.dataplane``
2. models: ``specdec.models`` and ``specdec.loader`` (its entry points under a short name)
3. workers: ``specdec.engine`` (model runner, target and draft workers)
4. engine backends: ``specdec.vllm_backend``
5. wire and service runtime: ``minedraft.v1`` (generated protos), ``minedraft.serving``,
   ``minedraft.telemetry``
6. engine-service scaffolding: ``engine_svc``
7. services: ``drafter_svc``, ``verifier_svc``, ``coordinator``, ``gateway`` (none imports another)
8. tools above the engine and the control plane: ``distill``, ``reference``
9. entry points: the rest of ``minedraft`` (CLI, launcher, stack), ``bench``, ``scripts``, ``tests``
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS: tuple[tuple[str, ...], ...] = (
    ("specdec", "specdec.config", "specdec.errors", "specdec.engine_api"),
    ("specdec.kv", "specdec.sample", "specdec.dataplane"),
    ("specdec.models", "specdec.loader"),
    ("specdec.engine",),
    ("specdec.vllm_backend",),
    ("minedraft.v1", "minedraft.serving", "minedraft.telemetry"),
    ("engine_svc",),
    ("drafter_svc", "verifier_svc", "coordinator", "gateway"),
    ("distill", "reference"),
    ("minedraft", "bench", "scripts", "tests"),
)
SERVICES = ("drafter_svc", "verifier_svc", "coordinator", "gateway")
TOP_PACKAGES = tuple(sorted({prefix.split(".")[0] for layer in LAYERS for prefix in layer}))
SKIP_DIRS = {"__pycache__", "results"}


def find_modules(root: str, packages=TOP_PACKAGES) -> dict[str, str]:
    """Dotted module name -> file path, for every ``.py`` file under ``packages``."""
    modules = {}
    for top in packages:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
            for name in filenames:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].replace(os.sep, ".")
                    modules[rel.removesuffix(".__init__")] = os.path.join(dirpath, name)
    return modules


def _resolve(name: str, modules: dict[str, str]) -> str | None:
    """The project module ``name`` refers to (its longest known prefix), or None (third party)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(node: ast.AST, module: str, is_package: bool, modules: dict[str, str]) -> list[str]:
    """The dotted names one import statement reaches: ``from p import m`` reaches the module
    ``p.m`` when there is one, else ``p`` (a name defined in ``p``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        parts = (module if is_package else module.rpartition(".")[0]).split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def import_graph(root: str, packages=TOP_PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in the file)."""
    modules = find_modules(root, packages)
    graph = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        is_package = path.endswith("__init__.py")
        targets = {_resolve(name, modules) for node in ast.walk(tree)
                   for name in _imported_names(node, module, is_package, modules)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
                    if len(component) > 1:
                        cycles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return cycles


def layer_of(module: str) -> int | None:
    """Index in ``LAYERS`` of the longest prefix ``module`` falls under (None: unlisted)."""
    best, best_len = None, -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
            for m in sorted(graph) for t in sorted(graph[m]) if layer_of(t) > layer_of(m)]


def cross_service_imports(graph: dict[str, set[str]]) -> list[str]:
    top = lambda name: name.split(".")[0]  # noqa: E731
    return [f"{m} imports {t}" for m in sorted(graph) for t in sorted(graph[m])
            if top(m) in SERVICES and top(t) in SERVICES and top(m) != top(t)]


def test_no_import_circles():
    assert find_cycles(import_graph(ROOT)) == []


def test_every_module_has_a_layer():
    assert [m for m in import_graph(ROOT) if layer_of(m) is None] == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    assert upward_imports(import_graph(ROOT)) == []


def test_no_service_imports_another():
    assert cross_service_imports(import_graph(ROOT)) == []


def test_the_checks_catch_a_circle_an_upward_arrow_and_a_service_import(tmp_path):
    files = {
        "specdec/__init__.py": "",
        "specdec/kv/__init__.py": "",
        "specdec/kv/a.py": "from specdec.kv import b\n",
        "specdec/kv/b.py": "def f():\n    from specdec.kv.a import x\n",                 # a <-> b
        "specdec/sample/__init__.py": "",
        "specdec/sample/s.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import coordinator.x\n",
        "coordinator/__init__.py": "",
        "coordinator/x.py": "from gateway import y\n",                                     # service -> service
        "gateway/__init__.py": "",
        "gateway/y.py": "from . import z\n",
        "gateway/z.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(str(tmp_path))
    assert graph["gateway.y"] == {"gateway.z"}
    assert find_cycles(graph) == [["specdec.kv.a", "specdec.kv.b"]]
    assert upward_imports(graph) == ["specdec.sample.s (layer 1) imports coordinator.x (layer 7)"]
    assert cross_service_imports(graph) == ["coordinator.x imports gateway.y"]
