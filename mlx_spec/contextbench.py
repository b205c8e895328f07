"""`bench --context 1k,4k,8k`: speed at agent context lengths.

Each prompt of the chosen kinds is padded to the asked length with realistic context built from
text the package ships, the same every run: an agent prompt gets a long file handed over first
(the package's own source files, one after another), a chat prompt a long earlier conversation
(the built-in prompts as the user's turns, the package's module docstrings as the replies).
Per context and prompt it measures:

- **cold**: the first token from an empty prefix cache (prefill tok/s, time to first token);
- **warm**: the same prompt again, its prefix in the in-memory prefix cache;
- **disk**: the same prompt after a restart: a fresh prefix cache whose disk tier finds the entry
  the cold run wrote (the load's time and bytes shown apart);
- **decode**: tokens per second after the first token for mlx-lm's own plain decoding, our plain
  path and the default engine (per-cycle policy, DFlash and lookup drafts), each started from the
  cached prefix (exact: the K/V rows are what a prefill gives), and the default engine's tau;
- **copy**: how much of the reply repeats its prompt (``analysis.copy_share``): what a lookup
  draft can reach. Whether a reply copies is the target model's doing, not the engine's (a small
  target handed a long file first may write new code instead of re-emitting the one it was asked
  to edit), so ``copying`` judges the engine on the agent replies that do copy;
- **same**: verify's verdict over the three rows (``diverged`` names each departure).

The disk entries go to a temporary folder inside the user cache (same disk), deleted afterwards.
Everything runs on the calling thread, which owns the pair.
"""

from __future__ import annotations

import ast
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from .analysis import COPY_SUBSET, copy_share
from .costs import CostMeter, Costs
from .costs import context_term as term
from .decode import Step, plain_steps, spec_steps
from .default_target import cache_dir
from .errors import BadRequest
from .prefix import PrefixCache, take
from .prefix_store import DiskConfig, PrefixStore
from .prompts import BUILTIN, Prompt
from .stats import Stats
from .text import encode_prompt
from .verify import IDENTICAL, MISMATCH, NUMERIC, tolerance

PACKAGE = Path(__file__).resolve().parent


def parse_contexts(text: str) -> list[int]:
    """'1k,4k,8k' or '1024,5000' -> token counts (k = 1024)."""
    out = []
    for part in (x.strip().lower() for x in text.split(",")):
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(k?)", part)
        if not m or float(m.group(1)) <= 0:
            raise BadRequest(f"--context wants token counts such as 1k,4k,8k or 5000 (got '{text}')")
        out.append(int(float(m.group(1)) * (1024 if m.group(2) else 1)))
    return sorted(set(out))


def _sources() -> list[tuple[str, str]]:
    return [(p.name, p.read_text()) for p in sorted(PACKAGE.glob("*.py"))]


def _docstrings() -> list[str]:
    out = []
    for _, text in _sources():
        try:
            doc = ast.get_docstring(ast.parse(text))
        except SyntaxError:
            doc = None
        if doc and len(doc) > 200:
            out.append(doc)
    return out


def _file_padding(n: int, sources: list[tuple[str, str]]) -> list[dict]:
    """The first ``n`` lines of the package's sources, as a file an agent was handed earlier."""
    lines = []
    for name, text in sources:
        lines.append(f"# ---- mlx_spec/{name} ----")
        lines.extend(text.splitlines())
        if len(lines) >= n:
            break
    body = "\n".join(lines[:n])
    return [
        {"role": "user", "content": f"For reference, here is the code I am working on:\n```python\n{body}\n```"},
        {"role": "assistant", "content": "I have read it. What would you like me to do?"},
    ]


def _conversation_padding(n: int, docs: list[str]) -> list[dict]:
    """``n`` earlier exchanges: built-in prompts asked, module docstrings as the replies."""
    asks = [p.text for p in BUILTIN if p.text]
    out = []
    for i in range(n):
        out += [{"role": "user", "content": asks[i % len(asks)]}, {"role": "assistant", "content": docs[i % len(docs)]}]
    return out


