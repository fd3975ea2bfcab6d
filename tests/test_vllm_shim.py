"""The vLLM 0.33 shim against the REAL vllm package, on a CPU (torch backend).

Run with ``bash ci/vllm-tests.sh`` (a venv with vllm 0.33 installed without its torch pin);
everywhere else this module skips with the reason. The plugin tests run vLLM's plugin loader,
its DeepSeek-V4 layer-class selection (hooked) and its config objects. The stack tests
(``tests/kit/vllm_stack.py``) build the attention layers of a small DeepSeek-V4 with vLLM's own
``__init__``, KV-cache grouping and allocation, metadata builders (Triton interpreter), cache
writer and MTP draft loop, and compare the shim's ``forward_mqa`` with vLLM's own
``forward_mqa``, whose FlashMLA calls are replaced by float64 implementations: the two agree to
bf16 output rounding on every layer kind, decode, MTP, prefill, every draft step and CUDA-graph
padding. What cannot run here: the ROCm model module (it needs a ROCm GPU to import; its hook
runs on a stand-in module), and vLLM's GPU-only kernels around attention (fused q-norm/RoPE
insert, indexer, compressor): their outputs -- the query, the cache rows, the top-k rows -- are
random inputs here.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import tomllib
import torch

if not torch.cuda.is_available():
    # vLLM enables its Triton kernels only with exactly one active Triton driver; with no GPU
    # visible it accepts none (the Triton interpreter runs them, conftest.py).
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

vllm = pytest.importorskip("vllm", reason="vllm is not importable here: run `bash ci/vllm-tests.sh` "
                                          "(docs/vllm.md) for the vLLM shim tests")

from dsv4_attn.common import layout  # noqa: E402
from dsv4_attn.common.backend import BackendUnavailableError  # noqa: E402
from dsv4_attn.integrations import vllm as shim  # noqa: E402

from kit import vllm_stack  # noqa: E402
from kit.compare import compare  # noqa: E402
from kit.vllm_stack import HEADS, NUM_SPEC_TOKENS, VllmStack  # noqa: E402

if not shim.is_tested_version(vllm.__version__):
    pytest.skip(f"vllm {vllm.__version__} is installed; these tests target vLLM {shim.TESTED_VLLM_SERIES}.x",
                allow_module_level=True)

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]
# Shim vs vLLM's own path with float64 FlashMLA: both round the same float attention to bf16.
REL_L2, MAX_ABS = 1e-3, 2e-2


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """Plugin off, no forced backend, fresh planners; vLLM's platform reported as CUDA (this
    machine has none: vLLM sees an 'unspecified' platform, which the plugin refuses)."""
    for name in (shim.ENV_ENABLE, "DSV4_ATTN_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(shim.gates, "vllm_platform", lambda: "cuda")
    monkeypatch.setattr(shim.sizing, "_planners", {})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dsv4_small")
    vllm_stack.write_model_config(path)
    return path


@pytest.fixture(scope="module")
def sm90(model_dir):
    """vLLM sees an SM90 device (CPU tensors, float64 FlashMLA) for this module's stack tests."""
    with pytest.MonkeyPatch.context() as mp:
        vllm_stack.as_sm90_cpu(mp)
        yield


@pytest.fixture(scope="module")
def built_stack(sm90, model_dir) -> VllmStack:
    return VllmStack(model_dir, torch.Generator().manual_seed(0))


@pytest.fixture
def stack(built_stack, gen) -> VllmStack:
    built_stack.gen = gen  # each test's inputs depend on its own seed only
    return built_stack


def basic_config(backend: str | None = None, block_size: int | None = None):
    """A real VllmConfig without a model (plugin and selection tests); block size: vLLM's default."""
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
    assert model._select_dsv4_attn_cls(basic_config()) is base  # off: vLLM's own class
    assert model._select_dsv4_attn_cls(basic_config("FLASHMLA_SPARSE_DSV4")) is base

    ours = model._select_dsv4_attn_cls(basic_config(shim.BACKEND_NAME))  # on through the flag
    assert ours is not base and issubclass(ours, base) and issubclass(ours, shim.DSv4AttnLayerMixin)
    assert ours.forward_mqa is shim.DSv4AttnLayerMixin.forward_mqa
    assert ours.backend_cls is base.backend_cls  # vLLM's metadata builders and KV specs stay

    monkeypatch.setenv(shim.ENV_ENABLE, "1")  # on through the environment
    assert model._select_dsv4_attn_cls(basic_config()) is ours
    assert model._select_dsv4_attn_cls(basic_config("FLASHMLA_SPARSE_DSV4")) is ours
    with pytest.raises(ValueError, match="plain bf16/fp8 KV rows"):
        model._select_dsv4_attn_cls(basic_config("FLASHINFER_MLA_SPARSE_DSV4"))
    monkeypatch.setenv(shim.ENV_ENABLE, "on")  # what envs.VLLM (and so the probe) accepts, the plugin takes
    assert model._select_dsv4_attn_cls(basic_config()) is ours
    monkeypatch.setenv(shim.ENV_ENABLE, "maybe")
    with pytest.raises(ValueError, match="DSV4_ATTN_VLLM: got 'maybe'"):
        model._select_dsv4_attn_cls(basic_config())


def v41_model_module():
    """vLLM's CUDA DeepSeek-V4.1 model module, with the plugin's hook installed."""
    shim.register()
    from vllm.models.deepseek_v41.nvidia import model

    return model


