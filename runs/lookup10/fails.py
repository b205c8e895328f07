import json, sys
sys.path.insert(0, "/tmp/h10a"); sys.path.insert(0, "/work/main/scripts")
from tokenizers import Tokenizer
import harness
from harness import *
from mlx_spec.lookup import SuffixIndex
tok = Tokenizer.from_file("/root/.cache/mlx_spec/models/smollm2-135m-instruct-f32/tokenizer.json")
data = json.load(open(FILES["agent"])); eos = data["eos"]
for pid in sys.argv[1:]:
    r = data["replies"][pid]; reply = r["reply"][:128]
    full = reply + ([eos[0]] if len(r["reply"]) < 128 else [])
    pol = policy_factory()()
    ctxs = []
    ch = pol.choose
    def noting(ctx, ch=ch):
        ctxs.append(ctx); return ch(ctx)
    pol.choose = noting
    steps, _ = replay(r["prompt"], full, COSTS, 128, lambda p: SuffixIndex(p, 4, stop=eos), eos=eos, policy=pol)
    n = 1
    for s, c in zip(steps, ctxs):
        if s.block_size > 1 and s.accepted < s.drafted:
            print(pid, f"n={n} m={c.match} L={s.block_size} acc={s.accepted}",
                  repr(tok.decode(full[max(0, n - 12):n])), "| prop:", repr(tok.decode(list(c.lookup[:8]))),
                  "| real:", repr(tok.decode(full[n:n + 8])))
        n += len(s.tokens)
