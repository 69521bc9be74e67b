"""The tree shows the architecture: one package per concern, imports flowing one way.

Read from the source (``ast``), so an import inside a function counts as much as one at the top.
The order is the one ``tensorpar/__init__.py`` states.
"""

import ast
import subprocess
import sys
from pathlib import Path

import tensorpar

ROOT = Path(tensorpar.__file__).parent
CORE = {"runtime", "parallel", "transformer"}
# what each package may import besides itself, in the order of tensorpar/__init__.py
MAY_IMPORT = {
    "runtime": set(),
    "parallel": {"runtime"},
    "transformer": {"runtime", "parallel"},
    "ranks": {"runtime"},
    "data": {"runtime"},
    "checkpoint": CORE,
    "planner": CORE,
    "mesh": CORE | {"ranks"},
    "gpt": CORE | {"data", "checkpoint"},
    "hf": CORE | {"ranks", "data", "checkpoint", "planner", "mesh"},
    "train": CORE | {"ranks", "data", "checkpoint", "planner", "mesh", "gpt", "hf"},
    "bench": CORE | {"ranks", "data", "checkpoint", "planner", "mesh", "gpt", "hf", "train"},
    "cli": CORE | {"ranks", "data", "checkpoint", "planner", "mesh", "gpt", "hf", "train", "bench"},
}
ENTRY = {"__init__.py", "__main__.py"}  # the only files at the top of the package


def _imports(path: Path) -> set[str]:
    """The tensorpar packages a file imports (``tensorpar.parallel.linear`` -> ``parallel``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; name the package")
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "tensorpar":
                if len(parts) == 1:  # "from tensorpar import x": the entry package
                    found.add("tensorpar")
                else:
                    found.add(parts[1])
    return found


def _package_files():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if len(rel.parts) > 1:
            yield rel.parts[0], path


def test_top_holds_only_the_entry_files_and_the_packages():
    loose = {p.name for p in ROOT.glob("*.py")} - ENTRY
    assert not loose, f"modules at the top of tensorpar/: {sorted(loose)}"
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(MAY_IMPORT), packages ^ set(MAY_IMPORT)


def test_core_imports_nothing_from_the_other_packages():
    for package, path in _package_files():
        if package in CORE:
            above = _imports(path) - CORE
            assert not above, f"{path.relative_to(ROOT)} (core) imports {sorted(above)}"


def test_imports_flow_one_way():
    for package, path in _package_files():
        if path.name == "__main__.py":  # python -m tensorpar.bench: a command line
            continue
        wrong = _imports(path) - MAY_IMPORT[package] - {package}
        assert not wrong, (f"{path.relative_to(ROOT)} ({package}) imports {sorted(wrong)}; "
                           f"it may import {sorted(MAY_IMPORT[package])}")


def _module_of(name: str) -> str | None:
    """``tensorpar.cli.verify`` (or a name in it) -> the module's file relative to ``ROOT``."""
    parts = name.split(".")[1:]
    while parts:
        for rel in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
            if (ROOT / rel).is_file():
                return rel
        parts = parts[:-1]
    return None


def _module_imports(path: Path) -> set[str]:
    """The tensorpar modules a file imports, at the top or in a function, by an import statement
    or ``importlib.import_module`` of a literal name (``from tensorpar.a import b`` is ``a/b.py``
    when b is a module, else ``a.py`` or ``a/__init__.py``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant):
            names = [str(node.args[0].value)]  # importlib.import_module("tensorpar.bench.x")
        else:
            continue
        found |= {m for n in names if n.startswith("tensorpar.") and (m := _module_of(n))}
    return found


def test_no_import_circle_between_modules():
    """No module imports (directly or through others) a module that imports it back."""
    graph = {str(p.relative_to(ROOT)): _module_imports(p) for p in sorted(ROOT.rglob("*.py"))}
    done: set[str] = set()
    circles: list[str] = []

    def visit(module: str, path: list[str]) -> None:  # depth first; a module met again on the
        if module in path:                             # path it started is a circle
            circles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        for other in sorted(graph.get(module, ()) - {module}):
            visit(other, path + [module])
        done.add(module)

    for module in graph:
        visit(module, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_every_package_states_its_place():
    for package in MAY_IMPORT:
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), \
            f"tensorpar/{package}/__init__.py: say what it imports"


def test_import_tensorpar_loads_torch_only():
    """``import tensorpar`` and every public name: no rich, matplotlib, transformers or
    safetensors (a fresh interpreter, so the other tests' imports do not count). The command
    line's parser, which every ``tensorpar`` command builds first, loads no DTensor either (it
    brings sympy: 0.7 s of every command's start)."""
    code = ("import sys, tensorpar\n"
            "[getattr(tensorpar, n) for n in tensorpar.__all__]\n"
            "print(sorted(m for m in ('rich', 'matplotlib', 'transformers', 'safetensors',"
            " 'accelerate') if m in sys.modules))\n"
            "from tensorpar.cli.main import build_parser\n"
            "build_parser()\n"
            "print(sorted(m for m in ('torch.distributed.tensor', 'sympy', 'transformers')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["[]", "[]"], out.stdout


# what the layers must never load: starting ranks, signal handling, failure reports, check mode
APPLICATION = ("tensorpar.ranks", "tensorpar.train", "tensorpar.cli", "tensorpar.checkpoint",
               "tensorpar.planner", "tensorpar.hf", "tensorpar.gpt", "tensorpar.mesh",
               "tensorpar.data")


def test_the_layers_load_no_application_module():
    """A fresh ``import tensorpar.parallel`` with every layer and block module loads the ground
    floor (``tensorpar.runtime``: groups, seeds, counting, asserts, DTensor checks) and nothing of
    launching, stopping, failure reporting or the check mode; nor does ``signal`` get a handler."""
    layers = [f"tensorpar.{p}.{m.stem}" for p in ("parallel", "transformer")
              for m in sorted((ROOT / p).glob("*.py")) if m.stem != "__init__"]
    code = ("import signal, sys\n"
            "before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}\n"
            f"import {', '.join(layers)}\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('tensorpar.'))\n"
            "print(loaded)\n"
            "print([s for s, h in before.items() if signal.getsignal(s) is not h])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    loaded, changed = eval(out[0]), eval(out[1])
    assert any(m.startswith("tensorpar.runtime.groups") for m in loaded)
    above = [m for m in loaded if m.startswith(APPLICATION)]
    assert not above, f"the layers load {above}"
    assert not changed, changed