def test_deepseek_v41_selection(monkeypatch):
    """V4.1's CUDA selection: vLLM's FlashMLA class becomes ours; its default on SM100, mega
    attention (a FlashMLA subclass), is served on FlashMLA's class; named mega attention and
    the FlashInfer classes are refused with the reason."""
    from vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn import DeepseekV4MegaAttnAttention
    from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

    v41 = v41_model_module()
    assert v41._select_dsv4_attn_cls._dsv4_attn_hook
    assert v41._select_dsv4_attn_cls(basic_config()) is DeepseekV4FlashMLAAttention  # off: vLLM's choice (SM90 here)
    ours = v41._select_dsv4_attn_cls(basic_config(shim.BACKEND_NAME))
    assert issubclass(ours, DeepseekV4FlashMLAAttention) and issubclass(ours, shim.DSv41AttnLayerMixin)
    assert ours.backend_cls is DeepseekV4FlashMLAAttention.backend_cls  # vLLM's builders and KV specs stay
    assert ours.swa_backend_cls is DeepseekV4FlashMLAAttention.swa_backend_cls
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    assert v41._select_dsv4_attn_cls(basic_config("FLASHMLA_SPARSE_DSV41")) is ours
    flashmla = DeepseekV4FlashMLAAttention
    assert shim.v41_layer_class_for(basic_config(), DeepseekV4MegaAttnAttention, flashmla) is ours  # SM100 default
    with pytest.raises(ValueError, match=r"vLLM chose DeepseekV4MegaAttnAttention for DeepSeek-V4\.1 "
                                         r"\(FLASHMLA_MEGA_ATTN_DSV41\): its kernel takes the un-normed"):
        shim.v41_layer_class_for(basic_config("FLASHMLA_MEGA_ATTN_DSV41"), DeepseekV4MegaAttnAttention, flashmla)
    with pytest.raises(ValueError, match=r"vLLM chose DeepseekV4FlashInferMLAAttention .* FlashInfer kernels'"):
        v41._select_dsv4_attn_cls(basic_config("FLASHINFER_MLA_SPARSE_DSV41"))


def test_deepseek_v41_on_rocm_is_refused_while_on(monkeypatch):
    """V4.1's ROCm module needs a ROCm GPU to import: its hook runs on a stand-in module."""
    module = types.ModuleType("stand_in_v41_amd_model")
    vllms_choice = type("VllmsChoice", (), {})
    module._select_dsv4_attn_cls = lambda config: vllms_choice
    shim._patch_v41_rocm_model(module)
    shim._patch_v41_rocm_model(module)  # idempotent
    assert module._select_dsv4_attn_cls(basic_config()) is vllms_choice  # off: vLLM's choice
    with pytest.raises(ValueError, match=r"got a DeepSeek-V4\.1 model on ROCm .* is not hooked"):
        module._select_dsv4_attn_cls(basic_config(shim.BACKEND_NAME))


