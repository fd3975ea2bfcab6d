"""The SGLang 0.5.23 shim against the REAL sglang package (CPU, torch backend).

Run with ``bash ci/sglang-tests.sh`` (builds a venv with sglang 0.5.23 installed without its torch
pin); everywhere else this module skips with the reason. Exercised: SGLang's plugin loader with our
entry point, its ``--attention-backend`` choices and ``ServerArgs.resolve_once`` (the flag turns the
plugin on; the one-phase flags are refused), its V4.1 feature resolution (decoder SWA bounded replay
on by default on CUDA), its HookRegistry wrapping the DeepSeek-V4 backend factories, real
``DeepSeekV4TokenToKVPool`` s (V4, V4.1) and our subclasses of SGLang's ``DeepseekV4AttnBackend`` /
``DeepseekV4MultiStepBackend`` built on the CPU, SGLang's own torch metadata builders (page table,
positions, causal and replay-floored SWA rows, prefill / verify / draft-extend expansion) and
``DSV4AttnMetadata``. Each step -- decode, extend, target verify, draft extend, multi-step draft
decode, the bounded-replay tail -- runs every layer through ``backend.forward`` and through
SGLang's OWN ``_forward_attention`` on the same metadata, its FlashMLA calls (decode and sparse
prefill) answered in float64 (tests/kit/vllm_stack.py), and both against the float64 reference. The
compressed rows (written on GPUs by SGLang's Triton metadata kernel and its indexer) are written
here from their definitions through SGLang's ``set_sparse_topk``. Not exercised:
SGLang's cache writers (CUDA kernels; the caches are filled with dsv4_attn's byte-exact writer),
a whole model, CUDA graphs.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import types
from pathlib import Path

import pytest
import tomllib
import torch

sglang = pytest.importorskip("sglang", reason="sglang is not importable here: run `bash ci/sglang-tests.sh` "
                                              "(docs/sglang.md) for the SGLang shim tests")

from dsv4_attn.common import layout, reference  # noqa: E402
from dsv4_attn.common.rows import StepRows  # noqa: E402
from dsv4_attn.integrations import sglang as shim  # noqa: E402

from kit import vllm_stack  # noqa: E402  # its float64 FlashMLA only (imports no vLLM code)
from kit.compare import assert_close, compare  # noqa: E402

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
TOPK, HEADS, PAGE, MAX_LEN = 64, 8, 256, 4096  # SGLang pads top-k rows to 64 columns


def publish(**server_args) -> None:
    """SGLang's process configuration, as a CPU server with these arguments would publish it."""
    get_context().set_server_args(ServerArgs(model_path="/nonexistent/deepseek-v4", device="cpu", **server_args))


