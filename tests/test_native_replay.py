"""The C replay of a bound layer call (``portable/kernels/native_replay.c``), built here with
Triton's C build as on a GPU machine, the driver replaced by a ctypes stand-in of
``cuLaunchKernelEx``'s signature: its guards, the order and arguments of its launches, where it
stops on a driver error, and what it raises. (The GPU tests of tests/test_host_path.py run it
against the real driver.)"""

from __future__ import annotations

import ctypes
import importlib.util
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its C build)")

_DRIVER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


@pytest.fixture
def native():
    """The built ``replay``, a recording driver whose results ``codes`` sets, and direct launches."""
    from dsv4_attn.portable.kernels import driver_launch, native_replay

    module = native_replay.built()
    assert module is not None, "native_replay.c did not build (a C compiler and Python's headers are needed)"
    order, codes = [], []

    def driver(config, function, params, extra) -> int:  # every launch here has two parameters
        order.append(("driver", config, function, ctypes.cast(params, ctypes.POINTER(ctypes.c_uint64))[:2], extra))
        return codes.pop(0) if codes else 0

    stand_in = _DRIVER(driver)
    structs = [driver_launch._Launch(0x1000 + i, 0x2000 + i, 0x3000 + 64 * i, 2) for i in range(3)]
    # what a DirectLaunch is to the C replay: the owner of a struct direct_launch at ``address``
    launches = [SimpleNamespace(address=ctypes.addressof(x), struct=x) for x in structs]
    replay = module.replay
    return SimpleNamespace(replay=replay, order=order, codes=codes, driver=ctypes.cast(stand_in, ctypes.c_void_p).value,
                           stand_in=stand_in, launches=launches)


_IS_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


def capture_query(status: int = 0, code: int = 0) -> tuple[int, object]:
    """(address, owner) of a stand-in of the driver's cuStreamIsCapturing for stream 7 (the
    replay's) that returns ``code`` and writes ``status`` (0 none, 1 active, 2 invalidated)."""

    def query(stream, out) -> int:
        assert stream == 7
        out[0] = status
        return code

    owner = _IS_CAPTURING(query)
    return ctypes.cast(owner, ctypes.c_void_p).value, owner


def _guards(hooks=(), exit_hooks=(), stream=7, capturing=(0, 0), device=0, gpu=0):
    """The guards tuple as ``launch.Replay`` builds it, the current state given: a runtime with
    those launch hooks, current stream ``stream`` (the replay's is 7), the driver's capture query
    giving (status, code), GPU ``device``."""
    runtime = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=list(hooks)),
                              launch_exit_hook=SimpleNamespace(calls=list(exit_hooks)))
    address, owner = capture_query(*capturing)
    _OWNERS.append(owner)
    return (runtime, lambda index: stream if index == 3 else -1, 3, 7, address, lambda: device, gpu)


_OWNERS: list = []  # the stand-ins' ctypes objects, alive while the C calls them


def test_every_launch_runs_in_order_with_its_own_arguments(native):
    calls = []
    python_launch = (lambda *args: calls.append(args) or native.order.append("python"), (1, "two", None))
    items = (native.launches[0], python_launch, native.launches[1])
    assert native.replay(native.driver, items, 0, _guards()) is None
    # each parameter's address: its 8-byte slot of the block
    assert native.order == [("driver", 0x1000, 0x2000, [0x3000, 0x3008], None), "python",
                            ("driver", 0x1001, 0x2001, [0x3040, 0x3048], None)]
    assert calls == [(1, "two", None)]
    native.order.clear()
    assert native.replay(native.driver, items, 2, None) is None  # from item 2, no guards asked
    assert native.order == [("driver", 0x1001, 0x2001, [0x3040, 0x3048], None)]


@pytest.mark.parametrize("state", [dict(hooks=[print]), dict(exit_hooks=[print]), dict(stream=8),
                                   dict(capturing=(1, 0)), dict(capturing=(2, 0)), dict(capturing=(0, 906)),
                                   dict(device=1)])
def test_a_guard_that_refuses_launches_nothing(native, state):
    assert native.replay(native.driver, tuple(native.launches), 0, _guards(**state)) is False
    assert native.order == []


def test_no_gpu_to_check_skips_the_device_and_capture_guards(native):
    guards = _guards(device=5, capturing=(1, 0))
    guards = (*guards[:4], 0, guards[5], None)  # a replay bound on no GPU (the CPU tests' binding)
    assert native.replay(native.driver, tuple(native.launches), 0, guards) is None and len(native.order) == 3


def test_a_driver_error_stops_there_and_names_the_launch(native):
    native.codes.extend([0, 700])
    assert native.replay(native.driver, tuple(native.launches), 0, _guards()) == (1, 700)
    assert [o[1] for o in native.order] == [0x1000, 0x1001]  # the third never launched


def test_a_guards_or_launchers_exception_propagates(native):
    from dsv4_attn.portable.kernels import driver_launch

    def broken(index):
        raise RuntimeError("no stream here")

    guards = _guards()
    with pytest.raises(RuntimeError, match="no stream here"):
        native.replay(native.driver, tuple(native.launches), 0, (guards[0], broken, *guards[2:]))
    with pytest.raises(ZeroDivisionError):
        native.replay(native.driver, ((lambda: 1 / 0, ()), native.launches[0]), 0, _guards())
    assert native.order == []
    with pytest.raises(AttributeError, match="address"):
        native.replay(native.driver, ("not a launch",), 0, None)
    with pytest.raises(TypeError, match="launch expected 2 arguments"):
        native.replay(native.driver, ((print,),), 0, None)
    with pytest.raises(ValueError, match="a direct launch with no driver"):
        native.replay(0, tuple(native.launches), 0, None)
    too_many = driver_launch._Launch(0x1000, 0x2000, 0x3000, 1025)
    with pytest.raises(ValueError, match="a direct launch of 1025 parameters; allowed: 0 to 1024"):
        native.replay(native.driver, (SimpleNamespace(address=ctypes.addressof(too_many)),), 0, None)
    with pytest.raises(TypeError, match="replay\\(driver, launches: tuple, start, guards\\)"):
        native.replay(native.driver, list(native.launches), 0, None)

