"""A default pretraining corpus that needs no download: the docstrings of Python's standard library.

`default_corpus(cache_dir)` returns a ~1.4 MB UTF-8 text file (Python 3.11): every module,
class, function, method and property docstring of the stdlib's public modules and their
submodules, in sorted order, one document per docstring, documents separated by a blank line
(blank lines inside a docstring are dropped, so `tokenize_to_indexed` sees exactly one
document per docstring). Duplicate docstrings are kept once.

The text is built in a fresh `python -I -S` process, which sees only the standard library and
none of the caller's imports, so it is identical on every machine with the same Python build.
The file is cached under `cache_dir`, keyed by the Python version.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

# Bump when the text produced changes, so cached files of the old kind are not reused.
CORPUS_VERSION = 1

# Modules with import side effects (open a browser, print, touch the terminal or GUI, write
# grammar caches, enable site-packages) or that exist only on Windows.
_EXCLUDED = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "readline", "site",
    "lib2to3", "distutils", "ensurepip", "encodings", "pydoc_data",
    "msilib", "msvcrt", "nt", "winreg", "winsound",
})


def default_corpus(cache_dir: str | os.PathLike) -> Path:
    """Path of the stdlib-docstring corpus under `cache_dir`, building it first if absent."""
    cache_dir = Path(cache_dir)
    version = ".".join(map(str, sys.version_info[:3]))
    path = cache_dir / f"stdlib-docstrings-v{CORPUS_VERSION}-{sys.implementation.name}{version}.txt"
    if path.is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        result = subprocess.run([sys.executable, "-I", "-S", __file__, str(tmp)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"building the default corpus failed (exit {result.returncode}):\n{result.stderr}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _import_quietly(name: str):
    """The module, or None when it cannot be imported here (platform-specific, optional C parts)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return importlib.import_module(name)
        except Exception:
            return None


def _walk(name: str):
    """The module `name` and, for a package, its public non-test submodules, in sorted order."""
    module = _import_quietly(name)
    if module is None:
        return
    yield module
    if hasattr(module, "__path__"):
        for info in sorted(pkgutil.iter_modules(module.__path__), key=lambda m: m.name):
            # `__main__` submodules run programs on import; tests are not prose.
            if not info.name.startswith("_") and "test" not in info.name:
                yield from _walk(f"{name}.{info.name}")


def _docstrings(module):
    """Docstrings defined in `module`: its own, then each class (with its members) and function, by name."""
    yield module.__doc__
    for name, obj in sorted(vars(module).items()):
        if getattr(obj, "__module__", None) != module.__name__:
            continue  # imported from elsewhere: documented where it is defined
        if inspect.isclass(obj):
            yield obj.__doc__
            for _, member in sorted(vars(obj).items()):
                if isinstance(member, (classmethod, staticmethod)):
                    member = member.__func__
                if inspect.isroutine(member) or inspect.isdatadescriptor(member):
                    yield member.__doc__
        elif inspect.isroutine(obj):
            yield obj.__doc__


def build_corpus_text() -> str:
    seen: set[str] = set()
    documents: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules warn on import or attribute access
        for top in sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _EXCLUDED):
            for module in _walk(top):
                for doc in _docstrings(module):
                    if not isinstance(doc, str):
                        continue
                    lines = (line.rstrip() for line in inspect.cleandoc(doc).splitlines())
                    text = "\n".join(line for line in lines if line)
                    if text and text not in seen:
                        seen.add(text)
                        documents.append(text)
    return "\n\n".join(documents) + "\n"


if __name__ == "__main__":  # run by default_corpus() in an isolated interpreter
    Path(sys.argv[1]).write_text(build_corpus_text(), encoding="utf-8")
