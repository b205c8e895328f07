"""Continuous batching with batched speculation: many sequences, one target pass per step.

Sequences join (``BatchDecoder.add``) and leave (finished, or ``cancel``) between any two
steps. Each ``step()`` runs, for every sequence in the batch:

- one drafter proposal per drafting sequence (all built into one lazy graph, evaluated once);
- ONE target forward over the rows of every sequence packed along the token axis: a decoding
  sequence contributes ``[anchor, d1..d(L-1)]`` (L = 1 is a plain step), a joining sequence the
  next chunk of its prompt (chunked prefill, interleaved with the others' decoding);
- per sequence: its own acceptance (greedy or rejection sampling), its own rollback (attention
  K/V trimmed, hybrid GDN state rebuilt from the pass's records), its own drafter context.

Exactness: the linear layers (projections, MLP / MoE, head), which dominate the cost, run once
over all packed rows. Attention runs for all decoding sequences in one call over ``BatchKV``,
the batch's shared K/V: one slot per sequence, ragged on the right (each row its own offset, so
a ragged rollback only lowers that row's offset; mlx-lm's ``BatchKVCache`` left-pads sequences
into one tensor written at one shared column and trims all rows by the same amount: a ragged
rollback would leave holes). A sequence prefills in its own ordinary mlx-lm caches and gets
them back, exactly its positions, when it leaves. The GDN recurrence (and the attention of
hybrid targets) runs per sequence against that sequence's own caches (``KVCache`` /
``ArraysCache``), rolled back exactly as a single sequence does. A packed row sees exactly the
computation it would alone; only float rounding (a matmul over a different row count, a
masked SDPA over the longest row's keys) can differ: greedy output is tested equal token for
token in float32; in 16-bit a near-tie between two tokens can round the other way. Which
attention path runs (``BatchDecoder.attention``) is checked at build time and logged.

The per-step budget (``BatchBudget``) chooses, from the batch size, each sequence's running
acceptance and a step-cost model fitted online (``t = a + b*rows + c*drafting``), which
sequences draft this step and how long their blocks are: as the batch grows and compute binds,
drafting must pay for its rows or stop (a sequence that stopped is probed now and then).

The decoder yields ``decode.Step``s per sequence, so ``stats.Stats`` works per request as for a
single stream. Everything runs on the engine thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.models.base import create_attention_mask, create_ssm_mask, scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, KVCache

from . import gdn
from .drafter import Drafter, Proposal, block_mask, skip_rows
from .errors import MlxSpecError, UnsupportedModel
from .lookup import SuffixIndex
from .policy import CHAINS, DFLASH, LOOKUP, PLAIN, Context, Decision
from .prefix import Prefill
from .sampling import SamplingConfig, accept_greedy, next_token, sample_target, sampled_acceptance
from .target import Target, feature_view

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# What a decoding step commits


@dataclass(frozen=True, slots=True)
class Step:
    """Tokens committed by one step. The first step of a run is the prefill (target's token)."""

    tokens: tuple[int, ...]
    drafted: int = 0  # draft tokens proposed this cycle (block_size - 1)
    accepted: int = 0  # of those, accepted (tokens = accepted + 1 bonus, before truncation)
    block_size: int = 1
    # the drafter's pass, until its tokens are on the host (0 for lookup/plain)
    draft_ms: float = 0.0
    # the target's pass: from building its graph until its choice is on the host; a pipelined
    # plain step: the wait for its token when it is read (its pass partly overlapped host work)
    verify_ms: float = 0.0
    rollback_ms: float = 0.0  # target cache rollback (hybrid targets: GDN state rebuild)
    elapsed_ms: float = 0.0  # wall time of the whole step, host work included
    prefill: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (prefill step)
    finish_reason: str | None = None  # "stop" (EOS) | "length" | None
    source: str = ""  # "plain" | "dflash" | "lookup" | "mtp" | "eagle" for a decoding cycle ("" otherwise)
    draft_block: int = 0  # the block the drafter ran at this cycle (0: it did not run); pick() may
    # then have verified a prefix of it or the lookup's draft: block_size is what was verified
    # points where the loop waited for the device this step (``DeviceWaits``; 0: not counted)
    host_syncs: int = 0
    head_passes: int = 0  # a chain drafter's passes this cycle (an MTP / EAGLE-3 draft of k: k)
    # the drafter's tokens were read in the verify's one wait (nothing to pick): ``verify_ms``
    # times both passes, from the drafter's graph to the target's choices, and ``draft_ms`` is 0
    draft_in_verify: bool = False


def untimed(step: Step) -> Step:
    """The step without its timings (what a seeded sampled run's policy may learn from)."""
    return replace(step, draft_ms=0.0, verify_ms=0.0, rollback_ms=0.0, elapsed_ms=0.0)


def prefix_start(prefill: Prefill | None, prompt: Sequence[int]) -> int:
    """How many prompt tokens ``prefill``'s caches hold already (0 without one)."""
    if prefill is None:
        return 0
    n = len(prefill.tokens)
    if n >= len(prompt) or tuple(prompt[:n]) != tuple(prefill.tokens):
        raise ValueError("the prefill's tokens must be a proper prefix of the prompt")
    return n


def hand_over(on_exit, make) -> None:
    """Give the final caches (``make()``; None = nothing to keep) away; a failure here must not
    turn a finished reply into an error."""
    if on_exit is None:
        return
    try:
        got = make()
        if got is not None:
            on_exit(got)
    except Exception:  # pragma: no cover - logged, the reply is already complete
        log.exception("could not keep the caches for prefix reuse")


def truncate_reply(tokens: list[int], n_done: int, max_tokens: int, eos: frozenset[int]):
    """Truncate after the first EOS or at max_tokens; return (tokens, finish_reason)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], "stop"
    room = max_tokens - n_done
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None


def lookup_context(index, max_lookup: int, room: int, greedy: bool) -> Context:
    """What a per-cycle policy decides a sequence's next cycle from: the lookup ``index``'s
    proposal (none without an index), at most ``max_lookup`` drafts and one fewer than the
    ``room`` tokens left to commit."""
    look, match = index.propose(min(max_lookup, room - 1)) if index is not None else ([], 0)
    return Context(tuple(look), match, room, greedy)


class DeviceWaits:
    """Every point where the decode loop waits for the device (``mx.eval``, a read of an array's
    values to the host) goes through one of these, so the waits per step are counted (and a test
    can count them by replacing it). ``count`` is the running total."""

    def __init__(self):
        self.count = 0

    def eval(self, *arrays) -> None:
        """Wait until ``arrays`` are computed."""
        self.count += 1
        mx.eval(*arrays)

    def read(self, *arrays: mx.array) -> list:
        """The values of ``arrays`` on the host (each a Python number or list), all computed in
        one wait."""
        self.count += 1
        mx.eval(*arrays)
        return [a.tolist() for a in arrays]


# --------------------------------------------------------------------------------------------
# The packed target forward


class Seg(NamedTuple):
    """One sequence's rows in a packed forward."""

    ids: mx.array  # (r,) int32
    cache: list  # that sequence's target cache (advanced by r)
    record: bool  # a verify pass: record GDN inputs for a later rollback
    logits: str  # "all" | "last" | "none": which rows' logits to compute
    row: Row | None = None  # its place in the batch's shared K/V (``BatchKV``), when it has one


class SegOut(NamedTuple):
    logits: mx.array | None  # (r, V), (1, V) or None
    hidden: mx.array | None  # (1, r, n_taps * H) tapped features, or None
    records: dict  # GDN layer index -> gdn.GDNRecord (record=True on a hybrid target)
    final: mx.array | None = None  # (1, r, H) the last hidden after the final norm (an MTP head's input)


def _same(a, b, tol: float = 1e-5) -> bool:
    return a.shape == b.shape and bool(mx.allclose(a, b, rtol=tol, atol=tol))


def _mirrors_attention(attn: nn.Module, norm: nn.Module) -> bool:
    """True when ``_attention`` (packed projections, per-sequence RoPE/cache/SDPA) computes what
    this attention module computes; checked numerically on a small input over two calls.
    ``norm``: the layer's input norm (for the width and dtype of the input)."""
    need = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
    if not all(hasattr(attn, n) for n in need):
        return False
    w = norm.weight
    x = mx.random.normal((1, 5, w.shape[0]), key=mx.random.key(0)).astype(w.dtype)
    try:
        real, mine = KVCache(), KVCache()
        want = [attn(x[:, :3], "causal", real), attn(x[:, 3:], "causal", real)]
        got = [
            _attention(attn, x[:, :3], [(0, 3)], [mine], ["causal"]),
            _attention(attn, x[:, 3:], [(0, 2)], [mine], ["causal"]),
        ]
        return all(_same(w, g) for w, g in zip(want, got))
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return False


def _attention(attn, x, bounds, caches, masks, pos=None, rows=None, layer=None):
    """The attention of a llama/qwen2/qwen3-style module over packed rows ``x`` (1, R, D): the
    projections, norms and RoPE once over all rows (each row at its own position ``pos``, rows on
    RoPE's batch axis), then the cache update and SDPA: for the first ``rows.n`` sequences (a
    ``RowsPlan``: sequences in the batch's shared K/V) one scatter and one SDPA for all of them,
    for the others per sequence against its own cache."""
    R = x.shape[1]
    if pos is None:
        pos = mx.array([c.offset + j for (a, b), c in zip(bounds, caches) for j in range(b - a)], mx.int32)
    qs = attn.q_proj(x).reshape(1, R, attn.n_heads, -1)
    ks = attn.k_proj(x).reshape(1, R, attn.n_kv_heads, -1)
    vs = attn.v_proj(x).reshape(1, R, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if "q_norm" in attn:
        qs, ks = attn.q_norm(qs), attn.k_norm(ks)
    qs = attn.rope(qs.transpose(1, 2, 0, 3), offset=pos).transpose(2, 1, 0, 3)  # (1, nh, R, hd)
    ks = attn.rope(ks.transpose(1, 2, 0, 3), offset=pos).transpose(2, 1, 0, 3)
    outs, skip = [], 0
    if rows is not None and rows.n:
        outs.append(rows.attend(layer, qs, ks, vs, attn.scale))
        skip = rows.n
    one = len(bounds) == 1 and not skip
    for (a, b), c, m in zip(bounds[skip:], caches[skip:], masks[skip:]):
        q, k, v = (qs, ks, vs) if one else (qs[:, :, a:b], ks[:, :, a:b], vs[:, :, a:b])
        k, v = c.update_and_fetch(k, v)
        o = scaled_dot_product_attention(q, k, v, cache=c, scale=attn.scale, mask=m)
        outs.append(o.transpose(0, 2, 1, 3).reshape(1, b - a, -1))
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)  # (1, R, nh * hd)
    return attn.o_proj(o)


# --------------------------------------------------------------------------------------------
# The batch's shared K/V: one buffer per attention layer, one row per decoding sequence


@dataclass(eq=False)
class Row:
    """A decoding sequence's place in ``BatchKV``: its slot and how many positions it holds."""

    slot: int
    offset: int


class RowsPlan(NamedTuple):
    """One step's writes and attention over the rows of ``BatchKV`` (built once per step).

    Uniform blocks (or blocks that mostly fill the longest) attend in one SDPA over all rows,
    each row's queries padded to the longest block. Ragged blocks where padding would be most
    of the queries (a few sequences drafting among plain ones) attend split: one SDPA for every
    row's first query over all rows, then one per drafting row for its other queries against its
    own keys only; on the CPU the softmax costs per query row and key, so padding is paid."""

    kv: BatchKV
    n: int  # rows (sequences), slots 0..n-1
    R: int  # packed query rows they bring (their blocks, in slot order)
    L: int  # the longest block
    T: int  # key positions read: max(offset + block)
    slots: mx.array | None  # (R,) slot of each packed row (None: one row, a slice write)
    cols: mx.array | None  # (R,) its position
    gather: mx.array | None  # padded: (n * L,) packed row of each (sequence, block position); None: uniform
    back: mx.array | None  # (R,) packed row -> row of the attention's output (None: the same order)
    mask: mx.array | str | None  # padded: (n, 1, L, T); split: the first queries' (n, 1, 1, T0)
    start: int  # one row: its offset before the step
    split: tuple = ()  # split: (first packed rows (n,), T0, ((slot, its other query rows lo, hi, its keys), ...))

    def attend(self, layer: int, qs, ks, vs, scale: float) -> mx.array:
        """Write this step's keys / values into every row and attend: (1, R, nh * hd) for the
        packed query rows ``qs[:, :, :R]``."""
        K, V = self.kv.keys[layer], self.kv.values[layer]
        n, R, L, T = self.n, self.R, self.L, self.T
        nh, hd = qs.shape[1], qs.shape[3]
        k, v = ks[:, :, :R], vs[:, :, :R]
        if self.slots is None:  # one row: a slice write, as KVCache does
            K[:1, :, self.start : self.start + R] = k
            V[:1, :, self.start : self.start + R] = v
            q = qs[:, :, :R]
        else:
            K[self.slots, :, self.cols] = k[0].transpose(1, 0, 2)
            V[self.slots, :, self.cols] = v[0].transpose(1, 0, 2)
            if self.split:
                return self._attend_split(K, V, qs[0], scale)
            q = qs[0, :, :R] if self.gather is None else qs[0][:, self.gather]
            q = q.reshape(nh, n, L, hd).transpose(1, 0, 2, 3)
        o = mx.fast.scaled_dot_product_attention(q, K[:n, :, :T], V[:n, :, :T], scale=scale, mask=self.mask)
        o = o.transpose(0, 2, 1, 3).reshape(1, n * L, nh * hd)
        return o if self.back is None else o[:, self.back]

    def _attend_split(self, K, V, q, scale: float) -> mx.array:
        first, T0, rest = self.split
        nh, hd = q.shape[0], q.shape[2]
        q0 = q[:, first].reshape(nh, self.n, 1, hd).transpose(1, 0, 2, 3)
        o = mx.fast.scaled_dot_product_attention(
            q0, K[: self.n, :, :T0], V[: self.n, :, :T0], scale=scale, mask=self.mask
        )
        outs = [o.reshape(self.n, nh * hd)]
        for b, lo, hi, Tb in rest:  # its other queries against its own keys (bottom-right causal)
            o = mx.fast.scaled_dot_product_attention(
                q[None, :, lo:hi], K[b : b + 1, :, :Tb], V[b : b + 1, :, :Tb], scale=scale, mask="causal"
            )
            outs.append(o[0].transpose(1, 0, 2).reshape(-1, nh * hd))
        return mx.concatenate(outs)[self.back][None]


class BatchKV:
    """The K/V of every decoding sequence for the layers whose attention runs batched: per layer
    one buffer (slots, n_kv, T, hd), a sequence's keys in its slot at positions 0..offset-1.

    Rows are ragged on the right: each sequence has its own offset, a rollback only lowers it
    (the stale positions above are masked, then overwritten), so speculative sequences accept
    different numbers of drafts without holes. Slots stay dense (0..n-1): a sequence that
    leaves hands its slot to the last one. A sequence joins after its prefill (its own
    ``KVCache``s are copied in and parked) and gets them back, exactly its positions, when it
    leaves."""

    step = 256
    split_at = 1.5  # ragged blocks attend split when the padded queries are this many times the real ones (timed on PackedTarget under load)  # noqa: E501

    def __init__(self, layers: Sequence[int]):
        self.layers = tuple(sorted(layers))
        self.keys: dict[int, mx.array] = {}
        self.values: dict[int, mx.array] = {}
        self.rows: list[Row] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for d in (self.keys, self.values) for a in d.values())

    @property
    def slots(self) -> int:
        """Rows the buffers hold room for now."""
        return self.keys[self.layers[0]].shape[0] if self.keys else 0

    @property
    def length(self) -> int:
        """Positions every row of the buffers holds room for now (what admission charges each)."""
        return self.keys[self.layers[0]].shape[2] if self.keys else 0

    def _round(self, n: int) -> int:
        return -(-n // self.step) * self.step

    def _reserve(self, slots: int, length: int, like: dict | None = None) -> None:
        for i in self.layers:
            for store in (self.keys, self.values):
                a = store.get(i)
                if a is None:
                    ref = like[i] if store is self.keys else like[-i - 1]
                    store[i] = mx.zeros((slots, ref.shape[1], self._round(length), ref.shape[3]), ref.dtype)
                    continue
                S, nk, T, hd = a.shape
                if slots > S:
                    a = mx.concatenate([a, mx.zeros((slots - S, nk, T, hd), a.dtype)], axis=0)
                if length > T:
                    a = mx.concatenate([a, mx.zeros((a.shape[0], nk, self._round(length - T), hd), a.dtype)], axis=2)
                store[i] = a

    def _fit(self) -> None:
        """Shrink the buffers when that frees a step of length or more (to the longest row left,
        rounded up to a step: a long row that left must not keep every later row at its length;
        admission charges each slot the buffers' length) or half their slots; else keep them: a
        request leaving and the next one joining then copy nothing (a spare slot is charged by
        admission as a row). Fresh buffers: the old ones go."""
        n, T = len(self.rows), self._round(max(r.offset for r in self.rows))
        if T > self.length - self.step:
            T = self.length
        if T == self.length and self.slots < 2 * n:
            return
        fresh = []  # (a copy is made: to the rows left)
        for store in (self.keys, self.values):
            for i in self.layers:
                a = store[i]
                b = mx.zeros((n, a.shape[1], T, a.shape[3]), a.dtype)
                b[:] = a[:n, :, :T]
                store[i] = b
                fresh.append(b)
        mx.eval(fresh)

    def join(self, cache: list, more: int = 0) -> Row:
        """Take a prefilled sequence's K/V for these layers (its caches are parked, emptied).
        ``more``: sequences that join right after it (room is made for all of them at once: the
        buffers are copied once per step's joiners, not once per joiner)."""
        off = cache[self.layers[0]].offset
        if off < 1 or any(cache[i].offset != off for i in self.layers):
            raise MlxSpecError("a sequence joins the batch's K/V with its caches at one common offset")
        like = {i: cache[i].keys for i in self.layers} | {-i - 1: cache[i].values for i in self.layers}
        row = Row(len(self.rows), off)
        self._reserve(row.slot + 1 + max(0, more), off, like)
        for i in self.layers:
            c = cache[i]
            self.keys[i][row.slot : row.slot + 1, :, :off] = c.keys[..., :off, :]
            self.values[i][row.slot : row.slot + 1, :, :off] = c.values[..., :off, :]
            c.keys = c.values = None  # parked: the K/V live here until the sequence leaves
        self.rows.append(row)
        return row

    def leave(self, row: Row, cache: list | None) -> None:
        """Drop a row; with ``cache``, first hand its K/V back into those (parked) caches."""
        self.leave_many([(row, cache)])

    def leave_many(self, leaving: Sequence[tuple[Row, list | None]]) -> None:
        """Drop rows (``leave`` for each, in order), the buffers rearranged once for all of them."""
        try:
            back = []
            for row, cache in leaving:
                if cache is None:
                    continue
                j, off = row.slot, row.offset
                for i in self.layers:
                    c = cache[i]
                    c.keys = mx.contiguous(self.keys[i][j : j + 1, :, :off])
                    c.values = mx.contiguous(self.values[i][j : j + 1, :, :off])
                    c.offset = off
                    back += [c.keys, c.values]
            if back:
                mx.eval(back)  # own copies now: the caches must not keep the batch's buffers alive
        finally:  # the rows go even when handing their K/V back failed
            self._drop([row for row, _ in leaving])

    def _drop(self, rows: Sequence[Row]) -> None:
        """Each leaving row's slot goes to the last row, in turn; the rows that moved are copied
        to their new slots in one scatter (a copy per row would copy the buffers per row)."""
        was = {id(r): r.slot for r in self.rows}
        for row in rows:
            j = row.slot
            last = self.rows.pop()
            if last is not row:
                last.slot = j
                self.rows[j] = last
            row.slot = -1
        if not self.rows:
            self.keys, self.values = {}, {}
            return
        moved = [r for r in self.rows if was[id(r)] != r.slot]
        if moved:
            dst = mx.array([r.slot for r in moved], mx.int32)
            src = mx.array([was[id(r)] for r in moved], mx.int32)
            for store in (self.keys, self.values):
                for i in self.layers:
                    store[i][dst] = store[i][src]
        self._fit()

    def plan(self, blocks: Sequence[int]) -> RowsPlan:
        """This step's plan for blocks of ``blocks[b]`` query rows for row b (slot order); the
        rows' offsets advance by their blocks (``PackedTarget.rollback`` takes back what is
        rejected)."""
        n = len(self.rows)
        if len(blocks) != n:
            raise MlxSpecError(f"a step over the batch's K/V needs a block for each of its {n} rows")
        offs = [r.offset for r in self.rows]
        T = max(o + L for o, L in zip(offs, blocks))
        self._reserve(n, T)
        L, R = max(blocks), sum(blocks)
        if n == 1:  # the masks a single stream uses (mlx-lm's), so a batch of one is exact
            plan = RowsPlan(self, 1, R, L, T, None, None, None, None, None if L == 1 else "causal", offs[0])
        else:
            slots = mx.array([b for b, k in enumerate(blocks) for _ in range(k)], mx.int32)
            cols = mx.array([o + j for o, k in zip(offs, blocks) for j in range(k)], mx.int32)
            starts = list(itertools.accumulate(blocks, initial=0))
            if n * L >= self.split_at * R:  # mostly padding: split (see RowsPlan)
                T0 = max(offs) + 1
                mask = (mx.arange(T0, dtype=mx.int32)[None] <= mx.array(offs, mx.int32)[:, None])[:, None, None]
                rest, order = [], starts[:-1]
                for b, (a, k) in enumerate(zip(starts, blocks)):
                    if k > 1:
                        rest.append((b, a + 1, a + k, offs[b] + k))
                        order += range(a + 1, a + k)
                inv = [0] * len(order)  # packed row -> its output row
                for i, r in enumerate(order):
                    inv[r] = i
                back = mx.array(inv, mx.int32)
                split = (mx.array(starts[:-1], mx.int32), T0, tuple(rest))
                plan = RowsPlan(self, n, R, L, T, slots, cols, None, back, mask, 0, split)
            else:
                gather = back = None
                if any(k != L for k in blocks):
                    gather = mx.array([a + min(j, k - 1) for a, k in zip(starts, blocks) for j in range(L)], mx.int32)
                    back = mx.array([b * L + j for b, k in enumerate(blocks) for j in range(k)], mx.int32)
                # query j of row b (position offs[b] + j) sees keys 0..offs[b] + j
                see = mx.array(offs, mx.int32)[:, None] + mx.arange(L, dtype=mx.int32)[None]
                mask = mx.arange(T, dtype=mx.int32)[None, None, None] <= see[:, None, :, None]
                plan = RowsPlan(self, n, R, L, T, slots, cols, gather, back, mask, 0)
        for r, k in zip(self.rows, blocks):
            r.offset += k
        return plan


def _rows_tol(dtype) -> float:
    """How close the batched attention must come to the module's (relative and absolute): a
    masked SDPA over the longest row's keys sums in another order than mlx-lm's own call, so
    16-bit weights (one bf16 ulp ~0.4 %) get a 16-bit tolerance, float32 a float32 one."""
    return 1e-4 if dtype == mx.float32 else 2e-2


def _mirrors_rows(attn: nn.Module, norm: nn.Module) -> str | None:
    """None when the batched attention over ``BatchKV`` rows (two sequences at different
    offsets, ragged blocks) computes what this attention module computes on each alone, else
    the reason it does not (the largest difference, or why it could not run). A module that does
    not fit the pattern is a reason; any other error (a device error, out of memory) propagates."""
    w = norm.weight
    x = mx.random.normal((1, 8, w.shape[0]), key=mx.random.key(3)).astype(w.dtype)
    tol = _rows_tol(w.dtype)
    try:
        real = [KVCache(), KVCache()]
        attn(x[:, :3], "causal", real[0])
        attn(x[:, 3:5], "causal", real[1])
        want = [attn(x[:, 5:7], "causal", real[0]), attn(x[:, 7:], None, real[1])]
        pairs = []
        for split_at in (float("inf"), 0.0):  # ragged blocks padded, then split (``RowsPlan``)
            kv = BatchKV([0])
            kv.split_at = split_at
            for a, b in ((0, 3), (3, 5)):
                c = KVCache()
                attn(x[:, a:b], "causal", c)
                kv.join([c])
            rows = list(kv.rows)
            pos = mx.array([3, 4, 2], mx.int32)
            plan = kv.plan([2, 1])
            got = _attention(attn, x[:, 5:], [(0, 2), (2, 3)], [None, None], [None, None], pos, plan, 0)
            # (a masked SDPA over the longest row's keys: the same sums, rounded in another order)
            pairs += [(want[0], got[:, :2]), (want[1], got[:, 2:])]
            kv.leave(rows[0], None)
            kv.leave(rows[1], None)
    except (AttributeError, TypeError, ValueError, MlxSpecError) as e:
        return f"the module does not fit the batched path ({type(e).__name__}: {e})"
    if all(_same(a, b, tol) for a, b in pairs):
        return None
    if any(a.shape != b.shape for a, b in pairs):
        return "the batched path's output has another shape than the module's"
    diff = max(float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()) for a, b in pairs)
    return f"differs from the module by up to {diff:.2g} in {w.dtype} (tolerance {tol:g})"


