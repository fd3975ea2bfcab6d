"""C128A rows at engine scale (issue 24): a plan at the model's width (what a CUDA graph captures)
costs what the step's requests need, not the width -- rows written only as far as needed, split
programs past a token's keys writing and merging nothing -- with the outputs of a narrow eager
plan; and the Triton row kernel compiled once at engine start, never at a later step.

The Triton front end runs under the CPU interpreter here. Which steps would compile a new variant
on a GPU is read from Triton's own JIT binder (the specialization and options its cache key is made
of) for an sm_90 target, fed each launch's arguments."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn.common import indices, reference
from dsv4_attn.common.spec import LayerKind
from dsv4_attn.testing.errors import compare
from dsv4_attn.testing.steps import make_step

C128A = LayerKind.C128A
MAX_LEN = 1 << 20  # C128A rows of 8192 columns
HAS_CUDA = torch.cuda.is_available()
SPEC = dsv4.ModelSpec(num_heads=16, max_model_len=MAX_LEN, layers=("swa", "c128a"))


def decode_batch(gen, seq_lens, num_tokens: int, device: str = "cpu") -> dsv4.StepBatch:
    """A decode step of ``seq_lens`` (one token each, ``num_tokens`` with padding), random block
    tables, no caches (the row builder reads none)."""
    R, longest = len(seq_lens), max(seq_lens)
    swa, comp = -(-longest // 64), -(-longest // 256) + 1
    tables = [torch.randperm(R * n, generator=gen).int().view(R, n) for n in (swa, comp)]
    return dsv4.StepBatch.from_lists([1] * R, seq_lens, tables[0], 64, {128: tables[1]}, 256, MAX_LEN,
                                     num_tokens=num_tokens, device=device)


def mla_for(spec, front_end: str, max_tokens: int = 8, max_reqs: int = 8):
    return dsv4.SparseMLA(spec, "fp8_ds_mla", backend="torch", max_tokens=max_tokens, max_reqs=max_reqs,
                          front_end=front_end)


def expected_rows(batch, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the model's width from the torch reference builder (common.indices)."""
    return indices.all_rows(batch, C128A, width)


def whole_rows(mla) -> tuple[torch.Tensor, torch.Tensor]:
    return mla._buffers.all_rows[C128A.ratio]


@pytest.mark.parametrize("front_end", ["torch", "triton"])
def test_columns_past_each_length_stay_minus_one(gen, front_end):
    """Long rows, then shorter ones viewed narrow, then at the model's width (what a graph
    captures): after every plan each row of the whole buffer is the reference's, -1 past its
    length, also past a narrow view's width (a longer earlier row's entries were cleared there)."""
    long = decode_batch(gen, [40000, 130000, 9000], 4)  # 312, 1015, 70 entries; a padding token
    short = decode_batch(gen, [300, 2000, 129], 3)  # 2, 15, 1 entries
    width = SPEC.all_width(C128A.ratio)
    mla = mla_for(SPEC, front_end)
    steps = [(long, None), (dataclasses.replace(short, max_seq_len=2000), 128), (short, None),
             (dataclasses.replace(long, max_seq_len=130000), 1024), (short, None)]
    for batch, view in steps:
        plan = mla.plan(batch)
        assert plan.comp_rows[C128A.ratio][0].shape[1] == (view or width)
        rows, lens = whole_rows(mla)
        ref_rows, ref_lens = expected_rows(batch, width)
        T = batch.num_tokens
        assert torch.equal(lens[:T], ref_lens)
        assert torch.equal(rows[:T], ref_rows), f"step viewed at {view or width} columns"
        assert (rows[T:] == -1).all()


