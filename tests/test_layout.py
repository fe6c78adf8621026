"""The layout's rules, checked from the source (an AST walk; nothing is imported):

- dependencies run one way between the top-level folders: net -> core <- kernels,
  engine_build -> kernels -> core, bench and tokenwire/ (the wiring) above them all; net/
  never reaches kernels/ or engine_build/, and core/ imports no tensor library;
- no import cycles between modules;
- imports between the project's folders are relative;
- no imports inside functions, except optional dependencies (a package that is not a
  requirement in pyproject.toml: cuda-python, torch, ...) and the package root's lazy
  `tokenwire.Server` (PEP 562: `import tokenwire` and `tokenwire --help` stay cheap; the
  CLI's subcommands load through importlib, not import statements).
"""

import ast
import functools
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("core", "kernels", "net", "engine_build", "bench", "tokenwire")
# folder -> the project folders it may import (besides itself)
ALLOWED = {
    "core": set(),
    "kernels": {"core"},
    "net": {"core"},
    "engine_build": {"core", "kernels"},
    "bench": {"core", "kernels", "net", "engine_build", "tokenwire"},
    "tokenwire": {"core", "kernels", "net", "engine_build", "bench"},
}
TENSOR_LIBRARIES = {"numpy", "torch", "cupy", "cuda", "tensorrt", "onnx", "onnxruntime"}
LAZY_ALLOWED = {("tokenwire/__init__.py", "tokenwire.server")}
# distribution names in pyproject.toml -> the module they install, where the two differ
MODULE_OF = {"huggingface_hub": "huggingface_hub", "uvloop": "uvloop", "pyyaml": "yaml"}


def project_files():
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "build" not in path.relative_to(REPO).parts[1:2]:
                yield path


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "tokenwire":
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["tokenwire"] + parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def resolve(node: ast.ImportFrom, path: Path) -> list:
    """Absolute module names an ImportFrom refers to (the module, or its submodules when
    `from package import submodule`)."""
    if node.level == 0:
        base = node.module or ""
    else:
        pkg = module_name(path).split(".")
        if not is_package(path):
            pkg = pkg[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    submodules = [f"{base}.{alias.name}" for alias in node.names]
    known = project_modules() | extension_modules()
    if all(name in known for name in submodules):   # `from package import module, ...`
        return submodules
    return [base] + [name for name in submodules if name in known]


def imports(path: Path):
    """-> [(absolute module names, node, inside a function)] for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.append(([a.name for a in child.names], child, in_function))
            elif isinstance(child, ast.ImportFrom):
                found.append((resolve(child, path), child, in_function))
            visit(child, nested)
    visit(tree, False)
    return found


@functools.lru_cache(maxsize=1)
def extension_modules() -> frozenset:
    """The C extensions setup.py builds (`Extension("tokenwire....", ...)`)."""
    return frozenset(re.findall(r'Extension\("([\w.]+)"', (REPO / "setup.py").read_text()))


@functools.lru_cache(maxsize=1)
def project_modules() -> frozenset:
    return frozenset(module_name(p) for p in project_files())


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else "tokenwire"


def required_modules() -> set:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = set()
    for req in meta["dependencies"]:
        if ";" in req:                  # a platform's requirement (uvloop): optional elsewhere
            continue
        dist = req.split("[")[0]
        for sep in "<>=!~ ":
            dist = dist.split(sep)[0]
        dist = dist.strip().lower()
        names.add(MODULE_OF.get(dist, dist.replace("-", "_")))
    return names


def edges():
    """module -> set of project modules it imports at module level. Importing `a.b.c` runs
    the packages `a.b` and `a` first, unless they are the importer's own ancestors (already
    running), so those count as imported too."""
    known = project_modules()
    graph = {}
    for path in project_files():
        mod = module_name(path)
        ancestors = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        deps = graph.setdefault(mod, set())
        for names, _, in_function in imports(path):
            if in_function:
                continue
            for name in names:
                parts = name.split(".")
                for i in range(2, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in known and dep != mod and dep not in ancestors:
                        deps.add(dep)
    return graph


def test_folders_depend_one_way():
    bad = []
    known = project_modules()
    for path in project_files():
        mod = module_name(path)
        folder = folder_of(mod)
        for names, node, _ in imports(path):
            for name in names:
                if name in known and folder_of(name) not in ALLOWED[folder] | {folder}:
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert not bad, "imports against the direction net -> core <- kernels <- engine_build:\n" + "\n".join(bad)


def test_core_imports_no_tensor_library():
    bad = [f"{p.relative_to(REPO)}:{node.lineno} imports {names[0]}"
           for p in project_files() if folder_of(module_name(p)) == "core"
           for names, node, _ in imports(p) if names[0].split(".")[0] in TENSOR_LIBRARIES]
    assert not bad, "\n".join(bad)


def test_imports_between_folders_are_relative():
    bad = [f"{p.relative_to(REPO)}:{node.lineno}" for p in project_files() for _, node, _ in imports(p)
           if (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tokenwire")
           or (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tokenwire" for a in node.names))]
    assert not bad, "absolute imports of the project (write them relative):\n" + "\n".join(bad)


def test_no_imports_inside_functions_but_optional_dependencies():
    stdlib = set(sys.stdlib_module_names)
    required = required_modules()
    known = project_modules()
    bad = []
    for path in project_files():
        rel = path.relative_to(REPO).as_posix()
        for names, node, in_function in imports(path):
            if not in_function:
                continue
            top = names[0].split(".")[0]
            if names[0] in known or top == "tokenwire":
                if not any((rel, n) in LAZY_ALLOWED for n in names):
                    bad.append(f"{rel}:{node.lineno} imports {names[0]} inside a function")
            elif top in stdlib or top in required:
                bad.append(f"{rel}:{node.lineno} imports {names[0]} inside a function (not optional)")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = edges()
    cycles, state, stack = [], {}, []

    def walk(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                walk(dep)
        stack.pop()
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            walk(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_what_it_checks():
    """The walk finds the project's modules and their imports (a checker that reads
    nothing would pass everything)."""
    graph = edges()
    assert len(graph) > 80
    assert "tokenwire.core.engine_core" in graph["tokenwire.runtime"]
    assert "tokenwire.core.scheduler" in graph["tokenwire.core.engine_core"]
    assert folder_of("tokenwire.net.app") == "net" and folder_of("tokenwire.runtime") == "tokenwire"