class _Rows(NamedTuple):
    """Stands in for a sequence's slice of the hidden states where only its shape is read."""

    shape: tuple


def _layer_form_ok(layer, make_cache, i: int) -> bool:
    """The decomposition the packed loop uses (``x + mixer(input_layernorm(x))`` then
    ``h + mlp(post_attention_layernorm(h))``) equals the real layer on a small input."""
    mixer = layer.linear_attn if getattr(layer, "is_linear", False) else getattr(layer, "self_attn", None)
    if mixer is None or not all(hasattr(layer, n) for n in ("mlp", "input_layernorm", "post_attention_layernorm")):
        return False
    H = layer.input_layernorm.weight.shape[0]
    x = mx.random.normal((1, 3, H), key=mx.random.key(1)).astype(layer.input_layernorm.weight.dtype)
    c1, c2 = make_cache()[i], make_cache()[i]
    mask = None if isinstance(c1, ArraysCache) else "causal"
    try:
        want = layer(x, mask, c1)
        h = x + mixer(layer.input_layernorm(x), mask, c2)
        got = h + layer.mlp(layer.post_attention_layernorm(h))
    except (AttributeError, TypeError, ValueError):
        return False
    return _same(want, got)


class PackedTarget:
    """One forward over the rows of many sequences, each against its own cache.

    Linear layers and the head run once over all packed rows; attention (its projections packed
    when the module matches the llama/qwen pattern, checked at build time; otherwise the module
    itself per sequence) runs for the decoding sequences in one call over ``BatchKV`` on the
    ``slotted`` layers, per sequence against its own cache elsewhere (prefill chunks); GDN
    layers run per sequence (recording for rollback on verify rows).
    """

    def __init__(self, target: Target):
        self.t = target
        kinds = {}
        for i, layer in enumerate(target.layers):  # noqa: B007
            kinds.setdefault(i in target.gdn, i)
        for i in kinds.values():
            if not _layer_form_ok(target.layers[i], target.make_cache, i):
                raise UnsupportedModel(
                    f"batched decoding: the installed mlx-lm's {target.model_type} decoder layer does not "
                    "have the residual / mixer / MLP shape the packed forward uses"
                )
        self.packed = {
            i
            for i, layer in enumerate(target.layers)
            if i not in target.gdn and _mirrors_attention(layer.self_attn, layer.input_layernorm)
        }
        # layers whose attention runs for all decoding sequences at once (``BatchKV``): packed
        # ones with a plain KVCache, when the batched path matches mlx-lm's module
        plain = [i for i, c in enumerate(target.make_cache()) if i in self.packed and type(c) is KVCache]
        kv = getattr(target, "kv", None)
        if kv is not None:  # the shared K/V holds plain rows: each sequence attends over its own quantized cache
            why = f"{kv.describe()}, --kv-bits: the batch's shared K/V holds plain rows"
        elif not plain:
            why = "no packed attention layer with a plain KVCache"
        else:
            why = _mirrors_rows(target.layers[plain[0]].self_attn, target.layers[plain[0]].input_layernorm)
        self.slotted = set(plain) if why is None else set()
        self.mismatch = bool(plain) and why is not None  # the batched path differs from the module
        # which attention path the batch runs, said (logged by BatchDecoder, shown by the engine)
        self.attention = f"shared K/V over {len(plain)} layers" if why is None else f"per sequence ({why})"

    def __call__(self, segs: Sequence[Seg], taps: bool = True, kv: BatchKV | None = None) -> list[SegOut]:
        """``kv``: the batch's shared K/V; the segments with a ``row`` come first, one per row of
        ``kv`` in slot order (their attention layers in ``slotted`` run all rows in one call)."""
        t = self.t
        sizes = [int(s.ids.shape[0]) for s in segs]
        nrows = sum(1 for s in segs if s.row is not None)
        if nrows and (kv is None or nrows != len(kv.rows) or any(s.row is not r for s, r in zip(segs, kv.rows))):
            raise MlxSpecError("a packed forward over the batch's K/V needs every row's segment first, in slot order")
        bounds, a = [], 0
        for n in sizes:
            bounds.append((a, a + n))
            a += n
        ids = segs[0].ids if len(segs) == 1 else mx.concatenate([s.ids for s in segs])
        h = t.embed(ids[None])
        caches = [s.cache for s in segs]
        # Masks from each sequence's cache before any layer advances it (as Target does).
        rows = [_Rows((1, b - a, h.shape[-1])) for a, b in bounds]
        first = t.inner.fa_idx if t.gdn else 0  # an attention layer: its offset is the sequence's
        if t.gdn:
            fa = [create_attention_mask(r, c[first]) for r, c in zip(rows, caches)]
            ssm = [create_ssm_mask(r, c[t.inner.ssm_idx]) for r, c in zip(rows, caches)]
        else:
            fa, ssm = [create_attention_mask(r, c[0]) for r, c in zip(rows, caches)], None
        offs = [s.row.offset if s.row is not None else s.cache[first].offset for s in segs]
        pos = mx.array([o + j for (a, b), o in zip(bounds, offs) for j in range(b - a)], mx.int32)
        plan = kv.plan(sizes[:nrows]) if nrows else None
        records = [dict() for _ in segs]
        want = set(t.taps) if taps else set()
        feats = {}
        for i, layer in enumerate(t.layers):
            x = layer.input_layernorm(h)
            if i in self.packed:
                r = _attention(
                    layer.self_attn, x, bounds, [c[i] for c in caches], fa, pos, plan if i in self.slotted else None, i
                )
            else:
                outs = []
                for k, ((a, b), s) in enumerate(zip(bounds, segs)):
                    part = x if len(segs) == 1 else x[:, a:b]
                    if i not in t.gdn:
                        outs.append(layer.self_attn(part, fa[k], s.cache[i]))
                    elif s.record:
                        rec: list = []
                        outs.append(gdn.gdn_forward(layer.linear_attn, part, ssm[k], s.cache[i], rec))
                        records[k][i] = rec[0]
                    else:
                        outs.append(layer.linear_attn(part, ssm[k], s.cache[i]))
                r = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in want:
                feats[i] = h
        hidden = mx.concatenate([feats[j] for j in t.taps], axis=-1) if feats else None
        # the final-normed hidden of every row when a drafter reads it (an MTP head); the head's
        # logits come from the same normed rows
        normed = t.inner.norm(h) if taps and getattr(t, "final_hidden", False) else None
        picked: list[int] = []
        spans = []
        for (a, b), s in zip(bounds, segs):
            start = len(picked)
            if s.logits == "all":
                picked.extend(range(a, b))
            elif s.logits == "last":
                picked.append(b - 1)
            spans.append((start, len(picked)))
        logits = None
        if picked:
            src = h if normed is None else normed
            sel = src if len(picked) == h.shape[1] else src[:, mx.array(picked, mx.int32)]
            logits = t.head(t.inner.norm(sel) if normed is None else sel)[0]
        out = []
        one = len(segs) == 1
        for k, ((a, b), (r0, r1)) in enumerate(zip(bounds, spans)):
            lg = logits[r0:r1] if r1 > r0 else None
            hid = None if hidden is None else (hidden if one else hidden[:, a:b])
            fin = None if normed is None else (normed if one else normed[:, a:b])
            out.append(SegOut(lg, hid, records[k], fin))
        return out

    def rollback(
        self,
        cache: list,
        records: dict,
        n_verified: int,
        n_keep: int,
        row: Row | None = None,
        waits: DeviceWaits | None = None,
    ) -> None:
        """Keep the first ``n_keep`` of the last ``n_verified`` rows of one sequence's cache
        (attention trimmed, in its ``row`` of the batch's K/V for the slotted layers; GDN state
        rebuilt from that sequence's records of the pass, lazily: the decoder evaluates every
        sequence's GDN state after the step through its ``waits``)."""
        n = n_verified - n_keep
        if n <= 0:
            return
        t = self.t
        if row is not None:
            row.offset -= min(n, row.offset)
        for i, c in enumerate(cache):
            if i not in t.gdn and (row is None or i not in self.slotted):
                c.trim(n)
        if t.gdn:
            gdn = sorted(t.gdn)
            if any(i not in records for i in gdn):
                raise MlxSpecError("rolling back a hybrid sequence needs its verify rows recorded")
            t.restore(
                [cache[i] for i in gdn], [records[i] for i in gdn], [t.layers[i].linear_attn for i in gdn], n_keep
            )