def padded(prompt: Prompt, tokens: int, count: Callable[[list[dict]], int]) -> tuple[list[dict], int]:
    """``prompt``'s messages after the longest padding whose prompt stays within ``tokens``
    (``count(messages)`` = its length in tokens): (messages, length)."""
    own = list(prompt.messages) if prompt.messages else [{"role": "user", "content": prompt.text}]
    if count(own) >= tokens:
        return own, count(own)
    if prompt.kind == "agent":
        sources = _sources()
        limit = sum(len(t.splitlines()) + 1 for _, t in sources)

        def pad(n):
            return _file_padding(n, sources)
    else:
        docs = _docstrings()
        limit = 4096

        def pad(n):
            return _conversation_padding(n, docs)

    lo, hi = 0, 16
    while hi < limit and count(pad(hi) + own) <= tokens:  # (never counting far past the length asked)
        lo, hi = hi, min(limit, 2 * hi)
    while lo < hi:  # the most padding units that fit
        mid = (lo + hi + 1) // 2
        if count(pad(mid) + own) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    msgs = pad(lo) + own
    return msgs, count(msgs)


@dataclass(frozen=True)
class ContextRow:
    context: int  # asked
    prompt_id: str
    kind: str
    prompt_tokens: int
    prefill_tps: float
    ttft_cold_ms: float
    ttft_warm_ms: float
    ttft_disk_ms: float
    disk_load_ms: float
    disk_bytes: int
    decode_tps: dict  # method label -> tok/s after the first token
    tau: float | None
    # verify's verdict over the methods: IDENTICAL (every method's tokens equal mlx-lm's), NUMERIC
    # (those that departed did so at a near tie of the target's), or MISMATCH
    verdict: str
    divergence: str | None  # "<method>: token i, ..." for each method that departed (``diverged``), "; "-joined
    copy: float  # the reply's copy share against its prompt (``analysis.copy_share``)
    costs: dict  # costs.Costs.as_dict() of the passes timed at this context (T1, Tt(B), Td(B))

    def restart_margin(self) -> float:
        """disk time to first token over (warm + the load): <= 1.10 is the target."""
        return self.ttft_disk_ms / max(1e-9, self.ttft_warm_ms + self.disk_load_ms)


def _first_token(pair, ids, policy, prefix) -> tuple[float, int]:
    """Time to the first token (prefix lookup included) and the prompt tokens reused."""
    t0 = time.perf_counter()
    pre = prefix.lookup(ids, drafter=True)
    gen = spec_steps(
        pair.target, pair.drafter, ids, block_size=2, max_tokens=1, policy=policy, prefill=pre, on_exit=prefix.store
    )
    first = next(gen)
    ms = (time.perf_counter() - t0) * 1e3
    gen.close()  # hands the caches to the prefix cache (after the clock stopped)
    return ms, first.cached_tokens


def _decode(steps) -> tuple[list[int], float, object]:
    stats, tokens, first = Stats(), [], None
    for s in steps:
        stats.add(s)
        tokens.extend(s.tokens)
        if first is None:
            first = time.perf_counter()
    n = len(tokens) - 1
    return tokens, n / max(1e-9, time.perf_counter() - first) if n > 0 else 0.0, stats


def _mlx_lm(pair, entry, ids, max_tokens):
    cache = take(entry, len(entry.tokens), drafter=False).target
    for r in stream_generate(
        pair.model,
        pair.tokenizer,
        mx.array(list(ids[-1:]), mx.int32),
        max_tokens=max_tokens,
        sampler=make_sampler(0.0),
        prompt_cache=cache,
    ):
        yield Step((int(r.token),))


