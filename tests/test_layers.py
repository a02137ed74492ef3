"""The layering of docs/architecture.md, checked on the source: a layer imports only from layers below.

Every `import` / `from ... import` of every .py file is found with `ast` at any depth (a function-local
import hides a cycle from the module's top but not from this test), relative imports resolved.

    entry points (train.py, finetune.py, rlhf.py), scripts/    may import any package, never tests/
    rlhf/       trainer, zeropp, export and below
    export/     trainer, zeropp and below
    trainer/    zeropp and below
    zeropp/     models, data, kernels
    models/, data/, kernels/    the bottom: independent of each other (each imports only itself)

    python tests/test_layers.py    prints every upward import and their count
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package -> its layer; a package may import itself and packages of a lower layer (not of its own).
LAYERS = {"models": 0, "data": 0, "kernels": 0, "zeropp": 1, "trainer": 2, "export": 3, "rlhf": 4}
TOP = 5  # the entry points and scripts/: above every package
ENTRY_POINTS = ("train.py", "finetune.py", "rlhf.py")
NEVER = {"tests"}  # no non-test code imports the test suite


def imported(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, top-level name) of every import in `tree`, at any depth; `package`: the file's dotted package."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the file's package
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in parts + [node.module or ""] if p)
                out.append((node.lineno, base.split(".")[0]))
            else:
                out.append((node.lineno, node.module.split(".")[0]))
    return sorted(out)


def sources(root: Path) -> list[tuple[Path, str]]:
    """(file, its top-level package or '' for an entry point) of the code the layering covers."""
    files = [(root / name, "") for name in ENTRY_POINTS if (root / name).is_file()]
    for package in (*LAYERS, "scripts"):
        files.extend((path, package) for path in sorted((root / package).rglob("*.py")))
    return files


def upward_imports(root: Path = ROOT) -> list[str]:
    """'file:line imports X' for every import that goes up (or sideways into another bottom package, or into tests)."""
    found = []
    for path, package in sources(root):
        rank = LAYERS.get(package, TOP)
        rel = path.relative_to(root)
        dotted = ".".join(rel.with_suffix("").parts[:-1]) if package else ""
        for line, name in imported(ast.parse(path.read_text(), str(path)), dotted):
            if name in NEVER:
                found.append(f"{rel}:{line} imports {name} (the test suite)")
            elif name in LAYERS and name != package and LAYERS[name] >= rank:
                found.append(f"{rel}:{line} imports {name} (layer {LAYERS[name]}, its own is {rank})")
    return found


def test_no_upward_import():
    bad = upward_imports()
    assert not bad, "imports against the layering of docs/architecture.md:\n" + "\n".join(bad)


def test_hidden_upward_imports_are_found(tmp_path):
    """Function-local and relative imports count: trainer/loop.py importing export/ inside a function fails."""
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "loop.py").write_text(
        "from trainer.config import Config\nfrom . import checkpoint\n\n\ndef build():\n    if True:\n"
        "        from export.peft import load_peft_adapter\n        from ..rlhf import common\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "check.py").write_text("import export, rlhf, trainer\nfrom tests.kernels import x\n")
    assert upward_imports(tmp_path) == ["trainer/loop.py:7 imports export (layer 3, its own is 2)",
                                        "trainer/loop.py:8 imports rlhf (layer 4, its own is 2)",
                                        "scripts/check.py:2 imports tests (the test suite)"]


if __name__ == "__main__":
    bad = upward_imports()
    print("\n".join(bad))
    print(f"{len(bad)} upward imports")
    sys.exit(1 if bad else 0)