@pytest.fixture(autouse=True)
def runtime_context():
    publish()
    yield
    publish()


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
    """SGLang's pool for ``ratios`` (V4.1's ratio-1/2 layers are their own kv_source layers)."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=2048, c4_size=1024, c128_size=64, c4_state_pool_size=64, c128_state_pool_size=8,
        page_size=PAGE, swa_page_size=PAGE, dtype=torch.uint8, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
        layer_num=len(ratios), device="cpu", enable_memory_saver=False, compression_ratios=ratios,
        kv_layout=kv_layout, compressed_kv_layout=compressed,
        kv_source_layers=[i for i, r in enumerate(ratios) if r in (1, 2)], full_size=16 * PAGE)


def model_runner(pool, heads=HEADS, model_type="deepseek_v4", is_draft_worker=False):
    cfg = types.SimpleNamespace(model_type=model_type, index_topk=TOPK, num_attention_heads=heads)
    return types.SimpleNamespace(
        device="cpu", page_size=PAGE, token_to_kv_pool=pool, hisparse_coordinator=None,
        is_draft_worker=is_draft_worker,
        model_config=types.SimpleNamespace(context_len=MAX_LEN, head_dim=512, v_head_dim=512, hf_text_config=cfg),
        req_to_token_pool=types.SimpleNamespace(req_to_token=torch.zeros(5, MAX_LEN, dtype=torch.int32), size=4),
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
    publish(enable_encoder_swa_bounded_replay=True)
    with pytest.raises(ValueError) as err:
        cls(runner)
    text = str(err.value)
    for reason in ("--tp-size: got 256 query heads per rank; allowed: <= 128 (pass a larger --tp-size)",
                   "--speculative-algorithm: got DSPARK", "pass --speculative-algorithm EAGLE",
                   "--enable-hisparse: got on", "--attn-cp-size: got 2",
                   "--enable-encoder-swa-bounded-replay: got on", "allowed: off (drop the flag)"):
        assert reason in text, text
    split = make_pool([0, 4, 128], kv_layout="v41")  # SGLang's block-split V4.1 arrangement: no record here
    assert shim.kv_format_of(split) is None
    assert "SGLANG_DSV4_KV_LAYOUT: got SWA v41" in "\n".join(shim.unsupported_reasons(model_runner(split)))
    assert shim.kv_format_of(make_pool([0, 4, 128], kv_layout="v41_new")).value == "mxfp8_ds_mla"
    assert shim.kv_format_of(make_pool([0, 4, 128], kv_layout="v41_new", compressed="fp4")).value == "nvfp4_ds_mla"


# ---- decode and extend steps through the shim ------------------------------------------------------------------------
SEQ_LENS = [300, 3, 140]  # decode at 299; at 2 (no compressed entry yet); a request crossing the window


class Step:
    """Requests placed in SGLang's pools: full-pool token slots per request (req_to_token), the SWA
    mapping, caches filled with random rows through the views the shim reads."""

    def __init__(self, gen, runner, ratios, seq_lens=SEQ_LENS):
        self.runner, self.pool, self.seq_lens = runner, runner.token_to_kv_pool, seq_lens
        req_to_token = runner.req_to_token_pool.req_to_token
        pages = torch.randperm(14, generator=gen)[: len(seq_lens) * 2] + 1  # 256-token pages, page 0 unused
        for r in range(len(seq_lens)):
            req_to_token[r, :512] = torch.cat([pages[2 * r] * PAGE + torch.arange(PAGE),
                                               pages[2 * r + 1] * PAGE + torch.arange(PAGE)]).int()
        self.req_to_token = req_to_token
        mapping = torch.full((16 * PAGE,), -1, dtype=torch.int64)
        used = torch.cat([req_to_token[r, :n] for r, n in enumerate(seq_lens)]).long()
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


def write_comp_rows(backend, core, step, tokens, gen):
    """Each compressed ratio's rows of ``core`` as SGLang's indexer (top-k ratios: a random
    choice of visible entries, as global slots and as the request-local entry numbers its sparse
    prefill reads) and C128A metadata (every visible entry) would fill them, through SGLang's
    ``set_sparse_topk``; returns {ratio: the slots chosen per token}."""
    keys = {}
    for ratio in backend.present_ratios:
        width = TOPK if ratio != 128 else 64
        rows = torch.full((len(tokens), width), -1, dtype=torch.int32)
        raw = torch.full((len(tokens), width), -1, dtype=torch.int32)
        entries = []
        for t, (r, p) in enumerate(tokens):
            visible = (p + 1) // ratio
            chosen = (torch.randperm(visible, generator=gen)[:TOPK].tolist() if ratio != 128
                      else list(range(visible)))
            slots = [step.comp_slot(r, c, ratio) for c in chosen]
            rows[t, : len(slots)] = torch.tensor(slots, dtype=torch.int32) if slots else rows[t, :0]
            raw[t, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32) if chosen else raw[t, :0]
            entries.append(slots)
        lens = torch.tensor([max(len(s), 1) for s in entries], dtype=torch.int32)  # SGLang's clamp-1 lengths
        core.set_sparse_topk(ratio, page_indices=rows, topk_lengths=lens, raw_indices=None if ratio == 128 else raw)
        keys[ratio] = entries
    return keys


def expected(step, tokens, keys, ratio, layer, q, sink, floor=None):
    """The float64 reference over each token's window (from ``floor[t]`` on when given: SWA
    bounded replay) and its chosen compressed entries."""
    T = q.shape[0]
    swa = torch.full((T, 128), -1, dtype=torch.int32)
    swa_lens = torch.zeros(T, dtype=torch.int32)
    comp = torch.full((T, 64), -1, dtype=torch.int32)
    comp_lens = torch.zeros(T, dtype=torch.int32)
    for t, (r, p) in enumerate(tokens):
        first = max(0, p - 127, 0 if floor is None else floor[t])
        window = [step.swa_slot(r, k) for k in range(first, p + 1)]
        swa[t, : len(window)], swa_lens[t] = torch.tensor(window, dtype=torch.int32), len(window)
        if ratio and keys[ratio][t]:
            comp[t, : len(keys[ratio][t])] = torch.tensor(keys[ratio][t], dtype=torch.int32)
            comp_lens[t] = len(keys[ratio][t])
    out, _ = reference.sparse_mla(q, shim.swa_cache_view(step.pool, layer), swa, swa_lens,
                                  shim.comp_cache_view(step.pool, layer) if ratio else None,
                                  comp if ratio else None, comp_lens if ratio else None, sink, 512**-0.5,
                                  "fp8_ds_mla")
    return out


# ---- the plugin against SGLang's OWN _forward_attention, FlashMLA in float64 ----------------------------------------
def flashmla_f64(q, k_cache, head_dim_v, softmax_scale, indices, topk_length, attn_sink, extra_k_cache=None,
                 extra_indices_in_kvcache=None, extra_topk_length=None, **_):
    """SGLang's ``flash_mla_with_kvcache`` call (q bf16 [T, 1, H, 512], caches [pages, 256, 1, bytes])
    answered by the float64 FlashMLA of the vLLM tests (tests/kit/vllm_stack.py: its own fp8_ds_mla
    dequantizer, not dsv4_attn's)."""
    out = torch.empty(*q.shape[:3], head_dim_v, dtype=torch.bfloat16)
    return vllm_stack.flash_mla_with_kvcache(
        q, k_cache, None, None, head_dim_v, vllm_stack.SchedMeta(), softmax_scale=softmax_scale, is_fp8_kvcache=True,
        indices=indices, attn_sink=attn_sink, extra_k_cache=extra_k_cache,
        extra_indices_in_kvcache=extra_indices_in_kvcache, topk_length=topk_length,
        extra_topk_length=extra_topk_length, out=out)


def flashmla_sparse_f64(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """SGLang's sparse-prefill ``flash_mla_sparse_fwd`` call (q [T, H, 512], kv bf16 [rows, 1, 512]
    gathered by SGLang) answered by the float64 FlashMLA of tests/kit/vllm_stack.py."""
    out = torch.empty(*q.shape[:2], d_v, dtype=torch.bfloat16)
    return vllm_stack.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out=out)


@pytest.fixture
def sglang_path(monkeypatch):
    """The plugin on; SGLang's FlashMLA module (the CUDA flash_mla package) replaced by the
    float64 sparse prefill and its scheduler object stubbed (read by its FlashMLA calls only);
    its extend on the dense FlashMLA call unless a test turns sparse prefill (SGLang's CUDA
    default) back on."""
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    monkeypatch.setenv("SGLANG_OPT_FLASHMLA_SPARSE_PREFILL", "0")
    monkeypatch.setattr(dsv4_backend, "_create_flashmla_metadata", lambda: None)
    flashmla = types.ModuleType("flash_mla_interface (float64)")
    flashmla.flash_mla_sparse_fwd = flashmla_sparse_f64
    monkeypatch.setitem(sys.modules, "sglang.kernels.ops.attention.flash_mla_interface", flashmla)


def attention_tp(monkeypatch, size: int) -> None:
    """SGLang's parallel context as a rank of ``size``-way attention TP sees it (the shim reads
    the head split from it; everything else as published)."""
    import sglang.srt.runtime_context as rc

    real = rc.get_parallel()
    monkeypatch.setattr(rc, "get_parallel", lambda: types.SimpleNamespace(
        attn_tp_size=size, attn_cp_size=real.attn_cp_size))


def sglang_own_path(backend):
    """``backend`` (ours) run through SGLang's own ``_forward_attention``: the same object, the
    same metadata, FlashMLA in float64."""
    backend._flash_mla_with_kvcache = flashmla_f64
    backend._swa_interleaved = False  # set only on CUDA (V4.1's layout choice)
    backend._flashmla_split_kv_min_topk = 1 << 30
    return functools.partial(dsv4_backend.DeepseekV4AttnBackend._forward_attention, backend)


def run_layers(backend, ratios, core, tokens, keys, step, gen, forward_mode, floor=None, heads=64, pad=0,
               batch=None):
    """Every layer of one forward through the plugin and through SGLang's own path (the C4A
    indexer's rows rewritten in place between layers, as SGLang's indexer does); each compared with
    the other and with the float64 reference. ``pad`` query rows past the metadata's (CUDA-graph
    padding: SGLang's path attends slot 0 there) must come out zero. Returns the number of plans
    the forward built. ``batch``: more ForwardBatch fields (an extend's lengths)."""
    theirs = sglang_own_path(backend)
    backend.forward_metadata = dsv4_backend.DSV4Metadata(core, None)
    forward_batch = types.SimpleNamespace(forward_mode=forward_mode, attn_cp_metadata=None, **(batch or {}))
    built = backend.dsv4_planner.plans_built
    for layer_id, ratio in enumerate(ratios):
        if layer_id and ratio == 4:
            keys[4] = write_comp_rows(types.SimpleNamespace(present_ratios=(4,)), scratch := copy.copy(core), step,
                                      tokens, gen)[4]
            for name in ("sparse_page_indices", "sparse_topk_lengths", "sparse_raw_indices"):
                getattr(core, name)(4).copy_(getattr(scratch, name)(4))
        T = len(tokens)
        q = torch.randn(T + pad, heads, 512, generator=gen).bfloat16()
        sink = torch.randn(heads, generator=gen)
        kv = q[:, :1]
        layer = types.SimpleNamespace(layer_id=layer_id, v_head_dim=512, tp_q_head_num=heads)
        ours = backend.forward(q, kv, kv, layer, forward_batch, compress_ratio=ratio, attn_sink=sink,
                               save_kv_cache=False)
        own = theirs(q, kv, kv, layer, forward_batch, compress_ratio=ratio, attn_sink=sink, save_kv_cache=False)
        assert own.shape == ours.shape == q.shape and not ours.isnan().any()
        assert not ours[T:].any()
        assert_close(compare(ours[:T], own[:T]), what=(forward_mode, ratio, "vs SGLang's own path"))
        ref = expected(step, tokens, keys, ratio, layer_id, q[:T], sink, floor)
        assert_close(compare(ours[:T], ref), what=(forward_mode, ratio, "vs reference"))
    return backend.dsv4_planner.plans_built - built


def prefill_metadata(backend, step, extend):
    """SGLang's prefill builder (init_forward_metadata_prefill, without its compressor plans) for
    an extend of the last ``extend[r]`` tokens of each request: (core metadata, tokens, out_loc)."""
    seq_lens = step.seq_lens
    tokens = [(r, p) for r, (n, e) in enumerate(zip(seq_lens, extend)) for p in range(n - e, n)]
    out_loc = torch.tensor([int(step.req_to_token[r, p]) for r, p in tokens], dtype=torch.int64)
    core = backend.init_forward_metadata_prefill(
        max_seq_len=max(seq_lens), req_pool_indices=torch.arange(len(seq_lens)),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), seq_lens_cpu=list(seq_lens), out_cache_loc=out_loc,
        num_tokens=len(tokens), extend_seq_lens=torch.tensor(extend, dtype=torch.int32), extend_seq_lens_cpu=extend,
        need_compress=False).core_attn_metadata
    return core, tokens, out_loc