def measure(
    pair,
    ids: Sequence[int],
    *,
    context: int,
    prompt: Prompt,
    max_tokens: int,
    repeats: int,
    policies,
    root: Path,
    threads: Callable[[str], None] = lambda who: None,
) -> ContextRow:
    """One padded prompt: cold, warm and disk first tokens, then the decode rows."""
    ids = list(ids)
    threads("ours")
    disk = DiskConfig(root, 1 << 40, 1)
    first = PrefixCache(1 << 40)
    first.attach(PrefixStore(disk, "bench"))
    cold_ms, _ = _first_token(pair, ids, policies(), first)
    warm, loaded = [], []

    def from_disk():
        restarted = PrefixCache(1 << 40)  # what a restarted server builds: memory empty, the same disk
        restarted.attach(PrefixStore(disk, "bench"))
        ms, cached = _first_token(pair, ids, policies(), restarted)
        if cached == 0:
            raise RuntimeError("the restarted prefix cache did not find the entry on disk")
        loaded.append((ms, restarted.disk.load_ms, restarted.disk.bytes_read))

    def from_memory():
        warm.append(_first_token(pair, ids, policies(), first)[0])

    for i in range(repeats):  # (the order alternates: neither always runs first)
        for run in (from_disk, from_memory) if i % 2 == 0 else (from_memory, from_disk):
            run()
    entry = first.lookup(ids, drafter=True)  # an independent copy of all but the last prompt token
    if entry is None or len(entry.tokens) != len(ids) - 1:
        raise RuntimeError("the prefix cache kept no entry for the prompt")
    ref, rates, tau = None, {}, None
    eos = tuple(pair.tokenizer.eos_token_ids)  # every row ends a reply where mlx-lm's does
    rows = (
        ("mlx-lm plain", lambda: _mlx_lm(pair, entry, ids, max_tokens)),
        (
            "plain (ours)",
            lambda: plain_steps(
                pair.model,
                ids,
                max_tokens=max_tokens,
                eos_ids=eos,
                prefill=take(entry, len(entry.tokens), drafter=False),
            ),
        ),
        (
            "default engine",
            lambda: spec_steps(
                pair.target,
                pair.drafter,
                ids,
                block_size=2,
                max_tokens=max_tokens,
                eos_ids=eos,
                policy=policies(),
                prefill=take(entry, len(entry.tokens), drafter=True),
            ),
        ),
    )
    parted: list[tuple[str, str]] = []  # (verdict, what) per method that departed
    for label, make in rows:
        threads("mlx-lm" if label.startswith("mlx-lm") else "ours")
        got = []
        for _ in range(repeats):
            tokens, rate, stats = _decode(make())
            got.append(rate)
        rates[label] = statistics.median(got)
        if ref is None:
            ref = tokens
        if tokens != ref:
            verdict, what = diverged(pair, entry, ids, ref, tokens)
            parted.append((verdict, f"{label}: {what}"))
        if label == "default engine":
            tau = stats.mean_acceptance_length
    threads("ours")

    def copies():
        got = take(entry, len(entry.tokens), drafter=True)
        return got.target, got.drafter

    meter = CostMeter(pair.model, pair.target, pair.drafter, COST_SIZES, ids[:-1], prefilled=copies)
    for _ in range(1 + max(2, repeats)):
        meter.round()
    disk_ms, load_ms, nbytes = sorted(loaded)[(len(loaded) - 1) // 2]  # the median run
    n = len(ids)
    return ContextRow(
        context,
        prompt.id,
        prompt.kind,
        n,
        n / (cold_ms / 1e3),
        round(cold_ms, 1),
        round(statistics.median(warm), 1),
        round(disk_ms, 1),
        round(load_ms, 1),
        nbytes,
        {k: round(v, 2) for k, v in rates.items()},
        None if tau is None else round(tau, 2),
        max((v for v, _ in parted), key=(IDENTICAL, NUMERIC, MISMATCH).index, default=IDENTICAL),
        "; ".join(w for _, w in parted) or None,
        round(copy_share(ids, ref or ()), 3),
        meter.costs().as_dict(),
    )


COST_SIZES = (2, 4, 8, 16)


def diverged(pair, entry, ids: Sequence[int], ref: Sequence[int], other: Sequence[int]) -> tuple[str, str]:
    """(verdict, what) where ``other`` first departs from mlx-lm's greedy ``ref``: NUMERIC where
    the target's logits there (one pass over the reply so far, from the cached prefix) put the two
    tokens within ``verify.tolerance`` of each other (a near tie: either is its greedy choice, and
    the runs' kernels rounded differently), MISMATCH otherwise or where one run ended first."""
    i = next((k for k, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
    if i >= len(ref) or i >= len(other):
        first, then = ("mlx-lm's run", "this one") if i >= len(ref) else ("this run", "mlx-lm's")
        return MISMATCH, f"{first} ended after {i} tokens where {then} went on"
    cache = take(entry, len(entry.tokens), drafter=False).target
    logits = pair.model(mx.array([list(ids[-1:]) + list(ref[:i])], mx.int32), cache=cache)[0, -1]
    verdict, gap = tie_verdict(logits, ref[i], other[i])
    return verdict, f"token {i} ({ref[i]} vs {other[i]}), {gap}"


def tie_verdict(logits: mx.array, a: int, b: int) -> tuple[str, str]:
    """(NUMERIC or MISMATCH, the gap in words): are ``a`` and ``b`` within rounding in ``logits``?"""
    row = logits.astype(mx.float32)
    la, lb, mag = (float(x) for x in (row[a], row[b], mx.abs(row).max()))
    tol = tolerance(str(logits.dtype).split(".")[-1], mag)
    return (NUMERIC if abs(la - lb) <= tol else MISMATCH), f"logits {abs(la - lb):.3g} apart (tolerance {tol:.3g})"


def context_term(rows: Sequence[ContextRow]):
    """The context term (``costs.context_term``) read off the shortest and longest prompts' pass
    costs, or None unless at least two context lengths were asked (prompts padded to one length
    differ by a few hundred tokens: their difference is noise, not a term)."""
    if len({r.context for r in rows}) < 2:
        return None
    by = sorted(rows, key=lambda r: r.prompt_tokens)
    return term(Costs.from_dict(by[0].costs), Costs.from_dict(by[-1].costs))


def run(
    pair,
    prompts: Sequence[Prompt],
    contexts: Sequence[int],
    *,
    max_tokens: int,
    repeats: int,
    policies,
    threads=lambda who: None,
    log=lambda msg: None,
) -> list[ContextRow]:
    def count(messages):
        return len(encode_prompt(pair.tokenizer, messages=messages))

    out = []
    cache_dir().mkdir(parents=True, exist_ok=True)
    for c in contexts:
        for p in prompts:
            msgs, n = padded(p, c, count)
            log(f"context {c}: {p.id} padded to {n} tokens")
            with tempfile.TemporaryDirectory(prefix=".bench-prefix-", dir=cache_dir()) as root:
                out.append(
                    measure(
                        pair,
                        encode_prompt(pair.tokenizer, messages=msgs),
                        context=c,
                        prompt=p,
                        max_tokens=max_tokens,
                        repeats=repeats,
                        policies=policies,
                        root=Path(root),
                        threads=threads,
                    )
                )
            log(table(out[-1:]))
    return out


def table(rows: Sequence[ContextRow]) -> str:
    labels = list(dict.fromkeys(k for r in rows for k in r.decode_tps))
    head = [
        "context",
        "prompt",
        "tokens",
        "prefill tok/s",
        "ttft cold s",
        "warm ms",
        "disk ms",
        "(load ms, MiB)",
        "disk/(warm+load)",
        *[f"{k} tok/s" for k in labels],
        "engine x mlx-lm",
        "engine x plain",
        "tau",
        "copy",
        "same",
    ]
    lines = []
    for r in rows:
        d = r.decode_tps
        eng, mlx, ours = d.get("default engine"), d.get("mlx-lm plain"), d.get("plain (ours)")
        lines.append(
            [
                str(r.context),
                r.prompt_id,
                str(r.prompt_tokens),
                f"{r.prefill_tps:.1f}",
                f"{r.ttft_cold_ms / 1e3:.1f}",
                f"{r.ttft_warm_ms:.0f}",
                f"{r.ttft_disk_ms:.0f}",
                f"({r.disk_load_ms:.0f}, {r.disk_bytes / 2**20:.1f})",
                f"{r.restart_margin():.2f}",
                *[f"{d.get(k, 0):.2f}" for k in labels],
                f"{eng / mlx:.2f}" if eng and mlx else "-",
                f"{eng / ours:.2f}" if eng and ours else "-",
                "-" if r.tau is None else f"{r.tau:.2f}",
                f"{r.copy:.0%}",
                {IDENTICAL: "yes", NUMERIC: "tie"}.get(r.verdict, "NO"),
            ]
        )
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(ln, widths)) for ln in [head, *lines])


def copying(rows: Sequence[ContextRow]) -> dict[int, float | None]:
    """Per context asked: the default engine's lowest speedup over mlx-lm's plain decoding among
    the agent replies that copy (copy share >= ``analysis.COPY_SUBSET``, as the main bench counts
    them); None where no agent reply copied."""
    out: dict[int, float | None] = {}
    for r in rows:
        out.setdefault(r.context, None)
        d = r.decode_tps
        eng, mlx = d.get("default engine"), d.get("mlx-lm plain")
        if r.kind == "agent" and r.copy >= COPY_SUBSET and eng and mlx:
            got = out[r.context]
            out[r.context] = eng / mlx if got is None else min(got, eng / mlx)
    return out


def copying_line(rows: Sequence[ContextRow]) -> str:
    """``copying`` for people: one line."""
    got = copying(rows)
    parts = [f"{c}: " + ("no copying reply" if v is None else f"{v:.2f}x") for c, v in got.items()]
    return f"copying agent replies (copy >= {COPY_SUBSET:.0%}), default engine x mlx-lm plain, lowest: " + ", ".join(
        parts
    )


def as_dicts(rows: Sequence[ContextRow]) -> list[dict]:
    return [{**asdict(r), "restart_margin": round(r.restart_margin(), 3)} for r in rows]
