"""Turn-2 prefill with and without the prefix cache on the default pair (engine thread, greedy).

    python scripts/prefix_cache_demo.py

Prints the second turn's prompt tokens, how many came from the cache, the prefill time, and a
hash of the reply (equal with and without the cache: reuse does not change the output).
"""
import mlx_spec
from mlx_spec.engine import Engine, Request
from mlx_spec.generation import engine_info
from mlx_spec.loading import load_pair
from mlx_spec.session import Session
def loader():
    p = load_pair('smollm2-135m-instruct', 'models/smollm2-135m-dflash2')
    return Session.of(p, engine_info(p, 4, "flag"))
system = "You are a careful Python tutor. " * 40
turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Write a function that reverses a string."}]
for budget in (256 << 20, 0):
    with Engine(loader, prefix_cache=budget) as e:
        e.wait_ready(120)
        d1 = e.submit(Request(messages=turn1, max_tokens=48)).result()
        turn2 = turn1 + [{"role": "assistant", "content": d1.text}, {"role": "user", "content": "Now add type hints."}]
        d2 = e.submit(Request(messages=turn2, max_tokens=48)).result()
        print(f"prefix cache {budget >> 20} MiB: turn 2 prompt {d2.prompt_tokens} tok, cached {d2.timings['cache_n']}, "
              f"prefill {d2.timings['prompt_ms']:.0f} ms, reply hash {hash(d2.text)}")