V4_LAYERS = [0, 4, 128, 4]  # SWA, C4A, C128A, a second C4A layer reading its own rows of the same step
SPEC_SEQ_LENS = [300, 6, 140]  # a verify of 4 tokens at 2..5 starts before the first compressed entry


# heads per rank: V4-Flash (64 heads) and V4-Pro (128) at TP 8, which SGLang pads to 64 per rank
@pytest.mark.parametrize("mode, heads", [("decode", 8), ("decode", 16), ("extend", 16)])
def test_plugin_matches_sglangs_own_forward(gen, monkeypatch, sglang_path, mode, heads):
    """Decode; extend on SGLang's sparse prefill (its CUDA default: it gathers the window and the
    chosen entries into a bf16 workspace for flash_mla_sparse_fwd, with its own chunk-cache
    builders; the dense FlashMLA call is the bounded-replay tail's, tested below)."""
    attention_tp(monkeypatch, 8)
    runner = model_runner(make_pool(V4_LAYERS), heads=heads * 8)
    backend = shim.backend_classes()[0](runner)
    assert backend.dsv4_planner.mla.spec.num_heads == heads
    step = Step(gen, runner, V4_LAYERS)
    seq = torch.tensor(SEQ_LENS, dtype=torch.int32)
    reqs = torch.arange(len(SEQ_LENS), dtype=torch.int64)
    if mode == "decode":  # what make_forward_metadata_from_raw_decode builds, without its compressor plans
        tokens = [(r, n - 1) for r, n in enumerate(SEQ_LENS)]
        out_loc = torch.tensor([int(step.req_to_token[r, p]) for r, p in tokens], dtype=torch.int64)
        core = backend.make_core_attn_metadata(req_to_token=step.req_to_token, req_pool_indices_repeated=reqs,
                                               seq_lens_casual=seq, max_seq_len=backend.MAX_SEQ_LEN_FOR_CAPTURE,
                                               out_loc=out_loc, need_compress=False)
        forward_mode = ForwardMode.DECODE
        batch = None
    else:  # the last 9, 3 and 12 tokens (a chunk crossing the window)
        extend = [9, 3, 12]
        core, tokens, _ = prefill_metadata(backend, step, extend)
        forward_mode = ForwardMode.EXTEND
        batch = dict(seq_lens=seq, seq_lens_cpu=seq.clone(), req_pool_indices=reqs, extend_seq_lens_cpu=extend,
                     extend_seq_lens=torch.tensor(extend, dtype=torch.int32))
        monkeypatch.setenv("SGLANG_OPT_FLASHMLA_SPARSE_PREFILL", "1")
    keys = write_comp_rows(backend, core, step, tokens, gen)
    planner = backend.dsv4_planner
    pad = 3 if mode == "decode" else 0  # decode CUDA graphs pad q past the metadata's rows
    assert run_layers(backend, V4_LAYERS, core, tokens, keys, step, gen, forward_mode, pad=pad, batch=batch) == 1
    sparse = backend.forward_metadata.sparse_prefill_cache is not None  # SGLang's path took its sparse prefill
    assert sparse == (mode == "extend")
    assert planner._plan.num_decode_tokens == (len(tokens) if mode == "decode" else 0)
    run_layers(backend, V4_LAYERS[:1], core, tokens, keys, step, gen, forward_mode, batch=batch)
    assert planner.plans_built == 2  # layer 0 again: the next forward pass


