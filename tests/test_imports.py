"""The house's import rules (docs/architecture.md, issue 25): no import circle, lazy imports
included; a vendor backend imports neither the registry nor another backend (tools and
SparseMLA choose backends, a backend never builds another); no package file over 600 lines
outside the Triton kernels."""

from __future__ import annotations

from house_stats import KERNELS, MAX_LINES, circles, import_graph, line_counts

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


def test_the_import_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "dsv4_attn.common.registry" in graph["dsv4_attn.api"]  # from .common import registry
    assert "dsv4_attn.portable.kernels.indices" in graph["dsv4_attn.api"]  # inside _make_front_end


def test_no_package_file_over_600_lines_outside_the_kernels():
    big = {f: n for f, n in line_counts().items() if n > MAX_LINES and not f.startswith(KERNELS)}
    assert not big, big
