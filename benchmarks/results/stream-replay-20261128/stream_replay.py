"""Replay drafters along the 1.5B's own greedy outputs of a stream (requests one after another), counting target
steps per request: every step commits the accepted draft plus one token. Also a hindsight lookup (the earlier
occurrence of the context's last m tokens whose continuation matches longest) and the 0.5B's teacher-forced
agreement. Outputs are cached in outs-<workload>-<n>.json.

    .venv/bin/python benchmarks/results/stream-replay-20261128/stream_replay.py agent 12 32
"""

import json
import os
import sys


def greedy_outputs(workload: str, limit: int, new: int, path: str) -> list[dict]:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specray.bench.workloads import load_workloads, prompt_ids

    torch.set_num_threads(2)
    root = os.path.expanduser("~/.cache/specray/models/")
    tok = AutoTokenizer.from_pretrained(root + "qwen2.5-coder-1.5b-instruct")
    big = AutoModelForCausalLM.from_pretrained(root + "qwen2.5-coder-1.5b-instruct", dtype=torch.bfloat16).eval()
    small = AutoModelForCausalLM.from_pretrained(root + "qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16).eval()
    rows = []
    with torch.inference_mode():
        for row in load_workloads([workload])[:limit]:
            ids = prompt_ids(tok, row)
            out = big.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids):].tolist()
            logits = small(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
            agree = (logits.argmax(-1) == torch.tensor(out)).tolist()
            rows.append({"prompt": ids, "out": out, "small_agree": agree, "text": tok.decode(out)})
            print(len(ids), repr(tok.decode(out)), flush=True)
    with open(path, "w") as f:
        json.dump(rows, f)
    return rows


def steps_with(draft_fn, prompt: list[int], out: list[int]) -> tuple[int, int]:
    """Target steps to produce out[1:] (out[0] comes from the prefill), and accepted draft tokens."""
    p, steps, acc = 1, 0, 0
    while p < len(out):
        d = draft_fn(prompt + out[:p], p)
        a = 0
        while a < len(d) and p + a < len(out) and d[a] == out[p + a]:
            a += 1
        steps += 1
        acc += a
        p += a + 1
    return steps, acc


def main(workload: str, limit: int, new: int) -> None:
    sys.path.insert(0, os.getcwd())
    from specray.spec.ngram import propose_ngram
    from specray.spec.suffix import SuffixConfig, SuffixDrafter

    here = os.path.dirname(os.path.abspath(__file__))
    rows = greedy_outputs(workload, limit, new, os.path.join(here, f"outs-{workload}-{limit}-{new}.json"))
    total = sum(len(r["out"]) - 1 for r in rows)
    print(f"{workload}: {len(rows)} requests, {total} tokens after the first")

    def run_suffix(factor: float, prob: float = 0.1) -> tuple[int, int]:
        d = SuffixDrafter(SuffixConfig(max_spec_factor=factor, min_token_prob=prob))
        s = a = 0
        for i, r in enumerate(rows):
            d.start(i, r["prompt"])
            held = [0]

            def fn(ctx, p, i=i, r=r, held=held):
                if p > held[0]:
                    d.extend(i, r["out"][held[0]:p])
                    held[0] = p
                return d.propose(i, ctx, max_k=24)
            st, ac = steps_with(fn, r["prompt"], r["out"])
            d.extend(i, r["out"][held[0]:])
            d.finish(i)
            s, a = s + st, a + ac
        return s, a

    def run_ngram(k: int, lo: int, hi: int, occ: str) -> tuple[int, int]:
        s = a = 0
        for r in rows:
            st, ac = steps_with(lambda ctx, p: propose_ngram(ctx, k, lo, hi, occ), r["prompt"], r["out"])
            s, a = s + st, a + ac
        return s, a

    def run_oracle(m: int) -> tuple[int, int]:
        """Hindsight: among the earlier occurrences (this context, earlier outputs) of the context's last m tokens,
        the one whose continuation matches what the target writes for longest."""
        s = a = 0
        earlier: list[int] = []
        for r in rows:
            def fn(ctx, p, r=r, earlier=earlier):
                hay, suf, best = earlier + [-1] + ctx, ctx[-m:], []
                for i in range(len(hay) - m):
                    if hay[i:i + m] == suf:
                        j = 0
                        while i + m + j < len(hay) and p + j < len(r["out"]) and hay[i + m + j] == r["out"][p + j]:
                            j += 1
                        if j > len(best):
                            best = r["out"][p:p + j]
                return best
            st, ac = steps_with(fn, r["prompt"], r["out"])
            earlier += [-1] + r["out"]
            s, a = s + st, a + ac
        return s, a

    def run_small(k: int) -> tuple[int, int]:
        """0.5B drafts K greedy tokens; accepted = run of teacher-forced agreements (a correct draft prefix equals
        the target's tokens, so the 0.5B's token at each drafted position is its teacher-forced one)."""
        s = a = 0
        for r in rows:
            ag = r["small_agree"]
            def fn(ctx, p, ag=ag, r=r):
                return [r["out"][p + j] if ag[p + j] else -2 for j in range(min(k, len(r["out"]) - p))]
            st, ac = steps_with(fn, r["prompt"], r["out"])
            s, a = s + st, a + ac
        return s, a

    res = {"suffix f1": run_suffix(1), "suffix f2": run_suffix(2), "suffix f4": run_suffix(4),
           "suffix f4 p0": run_suffix(4, 0.0),
           "vllm ngram K5 2-4 earliest": run_ngram(5, 2, 4, "earliest"),
           "ngram K8 1-4 earliest": run_ngram(8, 1, 4, "earliest"),
           "ngram K8 2-4 recent": run_ngram(8, 2, 4, "recent"),
           "hindsight lookup, 1-token match": run_oracle(1),
           "hindsight lookup, 2-token match": run_oracle(2),
           "0.5B K4": run_small(4), "0.5B K8": run_small(8)}
    for name, (s, a) in res.items():
        print(f"{name:36s} steps {s:4d}  accepted {a:4d}  tokens/step {total / s:.2f}")
    ag = [x for r in rows for x in r["small_agree"][1:]]
    print(f"0.5B teacher-forced agreement {sum(ag) / len(ag):.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