@pytest.mark.parametrize("k", [1, 2, 3])
def test_target_verify_matches_sglangs_own_forward(gen, monkeypatch, sglang_path, k):
    """MTP (EAGLE, top-k 1, k draft tokens): the target verifies k + 1 tokens per request;
    the rows are SGLang's verify builder's (make_forward_metadata_from_raw_verify)."""
    publish(speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=k,
            speculative_num_draft_tokens=k + 1)
    attention_tp(monkeypatch, 8)
    runner = model_runner(make_pool(V4_LAYERS), heads=64 if k != 2 else 128)
    backend = shim.backend_classes()[0](runner)
    step = Step(gen, runner, V4_LAYERS, SPEC_SEQ_LENS)
    reqs = torch.arange(len(SPEC_SEQ_LENS), dtype=torch.int64)
    seq_casual, req_rep = backend.expand_extend_with_same_length(
        bs=len(reqs), qo_len=k + 1, seq_lens=torch.tensor(SPEC_SEQ_LENS, dtype=torch.int32), req_pool_indices=reqs)
    tokens = [(int(r), int(n) - 1) for r, n in zip(req_rep, seq_casual)]
    out_loc = torch.tensor([int(step.req_to_token[r, p]) for r, p in tokens], dtype=torch.int64)
    core = backend.make_core_attn_metadata(req_to_token=step.req_to_token, req_pool_indices_repeated=req_rep,
                                           seq_lens_casual=seq_casual, max_seq_len=backend.MAX_SEQ_LEN_FOR_CAPTURE,
                                           out_loc=out_loc, need_compress=False, num_groups=len(reqs))
    keys = write_comp_rows(backend, core, step, tokens, gen)
    assert run_layers(backend, V4_LAYERS, core, tokens, keys, step, gen, ForwardMode.TARGET_VERIFY) == 1
    assert backend.dsv4_planner._plan.num_decode_tokens == len(tokens) == len(reqs) * (k + 1)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_draft_matches_sglangs_own_forward(gen, monkeypatch, sglang_path, k):
    """The MTP draft model (one SWA layer): draft extend over k + 1 tokens per request
    (SGLang's init_forward_metadata_draft_extend), then the k draft-decode steps of the
    multi-step backend, each on its own step backend (ours) with SGLang's decode rows."""
    publish(speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=k,
            speculative_num_draft_tokens=k + 1)
    attention_tp(monkeypatch, 8)
    from sglang.srt.layers.attention import deepseek_v4_trtllm_backend as factories

    shim.install_factory_hooks()
    runner = model_runner(make_pool([0]), heads=64 if k != 2 else 128, is_draft_worker=True)
    draft_extend = factories.create_deepseek_v4_attn_backend(runner)
    multistep = factories.create_deepseek_v4_multistep_backend(runner, 1, k)
    assert type(draft_extend) is shim.backend_classes()[0] and len(multistep.attn_backends) == k
    step = Step(gen, runner, [0], SPEC_SEQ_LENS)
    reqs = torch.arange(len(SPEC_SEQ_LENS), dtype=torch.int64)
    seq = torch.tensor(SPEC_SEQ_LENS, dtype=torch.int32)
    tokens = [(r, p) for r, n in enumerate(SPEC_SEQ_LENS) for p in range(n - k - 1, n)]
    out_loc = torch.tensor([int(step.req_to_token[r, p]) for r, p in tokens], dtype=torch.int64)
    core = draft_extend.init_forward_metadata_draft_extend(reqs, seq, k + 1, out_loc).core_attn_metadata
    assert run_layers(draft_extend, [0], core, tokens, {}, step, gen, ForwardMode.DRAFT_EXTEND_V2) == 1
    assert draft_extend.dsv4_planner._plan.num_decode_tokens == len(tokens)
    for i, backend in enumerate(multistep.attn_backends):  # draft step i decodes position n - k + i
        tokens = [(r, n - k + i) for r, n in enumerate(SPEC_SEQ_LENS)]
        out_loc = torch.tensor([int(step.req_to_token[r, p]) for r, p in tokens], dtype=torch.int64)
        core = backend.make_core_attn_metadata(req_to_token=step.req_to_token, req_pool_indices_repeated=reqs,
                                               seq_lens_casual=seq - k + i + 1,
                                               max_seq_len=backend.MAX_SEQ_LEN_FOR_CAPTURE, out_loc=out_loc,
                                               need_compress=False)
        assert run_layers(backend, [0], core, tokens, {}, step, gen, ForwardMode.DECODE) == 1
        assert backend.dsv4_planner._plan.num_decode_tokens == len(tokens)