def test_a_graph_width_plan_writes_only_the_entries_needed(gen):
    """The Triton builder at the model's width (8192 columns, as captured) writes a short row's
    entries and nothing past them: columns beyond stay as they were (a sentinel here). On the code
    before this change every one of the 8192 columns was written at every step."""
    batch = decode_batch(gen, [300, 2000, 129], 3)
    mla = mla_for(SPEC, "triton")
    mla.plan(batch)
    rows, lens = whole_rows(mla)
    assert lens[:3].tolist() == [2, 15, 1]
    rows[:, 64:] = -2  # stands for "not written": a correct row has -1 there
    mla.plan(batch)
    assert (rows[:, 64:] == -2).all()
    ref_rows, _ = expected_rows(batch, rows.shape[1])
    assert torch.equal(rows[:3, :64], ref_rows[:, :64])


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs on CPU-only machines")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")])])
@pytest.mark.parametrize("heads", [8, 16])
def test_graph_width_split_writes_and_merges_only_partials_with_keys(gen, device, heads):
    """A decode step of short requests (and a padding token) split over 32 programs per token at
    the model's width, as captured: the outputs are those of the eager plan viewed at 128 columns
    (4 programs) byte for byte, and only the programs with keys wrote partials -- 3, 4, 3 and 1
    (the padding token's empty one) per token, counted in a NaN-poisoned workspace, whose unwritten
    partials would turn the merge's output NaN had it read them. Before this change all 32 wrote."""
    from dsv4_attn.portable.kernels import ops

    case = make_step(gen, [1, 1, 1], [300, 8400, 129], kinds=("swa", "c128a"), heads=heads, max_model_len=MAX_LEN,
                     pad_tokens=1, device=device)
    # key tiles of 64 per token: 128 window keys = 2; 2 / 65 / 1 compressed entries = 1 / 2 / 1; padding 0
    used = [3, 4, 3, 1]
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch", max_tokens=8, front_end="triton")
    swa, comp = case.caches["swa"], case.caches[C128A]
    T, H, _ = case.q.shape
    outs = {}
    for name, batch, split in (("eager", dataclasses.replace(case.batch, max_seq_len=8400), 4),
                               ("graph", case.batch, 32)):
        plan = mla.plan(batch)
        rows, lens = plan.comp_rows[C128A.ratio]
        assert rows.shape[1] == (128 if name == "eager" else 8192)
        workspace = torch.full((T * 32 * H * 514 + T,), float("nan"), device=device)
        out = torch.full_like(case.q, float("nan"))
        ops.sparse_mla_fwd(case.q, out, "fp8_ds_mla", swa, plan.swa_rows, plan.swa_lens, comp, rows, lens,
                           sink=case.sink, scale=case.spec.scale, config=ops.KernelConfig(split=32),
                           workspace=workspace)
        partials = workspace[: T * split * H * 512].view(T, split, H, 512)
        written = ~partials.isnan().all(dim=-1).all(dim=-1)  # [T, split]: a program's partial stored
        assert written.sum(dim=1).tolist() == used, name
        assert all(written[t, :u].all() for t, u in enumerate(used))
        counts = workspace[T * split * H * 514:][:T].view(torch.int32)  # after the partials (ops.layer_launches)
        merged_in_kernel = HAS_CUDA and heads <= ops.MERGE_IN_KERNEL_MAX_HEADS  # the Gluon kernel's merge
        assert merged_in_kernel or counts.tolist() == used
        assert not out.isnan().any()
        outs[name] = out
    assert torch.equal(outs["eager"], outs["graph"])
    ref, _ = reference.sparse_mla(case.q, swa, plan.swa_rows, plan.swa_lens, comp, rows, lens, case.sink,
                                  case.spec.scale, "fp8_ds_mla")
    err = compare(outs["graph"], ref)
    assert err["rel_l2"] < 1e-2 and err["cosine"] > 0.9999, err


