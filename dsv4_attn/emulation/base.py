"""The state one emulated AITER installation keeps (what it ships, what it has loaded, what was
called) and the code-object lookup every kernel model shares."""

from __future__ import annotations

import torch

from .contract import capturing, fail
from .releases import (
    ARCHS,
    ASM_017,
    CU_NUM,
    FLAVORS,
    NATIVE_PERSISTENT,
    NO_GFX942_QH64,
    SPLIT_LSE_RAISES,
    STAGE1,
    V4_NM_OBJECT,
    VERSIONS,
    CodeObject,
)


class EmulatorBase:
    """What every emulated kernel reads of its installation: ``arch`` gfx942 (FNUZ fp8) or gfx950
    (OCP fp8), ``flavor`` (a release, :data:`.releases.FLAVORS`), the shipped code objects
    (``asm_objects``), the modules loaded so far (``loaded``), the call log (``calls``:
    ``(function, detail)``; ``call_bytes``: the fp32 partials each persistent call allocates)."""

    def __init__(self, arch: str = "gfx950", flavor: str = "0.1.20") -> None:
        if arch not in ARCHS:
            raise ValueError(f"arch: got {arch!r}; allowed: {ARCHS}")
        if flavor not in FLAVORS:
            raise ValueError(f"flavor: got {flavor!r}; allowed: {FLAVORS}")
        self.arch, self.flavor = arch, flavor
        self.version = VERSIONS[flavor]
        self.cu_num = CU_NUM[arch]
        self.fp8 = torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn
        self.calls: list[tuple[str, str]] = []
        self.call_bytes: list[int] = []
        self.loaded: set[str] = set()
        self.simulate_capture = False
        # bf16 split mode's stage-1 partition of a row (the code objects do not say): "mgc" splits
        # of whole stage-2 blocks (min(S, cdiv(L, mgc)) of them, what stage 2 merges) or "even"
        # (cdiv(L, S) keys each: partials stage 2 never merges when cdiv(L, mgc) < S)
        self.stage1_partition = "mgc"
        self._plans: dict[int, dict] = {}  # work_info_set data_ptr -> static facts of its plan
        legacy = flavor == "0.1.7"
        names = set(ASM_017) if legacy else {o.name for o in STAGE1[arch].values()}
        if flavor in NO_GFX942_QH64:
            names = {n for n in names if "qh64_qseqlen1_gqaratio64" not in n}
        if not legacy and arch == "gfx950":
            names.add(V4_NM_OBJECT)
        self.asm_objects = frozenset(names)

    # ---- module loading ---------------------------------------------------------------------
    def _load(self, module: str) -> None:
        if module in self.loaded:
            return
        if self.simulate_capture or capturing():
            fail("graph capture", f"a first use of {module} while capturing (AITER loads modules and "
                 "compiles Triton kernels on first use)", "every kernel variant run once before capture")
        self.loaded.add(module)

    # ---- mla_decode_fwd -------------------------------------------------------------------
    def stage1_object(self, heads: int, fp8: bool, persistent: bool, lse: bool) -> CodeObject:
        """The code object asm_mla.cu launches (aiter/mla.py folds other persistent head counts of
        32..128 into 16-head pseudo-batches); AiterContractError where it finds none."""
        if persistent and heads not in NATIVE_PERSISTENT[self.arch] and heads in range(32, 129, 16):
            heads = 16
        # lse_flag: ``lse != nullptr && persistent`` from 0.1.19, ``lse != nullptr`` before
        lse_flag = lse if self.flavor in SPLIT_LSE_RAISES else lse and persistent
        obj = STAGE1[self.arch].get((persistent, fp8, heads, lse_flag))
        if obj is None or obj.name not in self.asm_objects:
            fail("q", f"{heads} heads, {'fp8' if fp8 else 'bf16'} q/kv, {'persistent' if persistent else 'split'}"
                 f"{', LSE' if lse and persistent else ''} on {self.arch}",
                 "a shipped code object (asm_mla.cu: 'cannot get heuristic kernel'); modelled: split 16/128 "
                 f"heads bf16 or fp8, persistent fp8 {sorted({k[2] for k in STAGE1[self.arch] if k[0]})}")
        return obj

