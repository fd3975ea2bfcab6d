"""StepRows: one engine step handed over as ready-made per-token rows.

The second way into a plan, beside :class:`~dsv4_attn.common.batch.StepBatch` (block tables,
what vLLM hands over): engines that already hold every token's GLOBAL cache slots -- SGLang's
DeepSeek-V4 metadata, FlashMLA's own ``indices`` / ``extra_indices_in_kvcache`` interface -- pass
those rows, and ``SparseMLA.plan(rows)`` views them without a copy. Per compressed ratio of the
model the step gives either

* :class:`GlobalRows`: global slots of that ratio's cache and their lengths, for any selection
  (top-k or all entries); or
* :class:`TopkTable`: a block table, for a top-k kind whose layers pass their LOCAL top-k to
  ``SparseMLA.forward(topk=...)``; the plan translates it as for a StepBatch
  (docs/semantics.md#top-k-rows), which needs each token's position and request.

A row's first ``lens[t]`` columns are read; an entry -1 (or outside its cache, see
docs/semantics.md#out-of-range-entries) inside them is skipped. The rows tensors are read when a
layer runs, not copied by ``plan()``: an engine may rewrite a top-k layer's rows in place between
layers (SGLang's indexer writes every top-k layer's rows into one per-step buffer). Their lengths
must stay the same for every layer of the step (vendor kernels plan their work once per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .batch import require_num_tokens
from .spec import LayerKind, ModelSpec


def _int_tensor(name: str, t, dim: int, device: torch.device | None, dtypes=(torch.int32,)) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: got {type(t).__name__}; allowed: a torch.int32 tensor")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: got dtype {t.dtype}; allowed: {' or '.join(map(str, dtypes))}")
    if t.dim() != dim:
        raise ValueError(f"{name}: got shape {tuple(t.shape)}; allowed: a {dim}-d tensor")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: got device {t.device}; allowed: {device} (swa_rows' device)")
    return t


def _row_pair(rows_name: str, lens_name: str, rows, lens, num_tokens: int, device: torch.device) -> None:
    _int_tensor(rows_name, rows, 2, device)
    _int_tensor(lens_name, lens, 1, device)
    for what, t in ((rows_name, rows), (lens_name, lens)):
        if t.shape[0] < num_tokens:
            raise ValueError(f"{what}: got {t.shape[0]} rows; allowed: >= num_tokens ({num_tokens})")
    if rows.shape[1] < 1:
        raise ValueError(f"{rows_name}: got shape {tuple(rows.shape)}; allowed: at least one column")
    if rows.stride(1) != 1:
        raise ValueError(f"{rows_name}: got strides {tuple(rows.stride())}; allowed: last dim contiguous (the "
                         "kernels read rows with a row stride only)")


@dataclass
class GlobalRows:
    """A compressed ratio's rows, ready made.

    rows  int32 [>= T, K]  global slots of the ratio's compressed cache, -1 = no entry;
                           last dim contiguous (any row stride)
    lens  int32 [>= T]     columns [0, lens[t]) of row t are read (0 <= lens[t] <= K)
    """

    rows: torch.Tensor
    lens: torch.Tensor


@dataclass
class TopkTable:
    """How a top-k ratio's LOCAL top-k (``SparseMLA.forward(topk=...)``) becomes slots.

    block_table  int32 [R, nb]  block ids of the ratio's compressed cache per request
    block_size   int            ENTRIES per block of that cache (the cache's block size)
    """

    block_table: torch.Tensor
    block_size: int


@dataclass
class StepRows:
    """One engine step as per-token rows (tokens [0, num_tokens)).

    swa_rows          int32 [>= T, Ws]  global slots of the SWA cache, -1 = none; last dim
                      contiguous; Ws <= spec.window
    swa_lens          int32 [>= T]      columns [0, swa_lens[t]) of row t are read
    positions         int32/int64 [>= T]  each token's position in its sequence (0 for padding);
                      top-k translation and some vendor kernels read it
    num_decode_tokens int               tokens [0, num_decode_tokens) are decode tokens (they may
                      run on another backend than the rest)
    comp              {ratio: GlobalRows | TopkTable}, one entry per compressed ratio whose layers
                      run this step; a missing ratio makes those layers unusable in the step
    token_to_req      int32 [>= T] request of each token (row of the TopkTables), -1 = padding;
                      required when ``comp`` holds a TopkTable
    num_tokens        T; default swa_rows.shape[0]

    Construction runs the host checks (dtypes, ranks, devices, shapes; no device sync);
    :meth:`validate` the value checks that read the tensors.
    """

    swa_rows: torch.Tensor
    swa_lens: torch.Tensor
    positions: torch.Tensor
    num_decode_tokens: int = 0
    comp: dict[int, GlobalRows | TopkTable] = field(default_factory=dict)
    token_to_req: torch.Tensor | None = None
    num_tokens: int | None = None

    def __post_init__(self) -> None:
        self.check()

    # ---- validation -------------------------------------------------------------------
    def check(self) -> StepRows:
        """Host checks (also run by every ``SparseMLA.plan``: engines may swap tensors)."""
        _int_tensor("swa_rows", self.swa_rows, 2, None)
        dev = self.swa_rows.device
        if self.num_tokens is None:
            self.num_tokens = self.swa_rows.shape[0]
        T = self.num_tokens
        if isinstance(T, bool) or not isinstance(T, int) or T < 0:
            raise ValueError(f"num_tokens: got {T!r}; allowed: an int >= 0")
        _row_pair("swa_rows", "swa_lens", self.swa_rows, self.swa_lens, T, dev)
        _int_tensor("positions", self.positions, 1, dev, (torch.int32, torch.int64))
        if self.positions.shape[0] < T:
            raise ValueError(f"positions: got {self.positions.shape[0]} entries; allowed: >= num_tokens ({T})")
        nd = self.num_decode_tokens
        if isinstance(nd, bool) or not isinstance(nd, int) or not 0 <= nd <= T:
            raise ValueError(f"num_decode_tokens: got {nd!r}; allowed: an int in [0, num_tokens = {T}]")
        if not isinstance(self.comp, dict):
            raise ValueError(f"comp: got {type(self.comp).__name__}; allowed: a dict ratio -> GlobalRows | TopkTable")
        for ratio, entry in self.comp.items():
            name = f"comp[{ratio}]"
            if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio <= 0:
                raise ValueError(f"comp: got key {ratio!r}; allowed: compression ratios (positive ints: 4 and 128 "
                                 "for V4, 1 and 2 for V4.1)")
            if isinstance(entry, GlobalRows):
                _row_pair(f"{name}.rows", f"{name}.lens", entry.rows, entry.lens, T, dev)
            elif isinstance(entry, TopkTable):
                _int_tensor(f"{name}.block_table", entry.block_table, 2, dev)
                bs = entry.block_size
                if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
                    raise ValueError(f"{name}.block_size: got {bs!r}; allowed: a positive int (entries per block)")
            else:
                raise ValueError(f"{name}: got {type(entry).__name__}; allowed: GlobalRows or TopkTable")
        if self.token_to_req is not None:
            _int_tensor("token_to_req", self.token_to_req, 1, dev)
            if self.token_to_req.shape[0] < T:
                raise ValueError(f"token_to_req: got {self.token_to_req.shape[0]} entries; allowed: >= num_tokens "
                                 f"({T})")
        elif any(isinstance(e, TopkTable) for e in self.comp.values()):
            raise ValueError("token_to_req: got None beside a TopkTable; allowed: int32 [T] request of each token "
                             "(the table's row; -1 for padding)")
        return self

    def check_model(self, spec: ModelSpec) -> None:
        """The rows fit the model: known ratios, TopkTables only for top-k kinds, widths within
        the model's (so backends' buffers sized from the spec hold them)."""
        if self.swa_rows.shape[1] > spec.window:
            raise ValueError(f"swa_rows: got {self.swa_rows.shape[1]} columns; allowed: <= spec.window "
                             f"({spec.window})")
        kinds = {k.ratio: k for k in spec.kinds if k.has_comp_scope}
        for ratio, entry in self.comp.items():
            if ratio not in kinds:
                raise ValueError(f"comp: got ratio {ratio}; allowed: the model's compression ratios "
                                 f"{list(spec.comp_ratios)}")
            kind = kinds[ratio]
            if isinstance(entry, TopkTable):
                if not kind.uses_topk:
                    raise ValueError(f"comp[{ratio}]: got a TopkTable for {kind.name}, which attends every entry; "
                                     "allowed: GlobalRows (its layers get no top-k to translate)")
            elif entry.rows.shape[1] > spec.comp_width(kind):
                raise ValueError(f"comp[{ratio}].rows: got {entry.rows.shape[1]} columns; allowed: <= "
                                 f"{spec.comp_width(kind)} (the {kind.name} row width of the model)")

    def validate(self, num_slots: dict | None = None) -> StepRows:
        """Value checks that read the tensors (a device sync on GPU): every length within its row,
        positions >= 0, requests and used table columns in range; with ``num_slots`` ("swa" and
        ratios -> slots of the caches the rows index) every slot inside a length is -1 or in
        [0, num_slots)."""
        num_slots = num_slots or {}
        T = self.checked_num_tokens
        # (key of num_slots: "swa" or a ratio, rows' name, lens' name, rows, lens)
        scopes: list[tuple[str | int, str, str, torch.Tensor, torch.Tensor]] = [
            ("swa", "swa_rows", "swa_lens", self.swa_rows, self.swa_lens)]
        scopes += [(r, f"comp[{r}].rows", f"comp[{r}].lens", e.rows, e.lens)
                   for r, e in self.comp.items() if isinstance(e, GlobalRows)]
        for key, rows_name, lens_name, rows, lens in scopes:
            rows, lens = rows[:T].cpu().long(), lens[:T].cpu().long()
            bad = (lens < 0) | (lens > rows.shape[1])
            if bool(bad.any()):
                t = int(bad.nonzero()[0])
                raise ValueError(f"{lens_name}: got {int(lens[t])} at token {t}; allowed: 0..{rows.shape[1]} "
                                 "(the row's width)")
            used = torch.arange(rows.shape[1])[None, :] < lens[:, None]
            limit = num_slots.get(key)
            bad = used & ((rows < -1) | (rows >= (limit if limit is not None else 2**31)))
            if bool(bad.any()):
                t, c = (int(i) for i in bad.nonzero()[0])
                allowed = f"-1 or a slot in [0, {limit})" if limit is not None else "-1 or a slot >= 0"
                cache = "swa_cache" if key == "swa" else "comp_cache"
                raise ValueError(f"{rows_name}: got {int(rows[t, c])} at token {t}, column {c}; allowed: {allowed} "
                                 f"(the slots of {cache})")
        pos = self.positions[:T].cpu()
        if pos.numel() and int(pos.min()) < 0:
            raise ValueError(f"positions: got {int(pos.min())}; allowed: >= 0")
        tables = {r: e for r, e in self.comp.items() if isinstance(e, TopkTable)}
        if tables:
            assert self.token_to_req is not None  # check() refuses a TopkTable without token_to_req
            req = self.token_to_req[:T].cpu().long()
            R = min(e.block_table.shape[0] for e in tables.values())
            bad = (req < -1) | (req >= R)
            if bool(bad.any()):
                t = int(bad.nonzero()[0])
                raise ValueError(f"token_to_req: got {int(req[t])} at token {t}; allowed: -1 (padding) or a "
                                 f"request 0..{R - 1} (a row of every TopkTable)")
        return self

    # ---- what a plan asks of its step (the same questions as of a StepBatch) -----------------
    @property
    def device(self) -> torch.device:
        return self.swa_rows.device

    @property
    def checked_num_tokens(self) -> int:
        """``num_tokens`` as the last :meth:`check` left it (construction and every ``plan()``
        run it): never None, unless set to None since."""
        return require_num_tokens(self.num_tokens, "default it to swa_rows.shape[0]")

    swa_block_size = None  # SWA rows are global slots: any cache block size

    def global_rows(self, ratio: int) -> GlobalRows | None:
        entry = self.comp.get(ratio)
        return entry if isinstance(entry, GlobalRows) else None

    def comp_block_size(self, kind: LayerKind) -> int | None:
        """Entries per block a layer's compressed cache must have: the TopkTable's block size;
        None for ratios given as GlobalRows (any block size)."""
        entry = self.comp.get(LayerKind.parse(kind).ratio)
        return entry.block_size if isinstance(entry, TopkTable) else None

    def comp_block_table(self, kind: LayerKind) -> torch.Tensor:
        kind = LayerKind.parse(kind)
        entry = self.comp.get(kind.ratio)
        if not isinstance(entry, TopkTable):
            have = "GlobalRows" if entry is not None else "no entry"
            raise ValueError(f"comp[{kind.ratio}]: got {have}; allowed: a TopkTable to translate the local top-k of "
                             f"{kind.name} layers")
        return entry.block_table

    def token_facts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions int64 [T], token_to_req int32 [T], token_valid bool [T]): padding tokens
        (request -1) are invalid; without token_to_req every token is valid, request 0. A request
        outside every TopkTable's rows (>= the fewest rows R) is padding too (request -1): its
        token reads nothing, never another request's blocks or a stale row past a ``[:R]`` view
        (docs/bad-input.md; ``validate()`` names it)."""
        T = self.checked_num_tokens
        pos = self.positions[:T].long()
        if self.token_to_req is None:
            req = torch.zeros(T, dtype=torch.int32, device=self.device)
            return pos, req, torch.ones(T, dtype=torch.bool, device=self.device)
        req = self.token_to_req[:T]
        rows = [e.block_table.shape[0] for e in self.comp.values() if isinstance(e, TopkTable)]
        if rows:
            req = torch.where(req < min(rows), req, -1)
        return pos, req, req >= 0