def test_mismatched_vllm_version_is_refused(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    shim.register()  # opted out: does nothing, raises nothing
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    with pytest.raises(RuntimeError, match=r"got vLLM 0\.34\.0; allowed: vLLM 0\.33\.x"):
        shim.register()
    with pytest.raises(RuntimeError, match=r"got vLLM 0\.34\.0"):
        shim.layer_class_for(basic_config(), flashmla_layer_class())


def test_other_platform_is_refused_when_enabled(monkeypatch):
    monkeypatch.setattr(shim.gates, "vllm_platform", lambda: "cpu")
    shim.register()
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    with pytest.raises(RuntimeError, match="got vLLM platform 'cpu'; allowed: cuda or rocm"):
        shim.register()


def test_startup_log_says_what_runs(monkeypatch, caplog):
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    with caplog.at_level(logging.INFO, logger="vllm.dsv4_attn"):
        shim.register()
    line = caplog.records[-1].getMessage()
    assert "DeepSeek-V4 attention layers built in this process will run on dsv4_attn" in line
    assert "DeepSeek-V4.1's too" in line and "other models are not affected" in line


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


def ray_actor_env() -> dict[str, str]:
    """The environment vLLM gives a data-parallel engine-core Ray actor (``v1/engine/utils.py``
    ``CoreEngineActorManager.__init__``, with vLLM's own ``get_env_vars_to_copy``)."""
    from vllm.ray.ray_env import get_env_vars_to_copy
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    names = get_env_vars_to_copy(destination="EngineCoreActor", exclude_vars=WORKER_SPECIFIC_ENV_VARS)
    return {name: os.environ[name] for name in names if name in os.environ}


RAY_EXTRA_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"  # vllm/envs.py


def test_ray_data_parallel_actors_get_the_opt_in(monkeypatch):
    """--data-parallel-backend ray: the engine-core actors get our variables through vLLM's
    extra-prefix knob (a user's own prefixes kept), and pass them on from there."""
    monkeypatch.setenv(RAY_EXTRA_PREFIXES, "MYLIB_")
    monkeypatch.setenv(shim.ENV_ENABLE, "1")
    monkeypatch.setenv("DSV4_ATTN_BACKEND", "torch")
    monkeypatch.setenv("MYLIB_FLAG", "x")
    shim.register()  # vLLM loads the plugin in the driver (EngineArgs) before it starts the actors
    actor = ray_actor_env()
    assert actor[shim.ENV_ENABLE] == "1" and actor["DSV4_ATTN_BACKEND"] == "torch" and actor["MYLIB_FLAG"] == "x"
    assert actor[RAY_EXTRA_PREFIXES] == "MYLIB_,DSV4_ATTN_"
    for name in [n for n in os.environ if n.startswith(("DSV4_ATTN_", "VLLM_RAY_"))]:
        monkeypatch.delenv(name)
    for name, value in actor.items():  # inside the actor: its workers get the same again
        monkeypatch.setenv(name, value)
    shim.register()
    assert ray_actor_env()[shim.ENV_ENABLE] == "1" and os.environ[RAY_EXTRA_PREFIXES] == "MYLIB_,DSV4_ATTN_"


def test_ray_env_untouched_without_our_variables(monkeypatch):
    monkeypatch.delenv(RAY_EXTRA_PREFIXES, raising=False)
    for name in [n for n in os.environ if n.startswith("DSV4_ATTN_")]:
        monkeypatch.delenv(name)
    shim.register()
    assert RAY_EXTRA_PREFIXES not in os.environ


# ---- vLLM's own stack: construction, grouping, writer -------------------------------------------
def test_layers_are_built_by_vllm_and_grouped_by_vllm(stack):
    """The layers come from vLLM's __init__ through the hook; vLLM's KV-cache grouping puts them
    into plans as predicted at profiling time, and the MTP layer is flagged as a draft layer."""
    ours = cuda_model_module()._select_dsv4_attn_cls(stack.config)
    assert all(type(layer) is ours for layer in stack.layers + [stack.mtp])
    assert [layer.compress_ratio for layer in stack.layers] == [1, 4, 128, 4, 128] and stack.mtp.compress_ratio == 1
    assert stack.mtp.is_draft_layer and not any(layer.is_draft_layer for layer in stack.layers)
    assert stack.layers[0].padded_heads == 64 and stack.layers[0].n_local_heads == HEADS  # FlashMLA's padding
    assert stack.layers[1].swa_cache_layer.kv_cache.stride(0) > 64 * 584  # pages of other groups interleaved
    planner = stack.layers[0].dsv4_planner
    assert all(layer.dsv4_planner is planner for layer in stack.layers + [stack.mtp])
    # vLLM split the SWA caches over several groups; the plans follow its grouping.
    swa_groups = {stack.group_of[layer.swa_cache_layer.prefix] for layer in stack.layers}
    assert len(swa_groups) > 1 and len(stack.predicted_groups) == len(swa_groups)
    step = stack.step([1, 3], [40, 70])
    index, groups = shim.plan_groups(stack.layers, lambda prefix: id(step.attn_metadata[prefix]))
    assert groups == stack.predicted_groups
    for layer in stack.layers:
        group = groups[index[layer.prefix]]
        assert stack.group_of[group.swa_prefix] == stack.group_of[layer.swa_cache_layer.prefix]
        if layer.compress_ratio > 1:
            (comp,) = [p for r, p in group.comp_prefixes if r == layer.compress_ratio]
            assert stack.group_of[comp] == stack.group_of[layer.prefix]


def exactly_quantizable_keys(gen, n: int) -> torch.Tensor:
    """bf16 [n, 512] whose NoPE tiles are e4m3 values times 2^e with a +-448 * 2^e element (so
    the tile's scale is exactly 2^e and no value needs rounding), one all-zero tile (vLLM's 1e-4
    amax floor), random bf16 RoPE dims."""
    from kit.reference import e4m3_table

    finite = e4m3_table()[:0x7F]  # the non-negative finite e4m3 values, 0 .. 448
    tiles = finite[torch.randint(0, 0x7F, (n, 7, 64), generator=gen)]
    tiles *= torch.where(torch.rand(n, 7, 64, generator=gen) < 0.5, -1.0, 1.0)
    tiles[:, :, 0] = 448.0 * torch.where(torch.rand(n, 7, generator=gen) < 0.5, -1.0, 1.0)
    tiles *= torch.pow(2.0, torch.randint(-20, 8, (n, 7, 1), generator=gen).double())
    tiles[0, 3] = 0
    rope = torch.randn(n, 64, generator=gen) * 3
    return torch.cat([tiles.reshape(n, 448).float(), rope], dim=1).bfloat16()


def test_cache_writers_agree(gen):
    """vLLM's fp8_ds_mla writer and dsv4_attn's write the same bytes (the stack fills cache
    history with dsv4_attn's, much faster under the interpreter). The keys need no rounding:
    Triton 3.8's interpreter rounds fp32 -> e4m3 ties away from zero and loses the carry into
    the exponent (7.875 -> 4.0), which the GPU does not."""
    from vllm.models.deepseek_v4.common.ops.cache_utils import quantize_and_insert_k_cache

    keys = exactly_quantizable_keys(gen, 12)
    slots = torch.randperm(3 * 64, generator=gen)[:12]
    ours, theirs = (layout.new_cache("fp8_ds_mla", 3, 64, block_stride=64 * 584 + 576 * 3) for _ in range(2))
    layout.insert(ours, "fp8_ds_mla", slots, keys)
    quantize_and_insert_k_cache(keys, theirs, slots.long(), 64)
    written = ours.view(torch.uint8).flatten() != 0
    assert written.sum() > 12 * 500  # the rows landed (nonzero data and scale bytes)
    assert torch.equal(ours.view(torch.uint8).flatten(), theirs.view(torch.uint8).flatten())


# ---- the shim vs vLLM's own forward_mqa ---------------------------------------------------------
def run_all(stack, layers, step, num_tokens=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(shim output, vLLM output)] of ``layers`` in one forward pass over ``step``, layer by
    layer as vLLM's model runs them (a V4.1 index source's indexer rewrites the shared top-k
    buffer before its attention); every output poisoned with NaN first."""
    from vllm.forward_context import set_forward_context

    T = step.num_tokens if num_tokens is None else num_tokens
    results = []
    with set_forward_context(step.attn_metadata, stack.config):
        for layer in layers:
            if getattr(layer, "is_index_source", False):
                stack.write_topk(step, layer.dsv4_kind.ratio)
            q = stack.random_q(layer, T)
            ours = torch.full((T, layer.padded_heads, 512), float("nan"), dtype=torch.bfloat16)
            theirs = ours.clone()
            layer.forward_mqa(q, None, step.positions[:T], ours)
            with vllms_own_metadata(step):
                stack.vllm_cls.forward_mqa(layer, q, None, step.positions[:T], theirs)
            assert not ours.isnan().any(), "the shim left output elements unwritten"
            results.append((ours, theirs))
    return results


@contextlib.contextmanager
def vllms_own_metadata(step):
    """The forward's metadata as vLLM's own builders make it (with vLLM's C128A rows, which the
    plugin's builders leave out) while vLLM's own path runs."""
    from vllm.forward_context import get_forward_context

    forward = get_forward_context()
    forward.attn_metadata = step.reference_metadata or step.attn_metadata
    try:
        yield
    finally:
        forward.attn_metadata = step.attn_metadata


def run_both(stack, layer, step, num_tokens=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(shim output, vLLM output) of one layer in a forward pass of its own."""
    return run_all(stack, [layer], step, num_tokens)[0]


def assert_agree(ours, theirs, real_tokens: int, heads: int = HEADS):
    # vLLM's V4.1 SM90 prefill writes the live heads only (_prefill_num_heads); it keeps no other
    assert not theirs[:real_tokens, :heads].isnan().any()
    err = compare(ours[:real_tokens, :heads], theirs[:real_tokens, :heads])  # the live heads vLLM keeps
    assert err["rel_l2"] < REL_L2 and err["max_abs"] < MAX_ABS and err["cosine"] > 0.99999, err
    return err


def test_mixed_step_matches_vllm(stack):
    """Decode, MTP verification (2 tokens, a decode for vLLM), chunked and fresh prefill, and 2
    padding tokens of a piecewise CUDA graph, on every layer kind; one plan per plan group."""
    planner = stack.layers[0].dsv4_planner
    step = stack.step([1, 2, 9, 5], [200, 131, 160, 5], pad_tokens=2)
    swa_md = step.attn_metadata[stack.layers[0].swa_cache_layer.prefix]
    assert (swa_md.num_decodes, swa_md.num_decode_tokens, swa_md.num_prefills) == (2, 3, 2)
    built = planner.plans_built
    for ours, theirs in run_all(stack, stack.layers, step):
        assert_agree(ours, theirs, step.num_tokens - 2)
        assert ours[-2:].abs().max() == 0  # padding tokens: no keys, zero output
    assert planner.plans_built - built == len(stack.predicted_groups)  # one per plan group, not per layer


def test_full_graph_padding_matches_vllm(stack):
    """A uniform MTP-verification batch (1 + 3 tokens per request) padded like a FULL CUDA graph:
    2 zero-length requests and 8 padding tokens, metadata built for the padded sizes."""
    q = 1 + NUM_SPEC_TOKENS
    step = stack.step([q, q, q], [90, 300, 4], pad_tokens=2 * q, pad_reqs=2, full_graph=True)
    real = 3 * q
    for ours, theirs in run_all(stack, stack.layers, step):
        assert_agree(ours, theirs, real)
        assert ours[real:].abs().max() == 0


def test_draft_steps_match_vllm(stack):
    """MTP with 3 speculative tokens: vLLM builds the draft metadata once and updates it in place
    for each further draft step. Every draft step plans afresh and matches vLLM's own path."""
    planner, errors, positions = stack.mtp.dsv4_planner, [], []
    seq_lens = [200, 131, 77]
    R = len(seq_lens)

    def attend(step):
        positions.append(step.positions[:R].tolist())
        ours, theirs = run_both(stack, stack.mtp, step, num_tokens=R)
        errors.append(assert_agree(ours, theirs, R))

    built = planner.plans_built
    stack.run_draft_loop(seq_lens, attend)
    assert len(errors) == NUM_SPEC_TOKENS - 1  # draft steps 1 and 2 (step 0 is the draft prefill)
    assert positions == [[s - 1 + k for s in seq_lens] for k in range(NUM_SPEC_TOKENS - 1)]
    assert planner.plans_built - built == NUM_SPEC_TOKENS - 1


def test_step_batch_maps_each_vllm_field(stack):
    step = stack.step([1, 6], [70, 300])
    layer = stack.layers[2]  # C128A
    swa_md = step.attn_metadata[layer.swa_cache_layer.prefix]
    c128 = step.attn_metadata[layer.prefix]
    batch = layer.dsv4_planner.step_batch(swa_md, {128: c128}, step.num_tokens)
    assert batch.query_start_loc is swa_md.query_start_loc and batch.seq_lens is swa_md.seq_lens
    assert batch.swa_block_table is swa_md.block_table and batch.swa_block_size == swa_md.block_size == 64
    assert batch.comp_block_tables == {128: c128.block_table} and batch.block_size == c128.block_size == 256
    assert batch.num_decode_tokens == swa_md.num_decode_tokens == 1
    assert batch.num_tokens == step.num_tokens and batch.max_model_len == vllm_stack.MAX_MODEL_LEN
    assert batch.positions.tolist() == step.positions.tolist()  # derived on the device: vLLM's positions
    assert layer.dsv4_planner.step_batch(swa_md, {}, step.num_tokens).comp_block_tables == {}


def test_c128a_width_bound_is_vllms_max_seq_len(stack):
    """A target plan's C128A rows are bounded by the step's longest request, vLLM's
    ``max_seq_len`` (what vLLM sizes its own C128A launch by); a FULL-graph step's metadata
    carries ``max_model_len`` (vLLM builds it so for capture): the model's width."""
    layer = stack.layers[2]  # C128A
    for step, bound in ((stack.step([1, 6], [70, 300]), 300),
                        (stack.step([1, 1], [70, 300], pad_tokens=1, pad_reqs=1, full_graph=True),
                         vllm_stack.MAX_MODEL_LEN)):
        swa_md, c128 = step.attn_metadata[layer.swa_cache_layer.prefix], step.attn_metadata[layer.prefix]
        assert layer.dsv4_planner.step_batch(swa_md, {128: c128}, step.num_tokens).max_seq_len == bound


def test_no_plan_outlives_its_forward(stack):
    """vLLM's CUDA-graph memory profile builds a throwaway KV cache and metadata builders,
    captures, then frees them (v1/worker/gpu/cudagraph_utils.py): once a forward is over, the
    planner keeps none of its metadata -- views of those builders' buffers -- alive."""
    step = stack.step([1, 5], [70, 300])
    layer = stack.layers[2]  # C128A: its metadata views its builder's buffers
    metadata = weakref.ref(step.attn_metadata[layer.prefix])
    swa_table = weakref.ref(step.block_tables[stack.group_of[layer.swa_cache_layer.prefix]])  # the plan's batch
    built = layer.dsv4_planner.plans_built
    run_both(stack, layer, step)
    assert layer.dsv4_planner.plans_built == built + 1
    del step
    gc.collect()
    assert metadata() is None and swa_table() is None


def test_vllms_own_c128a_rows_are_not_allocated(stack):
    """vLLM's DeepSeek-V4 builder keeps two C128A row buffers for its own FlashMLA calls
    (``max_num_batched_tokens x round_up(cdiv(max_model_len, 128), 128)`` int32 each: 2 x 256 MiB
    at vLLM's defaults and 1M context) and fills them every step; the plugin never reads them, so
    a C128A layer's builder has neither the buffers nor the fields, and keeps every other
    attribute of vLLM's builder."""
    layer = stack.layers[2]
    assert layer.dsv4_kind.name == "C128A"
    ours = [g.get_metadata_builder(0) for groups in stack.target_groups for g in groups
            if layer.prefix in g.layer_names]
    assert len(ours) == 1
    builder = ours[0]
    vllms = stack.vllm_cls.backend_cls.get_builder_cls()(builder.kv_cache_spec, builder.layer_names, stack.config,
                                                         builder.device)
    rows = {"c128a_global_decode_buffer", "c128a_decode_lens_buffer", "c128a_prefill_buffer"}
    assert rows <= set(vars(vllms)) and not rows & set(vars(builder))
    assert set(vars(vllms)) - rows <= set(vars(builder))
    assert isinstance(builder, type(vllms))
    metadata = stack.step([1, 5], [70, 300]).attn_metadata[layer.prefix]
    assert metadata.c128a_global_decode_topk_indices is None and metadata.c128a_prefill_topk_indices is None


# ---- profiling: every plan buffer inside vLLM's budget -----------------------------------------
def test_profiling_reserves_every_plan_buffer(stack, caplog):
    """The dummy run (attn_metadata None) allocates every slot and C128A row set that later steps
    use, draft slot included; real steps and draft steps then allocate nothing."""
    from vllm.forward_context import set_forward_context

    old = stack.layers[0].dsv4_planner
    planner = shim.StepPlanner(old.spec, old.max_tokens, old.max_reqs, old.swa_dialect,
                               predict=lambda layers: shim.predicted_plan_groups(stack.config, layers),
                               block_size=old.block_size)
    for layer in stack.layers + [stack.mtp]:
        layer.dsv4_planner = planner
        planner.add_layer(layer)
    try:
        out = torch.full((5, 64, 512), float("nan"), dtype=torch.bfloat16)
        with set_forward_context(None, stack.config), caplog.at_level(logging.INFO, logger="vllm.dsv4_attn"):
            stack.layers[1].forward_mqa(stack.random_q(stack.layers[1], 5), None, torch.zeros(5), out)
            stack.mtp.forward_mqa(stack.random_q(stack.mtp, 5), None, torch.zeros(5), out)
        assert out.abs().max() == 0  # the dummy run's output is zeros
        reserved = planner.reserved_bytes
        per_token = 8 + 4 + 1 + 4 * (128 + 1)  # positions, token_to_req, valid, SWA rows and lens
        c128a = 4 * (planner.spec.c128a_width + 1)
        # vLLM 0.33 puts every compressed cache of V4 in one KV-cache group: the plans with C128A
        # layers (one per SWA group) read one ratio-128 table and share ONE C128A row set.
        with_c128a = [i for i, g in enumerate(stack.predicted_groups) if g.has_c128a]
        assert len(with_c128a) == 2 and len({stack.predicted_groups[i].c128a_table for i in with_c128a}) == 1
        rows = [planner.slots[i]._buffers.all_rows[128][0] for i in with_c128a]
        assert rows[0] is rows[1]
        assert reserved == planner.max_tokens * (per_token * (len(stack.predicted_groups) + 1) + c128a)
        assert f"reserved {reserved / 2**20:.1f} MiB of plan buffers" in caplog.text
        assert "2 with C128A rows, 1 C128A row set(s)" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm.dsv4_attn"):
            step = stack.step([1, 9], [200, 160], pad_tokens=3)
            for ours, theirs in run_all(stack, stack.layers, step):
                assert_agree(ours, theirs, step.num_tokens - 3)
            stack.run_draft_loop([90, 40], lambda s: run_both(stack, stack.mtp, s, num_tokens=2))
        assert caplog.records == []  # no "allocating ... after vLLM's memory profile"
        assert shim._buffer_bytes(*planner.slots, planner.draft_slot) == reserved
    finally:
        for layer in stack.layers + [stack.mtp]:
            layer.dsv4_planner = old


def test_unpredicted_plan_buffers_are_allocated_loudly(stack, caplog):
    """When vLLM's grouping could not be predicted at profiling, the step still runs right, and
    the log says which buffers landed outside vLLM's KV-cache budget."""
    from vllm.forward_context import set_forward_context

    old = stack.layers[0].dsv4_planner

    def cannot_predict(layers):
        raise ValueError("KV cache layout has not been resolved yet")

    planner = shim.StepPlanner(old.spec, old.max_tokens, old.max_reqs, old.swa_dialect, predict=cannot_predict,
                               block_size=old.block_size)
    for layer in stack.layers:
        layer.dsv4_planner = planner
        planner.add_layer(layer)
    try:
        with set_forward_context(None, stack.config), caplog.at_level(logging.WARNING, logger="vllm.dsv4_attn"):
            stack.layers[0].forward_mqa(stack.random_q(stack.layers[0], 2), None, torch.zeros(2),
                                        torch.empty(2, 64, 512, dtype=torch.bfloat16))
            assert "could not predict vLLM's KV-cache groups (ValueError: KV cache layout" in caplog.text
            step = stack.step([1], [150])
            for ours, theirs in run_all(stack, stack.layers, step):
                assert_agree(ours, theirs, 1)
        assert "allocating plan slot 1 after vLLM's memory profile" in caplog.text
        assert "allocating the C128A rows of plan slot 2" in caplog.text
    finally:
        for layer in stack.layers:
            layer.dsv4_planner = old


# ---- vLLM's default flags: engine start to a step -----------------------------------------------
# (model, tensor-parallel size, the model's query heads, speculative tokens): TP 1, and TP 8 as
# DeepSeek-V4-Flash (64 heads: 8 per rank) and V4-Pro (128 heads: 16 per rank) split them; k = 1, 2, 3
# spread over the three (each stack costs ~10 s of interpreted metadata builders on 2 cores).
DEFAULT_FLAG_CASES = [(model, tp, heads, k) for model in (vllm_stack.V4, vllm_stack.V41)
                      for tp, heads, k in ((1, HEADS, 1), (8, 64, 2), (8, 128, 3))]


@pytest.mark.parametrize("model, tp, heads, k", DEFAULT_FLAG_CASES,
                         ids=[f"{m.name}-tp{tp}-h{h // tp}-k{k}" for m, tp, h, k in DEFAULT_FLAG_CASES])
def test_default_flags_from_engine_start_to_a_step(sm90, tmp_path, gen, caplog, model, tp, heads, k):
    """vLLM's DEFAULT CacheConfig (no --block-size): the layers are built while the block size is
    vLLM's placeholder 16, vLLM resolves it after the model is built (256 for V4's compressed
    caches, 64 for V4.1 on SM90), groups the KV caches, runs the profiling pass, then a step with
    (1 + k)-token verifications and a prefill on every target layer (and, for V4, the k - 1 MTP
    draft steps) matches vLLM's own forward_mqa, allocating nothing after the profile."""
    from vllm.forward_context import set_forward_context

    model.write_config(tmp_path, heads=heads, o_groups=8)
    stack = VllmStack(tmp_path, gen, model, num_spec_tokens=k, tp_size=tp)
    assert not stack.config.cache_config.user_specified_block_size and stack.built_with_block_size == 16
    assert stack.config.cache_config.block_size == (256 if model is vllm_stack.V4 else 64)
    assert all(layer.n_local_heads == heads // tp for layer in stack.all_layers)
    planner = stack.layers[0].dsv4_planner
    with caplog.at_level(logging.INFO, logger="vllm.dsv4_attn"):
        with set_forward_context(None, stack.config):  # vLLM's profiling run: no metadata
            for layer in stack.all_layers:
                layer.forward_mqa(stack.random_q(layer, 4), None, torch.zeros(4),
                                  torch.empty(4, layer.padded_heads, 512, dtype=torch.bfloat16))
    assert planner.reserved_bytes > 0 and "reserved" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.dsv4_attn"):
        step = stack.step([1 + k, 1 + k, 7], [90, 300, 7])
        swa_md = step.attn_metadata[stack.layers[0].swa_cache_layer.prefix]
        assert (swa_md.num_decode_tokens, swa_md.num_prefills) == (2 * (1 + k), 1)
        for ours, theirs in run_all(stack, stack.layers, step):
            assert_agree(ours, theirs, step.num_tokens, heads // tp)
        if stack.mtp is not None:
            stack.run_draft_loop([90, 40], lambda s: assert_agree(*run_both(stack, stack.mtp, s, num_tokens=2), 2,
                                                                  heads // tp))
    assert caplog.records == []  # nothing allocated outside the profile, nothing refused


def test_block_size_is_refused_at_engine_start_only_when_given(built_stack, model_dir):
    """--block-size 64 (a user's value vLLM keeps) cannot hold whole C128A entries: refused when
    the layer is built, naming the flag, the value and what to pass instead."""
    with pytest.raises(ValueError, match=r"--block-size: got 64; allowed: a multiple of 128 .* or leave --block-size "
                                         r"unset"):
        build_layer(vllm_stack.vllm_config(model_dir, speculative=False, block_size=64), index=2)


# ---- engine-start refusals and the backend choice ----------------------------------------------
def build_layer(config, index: int = 1, model_module=None):
    """One attention layer of ``config``'s model through the hook and vLLM's __init__;
    ``model_module``: the model's CUDA module (default DeepSeek-V4's, cuda_model_module())."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        cls = (model_module or cuda_model_module())._select_dsv4_attn_cls(config)
        topk = torch.empty(vllm_stack.MAX_TOKENS, vllm_stack.TOPK, dtype=torch.int32)
        return cls(config, prefix=f"model.layers.{index}.attn", topk_indices_buffer=topk)


@pytest.mark.parametrize("setting, match", [
    (lambda c: setattr(c.kernel_config, "monokernel", True), "--monokernel: decode steps .* never reach"),
    (lambda c: setattr(c.parallel_config, "ubatch_size", 2), r"micro-batching \(--ubatch-size 2, --enable-dbo False"),
    (lambda c: setattr(c.parallel_config, "enable_dbo", True), r"micro-batching \(--ubatch-size 0, --enable-dbo True"),
    (lambda c: setattr(c.parallel_config, "decode_context_parallel_size", 2), "decode_context_parallel_size: got 2"),
])
def test_engine_start_refusals(built_stack, model_dir, setting, match):
    config = vllm_stack.vllm_config(model_dir, speculative=False)
    setting(config)
    with pytest.raises(ValueError, match=f"dsv4_attn cannot serve model.layers.1.attn .*\n  - {match}"):
        build_layer(config)


def test_kv_cache_dtype_is_vllms_to_refuse(built_stack, model_dir):
    """vLLM's own __init__ rejects non-fp8 KV caches for these layer classes before the shim
    looks, and turns every fp8 dtype into fp8_ds_mla: the shim has nothing to check."""
    with pytest.raises(ValueError, match="fp8_ds_mla layout only supports fp8 kv-cache, got bfloat16"):
        build_layer(vllm_stack.vllm_config(model_dir, speculative=False, cache_dtype="bfloat16"))
    assert build_layer(vllm_stack.vllm_config(model_dir, speculative=False, cache_dtype="fp8_e5m2"),
                       index=2).kv_cache_dtype == "fp8_ds_mla"


def test_heads_and_backend_choice(built_stack, model_dir, monkeypatch):
    ours = shim.layer_class_for(basic_config(shim.BACKEND_NAME), flashmla_layer_class())
    with pytest.raises(ValueError, match="got 256 query heads per rank; allowed: <= 128"):
        ours.get_padded_num_q_heads(256)
    assert ours.get_padded_num_q_heads(100) == 128  # vLLM's FlashMLA padding is kept
    monkeypatch.setenv("DSV4_ATTN_BACKEND", "aiter")  # cannot run on this machine: refused, not replaced
    with pytest.raises(BackendUnavailableError, match="backend 'aiter' .*forced by DSV4_ATTN_BACKEND"):
        build_layer(vllm_stack.vllm_config(model_dir, speculative=False))
    monkeypatch.setenv("DSV4_ATTN_BACKEND", "torch")
    layer = build_layer(vllm_stack.vllm_config(model_dir, speculative=False), index=2)
    assert {layer.dsv4_planner.slots[0].backend_for(k, p) for k in ("swa", "c4a", "c128a")
            for p in ("decode", "prefill")} == {"torch"}


@pytest.mark.parametrize("max_seqs, k, expected", [
    (4, 2, 4 * 3),  # 4 requests x 3 tokens, below the 256-token budget
    (100, 3, vllm_stack.MAX_TOKENS),  # 400 decode tokens do not fit one step: the budget bounds them
])
def test_decode_scratch_is_sized_for_decode_launches(built_stack, model_dir, monkeypatch, max_seqs, k, expected):
    """The decode backends' scratch (aiter's) is reserved at engine start for the most decode
    tokens one launch holds -- --max-num-seqs x (1 + speculative tokens), within the step's token
    budget -- not for --max-num-batched-tokens (prefill tokens are another phase's launch; at long
    context that budget made ~4 GiB of AITER scratch)."""
    from dsv4_attn.api import SparseMLA

    config = vllm_stack.vllm_config(model_dir, max_seqs=max_seqs, num_spec_tokens=k)
    seen = []
    monkeypatch.setattr(SparseMLA, "reserve", lambda self, plan, decode_tokens=None: seen.append(decode_tokens))
    layer = build_layer(config, index=2)
    vllm_stack.resolve_block_size(config)
    layer.dsv4_planner.reserve(torch.device("cpu"))
    assert config.scheduler_config.max_num_batched_tokens == vllm_stack.MAX_TOKENS
    assert seen and set(seen) == {expected}


def test_rocm_hook_on_a_stand_in_module():
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
    assert type(DecoderLayer(basic_config(), "l0").attn) is VllmRocmAttention  # off: vLLM's own
    ours = shim.layer_class_for(basic_config(shim.BACKEND_NAME), VllmRocmAttention, rocm=True)
    setups = []
    ours.dsv4_setup = lambda self, cfg: setups.append(cfg)  # the engine-start part is tested above
    config = basic_config(shim.BACKEND_NAME)
    layer = DecoderLayer(config, "l1")
    assert type(layer.attn) is ours and isinstance(layer.attn, VllmRocmAttention) and setups == [config]
    assert issubclass(ours, shim.DSv4AttnRocmLayerMixin)
    assert module.DeepseekV4ROCMAiterMLAAttention is VllmRocmAttention  # the name is vLLM's again


# ---- DeepSeek-V4.1: vLLM's own V4.1 layers, caches, builders ----------------------------------
@pytest.fixture(scope="module")
def model_dir41(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dsv41_small")
    vllm_stack.write_v41_model_config(path)
    return path


@pytest.fixture(scope="module")
def built_stack41(sm90, model_dir41) -> VllmStack:
    return VllmStack(model_dir41, torch.Generator().manual_seed(1), vllm_stack.V41)


@pytest.fixture
def stack41(built_stack41, gen) -> VllmStack:
    built_stack41.gen = gen
    return built_stack41


def test_v41_layers_share_their_sources_caches(stack41):
    """vLLM's V4.1 __init__ through the hook: kinds from compress_ratios, readers keyed to their
    KV source's metadata and reading its cache TENSOR (no copy), V4 record on SM90, SWA blocks
    of 32; the plans follow vLLM's grouping as predicted at profiling."""
    from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

    layers = stack41.layers
    assert all(isinstance(layer, shim.DSv41AttnLayerMixin) and isinstance(layer, DeepseekV4FlashMLAAttention)
               for layer in layers)
    assert [layer.dsv4_kind.name for layer in layers] == ["SWA", "C1A", "C1A", "C2A", "C2A", "SWA"]
    assert [layer.dsv4_comp_prefix for layer in layers[1:5]] == [layers[i].prefix for i in (1, 1, 3, 3)]
    assert layers[2].dsv4_comp_cache() is layers[1].kv_cache and layers[4].dsv4_comp_cache() is layers[3].kv_cache
    assert layers[2].get_kv_cache_spec(stack41.config) is None  # readers own no compressed cache
    planner = layers[0].dsv4_planner
    assert all(layer.dsv4_planner is planner for layer in layers)
    assert planner.fmt is layout.KVFormat.MODEL1_FP8 and planner.spec.kinds == tuple(shim.V41_KINDS.values())
    assert layers[0].swa_cache_layer.block_size == 32
    step = stack41.step([1, 3], [40, 70])
    _, groups = shim.plan_groups(layers, lambda prefix: id(step.attn_metadata[prefix]))
    assert groups == stack41.predicted_groups
    assert {p for g in groups for _, p in g.comp_prefixes} == {layers[1].prefix, layers[3].prefix}


def test_v41_mixed_step_matches_vllm(stack41):
    """Decode, n-gram verification (4 tokens, a decode for vLLM), chunked and fresh prefill and 2
    piecewise-graph padding tokens on every V4.1 layer -- SWA-only, C1A and C2A, sources and
    readers of a shared compressed cache -- vs vLLM's own forward_mqa."""
    step = stack41.step([1, 4, 9, 5], [200, 131, 160, 5], pad_tokens=2)
    swa_md = step.attn_metadata[stack41.layers[0].swa_cache_layer.prefix]
    assert (swa_md.num_decodes, swa_md.num_decode_tokens, swa_md.num_prefills) == (2, 5, 2)
    planner = stack41.layers[0].dsv4_planner
    built = planner.plans_built
    for ours, theirs in run_all(stack41, stack41.layers, step):
        assert_agree(ours, theirs, step.num_tokens - 2)
        assert ours[-2:].abs().max() == 0
    assert planner.plans_built - built == len(stack41.predicted_groups)


def test_v41_full_graph_padding_matches_vllm(stack41):
    """A uniform verification batch padded like a FULL CUDA graph (2 zero-length requests, 8
    padding tokens), on a C1A reader and a C2A source."""
    q = 1 + NUM_SPEC_TOKENS
    step = stack41.step([q, q, q], [90, 300, 4], pad_tokens=2 * q, pad_reqs=2, full_graph=True)
    for ours, theirs in run_all(stack41, [stack41.layers[i] for i in (1, 2, 3)], step):
        assert_agree(ours, theirs, 3 * q)
        assert ours[3 * q:].abs().max() == 0


def test_v41_swa_bounded_replay_matches_vllm(stack41):
    """SWA bounded replay: prefills of prefix hits rebuild their window from replay_start (vLLM's
    model state hands it to the SWA builders); no window key below it is read -- the cache rows
    there hold no written key -- on an SWA-only, a C1A and a C2A layer."""
    starts = [0, 0, 150, 58]  # decodes carry none (vLLM's model state zeroes them); 58: the first query position
    step = stack41.step([1, 1, 30, 12], [200, 131, 190, 70], replay_start=starts)
    swa_md = step.attn_metadata[stack41.layers[0].swa_cache_layer.prefix]
    assert swa_md.replay_start.tolist()[:4] == starts
    batch = stack41.layers[0].dsv4_planner.step_batch(swa_md, {}, step.num_tokens)
    assert batch.swa_start is swa_md.replay_start
    for ours, theirs in run_all(stack41, [stack41.layers[i] for i in (0, 2, 3)], step):
        assert_agree(ours, theirs, step.num_tokens)


@pytest.mark.parametrize("mxfp8, dtype, fmt", [
    (False, "fp8_ds_mla", layout.KVFormat.MODEL1_FP8),  # every GPU but SM100 keeps the V4 record
    (True, "fp8_ds_mla", layout.KVFormat.MXFP8),  # SM100: vLLM's fp8_ds_mla is the MXFP8 record
    (True, "nvfp4_ds_mla", layout.KVFormat.NVFP4),
])
def test_v41_kv_format_follows_vllms_record(mxfp8, dtype, fmt):
    """vLLM's V4.1 layer attributes (kv_mxfp8 on SM100, the resolved kv_cache_dtype) -> the
    package's format. Contract only: SM100 records cannot be built on this machine."""
    layer = types.SimpleNamespace(kv_mxfp8=mxfp8, kv_cache_dtype=dtype)
    assert shim.DSv41AttnLayerMixin.dsv4_kv_format(layer) is fmt


@pytest.mark.parametrize("setting, match", [
    (lambda c: setattr(c, "additional_config", {"decode_backend": "latency_specialized"}),
     "additional_config decode_backend='latency_specialized': DeepSeek-V4.1's specialized decode"),
    (lambda c: setattr(c.parallel_config, "ubatch_size", 2), r"micro-batching \(--ubatch-size 2"),
])
def test_v41_engine_start_refusals(built_stack41, model_dir41, setting, match):
    config = vllm_stack.vllm_config(model_dir41, speculative=False, block_size=64)
    setting(config)
    with pytest.raises(ValueError, match=f"dsv4_attn cannot serve model.layers.1.attn .*\n  - {match}"):
        build_layer(config, model_module=v41_model_module())


def test_v41_dspark_is_refused():
    """V4.1's only draft method is DSpark (vLLM rejects classic MTP for it), whose non-causal
    draft windows dsv4_attn does not model: refused at engine start."""
    config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(use_dspark=lambda: True),
                                   cache_config=types.SimpleNamespace(block_size=64, user_specified_block_size=True),
                                   parallel_config=types.SimpleNamespace(use_ubatching=False), additional_config={},
                                   kernel_config=types.SimpleNamespace())
    layer = types.SimpleNamespace(compress_ratio=1)
    assert shim.unsupported_reasons(layer, config) == [
        "DSpark speculative decoding: non-causal draft windows are not modelled by dsv4_attn"]
