"""`specray bench`: workloads (JSONL), the measuring runner, peers (HF transformers, vLLM), the JSON report and
its plots."""
