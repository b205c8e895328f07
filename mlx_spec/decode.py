"""The decode loops, as generators of ``Step``s (token level; text lives in text.py).

``spec_steps``: prefill (chunked) -> first token from the target -> cycles of: choose the
cycle's source and length (a ``adaptive.DraftPolicy``, or a fixed DFlash block) -> draft
(DFlash: ``[anchor, MASK x (L-1)]`` through the drafter; lookup: the continuation of the best
earlier match of the sequence's tail in everything the target has seen, ``lookup.SuffixIndex``;
plain: nothing) -> one target verify pass over ``[anchor, d1..d(L-1)]`` -> accept the longest
matching prefix plus the target's bonus (greedy), or rejection-sample against the proposal
(T > 0; a lookup draft is a point-mass proposal) -> roll the target cache back -> queue the
accepted rows' features for the drafter's context cache (pushed at its next pass, whatever the
source of this cycle).

Timings are taken where each pass really finishes: ``draft_ms`` ends when the draft tokens are
on the host, ``verify_ms`` when the target's choice is (it starts when its graph is built; a
verify graph built while the drafter runs is booked to ``verify_ms``, not ``draft_ms``); a
pipelined plain step's ``verify_ms`` is the wait for its token when it is read. The host's own
work (the policy, ``pick``, the lookup, bookkeeping) is ``elapsed_ms`` minus those.

Both loops can start from a ``Prefill`` (caches already holding a prefix of the prompt, from the
prefix cache) and hand their final caches to ``on_exit`` when they end or are closed, so the next
turn of a conversation prefills only its new tokens.

``plain_steps``: mlx-lm's own ``generate_step`` (the baseline a user would otherwise run).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream

from .adaptive import DFLASH, LOOKUP, PLAIN, Context, Decision
from .drafter import Drafter, Proposal
from .lookup import SuffixIndex
from .prefix import Prefill
from .sampling import SamplingConfig, accept_greedy, accept_sampled, sample_target
from .target import Target


@dataclass(frozen=True, slots=True)
class Step:
    """Tokens committed by one step. The first step of a run is the prefill (target's token)."""

    tokens: tuple[int, ...]
    drafted: int = 0  # draft tokens proposed this cycle (block_size - 1)
    accepted: int = 0  # of those, accepted (tokens = accepted + 1 bonus, before truncation)
    block_size: int = 1
    # the drafter's pass, until its tokens are on the host, less the target's verify graph built
    # while it ran (0 for lookup/plain)
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
    source: str = ""  # "plain" | "dflash" | "lookup" for a cycle of spec_steps ("" otherwise)
    draft_block: int = 0  # the block the drafter ran at this cycle (0: it did not run); pick() may
    # then have verified a prefix of it or the lookup's draft: block_size is what was verified


log = logging.getLogger(__name__)


def _start(prefill: Prefill | None, prompt: Sequence[int]) -> int:
    if prefill is None:
        return 0
    n = len(prefill.tokens)
    if n >= len(prompt) or tuple(prompt[:n]) != tuple(prefill.tokens):
        raise ValueError("the prefill's tokens must be a proper prefix of the prompt")
    return n


def _hand_over(on_exit, make) -> None:
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


def _finish(tokens: list[int], n_done: int, max_tokens: int, eos: frozenset[int]):
    """Truncate after the first EOS or at max_tokens; return (tokens, finish_reason)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], "stop"
    room = max_tokens - n_done
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None


def untimed(step: Step) -> Step:
    """The step without its timings (what a seeded sampled run's policy may learn from)."""
    return replace(step, draft_ms=0.0, verify_ms=0.0, rollback_ms=0.0, elapsed_ms=0.0)


def _prefill(target: Target, ids: list[int], cache, step: int, sink) -> mx.array:
    """Run the prompt through the target in chunks; ``sink(features)`` gets every chunk's taps.

    Returns the last position's logits (V,).
    """
    x = mx.array(ids, mx.int32)[None]
    n = x.shape[1]
    for s in range(0, n, step):
        out = target(x[:, s : s + step], cache, last_only=True)
        sink(out.hidden)
        mx.eval(out.logits, out.hidden, [c.state for c in cache])
    return out.logits[0, -1]


def lookup_context(index, max_lookup: int, room: int, greedy: bool) -> Context:
    """What a per-cycle policy decides a sequence's next cycle from: the lookup ``index``'s
    proposal (none without an index), at most ``max_lookup`` drafts and one fewer than the
    ``room`` tokens left to commit."""
    look, match = index.propose(min(max_lookup, room - 1)) if index is not None else ([], 0)
    return Context(tuple(look), match, room, greedy)


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
    controller: Callable[[Step | None], int] | None = None,
    policy=None,
    lookup_ngram: int = 4,
    index: SuffixIndex | None = None,
    prefill: Prefill | None = None,
    on_exit: Callable[[Prefill], None] | None = None,
) -> Iterator[Step]:
    """Speculative decoding with a DFlash drafter and lookup drafts. Lossless: the output is the
    target's (greedy: token for token; T > 0: in distribution).

    ``policy`` (an ``adaptive.DraftPolicy``, one per sequence) chooses every cycle's source
    (plain / dflash / lookup) and length; at greedy, after a DFlash pass while the lookup had a
    proposal too, it may switch to the lookup (``pick``); it ``observe``s every Step. Without a
    policy, ``controller`` (optional, older interface) is called before every cycle with the
    previous Step and returns the DFlash block L (1 = a plain step); without either, every
    cycle drafts ``block_size`` with the drafter. ``index``: the lookup index over ``prompt``
    that the policy's lookup drafts come from (default ``SuffixIndex(prompt, lookup_ngram,
    stop=eos_ids)``; another to compare, e.g. scripts/lookup_replay.py's baseline), extended by
    the committed tokens.

    ``prefill``: caches (target and drafter) already holding a proper prefix of ``prompt``; they
    are advanced in place. ``on_exit`` receives the final caches and the ids they hold when the
    run ends or the generator is closed between steps (not after an error).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    if not prompt:
        raise ValueError("empty prompt")
    eos = frozenset(eos_ids)
    done = _start(prefill, prompt)
    if prefill is not None and prefill.drafter is None:
        raise ValueError("a speculative run needs the drafter's context cache in its prefill")
    cache = prefill.target if prefill else target.make_cache()
    dcache = prefill.drafter if prefill else drafter.make_cache()
    fed = list(prompt)  # the ids whose K/V the target cache holds once the prefill is done
    consistent = False  # caches, `fed` and `pending` agree (true at every yield)
    greedy = sampling.greedy
    key = mx.random.key(sampling.seed if sampling.seed is not None else time.time_ns() % 2**31)
    pending: list[mx.array] = []  # features of committed rows not yet in the drafter's cache
    # A seeded sampled run must give the same text every time: its policy may not learn from
    # timings (they vary), only from the tokens (they do not, given the seed and the choices).
    seeded = not greedy and sampling.seed is not None
    if index is not None and (policy is None or LOOKUP not in policy.sources):
        raise ValueError("a lookup index needs a policy that drafts from it (LOOKUP among its sources)")
    if index is not None and index.ids != [int(t) for t in prompt]:
        raise ValueError("the lookup index must hold the prompt, and nothing after it")
    if index is None and policy is not None and LOOKUP in policy.sources:
        index = SuffixIndex(prompt, lookup_ngram, stop=eos)  # once; then extended by the committed tokens

    def sink(features):
        if pending:  # push the previous chunk; the last one waits for the first draft call
            drafter.add_context(pending.pop(), dcache)
            mx.eval([c.state for c in dcache])  # so that chunk's features can be freed now
        pending.append(features)

    def take_pending() -> mx.array | None:
        features = (mx.concatenate(pending, axis=1) if len(pending) > 1 else pending[0]) if pending else None
        pending.clear()
        return features

    def context(room: int) -> Context:
        return lookup_context(index, policy.max_lookup, room, greedy)

    def plain_pass(token: mx.array, key: mx.array):
        """Queue one plain step fed ``token`` (on the host or still lazy): (key, its token, its
        features), evaluated asynchronously."""
        out = target(token.reshape(1, 1), cache)
        logits = out.logits[0, -1:]
        if greedy:
            y = mx.argmax(logits[0], axis=-1)
        else:
            key, sub = mx.random.split(key)
            y = sample_target(logits, sampling, sub)[0]
        mx.async_eval(y, out.hidden)
        return key, y, out.hidden

    def final() -> Prefill:
        for f in pending:
            drafter.add_context(f, dcache)
        pending.clear()
        return Prefill(tuple(fed), cache, dcache)

    def learn(step: Step) -> None:
        policy.observe(untimed(step) if seeded else step)

    def commit(tokens: list[int]) -> tuple[list[int], str | None]:
        """Truncate ``tokens`` (EOS, max_tokens), count them and add them to the lookup index:
        (committed, finish_reason)."""
        nonlocal n
        committed, reason = _finish(tokens, n, max_tokens, eos)
        n += len(committed)
        if index is not None:
            index.extend(committed)
        if n % 256 < len(committed):  # every 256 tokens
            mx.clear_cache()
        return committed, reason

    def feed_drafter() -> None:
        """A long run of cycles without the drafter: push the queued features into its context
        cache (queued, not waited for), so they do not pile up for its next pass."""
        if len(pending) >= 32:
            drafter.add_context(take_pending(), dcache)
            mx.async_eval([c.state for c in dcache])

    # Like mlx-lm, run on its generation stream (measured faster here than the default stream).
    with mx.stream(generation_stream):
        try:
            t0 = time.perf_counter()
            logits = _prefill(target, list(prompt[done:]), cache, prefill_step, sink)
            key, sub = mx.random.split(key)
            anchor = sample_target(logits[None], sampling, sub)[0]  # first token comes from the target
            anchor_id = anchor.item()
            n = 0
            toks, reason = commit([anchor_id])
            ms = (time.perf_counter() - t0) * 1e3
            consistent = True
            yield Step(tuple(toks), elapsed_ms=ms, verify_ms=ms, prefill=True,
                       prompt_tokens=len(prompt), cached_tokens=done, finish_reason=reason)
            prev = Step(tuple(toks), prefill=True, prompt_tokens=len(prompt))  # (the policy prices at the context)
            while reason is None:
                tc = time.perf_counter()
                room = max_tokens - n
                ctx = None
                if policy is not None:
                    learn(prev)
                    ctx = context(room)
                    dec = policy.choose(ctx)
                elif controller is not None:
                    dec = Decision(DFLASH, controller(prev))
                else:
                    dec = Decision(DFLASH, block_size)
                L = max(1, min(dec.length, room))
                source = dec.source if L > 1 else PLAIN
                consistent = False
                if source == PLAIN and policy is not None:
                    # A run of plain steps, pipelined as mlx-lm's generate_step: the next step is
                    # queued (fed the token still being computed) before this one is read, for as
                    # long as the policy would stay plain (asked one token ahead, so its lookup
                    # context lags one token). Every queued step's token joins `fed` and its
                    # features `pending` as soon as the token is known, so the caches agree with
                    # them at every yield; a step queued when the reply ends (EOS) stays fed.
                    # verify_ms is the wait for the token at its read (the pass ran on while the
                    # host queued the next one); the host's work since the last yield is overhead.
                    key, y, h = plain_pass(anchor, key)
                    fed.append(anchor_id)
                    pending.append(h)
                    while True:
                        # the step queued next commits one token after the one in flight: one less
                        # room (the last token's step in flight: none to queue)
                        ctx = context(max_tokens - n - 1) if n + 1 < max_tokens else None
                        more = ctx is not None and policy.stays_plain(ctx)
                        if more:
                            policy.choose(ctx)
                            key, y_next, h_next = plain_pass(y, key)
                        tw = time.perf_counter()
                        tok = y.item()  # this step's pass ends here
                        tv = time.perf_counter()
                        if more:
                            fed.append(tok)
                            pending.append(h_next)
                        committed, reason = commit([tok])
                        feed_drafter()
                        prev = Step((tok,), block_size=1, verify_ms=(tv - tw) * 1e3,
                                    elapsed_ms=(time.perf_counter() - tc) * 1e3, finish_reason=reason,
                                    source=PLAIN)
                        consistent = True
                        yield prev
                        if not more or reason is not None:
                            break
                        tc = time.perf_counter()
                        learn(prev)
                        y = y_next
                    anchor, anchor_id = mx.array(tok, mx.int32), tok
                    continue
                kd = ka = None
                if not greedy:  # greedy never evaluates keys: splitting would grow a lazy chain
                    key, kd, ka = mx.random.split(key, 3)
                proposal, drafts, out = None, [], None
                # draft_ms: from the drafter's call until its tokens are on the host, less the
                # verify graph built meanwhile (booked to verify_ms, as on the other paths); pick()
                # and the rest of the host's work are the cycle's overhead
                tq = td = time.perf_counter()
                build = 0.0
                # the drafter's block, 0 if it does not run (its pass is booked even where pick()
                # then trims its block or takes the lookup's: L becomes what is verified)
                Ld = L if source == DFLASH else 0
                if source == DFLASH:
                    # greedy: pick() trims the block to what the drafter is sure enough of, or
                    # takes the lookup's proposal
                    conf = greedy and ctx is not None
                    kw = {"confidence": True} if conf else {}
                    proposal = drafter.propose(anchor, take_pending(), dcache, L, sampling, kd, **kw)
                    if conf:  # the verify input waits for pick()
                        mx.eval([x for x in proposal if x is not None])
                        drafts = proposal.tokens.tolist()  # the draft pass ends here
                        td = time.perf_counter()
                        dec = policy.pick(dec, drafts, proposal.confidence.tolist(), ctx, trim=True)
                        if dec.source == LOOKUP:
                            source, proposal = LOOKUP, None
                        elif dec.length < L:  # verify a prefix (or the anchor alone)
                            drafts, L = drafts[: dec.length - 1], dec.length
                    else:  # start drafting and build the verify graph while it runs
                        mx.async_eval(proposal.tokens if proposal.q is None else (proposal.tokens, proposal.q))
                        tb = time.perf_counter()
                        verify_in = mx.concatenate([anchor.reshape(1), proposal.tokens.astype(mx.int32)])[None]
                        out = target(verify_in, cache, record=True)
                        build = time.perf_counter() - tb
                        drafts = proposal.tokens.tolist()  # the draft pass ends here
                        td = time.perf_counter()
                else:
                    feed_drafter()
                if source == LOOKUP:
                    drafts = list(ctx.lookup[: min(dec.length, room) - 1])
                    L = len(drafts) + 1
                    if not greedy:
                        proposal = Proposal(mx.array(drafts, mx.int32), None)  # q = point mass
                ts = time.perf_counter()
                if out is None:
                    out = target(mx.array([[anchor_id] + drafts], mx.int32), cache, record=True)
                if greedy:
                    choice = mx.argmax(out.logits[0], axis=-1)
                    mx.async_eval(choice, out.hidden)
                    a, bonus = accept_greedy(drafts, choice.tolist())  # the verify pass ends here
                else:
                    mx.async_eval(out.logits, out.hidden)
                    a, bonus = accept_sampled(out.logits[0], proposal, sampling, ka)
                tv = time.perf_counter()
                target.rollback(cache, L, a + 1)
                tr = time.perf_counter()
                pending.append(out.hidden[:, : a + 1])
                fed.append(anchor_id)
                fed.extend(drafts[:a])
                committed, reason = commit(drafts[:a] + [bonus])
                anchor, anchor_id = mx.array(bonus, mx.int32), bonus
                prev = Step(
                    tuple(committed), drafted=L - 1, accepted=a, block_size=L,
                    draft_ms=(td - tq - build) * 1e3 if Ld else 0.0, verify_ms=(tv - ts + build) * 1e3,
                    rollback_ms=(tr - tv) * 1e3, elapsed_ms=(time.perf_counter() - tc) * 1e3,
                    finish_reason=reason, source=source, draft_block=Ld,
                )
                consistent = True
                yield prev
            if policy is not None:
                learn(prev)
        except GeneratorExit:
            if consistent:
                _hand_over(on_exit, final)
            raise
        _hand_over(on_exit, final)


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
) -> Iterator[Step]:
    """Plain decoding through mlx-lm's own ``generate_step`` (one token per step).

    ``prefill`` / ``on_exit`` as in ``spec_steps`` (target cache only).
    """
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    eos = frozenset(eos_ids)
    done = _start(prefill, prompt)
    cache = prefill.target if prefill else make_prompt_cache(model)
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    sampler = sampling.mlx_sampler()
    t = time.perf_counter()
    first = True
    seq = list(prompt)

    def final() -> Prefill | None:
        # generate_step feeds each token before yielding it, so the cache holds a prefix of seq.
        held = next((c.offset for c in cache if type(c) is KVCache), None)
        if held is None or held > len(seq):
            return None
        for c in cache:
            if type(c) is KVCache and c.offset != held:
                return None
        return Prefill(tuple(seq[:held]), cache, None)

    gen = generate_step(mx.array(list(prompt[done:]), mx.int32), model, max_tokens=max_tokens,
                        sampler=sampler, prefill_step_size=prefill_step, prompt_cache=cache)
    n = 0
    try:
        for tok, _ in gen:
            n += 1
            seq.append(tok)
            now = time.perf_counter()
            reason = "stop" if tok in eos else ("length" if n >= max_tokens else None)
            ms = (now - t) * 1e3
            yield Step((tok,), elapsed_ms=ms, verify_ms=ms, prefill=first,
                       prompt_tokens=len(prompt) if first else 0, cached_tokens=done if first else 0,
                       finish_reason=reason)
            first, t = False, now
            if reason:
                break
    except GeneratorExit:
        gen.close()
        _hand_over(on_exit, final)
        raise
    gen.close()
    _hand_over(on_exit, final)
