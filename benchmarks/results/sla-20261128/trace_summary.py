"""Rounds of a planner trace (`policy.trace_file`) by batch and plan: count, median and P90 measured seconds, median
predicted seconds.

    python benchmarks/results/sla-20261128/trace_summary.py benchmarks/results/sla-20261128/planner-trace.jsonl
"""

import collections
import json
import statistics
import sys


def main(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    by: dict[tuple[int, str], list[tuple[float, float | None]]] = collections.defaultdict(list)
    for r in rows:
        if r.get("round_s") is not None:
            drafter = r["plan"].split(">")[0] if ">" in r["plan"] else "plain"
            by[(r["batch"], drafter)].append((r["round_s"], r.get("predicted_s")))
    print("batch  plan                 rounds  median s  p90 s  predicted s")
    for (batch, plan), v in sorted(by.items()):
        measured = sorted(x[0] for x in v)
        predicted = [x[1] for x in v if x[1] is not None]
        p90 = measured[max(0, int(0.9 * len(measured)) - 1)]
        pred = f"{statistics.median(predicted):.3f}" if predicted else "-"
        print(f"{batch:5d}  {plan[:20]:20s} {len(v):6d}  {statistics.median(measured):8.3f}  {p90:5.3f}  {pred:>11s}")


if __name__ == "__main__":
    main(sys.argv[1])
