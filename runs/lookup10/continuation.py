"""Per-token conditional acceptance of the lookup index's proposals on the cached greedy replies, by
match bucket (adaptive.Copy) and split two ways: does the proposal continue the previous one's
accepted copy ("cont") or is it a fresh match ("fresh"); was the lookup's first guess wrong within
the last 4 reply tokens ("recent-miss") or not ("clean"). Throwaway research (session 10; it reads
SuffixIndex's private _run): python runs/lookup10/continuation.py 64  (or 128)."""
import json
import sys
from collections import defaultdict

from mlx_spec.adaptive import Copy
from mlx_spec.lookup import SuffixIndex

T = int(sys.argv[1]) if len(sys.argv) > 1 else 64
c = Copy()
stats = defaultdict(lambda: [0, 0])  # key -> judged, hits
for f in ("runs/replies-agent128.json", "runs/replies-chat64.json"):
    d = json.load(open(f))
    for r in d["replies"].values():
        kind = "agent" if r["kind"] == "agent" else "chat"
        reply = r["reply"][:T]
        idx = SuffixIndex(r["prompt"], 4, stop=d["eos"])
        idx.extend(reply[:1])
        prev, since = None, 99  # (n, proposal, agreement) of the last proposal; tokens since a first-guess miss
        for n in range(1, len(reply)):
            look, m = idx.propose(32)
            a = 0
            while a < len(look) and n + a < len(reply) and look[a] == reply[n + a]:
                a += 1
            cont = False
            if prev is not None:  # the previous proposal covered reply[n0:n] and its tail goes on as this one
                n0, look0, a0 = prev
                k = n - n0
                cont = a0 >= k and len(look0) > k and look0[k:k + 4] == look[:min(4, len(look0) - k)]
            split = ("cont" if cont else "fresh", "recent-miss" if since <= 4 else "clean")
            for k in range(min(a + 1, len(look), len(reply) - n)):
                for key in ((kind, c.bucket(m + k)), (kind, c.bucket(m + k), split[0]), (kind, c.bucket(m + k), split[1])):
                    stats[key][0] += 1
                    stats[key][1] += k < a
            prev = (n, look, a)
            since = 0 if a == 0 and look else since + 1
            idx.extend(reply[n:n + 1])
for key in sorted(stats, key=str):
    j, h = stats[key]
    if j >= 5:
        print(key, "bucket <", c.tops[key[1]], f"{h}/{j} = {h / j:.2f}")