class OwnForward:
    """The target's own forward (``Target.__call__`` / ``Target.rollback``), one segment at a
    time: what a batch of one runs (the single stream, ``decode.spec_steps``), so its numerics
    are the target's own, every model ``Target`` loads runs (also a layer form the packed forward
    refuses) and a stand-in target with the same three methods does too. A hybrid target keeps
    one verify tape, so this path serves one decoding sequence at a time."""

    slotted: frozenset = frozenset()
    mismatch = False

    def __init__(self, target, why: str = "a batch of one"):
        self.t = target
        self.attention = f"the target's own forward, one sequence ({why})"

    def __call__(self, segs: Sequence[Seg], taps: bool = True, kv: BatchKV | None = None) -> list[SegOut]:
        out = []
        for s in segs:
            ids = s.ids[None]
            # a plain step (one row) is never rolled back: no tape to record
            o = self.t(ids, s.cache, last_only=s.logits != "all", record=s.record and ids.shape[1] > 1)
            lg = None if s.logits == "none" else o.logits[0]
            out.append(SegOut(lg, o.hidden if taps else None, {}, getattr(o, "final", None) if taps else None))
        return out

    def rollback(
        self,
        cache: list,
        records: dict,
        n_verified: int,
        n_keep: int,
        row: Row | None = None,
        waits: DeviceWaits | None = None,
    ) -> None:
        """The target's own rollback; a hybrid target's rebuilt GDN state is waited for through
        ``waits`` (counted with the step's other waits). A stand-in target without GDN layers
        is called as ``rollback(cache, n_verified, n_keep)``."""
        if n_verified <= 1:
            return
        if waits is not None and getattr(self.t, "gdn", None):
            self.t.rollback(cache, n_verified, n_keep, wait=waits.eval)
        else:
            self.t.rollback(cache, n_verified, n_keep)


# --------------------------------------------------------------------------------------------
# The packed drafter pass


def _context_many(drafter, feats: Sequence[mx.array], caches: Sequence[list]) -> list[list]:
    """``add_context`` for many sequences: fusion and K/V projections once over all their new
    rows, RoPE once (each row at its own position), then each sequence's cache update (rows no
    layer of its cache keeps, under a drafting window, skipped as ``Drafter.add_context`` does)."""
    feats = list(feats)
    for i, cache in enumerate(caches):
        n = skip_rows(cache, int(feats[i].shape[1]))
        if n:
            for lc in cache:
                lc.skip(n)
            feats[i] = feats[i][:, n:]
    sizes = [int(f.shape[1]) for f in feats]
    c = drafter.fuse(feats[0] if len(feats) == 1 else mx.concatenate(feats, axis=1))  # (1, S, H)
    rows = c.transpose(1, 0, 2)  # (S, 1, H): rows on the batch axis, each RoPE'd at its own position
    out: list[list] = [[] for _ in feats]
    for li, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        pos = mx.array([cache[li].offset + j for cache, n in zip(caches, sizes) for j in range(n)], mx.int32)
        k, v = attn.kv(rows, pos)  # (S, n_kv, 1, hd)
        k, v = k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3)  # (1, n_kv, S, hd)
        a = 0
        for i, (cache, n) in enumerate(zip(caches, sizes)):
            out[i].append(cache[li].update_and_fetch(k[:, :, a : a + n], v[:, :, a : a + n]))
            a += n
    return out


