"""Losslessness check: greedy speculative decoding against greedy plain decoding of one pair.

For every prompt and block size both runs decode greedily; the outputs must be the same tokens
(and so the same bytes). At the first divergence the target's logits at that position are
recovered in both arithmetic forms, by replaying each run deterministically up to it:

- single-token form: mlx-lm's plain decoding step (log-probs, what its argmax saw);
- batched-verify form: the row of the speculative run's verify pass that chose the token.

Verdicts:

- ``identical``: same tokens.
- ``numeric``: a near tie. Each run took its own argmax, and the two tokens are within a
  tolerance of each other in both forms (``tolerance``: a few units of rounding of the logits'
  dtype at their magnitude). Batched and single-token kernels may round differently.
- ``mismatch``: a real bug. The speculative run committed a token its own verify pass did not
  choose (accept rule), or the two forms disagree by more than rounding (rollback, cache or
  position bug), or one run stopped where the other did not.

A diverging prompt is re-run at block size 2 (one draft, rollback by at most one token) to
separate verify-width arithmetic from accept or rollback bugs; its outcome is reported and the
worse of the two verdicts counts.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from . import backend as seam
from .decode import plain_steps, spec_steps
from .errors import BadRequest
from .prompts import BUILTIN, Prompt

log = logging.getLogger(__name__)

IDENTICAL, NUMERIC, MISMATCH = "identical", "numeric", "mismatch"
_RANK = {IDENTICAL: 0, NUMERIC: 1, MISMATCH: 2}
PREFILL_STEP = 2048  # plain and speculative runs prefill in the same chunks as generate does

# Rounding allowance between two computations of one logit, in units of eps(dtype) * max|logit|.
# 16-bit logits are dominated by the final rounding (a few ulps); float32 by the order of long
# reductions through the network, which the final rounding does not hide.
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
ULPS = {"float32": 64.0, "float16": 4.0, "bfloat16": 4.0}  # the CPU backend (BLAS), measured
# GPU backends round differently between their single-row and multi-row kernels (quantized
# matmul, attention above 8 query rows): a wider allowance, until tests/test_mac_config.py's
# Metal calibration (which runs on Metal only and prints what it measured) narrows it.
ULPS_GPU = {"float32": 256.0, "float16": 8.0, "bfloat16": 8.0}


def tolerance(dtype: str, magnitude: float, backend: str | None = None) -> float:
    """Largest top-2 logit gap that rounding alone can flip, for logits of ``dtype`` of size
    up to ``magnitude`` on ``backend`` ("metal" | "gpu" | "cpu"; None: the one in use, see
    backend.current()). Unknown dtypes get the bfloat16 allowance."""
    if backend is None:
        backend = seam.current().kind
    ulps = ULPS if backend == "cpu" else ULPS_GPU
    return ulps.get(dtype, ulps["bfloat16"]) * EPS.get(dtype, 2.0**-7) * max(1.0, magnitude)


@dataclass(frozen=True, slots=True)
class Divergence:
    index: int  # first generated position where the runs differ
    plain_token: int | None  # None: that run had already stopped
    spec_token: int | None
    plain_text: str
    spec_text: str
    single_gap: float | None  # plain run: top-1 minus top-2 logit at that position
    batched_gap: float | None  # speculative run's verify pass: top-1 minus top-2
    flip: float | None  # how far the two tokens are apart, in the form that disfavours the pick
    drift: float | None  # max |batched - single| over the vocabulary (after centering)
    tolerance: float | None
    dtype: str | None
    verdict: str
    reason: str


@dataclass(frozen=True, slots=True)
class PromptResult:
    prompt: str  # prompt id
    block_size: int
    verdict: str
    prompt_tokens: int
    plain_tokens: int
    spec_tokens: int
    plain_sha256: str  # of the token ids, comma-separated decimal
    spec_sha256: str
    plain_text_sha256: str  # of the decoded text, UTF-8
    spec_text_sha256: str
    drafted: int = 0
    accepted: int = 0
    cycles: int = 0
    divergence: Divergence | None = None
    block2: str | None = None  # outcome of the block-size-2 re-run of a diverging prompt
    source: str = "dflash"  # what drafted every cycle: "dflash", or a chain drafter ("mtp", "eagle") at depth B - 1

    @property
    def tau(self) -> float:
        return (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0

    def describe(self) -> str:
        what = f"B={self.block_size:<3}" if self.source == "dflash" else f"{self.source} k={self.block_size - 1}"
        head = f"{self.prompt:<12} {what} {self.verdict:<9}"
        if self.divergence is None:
            return (
                f"{head} {self.plain_tokens} tokens, sha256 {self.plain_sha256[:12]} (tokens) "
                f"{self.plain_text_sha256[:12]} (text), tau {self.tau:.2f}"
            )
        d = self.divergence
        out = (
            f"{head} first divergence at token {d.index}: plain {d.plain_text!r} ({d.plain_token}) "
            f"vs speculative {d.spec_text!r} ({d.spec_token}); {d.reason}"
        )
        return out + (f"; block size 2: {self.block2}" if self.block2 else "")


@dataclass(frozen=True, slots=True)
class Report:
    method: str
    target: str
    drafter: str | None
    max_tokens: int
    block_sizes: tuple[int, ...]
    results: tuple[PromptResult, ...]

    def count(self, verdict: str) -> int:
        return sum(r.verdict == verdict for r in self.results)

    @property
    def ok(self) -> bool:
        return self.count(MISMATCH) == 0

    def summary(self) -> str:
        return f"{self.count(IDENTICAL)} identical, {self.count(NUMERIC)} numeric, {self.count(MISMATCH)} mismatch"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["summary"] = {v: self.count(v) for v in (IDENTICAL, NUMERIC, MISMATCH)}
        d["ok"] = self.ok
        return d


def check(
    pair,
    prompts: Sequence[Prompt | str | Sequence[int]] | None = None,
    block_sizes: Sequence[int] | None = None,
    max_tokens: int = 64,
    *,
    tol: float | None = None,
    progress: Callable[[PromptResult], None] | None = None,
) -> Report:
    """Compare greedy speculative with greedy plain decoding on every prompt and block size, for
    the DFlash drafter and each chain drafter the pair loaded (a chain of depth B - 1 every cycle).

    Runs on the thread that owns ``pair`` (from another thread: ``engine.call(lambda pair:
    check(pair, ...))``). ``prompts`` are ``prompts.Prompt``s, raw strings (chat template
    applied) or token-id lists; default: the built-in set. ``block_sizes`` default to the
    drafter's checkpoint block size (4 rows for a chain-only pair). ``tol`` overrides the
    dtype-derived tolerance.
    """
    chains = tuple(getattr(pair, "chains", None) or ())
    if pair.drafter is None and not chains:
        raise BadRequest(
            "verify compares speculative with plain decoding and needs a drafter (drop --no-draft, or pass "
            "--drafter, or --draft mtp / eagle)"
        )
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be >= 1 (got {max_tokens})")
    sizes = tuple(block_sizes or ((pair.drafter.args.block_size,) if pair.drafter is not None else (4,)))
    sources = (("dflash",) if pair.drafter is not None else ()) + chains
    if any(b < 2 for b in sizes):
        raise BadRequest(f"block sizes must be >= 2 (got {list(sizes)})")
    eos = tuple(pair.tokenizer.eos_token_ids)
    results = []
    for n, item in enumerate(BUILTIN if prompts is None else prompts):
        name, ids = _encode(pair.tokenizer, item, n)
        plain = [
            t
            for s in plain_steps(
                pair.model, ids, max_tokens=max_tokens, eos_ids=eos, prefill_step=PREFILL_STEP, kv=pair.kv
            )
            for t in s.tokens
        ]
        for source, B in ((src, B) for src in sources for B in sizes):
            res = _compare(pair, name, ids, plain, B, max_tokens, eos, tol, source)
            if res.verdict != IDENTICAL and B != 2:
                again = _compare(pair, name, ids, plain, 2, max_tokens, eos, tol, source)
                note = IDENTICAL if again.divergence is None else (f"{again.verdict} at token {again.divergence.index}")
                verdict = max(res.verdict, again.verdict, key=_RANK.get)
                res = replace(res, block2=note, verdict=verdict)
            log.info("verify %s", res.describe())
            results.append(res)
            if progress is not None:
                progress(res)
    method = ("dflash2" if pair.drafter.args.is_v2 else "dflash") if pair.drafter is not None else "+".join(chains)
    return Report(method, pair.target_id, pair.drafter_id, max_tokens, sizes, tuple(results))


def _encode(tokenizer, item, n: int) -> tuple[str, list[int]]:
    if isinstance(item, Prompt):
        return item.id, item.encode(tokenizer)
    if isinstance(item, str):
        return f"prompt-{n + 1}", Prompt(f"prompt-{n + 1}", "user", item).encode(tokenizer)
    return f"ids-{n + 1}", [int(t) for t in item]


def _sha(tokens: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()


def _text_sha(tokenizer, tokens: Sequence[int]) -> str:
    return hashlib.sha256(tokenizer.decode(list(tokens)).encode("utf-8")).hexdigest()


def _compare(pair, name, ids, plain, B, max_tokens, eos, tol, source: str = "dflash") -> PromptResult:
    spec, drafted, accepted, cycles, error = [], 0, 0, 0, None
    try:
        for s in spec_steps(
            pair.target,
            pair.drafter,
            ids,
            block_size=B,
            max_tokens=max_tokens,
            eos_ids=eos,
            prefill_step=PREFILL_STEP,
            chains=getattr(pair, "chains", None) or None,
            source=source,
        ):
            spec.extend(s.tokens)
            if not s.prefill:
                drafted, accepted, cycles = drafted + s.drafted, accepted + s.accepted, cycles + 1
    except Exception as e:  # a crash of the speculative path is a finding, not an abort
        error = f"speculative decoding raised {type(e).__name__}: {e}"
    tk = pair.tokenizer
    res = PromptResult(
        name,
        B,
        IDENTICAL,
        len(ids),
        len(plain),
        len(spec),
        _sha(plain),
        _sha(spec),
        _text_sha(tk, plain),
        _text_sha(tk, spec),
        drafted,
        accepted,
        cycles,
        source=source,
    )
    if error is None and spec == plain:
        return res
    i = next((k for k, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    if error is not None:
        div = _divergence(tk, plain, spec, i, MISMATCH, error)
    else:
        div = _attribute(pair, ids, plain, spec, i, B, max_tokens, eos, tol, source)
    return replace(res, verdict=div.verdict, divergence=div)


def _divergence(tk, plain, spec, i, verdict, reason, **rows) -> Divergence:
    p = plain[i] if i < len(plain) else None
    s = spec[i] if i < len(spec) else None
    text = lambda t: "" if t is None else tk.decode([t])
    fields = dict(single_gap=None, batched_gap=None, flip=None, drift=None, tolerance=None, dtype=None)
    return Divergence(i, p, s, text(p), text(s), **(fields | rows), verdict=verdict, reason=reason)


def _attribute(pair, ids, plain, spec, i, B, max_tokens, eos, tol, source: str = "dflash") -> Divergence:
    tk = pair.tokenizer
    if i >= len(plain) or i >= len(spec):
        short, longer = ("speculative", "plain") if len(spec) < len(plain) else ("plain", "speculative")
        return _divergence(
            tk,
            plain,
            spec,
            i,
            MISMATCH,
            f"the {short} run stopped after {i} tokens while the {longer} run went on "
            "with the same tokens (finish/truncation bug)",
        )
    single = _plain_row(pair.model, ids, i, max_tokens)  # log-probs (V,)
    batched = _spec_row(pair, ids, i, B, max_tokens, eos, source)  # logits (V,)
    dtype = str(batched.dtype).rsplit(".", 1)[-1]
    return classify(single, batched, plain[i], spec[i], dtype, tol, tk=tk, plain=plain, spec=spec, i=i)


def classify(
    single: mx.array,
    batched: mx.array,
    plain_token: int,
    spec_token: int,
    dtype: str = "float32",
    tol: float | None = None,
    *,
    tk=None,
    plain=None,
    spec=None,
    i: int = 0,
) -> Divergence:
    """The verdict at a divergence from the target's logits there in both forms.

    single: the plain run's row (logits or log-probs); batched: the verify row that chose the
    speculative token. Pure, so it is testable on synthetic rows.
    """
    ls = single.astype(mx.float32)
    lb = batched.astype(mx.float32)
    ls = ls - mx.logsumexp(ls)
    lb_c = lb - mx.logsumexp(lb)
    top_s, top_b = mx.topk(ls, 2), mx.topk(lb, 2)
    vals = mx.stack(
        [
            ls[plain_token],
            ls[spec_token],
            lb[plain_token],
            lb[spec_token],
            ls.max(),
            lb.max(),
            mx.abs(lb).max(),
            mx.abs(lb_c - ls).max(),
            top_s.max() - top_s.min(),
            top_b.max() - top_b.min(),
        ]
    ).tolist()
    s_p, s_s, b_p, b_s, s_max, b_max, mag, drift, gap_s, gap_b = vals
    tol = tolerance(dtype, mag) if tol is None else tol
    flip = max(b_s - b_p, s_p - s_s)
    rows = dict(single_gap=gap_s, batched_gap=gap_b, flip=flip, drift=drift, tolerance=tol, dtype=dtype)
    if b_s < b_max:
        verdict, reason = (
            MISMATCH,
            (
                f"the speculative run committed a token its own verify pass did not choose (logit "
                f"{b_s:.4f} vs top {b_max:.4f}): accept-rule bug"
            ),
        )
    elif s_p < s_max:
        verdict, reason = MISMATCH, "the plain run did not take its own argmax"
    elif flip <= tol:
        verdict, reason = (
            NUMERIC,
            (
                f"near tie: the two tokens are {flip:.3g} apart (tolerance {tol:.3g}, {dtype}); top-2 gap "
                f"single-token {gap_s:.3g}, batched-verify {gap_b:.3g}"
            ),
        )
    else:
        verdict, reason = (
            MISMATCH,
            (
                f"the forms disagree by {flip:.3g} > tolerance {tol:.3g} ({dtype}; drift {drift:.3g}); "
                f"top-2 gap single-token {gap_s:.3g}, batched-verify {gap_b:.3g}: the verify pass saw a "
                "different context (rollback, cache or position bug)"
            ),
        )
    if tk is None:
        return Divergence(i, plain_token, spec_token, "", "", **rows, verdict=verdict, reason=reason)
    return _divergence(tk, plain, spec, i, verdict, reason, **rows)


def _plain_row(model, ids, i: int, max_tokens: int) -> mx.array:
    """Replay plain decoding exactly (mlx-lm's generate_step) and return step i's log-probs."""
    gen = generate_step(mx.array(ids, mx.int32), model, max_tokens=max_tokens, prefill_step_size=PREFILL_STEP)
    try:
        for k, (_, logprobs) in enumerate(gen):
            if k == i:
                mx.eval(logprobs)
                return logprobs
    finally:
        gen.close()
    raise AssertionError(f"plain replay ended before token {i}")


class _Recorder:
    """The target with every call passed through; keeps the logits row whose input sits at
    absolute position ``pos`` (the row that predicts the token at ``pos + 1``)."""

    def __init__(self, target, pos: int):
        self._target, self._pos, self._at = target, pos, 0
        self.row: mx.array | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def make_cache(self):
        self._at = 0
        return self._target.make_cache()

    def __call__(self, ids, cache, **kw):
        out = self._target(ids, cache, **kw)
        T, R = ids.shape[1], out.logits.shape[1]  # R = 1 for a last_only prefill chunk
        k = self._pos - (self._at + T - R)
        if 0 <= k < R:  # later calls overwrite: the last one covering pos is the one that decided
            self.row = out.logits[0, k]
        self._at += T
        return out

    def rollback(self, cache, n_verified: int, n_keep: int):
        self._at -= max(0, n_verified - n_keep)
        return self._target.rollback(cache, n_verified, n_keep)


def _spec_row(pair, ids, i: int, B: int, max_tokens: int, eos, source: str = "dflash") -> mx.array:
    """Replay the speculative run (same block size and max_tokens, so the same verify widths)
    until token i is committed; return the verify row that chose it."""
    rec = _Recorder(pair.target, len(ids) + i - 1)
    steps = spec_steps(
        rec,
        pair.drafter,
        ids,
        block_size=B,
        max_tokens=max_tokens,
        eos_ids=eos,
        prefill_step=PREFILL_STEP,
        chains=getattr(pair, "chains", None) or None,
        source=source,
    )
    n = 0
    try:
        for s in steps:
            n += len(s.tokens)
            if n > i:
                break
    finally:
        steps.close()
    if rec.row is None:
        raise AssertionError(f"speculative replay never computed token {i}")
    mx.eval(rec.row)
    return rec.row


__all__ = ["check", "classify", "tolerance", "Report", "PromptResult", "Divergence", "IDENTICAL", "NUMERIC", "MISMATCH"]
