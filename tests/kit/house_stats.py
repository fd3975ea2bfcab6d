"""The house in numbers (issue 25's "Done when" table, docs/architecture.md): lines per module, the
package's import graph and its circles, mypy errors, the most complex functions.

    python tests/kit/house_stats.py        # from the repository root

The import graph counts every import of a package module, lazy ones inside functions included
(a lazy import is still an arrow: a circle is a missing module); tests/test_imports.py holds the
rules on it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dsv4_attn"
KERNELS = "dsv4_attn/portable/kernels/"  # Triton kernels: long by nature, outside the 600-line rule
MAX_LINES = 600


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> set[str]:
    """The package modules one import statement of module ``name`` (file ``path``) names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    base = node.module or ""
    if node.level:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    found = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known}
    if len(found) < len(node.names) and base in known:
        found.add(base)  # names defined in the module ``base`` itself
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package modules it imports (at its top or inside a function)."""
    known = modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(name, path, node, known)
        graph[name] = edges - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def line_counts(root: Path = ROOT) -> dict[str, int]:
    return {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in modules(root).values()}


def complexity(root: Path = ROOT, top: int = 8) -> list[tuple[int, str]]:
    """(McCabe complexity, "file:line function") of the most complex functions (ruff C901)."""
    run = subprocess.run([sys.executable, "-m", "ruff", "check", PACKAGE, "--select", "C901", "--config",
                          "lint.mccabe.max-complexity=0", "--output-format", "json", "--exit-zero"],
                         cwd=root, capture_output=True, text=True, check=True)
    found = []
    for item in json.loads(run.stdout):
        words = item["message"].split()  # "`name` is too complex (N > 0)"
        where = f"{Path(item['filename']).relative_to(root)}:{item['location']['row']} {words[0].strip('`')}"
        found.append((int(words[-3].strip("(")), where))
    return sorted(found, reverse=True)[:top]


def mypy_errors(root: Path = ROOT) -> str:
    """mypy's last line over the whole package ("Success: ..." or "Found N errors in M files ...")."""
    run = subprocess.run([sys.executable, "-m", "mypy", PACKAGE], cwd=root, capture_output=True, text=True)
    return run.stdout.strip().splitlines()[-1]


def main() -> None:
    counts = line_counts()
    big = {f: n for f, n in counts.items() if n > MAX_LINES and not f.startswith(KERNELS)}
    print(f"{len(counts)} modules, {sum(counts.values())} lines; over {MAX_LINES} outside the kernels: {big or 'none'}")
    print("largest:", ", ".join(f"{f} {n}" for f, n in sorted(counts.items(), key=lambda x: -x[1])[:8]))
    print("import circles:", circles(import_graph()) or "none")
    print("most complex functions:", ", ".join(f"{where} {c}" for c, where in complexity()))
    print("mypy dsv4_attn:", mypy_errors())


if __name__ == "__main__":
    main()
