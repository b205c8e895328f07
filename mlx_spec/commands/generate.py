"""`mlx_spec generate`: stream text; finish with the engine that really ran and its stats."""

from __future__ import annotations

import json
import sys

from .. import distributed
from ..cli import add_model_args, add_sampling_args, load_config, think_kwargs
from ..errors import BadRequest
from ..generation import GenConfig, Result, generate, policies
from ..sampling import SamplingConfig
from ..session import open_session, run_follower
from ..text import encode_prompt


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--prompt", default=None, help="prompt text (default: read stdin)")
    add_sampling_args(p, max_tokens=256, what="the generated text")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end, no streaming")


def run(args) -> int:
    load = load_config(args)  # every flag is checked before anything is read or loaded
    if distributed.follower_process():  # under mlx.launch: rank 0 prints, the others follow it
        return run_follower(load, lambda m: print(m, file=sys.stderr))
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    try:
        cfg = GenConfig(
            max_tokens=args.max_tokens,
            stop=tuple(args.stop),
            sampling=SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed),
        )
    except ValueError as e:
        raise BadRequest(str(e)) from None
    out = sys.stderr if args.json else sys.stdout
    session = open_session(load, log=lambda m: print(m, file=sys.stderr), group_aware=True)
    pair, info = session.pair, session.info
    ids = encode_prompt(pair.tokenizer, prompt, chat=args.chat, template_kwargs=think_kwargs(args))
    result = Result()
    make = policies(pair, info)
    lead = distributed.Leader(session.group) if session.group is not None else None
    try:
        for chunk in generate(pair, info, ids, cfg, result, policy=make() if make else None, lead=lead):
            if not args.json:
                out.write(chunk.text)
                out.flush()
    finally:
        if lead is not None:
            lead.shutdown()  # the other ranks exit
    s = result.stats
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "tokens": len(result.tokens),
                    "prompt_tokens": len(ids),
                    "finish_reason": result.finish_reason,
                    "engine": {k: v for k, v in info.as_dict().items() if k != "target"} | {"target": info.target},
                    "group": info.group.as_dict(),
                    "stats": s.as_dict(trace=True),
                }
            )
        )
    else:
        print("\n", file=sys.stderr)
        print(info.describe(), file=sys.stderr)
        print(
            f"prompt {len(ids)} tok, {s.prefill_tps:.1f} tok/s | generated {len(result.tokens)} tok, "
            f"{s.decode_tps:.2f} tok/s decode | cycles {s.cycles}, drafted {s.drafted}, accepted "
            f"{s.accepted}, tau {s.mean_acceptance_length:.2f}, acceptance {s.acceptance_rate:.1%} | "
            f"finish {result.finish_reason}",
            file=sys.stderr,
        )
        if s.plain_cycles or len(s.sources) > 1 or "lookup" in s.sources:  # what the drafting policy did
            per = ", ".join(
                f"{k} {c['cycles']} cycles {c['accepted']}/{c['drafted']} accepted"
                for k, c in sorted(s.sources.items())
            )
            trim = f" ({s.trimmed} of {s.drafter_passes} drafter passes trimmed)" if s.trimmed else ""
            print(
                f"cycles: {s.drafted_cycles} drafted ({per or 'none'}), {s.plain_cycles} plain steps{trim} | "
                f"blocks {dict(sorted(s.block_sizes.items()))} | {s.trace_text(limit=40)}",
                file=sys.stderr,
            )
    return 0