# ---- compiles ----------------------------------------------------------------------------------------
def _record_variants(monkeypatch, name: str = "_step_rows_kernel") -> list:
    """Patch a row kernel's launch (``kernels/indices.py``'s ``name``) to record the cache key
    Triton's JIT computes for it on an sm_90 target (``JITFunction.run``: specialization of every
    argument + options) before running it under the interpreter. Distinct keys = compiled
    variants on a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from dsv4_attn.portable.kernels import indices as triton_indices

    kernel = getattr(triton_indices, name)
    jit = JITFunction(kernel.fn, **kernel.kwargs)  # the interpreted kernel's function and JIT arguments
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    keys: list = []
    interpret = kernel.run

    def run(*args, grid, warmup, **kwargs):
        _, specialization, options = binder(*args, **kwargs)
        keys.append((tuple(specialization), str(options)))
        return interpret(*args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(kernel, "run", run)
    return keys


def _empty_step(spec, c128a: bool, device: str = "cpu") -> dsv4.StepBatch:
    """What the engines plan at their profile run (integrations/vllm/memory.py ``_allocate``)."""
    empty = torch.zeros(0, 1, dtype=torch.int32)
    return dsv4.StepBatch.from_lists([], [], empty, 64, {128: empty} if c128a else {}, 256, spec.max_model_len,
                                     num_tokens=0, device=device)


@pytest.mark.skipif(HAS_CUDA, reason="reads the JIT key under the interpreter; the GPU test counts compiles")
def test_no_row_kernel_compile_after_engine_start(gen, monkeypatch):
    """Engine start (``SparseMLA.reserve`` on the profile run's empty step) compiles every variant
    the steps of this model launch; steps of 1, 3, 16 and 17 requests, with and without a window
    start, with and without C128A rows, viewed at 128 / 256 / 1024 / 8192 columns, with padding
    tokens, compile none. On the code before this change engine start compiled nothing and each of
    those request counts and widths was a variant of its own."""
    keys = _record_variants(monkeypatch)
    spec = SPEC
    mla = mla_for(spec, "triton", max_tokens=32, max_reqs=32)
    mla.reserve(mla.plan(_empty_step(spec, c128a=True)))
    at_start = set(keys)
    assert at_start
    for seq_lens, bound in (([300], 300), ([300, 2000, 129], 2000), ([5000] * 16, 40000), ([70000] * 17, None),
                            ([129] * 3, 129)):
        batch = dataclasses.replace(decode_batch(gen, seq_lens, len(seq_lens) + 2), max_seq_len=bound)
        mla.plan(batch)
        R = len(seq_lens)
        mla.plan(dataclasses.replace(batch, swa_start=torch.zeros(R, dtype=torch.int32)))
        mla.plan(dataclasses.replace(batch, comp_block_tables={}))
    assert len(keys) > len(at_start)
    assert set(keys) <= at_start, "a step compiled a row-kernel variant engine start did not"


@pytest.mark.skipif(HAS_CUDA, reason="reads the JIT key under the interpreter")
def test_no_topk_row_kernel_compile_after_engine_start(gen, monkeypatch):
    """Engine start compiles the top-k row kernel's variants too (it compiled at the first top-k
    layer of the first step before this change): steps of 1, 3 and 17 requests, int32 and int64
    top-k of a wider buffer (its own stride), a block table as wide as the step needs, a cache
    bound, FlashMLA's padding to 64 columns, a prefill sub-plan (tokens at an offset) compile none."""
    keys = _record_variants(monkeypatch, "_topk_rows_kernel")
    mla = _reserved_topk_model("cpu")
    at_start = set(keys)
    assert at_start
    _topk_steps(gen, mla, "cpu")
    assert len(keys) > len(at_start)
    assert set(keys) <= at_start, "a step compiled a top-k row kernel variant engine start did not"


