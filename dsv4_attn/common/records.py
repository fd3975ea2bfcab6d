"""Records and KV formats as data: the FP8 dialects (:class:`Fp8Dialect`), each record's byte
layout (:class:`RecordLayout`, ``Record.X.layout``) and the records a format stores
(:class:`KVFormat`). docs/semantics.md ("Cache records") gives every record's bytes; the cache
functions (:mod:`.layout`) and the codec (:mod:`.codec`) read this description."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .spec import (
    HEAD_DIM,
    MODEL1_DATA_BYTES,
    MODEL1_PAGE_ALIGN,
    MODEL1_SCALE_BYTES,
    NOPE_DIM,
    QUANT_TILE,
    ROPE_DIM,
)


class Fp8Dialect(str, enum.Enum):
    OCP = "ocp"
    FNUZ = "fnuz"

    @classmethod
    def parse(cls, value: Fp8Dialect | str) -> Fp8Dialect:
        if isinstance(value, Fp8Dialect):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"dialect: got {value!r}; allowed: 'ocp' or 'fnuz'") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Fp8Dialect.OCP else torch.float8_e4m3fnuz

    @property
    def quant_max(self) -> float:
        """Clamp bound used when quantizing (OCP 448; FNUZ 224 as vLLM's gfx942 quantizer)."""
        return 448.0 if self is Fp8Dialect.OCP else 224.0


@dataclass(frozen=True)
class RecordLayout:
    """How one token's row is stored (docs/semantics.md "Cache records").

    elem           the cache tensor's element: "byte" (packed records, uint8), "bf16" or "fp8"
    data_bytes     bytes of a token's values: block-scaled dims first, then raw bf16 dims
    scale_bytes    bytes of a token's block scales, pad bytes included (0: none)
    values         encoding of the block-scaled dims: "e4m3", "e2m1" (two per byte) or None
    scaled_dims    dims stored as ``values`` with a block scale (448, 512) -- 0 for plain rows
    bf16_dims      dims stored as little-endian bf16 after them (V4's RoPE dims)
    group          dims per block scale
    scale          scale encoding: "ue8m0" (byte b means 2**(b - 127)), "e4m3" (an OCP e4m3 value)
    split_pages    True: a page holds all data rows, then all scale rows (V4); False: each
                   token's scales directly follow its data (V4.1)
    page_align     a page (block_size tokens) is padded to a multiple of this many bytes
    dialects       FP8 dialects the record is written in
    """

    elem: str
    data_bytes: int
    scale_bytes: int
    values: str | None
    scaled_dims: int
    bf16_dims: int
    group: int
    scale: str | None
    split_pages: bool
    page_align: int
    dialects: tuple[Fp8Dialect, ...]

    @property
    def token_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    @property
    def packed(self) -> bool:
        return self.elem == "byte"

    @property
    def row_elems(self) -> int:
        """Elements per token in the cache tensor's last dim."""
        return self.token_bytes if self.packed else HEAD_DIM

    @property
    def num_scales(self) -> int:
        return self.scaled_dims // self.group if self.group else 0


_BOTH = (Fp8Dialect.OCP, Fp8Dialect.FNUZ)


class Record(str, enum.Enum):
    """The record one cache stores (its value names the record in messages and strings)."""

    V4_FP8 = "v4_fp8"
    BF16 = "bf16"
    FP8_TENSOR = "fp8_tensor"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"

    @property
    def layout(self) -> RecordLayout:
        return _LAYOUTS[self]

    def cache_dtype(self, dialect: Fp8Dialect = Fp8Dialect.OCP) -> torch.dtype:
        elem = self.layout.elem
        return torch.uint8 if elem == "byte" else torch.bfloat16 if elem == "bf16" else dialect.torch_dtype


_LAYOUTS = {
    # vLLM fp8_ds_mla on every arch but SM100 (V4.1 too); FlashMLA "MODEL1"
    Record.V4_FP8: RecordLayout("byte", MODEL1_DATA_BYTES, MODEL1_SCALE_BYTES, "e4m3", NOPE_DIM, ROPE_DIM,
                                QUANT_TILE, "ue8m0", True, MODEL1_PAGE_ALIGN, _BOTH),
    Record.BF16: RecordLayout("bf16", 2 * HEAD_DIM, 0, None, 0, HEAD_DIM, 0, None, False, 1, _BOTH),  # no fp8
    Record.FP8_TENSOR: RecordLayout("fp8", HEAD_DIM, 0, None, 0, 0, 0, None, False, 1, _BOTH),
    # vLLM fp8_ds_mla of V4.1 on SM100; FlashMLA ModelType::V41
    Record.MXFP8: RecordLayout("byte", HEAD_DIM, 16, "e4m3", HEAD_DIM, 0, 32, "ue8m0", False, 512, _BOTH),
    # the compressed cache of vLLM nvfp4_ds_mla (SM100); FlashMLA ModelType::V41_FP4. Its scales are
    # OCP e4m3 (vLLM has no FNUZ writer or reader for it).
    Record.NVFP4: RecordLayout("byte", HEAD_DIM // 2, 32, "e2m1", HEAD_DIM, 0, 16, "e4m3", False, 512,
                               (Fp8Dialect.OCP,)),
}


class KVFormat(str, enum.Enum):
    """A KV format as vLLM's ``--kv-cache-dtype`` names it: the records of the two caches.

    ``fp8_ds_mla`` is the V4 record (what vLLM stores under that name everywhere but on SM100);
    vLLM calls the V4.1 MXFP8 record ``fp8_ds_mla`` too when it runs V4.1 on SM100 -- here it is
    ``mxfp8_ds_mla``. ``nvfp4_ds_mla`` is vLLM's name: MXFP8 SWA cache, NVFP4 compressed cache.
    """

    MODEL1_FP8 = "fp8_ds_mla"
    BF16 = "bfloat16"
    FP8_TENSOR = "fp8_e4m3"
    MXFP8 = "mxfp8_ds_mla"
    NVFP4 = "nvfp4_ds_mla"

    @classmethod
    def parse(cls, value: KVFormat | str) -> KVFormat:
        if isinstance(value, KVFormat):
            return value
        key = str(value).lower()
        if key in _FORMAT_ALIASES:
            return _FORMAT_ALIASES[key]
        raise ValueError(
            f"fmt: got {value!r}; allowed: {sorted(_FORMAT_ALIASES)} or a KVFormat member"
        )

    @property
    def swa_record(self) -> Record:
        return _FORMAT_RECORDS[self][0]

    @property
    def comp_record(self) -> Record:
        return _FORMAT_RECORDS[self][1]

    @property
    def record(self) -> Record:
        """The record of both caches; ValueError for a format whose two caches differ."""
        return _single_record(self, "fmt")

    @property
    def row_elems(self) -> int:
        """Elements per token row in the cache tensor's last dim (formats with one record)."""
        return self.record.layout.row_elems

    def cache_dtype(self, dialect: Fp8Dialect) -> torch.dtype:
        return self.record.cache_dtype(dialect)

    @property
    def uses_fp8(self) -> bool:
        return self is not KVFormat.BF16


_FORMAT_RECORDS = {
    KVFormat.MODEL1_FP8: (Record.V4_FP8, Record.V4_FP8),
    KVFormat.BF16: (Record.BF16, Record.BF16),
    KVFormat.FP8_TENSOR: (Record.FP8_TENSOR, Record.FP8_TENSOR),
    KVFormat.MXFP8: (Record.MXFP8, Record.MXFP8),
    KVFormat.NVFP4: (Record.MXFP8, Record.NVFP4),
}

_FORMAT_ALIASES = {
    "fp8_ds_mla": KVFormat.MODEL1_FP8,
    "model1_fp8": KVFormat.MODEL1_FP8,
    "model1": KVFormat.MODEL1_FP8,
    "bfloat16": KVFormat.BF16,
    "bf16": KVFormat.BF16,
    "fp8_e4m3": KVFormat.FP8_TENSOR,
    "fp8": KVFormat.FP8_TENSOR,
    "fp8_tensor": KVFormat.FP8_TENSOR,
    "mxfp8_ds_mla": KVFormat.MXFP8,
    "mxfp8": KVFormat.MXFP8,
    "nvfp4_ds_mla": KVFormat.NVFP4,
}


def _single_record(fmt: KVFormat, name: str) -> Record:
    swa, comp = _FORMAT_RECORDS[fmt]
    if swa is not comp:
        raise ValueError(
            f"{name}: got {fmt.value!r}, whose SWA cache is {swa.value} and compressed cache {comp.value}; "
            f"allowed here: one record -- pass KVFormat.{fmt.name}.swa_record or .comp_record"
        )
    return swa


def parse_record(value: Record | KVFormat | str, name: str = "fmt") -> Record:
    """The record named by a Record, a one-record KVFormat, or a string of either."""
    if isinstance(value, Record):
        return value
    if isinstance(value, KVFormat):
        return _single_record(value, name)
    key = str(value).lower()
    if key in _FORMAT_ALIASES:
        return _single_record(_FORMAT_ALIASES[key], name)
    try:
        return Record(key)
    except ValueError:
        allowed = sorted(set(_FORMAT_ALIASES) | {r.value for r in Record})
        raise ValueError(f"{name}: got {value!r}; allowed: {allowed}, a Record or a KVFormat") from None




def check_dialect(record: Record, dialect: Fp8Dialect, name: str) -> None:
    if dialect not in record.layout.dialects:
        allowed = " or ".join(d.value for d in record.layout.dialects)
        raise ValueError(f"{name}: got dialect {dialect.value!r}; allowed: {allowed} for record {record.value}")

