"""LLMEngine: requests in, one scheduling + model step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import torch

from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.kv_spec import plan_kv_layout
from ..core.request import Request, RequestStatus
from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.state_slots import StateSlots
from ..errors import ConfigError, InvalidRequestError
from ..executor import executor_for
from ..model_executor.model_runner import StepResult
from ..outputs import Logprob, RequestOutput
from ..platforms.allocator import keep_freed_memory
from ..sample.sampler import Sampler, SampleResult
from ..sample.structured_outputs import StructuredOutputs
from ..sampling_params import SamplingParams, StructuredOutputsParams
from ..spec_decode.ngram import NgramProposer, SpecDecodeCounters, SpeculativeConfig, propose_for, record_acceptance
from ..tokenizer import IncrementalDetokenizer
from .input_processor import InputProcessor, PromptType
from .kv_offload import check_offload, open_offload
from .kv_sizing import page_parts, size_kv_pool
from .output_processor import RequestGroup, check_stop, finish_text, make_output
from .stats import EngineStats, EngineView, engine_stats, kv_snapshot

__all__ = ["EngineStats", "LLMEngine", "PromptType"]

log = logging.getLogger("pagedllm")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        keep_freed_memory()  # before the first step's activations: they are then reused, not re-faulted
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        t0 = time.monotonic()
        self.executor = executor_for(config)
        loaded = self.executor.load_model()
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        mc = loaded.config
        self.spec: SpeculativeConfig | None = config.speculative_config
        draft = None
        if self.spec is not None and self.spec.method == "draft_model":  # its KV pool mirrors ours block for block
            draft = self.executor.load_draft_model(self.spec.model)
        specs = loaded.model.kv_specs()
        has_state = getattr(loaded.model, "has_state", False)  # linear-attention layers: a state per sequence
        if has_state and self.spec is not None:
            raise ConfigError(f"{mc.architecture} keeps a linear-attention state, which cannot roll back rejected "
                              "proposals: speculative decoding is not supported for it")
        if has_state and config.enable_prefix_caching:
            log.info("prefix caching off: %s's linear-attention state is not kept at block boundaries", mc.architecture)
        layout = plan_kv_layout(specs, config.hybrid_kv_cache, page_parts(config, loaded.dtype))
        if draft is not None and layout.groups[0].sliding_window is not None:  # the draft mirrors the first group
            layout = plan_kv_layout(specs, hybrid=False)
        size = size_kv_pool(config, mc, loaded.dtype, specs, draft.model.kv_specs() if draft is not None else None,
                            layout, self.executor.profile_activations(loaded.model))
        num_blocks, bs, kv_dtype, cache_cls = size.num_blocks, size.block_size, size.kv_dtype, size.cache_cls
        self.max_model_len = max_len = size.max_model_len
        self.kv_bytes_per_token, self.bytes_per_block = size.bytes_per_token, size.bytes_per_block
        max_seqs, state_slots = config.max_num_seqs, None
        if has_state:  # a slot per running sequence; the states never take more memory than the KV pool
            per_seq = loaded.model.state_bytes_per_seq()
            max_seqs = min(max_seqs, max(1, num_blocks * size.bytes_per_block // per_seq))
            state_slots = StateSlots(max_seqs)
            log.info("linear-attention state: %d slots x %.1f MiB (at most %d running sequences)", max_seqs,
                     per_seq / 2**20, max_seqs)
        self.kv_events = None  # a publisher of the prefix cache's changes for fleet routers (kv_events.py)
        if config.kv_events_config is not None:
            from .kv_events import make_publisher

            self.kv_events = make_publisher(config.kv_events_config, bs)
        if config.kv_offload_dir is not None:
            check_offload(config, mc.architecture, has_state, len(layout.groups), draft is not None)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching and not has_state,
                                          layout.windows, record_events=self.kv_events is not None,
                                          record_new_blocks=config.kv_offload_dir is not None)
        self.scheduler = Scheduler(self.block_manager, max_seqs, config.max_num_batched_tokens,
                                   max_len, config.enable_chunked_prefill, config.preemption_mode,
                                   config.watermark, state_slots)
        self.runner = self.executor.init_kv_cache(loaded.model, num_blocks, bs, kv_dtype, cache_cls, layout,
                                                  max_seqs if has_state else 0)
        if self.spec is None:  # a speculating step scores several rows a sequence: never a captured decode
            self.executor.capture_decode_graphs(max_seqs, max_len)
        self.offload = None  # the prefix cache's disk tier (kv_offload.py)
        self._step_thread: int | None = None  # the thread of the last step (steps that hop are warned of, once)
        self._warned_thread = False
        if config.kv_offload_dir is not None:
            self.offload = open_offload(config, self.runner, loaded.dtype, kv_dtype, bs)
            self.scheduler.offload = self.offload.store.leading_hits
        self.groups: dict[str, RequestGroup] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        eos = mc.eos_token_id
        self.eos_token_ids: set[int] = set(self.tokenizer.eos_token_ids) if self.tokenizer else set()
        self.eos_token_ids |= {eos} if isinstance(eos, int) else set(eos or [])
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size, self.eos_token_ids,
                                            max_threads=torch.get_num_threads(), mask_rows=self.runner.model.backend.mask_rows) \
            if self.tokenizer else None
        self.inputs = InputProcessor(self.tokenizer, mc.vocab_size, max_len, config.max_logprobs, self.structured)
        self.sampler = Sampler(config.seed, self.runner.argmax, self.structured)
        self.spec_counters = SpecDecodeCounters()
        self.proposer = NgramProposer(self.spec) if self.spec is not None else None
        self.draft = None
        if draft is not None:
            from ..spec_decode.draft_model import DraftModel

            self.executor.init_draft_kv_cache(draft.model, num_blocks, bs, kv_dtype, cache_cls)
            self.draft = DraftModel(self.spec, self.executor, draft, mc.vocab_size, self.sampler, self.structured)
            self.proposer = self.draft
        log.info("engine ready in %.1f s", time.monotonic() - t0)

    def _finish_loads(self, timeout: float | None = None) -> None:
        """Requests whose blocks the disk tier has read in join the batch."""
        for rid, n in self.offload.poll(timeout):
            self.scheduler.finish_loading(rid, n)

    # ---- requests ------------------------------------------------------------------------
    def prepare_prompt(self, prompt: PromptType) -> dict:
        """Tokenize and check a prompt without touching the engine's state (safe from any thread):
        {"prompt": text or None, "prompt_token_ids": ids}, which add_request takes as it is."""
        text, ids = self.inputs.prompt_ids(prompt)
        return {"prompt": text, "prompt_token_ids": ids}

    def compile_grammar(self, spec: StructuredOutputsParams) -> Any:
        """Compile (and cache) a structured-outputs spec; safe from any thread, so a server compiles
        before add_request and the engine loop finds it cached. Raises InvalidRequestError."""
        return self.inputs.compile_grammar(spec)

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """Check params against the model, tokenize bad_words, compile the grammar: safe from any thread,
        so a server does it before add_request, off the step loop. Raises InvalidRequestError."""
        return self.inputs.prepare_params(params)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Validate and queue a request. Raises InvalidRequestError; nothing else is touched."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self.inputs.prompt_ids(prompt)
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
        self.groups[request_id] = RequestGroup(request_id, text, ids, params, seqs, detoks, [""] * len(seqs))
        return request_id

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
    def _check_step_thread(self) -> None:
        me = threading.get_ident()
        if self._step_thread not in (None, me) and not self._warned_thread:
            log.warning("LLMEngine.step ran in another thread than the step before it. Each thread that runs the CPU "
                        "kernels keeps an OpenMP team of its own, and with more team threads than cores OpenMP puts "
                        "its idle workers to sleep between kernel calls: steps slow down several-fold. Call the "
                        "engine (or an LLM) from one thread, e.g. a single-worker executor.")
            self._warned_thread = True
        self._step_thread = me

    def step(self) -> list[RequestOutput]:
        self._check_step_thread()
        if self.spec is not None:
            self._propose()
        if self.offload is not None:
            self._finish_loads()
        sched = self.scheduler.schedule()
        while self.offload is not None:
            for rid, blocks in sched.loads:
                self.offload.load(rid, blocks)
            if sched.scheduled or not self.offload.num_loading:
                break
            self._finish_loads(timeout=1.0)  # only loads in flight: wait for one, rather than spin
            sched = self.scheduler.schedule()
        if not sched.scheduled:
            self._publish_events()
            return []
        self.num_steps += 1
        if self.draft is not None:
            self.draft.run(sched, self.block_manager.group_tables)
        res = self.execute(sched)
        if self.offload is not None:  # the blocks the cache gained hold their KV now
            self.offload.save(self.block_manager.take_new_blocks())
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
        touched: dict[str, RequestGroup] = {gid: self.groups[gid] for gid in failed}
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
            out = self._finalize_if_done(g) or make_output(g)
            outs.append(out)
        self._publish_events()
        return outs

    def execute(self, sched: SchedulerOutput, all_logits: bool = False) -> StepResult:
        """Run a scheduled step on every rank (tensor-parallel workers on their shards, with the tables of
        requests gone since the last step dropped); the driver's logits come back."""
        return self.executor.execute_model(sched, self.block_manager.group_tables, all_logits)

    def free_blocks(self, request_id: str) -> None:
        """Free the blocks of work run outside the scheduler (scoring a text), on every rank."""
        self.block_manager.free(request_id)
        self.executor.forget(request_id)

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

    def _take_tokens(self, g: RequestGroup, seq: Request, new: list[SampleResult]) -> None:
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

    def _fail(self, g: RequestGroup, error: BaseException) -> None:
        """Abort a request whose own work raised inside a step; the rest of the batch goes on."""
        log.error("request %s failed inside a step and was aborted: %s: %s", g.request_id,
                  type(error).__name__, error, exc_info=error)
        g.error = error
        for seq in g.seqs:
            self._release(seq, RequestStatus.FINISHED_ABORTED)

    def _propose(self) -> None:
        propose_for(self.scheduler.running, self.proposer, self.spec, self.max_model_len, self.draft is not None)

    def _check_stop(self, g: RequestGroup, seq: Request, n_out: int | None = None) -> None:
        """Whether the n_out-th output token (default: the last) ends the sequence."""
        n_out = len(seq.output_token_ids) if n_out is None else n_out
        stop = check_stop(g, seq, n_out, self.eos_token_ids, self.max_model_len)
        if stop is not None:
            self._finish(seq, *stop)

    def _finish(self, seq: Request, status: RequestStatus, reason: int | str | None) -> None:
        finish_text(self.groups[seq.group_id], seq, reason)
        seq.stop_reason = reason
        self._release(seq, status)

    def _release(self, seq: Request, status: RequestStatus) -> None:
        """Finish seq in the scheduler (its blocks freed) and drop its per-request state."""
        if seq.is_finished:
            return
        self.scheduler.finish(seq, status)
        self.sampler.forget(seq.request_id)
        self.executor.forget(seq.request_id)
        if self.proposer is not None:
            self.proposer.forget(seq.request_id)

    def _finalize_if_done(self, g: RequestGroup) -> RequestOutput | None:
        if not all(s.is_finished for s in g.seqs):
            return None
        for seq in g.seqs:
            self.sampler.forget(seq.request_id)
            if self.proposer is not None:
                self.proposer.forget(seq.request_id)
        del self.groups[g.request_id]
        return make_output(g)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, the KV events' publisher and the disk tier (its saves written)."""
        self.executor.shutdown()
        if self.offload is not None:
            self.offload.close()
            self.offload = None
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def _publish_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.block_manager.take_events())

    # ---- introspection -------------------------------------------------------------------
    def _view(self) -> EngineView:
        return EngineView(self.block_manager, self.scheduler, self.spec_counters, self.num_steps, self.bytes_per_block,
                          self.model_name, self.max_model_len,
                          self.offload.counters if self.offload is not None else None)

    def kv_snapshot(self) -> dict:
        """The KV pool block by block, the live requests and counters (stats.kv_snapshot); the dashboard draws it."""
        return kv_snapshot(self._view())

    def stats(self) -> EngineStats:
        return engine_stats(self._view())
