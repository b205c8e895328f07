"""The single stream, as a generator of ``Step``s (token level; text lives in text.py).

``spec_steps`` is the one decode loop (``batch.BatchDecoder``) with one sequence, run through the
target's own forward (``batch.OwnForward``): prefill (chunked) -> first token from the target ->
cycles of: choose the cycle's source and length (a ``policy.DraftPolicy``, or a fixed DFlash
block) -> draft (DFlash: ``[anchor, MASK x (L-1)]`` through the drafter; lookup: the
continuation of the best earlier match of the sequence's tail in everything the target has seen,
``lookup.SuffixIndex``; plain: nothing) -> one target verify pass over ``[anchor, d1..d(L-1)]``
-> accept the longest matching prefix plus the target's bonus (greedy), or rejection-sample
against the proposal (T > 0; a lookup draft is a point-mass proposal) -> roll the target cache
back -> queue the accepted rows' features for the drafter's context cache (pushed at its next
pass, whatever the source of this cycle). A run of plain steps is pipelined as mlx-lm's
``generate_step``: the next step is queued before this one's token is read.

Timings are taken where each pass really finishes: ``draft_ms`` ends when the draft tokens are
on the host, ``verify_ms`` when the target's choice is; a cycle with nothing to ``pick`` (a fixed
block, sampling) reads its drafts with the target's choices, in one wait, and books both passes
to ``verify_ms`` (``Step.draft_in_verify``); a pipelined plain step's ``verify_ms`` is the wait
for its token when it is read. The host's own work (the policy, ``pick``, the lookup,
bookkeeping) is ``elapsed_ms`` minus those. ``host_syncs``: the waits for the device the step
took (``batch.DeviceWaits``).

A prefill budget (``prefill_budget_s``, the server's ``--prefill-timeout``) is checked between
prefill chunks: past it, the run is cancelled before its next chunk (``errors.PrefillTimeout``,
naming how many chunks ran), its caches dropped.

Both loops can start from a ``Prefill`` (caches already holding a prefix of the prompt, from the
prefix cache) and hand their final caches to ``on_exit`` when they end or are closed, so the next
turn of a conversation prefills only its new tokens.

``plain_steps``: mlx-lm's own ``generate_step`` (the baseline a user would otherwise run).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .batch import BatchDecoder, DeviceWaits, Step, hand_over, lookup_context, prefix_start, untimed
from .drafter import Drafter
from .errors import PrefillTimeout
from .lookup import SuffixIndex
from .policy import LOOKUP
from .prefix import Prefill
from .sampling import SamplingConfig
from .target import KVQuant, Target, make_cache

log = logging.getLogger(__name__)

__all__ = ["Step", "untimed", "lookup_context", "spec_steps", "plain_steps"]


def spec_steps(
    target: Target,
    drafter: Drafter,
    prompt: Sequence[int],
    *,
    block_size: int,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    sampling: SamplingConfig = SamplingConfig(),
    prefill_step: int = 2048,
    policy=None,
    lookup_ngram: int = 4,
    index: SuffixIndex | None = None,
    prefill: Prefill | None = None,
    on_exit: Callable[[Prefill], None] | None = None,
    waits: DeviceWaits | None = None,
    chains: dict | None = None,
    source: str = "dflash",
    prefill_budget_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Step]:
    """Speculative decoding with a DFlash drafter, chain drafters (MTP, EAGLE-3) and lookup drafts.
    Lossless: the output is the target's (greedy: token for token; T > 0: in distribution).

    ``policy`` (a ``policy.DraftPolicy``, one per sequence) chooses every cycle's source
    (plain / dflash / lookup) and length; at greedy, after a DFlash pass, it may trim the block
    or switch to the lookup's proposal (``pick``); it ``observe``s every Step. Without a policy
    every cycle drafts ``block_size`` with the drafter (a fixed-block run). ``index``: the lookup
    index over ``prompt`` that the policy's lookup drafts come from (default
    ``SuffixIndex(prompt, lookup_ngram, stop=eos_ids)``), extended by the committed tokens.

    ``prefill``: caches (target and drafter) already holding a proper prefix of ``prompt``; they
    are advanced in place. ``on_exit`` receives the final caches and the ids they hold when the
    run ends or the generator is closed between steps (not after an error). ``waits``: what
    every wait for the device goes through (counted per step in ``Step.host_syncs``).
    ``chains``: the chain drafters (kind -> ``chain.ChainDrafter``) the policy may draft with;
    ``target`` is then the view returning every drafter's features (``batch.BatchDecoder``).
    ``drafter`` may be None when the policy drafts from other sources only. ``source``: what
    every cycle drafts without a policy ("dflash", or a chain kind at depth ``block_size - 1``).
    ``prefill_budget_s`` (None or 0: no limit): seconds the prefill may take by ``clock``, checked
    before every prefill chunk of ``prefill_step`` tokens after the first; past it the run ends
    with ``PrefillTimeout`` (its caches dropped, nothing handed to ``on_exit``).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    if not prompt:
        raise ValueError("empty prompt")
    prefix_start(prefill, prompt)
    if prefill is not None and drafter is not None and prefill.drafter is None:
        raise ValueError("a speculative run needs the drafter's context cache in its prefill")
    if index is not None and (policy is None or LOOKUP not in policy.sources):
        raise ValueError("a lookup index needs a policy that drafts from it (LOOKUP among its sources)")
    if index is not None and index.ids != [int(t) for t in prompt]:
        raise ValueError("the lookup index must hold the prompt, and nothing after it")
    dec = BatchDecoder(
        target,
        drafter,
        block_size=block_size,
        max_batch=1,
        prefill_chunk=prefill_step,
        prefill_step=prefill_step,
        own_forward=True,
        waits=waits,
        chains=chains,
    )
    sid = dec.add(
        prompt,
        max_tokens=max_tokens,
        eos_ids=eos_ids,
        sampling=sampling,
        prefill=prefill,
        on_exit=on_exit,
        policy=policy,
        lookup_ngram=lookup_ngram,
        index=index,
        source=source,
    )
    budget = _PrefillBudget(prefill_budget_s, _chunks(len(prompt) - prefix_start(prefill, prompt), prefill_step), clock)
    try:
        while len(dec):
            budget.check()
            got = dec.step()
            budget.ran(bool(got))
            for _, step in got:
                yield step
    except GeneratorExit:
        dec.cancel(sid)  # between steps: the caches agree with the ids they hold
        raise
    except BaseException:
        dec.cancel(sid, keep=False)
        raise


