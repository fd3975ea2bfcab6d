"""One emulated AITER installation: the public functions of the release it models, bound to the
kernel models (:mod:`.metadata`, :mod:`.decode`, :mod:`.v4_nm`, :mod:`.sparse`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .decode import DecodeKernel
from .metadata import MetadataKernels
from .releases import POSITIONAL_NM_LAST_PAGE
from .sparse import SparseKernel
from .v4_nm import NmKernel


class AiterEmulator(MetadataKernels, DecodeKernel, NmKernel, SparseKernel):
    """One emulated AITER installation: ``arch`` gfx942 (FNUZ fp8) or gfx950 (OCP fp8) and
    ``flavor`` (see the package docstring).

    Attributes mirror what the adapter's ``load_aiter()`` seam exposes: ``version``, ``arch``,
    ``mla_decode_fwd``, ``get_mla_metadata_info_v1``, ``get_mla_metadata_v1``,
    ``mla_decode_fwd_v4_nm`` and ``sparse_mla_fwd`` (None where the flavor lacks them),
    ``asm_objects``. ``calls`` logs ``(function, detail)`` of every call, ``call_bytes`` the fp32
    partials each persistent call allocates, ``loaded`` the modules loaded so far.
    """

    emulated = True

    def __init__(self, arch: str = "gfx950", flavor: str = "0.1.20") -> None:
        super().__init__(arch, flavor)
        legacy = flavor == "0.1.7"
        self.mla_decode_fwd: Callable[..., Any] = self._mla_decode_fwd_017 if legacy else self._mla_decode_fwd_new
        self.get_mla_metadata_info_v1: Callable[..., Any] = self._info_017 if legacy else self._info_new
        self.get_mla_metadata_v1: Callable[..., Any] = self._metadata_017 if legacy else self._metadata_new
        self.mla_decode_fwd_v4_nm: Callable[..., Any] | None = (
            None if legacy else self._mla_decode_fwd_v4_nm_0117 if flavor in POSITIONAL_NM_LAST_PAGE
            else self._mla_decode_fwd_v4_nm)
        self.sparse_mla_fwd: Callable[..., Any] | None = self._sparse_mla_fwd if flavor == "sparse" else None

    def __repr__(self) -> str:
        return f"AiterEmulator(arch={self.arch!r}, flavor={self.flavor!r})"
