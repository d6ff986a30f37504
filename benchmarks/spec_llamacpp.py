"""llama.cpp's own n-gram speculation on the grounded prompts of `bench latency --workload grounded`:
llama-server (one slot, 2 threads) with --spec-type ngram-simple and without, the same chat-templated
token ids, greedy, up to 128 tokens, one warm-up request first; its timings give decode tokens/s and
draft_n / draft_n_accepted. Run: LLAMA_SERVER=.../llama-server .venv/bin/python benchmarks/spec_llamacpp.py"""

import json
import os
import statistics
import sys

from pagedllm.bench.llama_server import LlamaServer, find_server
from pagedllm.bench.passages import grounded_messages
from pagedllm.model_executor.model_loader import default_model_path, load_model

N, OUT = 6, 128
tok = load_model(None).tokenizer
prompts = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in grounded_messages(N)]
server = find_server(os.environ.get("LLAMA_SERVER"))
base = ["-m", str(default_model_path()), "-np", "1", "-c", "4096", "-t", "2", "-tb", "2"]
configs = {"llama-server": [],
           "llama-server ngram-simple": ["--spec-type", "ngram-simple", "--spec-draft-n-max", "4"]}
report = {}
for name, extra in configs.items():
    with LlamaServer(server, base + extra) as srv:
        srv.post("/completion", {"prompt": prompts[0][:32], "n_predict": 8, "temperature": 0.0, "top_k": 1})
        runs = []
        for p in prompts:
            r = srv.post("/completion", {"prompt": p, "n_predict": OUT, "temperature": 0.0, "top_k": 1,
                                         "cache_prompt": False})
            t = r["timings"]
            runs.append({"decode_tokens_per_s": t["predicted_per_second"], "tokens": t["predicted_n"],
                         "draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0)})
    drafted = sum(r["draft_n"] for r in runs)
    accepted = sum(r["draft_n_accepted"] for r in runs)
    report[name] = {"decode_tokens_per_s_median": statistics.median(r["decode_tokens_per_s"] for r in runs),
                    "acceptance_rate": accepted / drafted if drafted else None, "draft_tokens": drafted,
                    "accepted_tokens": accepted, "runs": runs}
    print(f"{name:28s} decode {report[name]['decode_tokens_per_s_median']:7.1f} tok/s (median of {N}); "
          f"drafted {drafted}, accepted {accepted}" + (f" = {accepted / drafted:.1%}" if drafted else ""))
a, b = (report[k]["decode_tokens_per_s_median"] for k in configs)
print(f"llama.cpp ngram-simple speedup {b / a:.2f}x")
json.dump(report, open(sys.argv[1], "w"), indent=1) if len(sys.argv) > 1 else None