@pytest.mark.skipif(HAS_CUDA, reason="reads the JIT key under the interpreter")
def test_engine_start_of_ready_made_rows_warms_the_topk_row_kernel(monkeypatch):
    """SGLang's engine start plans an empty StepRows (integrations/sglang.py): its top-k layers'
    rows (a TopkTable) go through the same kernel, so reserve compiles its variants there too (it
    compiled nothing for a StepRows before this change)."""
    keys = _record_variants(monkeypatch, "_topk_rows_kernel")
    _reserved_topk_model("cpu")
    from_batch = set(keys)
    keys.clear()
    mla = mla_for(TOPK_SPEC, "triton", max_tokens=64, max_reqs=32)
    none = torch.zeros(0, 1, dtype=torch.int32)
    mla.reserve(mla.plan(dsv4.StepRows(none, none[:, 0], none[:, 0])))
    assert from_batch and set(keys) == from_batch


TOPK_SPEC = dsv4.ModelSpec(num_heads=16, max_model_len=1 << 16, topk=512, layers=("swa", "c4a"))


def _reserved_topk_model(device: str):
    """A V4-like model (window + C4A, top-k 512) whose engine start (``reserve``) has run."""
    mla = mla_for(TOPK_SPEC, "triton", max_tokens=64, max_reqs=32)
    mla.reserve(mla.plan(_empty_step(TOPK_SPEC, c128a=False, device=device)))
    return mla


def _topk_steps(gen, mla, device: str) -> None:
    """The top-k rows of steps of 1, 3 and 17 requests, as each decode backend asks for them."""
    for query_lens in ([1], [1, 1, 5], [1] * 16 + [7]):
        case = make_step(gen, query_lens, [900 + 97 * i for i in range(len(query_lens))],
                         kinds=(LayerKind.SWA, LayerKind.C4A), topk=512, max_model_len=1 << 16, device=device)
        plan = mla.plan(case.batch)
        topk = case.topks[LayerKind.C4A]
        wide = torch.full((topk.shape[0], 520), -1, dtype=torch.int64, device=device)[:, :512].copy_(topk)
        for local, bound, multiple in ((topk, None, 1), (wide, 1 << 20, 64)):
            plan.comp_scope(LayerKind.C4A, local, bound, multiple)
        if plan.num_tokens > plan.num_decode_tokens:
            plan.phase_plan("prefill").comp_scope(LayerKind.C4A, topk[plan.num_decode_tokens:])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_no_topk_row_kernel_compile_after_engine_start_gpu(gen):
    """The same on a GPU, counted in the kernel's own compile cache."""
    from dsv4_attn.portable.kernels import indices as triton_indices

    kernel = triton_indices._topk_rows_kernel
    mla = _reserved_topk_model("cuda")
    compiled = sum(len(cache[0]) for cache in kernel.device_caches.values())
    assert compiled
    _topk_steps(gen, mla, "cuda")
    torch.cuda.synchronize()
    assert sum(len(cache[0]) for cache in kernel.device_caches.values()) == compiled


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_no_row_kernel_compile_after_engine_start_gpu(gen):
    """The same on a GPU, counted in the kernel's own compile cache."""
    from dsv4_attn.portable.kernels import indices as triton_indices

    kernel = triton_indices._step_rows_kernel
    spec = SPEC
    mla = dsv4.SparseMLA(spec, "fp8_ds_mla", backend="triton", max_tokens=32, max_reqs=32, device="cuda")
    mla.reserve(mla.plan(_empty_step(spec, c128a=True, device="cuda")))
    compiled = sum(len(cache[0]) for cache in kernel.device_caches.values())
    for seq_lens, bound in (([300], 300), ([300, 2000, 129], 2000), ([5000] * 16, 40000), ([70000] * 17, None)):
        batch = dataclasses.replace(decode_batch(gen, seq_lens, len(seq_lens) + 2, "cuda"), max_seq_len=bound)
        mla.plan(batch)
        mla.plan(dataclasses.replace(batch, comp_block_tables={}))
    torch.cuda.synchronize()
    assert sum(len(cache[0]) for cache in kernel.device_caches.values()) == compiled



