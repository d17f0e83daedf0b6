"""specdec_ext's modules import one another without a cycle: a layer only imports the layers below it, so that
any module can be imported (and read) without the ones above it.

The graph is read from the source with ast, nothing is imported. Its nodes are the package's .py files: a module
`specdec_ext/a/b.py` is `specdec_ext.a.b`, a package's `__init__.py` is a node of its own named after the package
(`specdec_ext.a`). Every import statement counts, wherever it is (inside a function or an `if TYPE_CHECKING:` as
well: a lazy import is still a dependency). Edges:
- `import a.b.c`: to `a.b.c` only. Python runs `a/__init__` and `a/b/__init__` first, but importing a submodule is
  not counted as an edge to its packages' `__init__`s: that would make every `__init__` that imports its own
  submodules (as most do, to re-export them) a cycle.
- `from p import name` (relative ones resolved against the importing module's package): to `p.name` where `p.name`
  is a module (a .py file, a package or a compiled extension), else to `p` (its `__init__`); `from p import *` to `p`.
Only edges to the package's own .py modules are kept (third-party modules and compiled extensions import nothing of
it), and a module importing from itself is not an edge."""
import ast
import importlib.machinery
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "specdec_ext"
PACKAGE = PACKAGE_DIR.name


def module_files(package_dir: Path = PACKAGE_DIR) -> dict:
    """{module name: file} of every .py file under package_dir (a package's __init__.py named after the package)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def is_module(name: str, modules: dict, package_dir: Path = PACKAGE_DIR) -> bool:
    """Whether `name` names a module of the package: one of its .py files, or a compiled extension file next to
    them (specdec_ext._C, which `from . import _C` imports)."""
    if name in modules:
        return True
    parts = name.split(".")
    if parts[0] != package_dir.name:
        return False
    folder = package_dir.parent.joinpath(*parts[:-1])
    return any((folder / (parts[-1] + suffix)).is_file() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def imported_modules(name: str, path: Path, modules: dict, package_dir: Path = PACKAGE_DIR) -> list:
    """[(imported module name, line)] of every import statement in the module's file (see the module docstring)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:  # `from ..x import y` in package a.b.c: a.b.x (one level is the package itself)
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                imported = full if alias.name != "*" and is_module(full, modules, package_dir) else base
                found.append((imported, node.lineno))
    return found


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict:
    """{module: {imported module: first line that imports it}} over the package's own modules."""
    modules = module_files(package_dir)
    graph = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for target, line in imported_modules(name, path, modules, package_dir):
            if target in modules and target != name:
                edges.setdefault(target, line)
    return graph


def strongly_connected(graph: dict) -> list:
    """The strongly connected components of more than one module (each sorted), by Tarjan's algorithm (iterative:
    no recursion limit)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
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
                        components.append(sorted(component))
    return components


def one_cycle(graph: dict, component: list) -> list:
    """A shortest cycle through the component's first module, as [m0, m1, ..., m0] (breadth-first within it)."""
    start, members = component[0], set(component)
    parents, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node]):
                if succ == start:
                    cycle = [node]
                    while parents[cycle[-1]] is not None:
                        cycle.append(parents[cycle[-1]])
                    return [start, *reversed(cycle[:-1]), start] if len(cycle) > 1 else [start, node, start]
                if succ in members and succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def describe(graph: dict, component: list) -> str:
    """The component's cycle and every edge within it, with the file and line of the import."""
    modules = module_files()
    cycle = one_cycle(graph, component)
    lines = [" -> ".join(cycle), "  imports within it:"]
    for source in component:
        for target, line in sorted(graph[source].items()):
            if target in component:
                where = modules[source].relative_to(PACKAGE_DIR.parent)
                lines.append(f"    {source} -> {target}  ({where}:{line})")
    return "\n".join(lines)


def test_the_package_imports_without_a_cycle():
    graph = import_graph()
    assert len(graph) > 20 and f"{PACKAGE}.ops" in graph[PACKAGE]  # the walk found the package and its edges
    components = strongly_connected(graph)
    assert not components, "import cycles:\n" + "\n".join(describe(graph, c) for c in components)


def test_the_graph_follows_the_documented_rules(tmp_path):
    """A small package with one import of each kind, and a cycle planted in it, found and described."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\nimport pkg.sub.c\n",
        "a.py": "def f():\n    from . import b, A_NAME\n    from .sub import *\n",
        "b.py": "import os\nfrom pkg.sub import c as renamed\nfrom .b import itself\n",
        "sub/__init__.py": "",
        "sub/c.py": "from .. import a\nfrom ..sub import d\n",
        "sub/d.py": "from ..b import B\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph == {"pkg": {"pkg.a": 1, "pkg.sub.c": 2}, "pkg.a": {"pkg.b": 2, "pkg": 2, "pkg.sub": 3},
                     "pkg.b": {"pkg.sub.c": 2}, "pkg.sub": {}, "pkg.sub.c": {"pkg.a": 1, "pkg.sub.d": 2},
                     "pkg.sub.d": {"pkg.b": 1}}
    assert strongly_connected(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.sub.c", "pkg.sub.d"]]
    assert one_cycle(graph, ["pkg", "pkg.a", "pkg.b", "pkg.sub.c", "pkg.sub.d"]) == ["pkg", "pkg.a", "pkg"]