# ---- DeepSeek-V4.1 under SGLang's default server args ----------------------------------------------------------
V41_LAYERS = [0, 1, 2]  # SWA, C1A, C2A (each compressed layer its own kv_source)


def test_v41_default_server_args_resolve_bounded_replay_and_are_served(monkeypatch):
    """SGLang resolves decoder SWA bounded replay ON for V4.1 on CUDA by default
    (arg_groups/deepseek_v4_hook.py validate_deepseek_v41_features); the plugin serves it."""
    from sglang.srt.arg_groups import deepseek_v4_hook as hook
    from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
    from sglang.srt.runtime_context import get_exec

    args = ServerArgs(model_path="/nonexistent/deepseek-v41", device="cuda")
    args.cuda_graph_config = CudaGraphConfig(prefill=PhaseConfig(backend=Backend.BREAKABLE))  # CUDA's default
    monkeypatch.setattr(hook, "model_config_of", lambda _: types.SimpleNamespace(
        hf_config=types.SimpleNamespace(model_type="deepseek_v41")))
    monkeypatch.setattr(hook, "get_platform", lambda: types.SimpleNamespace(is_cuda=True, is_hip=False))
    hook.validate_deepseek_v41_features(args)
    args.device = "cpu"
    get_context().set_server_args(args)
    assert get_exec().features.enable_decoder_swa_bounded_replay is True
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    runner = model_runner(make_pool(V41_LAYERS), model_type="deepseek_v41")
    assert shim.unsupported_reasons(runner) == []
    backend = shim.backend_classes()[0](runner)
    assert {k.name for k in backend.dsv4_planner.mla.spec.kinds} == {"SWA", "C1A", "C2A"}


