import json, sys
from mlx_spec.costs import Costs
from mlx_spec.adaptive import Copy, LOOKUP_PRIOR
raw = Costs.from_dict(json.load(open("/work/main/runs/" + (sys.argv[1] if len(sys.argv) > 1 else "issue17-bench9-mkl") + ".json"))["costs"])
sm = raw.smoothed()
def T(L): return min(raw.verify(1), sm.verify(1)) if L == 1 else sm.verify(L)
cp = Copy()
M, LMAX = 70, 33
def run(conds):
    c = [conds[cp.bucket(m)] for m in range(M + LMAX + 2)]
    # outcome distribution for (m, L): list of (prob, tokens, next)
    out = {}
    for m in range(M + 1):
        for L in range(1, LMAX + 1):
            res, surv = [], 1.0
            for a in range(L - 1):
                res.append((surv * (1 - c[m + a]), a + 1, 0)); surv *= c[m + a]
            res.append((surv * c[m + L - 1], L, min(M, m + L)))
            res.append((surv * (1 - c[m + L - 1]), L, 0))
            out[m, L] = res
    def myopic(m):
        best, rate = 1, 1 / T(1)
        for L in range(2, LMAX + 1):
            e = sum(p * t for p, t, _ in out[m, L])
            if e / T(L) > rate: best, rate = L, e / T(L)
        return best
    def evaluate(pol, g, iters=400):  # relative value iteration; returns avg reward per cycle
        h = [0.0] * (M + 1)
        for _ in range(iters):
            nh = []
            for m in range(M + 1):
                Ls = [pol(m)] if pol else range(1, LMAX + 1)
                nh.append(max(sum(p * (t - g * T(L) + h[n]) for p, t, n in out[m, L]) for L in Ls))
            rho = nh[0]; h = [x - rho for x in nh]
        return rho, h
    def gain(pol):
        lo, hi = 0.0, 0.5
        for _ in range(30):
            g = (lo + hi) / 2
            rho, _ = evaluate(pol, g, 150)
            lo, hi = (g, hi) if rho > 0 else (lo, g)
        return g
    gm = gain(myopic); go = gain(None)
    _, h = evaluate(None, go)
    optL = [max(range(1, LMAX + 1), key=lambda L: sum(p * (t - go * T(L) + h[n]) for p, t, n in out[m, L])) for m in range(M + 1)]
    print(f"myopic {gm * raw.t1_ms:.3f}x  optimal {go * raw.t1_ms:.3f}x  (+{(go / gm - 1) * 100:.1f}%)")
    print(" m:      " + " ".join(f"{m:3d}" for m in range(0, 41, 2)))
    print(" myopic: " + " ".join(f"{myopic(m):3d}" for m in range(0, 41, 2)))
    print(" opt:    " + " ".join(f"{optL[m]:3d}" for m in range(0, 41, 2)))
print("agent measured"); run([0.205, 0.667, 0.644, 0.942, 0.94, 0.992, 0.993])
print("prior"); run([v for _, v in LOOKUP_PRIOR])
print("chat measured"); run([0.161, 0.578, 0.712, 0.899, 0.84, 0.638, 0.7])
