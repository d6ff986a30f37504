"""xgrammar (the engine's backend) against llguidance on the same states: the default model's
tokenizer, the person-array JSON schema of `bench structured`, a valid JSON text walked token by token;
at every prefix each backend fills one bitmask row (timed) and accepts the next token. Compile times
cold. Run: .venv/bin/python benchmarks/grammar_backends.py  (needs `pip install llguidance`)"""

import json
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from pagedllm.bench.structured import PEOPLE
from pagedllm.model_executor.model_loader import load_model
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.sample.structured_outputs import StructuredOutputs

tok = load_model(None).tokenizer
vocab = tok.vocab_size
people = [{"name": f"Person {i}", "age": 20 + i, "email": f"p{chr(97 + i % 26)}@corp.com", "role": ["admin", "dev", "ops"][i % 3],
           "tags": ["a", "bb"][: i % 3]} for i in range(64)]
text = json.dumps(people)  # compact separators are ", " and ": ", as the engine's JSON grammar
ids = tok.encode(text, add_special_tokens=False)[:600]

so = StructuredOutputs(tok, vocab, tok.eos_token_ids, max_threads=1)
t = time.perf_counter()
compiled = so.compile(StructuredOutputsParams(json=PEOPLE))
x_compile = time.perf_counter() - t - so.stats.tokenizer_info_seconds
xm = xgr.GrammarMatcher(compiled)
xmask = xgr.allocate_token_bitmask(1, vocab)

lt = llguidance.hf.from_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok.tok), n_vocab=vocab,
                                  eos_token=sorted(tok.eos_token_ids)[0])
t = time.perf_counter()
grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(PEOPLE), defaults={"whitespace_flexible": False, "key_separator": ": ",
                                                                                     "item_separator": ", "})
lm = llguidance.LLMatcher(lt, grammar)
l_compile = time.perf_counter() - t
lmask = llguidance.torch.allocate_token_bitmask(1, vocab)
assert not lm.is_error(), lm.get_error()

xt, lt_ = [], []
for tid in ids:
    t = time.perf_counter()
    xm.fill_next_token_bitmask(xmask, 0)
    xt.append(time.perf_counter() - t)
    t = time.perf_counter()
    llguidance.torch.fill_next_token_bitmask(lm, lmask, 0)
    lt_.append(time.perf_counter() - t)
    assert xm.accept_token(tid), ("xgrammar rejects", tok.decode([tid]))
    assert lm.consume_token(tid), ("llguidance rejects", tok.decode([tid]), lm.get_error())
agree = int((torch.tensor(xt) > 0).sum())
print(f"{len(ids)} tokens of a {len(text)}-character JSON text, {vocab}-token vocabulary, 1 thread")
print(f"xgrammar 0.2.9  compile {x_compile * 1000:7.1f} ms; mask fill median {statistics.median(xt) * 1e6:6.1f} us, "
      f"mean {statistics.mean(xt) * 1e6:6.1f} us, max {max(xt) * 1e6:7.1f} us")
print(f"llguidance {llguidance.get_version() if hasattr(llguidance, 'get_version') else ''}  compile {l_compile * 1000:7.1f} ms; "
      f"mask fill median {statistics.median(lt_) * 1e6:6.1f} us, mean {statistics.mean(lt_) * 1e6:6.1f} us, "
      f"max {max(lt_) * 1e6:7.1f} us")