def test_v41_bounded_replay_tail_matches_sglang_and_reference(gen, monkeypatch, sglang_path):
    """An extend under decoder SWA bounded replay: the early layers over every token, then the
    late layers over each request's last (up to 128) tokens with SGLang's tail metadata: its
    late_layer_tail_layout floors each row's window at seq_len - 128, a position the request
    wrote before this extend; the builder call is _build_late_layer_tail_metadata's, without its
    compressor plans. (Which q rows form the tail is the model's gather, not the backend's.)"""
    from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import late_layer_tail_layout

    publish(enable_decoder_swa_bounded_replay=True)
    runner = model_runner(make_pool(V41_LAYERS), model_type="deepseek_v41")
    backend = shim.backend_classes()[0](runner)
    step = Step(gen, runner, V41_LAYERS)
    extend = [2, 3, 12]  # floors 172 (cuts position 298's window by one), 0, 12 (cuts 128..138's windows)
    core, tokens, out_loc = prefill_metadata(backend, step, extend)
    keys = write_comp_rows(backend, core, step, tokens, gen)
    assert run_layers(backend, V41_LAYERS, core, tokens, keys, step, gen, ForwardMode.EXTEND) == 1

    index, tail_lens, floor = late_layer_tail_layout(extend_lens_cpu=extend, seq_lens_cpu=SEQ_LENS, tail_len=128,
                                                     device=torch.device("cpu"))
    assert floor.tolist() == [172] * 2 + [0] * 3 + [12] * 12
    tail_tokens = [tokens[int(i)] for i in index]
    tail_lens_t = torch.tensor(tail_lens, dtype=torch.int32)
    tail = backend.init_forward_metadata_prefill(
        max_seq_len=max(SEQ_LENS), req_pool_indices=torch.arange(len(SEQ_LENS)),
        seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32), seq_lens_cpu=SEQ_LENS, out_cache_loc=out_loc[index],
        num_tokens=len(tail_tokens), extend_seq_lens=tail_lens_t, extend_seq_lens_cpu=tail_lens,
        extend_start_loc=torch.cumsum(tail_lens_t, 0) - tail_lens_t, need_compress=False,
        swa_replay_start=floor).core_attn_metadata
    assert (tail.swa_topk_lengths < core.swa_topk_lengths).sum() == 1 + 11  # the floors SGLang applied
    keys = write_comp_rows(backend, tail, step, tail_tokens, gen)
    assert run_layers(backend, V41_LAYERS, tail, tail_tokens, keys, step, gen, ForwardMode.EXTEND,
                      floor=floor.tolist()) == 1


