"""The one report writer of the benchmarks: results (JSON, CSV), markdown tables, plots, docs sections."""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "benchmarks.md"
DOCS_IMAGES = ROOT / "docs" / "benchmarks"
TITLE = "# Benchmarks: the ZeRO++ paper's tables on an emulated cluster"


def fmt(value, spec: str) -> str:
    if value is None or value == "":
        return "–"
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def md_table(rows: list[dict], columns: list[tuple[str, str, str]], align: str | None = None) -> list[str]:
    """Markdown table lines; `columns` = (key, header, format spec), `align` = l, r or c per column (default: the
    first left, the others right); missing values show '–', a failed row (ok False) its error."""
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    lines = [row_line(h for _, h, _ in columns), row_line(rule[a] for a in align or "l" + "r" * (len(columns) - 1))]
    for r in rows:
        cells = [fmt(r.get(k), f) for k, _, f in columns]
        if not r.get("ok", True):
            cells = cells[:2] + [f"failed: {str(r.get('error', '?'))[:160]}"] + [""] * (len(columns) - 3)
        lines.append(row_line(cells))
    return lines


def row_line(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, indent=1, default=str))  # default=str: paths, dtypes
    return path


def write_results(result: dict, out_dir: Path, name: str) -> list[Path]:
    """<name>.json (everything) and <name>.csv (the rows, scalar columns only)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [write_json(out_dir / f"{name}.json", result)]
    rows = result.get("rows") or []
    if rows:
        keys = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (list, dict))))
        paths.append(out_dir / f"{name}.csv")
        with open(paths[1], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return paths


def machine_info() -> dict:
    import torch

    def read(path, pattern):
        try:
            return re.search(pattern, Path(path).read_text(), re.M).group(1)
        except (OSError, AttributeError):
            return None

    try:
        from importlib.metadata import version

        deepspeed = version("deepspeed")
    except Exception:
        deepspeed = None
    mem = read("/proc/meminfo", r"^MemTotal:\s+(\d+)")
    return {"cpu": read("/proc/cpuinfo", r"^model name\s*:\s*(.+)$") or platform.processor() or "?",
            "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "kernel": platform.release(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "deepspeed": deepspeed, "memory_gib": round(int(mem) / 2**20, 1) if mem else "?"}


def machine_line(info: dict) -> str:
    return (f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, Linux {info['kernel']}, "
            f"Python {info['python']}, torch {info['torch']}, DeepSpeed {info['deepspeed'] or 'not installed'}; "
            f"load average at the start {info['load_average'][0]}")


# ---------------------------------------------------------------- plots


def pyplot():
    """matplotlib.pyplot on the Agg backend (ImportError without matplotlib: the caller notes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out_dir: Path, name: str) -> Path:
    path = Path(out_dir) / "plots" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def bars(ax, groups: list[str], series: dict[str, list], horizontal: bool = False, labels: dict | None = None):
    """Grouped bars: one group per entry of `groups`, one bar per series in each (None: no bar);
    `labels[series]` = texts written on that series' bars."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + i * width for x in range(len(groups))]
        ys = [v or 0 for v in values]
        (ax.barh if horizontal else ax.bar)(xs, ys, width, label=name)
        for x, y, text in zip(xs, ys, (labels or {}).get(name, [])):
            if text:
                ax.text(x, y, text, ha="center", va="bottom", fontsize=8)
    ticks = [x + width * (len(series) - 1) / 2 for x in range(len(groups))]
    if horizontal:
        ax.set_yticks(ticks, groups, fontsize=7)
        ax.invert_yaxis()
    else:
        ax.set_xticks(ticks, groups, fontsize=8)
    ax.legend(fontsize=8)


def bar_chart(out_dir: Path, name: str, groups: list[str], series: dict[str, list], title: str, ylabel: str = "",
              xlabel: str = "", figsize=(8, 4), horizontal: bool = False, labels: dict | None = None,
              line_at: float | None = None) -> Path:
    """A figure of grouped bars (see bars), saved as plots/<name>.png; line_at: a dashed horizontal line."""
    fig, ax = pyplot().subplots(figsize=figsize)
    bars(ax, groups, series, horizontal, labels)
    if line_at is not None:
        ax.axhline(line_at, color="k", lw=0.8, ls="--")
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    return save(fig, out_dir, name)


def time_columns(kinds: list[str]) -> list[tuple[str, str, str]]:
    """md_table columns of where a step's time goes: the runtime's timings ("<kind> ms"), then the rest."""
    return [(f"{k} ms", f"{k} ms", "{:.0f}") for k in kinds] + [("rest ms", "rest (compute, other) ms", "{:.0f}")]


def time_bars(ax, rows: list[dict], kinds: list[str], names: list[str], xlabel: str, fontsize: int = 8):
    """Horizontal stacked bars, one per row: where its step time goes (its "<kind> ms", then "rest ms")."""
    left = [0.0] * len(rows)
    for kind in [*kinds, "rest"]:
        ax.barh(range(len(rows)), values := [max(0.0, r.get(f"{kind} ms", 0.0)) for r in rows], left=left, label=kind)
        left = [a + b for a, b in zip(left, values)]
    ax.set_yticks(range(len(rows)), names, fontsize=fontsize)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=7)


def curves(ax, lines: dict[str, list[tuple]], xlabel: str, ylabel: str, **style):
    for name, points in lines.items():
        ax.plot(*zip(*points), label=name, **style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


# ---------------------------------------------------------------- docs


def section(name: str, body: str) -> str:
    return f"<!-- section:{name} -->\n{body.rstrip()}\n<!-- /section:{name} -->\n"


def copy_images(pngs: list[Path]) -> dict[str, str]:
    """Copy plots into docs/benchmarks/; stem -> path relative to docs/ (for the markdown)."""
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
    for p in pngs:
        shutil.copy2(p, DOCS_IMAGES / p.name)
    return {p.stem: f"benchmarks/{p.name}" for p in pngs}


def stamp(result: dict, machine: dict | None = None) -> str:
    """When, where and how a result was made (`machine`: for results saved without theirs, e.g. a suite's)."""
    return (f"_{result['date'][:10]}, {machine_line(result.get('machine') or machine)}. "
            f"Command: `{result['command']}`._")


def update_docs_section(docs: Path, name: str, body: str, heading: str) -> None:
    """Replace one benchmark's section of a docs page (the marked block), or append it under `heading`."""
    new = section(name, body)
    text = docs.read_text() if docs.is_file() else f"{TITLE}\n\n"
    marked = re.compile(rf"<!-- section:{name} -->.*?<!-- /section:{name} -->\n?", re.S)
    text = marked.sub(lambda _: new, text) if marked.search(text) else f"{text.rstrip()}\n\n{heading}\n\n{new}"
    docs.write_text(text)