def _draft_attention(attn, x, ctx, starts, masks):
    """The drafter's attention for n blocks (n, L, H), block i against its own context ctx[i]:
    projections and RoPE batched over the blocks, SDPA per block."""
    n, L, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).reshape(n, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=starts)
    kb, vb = attn.kv(x, starts)
    outs = []
    for i, ((ck, cv), m) in enumerate(zip(ctx, masks)):
        k, v = kb[i : i + 1], vb[i : i + 1]
        if ck is not None:
            k, v = mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)
        outs.append(mx.fast.scaled_dot_product_attention(q[i : i + 1], k, v, scale=attn.scale, mask=m))
    o = mx.concatenate(outs, axis=0) if n > 1 else outs[0]
    return attn.o_proj(o.transpose(0, 2, 1, 3).reshape(n, L, -1))


def _draft_layer(layer, x, ctx, starts, masks):
    """A DFlash / DFlash 2 decoder layer over n blocks (the layer's own sublayers)."""
    v2 = "attention_conv" in layer
    u = layer.input_layernorm(x)
    if v2:
        u, d = layer.attention_conv.prepare(u)
    a = _draft_attention(layer.self_attn, u, ctx, starts, masks)
    x = x + (layer.attention_conv.finish(a, d) if v2 else a)
    u = layer.post_attention_layernorm(x)
    if v2:
        u, d = layer.mlp_conv.prepare(u)
    m = layer.mlp(u)
    return x + (layer.mlp_conv.finish(m, d) if v2 else m)


def draft_hidden_many(
    drafter, anchors: Sequence[int], feats: Sequence[mx.array | None], caches: Sequence[list], L: int
) -> mx.array:
    """Final-normed hidden states (n, L-1, H) of n blocks ``[anchor, MASK x (L-1)]``, block i
    against sequence i's drafter context (its new rows ``feats[i]`` are added first): the block
    pass of ``Drafter.hidden`` for many sequences, each weight read once."""
    new = [i for i, f in enumerate(feats) if f is not None and f.shape[1] > 0]
    kvs = [[lc.state for lc in c] for c in caches]
    if new:
        for i, got in zip(new, _context_many(drafter, [feats[i] for i in new], [caches[i] for i in new])):
            kvs[i] = got
    starts_list = [c[0].offset for c in caches]
    starts = mx.array(starts_list, mx.int32)
    mask_id = drafter.args.mask_token_id
    block = mx.array([[a] + [mask_id] * (L - 1) for a in anchors], mx.int32)
    x = drafter.embed_block(block)
    for li, layer in enumerate(drafter.layers):
        ctx = [kv[li] for kv in kvs]
        masks = [
            block_mask(0 if ck is None else ck.shape[2], st, L, layer.causal, layer.window)
            for (ck, _), st in zip(ctx, starts_list)
        ]
        x = _draft_layer(layer, x, ctx, starts, masks)
    return drafter.norm(x)[:, 1:]


def _drafter_tol(dtype) -> float:
    """How close the packed drafter pass must come to ``Drafter.hidden`` (relative and absolute):
    the same sums over another row count and block layout, rounded in another order. float32
    rounds at ~1e-7 (1e-5 leaves room for a few layers of it); float16 / bfloat16 activations
    round at ~1e-3 / ~4e-3 per operation, so a few ulps of a 16-bit value (3e-2) is the bound,
    far below what a wrong mirror gives (differences of order one)."""
    return 1e-5 if dtype == mx.float32 else 3e-2


def _mirrors_drafter(drafter) -> str | None:
    """None when the packed drafter pass equals ``Drafter.hidden`` (two sequences, checked
    numerically), else why not. The feature width comes from the drafter's args (the tapped
    target layers times the target's width): a quantized ``fc``'s weight is packed."""
    args = drafter.args
    F = len(args.target_layer_ids) * (args.target_hidden_size or args.hidden_size)
    a, b = (x % max(1, args.vocab_size) for x in (3, 5))  # two anchor ids inside the vocabulary (any size)
    try:
        f = (mx.random.normal((1, 7, F), key=mx.random.key(2)) * 0.5).astype(drafter.norm.weight.dtype)
        want = [
            drafter.hidden(mx.array([[x] + [args.mask_token_id] * 3]), f[:, :n], drafter.make_cache())[0, 1:]
            for x, n in ((a, 7), (b, 4))
        ]
        got = draft_hidden_many(drafter, [a, b], [f, f[:, :4]], [drafter.make_cache(), drafter.make_cache()], 4)
        pairs = list(zip(want, got))
    except (AttributeError, TypeError, ValueError, RuntimeError) as e:
        return f"the packed pass could not run ({type(e).__name__}: {e})"
    dtype = want[0].dtype  # the drafter's activations (a 16-bit drafter's own, or promoted)
    tol = _drafter_tol(dtype)
    if all(_same(w, g, tol) for w, g in pairs):
        return None
    if any(w.shape != g.shape for w, g in pairs):
        return "the packed pass's output has another shape than the drafter's"
    diff = max(float(mx.abs(w.astype(mx.float32) - g.astype(mx.float32)).max()) for w, g in pairs)
    return f"the packed pass differs from the drafter's by up to {diff:.2g} in {dtype} (tolerance {tol:g})"


# --------------------------------------------------------------------------------------------
# The per-step budget


