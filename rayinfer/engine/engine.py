"""The engine loop: add requests, step, abort. It drives an Executor and knows no workers.

One request whose token the executor could not choose (SampledTokens.errors: its seed, NaN
logits), or whose own post-processing raised (detokenizing, stop strings, log-probability text),
ends alone with finish_reason "error" and a reason; a step whose forward fails raises.

A request can also run half-way: `prefill_only` requests stop after their first token and keep
their KV until `take_handoff` exports it; `add_prefilled_request` starts a request from such a
hand-off in another engine, which decodes it without recomputing the prompt.

Hand-off copies run beside the steps: `take_handoff` starts the export and returns at once (the
request's blocks are freed when the executor reports the copy done); an imported request's
blocks are filled while the engine keeps stepping the others, and the request joins the batch
once its KV has landed (`Executor.transfers_done`, polled at the start of every step); the
copies in flight are handoffs.py's.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.engine.bad_words import completing_tokens, with_bad_words_tokenized
from rayinfer.engine.batch import ModelBatch, ScheduledRequest
from rayinfer.engine.block_manager import BlockManager
from rayinfer.engine.executor import Executor
from rayinfer.engine.handoffs import Handoffs, PendingImport
from rayinfer.engine.kv_handoff import KVHandoff
from rayinfer.engine.outputs import RequestOutput
from rayinfer.engine.prompt_truncation import keep_last, prompt_token_limit
from rayinfer.engine.request_state import RequestState
from rayinfer.engine.sampling_params import InvalidRequestError, SamplingParams
from rayinfer.engine.scheduler import ScheduledSequence, Scheduler
from rayinfer.engine.sequence import Sequence, SequenceStatus
from rayinfer.engine.stop_checker import eos_token_ids
from rayinfer.engine_config import CacheConfig, SchedulerConfig

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        executor: Executor,
        tokenizer=None,
    ):
        if executor.num_kv_blocks not in (None, cache_config.num_blocks):
            # The executor sized its cache from GPU memory (gpu_memory_utilization).
            cache_config = replace(cache_config, num_blocks=executor.num_kv_blocks)
        capacity = cache_config.num_blocks * cache_config.block_size
        if scheduler_config.max_model_len > capacity:
            raise ConfigError(
                f"max_model_len={scheduler_config.max_model_len} exceeds the KV cache's "
                f"{capacity} tokens; raise num_blocks or lower max_model_len"
            )
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.executor = executor
        self.tokenizer = tokenizer
        # One cache partition per data-parallel attention replica of the executor.
        self.block_managers = [
            BlockManager(
                cache_config.num_blocks,
                cache_config.block_size,
                cache_config.enable_prefix_caching,
                cache_config.num_window_blocks,
                model_config.window_span,
            )  # fmt: skip
            for _ in range(executor.num_kv_partitions)
        ]
        self.windowed = model_config.window_span > 0
        self.scheduler = Scheduler(scheduler_config, self.block_managers)
        self.states: dict[str, RequestState] = {}
        self.handoffs_ready: dict[str, RequestState] = {}
        self.ready_outputs: list[RequestOutput] = []  # finished outside a step, reported next
        # the last step's prompt tokens beside its decodes; None: it ran no model batch
        self.last_step_prompt_tokens: int | None = None
        self.eos_token_ids = eos_token_ids(model_config, tokenizer)
        self._arrivals = 0
        # Finished requests whose per-request executor state (sampling generators) is freed in
        # one call at the end of the step: a worker group makes one remote call per worker per
        # free, and 256 decodes finishing together made 512.
        self._to_free: list[str] = []
        self.handoffs = Handoffs(self.scheduler, scheduler_config, executor, self._free_later)
        # Requests that have sampled on this executor: their grammar history and prompt (for the
        # repetition penalty) were sent with their first sampling step.
        self._sampled_here: set[str] = set()
        self._eos_ids = tuple(sorted(self.eos_token_ids))

    # --- requests in -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        prefill_only: bool = False,
    ) -> None:
        params = self._checked_params(params or SamplingParams())
        limit = prompt_token_limit(
            params.truncate_prompt_tokens, self.scheduler_config.max_model_len, params.max_tokens
        )
        prompt_ids = self._prompt_token_ids(prompt, limit)
        self._check_new_request(request_id, prompt_ids)
        state = self._new_state(request_id, prompt_ids, params, prefill_only)
        self.scheduler.add(state.seq)

    def add_prefilled_request(self, handoff: KVHandoff, params: SamplingParams) -> None:
        """Continue a request whose prompt was prefilled elsewhere; its KV arrives as a payload."""
        self._check_new_request(handoff.request_id, handoff.prompt_token_ids)
        params = self._checked_params(params)  # the prefill truncated the prompt already
        state = self._new_state(handoff.request_id, list(handoff.prompt_token_ids), params, False)
        pending_imports = self.handoffs.pending_imports
        pending_imports.append(PendingImport(state, handoff.payload))
        try:
            self._append_token(state, handoff.first_token_id, handoff.first_token_logprobs)
            first = state.take_output()  # the caller already has the first token
        except Exception:  # the caller hears it; nothing of the request stays
            pending_imports.pop()
            self.executor.discard_kv(handoff.payload)
            self.states.pop(handoff.request_id, None)
            raise
        finally:
            self._free_finished()
        if state.seq.is_finished:  # max_tokens=1, or the first token was EOS
            pending_imports.pop()
            self.executor.discard_kv(handoff.payload)
            self.ready_outputs.append(first)

    def abort(self, request_id: str) -> None:
        state = self.states.get(request_id) or self.handoffs_ready.pop(request_id, None)
        if state is None:
            return
        if self.handoffs.abort(state):  # its blocks are being written: freed when that ends
            self.states.pop(request_id, None)
            return
        if state.seq.status == SequenceStatus.FINISHED:
            self.scheduler.release(state.seq)
        else:
            self.scheduler.finish(state.seq, "abort")
        self.executor.free_requests([request_id])
        self._sampled_here.discard(request_id)
        self.states.pop(request_id, None)

    @property
    def block_manager(self) -> BlockManager:
        """The cache's only partition (engines without data-parallel attention)."""
        return self.scheduler.block_manager

    @property
    def kv_usage(self) -> float:
        """Fraction of every partition's blocks in use."""
        total = sum(len(m.blocks) for m in self.block_managers)
        return sum(len(m.blocks) - m.num_free_blocks for m in self.block_managers) / total

    def has_unfinished_requests(self) -> bool:
        """Whether `step` has work: requests to run, hand-offs to import or copies in flight, or
        outputs to report."""
        return bool(self.scheduler.has_unfinished or self.handoffs.busy or self.ready_outputs)

    # --- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute and report every request that produced tokens or finished."""
        try:
            return self._step()
        finally:
            self._free_finished()

    def _step(self) -> list[RequestOutput]:
        self.handoffs.finish_transfers()
        self.handoffs.admit_pending_imports()
        scheduled = self.scheduler.schedule()
        # prompt tokens (prefill chunks, recomputes) beside the decodes' one token each
        self.last_step_prompt_tokens = (
            sum(s.num_new_tokens for s in scheduled if not s.is_decode) if scheduled else None
        )
        ready, self.ready_outputs = self.ready_outputs, []
        if not scheduled:
            if not ready:  # only copies in flight (or nothing that fits yet): wait for one
                self.handoffs.wait_for_a_transfer()
            return ready
        result = self.executor.execute(self._model_batch(scheduled))
        sampled = iter(result.token_ids)
        logprobs = iter(result.logprobs) if result.logprobs is not None else None
        prompt_logprobs = result.prompt_logprobs or {}
        errors = result.errors or {}
        outputs = ready
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.scheduler.manager_of(seq).mark_computed(seq)
            state = self.states[seq.request_id]
            token = (next(sampled), next(logprobs) if logprobs else None) if item.samples else None
            try:
                output = self._report(state, token, prompt_logprobs, errors)
            except Exception as error:  # this request's own bookkeeping: it alone fails
                output = self._fail_report(state, error)
            if output is not None:
                outputs.append(output)
        return outputs

    def _report(self, state: RequestState, token, prompt_logprobs, errors) -> RequestOutput | None:
        """One scheduled request after the step: its prompt log-probabilities, then its sampled
        token (detokenized, stop strings checked) when it sampled one."""
        request_id = state.seq.request_id
        if request_id in prompt_logprobs:  # before a last chunk's token ends the request
            state.add_prompt_logprobs(*prompt_logprobs[request_id])
        if token is None:
            return None
        if request_id in errors:
            self._fail(state, errors[request_id])
        else:
            self._append_token(state, *token)
        return state.take_output()

    def take_handoff(self, request_id: str) -> KVHandoff:
        """Start exporting the KV of a finished prefill-only request; its blocks are freed once
        the executor has copied them out."""
        state = self.handoffs_ready.pop(request_id)
        seq = state.seq
        payload = self.handoffs.start_export(seq)
        return KVHandoff(
            request_id=request_id,
            prompt_token_ids=seq.prompt_token_ids,
            first_token_id=seq.output_token_ids[0],
            first_token_logprobs=state.logprobs[0] if state.logprobs else None,
            payload=payload,
            num_bytes=getattr(payload, "num_bytes", 0),
        )

    # --- internals ---------------------------------------------------------------------------
    def _prompt_token_ids(self, prompt: str | list[int], limit: int | None) -> list[int]:
        """limit: truncate_prompt_tokens' (engine/prompt_truncation.py), None for all."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer; pass token ids")
            if limit is not None:
                return self.tokenizer.encode_last(prompt, limit)
            return self.tokenizer.encode(prompt)
        return keep_last(list(prompt), limit)

    def _check_new_request(self, request_id: str, prompt_ids: list[int]) -> None:
        if request_id in self.states or request_id in self.handoffs_ready:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if not prompt_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        limit = self.scheduler_config.max_model_len
        if len(prompt_ids) >= limit:
            raise InvalidRequestError(
                "prompt", f"has {len(prompt_ids)} tokens; max_model_len={limit} leaves no room"
            )
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:  # builtins: 16k ids in ~0.2 ms
            raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab})")

    def _checked_params(self, params: SamplingParams) -> SamplingParams:
        """params with bad_words tokenized, after what SamplingParams cannot check alone: token
        ids against the vocabulary, and that stop strings and bad words have a tokenizer."""
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop", "this model has no tokenizer, so there is no text to match stop strings in"
            )
        params = with_bad_words_tokenized(params, self.tokenizer)
        params.check_vocabulary(self.model_config.vocab_size)
        return params

    def _new_state(self, request_id, prompt_ids, params, prefill_only) -> RequestState:
        seq = Sequence(request_id, prompt_ids, params, self._arrivals, prefill_only)
        self._arrivals += 1
        state = RequestState(seq, self.tokenizer)
        self.states[request_id] = state
        return state

    def _append_token(self, state: RequestState, token_id: int, logprobs=None) -> None:
        reason = state.append_token(
            token_id, self.eos_token_ids, self.scheduler_config.max_model_len, logprobs
        )
        seq = state.seq
        if seq.prefill_only and reason is None:
            reason = "prefilled"
        if reason is None:
            return
        keep = seq.prefill_only and seq.status == SequenceStatus.RUNNING
        if seq.status != SequenceStatus.FINISHED:
            self.scheduler.finish(seq, reason, keep_blocks=keep)
        state.finish(reason)
        del self.states[seq.request_id]
        if keep:
            self.handoffs_ready[seq.request_id] = state
        else:
            self._to_free.append(seq.request_id)

    def _fail(self, state: RequestState, reason: str) -> None:
        """End one request with finish_reason "error" (the executor could not choose its
        token); its blocks and executor state are freed, the rest of the batch goes on."""
        seq = state.seq
        logger.warning("request %s failed in the engine: %s", seq.request_id, reason)
        self.scheduler.finish(seq, "error")
        state.fail(reason)
        del self.states[seq.request_id]
        self._to_free.append(seq.request_id)

    def _fail_report(self, state: RequestState, error: Exception) -> RequestOutput:
        """End a request whose post-processing raised, wherever it stopped: running, finished,
        or finished with its blocks kept for a hand-off. The traceback goes to the log."""
        seq = state.seq
        logger.exception("reporting request %s failed; it alone ends", seq.request_id)
        reason = f"the engine failed to process its output ({type(error).__name__})"
        self.states.pop(seq.request_id, None)
        if self.handoffs_ready.pop(seq.request_id, None) is not None:
            self.scheduler.release(seq)
        if seq.status != SequenceStatus.FINISHED:
            self.scheduler.finish(seq, "error")
        if seq.request_id not in self._to_free:
            self._to_free.append(seq.request_id)
        state.fail(reason)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            finish_reason="error",
            num_cached_tokens=seq.num_cached_tokens,
            error=reason,
        )

    def _free_later(self, request_id: str) -> None:
        """Free the request's executor state with the others' at the end of the step."""
        self._to_free.append(request_id)

    def _free_finished(self) -> None:
        if self._to_free:
            finished, self._to_free = self._to_free, []
            self._sampled_here.difference_update(finished)
            self.executor.free_requests(finished)

    def _model_batch(self, scheduled: list[ScheduledSequence]) -> ModelBatch:
        """The step's requests. Block tables are the sequences' own lists, not copies: the
        executor reads them during `execute` (a worker group pickles them), and nothing changes
        them before it returns."""
        requests = []
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            requests.append(
                ScheduledRequest(
                    request_id=seq.request_id,
                    token_ids=seq.token_slice(start, start + item.num_new_tokens),
                    start_position=start,
                    block_table=seq.block_table,
                    window_table=seq.window_table if self.windowed else None,
                    samples=item.samples,
                    params=seq.params,
                    kv_partition=seq.kv_partition,
                    output_token_ids=(
                        list(seq.output_token_ids)
                        if item.samples and seq.params.has_penalties
                        else None
                    ),
                    prompt_logprob_targets=_prompt_logprob_targets(seq, start, item.num_new_tokens),
                    suppressed_token_ids=self._suppressed(seq) if item.samples else None,
                    exports_kv=seq.prefill_only and item.samples,
                )
            )
            if item.samples and seq.request_id not in self._sampled_here:
                self._send_history(requests[-1], seq)
        return ModelBatch(requests)

    def _send_history(self, request: ScheduledRequest, seq: Sequence) -> None:
        """The first time a request samples here: what the runner keeps from then on (a
        structured request's generated tokens, a repetition-penalized request's prompt)."""
        self._sampled_here.add(seq.request_id)
        if seq.params.structured_output is not None:
            request.grammar_token_ids = list(seq.output_token_ids)
        if seq.params.repetition_penalty != 1:
            request.prompt_token_ids = seq.prompt_token_ids

    def _suppressed(self, seq: Sequence) -> tuple[int, ...] | None:
        """The tokens this step may not sample: under min_tokens, those that would end the
        request (EOS unless ignored or a grammar decides, and the stop_token_ids); with
        bad_words, those that would complete one (engine/bad_words.py)."""
        params = seq.params
        suppressed = ()
        if seq.num_output_tokens < params.min_tokens:
            ignored = params.ignore_eos or params.structured_output is not None
            suppressed = (() if ignored else self._eos_ids) + params.stop_token_ids
        if params.bad_words_token_ids:
            suppressed += completing_tokens(params.bad_words_token_ids, seq.output_token_ids)
        return suppressed or None


def _prompt_logprob_targets(seq: Sequence, start: int, num_new: int) -> list[int] | None:
    """The prompt tokens that rows start.. start + num_new - 1 predict, when the request wants
    prompt log-probabilities (row j predicts position start + j + 1)."""
    if seq.params.prompt_logprobs is None or start + 1 >= seq.num_prompt_tokens:
        return None
    end = min(start + num_new, seq.num_prompt_tokens - 1)
    return seq.prompt_token_ids[start + 1 : end + 1]
