"""The offline API, shaped like vLLM's `LLM`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config import EngineConfig
from ..engine.llm_engine import EngineStats, LLMEngine, PromptType
from ..errors import RequestFailedError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams


class LLM:
    """`LLM()` loads the embedded SmolLM2-135M-Instruct; `LLM(model=PATH)` an HF folder or .gguf.
    Engine options are keyword arguments (dtype, block_size, max_num_seqs, kv_cache_memory, ...)."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        prio = list(priority) if priority is not None else [0] * len(prompts)
        ids = []
        try:
            for p, sp, pr in zip(prompts, params, prio):
                ids.append(self.engine.add_request(None, p, sp, priority=pr))
        except Exception:
            for rid in ids:  # a bad prompt aborts the whole call; the engine stays clean
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        if out.error is not None:
                            raise RequestFailedError(f"request {out.request_id} failed: {out.error}")
                        if bar:
                            bar.update(1)
        except BaseException:
            for rid in pending:  # the call is over: its other requests must not stay in the engine
                self.engine.abort(rid)
            raise
        finally:
            if bar:
                bar.close()
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it cannot chat")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template)
            # the template already wrote any BOS text: do not add special tokens twice
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op at tensor_parallel_size=1)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def kv_snapshot(self) -> dict:
        """The KV pool block by block (what the server's /dashboard draws); see LLMEngine.kv_snapshot."""
        return self.engine.kv_snapshot()
