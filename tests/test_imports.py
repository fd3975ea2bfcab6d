"""The house's import rules (docs/architecture.md, issue 25): no import circle, lazy imports
included; a vendor backend imports neither the registry nor another backend (tools and
SparseMLA choose backends, a backend never builds another); no package file over 600 lines
outside the Triton kernels; a test module imports the tests' kit, the package and third-party
modules only, never another test module."""

from __future__ import annotations

import ast
from pathlib import Path

from kit.house_stats import KERNELS, MAX_LINES, circles, import_graph, line_counts

TESTS = Path(__file__).resolve().parent

# the backend modules the registry ships (common/registry.py _REGISTRY), and what else they may
# not import: the registry, tools, engines
BACKENDS = {"dsv4_attn.portable.torch_backend", "dsv4_attn.portable.triton_backend", "dsv4_attn.cuda.flashmla",
            "dsv4_attn.cuda.flashinfer", "dsv4_attn.rocm.aiter"}
NOT_FOR_BACKENDS = {"dsv4_attn.common.registry", "dsv4_attn.api", "dsv4_attn.parity", "dsv4_attn.bench",
                    "dsv4_attn.integrations", "dsv4_attn.probe_cli", "dsv4_attn.cli"}


def test_the_package_has_no_import_circle():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_backend_imports_the_registry_or_another_backend():
    graph = import_graph()
    for backend in BACKENDS:
        reached, todo = set(), [backend]
        while todo:  # what it imports, directly or through its own helpers (rocm/scratch.py ...)
            for nxt in graph[todo.pop()] - reached:
                reached.add(nxt)
                if nxt not in BACKENDS:
                    todo.append(nxt)
        wrong = {m for m in reached if m in BACKENDS - {backend}
                 or any(m == n or m.startswith(n + ".") for n in NOT_FOR_BACKENDS)}
        assert not wrong, f"{backend} imports {sorted(wrong)}"


def test_the_shared_step_builder_imports_torch_and_common_only():
    """dsv4_attn.testing serves the tests, parity and the bench from a wheel: vendor-free like common/."""
    graph = import_graph()
    for module in (m for m in graph if m == "dsv4_attn.testing" or m.startswith("dsv4_attn.testing.")):
        wrong = {m for m in graph[module] if not m.startswith(("dsv4_attn.common", "dsv4_attn.testing"))}
        assert not wrong, f"{module} imports {sorted(wrong)}"
    assert "dsv4_attn.testing.steps" in graph["dsv4_attn.parity.inputs"]


def test_the_import_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "dsv4_attn.common.registry" in graph["dsv4_attn.api"]  # from .common import registry
    assert "dsv4_attn.portable.kernels.indices" in graph["dsv4_attn.api"]  # inside _make_front_end


def test_no_package_file_over_600_lines_outside_the_kernels():
    big = {f: n for f, n in line_counts().items() if n > MAX_LINES and not f.startswith(KERNELS)}
    assert not big, big


def _top_level_imports(path: Path) -> set[str]:
    """The first name of every absolute import in a file, lazy ones inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_test_modules_import_only_the_kit_the_package_and_third_party_modules():
    """Helpers two test modules share live in tests/kit/ (or the package's dsv4_attn.testing): no
    test module, kit module or GPU script imports a test module, conftest or another file of
    tests/ outside the kit."""
    beside = {p.stem for p in TESTS.glob("*.py")} | {p.name for p in TESTS.iterdir() if p.is_dir()}
    beside -= {"kit"}
    files = [*TESTS.glob("*.py"), *TESTS.glob("kit/*.py"), *TESTS.glob("gpu_scripts/*.py"),
             *TESTS.glob("vllm_env/*.py"), *TESTS.glob("sglang_env/*.py")]
    assert len(files) > 40 and "conftest" in beside and "test_aiter" in beside
    wrong = {f"{f.relative_to(TESTS)} imports {sorted(names)}" for f in files
             if (names := _top_level_imports(f) & beside)}
    assert not wrong, sorted(wrong)


# engines and vendor libraries that CI's main run does not install: their own jobs (ci/vllm-tests.sh,
# ci/sglang-tests.sh, a GPU / ROCm machine) import them; dsv41_kv_quant_reference is a file of an
# SGLang source checkout (tests/data/make_kv_records_golden.py)
NOT_INSTALLED_HERE = {"vllm", "sglang", "transformers", "aiter", "flashinfer", "flash_mla", "dsv41_kv_quant_reference"}
HOUSE = ("dsv4_attn", "kit")


def _imports(path: Path) -> set[tuple[str, str | None]]:
    """(module, imported name or None) for every absolute import in a file, lazy ones included."""
    found: set[tuple[str, str | None]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name, None) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found |= {(node.module, alias.name) for alias in node.names}
    return found


def _resolves(module: str, name: str | None) -> bool:
    """Whether `import module` / `from module import name` would work here; a GPU script's sibling
    (sys.path[0] when it runs) counts, so does tests/ (where pytest and the scripts put the kit)."""
    import importlib
    import importlib.machinery
    import importlib.util
    top = module.split(".")[0]
    if top not in HOUSE:
        return (importlib.util.find_spec(top) is not None
                or importlib.machinery.PathFinder.find_spec(top, [str(TESTS / "gpu_scripts")]) is not None)
    try:
        imported = importlib.import_module(module)
        return name is None or name == "*" or hasattr(imported, name) or \
            importlib.util.find_spec(f"{module}.{name}") is not None
    except ImportError:  # a module that is not there, or a name looked up as a submodule of a module
        return False


def test_every_import_in_tests_resolves():
    """A GPU-only test's lazy import runs on a GPU only: a name the house renamed or removed would
    fail there first (it did once: `from compare import` after the kit took compare.py in). Every
    import in tests/ must name a module that exists, and a house module's name must exist in it."""
    files = [*TESTS.glob("*.py"), *TESTS.glob("*/*.py")]
    wrong = sorted(f"{f.relative_to(TESTS)}: from {module} import {name}" for f in files
                   for module, name in _imports(f)
                   if module.split(".")[0] not in NOT_INSTALLED_HERE and not _resolves(module, name))
    assert not wrong, wrong