class Acceptance:
    """A sequence's running acceptance by block position (decayed counts, as the adaptive
    controller keeps them): ``expected(L)`` = committed tokens of an L-row step."""

    def __init__(self, n: int, prior: Sequence[float] = (), decay: float = 0.9, weight: float = 2.0):
        p = [min(1.0, max(0.0, float(x))) for x in prior[:n]]
        while len(p) < n:
            p.append((p[-1] if p else 1.0) * 0.6)
        self.hits = [weight * x for x in p]
        self.reached = [weight] * n
        self.decay = decay

    def observe(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        for k in range(len(self.reached)):
            self.reached[k] = self.decay * self.reached[k] + (k < drafted)
            self.hits[k] = self.decay * self.hits[k] + (k < accepted)

    def expected(self, L: int) -> float:
        out, last = 1.0, 1.0
        for k in range(min(L - 1, len(self.reached))):
            p = min(last, self.hits[k] / self.reached[k] if self.reached[k] > 0 else 0.0)
            out += p
            last = p
        return out


class StepCost(NamedTuple):
    """What a batched step costs, in ms: ``base + row*rows + prefill_row*prefill rows +
    seq*drafting sequences + draft_seq*sequences in the drafter pass + drafter_pass*[it runs] +
    head_pass*chain head passes`` (``BatchBudget`` fits it to measured steps)."""

    base: float
    row: float
    prefill_row: float
    seq: float  # a drafting sequence's own attention call and acceptance, beyond its rows
    draft_seq: float  # a sequence in the drafter pass
    drafter_pass: float  # the drafter pass itself, when one runs
    head_pass: float = 0.0  # one pass of a chain drafter (MTP / EAGLE-3: k per draft of k)

    def __call__(self, rows: int, drafting: int, extra: int = 0, seqs: int | None = None, heads: int = 0) -> float:
        seqs = drafting if seqs is None else seqs
        return (
            self.base
            + self.row * rows
            + self.prefill_row * extra
            + self.seq * seqs
            + self.draft_seq * drafting
            + (self.drafter_pass if drafting else 0.0)
            + self.head_pass * heads
        )


def heads_kw(heads: Sequence[bool] | None) -> dict:
    """``BatchBudget.plan``'s ``heads`` argument, passed only when a sequence drafts with a chain
    drafter (a subclass written before chain drafters overrides ``plan`` without it)."""
    return {"heads": list(heads)} if heads is not None and any(heads) else {}


class BatchBudget:
    """Which sequences draft this step, and how long their blocks are.

    Step cost is a ``StepCost`` (rows: the decoding sequences' packed rows; the drafter pass runs
    once for all its sequences), ``costs``, fitted by ridge least squares to the last ``window``
    measured steps, the drafter pass apart from the rest (prior ``prior`` = base, per row, per
    sequence in the drafter pass, the pass; in units of the base).
    Candidates are ranked by expected extra tokens per extra millisecond, each at its best block
    length up to its wish; the step takes the prefix of that ranking (none = a plain step for
    everyone) with the most expected tokens per millisecond, then lengthens or shortens each
    chosen block where that raises the step's rate.
    Acceptance comes from each sequence's own draft policy for the source it wishes (DFlash's
    running acceptance, or the copy model at the lookup's match length), else from its
    ``Acceptance`` (the batch's count for sequences without one). A sequence kept plain for
    ``probe_every`` steps (doubling after each failed probe) is judged at the better of its own
    acceptance and the prior's (``Acceptance()``'s default): a probe is taken only where drafting
    at the prior's acceptance would pay at this step's cost, so a large batch whose rows cost
    more than a typical draft returns stays plain (no forced probes), and a sequence whose
    drafts start to pay is found again once the batch can afford to look. After
    ``explore_every`` drafting steps in a row one step is plain, so the fit keeps seeing what a
    plain step costs (a pipelined plain step is fitted at its cost to the batch: the host work and
    the wait, its pass having overlapped the step before; that is what stepping plain costs then,
    and it pulls the fitted intercept below an unpipelined step's). A batch of one follows its own wish (the single-stream policy decides, as
    in ``spec_steps``).
    """  # noqa: E501

    def __init__(
        self,
        prior: tuple[float, ...] = (1.0, 0.04, 0.03, 0.1),
        window: int = 64,
        probe_every: int = 8,
        max_probe_every: int = 64,
        head_prior: float = 0.1,
    ):
        self.prior = tuple(prior)
        self.head_prior = head_prior  # a chain head pass, in units of the base (fitted as passes run)
        self.obs: deque = deque(maxlen=window)
        a, b, c, e = self.prior
        self._costs, self._stale = StepCost(a, b, b, 0.0, c, e, head_prior * a), False
        self.probe_every, self.max_probe = probe_every, max_probe_every
        self.optimism = Acceptance(16)  # what a sequence due for a probe is judged at (at least)
        # after this many drafting steps in a row, one plain step: the fit must see what the
        # alternative costs (drafting steps alone spread their rows too little to tell)
        self.explore_every, self._drafted_run = 16, 0

    def observe(
        self,
        rows: int,
        drafting: int,
        ms: float,
        draft_ms: float | None = 0.0,
        extra: int = 0,
        seqs: int | None = None,
        heads: int = 0,
    ) -> None:
        """One measured step: ``rows`` decoding rows and ``extra`` prefill rows, ``ms`` in all,
        ``draft_ms`` of it in the drafter pass and the chain passes (0: none ran; None: they ran
        but were not timed apart, their drafts read in the verify's wait); ``seqs``: sequences
        that drafted, from any source (default ``drafting``); ``heads``: chain head passes run."""
        self.obs.append((rows, drafting, ms, draft_ms, extra, drafting if seqs is None else seqs, heads))
        self._stale = True

    @property
    def costs(self) -> StepCost:
        """The step costs fitted to the steps observed so far (refitted when read after new
        steps: a long run of plain steps that no sequence could draft in never pays for a fit)."""
        if self._stale:
            self._costs, self._stale = self._fit(), False
        return self._costs

    def _fit(self):
        """Two ridge fits, so that neither phase hides in the other's intercept (a batch that
        always drafts would otherwise never learn what a plain step costs): the step less its
        drafter pass on ``[1, rows, prefill rows, drafting sequences]`` (a prefill row attends over
        a short context: cheaper than a decoding row, so it gets its own slope; a drafting
        sequence costs its own attention call and acceptance beyond its rows); the drafter pass,
        where one ran and was timed apart, on ``[1, drafting]`` (a step that read its drafts in
        the verify's wait has the last fit's drafter pass taken out). Pseudo-observations pull
        toward the prior: enough to settle what the steps cannot tell apart (rows always 8:
        intercept vs per-row), weak enough that 64 steps are not biased."""

        def ridge(X, y, p, lam):
            p = p * float(y.mean() / (X @ p).mean())
            return np.linalg.solve(X.T @ X + np.diag(lam), X.T @ y + np.diag(lam) @ p), p

        pa, pb, pc, pe = self.prior
        last = self._costs
        X = np.array([[1.0, r, x, k] for r, _, _, _, x, k, _ in self.obs])
        y = np.array(
            [
                # a step whose drafts were read in the verify's wait: its draft phase as last fitted
                ms - (dm if dm is not None else last.drafter_pass * (d > 0) + last.draft_seq * d + last.head_pass * h)
                for _, d, ms, dm, _, _, h in self.obs
            ]
        )
        (a, b, f, g), p = ridge(X, y, np.array([pa, pb, pb, pc]), [0.25, 1.0, 1.0, 1.0])
        a, b, f, g = max(a, 1e-3 * p[0]), max(b, 0.0), max(f, 0.0), max(g, 0.0)
        # the draft phase: the DFlash pass (when one ran: [1, its sequences]) and the chain passes
        drew = [(d, h, dm) for _, d, _, dm, _, _, h in self.obs if (d > 0 or h > 0) and dm]
        if drew:
            (e, c, hp), _ = ridge(
                np.array([[float(d > 0), d, h] for d, h, _ in drew]),
                np.array([dm for _, _, dm in drew]),
                np.array([pe, pc, self.head_prior]) * (a / pa),
                [0.25, 1.0, 1.0],
            )
        else:
            e, c, hp = pe * a / pa, pc * a / pa, self.head_prior * a / pa
        return StepCost(
            float(a), float(b), float(f), float(g), float(max(c, 0.0)), float(max(e, 0.0)), float(max(hp, 0.0))
        )

    def choose(
        self,
        wants: Sequence[int],
        accs: Sequence[Acceptance],
        plain_runs: Sequence[int],
        probes: Sequence[int],
        extra_rows: int = 0,
        passes: Sequence[bool] | None = None,
        heads: Sequence[bool] | None = None,
    ) -> list[int]:
        """Each sequence's rows this step (1 = plain), at most its wish (``plan``), counted: after
        ``explore_every`` drafting steps in a row the next is plain."""
        L = self.plan(wants, accs, plain_runs, probes, extra_rows, passes, **heads_kw(heads))
        self.count(L, len(wants) > 1 or bool(extra_rows))
        return L

    def count(self, L: Sequence[int], batched: bool = True) -> None:
        """A step taken with rows ``L`` (``batched``: more than one sequence, or prefill rows)."""
        if batched:
            self._drafted_run = self._drafted_run + 1 if max(L, default=1) > 1 else 0

    def plan(
        self,
        wants: Sequence[int],
        accs: Sequence[Acceptance],
        plain_runs: Sequence[int],
        probes: Sequence[int],
        extra_rows: int = 0,
        passes: Sequence[bool] | None = None,
        heads: Sequence[bool] | None = None,
    ) -> list[int]:
        """What ``choose`` returns now, nothing changed (what a subclass overrides). ``passes[i]``:
        the sequence's draft needs the drafter pass (a lookup draft costs rows only);
        ``heads[i]``: it drafts with a chain drafter (k rows' drafts cost k - 1 head passes)."""
        n = len(wants)
        passes = [True] * n if passes is None else list(passes)
        heads = [False] * n if heads is None else list(heads)
        if n == 1 and not extra_rows:
            return list(wants)
        if self._drafted_run >= self.explore_every:
            return [1] * n
        return self._choose(wants, accs, plain_runs, probes, extra_rows, passes, heads)

    def _choose(self, wants, accs, plain_runs, probes, extra_rows, passes, heads) -> list[int]:
        n = len(wants)
        if max(wants, default=1) <= 1:
            return [1] * n  # nobody wishes a draft: the costs are not needed (nor refitted)
        cost = self.costs
        b, c = cost.row, cost.draft_seq
        L = [1] * n
        rows, drafting, tokens = n, 0, float(n)
        x = extra_rows
        cands = []
        for i, w in enumerate(wants):
            if w <= 1:
                continue
            ci = (c if passes[i] else 0.0) + cost.seq
            bi = b + (cost.head_pass if heads[i] else 0.0)  # a chain's draft row costs a head pass too
            if plain_runs[i] >= probes[i]:  # due for a probe: judged at least at the prior's acceptance
                gains = [max(accs[i].expected(k), self.optimism.expected(k)) - 1 for k in range(2, w + 1)]
            else:
                gains = [accs[i].expected(k) - 1 for k in range(2, w + 1)]
            k = max(range(2, w + 1), key=lambda k: gains[k - 2] / (bi * (k - 1) + ci + 1e-9))
            cands.append((gains[k - 2] / (bi * (k - 1) + ci + 1e-9), i, k, gains))
        cands.sort(reverse=True)
        best, best_rate = 0, tokens / cost(rows, drafting, x, 0)
        r, d, t, h = rows, drafting, tokens, 0
        for j, (_, i, k, gains) in enumerate(cands, start=1):
            r, d, t = r + k - 1, d + passes[i], t + gains[k - 2]
            h += (k - 1) * heads[i]
            rate = t / cost(r, d, x, j, h)
            if rate > best_rate:
                best, best_rate = j, rate
        if not best:
            return L
        chosen = cands[:best]
        for _, i, k, _ in chosen:
            L[i] = k
        # The lengths were picked by tokens per row; the step's rate may want longer (or shorter)
        # blocks: where the step is dear anyway (a small batch's base cost), rows that add fewer
        # tokens each still raise it. One pass of coordinate ascent on the step's rate.
        r = rows + sum(L[i] - 1 for _, i, _, _ in chosen)
        d = drafting + sum(passes[i] for _, i, _, _ in chosen)
        t = tokens + sum(g[L[i] - 2] for _, i, _, g in chosen)
        h = sum((L[i] - 1) * heads[i] for _, i, _, _ in chosen)
        for _, i, _, g in chosen:
            k0 = L[i]
            hi = heads[i]
            k = max(
                range(2, len(g) + 2),
                key=lambda k: (t + g[k - 2] - g[k0 - 2]) / cost(r + k - k0, d, x, best, h + hi * (k - k0)),
            )
            r, t, h, L[i] = r + k - k0, t + g[k - 2] - g[k0 - 2], h + hi * (k - k0), k
        return L


# --------------------------------------------------------------------------------------------
# The decoder


@dataclass(eq=False)
class _Seq:
    id: int
    prompt: list[int]
    max_tokens: int
    eos: frozenset
    sampling: SamplingConfig
    block_size: int  # the DFlash block it drafts without a policy
    policy: object | None  # policy.DraftPolicy: source and length per cycle
    index: SuffixIndex | None  # lookup drafts (when the policy allows them)
    on_exit: Callable | None
    speculate: bool
    cache: list
    dcache: list | None
    done: int  # prompt tokens the caches hold (prefill progress)
    cached: int  # of those, from the prefix cache
    key: mx.array
    acc: Acceptance
    t_join: float
    pending: list = field(default_factory=list)  # features of rows not yet in the drafter cache
    anchor_id: int = -1  # the last token, not yet in the target cache (-1 while prefilling)
    fed: list = field(default_factory=list)  # ids the target cache holds (once decoding)
    n: int = 0
    prev: Step | None = None
    plain_run: int = 0
    probe_every: int = 8
    ctx: Context | None = None  # this step's lookup context (policy sequences)
    row: Row | None = None  # its place in the batch's shared K/V once decoding (``BatchKV``)
    fixed: str = DFLASH  # the source it drafts every cycle without a policy ("dflash" or a chain kind)
    chains: dict = field(default_factory=dict)  # kind -> its chain drafter's ``chain.ChainCache``
    # kind -> [(features (1, n, F), the n ids fed there)] not yet handed to that chain drafter
    cpend: dict = field(default_factory=dict)

    @property
    def anchor(self) -> mx.array | None:
        """``anchor_id`` as the drafter takes it (None while prefilling)."""
        return None if self.anchor_id < 0 else mx.array(self.anchor_id, mx.int32)

    def final(self, drafter, chains: dict | None = None) -> Prefill | None:
        """The caches and the ids they hold (flushing pending features into the drafters')."""
        if self.dcache is not None:
            for f in self.pending:
                drafter.add_context(f, self.dcache)
        self.pending.clear()
        for kind, cc in self.chains.items():
            chain_context(chains[kind], self, kind)
            chains[kind].flush(cc)
        ids = tuple(self.fed) if self.anchor_id >= 0 else tuple(self.prompt[: self.done])
        return Prefill(ids, self.cache, self.dcache, dict(self.chains) or None) if ids else None


def chain_context(chain, s: _Seq, kind: str) -> None:
    """Hand the chain drafter ``kind`` the rows it has not seen (queued: they run in its next
    pass or flush)."""
    pend = s.cpend.get(kind)
    if not pend:
        return
    f = pend[0][0] if len(pend) == 1 else mx.concatenate([x for x, _ in pend], axis=1)
    ids = mx.array([t for _, tt in pend for t in tt], mx.int32)
    pend.clear()
    chain.add_context(f, ids, s.chains[kind])


class BatchDecoder:
    """A continuous batch of sequences over one target (and optionally one drafter).

    Args:
        target: the ``Target`` (taps are read only when there is a drafter).
        drafter: a DFlash drafter, or None for batched plain decoding.
        block_size: the block a sequence without a draft policy drafts (fixed-block runs).
        max_batch: sequences admitted at once (``add`` refuses beyond it).
        prefill_chunk: prompt rows per step while other sequences decode (a joining sequence's
            prefill is spread over steps so the others keep going); ``prefill_step`` when the
            batch has nothing else to do.
        policy: the per-step ``BatchBudget`` (a fresh default one if None).
        pipeline: queue the next plain step before reading this one's tokens when every sequence
            stays plain (no joiner prefilling, attention-only targets; sampled sequences draw their
            token in the graph, with the key an unpipelined step would use), as mlx-lm's
            ``BatchGenerator`` does: the host's work on a step overlaps the next step's pass.
        own_forward: run the target's own forward (``OwnForward``) instead of the packed one: a
            batch of one (``max_batch`` must be 1), the single stream ``decode.spec_steps`` drives.
        waits: the ``DeviceWaits`` every wait for the device goes through (a fresh one if None).
        chains: the chain drafters (kind "mtp" / "eagle" -> ``chain.ChainDrafter``) a sequence's
            policy may draft with. ``target`` is the one view that returns every drafter's
            features (the union of the taps, and the final-normed hidden for an MTP head); each
            drafter gets its slice. A chain's k passes run per sequence (``chain_path``).
    """

    def __init__(
        self,
        target: Target,
        drafter=None,
        *,
        block_size: int = 1,
        max_batch: int = 8,
        prefill_chunk: int = 256,
        prefill_step: int = 2048,
        policy: BatchBudget | None = None,
        pipeline: bool = True,
        own_forward: bool = False,
        waits: DeviceWaits | None = None,
        chains: dict | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
        if own_forward and max_batch != 1:
            raise ValueError("the target's own forward serves a batch of one (max_batch=1)")
        self.target, self.drafter = target, drafter
        self.chains = dict(chains or {})
        bad = sorted(set(self.chains) - set(CHAINS))
        if bad:
            raise ValueError(f"unknown chain drafter kinds {bad} (known: {', '.join(CHAINS)})")
        # each drafter's slice of the target view's features
        taps = getattr(target, "taps", None)  # (a stand-in target without taps: its features are DFlash's)
        dtaps = getattr(getattr(drafter, "args", None), "target_layer_ids", None)
        self._dflash_view = None
        if drafter is not None:
            self._dflash_view = (lambda h: h) if taps is None or dtaps is None else feature_view(taps, dtaps)
        taps = tuple(taps or ())
        self._chain_views = {}
        for kind, c in self.chains.items():
            if c.final_hidden:
                if not getattr(target, "final_hidden", False):
                    raise MlxSpecError(
                        f"the {kind} drafter reads the target's final hidden: the target view must return it"
                    )
                self._chain_views[kind] = None  # TargetOut.final
            else:
                self._chain_views[kind] = feature_view(taps, c.taps)
        self._taps = drafter is not None or bool(self.chains)  # does any drafter read the features
        self.waits = waits or DeviceWaits()
        self.packed = OwnForward(target) if own_forward else PackedTarget(target)
        self.gdn = getattr(target, "gdn", ())
        # decoding sequences' K/V for the batched attention layers (None: attention per sequence)
        self.kv = BatchKV(self.packed.slotted) if self.packed.slotted else None
        # one drafter pass for all drafting sequences when our mirror of its layers checks out
        self.packed_drafter, self.drafter_path = False, "none" if drafter is None else "per sequence (a batch of one)"
        if isinstance(drafter, Drafter) and max_batch > 1:
            why = _mirrors_drafter(drafter)
            self.packed_drafter = why is None
            # "one pass for all" | "per sequence (<reason>)": said, and shown by the engine
            self.drafter_path = "one pass for all" if why is None else f"per sequence ({why})"
            if why is not None:
                log.warning("batched drafter: the packed pass is off, one drafter pass per sequence (%s)", why)
        elif drafter is not None and max_batch > 1:
            self.drafter_path = "per sequence (not a DFlash drafter)"
        # chain drafters: a sequence's k head passes run against its own chain cache (lazily, in
        # the same graph as the DFlash pass; not packed across sequences)
        self.chain_path = (
            "none"
            if not self.chains
            else f"{', '.join(sorted(self.chains))}: k head passes per drafting sequence"
            + (" (not packed across sequences)" if max_batch > 1 else "")
        )
        self.attention = self.packed.attention  # "shared K/V over N layers" | "per sequence (<reason>)"
        log.log(
            logging.WARNING if self.packed.mismatch else logging.INFO,
            "batched attention: %s; drafter: %s; chain drafters: %s",
            self.attention,
            self.drafter_path,
            self.chain_path,
        )
        self.block_size = block_size if drafter is not None or self.chains else 1
        self.max_batch = max_batch
        self.prefill_chunk, self.prefill_step = max(1, prefill_chunk), max(1, prefill_step)
        self.policy = policy or BatchBudget()
        # (a hybrid's GDN state is evaluated after every packed step; the target's own forward
        # evaluates it in its rollback)
        self.pipeline = pipeline and (not self.gdn or own_forward)
        # in a batch of 2+, a policy's plain step is offered to the drafter (``_wished_decision``)
        self.widen = drafter is not None
        self._queued: _Queued | None = None  # a plain step queued ahead (pipeline)
        self._seqs: dict[int, _Seq] = {}
        self._ids = itertools.count(1)
        # observability (plain values; the engine copies them)
        self.batch_sizes: dict[int, int] = {}
        self.steps = {"plain": 0, "drafted": 0}
        self.pipelined = 0  # plain steps that ran queued ahead of the step before them (pipeline)
        self._since_clear = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def add(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        eos_ids: Sequence[int] = (),
        sampling: SamplingConfig = SamplingConfig(),
        prefill: Prefill | None = None,
        on_exit: Callable[[Prefill], None] | None = None,
        policy=None,
        lookup_ngram: int = 4,
        speculate: bool = True,
        block_size: int | None = None,
        index: SuffixIndex | None = None,
        source: str = DFLASH,
    ) -> int:
        """Admit a sequence; it joins at the next ``step``. Returns its id.

        ``policy`` (a ``policy.DraftPolicy``, one per sequence) says what the sequence would draft
        alone; ``BatchBudget`` then decides what the batch can afford. Without one it wishes
        ``block_size`` DFlash drafts (default: the decoder's). ``index``: the lookup index over
        ``prompt`` its policy's lookup drafts come from (default ``SuffixIndex(prompt,
        lookup_ngram, stop=eos_ids)``), extended by the committed tokens. ``source``: what it
        drafts every cycle without a policy (a fixed block of ``block_size`` rows): "dflash" or
        a loaded chain drafter's kind."""
        if len(self._seqs) >= self.max_batch:
            raise MlxSpecError(f"the batch is full ({self.max_batch} sequences)")
        if not prompt:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
        if self.drafter is None and policy is not None and DFLASH in policy.sources:
            raise ValueError("a DFlash draft policy needs a drafter")
        if source != DFLASH and source not in self.chains:
            raise ValueError(f"a fixed {source} draft needs that chain drafter loaded (loaded: {sorted(self.chains)})")
        kinds = [k for k in CHAINS if (k in policy.sources if policy is not None else k == source)]
        missing = [k for k in kinds if k not in self.chains]
        if missing:
            raise ValueError(f"a draft policy with {', '.join(missing)} needs that chain drafter loaded")
        speculate = speculate and (
            self.drafter is not None or policy is not None or (source != DFLASH and self.block_size > 1)
        )
        kinds = kinds if speculate else []
        done = prefix_start(prefill, prompt)
        if prefill is not None and speculate and self.drafter is not None and prefill.drafter is None:
            raise ValueError("a speculative sequence needs the drafter's context cache in its prefill")
        if prefill is not None and any(k not in (prefill.chains or {}) for k in kinds):
            raise ValueError(f"a sequence drafting with {', '.join(kinds)} needs those chain caches in its prefill")
        cache = prefill.target if prefill else self.target.make_cache()
        dcache = None
        if speculate and self.drafter is not None:
            dcache = prefill.drafter if prefill else self.drafter.make_cache()
        heads = {k: prefill.chains[k] if prefill else self.chains[k].make_cache() for k in kinds}
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        if index is None and speculate and policy is not None and LOOKUP in policy.sources:
            index = SuffixIndex(prompt, lookup_ngram, stop=eos_ids)
        seed = sampling.seed if sampling.seed is not None else time.time_ns() % 2**31
        sid = next(self._ids)
        self._seqs[sid] = _Seq(
            sid,
            list(prompt),
            max_tokens,
            frozenset(eos_ids),
            sampling,
            self.block_size if block_size is None or (self.drafter is None and not self.chains) else block_size,
            policy if speculate else None,
            index if speculate else None,
            on_exit,
            speculate,
            cache,
            dcache,
            done,
            done,
            mx.random.key(seed),
            Acceptance(max(1, self.block_size - 1)),
            time.perf_counter(),
            probe_every=self.policy.probe_every,
            fixed=source,
            chains=heads,
            cpend={k: [] for k in heads},
        )
        return sid

    def cancel(self, sid: int, keep: bool = True) -> None:
        """Drop a sequence now (between steps); its caches go to its ``on_exit`` (``keep=False``:
        dropped, e.g. after a failed step left them half-written)."""
        s = self._seqs.pop(sid, None)
        if s is not None:
            if not keep:
                s.on_exit = None
            self._release(s)
            hand_over(s.on_exit, lambda: s.final(self.drafter, self.chains))
            self._drop_queued()

    def _release(self, *seqs: _Seq) -> None:
        """Their rows of the batch's K/V go (their own caches get their K/V back if kept)."""
        rows = [s for s in seqs if s.row is not None]
        if rows:
            self.kv.leave_many([(s.row, s.cache if s.on_exit is not None else None) for s in rows])
            for s in rows:
                s.row = None

    def close(self) -> None:
        for sid in list(self._seqs):
            self.cancel(sid)
        self._drop_queued()

    def _drop_queued(self) -> None:
        """Forget a step queued ahead whose sequences all left (its caches are theirs to free)."""
        q = self._queued
        if q is not None and not any(self._seqs.get(s.id) is s for s in q.seqs):
            self._queued = None

    def step(self) -> list[tuple[int, Step]]:
        """One batched step. Returns ``(sequence id, Step)`` for each sequence that committed
        tokens (a sequence still prefilling commits none); finished sequences have left."""
        if not self._seqs:
            return []
        with mx.stream(generation_stream):
            return self._step()

    # -- internals ---------------------------------------------------------------------------
    def _wished_decision(
        self, s: _Seq, peek: bool = False, batch: int = 1, asked: bool = False, ahead: bool = False
    ) -> Decision:
        """What the sequence would do alone this cycle (its own policy, else its fixed block).
        ``peek``: what its policy would choose, nothing counted. ``asked``: its context is the
        one a ``peek`` just built (nothing happened since). ``ahead``: the cycle after the step
        in flight (a step queued ahead: that step's token is not counted yet, and is not room
        any more).

        In a batch of two or more, a policy's plain step (its drafter resting, or drafts not
        paying at the single-stream pass costs) is offered to the batch as a DFlash draft of its
        longest block: the batch judges it at the drafter's running acceptance for this sequence
        against the batch's own step costs, where extra rows cost less than a sequence's plain
        step alone (and the policy learns from what the batch drafted)."""
        room = s.max_tokens - s.n - ahead
        ctx, s.ctx = s.ctx, None
        if not s.speculate:
            d = Decision(PLAIN, 1)
        elif s.policy is not None:
            s.ctx = ctx if asked and ctx is not None else self._lookup_context(s, room)
            d = s.policy.peek(s.ctx) if peek else s.policy.choose(s.ctx)
            if d.source == PLAIN and batch > 1 and self.widen and DFLASH in s.policy.sources:
                d = Decision(DFLASH, s.policy.pinned or s.policy.max_block)
        else:
            d = Decision(s.fixed, s.block_size)
        L = max(1, min(d.length, room))
        if d.source == LOOKUP:
            L = min(L, len(s.ctx.lookup) + 1)
        if L == d.length and (L > 1 or d.source == PLAIN):
            return d  # the policy's own decision (its trace holds it: ``pick`` replaces it there)
        return Decision(d.source if L > 1 else PLAIN, L, d.probe)

    @staticmethod
    def _lookup_context(s: _Seq, room: int) -> Context:
        """What the sequence's policy decides its next cycle from (its lookup proposal), ``room``
        tokens left to commit."""
        return lookup_context(s.index, s.policy.max_lookup, room, s.sampling.greedy)

    @staticmethod
    def _acceptance(s: _Seq, d: Decision) -> Acceptance:
        """What the batch judges the sequence's wished draft by: its own policy's acceptance for
        that source (the copy model at this match for a lookup draft), else the batch's count.
        A policy's curve (P(the first k+1 drafts accepted): in [0, 1], never rising) is an
        ``Acceptance`` with it for its prior and nothing counted, whose ``expected`` is the
        curve's expected tokens."""
        if s.policy is None or d.length < 2 or d.source == PLAIN:
            return s.acc
        if d.source == LOOKUP:
            curve = s.policy.copy.curve(s.ctx.match, d.length - 1)
        elif d.source == DFLASH:
            curve = s.policy.dflash.curve()
        else:  # a chain drafter's running acceptance by position
            curve = s.policy.acceptance[d.source].curve()
        return Acceptance(len(curve), curve)

    def _decide(self, decoding: list[_Seq], extra_rows: int) -> list[Decision]:
        """Every decoding sequence's decision this step: its wish, within what the batch affords
        (a batch of one with no prefill rows: its wish)."""
        wish = [self._wished_decision(s, batch=len(decoding)) for s in decoding]
        if len(decoding) == 1 and not extra_rows:  # (``BatchBudget.plan`` returns the wish)
            self.policy.count([wish[0].length], False)
            return wish
        blocks = self.policy.choose(
            *self._budget_inputs(decoding, wish),
            extra_rows,
            [d.source == DFLASH for d in wish],
            [d.source in CHAINS for d in wish],
        )
        return [Decision(d.source, L, d.probe) if L > 1 else Decision(PLAIN, 1) for d, L in zip(wish, blocks)]

    def _budget_inputs(self, decoding: list[_Seq], wish: list[Decision]) -> tuple:
        """What ``BatchBudget.choose`` weighs: the wished lengths, the acceptances they are judged
        by, the plain runs and the probe spacings."""
        return (
            [d.length for d in wish],
            [self._acceptance(s, d) for s, d in zip(decoding, wish)],
            [s.plain_run for s in decoding],
            [s.probe_every for s in decoding],
        )

    def _next_stays_plain(self, decoding: list[_Seq]) -> bool:
        """Would the step after the one in flight be plain for every sequence (asked now,
        nothing counted)? A sequence alone asks its policy's ``stays_plain``, as the single
        stream always has (what ``distributed.RankSharedPolicy`` shares with the other ranks)."""
        if len(decoding) == 1 and decoding[0].max_tokens - decoding[0].n <= 1:
            return False  # alone, the step in flight commits its last token: nothing to queue
        if len(decoding) == 1 and decoding[0].policy is not None:
            s = decoding[0]
            room = s.max_tokens - s.n - 1
            if not s.speculate:
                return False
            s.ctx = self._lookup_context(s, room)
            return bool(s.policy.stays_plain(s.ctx))
        wish = [self._wished_decision(s, peek=True, batch=len(decoding), ahead=True) for s in decoding]
        plan = self.policy.plan(
            *self._budget_inputs(decoding, wish),
            0,
            [d.source == DFLASH for d in wish],
            **heads_kw([d.source in CHAINS for d in wish]),
        )
        return max(plan, default=1) <= 1

    @staticmethod
    def _wants_confidence(s: _Seq, alone: bool) -> bool:
        """Greedy with a policy that may ``pick``: alone (it may trim the block), or with a lookup
        proposal too (it may switch to it): the drafter's confidence is wanted."""
        return s.sampling.greedy and s.ctx is not None and (alone or bool(s.ctx.lookup))

    @staticmethod
    def _split_keys(s: _Seq) -> tuple:
        """This step's keys of a sampled sequence (its draft's, its acceptance's); greedy: none."""
        if s.sampling.greedy:
            return None, None
        s.key, kd, ka = mx.random.split(s.key, 3)
        return kd, ka

    @staticmethod
    def _take_pending(s: _Seq) -> mx.array | None:
        """The sequence's queued features (for its drafter's context cache), taken: one array."""
        f = (mx.concatenate(s.pending, axis=1) if len(s.pending) > 1 else s.pending[0]) if s.pending else None
        s.pending.clear()
        return f

    def _feed_drafter(self, s: _Seq, used: str = "") -> None:
        """A long run of cycles without a drafter (``used``: the source that drafted this cycle):
        push the queued features into its context cache (queued, not waited for), so they do not
        pile up for its next pass."""
        if used != DFLASH and s.dcache is not None and len(s.pending) >= 32:
            self.drafter.add_context(self._take_pending(s), s.dcache)
            mx.async_eval([c.state for c in s.dcache])
        for kind, pend in s.cpend.items():
            if kind != used and len(pend) >= 32:
                self._flush_chain(s, kind)
                mx.async_eval(s.chains[kind].state)

    def _flush_chain(self, s: _Seq, kind: str) -> None:
        """The chain drafter ``kind``'s unseen rows, run into its cache (lazily)."""
        chain_context(self.chains[kind], s, kind)
        self.chains[kind].flush(s.chains[kind])

    def _keep(self, s: _Seq, out: SegOut, n: int, ids: Sequence[int]) -> None:
        """The features of the first ``n`` rows of a pass (fed ``ids``) wait for every drafter
        of the sequence: its slice of the target view's features, taken at its next pass."""
        if s.dcache is not None:
            s.pending.append(self._dflash_view(out.hidden[:, :n]))
        for kind, pend in s.cpend.items():
            view = self._chain_views[kind]
            f = out.final if view is None else view(out.hidden)
            pend.append((f[:, :n], list(ids)))

    def _step(self) -> list[tuple[int, Step]]:
        """One step, in its named phases: decide (each sequence's source and length) -> propose
        (DFlash passes, lookup drafts) -> pick (greedy: trim the block or take the lookup's) ->
        verify (one target pass over every sequence's rows and the prefill chunks) -> accept and
        roll back (per sequence) -> hand over (committed tokens, finished sequences' caches)."""
        t0 = time.perf_counter()
        waits0 = self.waits.count
        q, self._queued = self._queued, None
        if q is not None:  # (one of its sequences is live: ``_drop_queued`` sees to that)
            return self._run_queued(q, t0)
        decoding = [s for s in self._seqs.values() if s.anchor_id >= 0]
        if self.kv is not None:  # the rows' segments first, in slot order
            decoding.sort(key=lambda s: s.row.slot)
        prefilling = [s for s in self._seqs.values() if s.anchor_id < 0]
        budget = self.prefill_chunk if decoding else self.prefill_step
        chunks = []
        for s in prefilling:  # FIFO: the oldest joiner's prompt first
            if budget <= 0:
                break
            n = min(budget, len(s.prompt) - s.done)
            chunks.append((s, n))
            budget -= n
        extra = sum(n for _, n in chunks)
        alone = len(decoding) == 1 and not chunks  # a batch of one: its policy may trim its block
        decisions = self._decide(decoding, extra)
        tc = time.perf_counter()

        # propose: every drafting sequence's DFlash proposal and chain passes in one lazy graph,
        # evaluated together (a chain drafter's k passes per sequence, against its own cache)
        keys, props, group, heads = {}, {}, {}, {}
        for s, d in zip(decoding, decisions):
            keys[s.id] = self._split_keys(s)
            kd = keys[s.id][0]
            if d.source in s.chains:
                chain_context(self.chains[d.source], s, d.source)
                props[s.id] = self.chains[d.source].propose(
                    s.anchor, d.length - 1, s.chains[d.source], sampling=s.sampling, key=kd
                )
                heads[s.id] = d.length - 1
            elif d.source == DFLASH:
                if self.packed_drafter:
                    group.setdefault(d.length, []).append(s)
                    continue
                props[s.id] = self.drafter.propose(
                    s.anchor,
                    self._take_pending(s),
                    s.dcache,
                    d.length,
                    s.sampling,
                    kd,
                    **({"confidence": True} if self._wants_confidence(s, alone) else {}),
                )
        for L, ss in group.items():  # one block pass per block length for all its sequences
            h = draft_hidden_many(
                self.drafter, [s.anchor_id for s in ss], [self._take_pending(s) for s in ss], [s.dcache for s in ss], L
            )
            unary = self.drafter.logits(h)
            for i, s in enumerate(ss):
                props[s.id] = self.drafter.proposal(
                    h[i], unary[i], s.anchor, s.sampling, keys[s.id][0], self._wants_confidence(s, alone)
                )
        ran = len(props) - len(heads)  # sequences in DFlash passes this step
        ids = list(props)
        # pick decides the verify from the drafts and the drafter's confidence: where a sequence
        # picks, every draft is read first (one wait for all). Where none does (a fixed block, a
        # sampled cycle, a batch without lookup proposals) the verify is built on the lazy drafts
        # and they are read with the target's choices, in its one wait.
        lazy = bool(props) and all(props[sid].confidence is None for sid in ids)
        got = (
            self.waits.read(*[x for sid in ids for x in (props[sid].tokens, props[sid].confidence) if x is not None])
            if props and not lazy
            else []
        )
        td = time.perf_counter()
        # pick: greedy, the drafter's block kept, trimmed (alone) or the lookup's taken instead
        drafts: dict[int, list[int]] = {}
        ran_block: dict[int, int] = {}
        j = 0
        for sid in ids:
            conf = None
            if not lazy:  # (lazy: the drafts come with the choices)
                drafts[sid] = got[j]
                conf = got[j + 1] if props[sid].confidence is not None else None
                j += 1 + (conf is not None)
            props[sid] = (props[sid], conf)
        blocks = []
        for k, (s, d) in enumerate(zip(decoding, decisions)):
            p, conf = props.get(s.id, (None, None))
            if p is not None and s.id not in heads:
                ran_block[s.id] = d.length
                if conf is not None:
                    d = s.policy.pick(d, drafts[s.id], conf, s.ctx, trim=alone)
                    if d.source == LOOKUP:
                        p = None
                    elif d.length < len(drafts[s.id]) + 1:  # verify a prefix (or the anchor alone)
                        drafts[s.id] = drafts[s.id][: d.length - 1]
            if p is not None:
                props[s.id] = p
            else:
                props.pop(s.id, None)
            if d.source == LOOKUP:
                drafts[s.id] = list(s.ctx.lookup[: d.length - 1])
                if not s.sampling.greedy:  # a point-mass proposal
                    props[s.id] = Proposal(mx.array(drafts[s.id], mx.int32), None)
            decisions[k] = d
            blocks.append(
                len(drafts[s.id]) + 1 if s.id in drafts else (int(p.tokens.shape[0]) + 1 if p is not None else 1)
            )
        # lazy: the drafter's tokens, read with the target's choices
        unread = [s.id for s in decoding if s.id in props and s.id not in drafts]

        # verify: one target pass over every decoding sequence's rows and the prefill chunks
        # (from the drafter's graph when the drafts are read with the choices: both passes; else
        # pick and the host's work before it are the step's overhead)
        ts = tc if lazy else time.perf_counter()
        segs = []
        for s in decoding:
            if s.id in unread:
                row = mx.concatenate([mx.array([s.anchor_id], mx.int32), props[s.id].tokens.astype(mx.int32)])
            else:
                row = mx.array([s.anchor_id] + drafts.get(s.id, []), mx.int32)
            segs.append(Seg(row, s.cache, True, "all", s.row))
        for s, n in chunks:
            last = s.done + n == len(s.prompt)
            segs.append(
                Seg(mx.array(s.prompt[s.done : s.done + n], mx.int32), s.cache, False, "last" if last else "none")
            )
        outs = self.packed(segs, taps=self._taps, kv=self.kv)
        # The target's choices, one host transfer: a sequence stepping plain, its next token (a
        # sampled one's drawn in the graph); a greedy draft's rows, their argmax. Only a sampled
        # draft is accepted apart (sampling.sampled_acceptance), read in the same wait.
        greedy = [k for k, s in enumerate(decoding) if s.sampling.greedy or blocks[k] == 1]
        choice = (
            mx.concatenate(
                [
                    next_token(outs[k].logits, decoding[k].sampling, keys[decoding[k].id][1])
                    if blocks[k] == 1
                    else mx.argmax(outs[k].logits, axis=-1).astype(mx.int32)
                    for k in greedy
                ]
            )
            if greedy
            else None
        )
        mx.async_eval(
            [] if choice is None else [choice],
            [o.hidden for o in outs if o.hidden is not None],
            [o.final for o in outs if o.final is not None],
        )
        ahead = None
        if decoding and all(L == 1 for L in blocks) and not prefilling:
            ahead = self._queue(decoding, [choice[k : k + 1] for k in range(len(decoding))])

        # accept and roll back, per sequence
        results: list[tuple[int, Step]] = []
        finished: list[_Seq] = []
        verify_ms = 0.0
        rollback_s = 0.0
        greedy_ids: dict[int, list[int]] = {}
        sampled = {
            k: sampled_acceptance(outs[k].logits, props.get(s.id), s.sampling, keys[s.id][1])
            for k, s in enumerate(decoding)
            if k not in set(greedy)
        }
        tw = time.perf_counter()
        # the target's choices, the sampled acceptances and the drafts not read yet: one wait (the
        # verify pass ends here)
        if decoding:
            got = self.waits.read(
                *([] if choice is None else [choice]), *sampled.values(), *[props[sid].tokens for sid in unread]
            )
            for sid, toks in zip(unread, got[len(got) - len(unread) :]):
                drafts[sid] = toks
            got = got[: len(got) - len(unread)]
            if choice is not None:
                flat, r = got.pop(0), 0
                for k in greedy:
                    greedy_ids[k], r = flat[r : r + blocks[k]], r + blocks[k]
            sampled = dict(zip(sampled, got))
        # the verify pass: from building its graph to its choices on the host; a plain step with
        # the next one queued ahead, or a policy's plain step alone (queued before the policy is
        # asked about the next, as the single stream always has): the wait for its tokens at the
        # read (its pass overlapped the host's work)
        waited = ahead is not None or (
            alone and blocks == [1] and decisions[0].source == PLAIN and decoding[0].policy is not None
        )
        verify_ms = (time.perf_counter() - (tw if waited else ts)) * 1e3
        for k, (s, L) in enumerate(zip(decoding, blocks)):
            out = outs[k]
            draft_list = drafts.get(s.id, [])
            if k in greedy_ids:  # (a sampled sequence's plain step too)
                a, bonus = accept_greedy(draft_list, greedy_ids[k])
            else:
                a, bonus = sampled[k]
            tr0 = time.perf_counter()
            self.packed.rollback(s.cache, out.records, L, a + 1, s.row, self.waits)
            if s.id in heads:  # the chain's own rows go; the accepted come back with real features
                self.chains[decisions[k].source].rollback(s.chains[decisions[k].source])
            rollback_s += time.perf_counter() - tr0
            self._keep(s, out, a + 1, [s.anchor_id] + draft_list[:a])
            s.fed.append(s.anchor_id)
            s.fed.extend(draft_list[:a])
            step = self._commit(
                s,
                draft_list[:a],
                bonus,
                L,
                a,
                decisions[k].source,
                (td - tc) * 1e3 if (s.id in ran_block or s.id in heads) and not lazy else 0.0,
                ran_block.get(s.id, 0),
                heads.get(s.id, 0),
                lazy and (s.id in ran_block or s.id in heads),
            )
            if ahead is not None:
                self._fed_ahead(s, ahead.outs[k])
            results.append((s.id, step))
            if step.finish_reason is not None:
                finished.append(s)
        if self.gdn and isinstance(self.packed, PackedTarget):
            self.waits.eval([c.cache for s in decoding for i, c in enumerate(s.cache) if i in self.gdn])

        # prefill chunks: the drafter's context, and a sequence whose prompt is done gets its first
        # token (every such sequence's, read in one wait)
        firsts = []
        for k, (s, n) in enumerate(chunks, start=len(decoding)):
            out = outs[k]
            if (
                s.dcache is not None and s.pending
            ):  # the previous chunk: into the drafter's cache now (frees its features)
                self.drafter.add_context(s.pending.pop(), s.dcache)
            self._keep(s, out, n, s.prompt[s.done : s.done + n])
            for kind in s.chains:  # a chain head's K/V rows of the chunk now (its last row waits)
                self._flush_chain(s, kind)
            s.done += n
            if s.done < len(s.prompt):
                continue
            s.key, sub = mx.random.split(s.key)
            firsts.append((s, sample_target(out.logits, s.sampling, sub)[0]))
        for (s, _), first in zip(firsts, self.waits.read(*[t for _, t in firsts]) if firsts else []):
            s.anchor_id = first
            s.fed = list(s.prompt)
            toks, reason = truncate_reply([s.anchor_id], 0, s.max_tokens, s.eos)
            s.n = len(toks)
            if s.index is not None:
                s.index.extend(toks)
            ms = (time.perf_counter() - s.t_join) * 1e3
            step = Step(
                tuple(toks),
                elapsed_ms=ms,
                verify_ms=ms,
                prefill=True,
                prompt_tokens=len(s.prompt),
                cached_tokens=s.cached,
                finish_reason=reason,
            )
            s.prev = Step(tuple(toks), prefill=True, prompt_tokens=len(s.prompt))
            results.append((s.id, step))
            if reason is not None:
                finished.append(s)
        if chunks:  # evaluate the prefill chunks' caches now (bounded graphs)
            self.waits.eval(
                [c.state for s, _ in chunks for c in s.cache],
                [c.state for s, _ in chunks if s.dcache is not None for c in s.dcache],
                [cc.state for s, _ in chunks for cc in s.chains.values()],
            )
            if self.kv is not None:  # prefilled: its K/V join the batch's rows
                joining = [s for s, _ in chunks if s.anchor_id >= 0 and s not in finished]
                for j, s in enumerate(joining):
                    s.row = self.kv.join(s.cache, more=len(joining) - 1 - j)
        self._queued = ahead
        out = self._close(
            t0,
            results,
            finished,
            len(decoding),
            bool(chunks),
            blocks,
            extra,
            ran,
            None if lazy else (td - tc) * 1e3 if props else 0.0,
            verify_ms,
            rollback_s * 1e3,
            self.waits.count - waits0,
            sum(heads.values()),
        )
        self._drop_queued()
        return out

    # -- a pipelined run of plain steps ---------------------------------------------------------
    def _queue(self, decoding: list[_Seq], tokens: list[mx.array]) -> _Queued | None:
        """Queue the next step now, fed ``tokens`` (each sequence's token of the step in flight,
        still lazy), when it will be a plain step for every sequence: each one's policy stays plain
        (asked one token ahead, as ``spec_steps`` does in a plain run: its lookup context lags one
        token). The step's K/V rows are written when it runs; the
        tokens that feed it join ``fed`` (and its features ``pending``) as soon as they are read
        (``_fed_ahead``), so the caches agree with them between steps; a sequence that ends (EOS,
        a stop string, a cancel, its last token) leaves with that row, its last token fed, as
        ``spec_steps`` does at EOS."""
        if not self.pipeline or not decoding:
            return None
        if self.kv is not None and len(self.kv.rows) != len(decoding):
            return None
        if not self._next_stays_plain(decoding):
            return None
        for s in decoding:  # now each policy, and the batch, count the step as chosen
            self._wished_decision(s, batch=len(decoding), asked=True, ahead=True)
        self.policy.count([1] * len(decoding), len(decoding) > 1)
        segs = [Seg(t.astype(mx.int32), s.cache, True, "all", s.row) for s, t in zip(decoding, tokens)]
        outs = self.packed(segs, taps=self._taps, kv=self.kv)
        # (a sampled sequence's keys are consumed as by an unpipelined plain step)
        choice = mx.concatenate(
            [next_token(o.logits, s.sampling, self._split_keys(s)[1]) for o, s in zip(outs, decoding)]
        )
        mx.async_eval(
            choice, [o.hidden for o in outs if o.hidden is not None], [o.final for o in outs if o.final is not None]
        )
        return _Queued(list(decoding), outs, choice)

    def _fed_ahead(self, s: _Seq, out: SegOut) -> None:
        """``s``'s new anchor feeds the step queued ahead: its K/V row is (being) written."""
        self._keep(s, out, 1, [s.anchor_id])
        s.fed.append(s.anchor_id)

    def _run_queued(self, q: _Queued, t0: float) -> list[tuple[int, Step]]:
        """Read the step queued ahead (after queuing the next one, when it stays plain too)."""
        live = [(k, s) for k, s in enumerate(q.seqs) if self._seqs.get(s.id) is s]
        if self.kv is not None:  # the rows' segments in slot order (leavers reordered them)
            live.sort(key=lambda ks: ks[1].row.slot)
        decoding = [s for _, s in live]
        prefilling = any(s.anchor_id < 0 for s in self._seqs.values())
        ahead = None if prefilling else self._queue(decoding, [q.choice[k : k + 1] for k, _ in live])
        tw = time.perf_counter()
        waits0 = self.waits.count
        (flat,) = self.waits.read(q.choice)  # the queued pass ends here
        self.pipelined += 1
        verify_ms = (time.perf_counter() - tw) * 1e3
        results, finished = [], []
        for j, (k, s) in enumerate(live):
            step = self._commit(s, [], flat[k], 1, 0, PLAIN, 0.0)
            if ahead is not None:
                self._fed_ahead(s, ahead.outs[j])
            results.append((s.id, step))
            if step.finish_reason is not None:
                finished.append(s)
        self._queued = ahead
        out = self._close(
            t0,
            results,
            finished,
            len(decoding),
            False,
            [1] * len(decoding),
            0,
            0,
            0.0,
            verify_ms,
            0.0,
            self.waits.count - waits0,
        )
        self._drop_queued()
        return out

    # -- committing a step ------------------------------------------------------------------------
    def _commit(
        self,
        s: _Seq,
        accepted: list[int],
        bonus: int,
        L: int,
        a: int,
        source: str,
        draft_ms: float,
        draft_block: int = 0,
        head_passes: int = 0,
        draft_in_verify: bool = False,
    ) -> Step:
        """Count a decoding sequence's step: its committed tokens (EOS, max_tokens), its lookup
        index, its new anchor, its acceptance and probe spacing (``draft_block``: the block its
        DFlash drafter ran at, 0 if it did not run; ``head_passes``: its chain drafter's passes;
        ``draft_in_verify``: its drafts were read in the verify's wait)."""
        committed, reason = truncate_reply(accepted + [bonus], s.n, s.max_tokens, s.eos)
        s.n += len(committed)
        if s.index is not None:
            s.index.extend(committed)
        s.anchor_id = bonus
        s.acc.observe(L - 1, a)
        if L > 1:
            s.plain_run = 0
            gained = a > 0
            s.probe_every = self.policy.probe_every if gained else min(self.policy.max_probe, s.probe_every * 2)
        else:
            s.plain_run += 1
        self._feed_drafter(s, DFLASH if draft_block else source if head_passes else "")
        return Step(
            tuple(committed),
            drafted=L - 1,
            accepted=a,
            block_size=L,
            draft_ms=draft_ms,
            finish_reason=reason,
            source=source,
            draft_block=draft_block,
            head_passes=head_passes,
            draft_in_verify=draft_in_verify,
        )

    def _close(
        self,
        t0: float,
        results: list,
        finished: list,
        n_decoding: int,
        prefilled: bool,
        blocks: list[int],
        extra: int,
        ran: int,
        draft_ms: float | None,
        verify_ms: float,
        rollback_ms: float,
        waits: int,
        heads: int = 0,
    ) -> list[tuple[int, Step]]:
        """The step's bookkeeping: the cost fit, the counters, each decoding Step's timings and its
        policy's lesson, finished sequences out (their caches to ``on_exit``)."""
        elapsed = (time.perf_counter() - t0) * 1e3
        drafting = sum(1 for L in blocks if L > 1)
        self.policy.observe(sum(blocks), ran, elapsed, draft_ms, extra, drafting, heads)
        if n_decoding:
            self.batch_sizes[n_decoding] = self.batch_sizes.get(n_decoding, 0) + 1
            self.steps["drafted" if drafting else "plain"] += 1
        out_steps = []
        for sid, st in results:
            if st.prefill:
                st = replace(st, host_syncs=waits)
                if self._seqs[sid].policy is not None:  # (a policy ignores it; it is shown every step)
                    self._seqs[sid].policy.observe(st)
            else:
                st = replace(st, verify_ms=verify_ms, rollback_ms=rollback_ms, elapsed_ms=elapsed, host_syncs=waits)
                s = self._seqs[sid]
                s.prev = st
                if s.policy is not None:
                    # A sequence's own policy learns acceptance; step costs under a batch are the
                    # batch's (BatchBudget's business), so it sees them only when it ran alone. A
                    # seeded sampled run must give the same text every time: its policy may not
                    # learn from timings (they vary), only from the tokens.
                    seeded = not s.sampling.greedy and s.sampling.seed is not None
                    s.policy.observe(st if n_decoding == 1 and not prefilled and not seeded else untimed(st))
            out_steps.append((sid, st))
        # their rows leave together, from the highest slot down (the fewest rows move into holes)
        finished = sorted(finished, key=lambda s: -1 if s.row is None else s.row.slot, reverse=True)
        self._release(*finished)
        for s in finished:
            self._seqs.pop(s.id, None)
            hand_over(s.on_exit, lambda s=s: s.final(self.drafter, self.chains))
        self._since_clear += sum(len(st.tokens) for _, st in out_steps)
        if self._since_clear >= 256:
            self._since_clear = 0
            mx.clear_cache()
        return out_steps


class _Queued(NamedTuple):
    """A plain step queued ahead: its sequences (in their slot order then), its outputs and its
    next tokens (lazy; sampled ones drawn in the graph)."""

    seqs: list
    outs: list
    choice: mx.array


def batched_steps(
    decoder: BatchDecoder,
    jobs: Sequence[dict],
    joins: dict[int, int] | None = None,
    cancels: dict[int, int] | None = None,
):
    """Run ``jobs`` (keyword arguments of ``BatchDecoder.add``) to completion on ``decoder``;
    yields ``(job index, Step)``. ``joins``: job index -> step number at which it joins (default
    0); ``cancels``: job index -> step number at which it is cancelled. For tests and bench."""
    joins = joins or {}
    cancels = cancels or {}
    sid_of: dict[int, int] = {}
    job_of: dict[int, int] = {}
    t = 0
    while True:
        for j, kw in enumerate(jobs):
            if j not in sid_of and joins.get(j, 0) <= t:
                sid_of[j] = decoder.add(**kw)
                job_of[sid_of[j]] = j
        for j, at in cancels.items():
            if j in sid_of and at == t:
                decoder.cancel(sid_of[j])
        if not len(decoder) and len(sid_of) == len(jobs):
            return
        for sid, st in decoder.step():
            yield job_of[sid], st
        t += 1


__all__ = [
    "Seg",
    "SegOut",
    "Row",
    "RowsPlan",
    "BatchKV",
    "PackedTarget",
    "Acceptance",
    "StepCost",
    "BatchBudget",
    "BatchDecoder",
    "batched_steps",
]