# ---- engine-start rules ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["decode_attention_backend", "prefill_attention_backend"])
def test_one_phase_dsv4_attn_is_refused_when_arguments_resolve(flag):
    shim.register()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
    with pytest.raises(Exception) as err:
        ServerArgs(model_path="/nonexistent/deepseek-v4", device="cpu", **{flag: shim.BACKEND_NAME}).resolve_once()
    dashed = "--" + flag.replace("_", "-")
    assert isinstance(err.value, ValueError), err.value
    assert f"{dashed}: got dsv4_attn" in str(err.value) and "Pass --attention-backend dsv4_attn" in str(err.value)
    assert os.environ.get(shim.ENV_ENABLE) is None


@pytest.mark.parametrize("server_args, bound", [
    ({"chunked_prefill_size": -1, "max_prefill_tokens": 2048}, MAX_LEN),  # no chunking: a whole prompt
    ({"chunked_prefill_size": -1, "max_prefill_tokens": 16384}, 16384),
    ({"chunked_prefill_size": 2048}, 2048),
    ({"chunked_prefill_size": 1024, "speculative_algorithm": "EAGLE", "speculative_eagle_topk": 1,
      "speculative_num_steps": 3, "speculative_num_draft_tokens": 4}, 1200),  # 300 requests x 4 verify tokens
])
def test_plan_buffers_are_sized_from_sglangs_config_at_engine_start(monkeypatch, server_args, bound):
    """The largest step SGLang can hand over is sized at backend creation (plan buffers allocated
    then), so no step is refused later: here every such step is planned."""
    publish(**server_args)
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    runner = model_runner(make_pool(V4_LAYERS))
    runner.req_to_token_pool.size = 300  # request slots
    backend = shim.backend_classes()[0](runner)
    mla = backend.dsv4_planner.mla
    assert mla.max_tokens == bound
    assert mla._buffers is not None and mla._buffers.max_tokens == mla.max_tokens  # allocated at start
    rows = torch.zeros(mla.max_tokens, 128, dtype=torch.int32)
    lens = torch.ones(mla.max_tokens, dtype=torch.int32)
    plan = mla.plan(StepRows(rows, lens, lens.clone(), num_decode_tokens=mla.max_tokens))
    assert plan.num_tokens == mla.max_tokens


