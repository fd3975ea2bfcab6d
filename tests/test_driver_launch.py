"""The direct launch of a bound call (``portable/kernels/driver_launch.py``, issue 24 item 6).

* The parameter block holds, slot by slot, the values Triton's launcher would pass (the
  signature's non-constexpr entries, then two null scratch pointers), bit for bit; the
  configuration holds the grid, block, shared memory, stream and attributes (PDL's id 6).
* A kernel is launched directly only where its PTX entry declares exactly the sizes packed, and
  nothing else could differ (num_ctas, scratch, instrumentation, types some Triton packs otherwise);
  every NVIDIA kernel we ship is checked against its real PTX by the offline compile matrix
  (``ci/compile-matrix.sh``, Triton 3.6 and 3.9: it fails on a kernel the direct launch declines).
* A replay hands the driver the block of the arguments Triton's launcher would get; a thread without
  a CUDA context (201) gets Triton's launcher, any other error raises; ``DSV4_ATTN_DIRECT_LAUNCH=0``
  binds no direct launch.

Nothing here calls the driver (no GPU): the GPU tests of tests/test_host_path.py compare the bytes.
"""

from __future__ import annotations

import ctypes
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from dsv4_attn.portable.kernels import driver_launch

from kit.launches import c4a_launches

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _ptx(*types: str, name: str = "k") -> str:
    params = ",\n".join(f"\t.param .{t} {name}_param_{i}" if t != "ptr" else
                        f"\t.param .u64 .ptr .global .align 1 {name}_param_{i}" for i, t in enumerate(types))
    return f"//\n.version 8.7\n.target sm_90a\n.visible .entry {name}(\n{params}\n)\n.reqntid 128\n{{\n\tret;\n}}\n"


def _kernel(signature: dict, ptx: str, **meta) -> SimpleNamespace:
    """A CompiledKernel stand-in: what ``kernel_layout`` reads."""
    metadata = dict(num_ctas=1, num_warps=4, shared=1024, global_scratch_size=0, profile_scratch_size=0,
                    launch_pdl=False, launch_cooperative_grid=False)
    metadata.update(meta)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(**metadata),
                           asm={"ptx": ptx}, hash="h")


SIGNATURE = {"A": "*bf16", "n": "i32", "s": "fp32", "C": "constexpr", "m": "i64", "B": "*fp32", "u": "u32"}
SIG_PTX = _ptx("ptr", "u32", "f32", "u64", "ptr", "u32", "ptr", "ptr")


