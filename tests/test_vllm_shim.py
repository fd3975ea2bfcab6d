"""The vLLM 0.33 shim against the REAL vllm package (CPU, torch backend).

Run with ``bash ci/vllm-tests.sh`` (builds a venv with vllm 0.33 installed without its torch pin);
everywhere else this module skips with the reason. What is exercised: vLLM's plugin loader with
our entry point, vLLM's own DeepSeek-V4 layer-class selection wrapped by the hook, vLLM's real
metadata dataclasses / forward context / attention-sink helper / config objects, and our layer
class's ``forward_mqa`` on a mixed decode + MTP + prefill + padding batch against the float64
reference. Not exercised: building a whole vLLM layer or model (that needs GPU kernels, model
weights and a distributed setup; the layer here is our class with the attributes vLLM's
``__init__`` would set), vLLM's metadata builders (Triton GPU kernels), and the ROCm model module
(it cannot be imported without a ROCm GPU: its hook is tested on a stand-in module).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm is not importable here: run `bash ci/vllm-tests.sh` "
                                          "(docs/vllm.md) for the vLLM shim tests")

from dsv4_attn.common import layout, reference  # noqa: E402
from dsv4_attn.common.backend import BackendUnavailableError  # noqa: E402
from dsv4_attn.integrations import vllm as shim  # noqa: E402

from conftest import compare  # noqa: E402

if not shim.is_tested_version(vllm.__version__):
    pytest.skip(f"vllm {vllm.__version__} is installed; these tests target vLLM {shim.TESTED_VLLM_SERIES}.x",
                allow_module_level=True)

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """Plugin off, no forced backend, fresh planners; vLLM's platform reported as CUDA (this
    machine has none: vLLM sees an 'unspecified' platform, which the plugin refuses)."""
    for name in (shim.ENV_ENABLE, "DSV4_ATTN_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(shim, "vllm_platform", lambda: "cuda")
    monkeypatch.setattr(shim, "_planners", {})


def vllm_config(backend: str | None = None, block_size: int = 256):
    """A real VllmConfig; the plugin is registered first, as vLLM does before parsing arguments."""
    from vllm.config import AttentionConfig, CacheConfig, DeviceConfig, VllmConfig

    shim.register()

    return VllmConfig(device_config=DeviceConfig(device="cpu"), attention_config=AttentionConfig(backend=backend),
                      cache_config=CacheConfig(block_size=block_size))


def cuda_model_module():
    """vLLM's CUDA DeepSeek-V4 model module, with the plugin's hook installed."""
    shim.register()
    from vllm.models.deepseek_v4.nvidia import model

    return model


def flashmla_layer_class():
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    return DeepseekV4FlashMLAAttention


# ---- plugin loading and selection ---------------------------------------------------------------
def _declared_entry_point() -> str:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    return meta["project"]["entry-points"]["vllm.general_plugins"]["dsv4_attn"]


def test_plugin_loads_through_vllms_loader(monkeypatch, tmp_path):
    from importlib.metadata import entry_points

    import vllm.plugins

    declared = _declared_entry_point()
    assert declared == "dsv4_attn.integrations.vllm:register"
    if not any(ep.name == "dsv4_attn" for ep in entry_points(group="vllm.general_plugins")):
        # Not pip-installed here: expose pyproject's declaration as installed metadata would.
        dist = tmp_path / "dsv4_attn_decl-0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4-attn-decl\nVersion: 0\n")
        (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\ndsv4_attn = {declared}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VLLM_PLUGINS", "dsv4_attn")
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum[shim.BACKEND_NAME].get_class().get_name() == shim.BACKEND_NAME
    from vllm.models.deepseek_v4.nvidia import model

    hooked = model._select_dsv4_attn_cls
    assert hooked._dsv4_attn_hook and not getattr(hooked.__wrapped__, "_dsv4_attn_hook", False)
    shim.register()  # idempotent: a second (and third) call wraps nothing twice
    shim.register()
    assert model._select_dsv4_attn_cls is hooked


def test_selection_returns_ours_only_when_enabled(monkeypatch):
    model, base = cuda_model_module(), flashmla_layer_class()
    assert model._select_dsv4_attn_cls(vllm_config()) is base  # off: vLLM's own class
    assert model._select_dsv4_attn_cls(vllm_config("FLASHMLA_SPARSE_DSV4")) is base

    ours = model._select_dsv4_attn_cls(vllm_config(shim.BACKEND_NAME))  # on through the flag
    assert ours is not base and issubclass(ours, base) and issubclass(ours, shim.DSv4AttnLayerMixin)
    assert ours.forward_mqa is shim.DSv4AttnLayerMixin.forward_mqa
    assert ours.backend_cls is base.backend_cls  # vLLM's metadata builders and KV specs stay

    monkeypatch.setenv(shim.ENV_ENABLE, "1")  # on through the environment
    assert model._select_dsv4_attn_cls(vllm_config()) is ours
    assert model._select_dsv4_attn_cls(vllm_config("FLASHMLA_SPARSE_DSV4")) is ours
    with pytest.raises(ValueError, match="plain bf16/fp8 KV rows"):
        model._select_dsv4_attn_cls(vllm_config("FLASHINFER_MLA_SPARSE_DSV4"))
    monkeypatch.setenv(shim.ENV_ENABLE, "yes")
    with pytest.raises(ValueError, match="DSV4_ATTN_VLLM: got 'yes'"):
        model._select_dsv4_attn_cls(vllm_config())


def test_mismatched_vllm_version_is_refused(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    shim.register()  # opted out: does nothing, raises nothing
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    with pytest.raises(RuntimeError, match=r"got vLLM 0\.34\.0; allowed: vLLM 0\.33\.x"):
        shim.register()
    with pytest.raises(RuntimeError, match=r"got vLLM 0\.34\.0"):
        shim.layer_class_for(vllm_config(), flashmla_layer_class())


def test_other_platform_is_refused_when_enabled(monkeypatch):
    monkeypatch.setattr(shim, "vllm_platform", lambda: "cpu")
    shim.register()
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    with pytest.raises(RuntimeError, match="got vLLM platform 'cpu'; allowed: cuda or rocm"):
        shim.register()


def test_status_reports_the_plugin_state(monkeypatch):
    assert shim.status()["vllm"] == vllm.__version__
    assert "available: on with DSV4_ATTN_VLLM=1" in shim.status()["vllm plugin"] or \
        shim.status()["entry point"] == "missing"
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    if shim.status()["entry point"] == "installed":
        assert shim.status()["vllm plugin"].startswith("on (DSV4_ATTN_VLLM=1)")
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.34.1")
    assert shim.status()["vllm plugin"] == "refused (vLLM 0.34.1; tested: 0.33.x)"


def test_backend_name_survives_pickling_into_a_fresh_process():
    """vLLM pickles its config (holding the DSV4_ATTN member) into spawned workers."""
    shim.register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    blob = pickle.dumps(AttentionBackendEnum[shim.BACKEND_NAME])
    code = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read()).name)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split()[-1] == shim.BACKEND_NAME


# ---- a step of real vLLM metadata ---------------------------------------------------------------
HEADS, TOPK, MAX_MODEL_LEN = 8, 16, 4096
QUERY_LENS = [1, 2, 9, 5, 0]  # decode, MTP decode pair, prefill across blocks, fresh prefill, padded req
SEQ_LENS = [300, 131, 700, 5, 0]
NUM_DECODES, NUM_DECODE_TOKENS, PAD_TOKENS = 2, 3, 2
SWA_BS, BS = 64, 256


def _slot(table, req, p, bs):
    return int(table[req, p // bs]) * bs + p % bs


def _tokens():
    """(request, position) of every real token, decodes first as vLLM orders them."""
    return [(r, s - q + i) for r, (q, s) in enumerate(zip(QUERY_LENS, SEQ_LENS)) for i in range(q)]


def _block_table(gen, entries_per_req, bs, extra_cols=2):
    cols = max(-(-e // bs) for e in entries_per_req) + extra_cols
    return torch.randperm(len(entries_per_req) * cols, generator=gen).int().view(len(entries_per_req), cols)


def _cache(gen, table, bs, block_stride=None):
    cache = layout.new_cache("fp8_ds_mla", table.numel(), bs, block_stride=block_stride)
    n = table.numel() * bs
    layout.insert(cache, "fp8_ds_mla", torch.arange(n, dtype=torch.int32),
                  (torch.randn(n, 512, generator=gen) * 2).bfloat16())
    return cache


def make_step(gen, max_tokens):
    """vLLM 0.33 metadata dataclasses for one step, filled as its builders would, plus caches and
    the shared top-k buffer. Returns a dict of everything the tests need."""
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    toks = _tokens()
    T = len(toks) + PAD_TOKENS
    R = len(QUERY_LENS)
    qsl = torch.tensor([0] + list(torch.tensor(QUERY_LENS).cumsum(0)), dtype=torch.int32)
    seq = torch.tensor(SEQ_LENS, dtype=torch.int32)
    swa_bt = _block_table(gen, SEQ_LENS, SWA_BS)
    comp_bt = {4: _block_table(gen, [s // 4 for s in SEQ_LENS], BS // 4),
               128: _block_table(gen, [s // 128 for s in SEQ_LENS], BS // 128)}
    req_of = torch.tensor([r for r, _ in toks] + [-1] * PAD_TOKENS, dtype=torch.int32)
    swa_slots = torch.tensor([_slot(swa_bt, r, p, SWA_BS) for r, p in toks] + [-1] * PAD_TOKENS)
    swa_md = DeepseekSparseSWAMetadata(
        block_table=swa_bt, slot_mapping=swa_slots, block_size=SWA_BS, seq_lens=seq, query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(), is_valid_token=swa_slots >= 0, token_to_req_indices=req_of,
        num_decodes=NUM_DECODES, num_prefills=2, num_decode_tokens=NUM_DECODE_TOKENS,
        num_prefill_tokens=len(toks) - NUM_DECODE_TOKENS, max_decode_query_len=2,
        prefill_seq_lens=seq[NUM_DECODES:], prefill_seq_lens_cpu=seq[NUM_DECODES:].clone(),
        prefill_query_lens_cpu=torch.tensor(QUERY_LENS[NUM_DECODES:], dtype=torch.int32),
        prefill_window_size=128, prefill_max_model_len=MAX_MODEL_LEN, prefill_max_num_batched_tokens=max_tokens)

    def comp_md(ratio):
        bs_c = BS // ratio
        slots = [(_slot(comp_bt[ratio], r, p // ratio, bs_c) if (p + 1) % ratio == 0 else -1) for r, p in toks]
        return DeepseekV4FlashMLAMetadata(
            num_reqs=R, max_query_len=max(QUERY_LENS), max_seq_len=max(SEQ_LENS), num_actual_tokens=len(toks),
            query_start_loc=qsl, slot_mapping=torch.tensor(slots + [-1] * PAD_TOKENS),
            block_table=comp_bt[ratio], req_id_per_token=req_of, block_size=BS, topk_tokens=TOPK)

    topk = torch.randint(-7, 10**6, (max_tokens, TOPK), generator=gen, dtype=torch.int32)  # stale rows
    for t, (r, p) in enumerate(toks):  # the indexer's row: LOCAL positions, valid prefix, then -1
        n = min((p + 1) // 4, TOPK)
        topk[t] = -1
        topk[t, :n] = torch.randperm((p + 1) // 4, generator=gen)[:n].int()
    return dict(T=T, toks=toks, swa_md=swa_md, comp_md={4: comp_md(4), 128: comp_md(128)}, swa_bt=swa_bt,
                comp_bt=comp_bt, topk=topk)


def expected_rows(step, ratio):
    """Keys of every token written out by hand from the step's own facts (not by dsv4_attn):
    (swa_rows, swa_lens, comp_rows, comp_lens) for a layer of compression ratio ``ratio``."""
    T, width = step["T"], 128 + TOPK + 128
    swa, comp = torch.full((T, 128), -1, dtype=torch.int32), torch.full((T, width), -1, dtype=torch.int32)
    swa_lens, comp_lens = torch.zeros(T, dtype=torch.int32), torch.zeros(T, dtype=torch.int32)
    for t, (r, p) in enumerate(step["toks"]):
        window = [_slot(step["swa_bt"], r, k, SWA_BS) for k in range(max(0, p - 127), p + 1)]
        swa[t, : len(window)], swa_lens[t] = torch.tensor(window), len(window)
        if ratio == 4:
            locals_ = [int(c) for c in step["topk"][t, : min((p + 1) // 4, TOPK)] if c >= 0]
        elif ratio == 128:
            locals_ = list(range((p + 1) // 128))
        else:
            continue
        keys = [_slot(step["comp_bt"][ratio], r, c, BS // ratio) for c in locals_]
        if keys:
            comp[t, : len(keys)] = torch.tensor(keys)
        comp_lens[t] = len(keys)
    return swa, swa_lens, comp, comp_lens


def make_layer(gen, config, ratio, step_tables, name, kv_cache_dtype="fp8_ds_mla", stride_pad=0):
    """Our layer class (as the hook returns it over vLLM's FlashMLA class) with the attributes
    vLLM's DeepseekV4Attention.__init__ sets, then our engine-start setup."""
    from vllm.model_executor.model_loader.weight_utils import make_attention_sink

    cls = shim.layer_class_for(config, flashmla_layer_class())
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    padded = cls.get_padded_num_q_heads(HEADS)  # vLLM's FlashMLA padding: 64
    sink = make_attention_sink(padded, torch.float32)  # -inf on the padded heads
    sink.data[:HEADS] = torch.randn(HEADS, generator=gen)
    swa_stride = layout.model1_page_bytes(SWA_BS) + stride_pad  # other layers' pages interleaved
    layer.__dict__.update(
        prefix=f"model.layers.{name}.attn", compress_ratio=ratio, kv_cache_dtype=kv_cache_dtype,
        n_local_heads=HEADS, padded_heads=padded, max_model_len=MAX_MODEL_LEN, window_size=128,
        scale=512**-0.5, max_image_tokens=0, topk_indices_buffer=step_tables["topk"],
        swa_cache_layer=types.SimpleNamespace(prefix=f"model.layers.{name}.attn.swa_cache",
                                              kv_cache=_cache(gen, step_tables["swa_bt"], SWA_BS, swa_stride)),
        kv_cache=_cache(gen, step_tables["comp_bt"][ratio], BS // ratio) if ratio > 1 else torch.tensor([]),
    )
    layer.attn_sink = sink
    layer.dsv4_setup(config)
    return layer


def attn_metadata_for(step, layers):
    md = {}
    for layer in layers:
        md[layer.swa_cache_layer.prefix] = step["swa_md"]  # one SWA-cache group
        if layer.compress_ratio > 1:
            md[layer.prefix] = step["comp_md"][layer.compress_ratio]
    return md


def test_layers_match_reference_on_real_vllm_metadata(gen):
    from vllm.forward_context import set_forward_context

    config = vllm_config(shim.BACKEND_NAME)
    max_tokens = config.scheduler_config.max_num_batched_tokens
    step = make_step(gen, max_tokens)
    # SWA-only, C4A, C128A, and a second C4A layer of the same KV-cache groups (same plan).
    layers = [make_layer(gen, config, r, step, i, stride_pad=576 * (i % 2)) for i, r in enumerate([1, 4, 128, 4])]
    planner = layers[0].dsv4_planner
    assert all(layer.dsv4_planner is planner for layer in layers)
    T, padded = step["T"], layers[0].padded_heads
    positions = torch.tensor([p for _, p in step["toks"]] + [0] * PAD_TOKENS)
    attn_metadata = attn_metadata_for(step, layers)
    with set_forward_context(attn_metadata, config):
        for layer in layers:
            q = torch.zeros(T, padded, 512, dtype=torch.bfloat16)  # vLLM zero-fills the padded heads
            q[:, :HEADS] = torch.randn(T, HEADS, 512, generator=gen).bfloat16()
            out = torch.full((T, padded, 512), float("nan"), dtype=torch.bfloat16)
            layer.forward_mqa(q, None, positions, out)
            assert not out.isnan().any(), "output not fully written"

            swa, swa_lens, comp, comp_lens = expected_rows(step, layer.compress_ratio)
            has_comp = layer.compress_ratio > 1
            ref, _ = reference.sparse_mla(
                q, layer.swa_cache_layer.kv_cache, swa, swa_lens, layer.kv_cache if has_comp else None,
                comp if has_comp else None, comp_lens if has_comp else None, layer.attn_sink.data,
                512**-0.5, "fp8_ds_mla")
            err = compare(out[:, :HEADS], ref[:, :HEADS])  # the live heads vLLM keeps
            assert err["rel_l2"] < 1e-2 and err["cosine"] > 0.9999 and err["max_abs"] < 5e-2, err
            assert compare(out, ref)["rel_l2"] < 1e-2  # padded heads are written sensibly too
            assert out[-PAD_TOKENS:].abs().max() == 0  # CUDA-graph padding tokens: no keys, zero output
    assert planner.plans_built == 3  # one per (SWA group, compressed group) pair, not one per layer

    with set_forward_context(attn_metadata_for(step, layers), config):  # the next step: a new dict
        out = torch.empty(T, padded, 512, dtype=torch.bfloat16)
        layers[1].forward_mqa(torch.zeros(T, padded, 512, dtype=torch.bfloat16), None, positions, out)
    assert planner.plans_built == 4 and len(planner.slots) == 3


def test_step_batch_maps_each_vllm_field(gen):
    config = vllm_config(shim.BACKEND_NAME)
    step = make_step(gen, config.scheduler_config.max_num_batched_tokens)
    planner = make_layer(gen, config, 4, step, 0).dsv4_planner
    swa_md, c4 = step["swa_md"], step["comp_md"][4]
    batch = planner.step_batch(swa_md, c4, 4, step["T"])
    assert batch.query_start_loc is swa_md.query_start_loc and batch.seq_lens is swa_md.seq_lens
    assert batch.swa_block_table is swa_md.block_table and batch.swa_block_size == swa_md.block_size == 64
    assert batch.comp_block_tables == {4: c4.block_table} and batch.block_size == c4.block_size == 256
    assert batch.num_decode_tokens == swa_md.num_decode_tokens == NUM_DECODE_TOKENS
    assert batch.num_tokens == step["T"] and batch.max_model_len == MAX_MODEL_LEN
    swa_only = planner.step_batch(swa_md, None, 1, step["T"])
    assert swa_only.comp_block_tables == {}
    # The derived positions are vLLM's: seq_len - query_len + offset, for every real token.
    assert batch.positions[: len(step["toks"])].tolist() == [p for _, p in step["toks"]]


def test_dummy_run_zeroes_output_and_reserves_plan_buffers(gen):
    from vllm.forward_context import set_forward_context

    config = vllm_config(shim.BACKEND_NAME)
    step = make_step(gen, config.scheduler_config.max_num_batched_tokens)
    layer = make_layer(gen, config, 4, step, 0)
    out = torch.full((7, layer.padded_heads, 512), float("nan"), dtype=torch.bfloat16)
    assert layer.dsv4_planner.slots[0]._buffers is None
    with set_forward_context(None, config):
        layer.forward_mqa(torch.randn(7, layer.padded_heads, 512).bfloat16(), None, torch.zeros(7), out)
    assert out.abs().max() == 0
    assert layer.dsv4_planner.slots[0]._buffers is not None  # allocated while vLLM profiles memory


# ---- engine-start refusals and the backend choice ----------------------------------------------
def test_engine_start_refusals(gen, monkeypatch):
    config = vllm_config(shim.BACKEND_NAME)
    step = make_step(gen, config.scheduler_config.max_num_batched_tokens)
    ours = shim.layer_class_for(config, flashmla_layer_class())
    with pytest.raises(ValueError, match="got 256 query heads per rank; allowed: <= 128"):
        ours.get_padded_num_q_heads(256)
    assert ours.get_padded_num_q_heads(100) == 128  # vLLM's FlashMLA padding is kept
    with pytest.raises(ValueError, match="--kv-cache-dtype: got 'bfloat16'"):
        make_layer(gen, config, 4, step, 0, kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="--block-size: got 130; allowed: a multiple of 4"):
        make_layer(gen, vllm_config(shim.BACKEND_NAME, block_size=130), 4, step, 0)
    monkeypatch.setenv("DSV4_ATTN_BACKEND", "aiter")  # cannot run on this machine: refused, not replaced
    with pytest.raises(BackendUnavailableError, match="backend 'aiter' .*forced by DSV4_ATTN_BACKEND"):
        make_layer(gen, config, 4, step, 0)
    monkeypatch.setenv("DSV4_ATTN_BACKEND", "torch")
    layer = make_layer(gen, config, 128, step, 0)
    assert {layer.dsv4_planner.slots[0].backend_for(k, p) for k in (1, 4, 128) for p in ("decode", "prefill")} \
        == {"torch"}


def test_rocm_hook_on_a_stand_in_module(gen):
    """The ROCm model module needs a ROCm GPU to import, so the hook runs on a stand-in with the
    same shape: a decoder layer that builds its attention from the module-global class name."""
    module = types.ModuleType("stand_in_amd_model")

    class VllmRocmAttention(torch.nn.Module):
        use_fp8_ds_mla_layout = True

        def __init__(self, vllm_config, prefix):
            super().__init__()
            self.prefix, self.built_with = prefix, vllm_config

        @classmethod
        def get_padded_num_q_heads(cls, num_heads):
            return num_heads

    class DecoderLayer:
        def __init__(self, vllm_config, prefix):
            self.attn = module.DeepseekV4ROCMAiterMLAAttention(vllm_config, prefix=f"{prefix}.attn")

    module.DeepseekV4ROCMAiterMLAAttention, module.DeepseekV4DecoderLayer = VllmRocmAttention, DecoderLayer
    shim._patch_rocm_model(module)
    shim._patch_rocm_model(module)  # idempotent
    assert type(DecoderLayer(vllm_config(), "l0").attn) is VllmRocmAttention  # off: vLLM's own
    ours = shim.layer_class_for(vllm_config(shim.BACKEND_NAME), VllmRocmAttention, rocm=True)
    setups = []
    ours.dsv4_setup = lambda self, cfg: setups.append(cfg)  # the engine-start part is tested above
    config = vllm_config(shim.BACKEND_NAME)
    layer = DecoderLayer(config, "l1")
    assert type(layer.attn) is ours and isinstance(layer.attn, VllmRocmAttention) and setups == [config]
    assert issubclass(ours, shim.DSv4AttnRocmLayerMixin)
    assert module.DeepseekV4ROCMAiterMLAAttention is VllmRocmAttention  # the name is vLLM's again