def test_plan_buffers_hold_no_window_rows_sglang_never_reads(monkeypatch):
    """SGLang hands over its own rows (StepRows: viewed, never copied), so a backend's plan buffers
    are the per-token facts only: 13 bytes per token (int64 position, int32 request, bool
    validity), not the 512 more of a StepBatch's SWA row buffers (~512 MiB per backend at 1M
    context with chunked prefill off)."""
    publish(chunked_prefill_size=-1, max_prefill_tokens=2048)
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    backend = shim.backend_classes()[0](model_runner(make_pool(V4_LAYERS)))
    buffers = backend.dsv4_planner.mla._buffers

    def tensors(value):
        if isinstance(value, torch.Tensor):
            return [value]
        items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else ()
        return [t for item in items for t in tensors(item)]

    allocated = tensors(tuple(vars(buffers).values()))
    assert sum(t.numel() * t.element_size() for t in allocated) == buffers.max_tokens * (8 + 4 + 1)


@pytest.mark.parametrize("context", [MAX_LEN, MAX_LEN + 3 * 128 + 1, 65536 + 300])
def test_c128a_row_width_holds_sglangs_widest_rows(context):
    """SGLang's C128A rows are ``page_size // 128`` x the page-table width of the step's longest
    sequence (at most its request table's width), padded to 64 columns (metadata_kernel.py
    init_compression_metadata, _pad_last_dim): the plugin's width, fixed at engine start from the
    same table, holds the widest of them, so no step's rows are refused later."""
    from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import build_page_table_positions

    runner = model_runner(make_pool(V4_LAYERS))
    runner.req_to_token_pool.req_to_token = torch.zeros(2, context, dtype=torch.int32)
    prep = build_page_table_positions(req_to_token=runner.req_to_token_pool.req_to_token,
                                      req_pool_indices_repeated=torch.zeros(1, dtype=torch.int64),
                                      seq_lens_casual=torch.tensor([context], dtype=torch.int32),
                                      max_seq_len=context, page_size=PAGE, swa_window=128)
    widest = dsv4_backend._pad_last_dim(torch.empty(1, PAGE // 128 * prep.page_table.shape[1])).shape[1]
    assert shim.spec_for(runner).c128a_width >= widest
