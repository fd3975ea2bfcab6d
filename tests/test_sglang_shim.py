"""The SGLang 0.5.23 shim against the REAL sglang package (CPU, torch backend).

Run with ``bash ci/sglang-tests.sh`` (builds a venv with sglang 0.5.23 installed without its torch
pin); everywhere else this module skips with the reason. Exercised: SGLang's plugin loader with our
entry point, its ``--attention-backend`` choices and ``ServerArgs.resolve_once`` (the flag turns the plugin on),
its HookRegistry wrapping the DeepSeek-V4 backend factories, a real ``DeepSeekV4TokenToKVPool`` and
our subclass of SGLang's ``DeepseekV4AttnBackend`` built on the CPU, SGLang's own torch metadata
builders (page table, positions, causal SWA rows) and ``DSV4AttnMetadata``, and a decode and an
extend step through ``backend.forward`` against the float64 reference. The compressed rows (written
on GPUs by SGLang's Triton metadata kernel and its indexer, which Triton's CPU interpreter cannot
run) are written here from their definitions through SGLang's ``set_sparse_topk``. Not exercised:
SGLang's cache writers (CUDA kernels; the caches are filled with dsv4_attn's byte-exact writer),
a whole model, CUDA graphs.
"""

from __future__ import annotations

import os
import tomllib
import types
from pathlib import Path

import pytest
import torch

sglang = pytest.importorskip("sglang", reason="sglang is not importable here: run `bash ci/sglang-tests.sh` "
                                              "(docs/sglang.md) for the SGLang shim tests")

from dsv4_attn.common import layout, reference  # noqa: E402
from dsv4_attn.integrations import sglang as shim  # noqa: E402

from conftest import compare  # noqa: E402

if not shim.is_tested_version(sglang.__version__):
    pytest.skip(f"sglang {sglang.__version__} is installed; these tests target {shim.TESTED_SGLANG_VERSIONS}",
                allow_module_level=True)

from sglang.srt.layers.attention import deepseek_v4_backend as dsv4_backend  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[1]
TOPK, HEADS, PAGE, MAX_LEN = 32, 8, 256, 4096


@pytest.fixture(scope="module", autouse=True)
def runtime_context():
    """SGLang's process configuration, as a CPU server would publish it."""
    get_context().set_server_args(ServerArgs(model_path="/nonexistent/deepseek-v4", device="cpu"))


@pytest.fixture(autouse=True)
def plugin_off(monkeypatch):
    monkeypatch.delenv(shim.ENV_ENABLE, raising=False)
    monkeypatch.delenv("DSV4_ATTN_BACKEND", raising=False)
    monkeypatch.setitem(ATTENTION_BACKENDS, "dsv4", ATTENTION_BACKENDS["dsv4"])  # restored after each test


