"""`mlx_spec generate`: stream text; finish with the engine that really ran and its stats."""

from __future__ import annotations

import json
import sys

from ..cli import add_model_args


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--prompt", default=None, help="prompt text (default: read stdin)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--temperature", "--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end, no streaming")


def run(args) -> int:
    from ..errors import BadRequest
    from ..generation import GenConfig, Result, controllers, engine_info, generate
    from ..pair import open_pair, resolve_block_size
    from ..sampling import SamplingConfig
    from ..text import encode_prompt

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    try:
        cfg = GenConfig(max_tokens=args.max_tokens, stop=tuple(args.stop),
                        sampling=SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed))
    except ValueError as e:
        raise BadRequest(str(e)) from None
    out = sys.stderr if args.json else sys.stdout
    pair = open_pair(args, log=lambda m: print(m, file=sys.stderr))
    block, source = resolve_block_size(pair, args)
    info = engine_info(pair, block, source, adaptive=args.adaptive)
    ids = encode_prompt(pair.tokenizer, prompt, chat=args.chat)
    result = Result()
    make = controllers(pair, info)
    for chunk in generate(pair, info, ids, cfg, result, controller=make() if make else None):
        if not args.json:
            out.write(chunk.text)
            out.flush()
    s = result.stats
    if args.json:
        print(json.dumps({
            "text": result.text, "tokens": len(result.tokens), "prompt_tokens": len(ids),
            "finish_reason": result.finish_reason,
            "engine": {k: v for k, v in info.as_dict().items() if k != "target"} | {"target": info.target},
            "stats": s.as_dict(),
        }))
    else:
        print("\n", file=sys.stderr)
        print(info.describe(), file=sys.stderr)
        print(f"prompt {len(ids)} tok, {s.prefill_tps:.1f} tok/s | generated {len(result.tokens)} tok, "
              f"{s.decode_tps:.2f} tok/s decode | cycles {s.cycles}, drafted {s.drafted}, accepted "
              f"{s.accepted}, tau {s.mean_acceptance_length:.2f}, acceptance {s.acceptance_rate:.1%} | "
              f"finish {result.finish_reason}", file=sys.stderr)
    return 0
