"""The tree shows the architecture: one package per concern, imports flowing one way.

Read from the source (``ast``), so an import inside a function counts as much as one at the top.
The order is the one ``tensorpar/__init__.py`` states.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tensorpar

ROOT = Path(tensorpar.__file__).parent
CORE = {"runtime", "parallel", "transformer"}
# what each package may import besides itself; command-line modules sit on top of all of them
MAY_IMPORT = {
    "runtime": set(),
    "parallel": {"runtime"},
    "transformer": {"runtime", "parallel"},
    "checkpoint": CORE,
    "plan": CORE,
    "scale": CORE,
    "gpt": CORE | {"checkpoint", "plan", "scale"},
    "hf": CORE | {"checkpoint", "plan", "scale", "gpt"},
    "bench": CORE | {"checkpoint", "plan", "scale", "gpt", "hf"},
}
ENTRY = {"__init__.py", "__main__.py", "cli.py"}  # the only files at the top of the package


def _is_cli(path: Path) -> bool:
    return path.name in ("cli.py", "bench_cli.py", "__main__.py")


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
        if _is_cli(path):
            continue
        wrong = _imports(path) - MAY_IMPORT[package] - {package}
        assert not wrong, (f"{path.relative_to(ROOT)} ({package}) imports {sorted(wrong)}; "
                           f"it may import {sorted(MAY_IMPORT[package])}")


def test_every_package_states_its_place():
    for package in MAY_IMPORT:
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), \
            f"tensorpar/{package}/__init__.py: say what it imports"


def test_entry_files_stay_small():
    for name in ENTRY:
        lines = len((ROOT / name).read_text().splitlines())
        assert lines <= 300, f"tensorpar/{name}: {lines} lines"


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_folders_and_files_stay_small(package):
    modules = [p for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= 12, f"tensorpar/{package}: {len(modules)} modules"
    for p in modules:
        lines = len(p.read_text().splitlines())
        assert lines <= 300, f"{p.relative_to(ROOT)}: {lines} lines"


def test_import_tensorpar_loads_torch_only():
    """``import tensorpar`` and every public name: no rich, matplotlib, transformers or
    safetensors (a fresh interpreter, so the other tests' imports do not count)."""
    code = ("import sys, tensorpar\n"
            "[getattr(tensorpar, n) for n in tensorpar.__all__]\n"
            "print(sorted(m for m in ('rich', 'matplotlib', 'transformers', 'safetensors',"
            " 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
