"""How often the 0.5B's greedy token equals the 1.5B's along the 1.5B's own greedy output, teacher-forced (a proxy for
the pair's per-token acceptance), with the whole prompt and with only 4 sink tokens + the last W - 4 prompt tokens.

    .venv/bin/python benchmarks/results/coldstart-20261128/agreement.py extraction code chat
"""

import os
import sys


def main(workloads: list[str], new_tokens: int = 80, sinks: int = 4) -> None:
    sys.path.insert(0, os.getcwd())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specray.bench.workloads import load_workloads, prompt_ids

    torch.set_num_threads(2)
    root = os.path.expanduser("~/.cache/specray/models/")
    tok = AutoTokenizer.from_pretrained(root + "qwen2.5-coder-1.5b-instruct")
    big = AutoModelForCausalLM.from_pretrained(root + "qwen2.5-coder-1.5b-instruct", dtype=torch.bfloat16).eval()
    small = AutoModelForCausalLM.from_pretrained(root + "qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        for w in workloads:
            res: dict[int | None, list[float]] = {}
            for row in load_workloads([w])[:3]:
                ids = prompt_ids(tok, row)
                out = big.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):]
                out = out.tolist()
                for window in (None, 64, 128, 256):
                    ctx = ids if window is None or len(ids) <= window else ids[:sinks] + ids[len(ids) - window + sinks:]
                    logits = small(torch.tensor([ctx + out])).logits[0, len(ctx) - 1:-1]
                    res.setdefault(window, []).append((logits.argmax(-1) == torch.tensor(out)).float().mean().item())
                print(w, len(ids), {k: round(v[-1], 3) for k, v in res.items()}, flush=True)
            print(w, "MEAN", {k: round(sum(v) / len(v), 3) for k, v in res.items()}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
