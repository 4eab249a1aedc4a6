"""Replay n-gram drafting policies along the 1.5B's own greedy outputs of the code editing (4) and extraction (3)
prompts, 96 tokens (outs-*.json, made by ../stream-replay-20261128/stream_replay.py's `greedy_outputs`): target
steps, draft tokens verified, tokens accepted, and the time under a cost model of BASE seconds a step plus SLOPE per
draft token verified (defaults: this box's in-process vLLM step, 0.160 s, and its extra cost per token, 0.011 s).
Also how often the first drafted token is accepted after a match of each length.

    .venv/bin/python benchmarks/results/ngram-cap-20261128-xeon/capped.py
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "stream-replay-20261128"))
from stream_replay import greedy_outputs  # noqa: E402


def lookup(ctx, k, lo, hi, occ="earliest"):
    """(draft, match length), as `specray.spec.ngram.propose_ngram` finds them."""
    n = len(ctx)
    for m in range(min(hi, n - 1), lo - 1, -1):
        suf = ctx[n - m:]
        starts = range(0, n - m) if occ == "earliest" else range(n - m - 1, -1, -1)
        for i in starts:
            if ctx[i:i + m] == suf:
                return ctx[i + m:i + m + k], m
    return [], 0


def run(rows, policy, first=None):
    steps = fed = acc = 0
    for r in rows:
        prompt, out = r["prompt"], r["out"]
        p = 1
        while p < len(out):
            d, m = policy(prompt + out[:p])
            d = d[:max(0, len(out) - p - 1)]
            a = 0
            while a < len(d) and d[a] == out[p + a]:
                a += 1
            if first is not None and d:
                first.setdefault(m, [0, 0])
                first[m][0] += 1
                first[m][1] += bool(a)
            steps, fed, acc, p = steps + 1, fed + len(d), acc + a, p + a + 1
    return steps, fed, acc


def capped(k, lo, hi, f):
    def policy(ctx):
        d, m = lookup(ctx, k, lo, hi)
        return (d[:max(1, int(f * m))] if f else d), m
    return policy


BASE, SLOPE = float(os.environ.get("BASE", 0.160)), float(os.environ.get("SLOPE", 0.011))
for w, lim in (("code", 4), ("extraction", 3)):
    rows = greedy_outputs(w, lim, 96, os.path.join(HERE, f"outs-{w}-{lim}-96.json"))
    total = sum(len(r["out"]) - 1 for r in rows)
    print(f"== {w}: {total} tokens after the first; {BASE * 1000:.0f} ms a step + {SLOPE * 1000:.0f} ms a draft token")
    first: dict[int, list[int]] = {}
    policies = {"vLLM: K 5, lookup 2-4": capped(5, 2, 4, 0), "K 8, lookup 1-4": capped(8, 1, 4, 0),
                "K 16, lookup 1-4": capped(16, 1, 4, 0), "K 8, lookup 2-4": capped(8, 2, 4, 0),
                "K 16, lookup 1-4, cap 1 x m": capped(16, 1, 4, 1), "K 16, lookup 1-4, cap 2 x m": capped(16, 1, 4, 2),
                "K 16, lookup 1-4, cap 3 x m": capped(16, 1, 4, 3), "K 16, lookup 1-4, cap 4 x m": capped(16, 1, 4, 4)}
    for name, policy in policies.items():
        s, fd, a = run(rows, policy, first if name == "K 8, lookup 1-4" else None)
        t = s * BASE + fd * SLOPE
        print(f"{name:30s} steps {s:4d}  draft tokens {fd:5d}  accepted {a:4d}  {t:5.1f} s  "
              f"{total * BASE / t:.2f}x plain")
    print("first draft token accepted after a match of m tokens (K 8, lookup 1-4):",
          {m: f"{h}/{n} = {h / n:.2f}" for m, (n, h) in sorted(first.items())})