# ---- plugin loading, the flag, the version gate -------------------------------------------------------------
def test_plugin_loads_through_sglangs_loader(monkeypatch, tmp_path):
    from importlib.metadata import entry_points

    import sglang.srt.plugins as plugins
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention import deepseek_v4_trtllm_backend as factories

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    assert declared == {"dsv4_attn": "dsv4_attn.integrations.sglang:register"}
    if not any(ep.name == "dsv4_attn" for ep in entry_points(group="sglang.srt.plugins")):
        dist = tmp_path / "dsv4_attn_decl-0.dist-info"  # not pip-installed here: declare it as metadata would
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4-attn-decl\nVersion: 0\n")
        (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\ndsv4_attn = {declared['dsv4_attn']}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SGLANG_PLUGINS", "dsv4_attn")
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    plugins.load_plugins()
    assert shim.BACKEND_NAME in ATTENTION_BACKEND_CHOICES
    with pytest.raises(ValueError, match="dsv4_attn with DeepSeek-V4 / V4.1 models only"):
        ATTENTION_BACKENDS[shim.BACKEND_NAME](types.SimpleNamespace(model_config=types.SimpleNamespace(
            hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLM"]))))
    wrapped = factories.create_deepseek_v4_attn_backend
    assert wrapped.__wrapped__ is not wrapped and factories.create_deepseek_v4_multistep_backend.__wrapped__
    shim.register()  # idempotent
    shim.install_factory_hooks()
    assert factories.create_deepseek_v4_attn_backend is wrapped


def test_attention_backend_flag_turns_the_plugin_on(monkeypatch):
    shim.register()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()

    def resolve(**flags):  # what the launchers do before starting processes; no model here, so it fails after
        with pytest.raises(Exception) as err:
            ServerArgs(model_path="/nonexistent/deepseek-v4", device="cpu", **flags).resolve_once()
        return err.value

    resolve()
    assert os.environ.get(shim.ENV_ENABLE) is None  # without the flag: untouched
    resolve(attention_backend=shim.BACKEND_NAME)
    assert os.environ[shim.ENV_ENABLE] == "1" and shim.env_enabled()
    monkeypatch.setenv(shim.ENV_ENABLE, "0")
    err = resolve(attention_backend=shim.BACKEND_NAME)
    assert isinstance(err, ValueError) and "DSV4_ATTN_SGLANG: got '0' beside --attention-backend dsv4_attn" in str(err)


def test_other_sglang_versions_are_refused_at_backend_creation(monkeypatch):
    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    original = ATTENTION_BACKENDS["dsv4"]
    shim.register()  # opted out: leaves SGLang alone
    assert ATTENTION_BACKENDS["dsv4"] is original
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    shim.register()
    with pytest.raises(RuntimeError, match=r"got SGLang 0\.5\.24; allowed: 0\.5\.23"):
        ATTENTION_BACKENDS["dsv4"](object())
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.5.24")
    assert shim.status()["sglang plugin"] == "refused (SGLang 0.5.24; tested: 0.5.23)"


def test_status_reports_the_plugin_state(monkeypatch):
    assert shim.status()["sglang"] == sglang.__version__
    monkeypatch.setenv(shim.ENV_ENABLE, "maybe")
    if shim.status()["entry point"] == "installed":
        assert shim.status()["sglang plugin"].startswith("refused at engine start (DSV4_ATTN_SGLANG: got 'maybe'")


# ---- a real pool, SGLang's backend class, SGLang's metadata ----------------------------------------------------
def make_pool(ratios, kv_layout="v4", compressed=None):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=2048, c4_size=1024, c128_size=64, c4_state_pool_size=64, c128_state_pool_size=8,
        page_size=PAGE, swa_page_size=PAGE, dtype=torch.uint8, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
        layer_num=len(ratios), device="cpu", enable_memory_saver=False, compression_ratios=ratios,
        kv_layout=kv_layout, compressed_kv_layout=compressed)


def model_runner(pool, heads=HEADS):
    cfg = types.SimpleNamespace(model_type="deepseek_v4", index_topk=TOPK, num_attention_heads=heads)
    return types.SimpleNamespace(
        device="cpu", page_size=PAGE, token_to_kv_pool=pool, hisparse_coordinator=None, is_draft_worker=False,
        model_config=types.SimpleNamespace(context_len=MAX_LEN, head_dim=512, v_head_dim=512, hf_text_config=cfg),
        req_to_token_pool=types.SimpleNamespace(req_to_token=torch.zeros(5, MAX_LEN, dtype=torch.int32)),
        spec_algorithm=types.SimpleNamespace(is_dspark=lambda: False), server_args=get_context().server_args)


def test_factories_build_our_backend_only_when_enabled(monkeypatch):
    from sglang.srt.layers.attention import deepseek_v4_trtllm_backend as factories

    shim.install_factory_hooks()
    runner = model_runner(make_pool([0, 4, 128]))
    assert type(factories.create_deepseek_v4_attn_backend(runner)) is dsv4_backend.DeepseekV4AttnBackend
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    ours = factories.create_deepseek_v4_attn_backend(runner)
    assert type(ours) is shim.backend_classes()[0] and isinstance(ours, dsv4_backend.DeepseekV4AttnBackend)
    assert ours.dsv4_planner.mla.fmt.value == "fp8_ds_mla" and ours.dsv4_planner.mla.spec.topk == TOPK
    draft = factories.create_deepseek_v4_multistep_backend(runner, 1, 2)
    assert type(draft) is shim.backend_classes()[1]
    assert all(type(b) is shim.backend_classes()[0] for b in draft.attn_backends)


def test_engine_start_refusals(monkeypatch):
    import sglang.srt.runtime_context as rc

    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    cls = shim.backend_classes()[0]
    runner = model_runner(make_pool([0, 4, 128]), heads=256)
    runner.hisparse_coordinator = object()
    spec_bag = types.SimpleNamespace(speculative_algorithm="DSPARK", speculative_eagle_topk=1,
                                     speculative_num_draft_tokens=4)
    monkeypatch.setattr(rc, "get_spec", lambda: spec_bag)
    parallel = types.SimpleNamespace(attn_tp_size=1, attn_cp_size=2)
    monkeypatch.setattr(rc, "get_parallel", lambda: parallel)
    with pytest.raises(ValueError) as err:
        cls(runner)
    text = str(err.value)
    for reason in ("query heads per rank: got 256; allowed: <= 128", "--speculative-algorithm DSPARK",
                   "enable_hisparse", "attention context parallelism"):
        assert reason in text, text
    split = make_pool([0, 4, 128], kv_layout="v41")  # SGLang's block-split V4.1 arrangement: no record here
    assert shim.kv_format_of(split) is None
    assert "KV cache layout: got SWA v41" in "\n".join(shim.unsupported_reasons(model_runner(split)))
    assert shim.kv_format_of(make_pool([0, 4, 128], kv_layout="v41_new")).value == "mxfp8_ds_mla"
    assert shim.kv_format_of(make_pool([0, 4, 128], kv_layout="v41_new", compressed="fp4")).value == "nvfp4_ds_mla"


# ---- decode and extend steps through the shim ------------------------------------------------------------------------
SEQ_LENS = [300, 3, 140]  # decode at 299; at 2 (no compressed entry yet); a request crossing the window


class Step:
    """Requests placed in SGLang's pools: full-pool token slots per request (req_to_token), the SWA
    mapping, caches filled with random rows through the views the shim reads."""

    def __init__(self, gen, runner, ratios):
        self.runner, self.pool = runner, runner.token_to_kv_pool
        req_to_token = runner.req_to_token_pool.req_to_token
        pages = torch.randperm(14, generator=gen)[: len(SEQ_LENS) * 2] + 1  # 256-token pages, page 0 unused
        for r, n in enumerate(SEQ_LENS):
            req_to_token[r, :512] = torch.cat([pages[2 * r] * PAGE + torch.arange(PAGE),
                                               pages[2 * r + 1] * PAGE + torch.arange(PAGE)]).int()
        self.req_to_token = req_to_token
        mapping = torch.full((16 * PAGE,), -1, dtype=torch.int64)
        used = torch.cat([req_to_token[r, :n] for r, n in enumerate(SEQ_LENS)]).long()
        mapping[used] = torch.randperm(self.pool.swa_size, generator=gen)[: used.numel()] + 1
        self.pool.register_mapping(mapping)
        self.mapping = mapping
        self.layers = list(range(len(ratios)))
        for layer in self.layers:
            for view in [shim.swa_cache_view(self.pool, layer)] + (
                    [shim.comp_cache_view(self.pool, layer)] if ratios[layer] else []):
                n = view.shape[0] * view.shape[1]
                layout.insert(view, "fp8_ds_mla", torch.arange(n, dtype=torch.int32),
                              (torch.randn(n, 512, generator=gen) * 2).bfloat16())

    def swa_slot(self, r, p):
        return int(self.mapping[int(self.req_to_token[r, p])])

    def comp_slot(self, r, c, ratio):
        per_page = PAGE // ratio
        return int(self.req_to_token[r, c * ratio]) // PAGE * per_page + c % per_page


def core_metadata(backend, step, tokens, gen):
    """SGLang's DSV4AttnMetadata for (request, position) tokens: its torch builders make the page
    table, positions and SWA rows; the compressed rows are written from their definitions."""
    req = torch.tensor([r for r, _ in tokens], dtype=torch.int64)
    seq_casual = torch.tensor([p + 1 for _, p in tokens], dtype=torch.int32)
    out_loc = torch.tensor([int(step.req_to_token[r, p]) for r, p in tokens], dtype=torch.int64)
    core = backend.make_core_attn_metadata(req_to_token=step.req_to_token, req_pool_indices_repeated=req,
                                           seq_lens_casual=seq_casual, max_seq_len=512, out_loc=out_loc,
                                           need_compress=False)
    keys = {}
    for ratio in backend.present_ratios:
        width = TOPK if ratio != 128 else 64
        rows = torch.full((len(tokens), width), -1, dtype=torch.int32)
        entries = []
        for t, (r, p) in enumerate(tokens):
            visible = (p + 1) // ratio
            chosen = (torch.randperm(visible, generator=gen)[:TOPK].tolist() if ratio != 128
                      else list(range(visible)))
            slots = [step.comp_slot(r, c, ratio) for c in chosen]
            rows[t, : len(slots)] = torch.tensor(slots, dtype=torch.int32) if slots else rows[t, :0]
            entries.append(slots)
        lens = torch.tensor([max(len(s), 1) for s in entries], dtype=torch.int32)  # SGLang's clamp-1 lengths
        core.set_sparse_topk(ratio, page_indices=rows, topk_lengths=lens)
        keys[ratio] = entries
    return core, keys


def expected(step, tokens, keys, ratio, layer, q, sink):
    T = q.shape[0]
    swa = torch.full((T, 128), -1, dtype=torch.int32)
    swa_lens = torch.zeros(T, dtype=torch.int32)
    comp = torch.full((T, 64), -1, dtype=torch.int32)
    comp_lens = torch.zeros(T, dtype=torch.int32)
    for t, (r, p) in enumerate(tokens):
        window = [step.swa_slot(r, k) for k in range(max(0, p - 127), p + 1)]
        swa[t, : len(window)], swa_lens[t] = torch.tensor(window, dtype=torch.int32), len(window)
        if ratio and keys[ratio][t]:
            comp[t, : len(keys[ratio][t])] = torch.tensor(keys[ratio][t], dtype=torch.int32)
            comp_lens[t] = len(keys[ratio][t])
    out, _ = reference.sparse_mla(q, shim.swa_cache_view(step.pool, layer), swa, swa_lens,
                                  shim.comp_cache_view(step.pool, layer) if ratio else None,
                                  comp if ratio else None, comp_lens if ratio else None, sink, 512**-0.5,
                                  "fp8_ds_mla")
    return out


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_steps_through_sglangs_backend_match_reference(gen, monkeypatch, mode):
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    # SGLang's metadata builder makes a FlashMLA tile-scheduler object (CUDA flash_mla package) that
    # only its FlashMLA calls use; the shim never reads it
    monkeypatch.setattr(dsv4_backend, "_create_flashmla_metadata", lambda: None)
    ratios = [0, 4, 128, 4]  # SWA, C4A, C128A, a second C4A layer reading its own rows of the same step
    runner = model_runner(make_pool(ratios))
    backend = shim.backend_classes()[0](runner)
    step = Step(gen, runner, ratios)
    if mode == "decode":
        tokens = [(r, n - 1) for r, n in enumerate(SEQ_LENS)]
    else:  # an extend: the last 9, 3 and 12 tokens of the requests (a chunk crossing the window)
        tokens = [(r, p) for r, (n, k) in enumerate(zip(SEQ_LENS, [9, 3, 12])) for p in range(n - k, n)]
    pad = 3  # query rows past the metadata's (SGLang pads q in graphs): zero output
    forward_batch = types.SimpleNamespace(forward_mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND)
    planner = backend.dsv4_planner
    for layer_id, ratio in enumerate(ratios):
        core, keys = core_metadata(backend, step, tokens, gen)
        if layer_id:  # one metadata per forward: later layers keep it, the indexer rewrites the top-k rows in place
            for r in core.present_ratios:
                first.sparse_page_indices(r).copy_(core.sparse_page_indices(r))
            core = first
        else:
            first = core
        backend.forward_metadata = dsv4_backend.DSV4Metadata(core, None)
        q = torch.randn(len(tokens) + pad, 64, 512, generator=gen).bfloat16()  # SGLang pads heads to 64
        sink = torch.zeros(64)
        sink[:HEADS] = torch.randn(HEADS, generator=gen)
        layer = types.SimpleNamespace(layer_id=layer_id, v_head_dim=512, tp_q_head_num=64)
        out = backend.forward(q, q[:, :1], q[:, :1], layer, forward_batch, compress_ratio=ratio, attn_sink=sink,
                              save_kv_cache=False)
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and not out.isnan().any()
        assert out[-pad:].abs().max() == 0
        ref = expected(step, tokens, keys, ratio, layer_id, q[: len(tokens)], sink)
        err = compare(out[: len(tokens), :HEADS], ref[:, :HEADS])
        assert err["rel_l2"] < 1e-2 and err["cosine"] > 0.9999 and err["max_abs"] < 6e-2, (mode, ratio, err)
    assert planner.plans_built == 1  # one plan per forward pass, shared by the four layers
    assert planner._plan.num_decode_tokens == (len(tokens) if mode == "decode" else 0)
    backend.forward(q, q[:, :1], q[:, :1], types.SimpleNamespace(layer_id=0, v_head_dim=512, tp_q_head_num=64),
                    forward_batch, compress_ratio=0, attn_sink=sink, save_kv_cache=False)
    assert planner.plans_built == 2  # layer 0 again: the next forward pass