def _chunks(tokens: int, step: int) -> int:
    return -(-max(0, tokens) // max(1, step))


class _PrefillBudget:
    """The prefill's time budget, checked before each chunk after the first (a chunk that ran
    is counted by ``ran``; the first step that commits a token ends the prefill)."""

    def __init__(self, seconds: float | None, total: int, clock: Callable[[], float]):
        self.seconds, self.clock, self.total = seconds or None, clock, total
        self.chunks, self.start = 0, clock() if seconds else 0.0

    def check(self) -> None:
        if self.seconds is None or not self.chunks:
            return
        took = self.clock() - self.start
        if took > self.seconds:
            raise PrefillTimeout(
                f"the prefill ran past its budget of {self.seconds:g} s ({took:.1f} s): cut after "
                f"{self.chunks} of {self.total} prefill chunks; send a shorter prompt"
            )

    def ran(self, committed: bool) -> None:
        if self.seconds is None:
            return
        if committed:
            self.seconds = None  # the first token is out: decoding has no prefill budget
        else:
            self.chunks += 1


def plain_steps(
    model,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    sampling: SamplingConfig = SamplingConfig(),
    prefill_step: int = 2048,
    prefill: Prefill | None = None,
    on_exit: Callable[[Prefill], None] | None = None,
    prefill_budget_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    kv: KVQuant | None = None,
) -> Iterator[Step]:
    """Plain decoding through mlx-lm's own ``generate_step`` (one token per step).

    ``prefill`` / ``on_exit`` / ``prefill_budget_s`` as in ``spec_steps`` (target cache only).
    With a budget, the prompt's chunks (all but its last token) are run here, as
    ``generate_step`` runs them, so the budget is checked between them. ``kv``: the K/V cache
    quantized from its first row (``--kv-bits``), as the speculative loop's target caches are.
    """
    eos = frozenset(eos_ids)
    done = prefix_start(prefill, prompt)
    cache = prefill.target if prefill else make_cache(model, kv)
    rows = (KVCache, QuantizedKVCache)
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    sampler = sampling.mlx_sampler()
    t = time.perf_counter()
    first = True
    seq = list(prompt)

    def final() -> Prefill | None:
        # generate_step feeds each token before yielding it, so the cache holds a prefix of seq.
        held = next((c.offset for c in cache if type(c) in rows), None)
        if held is None or held > len(seq):
            return None
        for c in cache:
            if type(c) in rows and c.offset != held:
                return None
        return Prefill(tuple(seq[:held]), cache, None)

    rest = list(prompt[done:])
    if prefill_budget_s:  # generate_step's own prefill loop, with the budget between its chunks
        budget = _PrefillBudget(prefill_budget_s, _chunks(len(rest) - 1, prefill_step) + 1, clock)
        with mx.stream(generation_stream):
            while len(rest) > 1:
                budget.check()
                n = min(prefill_step, len(rest) - 1)
                model(mx.array(rest[:n], mx.int32)[None], cache=cache)
                mx.eval([c.state for c in cache])
                mx.clear_cache()
                budget.ran(False)
                rest = rest[n:]
            budget.check()
    gen = generate_step(
        mx.array(rest, mx.int32),
        model,
        max_tokens=max_tokens,
        sampler=sampler,
        prefill_step_size=prefill_step,
        prompt_cache=cache,
    )
    n = 0
    try:
        for tok, _ in gen:
            n += 1
            seq.append(tok)
            now = time.perf_counter()
            reason = "stop" if tok in eos else ("length" if n >= max_tokens else None)
            ms = (now - t) * 1e3
            yield Step(
                (tok,),
                elapsed_ms=ms,
                verify_ms=ms,
                prefill=first,
                prompt_tokens=len(prompt) if first else 0,
                cached_tokens=done if first else 0,
                finish_reason=reason,
            )
            first, t = False, now
            if reason:
                break
    except GeneratorExit:
        gen.close()
        hand_over(on_exit, final)
        raise
    gen.close()
    hand_over(on_exit, final)
