"""LLMEngine: requests in, one scheduling + model step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .allocator import keep_freed_memory
from .block_manager import BlockManager
from .config import EngineConfig, available_memory_bytes, parse_size
from .errors import ConfigError, InvalidRequestError
from .kv_cache import KVCache
from .model_executor.model_loader import load_model
from .model_runner import ModelRunner
from .outputs import CompletionOutput, Logprob, RequestOutput
from .request import Request, RequestStatus
from .sampler import Sampler, SampleResult
from .sampling_params import SamplingParams, StructuredOutputsParams
from .scheduler import Scheduler
from .spec_decode import NgramProposer, SpecDecodeCounters, SpeculativeConfig, record_acceptance, should_propose
from .structured_outputs import StructuredOutputs
from .tokenizer import IncrementalDetokenizer

log = logging.getLogger("pagedllm")

DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PromptType = str | list[int] | dict


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached_free: int
    kv_usage: float
    kv_utilization: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    peak_kv_blocks_used: int
    peak_num_running: int
    num_steps: int
    block_size: int
    kv_bytes_per_block: int
    spec_num_drafts: int = 0  # speculative decoding (vLLM's spec_decode counters)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Group:
    """One user request: n sequences sharing a prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    texts: list[str] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    error: BaseException | None = None  # what failed it inside a step


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        keep_freed_memory()  # before the first step's activations: they are then reused, not re-faulted
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        t0 = time.monotonic()
        self.tp = None
        self._tp_gone: list[str] = []  # finished since the last step: the workers drop their tables
        if config.tensor_parallel_size > 1:
            if config.speculative_config is not None and config.speculative_config.method == "draft_model":
                raise ConfigError("a draft model is not supported with tensor_parallel_size > 1 (n-gram is)")
            from .distributed import check_divisible
            from .model_executor.model_loader import peek_config
            from .tensor_parallel import TPDriver

            # before any process starts
            check_divisible(peek_config(config.model, config.model_registry), config.tensor_parallel_size)
            self.tp = TPDriver(config)
            weakref.finalize(self, self.tp.close)  # the workers stop with the engine, or at exit
        try:
            loaded = load_model(config.model, config.dtype, config.quantization, self.tp.tp if self.tp else None,
                                config.model_registry)
        except BaseException:
            if self.tp is not None:
                self.tp.close()
            raise
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        mc = loaded.config
        model_dtype = loaded.dtype
        kv_dtype, cache_cls = self._kv_storage(config.kv_cache_dtype, model_dtype)
        bs = config.block_size
        # all ranks together: each holds its KV heads' share of every block
        bytes_per_token = mc.num_layers * cache_cls.bytes_per_token(mc.num_kv_heads, mc.head_dim, kv_dtype)
        self.spec: SpeculativeConfig | None = config.speculative_config
        draft = None
        if self.spec is not None and self.spec.method == "draft_model":  # its KV pool mirrors ours block for block
            draft = load_model(self.spec.model, config.dtype, config.quantization, registry=config.model_registry)
            dc = draft.config
            bytes_per_token += dc.num_layers * cache_cls.bytes_per_token(dc.num_kv_heads, dc.head_dim, kv_dtype)
        bytes_per_block = bytes_per_token * bs
        num_blocks = self._num_blocks(config, bytes_per_block)
        self._check_fits_in_memory(num_blocks, bytes_per_block)
        model_max = mc.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's context ({model_max})")
        max_len = config.max_model_len or model_max
        if num_blocks * bs < max_len:
            if config.max_model_len is not None:
                raise ConfigError(
                    f"KV cache of {num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens cannot hold one "
                    f"max_model_len={max_len} request; raise kv_cache_memory/num_kv_blocks or lower max_model_len")
            max_len = num_blocks * bs
            log.warning("max_model_len capped to %d tokens: all the KV pool holds", max_len)
        self.max_model_len = max_len
        self.kv_bytes_per_token = bytes_per_token
        self.bytes_per_block = bytes_per_block
        log.info("KV cache: %d bytes/token (%d layers x 2 x %d kv heads x %d dim x %s), %d blocks x %d tokens "
                 "= %d tokens in %.1f MiB", bytes_per_token, mc.num_layers, mc.num_kv_heads, mc.head_dim,
                 config.kv_cache_dtype, num_blocks, bs, num_blocks * bs, num_blocks * bytes_per_block / 2**20)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   max_len, config.enable_chunked_prefill, config.preemption_mode,
                                   config.watermark)
        self.runner = ModelRunner(loaded.model, num_blocks, bs, kv_dtype, cache_cls)
        if self.tp is not None:
            self.tp.setup(num_blocks, bs, kv_dtype, cache_cls)
        self.groups: dict[str, _Group] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        eos = mc.eos_token_id
        self.eos_token_ids: set[int] = set(self.tokenizer.eos_token_ids) if self.tokenizer else set()
        self.eos_token_ids |= {eos} if isinstance(eos, int) else set(eos or [])
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size, self.eos_token_ids,
                                            max_threads=torch.get_num_threads(), ops=self.runner.model.ops) \
            if self.tokenizer else None
        self.sampler = Sampler(config.seed, self.runner.argmax, self.structured)
        self.spec_counters = SpecDecodeCounters()
        self.proposer = NgramProposer(self.spec) if self.spec is not None else None
        self.draft = None
        if draft is not None:
            from .draft_model import DraftModel

            self.draft = DraftModel(self.spec, self.runner, draft, num_blocks, kv_dtype, cache_cls, self.sampler,
                                    self.structured)
            self.proposer = self.draft
        log.info("engine ready in %.1f s", time.monotonic() - t0)

    # ---- setup helpers -------------------------------------------------------------------
    @staticmethod
    def _kv_storage(kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[torch.dtype, type]:
        if kv_cache_dtype == "auto":
            return model_dtype, KVCache
        if kv_cache_dtype in _TORCH_DTYPES:
            return _TORCH_DTYPES[kv_cache_dtype], KVCache
        from .kv_quant import FP8KVCache

        return FP8KVCache.storage_dtype(kv_cache_dtype), FP8KVCache

    @staticmethod
    def _num_blocks(config: EngineConfig, bytes_per_block: int) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory is not None:
            budget = parse_size(config.kv_cache_memory)
        elif config.memory_utilization is not None:
            budget = int(available_memory_bytes() * config.memory_utilization)
        else:
            budget = DEFAULT_KV_CACHE_MEMORY
        n = budget // bytes_per_block
        if n < 1:
            raise ConfigError(f"KV budget of {budget} bytes is smaller than one block ({bytes_per_block} bytes)")
        return n

    @staticmethod
    def _check_fits_in_memory(num_blocks: int, bytes_per_block: int) -> None:
        """A pool larger than the memory there is would be zero-filled until the OOM killer ends the
        process (a shared host's global OOM): refused here, with the figures."""
        need, have = num_blocks * bytes_per_block, available_memory_bytes()
        if need > have:
            raise ConfigError(f"the KV pool needs {need / 2**30:.2f} GiB ({num_blocks} blocks x {bytes_per_block} "
                              f"bytes) but only {have / 2**30:.2f} GiB of memory is available; lower "
                              "kv_cache_memory / num_kv_blocks or use memory_utilization")

    # ---- requests ------------------------------------------------------------------------
    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; pass {'prompt_token_ids': [...]}")
            return prompt, self._check_ids(self.tokenizer.encode(prompt, max_tokens=self.max_model_len))
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(list(prompt))
        raise InvalidRequestError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def prepare_prompt(self, prompt: PromptType) -> dict:
        """Tokenize and check a prompt without touching the engine's state (safe from any thread):
        {"prompt": text or None, "prompt_token_ids": ids}, which add_request takes as it is."""
        text, ids = self._prompt_ids(prompt)
        return {"prompt": text, "prompt_token_ids": ids}

    def compile_grammar(self, spec: StructuredOutputsParams) -> Any:
        """Compile (and cache) a structured-outputs spec; safe from any thread, so a server compiles
        before add_request and the engine loop finds it cached. Raises InvalidRequestError."""
        if self.structured is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this model has none")
        return self.structured.compile(spec)

    def _check_ids(self, ids: list) -> list[int]:
        if not ids:
            raise InvalidRequestError("prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        return list(ids)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Validate and queue a request. Raises InvalidRequestError; nothing else is touched."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                                      "(room must be left for at least one output token)")
        if params.max_tokens is None:
            params = SamplingParams(**{**params.__dict__, "max_tokens": self.max_model_len - len(ids)})
        params = self.prepare_params(params)
        seqs = []
        for i in range(params.n):
            p = params if params.n == 1 else params.clone_for_child(i)
            seqs.append(Request(f"{request_id}#{i}" if params.n > 1 else request_id, ids, p,
                                priority=priority, cache_salt=cache_salt, group_id=request_id, index=i))
        if params.structured_outputs is not None:
            compiled = self.compile_grammar(params.structured_outputs)
            for seq in seqs:
                seq.grammar = self.structured.matcher(compiled)  # type: ignore[union-attr]
        leader = seqs[0]
        leader.pending_forks = seqs[1:]
        self.scheduler.add_request(leader)  # raises if it can never fit; nothing is queued then
        detoks = [IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
                  for _ in seqs]
        self.groups[request_id] = _Group(request_id, text, ids, params, seqs, detoks, [""] * len(seqs))
        return request_id

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """Check what params name against the model (token ids, logprobs), tokenize bad_words and
        compile the grammar: work linear in the request's size, safe from any thread, so a server does
        it before add_request, off the step loop; add_request then finds it done. Raises
        InvalidRequestError."""
        vocab = self.model_config.vocab_size
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            bad = next((t for t in (getattr(params, name) or []) if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > min(self.config.max_logprobs, vocab):
            raise InvalidRequestError(f"logprobs of {params.logprobs} is over the limit of "
                                      f"{min(self.config.max_logprobs, vocab)} (max_logprobs)")
        if params.structured_outputs is not None:
            self.compile_grammar(params.structured_outputs)  # cached: add_request finds it compiled
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words needs a tokenizer; this model has none")
        seqs: dict[tuple[int, ...], None] = {}  # ordered and de-duplicated in linear time
        for word in params.bad_words:  # as vLLM: the word alone and after a space, as the model would spell it
            for text in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids:
                    seqs[tuple(ids)] = None
        return SamplingParams(**{**params.__dict__, "bad_words_token_ids": [list(w) for w in seqs]})

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. Returns its final output (or None if unknown)."""
        g = self.groups.get(str(request_id))
        if g is None:
            return None
        for seq in g.seqs:
            self._release(seq, RequestStatus.FINISHED_ABORTED)
        return self._finalize_if_done(g)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.spec is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        self.num_steps += 1
        if self.draft is not None:
            self.draft.run(sched, self.block_manager.tables)
        if self.tp is not None:  # the workers run the same step on their shards
            gone, self._tp_gone = self._tp_gone, []
            self.tp.step(sched, self.block_manager.tables, gone)
        res = self.runner.execute(sched, self.block_manager.tables)
        # from here on, an exception is one request's: its group is aborted alone (failed), the batch goes on
        failed: dict[str, BaseException] = {}
        # a leader finishing its prompt also samples the first token of each of its forks; a speculating
        # request verifies its proposals over its 1 + k rows
        reqs, rows = [], []
        emitted: dict[str, list[SampleResult]] = {}
        offset = 0
        for r, n in zip(res.requests, res.num_rows):
            if n > 1:
                drafts = list(r.spec_tokens)
                q = self.draft.probs.get(r.request_id) if self.draft is not None else None
                try:
                    emitted[r.request_id], accepted = self.sampler.verify(res.logits[offset:offset + n], r, drafts,
                                                                          self.eos_token_ids, q)
                except Exception as e:  # noqa: BLE001 - failed alone, below
                    failed[r.group_id] = e
                else:
                    self.spec_counters.record(len(drafts), accepted)
                    record_acceptance(r, len(drafts), accepted, self.spec)
            else:
                for seq in [r, *r.pending_forks]:
                    reqs.append(seq)
                    rows.append(offset)
            offset += n
        for seq, s in zip(reqs, self._sample(res.logits, reqs, rows, failed)):
            if s is None:
                continue
            emitted[seq.request_id] = [s]
            try:
                if seq.grammar is not None and not seq.grammar.accept_token(s.token_id):
                    log.warning("request %s: sampled token %d is outside its grammar", seq.request_id, s.token_id)
            except Exception as e:  # noqa: BLE001
                failed[seq.group_id] = e
        for gid, e in failed.items():
            self._fail(self.groups[gid], e)
        self.scheduler.update(sched, {r.request_id: [s.token_id for s in emitted.get(r.request_id, [])]
                                      for r in res.requests})
        if self.draft is not None:
            self.draft.after_update([s.request for s in sched.scheduled if s.num_spec and not s.request.is_finished])
        for r in res.requests:
            if r.is_finished:
                continue
            for child in r.pending_forks:
                self.scheduler.fork(r, child)
                child.output_token_ids.append(emitted[child.request_id][0].token_id)
                self.scheduler.counters.generation_tokens += 1
            r.pending_forks = []
        now = time.monotonic()
        touched: dict[str, _Group] = {gid: self.groups[gid] for gid in failed}
        for seq in [*reqs, *(r for r, n in zip(res.requests, res.num_rows) if n > 1)]:
            if seq.is_finished:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            g = self.groups[seq.group_id]
            try:
                self._take_tokens(g, seq, emitted[seq.request_id])
            except Exception as e:  # noqa: BLE001 - detokenizing, stop strings, logprobs of this one request
                self._fail(g, e)
            touched[g.request_id] = g
        outs = []
        for g in touched.values():
            out = self._finalize_if_done(g) or self._output(g)
            outs.append(out)
        return outs

    def _sample(self, logits: torch.Tensor, reqs: list[Request], rows: list[int],
                failed: dict[str, BaseException]) -> list[SampleResult | None]:
        """One sample per request, batched; when the batch raises, each request alone, so that only the
        requests that fail (None, their error in failed) lose their step."""
        if not reqs:
            return []
        try:
            return self.sampler.sample(logits, reqs, rows, self.eos_token_ids)
        except Exception:  # noqa: BLE001 - found below, request by request
            pass
        out: list[SampleResult | None] = []
        for seq, row in zip(reqs, rows):
            try:
                out.append(self.sampler.sample(logits, [seq], [row], self.eos_token_ids)[0])
            except Exception as e:  # noqa: BLE001
                failed[seq.group_id] = e
                out.append(None)
        return out

    def _take_tokens(self, g: _Group, seq: Request, new: list[SampleResult]) -> None:
        """Logprobs and stop checks of the tokens a step appended to seq (several: accepted proposals)."""
        base = len(seq.output_token_ids) - len(new)
        for j, s in enumerate(new):
            if seq.params.logprobs is not None:
                seq.cumulative_logprob += s.logprob
                seq.logprobs.append({t: Logprob(lp, rank, self.tokenizer.id_to_token(t) if self.tokenizer else None)
                                     for t, lp, rank in s.top})
            self._check_stop(g, seq, base + j + 1)
            if seq.is_finished:  # a stop inside the accepted run: the tokens after it are not outputs
                dropped = len(seq.output_token_ids) - (base + j + 1)
                del seq.output_token_ids[base + j + 1:]
                self.scheduler.counters.generation_tokens -= dropped
                break

    def _fail(self, g: _Group, error: BaseException) -> None:
        """Abort a request whose own work raised inside a step; the rest of the batch goes on."""
        log.error("request %s failed inside a step and was aborted: %s: %s", g.request_id,
                  type(error).__name__, error, exc_info=error)
        g.error = error
        for seq in g.seqs:
            self._release(seq, RequestStatus.FINISHED_ABORTED)

    def _propose(self) -> None:
        """This step's proposals for running decodes (none while the batch is large, for paused
        requests, or where n-gram lookup finds nothing); a grammar cuts them at its first rejection."""
        cfg = self.spec
        running = self.scheduler.running
        large = cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size
        for req in running:
            req.spec_tokens = []
            if large or req.num_tokens - req.num_computed_tokens != 1 or req.pending_forks:
                continue
            k = min(cfg.num_speculative_tokens, req.max_tokens - len(req.output_token_ids) - 1,
                    self.max_model_len - req.num_tokens - 1)
            if k < 1 or not should_propose(req):
                continue
            drafts = self.proposer.propose(req, k)  # a draft model's are placeholders until it runs
            if req.grammar is not None and drafts and self.draft is None:
                n = 0
                while n < len(drafts) and req.grammar.accept_token(drafts[n]):
                    n += 1
                if n:
                    req.grammar.rollback(n)
                del drafts[n:]
            req.spec_tokens = drafts

    def _check_stop(self, g: _Group, seq: Request, n_out: int | None = None) -> None:
        """Whether the n_out-th output token (default: the last) ends the sequence."""
        n_out = len(seq.output_token_ids) if n_out is None else n_out
        tok = seq.output_token_ids[n_out - 1]
        p = seq.params
        detok = g.detoks[seq.index]
        if detok is not None:
            delta = detok.add(tok)
            if p.stop and delta:
                text = detok.text
                longest = max(map(len, p.stop))
                window_start = max(0, len(text) - len(delta) - longest + 1)
                hits = [(text.find(st, window_start), st) for st in p.stop]
                hits = [(i, st) for i, st in hits if i >= 0]
                if hits:
                    i, st = min(hits)
                    g.texts[seq.index] = text[:i + len(st)] if p.include_stop_str_in_output else text[:i]
                    return self._finish(seq, RequestStatus.FINISHED_STOPPED, st)
        if seq.grammar is not None and n_out == len(seq.output_token_ids) and seq.grammar.is_terminated():
            return self._finish(seq, RequestStatus.FINISHED_STOPPED, None)  # it accepted a stop token where it may end
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                return self._finish(seq, RequestStatus.FINISHED_STOPPED, None)
            if tok in p.stop_token_ids:
                return self._finish(seq, RequestStatus.FINISHED_STOPPED, tok)
        if n_out >= p.max_tokens or seq.num_prompt_tokens + n_out >= self.max_model_len:
            return self._finish(seq, RequestStatus.FINISHED_LENGTH, None)
        if detok is not None:
            hold = max(map(len, p.stop), default=1) - 1  # a stop string may still be completing
            g.texts[seq.index] = detok.text[:len(detok.text) - hold] if hold else detok.text

    def _finish(self, seq: Request, status: RequestStatus, reason: int | str | None) -> None:
        g = self.groups[seq.group_id]
        detok = g.detoks[seq.index]
        if detok is not None and not isinstance(reason, str):
            detok.flush()
            g.texts[seq.index] = detok.text
        seq.stop_reason = reason
        self._release(seq, status)

    def _release(self, seq: Request, status: RequestStatus) -> None:
        """Finish seq in the scheduler (its blocks freed) and drop its per-request state."""
        if seq.is_finished:
            return
        self.scheduler.finish(seq, status)
        self.sampler.forget(seq.request_id)
        if self.tp is not None:
            self._tp_gone.append(seq.request_id)
        if self.proposer is not None:
            self.proposer.forget(seq.request_id)

    def _output(self, g: _Group) -> RequestOutput:
        comps = []
        for seq, text in zip(g.seqs, g.texts):
            comps.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.status.value if seq.is_finished else None,
                stop_reason=seq.stop_reason))
        leader = g.seqs[0]
        finished = all(s.is_finished for s in g.seqs)
        metrics = {"arrival_time": leader.arrival_time, "first_scheduled_time": leader.first_scheduled_time,
                   "first_token_time": leader.first_token_time,
                   "finished_time": max((s.finished_time or 0) for s in g.seqs) if finished else None,
                   "num_preemptions": sum(s.num_preemptions for s in g.seqs)}
        error = None if g.error is None else f"{type(g.error).__name__}: {g.error}"
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, comps, finished,
                             leader.num_cached_tokens, metrics, error)

    def _finalize_if_done(self, g: _Group) -> RequestOutput | None:
        if not all(s.is_finished for s in g.seqs):
            return None
        for seq in g.seqs:
            self.sampler.forget(seq.request_id)
            if self.proposer is not None:
                self.proposer.forget(seq.request_id)
        del self.groups[g.request_id]
        return self._output(g)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them)."""
        if self.tp is not None:
            self.tp.close()

    # ---- introspection -------------------------------------------------------------------
    def kv_snapshot(self) -> dict:
        """The KV pool block by block, the live requests, the counters, and what the running requests
        would reserve under static max-length allocation.
        Built between steps (from the engine's thread); the dashboard draws it."""
        t0 = time.perf_counter()
        sc, bs = self.scheduler, self.block_manager.block_size
        reqs = [*sc.running, *sc.waiting.values()]
        pool = self.block_manager.snapshot([r.request_id for r in reqs],
                                           {r.request_id: r.num_computed_tokens for r in sc.running})
        rows = [{"id": r.request_id, "status": r.status.value, "prompt_tokens": r.num_prompt_tokens,
                 "output_tokens": len(r.output_token_ids), "computed_tokens": r.num_computed_tokens,
                 "max_tokens": r.max_tokens, "blocks": len(self.block_manager.table(r.request_id)),
                 "cached_tokens": r.num_cached_tokens, "preemptions": r.num_preemptions, "priority": r.priority}
                for r in reqs]
        # the seed's static serving: each running request holds max_model_len contiguous slots
        # (declared: prompt + max_tokens, what a smarter static server would reserve)
        live = sum(r.num_computed_tokens for r in sc.running)
        reserved = len(sc.running) * self.max_model_len
        declared = sum(min(r.max_total_tokens, self.max_model_len) for r in sc.running)
        static = {"requests": len(sc.running), "reserved_tokens": reserved, "reserved_blocks": -(-reserved // bs),
                  "declared_tokens": declared, "live_tokens": live,
                  "wasted_fraction": 1 - live / reserved if reserved else 0.0,
                  "declared_wasted_fraction": 1 - live / declared if declared else 0.0}
        return {"time": time.time(), "step": self.num_steps, "model": self.model_name,
                "max_model_len": self.max_model_len, "watermark_blocks": sc.watermark_blocks,
                "pool": pool, "requests": rows, "static": static,
                "stats": self.stats(filled=pool["filled_slots"], cached_free=pool["cached_free"]).to_dict(),
                "build_ms": (time.perf_counter() - t0) * 1000}

    def stats(self, filled: int | None = None, cached_free: int | None = None) -> EngineStats:
        """filled / cached_free: when the caller has them already (kv_snapshot), not counted again."""
        bm, sc = self.block_manager, self.scheduler
        used = bm.num_used_blocks
        if filled is None:
            filled = bm.filled_slots({r.request_id: r.num_computed_tokens for r in sc.running})
        c = sc.counters
        return EngineStats(
            num_running=len(sc.running), num_waiting=len(sc.waiting), kv_blocks_total=bm.num_blocks,
            kv_blocks_used=used,
            kv_blocks_cached_free=bm.num_cached_free_blocks if cached_free is None else cached_free,
            kv_usage=used / bm.num_blocks, kv_utilization=filled / (used * bm.block_size) if used else 0.0,
            prefix_cache_queries=c.prefix_cache_queries, prefix_cache_hits=c.prefix_cache_hits,
            num_preemptions=c.num_preemptions, prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens, peak_kv_blocks_used=c.peak_kv_blocks_used,
            peak_num_running=c.peak_num_running, num_steps=self.num_steps, block_size=bm.block_size,
            kv_bytes_per_block=self.bytes_per_block, spec_num_drafts=self.spec_counters.num_drafts,
            spec_num_draft_tokens=self.spec_counters.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_counters.num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_counters.accepted_per_pos))
