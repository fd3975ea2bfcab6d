"""StepBatch: what the engine hands over once per step (docs/semantics.md "Positions").

Tokens are laid out request by request (decodes first, as vLLM reorders them); token t of
request r sits at ``pos = seq_lens[r] - query_len[r] + (t - query_start_loc[r])``. Tokens at
index >= ``query_start_loc[-1]`` (up to ``num_tokens``) are padding, e.g. a CUDA-graph batch
padded to its capture size: they are invalid and get empty rows everywhere.

Engines keep these tensors as persistent buffers and rewrite them in place between steps, so
nothing derived from their CONTENTS is cached here: positions, requests and validity are
computed anew at every access, and ``SparseMLA.plan()`` re-runs the host checks (and, when
``num_tokens`` was not given, re-reads it) at every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .spec import LayerKind


def _check_int_tensor(name: str, t, dim: int, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: got {type(t).__name__}; allowed: a torch.int32 tensor")
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: got dtype {t.dtype}; allowed: torch.int32")
    if t.dim() != dim:
        raise ValueError(f"{name}: got shape {tuple(t.shape)}; allowed: a {dim}-d tensor")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: got device {t.device}; allowed: {device} (the batch's device)")


def _check_table(name: str, table: torch.Tensor, lengths: torch.Tensor, block_size: int,
                 num_blocks: int | None, cache: str) -> None:
    """Block ids of the used columns (``cdiv(lengths[r], block_size)`` per request r) lie in
    ``[0, num_blocks)`` (``num_blocks`` None: unbounded) with slots that fit int32."""
    need = (lengths + block_size - 1) // block_size
    if need.numel() and int(need.max()) > table.shape[1]:
        r = int(need.argmax())
        raise ValueError(
            f"{name}: got {table.shape[1]} columns; allowed: >= {int(need[r])} "
            f"(request {r} needs cdiv({int(lengths[r])}, {block_size}) blocks)"
        )
    used = torch.arange(table.shape[1])[None, :] < need[:, None]
    rows = table[: lengths.shape[0]].cpu().long()  # unused columns may hold anything: no kernel reads them

    def first(bad: torch.Tensor) -> str:
        r, c = (int(i) for i in bad.nonzero()[0])
        return f"block id {int(rows[r, c])} at request {r}, column {c}"

    if bool((rows.lt(0) & used).any()):
        raise ValueError(f"{name}: got {first(rows.lt(0) & used)} (a used column); allowed: block ids >= 0")
    if num_blocks is not None and bool((rows.ge(num_blocks) & used).any()):
        raise ValueError(
            f"{cache}: too small for this step: {name} holds {first(rows.ge(num_blocks) & used)}; "
            f"allowed: block ids < {num_blocks}, the cache's num_blocks (block table and cache disagree)"
        )
    too_big = rows.ge(2**31 // block_size) & used  # (id + 1) * block_size > 2**31
    if bool(too_big.any()):
        raise ValueError(
            f"{name}: got {first(too_big)}; allowed: block ids whose slots "
            f"(block * {block_size} + offset) fit int32, the kernels' index type"
        )


def require_num_tokens(num_tokens: int | None, what_check_does: str) -> int:
    """A step's ``num_tokens`` as its last ``check()`` left it; ValueError when it was set to None
    since (``what_check_does``: how check() would fill it in). StepBatch and StepRows share it."""
    if num_tokens is None:
        raise ValueError("num_tokens: got None since the last check(); allowed: an int, or call check() "
                         f"to {what_check_does}")
    return num_tokens


@dataclass
class StepBatch:
    """One engine step.

    query_start_loc   int32 [R+1]  token offsets of the R requests (query_start_loc[0] == 0)
    seq_lens          int32 [R]    sequence length of each request INCLUDING this step's tokens
    num_decode_tokens int          tokens [0, num_decode_tokens) are decode tokens
    swa_block_table   int32 [R, nb]   SWA-cache block ids per request
    swa_block_size    int          tokens per SWA-cache block (64 in vLLM)
    comp_block_tables {ratio: int32 [R, nb]} compressed-cache block tables, one per compression
                      ratio of the model (V4: 4 and 128; V4.1: 1 and 2); a missing ratio makes
                      that layer kind unusable in this step
    block_size        int          UNCOMPRESSED tokens per compressed-cache block (256 in vLLM);
                      the compressed cache of ratio r holds block_size // r entries per block
    max_model_len     int          longest sequence the engine serves
    num_tokens        int | None   T including padding tokens; default query_start_loc[-1],
                      re-read at every plan() (reading it from a GPU tensor syncs: engines pass it)
    swa_start         int32 [>= R] | None   the first position each request holds window keys
                      for: its tokens' SWA rows start at max(pos - W + 1, swa_start[r]). vLLM's
                      SWA bounded replay for DeepSeek-V4.1 rebuilds a prefix hit's window from
                      there (docs/semantics.md#swa-rows). None: 0 for every request.
    max_seq_len       int | None   a host bound of seq_lens (vLLM's ``max_seq_len``): the rows of
                      the "all" kinds (C128A) are then built only as wide as the longest request
                      needs -- a power of two >= 128 columns, at most the model's width -- so a
                      short-context step launches no empty splits; inside a CUDA-graph capture
                      they keep the model's width (a replay may meet any length). None: the
                      model's width. A bound below a request's length drops its oldest entries
                      (``validate()`` checks it).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_decode_tokens: int
    swa_block_table: torch.Tensor
    swa_block_size: int
    comp_block_tables: dict[int, torch.Tensor] = field(default_factory=dict)
    block_size: int = 256
    max_model_len: int = 65536
    num_tokens: int | None = None
    swa_start: torch.Tensor | None = None
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        self._num_tokens_given = self.num_tokens is not None
        self.check()

    # ---- validation -------------------------------------------------------------------
    def check(self) -> StepBatch:
        """Host checks of dtypes, ranks, devices and scalar ranges (run at construction and by
        every ``plan()``). When ``num_tokens`` was not given it is re-read from
        ``query_start_loc[-1]`` here (a device sync on GPU: engines pass it)."""
        if not self._num_tokens_given:
            self.num_tokens = None
        self._check_shapes()
        if self.num_tokens is None:
            self.num_tokens = int(self.query_start_loc[-1])
            if self.num_decode_tokens > self.num_tokens:
                raise ValueError(f"num_decode_tokens: got {self.num_decode_tokens}; allowed: <= num_tokens "
                                 f"({self.num_tokens} = query_start_loc[-1])")
        return self

    def _check_shapes(self) -> None:
        """Host-only checks (no device sync): dtypes, ranks, devices, scalar ranges."""
        _check_int_tensor("query_start_loc", self.query_start_loc, 1)
        dev = self.query_start_loc.device
        num_reqs = self.query_start_loc.shape[0] - 1
        if num_reqs < 0:
            raise ValueError("query_start_loc: got an empty tensor; allowed: shape [R+1] with R >= 0")
        _check_int_tensor("seq_lens", self.seq_lens, 1, dev)
        if self.seq_lens.shape[0] != num_reqs:
            raise ValueError(
                f"seq_lens: got shape {tuple(self.seq_lens.shape)}; allowed: [{num_reqs}] (one per request)"
            )
        _check_int_tensor("swa_block_table", self.swa_block_table, 2, dev)
        if self.swa_block_table.shape[0] < num_reqs:
            raise ValueError(
                f"swa_block_table: got {self.swa_block_table.shape[0]} rows; allowed: >= {num_reqs} (R)"
            )
        if self.swa_start is not None:
            _check_int_tensor("swa_start", self.swa_start, 1, dev)
            if self.swa_start.shape[0] < num_reqs:
                raise ValueError(
                    f"swa_start: got shape {tuple(self.swa_start.shape)}; allowed: [>= {num_reqs}] (one per request)"
                )
        bounds = (("swa_block_size", self.swa_block_size), ("block_size", self.block_size),
                  ("max_model_len", self.max_model_len))
        for name, value in bounds + ((("max_seq_len", self.max_seq_len),) if self.max_seq_len is not None else ()):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: got {value!r}; allowed: a positive int")
        if not isinstance(self.comp_block_tables, dict):
            raise ValueError(f"comp_block_tables: got {type(self.comp_block_tables).__name__}; allowed: a dict")
        for ratio, table in self.comp_block_tables.items():
            if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio <= 0:
                raise ValueError(f"comp_block_tables: got key {ratio!r}; allowed: compression ratios (positive "
                                 "ints: 4 and 128 for V4, 1 and 2 for V4.1)")
            _check_int_tensor(f"comp_block_tables[{ratio}]", table, 2, dev)
            if table.shape[0] < num_reqs:
                raise ValueError(
                    f"comp_block_tables[{ratio}]: got {table.shape[0]} rows; allowed: >= {num_reqs} (R)"
                )
            if self.block_size % ratio:
                raise ValueError(
                    f"block_size: got {self.block_size}; allowed: a multiple of {ratio} "
                    f"(the ratio-{ratio} cache holds block_size // {ratio} entries per block)"
                )
        nd = self.num_decode_tokens
        if isinstance(nd, bool) or not isinstance(nd, int) or nd < 0:
            raise ValueError(f"num_decode_tokens: got {nd!r}; allowed: an int >= 0")
        if self.num_tokens is not None:
            nt = self.num_tokens
            if isinstance(nt, bool) or not isinstance(nt, int) or nt < 0:
                raise ValueError(f"num_tokens: got {nt!r}; allowed: an int >= 0")
            if nd > nt:
                raise ValueError(f"num_decode_tokens: got {nd}; allowed: <= num_tokens ({nt})")

    def validate(self, cache_blocks: dict | None = None) -> StepBatch:
        """Value checks that read device tensors (a sync on GPU): call outside the hot path.

        Every block id a token reads (the used columns: ``cdiv(entries, block_size)`` of each
        request) must be >= 0 with int32 slots. ``cache_blocks`` maps "swa" and compressed
        ratios to the ``num_blocks`` of the caches those tables index; used ids must then also
        be below them (``SparseMLA.forward(validate=True)`` passes its caches' geometry).
        """
        cache_blocks = cache_blocks or {}
        qsl = self.query_start_loc.long().cpu()
        seq = self.seq_lens.long().cpu()
        if qsl[0] != 0:
            raise ValueError(f"query_start_loc: got first value {int(qsl[0])}; allowed: 0")
        qlen = qsl[1:] - qsl[:-1]
        if (qlen < 0).any():
            r = int((qlen < 0).nonzero()[0])
            raise ValueError(f"query_start_loc: got decreasing offsets at request {r}; allowed: non-decreasing")
        if int(qsl[-1]) > self.checked_num_tokens:
            raise ValueError(
                f"num_tokens: got {self.num_tokens}; allowed: >= query_start_loc[-1] = {int(qsl[-1])}"
            )
        if self.num_decode_tokens > int(qsl[-1]):
            raise ValueError(
                f"num_decode_tokens: got {self.num_decode_tokens}; allowed: <= {int(qsl[-1])} real tokens"
            )
        if self.max_seq_len is not None and (seq > self.max_seq_len).any():
            r = int((seq > self.max_seq_len).nonzero()[0])
            raise ValueError(f"max_seq_len: got {self.max_seq_len} < seq_lens[{r}] = {int(seq[r])}; allowed: a bound "
                             "of every request's length (or None)")
        if (seq < qlen).any():
            r = int((seq < qlen).nonzero()[0])
            raise ValueError(
                f"seq_lens: got seq_lens[{r}] = {int(seq[r])} < its query length {int(qlen[r])}; "
                "allowed: seq_lens include this step's tokens"
            )
        if self.swa_start is not None:
            start = self.swa_start[: self.num_reqs].long().cpu()
            late = (start < 0) | ((qlen > 0) & (start > seq - qlen))
            if late.any():
                r = int(late.nonzero()[0])
                raise ValueError(
                    f"swa_start: got swa_start[{r}] = {int(start[r])}; allowed: 0 .. {int(seq[r] - qlen[r])}, the "
                    "request's first query position (its tokens must see their own keys)"
                )
        if seq.numel() and int(seq.max()) > self.max_model_len:
            raise ValueError(f"seq_lens: got max {int(seq.max())}; allowed: <= max_model_len ({self.max_model_len})")
        _check_table("swa_block_table", self.swa_block_table, seq, self.swa_block_size, cache_blocks.get("swa"),
                     "swa_cache")
        for ratio, table in self.comp_block_tables.items():
            entries = torch.div(seq, ratio, rounding_mode="floor")
            _check_table(f"comp_block_tables[{ratio}]", table, entries, self.block_size // ratio,
                         cache_blocks.get(ratio), "comp_cache")
        return self

    def to(self, device: torch.device | str) -> StepBatch:
        """This step with its tensors on ``device`` (a given ``num_tokens`` stays given)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, query_start_loc=self.query_start_loc.to(device), seq_lens=self.seq_lens.to(device),
                       swa_block_table=self.swa_block_table.to(device),
                       comp_block_tables={r: t.to(device) for r, t in self.comp_block_tables.items()},
                       num_tokens=self.num_tokens if self._num_tokens_given else None,
                       swa_start=move(self.swa_start))

    # ---- derived per-token tensors ------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return self.query_start_loc.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    @property
    def checked_num_tokens(self) -> int:
        """``num_tokens`` as the last :meth:`check` left it (construction and every ``plan()``
        run it): never None, unless set to None since."""
        return require_num_tokens(self.num_tokens, "re-read query_start_loc[-1]")

    def comp_block_size(self, kind: LayerKind) -> int:
        """Entries per compressed-cache block of a compressed layer kind: block_size // ratio."""
        kind = LayerKind.parse(kind)
        if not kind.has_comp_scope:
            raise ValueError(f"kind: got {kind.name}; allowed: a kind with a compressed cache")
        return self.block_size // kind.ratio

    def comp_block_table(self, kind: LayerKind) -> torch.Tensor:
        kind = LayerKind.parse(kind)
        if kind.ratio not in self.comp_block_tables:
            raise ValueError(
                f"comp_block_tables: has no ratio-{kind.ratio} table; allowed: provide "
                f"comp_block_tables[{kind.ratio}] to run {kind.name} layers"
            )
        return self.comp_block_tables[kind.ratio]

    def window_starts(self, token_to_req: torch.Tensor) -> torch.Tensor | None:
        """int64 [T]: ``swa_start`` of each token's request (0 for padding tokens), or None
        without ``swa_start``. ``token_to_req`` int32 [T] as ``token_facts`` gives it."""
        if self.swa_start is None:
            return None
        start = self.swa_start.long()[token_to_req.long().clamp(min=0)] if token_to_req.numel() else \
            torch.zeros(0, dtype=torch.int64, device=self.device)
        return torch.where(token_to_req >= 0, start, torch.zeros_like(start))

    def token_facts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions int64 [T], token_to_req int32 [T], token_valid bool [T]) computed now from
        the tensors' current contents (never cached: engines rewrite them in place)."""
        t = torch.arange(self.checked_num_tokens, device=self.device, dtype=torch.int64)
        qsl = self.query_start_loc.long()
        req = torch.searchsorted(qsl, t, right=True) - 1
        valid = t < qsl[-1]
        req = req.clamp(0, max(self.num_reqs - 1, 0))
        if self.num_reqs == 0:
            pos = torch.zeros_like(t)
        else:
            prefix = self.seq_lens.long() - (qsl[1:] - qsl[:-1])
            pos = prefix[req] + (t - qsl[req])
        return (torch.where(valid, pos, torch.zeros_like(pos)),
                torch.where(valid, req, torch.full_like(req, -1)).to(torch.int32), valid)

    @property
    def positions(self) -> torch.Tensor:
        """int64 [T]: position of each token in its sequence (0 for padding tokens)."""
        return self.token_facts()[0]

    @property
    def token_to_req(self) -> torch.Tensor:
        """int32 [T]: request index of each token (-1 for padding tokens)."""
        return self.token_facts()[1]

    @property
    def token_valid(self) -> torch.Tensor:
        """bool [T]: False for padding tokens."""
        return self.token_facts()[2]

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        swa_block_table: torch.Tensor,
        swa_block_size: int,
        comp_block_tables: dict[int, torch.Tensor] | None = None,
        block_size: int = 256,
        max_model_len: int = 65536,
        num_decode_tokens: int | None = None,
        num_tokens: int | None = None,
        device: torch.device | str | None = None,
        swa_start: list[int] | None = None,
    ) -> StepBatch:
        """Convenience constructor from host lists. ``num_decode_tokens`` defaults to the tokens
        of the leading requests whose query length is 1."""
        if len(query_lens) != len(seq_lens):
            raise ValueError(
                f"seq_lens: got {len(seq_lens)} entries; allowed: {len(query_lens)} (one per query_lens entry)"
            )
        dev = torch.device(device) if device is not None else swa_block_table.device
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        if num_decode_tokens is None:
            num_decode_tokens = 0
            for q in query_lens:
                if q != 1:
                    break
                num_decode_tokens += 1
        return cls(
            query_start_loc=qsl.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            num_decode_tokens=num_decode_tokens,
            swa_block_table=swa_block_table.to(dev),
            swa_block_size=swa_block_size,
            comp_block_tables={k: v.to(dev) for k, v in (comp_block_tables or {}).items()},
            block_size=block_size,
            max_model_len=max_model_len,
            num_tokens=num_tokens,
            swa_start=None if swa_start is None else torch.tensor(swa_start, dtype=torch.int32, device=dev),
        )