def _bits32(x: float) -> int:
    return torch.tensor(x, dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF


def test_ptx_param_sizes_reads_the_entry_and_refuses_by_value_structs():
    assert driver_launch.ptx_param_sizes(SIG_PTX) == (8, 4, 4, 8, 8, 4, 8, 8)
    tma = _ptx("ptr").replace(".param .u64 .ptr .global .align 1 k_param_0", ".param .align 64 .b8 k_param_0[128]")
    assert driver_launch.ptx_param_sizes(tma) is None
    assert driver_launch.ptx_param_sizes("no entry here") is None
    assert driver_launch.ptx_param_sizes(_ptx()) == ()


def test_the_block_holds_triton_launchers_values_slot_by_slot_and_null_scratch():
    layout = driver_launch.kernel_layout(_kernel(SIGNATURE, SIG_PTX, launch_pdl=True, num_warps=8, shared=99000))
    assert layout is not None and layout.positions == (0, 1, 2, 4, 5, 6) and layout.params == 8
    args = (0x7F00_1234_5670, -3, 0.1, 64, 2**40 + 5, 0x7F00_0000_0010, 0xFFFF_FFF0)
    direct = driver_launch.DirectLaunch(layout, 0xABC, (5, 2, 1), 0x5555, args)
    raw = direct.block
    slot = [int.from_bytes(raw[8 * i:8 * i + 8], "little") for i in range(8)]
    assert len(raw) == 64
    assert slot == [0x7F00_1234_5670, (-3) & 0xFFFFFFFF, _bits32(0.1), 2**40 + 5, 0x7F00_0000_0010, 0xFFFF_FFF0, 0, 0]
    config = direct.config
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (5, 2, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ, config.sharedMemBytes) == (256, 1, 1, 99000)
    assert config.hStream == 0x5555 and config.numAttrs == 1
    # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert (config.attrs[0].id, config.attrs[0].value) == (6, 1)
    launch = driver_launch._Launch.from_address(direct.address)  # what native_replay.c reads
    assert (launch.config, launch.function, launch.block, launch.params) == (ctypes.addressof(config), 0xABC,
                                                                             direct.block_address, 8)


def test_a_cooperative_launch_without_pdl_sets_only_its_attribute():
    layout = driver_launch.kernel_layout(_kernel(SIGNATURE, SIG_PTX, launch_cooperative_grid=True))
    direct = driver_launch.DirectLaunch(layout, 1, (1, 1, 1), 0, (1, 2, 0.5, 0, 3, 4, 5))
    assert direct.config.numAttrs == 1 and (direct.config.attrs[0].id, direct.config.attrs[0].value) == (2, 1)
    plain = driver_launch.kernel_layout(_kernel(SIGNATURE, SIG_PTX))
    assert driver_launch.DirectLaunch(plain, 1, (1, 1, 1), 0, (1, 2, 0.5, 0, 3, 4, 5)).config.numAttrs == 0


@pytest.mark.parametrize("change", [
    "ptx sizes differ", "ptx has fewer params", "i1 parameter", "tuple parameter", "tensor descriptor",
    "two CTAs per cluster", "global scratch", "profile scratch", "instrumented", "oversized shared", "no ptx"])
def test_a_kernel_that_could_be_packed_otherwise_keeps_tritons_launcher(change):
    signature, ptx, meta = dict(SIGNATURE), SIG_PTX, {}
    if change == "ptx sizes differ":
        ptx = _ptx("ptr", "u64", "f32", "u64", "ptr", "u32", "ptr", "ptr")
    elif change == "ptx has fewer params":
        ptx = _ptx("ptr", "u32", "f32", "u64", "ptr", "u32")
    elif change == "i1 parameter":  # Triton 3.6 packs it in 1 byte, 3.8 in 4
        signature["n"], ptx = "i1", _ptx("ptr", "u8", "f32", "u64", "ptr", "u32", "ptr", "ptr")
    elif change == "tuple parameter":
        signature["n"] = ("i32", "i32")
    elif change == "tensor descriptor":
        signature["A"] = "tensordesc<bf16[64, 64]>"
    elif change == "two CTAs per cluster":
        meta["num_ctas"] = 2
    elif change == "global scratch":
        meta["global_scratch_size"] = 128
    elif change == "profile scratch":
        meta["profile_scratch_size"] = 64
    elif change == "instrumented":
        meta["instrumentation_mode"] = "gsan"
    elif change == "oversized shared":
        meta["shared"] = 228 * 1024 + 1
    kernel = _kernel(signature, ptx, **meta)
    if change == "no ptx":
        kernel.asm = {}
    assert driver_launch.kernel_layout(kernel) is None
    assert driver_launch.kernel_layout(_kernel(SIGNATURE, SIG_PTX)) is not None  # the unchanged kernel is taken


class _Kernel(SimpleNamespace):
    """A CompiledKernel stand-in for bind_launches whose Triton launcher records its calls."""

    packed_metadata = "packed"

    def run(self, *args):
        self.calls.append(args)


def _signature_of(launch) -> dict:
    """The JIT's signature of ``launch`` as a stand-in for its compile: constexprs, pointers, floats, ints."""
    from dsv4_attn.portable.kernels.launch import ordered_parameters

    types = {}
    for name, value in zip(launch.fn.arg_names, ordered_parameters(launch)):
        if name in launch.constexprs:
            types[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            types[name] = "*fp32"
        elif isinstance(value, float):
            types[name] = "fp32"
        else:
            types[name] = "i64"
    return types


def _stand_in(launch, function: int) -> _Kernel:
    signature = _signature_of(launch)
    sizes = ["ptr" if t.startswith("*") else {"fp32": "f32", "i64": "u64"}[t]
             for t in signature.values() if t != "constexpr"]
    return _Kernel(src=SimpleNamespace(signature=signature), asm={"ptx": _ptx(*sizes, "ptr", "ptr")},
                   metadata=SimpleNamespace(num_ctas=1, num_warps=4, shared=0, global_scratch_size=0,
                                            profile_scratch_size=0, launch_pdl=True, launch_cooperative_grid=False),
                   hash=f"stand-in-{function}", function=function, calls=[])


@pytest.fixture
def bound(gen, monkeypatch):
    """A split layer call's launches (attention + combine, temporaries in a workspace) bound to
    stand-in kernels that pack directly; the driver replaced by a recorder."""
    from dsv4_attn.common.spec import LayerKind
    from dsv4_attn.portable.kernels import launch
    from dsv4_attn.testing.steps import make_step

    case = make_step(gen, [1, 3], [40, 90], kinds=(LayerKind.SWA, LayerKind.C4A), topk=16, max_model_len=1024)
    layer = c4a_launches(case, split=2)
    kernels = [_stand_in(one, 0x100 + i) for i, one in enumerate(layer.launches)]
    sent, codes = [], []

    def driver(config, function, params, extra) -> int:  # cuLaunchKernelEx's stand-in, called from C
        # the parameter pointers the C replay made (on its stack: read them now), as many as the
        # launch's struct direct_launch, just before its configuration, says it has
        count = driver_launch._Launch.from_address(config - driver_launch._CONFIG_AT).params
        sent.append((config, function, ctypes.cast(params, ctypes.POINTER(ctypes.c_uint64))[:count], extra))
        return codes.pop(0) if codes else 0

    recorder = _LAUNCH_KERNEL_EX(driver)
    monkeypatch.setattr(driver_launch, "launch_kernel_ex", lambda: ctypes.cast(recorder, ctypes.c_void_p).value)
    monkeypatch.setattr(launch, "_stream_of", lambda: lambda index: 0x77)
    monkeypatch.setattr(launch, "_LAYOUTS", {})
    return SimpleNamespace(layer=layer, kernels=kernels, sent=sent, codes=codes, launch=launch, recorder=recorder)


_LAUNCH_KERNEL_EX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


def _bind(bound):
    cpu = torch.device("cpu")
    return bound.launch.bind_launches(bound.layer, bound.kernels, cpu, bound.launch.Workspace(cpu))


@needs_triton
def test_a_replay_hands_the_driver_the_arguments_tritons_launcher_would_get(bound):
    launch = bound.launch
    workspace = launch.Workspace(torch.device("cpu"))
    replay = launch.bind_launches(bound.layer, bound.kernels, torch.device("cpu"), workspace)
    assert replay() is True and replay() is True
    assert all(k.calls == [] for k in bound.kernels)  # Triton's launcher never ran
    assert len(bound.sent) == 2 * len(bound.kernels)
    triton_launches = [replay.triton_launch(i) for i in range(len(bound.kernels))]
    for sent, triton_launch, direct, kernel in zip(bound.sent, triton_launches, launch.direct_launches(replay),
                                                   bound.kernels):
        block = direct.block_address  # each parameter read from its slot
        assert sent == (ctypes.addressof(direct.config), kernel.function,
                        list(range(block, block + 8 * direct.layout.params, 8)), None)
        triton_args = triton_launch[1]
        assert triton_args[:9] == (*direct_grid(direct), 0x77, kernel.function, "packed", None, None, None)
        params = [a for a, t in zip(triton_args[9:], kernel.src.signature.values()) if t != "constexpr"]
        raw = direct.block
        for i, value in enumerate(params):
            slot = int.from_bytes(raw[8 * i:8 * i + 8], "little")
            assert slot == (_bits32(value) if isinstance(value, float) else value & (2**64 - 1))
        assert raw[8 * len(params):] == bytes(16)  # the null scratch pointers
        assert direct.config.hStream == 0x77 and direct.config.attrs[0].id == 6
    assert bound.sent[:len(bound.kernels)] == bound.sent[len(bound.kernels):]  # the same every call


def direct_grid(direct) -> tuple[int, int, int]:
    c = direct.config
    return c.gridDimX, c.gridDimY, c.gridDimZ


@needs_triton
def test_no_context_takes_tritons_launcher_and_another_error_raises(bound, monkeypatch):
    replay = _bind(bound)
    bound.codes.extend([driver_launch.CUDA_ERROR_INVALID_CONTEXT])
    assert replay() is True
    assert len(bound.kernels[0].calls) == 1 and bound.kernels[0].calls[0] == replay.triton_launch(0)[1]
    assert bound.kernels[1].calls == []  # the next launch went to the driver again
    monkeypatch.setattr(driver_launch, "error_text", lambda code: f"CUDA error {code} (CUDA_ERROR_ILLEGAL_ADDRESS)")
    bound.codes.extend([0, 700])
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx: CUDA error 700 \\(CUDA_ERROR_ILLEGAL_ADDRESS\\)"):
        replay()


@needs_triton
def test_direct_launch_off_binds_tritons_launcher(bound, monkeypatch):
    monkeypatch.setenv("DSV4_ATTN_DIRECT_LAUNCH", "0")
    replay = _bind(bound)
    assert replay() is True
    assert bound.sent == [] and bound.launch.direct_launches(replay) == [] \
        and all(len(k.calls) == 1 for k in bound.kernels)
    monkeypatch.setenv("DSV4_ATTN_DIRECT_LAUNCH", "sometimes")
    with pytest.raises(ValueError, match="DSV4_ATTN_DIRECT_LAUNCH: got 'sometimes'; allowed: 1/on or 0/off"):
        _bind(bound)
