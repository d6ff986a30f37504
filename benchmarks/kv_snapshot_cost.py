"""What a dashboard snapshot costs: LLMEngine.kv_snapshot on a 3,000-block pool holding 200+ sequences
that share a system prompt (a third of them n=2 forks). Run: .venv/bin/python benchmarks/kv_snapshot_cost.py"""

import json
import statistics
import time
from collections import Counter

from pagedllm import LLM, SamplingParams

llm = LLM(num_kv_blocks=3000, block_size=16, max_num_seqs=256)
e = llm.engine
system = "You are a helpful assistant. " * 40
for i in range(200):
    e.add_request(f"r{i}", system + f"question {i} " * (i % 30),
                  SamplingParams(max_tokens=64, n=1 + (i % 3 == 0), temperature=0.8))
for _ in range(12):
    e.step()
times = []
for _ in range(50):
    t = time.perf_counter()
    snap = e.kv_snapshot()
    times.append(time.perf_counter() - t)
t = time.perf_counter()
body = json.dumps(snap)
encode = time.perf_counter() - t
states = Counter(snap["pool"]["state"])
print(f"pool {snap['pool']['num_blocks']} blocks: free {states[0]}, cached-free {states[1]}, one owner {states[2]}, "
      f"shared {states[3]}; {len(snap['requests'])} requests")
print(f"kv_snapshot: median {statistics.median(times) * 1000:.2f} ms, min {min(times) * 1000:.2f} ms over 50; "
      f"json.dumps {encode * 1000:.2f} ms, {len(body) / 1024:.0f} KiB")