def _sm90_key(one) -> tuple:
    """The cache key Triton's JIT computes for a launch (``launch.KernelLaunch``) on an sm_90 target:
    (kernel, specialization of every argument, options). Nothing is launched or compiled."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = one.fn
    jit = fn if isinstance(fn, JITFunction) else JITFunction(fn.fn, **fn.kwargs)  # Gluon's, or the interpreted one's
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    _, specialization, options = binder(*one.args, **one.constexprs, **one.options)
    return fn.__name__, tuple(specialization), str(options)


@pytest.mark.parametrize("kernel,heads_on_n", [("portable", -1), ("gluon", 1), ("gluon", 0)])
def test_no_attention_kernel_variant_per_split(gen, monkeypatch, kernel, heads_on_n):
    """The split a step's launch size picks (1 .. a token's key tiles) is no part of the attention
    kernels' nor the combine's cache key: every split launch is one attention variant, and one
    combine variant per power of two of the split (its SPLIT_P2 lanes), so no step of a new batch
    size compiles one mid-serving. On the code before this change the attention kernels had a
    variant for split 16 (Triton specializes ints divisible by 16) and the combine one per split.
    Each Gluon kernel is pinned (auto picks the 64-head or the heads-on-N kernel by the split)."""
    pytest.importorskip("triton")
    from dsv4_attn.portable.kernels import ops

    if kernel == "gluon":
        if not ops._gluon_importable():
            pytest.skip("this Triton's Gluon does not import the Hopper kernel")
        monkeypatch.setattr(ops, "use_gluon", lambda *args, **kwargs: True)
    kind = LayerKind.C4A
    case = make_step(gen, [1, 1], [3000, 4000], kinds=(LayerKind.SWA, kind), topk=1024, max_model_len=8192)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(case.batch)
    variants: dict[str, set] = {}
    grids = set()
    splits = range(2, 19)  # 18 key tiles of 64 (a 128 window + 1024 top-k): every split a launch can take
    for split in splits:
        layer = ops.layer_launches(
            case.q, torch.empty_like(case.q), "fp8_ds_mla", case.caches["swa"], plan.swa_rows, plan.swa_lens,
            comp_cache=case.caches[kind], comp_rows=case.topks[kind],
            c4a=(case.batch.comp_block_table(kind), plan.token_to_req, plan.positions), topk_ratio=kind.ratio,
            sink=case.sink, config=ops.KernelConfig(split=split, merge_in_kernel=0, heads_on_n=heads_on_n))
        grids.add(layer.launches[0].grid[0] / split)  # (tokens x head blocks): the split launched, not clamped
        for one in layer.launches:
            name, *key = _sm90_key(one)
            variants.setdefault(name, set()).add(tuple(key))
    assert len(grids) == 1
    attention, combine = (variants[name] for name in sorted(variants, key=lambda n: n == "combine_kernel"))
    assert len(attention) == 1, f"{len(attention)} attention variants over splits {list(splits)}"
    assert len(combine) == len({triton_next_power_of_2(s) for s in splits})


def triton_next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_every_hopper_kernel_takes_its_split_at_run_time():
    """The Gluon kernels ops launches on sm_90 (64-head, heads-on-N, V4.1 records) each leave
    ``split`` unspecialized, as the test above checks through a launch for the first two: a kernel
    added later without it would compile a variant per split value mid-serving (the records
    kernel did, until this test)."""
    from dsv4_attn.portable.kernels import attention, build, ops

    if not ops._gluon_importable():
        pytest.skip("this Triton's Gluon does not import the Hopper kernels")
    kernels = {build.hopper_kernel(constexprs)[0] for constexprs in (
        build.hopper_constexprs(1, split=True), build.hopper_constexprs(1, split=True, heads_n=8),
        build.hopper_constexprs(1, split=True, records=(attention.FMT_MXFP8, attention.FMT_NVFP4)))}
    assert len(kernels) == 3
    for kernel in kernels:
        assert [p.do_not_specialize for p in kernel.params if p.name == "split"] == [True], kernel.__name__
