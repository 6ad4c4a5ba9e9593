"""The grammar matchers of one runner's structured-output requests and their token masks.

A matcher is made the first time its request samples on this runner, from the request's
StructuredOutput and the tokens it generated before (ScheduledRequest.grammar_token_ids: none on
the prefill worker, the first token on a decode worker after the hand-off), and advances with
every token sampled here. Masks are filled on the host into one int32 bitmask (bit j of row r:
token 32 * w + j allowed), after the forward has been queued, so on a GPU they are computed while
the forward runs; layers/sampler.py applies them. Requests without a grammar cost nothing here.
Each mask also keeps the output valid UTF-8 (utf8_tails.py), which xgrammar alone does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayinfer.engine.batch import ScheduledRequest
from rayinfer.workers.runner.utf8_tails import CLOSED, Tail, Utf8Tails


@dataclass
class GrammarMasks:
    bitmask: torch.Tensor  # [R, ceil(V / 32)] int32 on the host: the allowed tokens of each row
    rows: list[int]  # [R] the sampling row (index among the step's sampling requests) of each
    errors: dict[int, str]  # sampling row -> why its grammar could not be used


class GrammarMatchers:
    def __init__(self, tokenizer_path: str | None, vocab_size: int, eos_token_ids, pin: bool):
        """vocab_size: the logits' width (ids past the tokenizer's are never allowed);
        eos_token_ids: the tokens that end a complete output; pin: page-locked host masks (CUDA),
        so that their copy to the device does not wait on the host."""
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.pin = pin
        self.matchers: dict = {}  # request id -> xgrammar.GrammarMatcher
        self.tails: dict[str, Tail] = {}  # request id -> its output's unfinished UTF-8 character
        self._compiler = None
        self._utf8: Utf8Tails | None = None  # made with the compiler
        self._bitmask: torch.Tensor | None = None  # grown to the most rows seen

    @staticmethod
    def needed(sampling: list[ScheduledRequest]) -> bool:
        return any(r.params.structured_output is not None for r in sampling)

    def masks(self, sampling: list[ScheduledRequest]) -> GrammarMasks:
        """The masks of the sampling requests that have a grammar (call when `needed`)."""
        rows = [row for row, r in enumerate(sampling) if r.params.structured_output is not None]
        bitmask = self._bitmask_rows(len(rows))
        rows_np = bitmask.numpy()  # the same memory
        errors = {}
        for index, row in enumerate(rows):
            try:
                request_id = sampling[row].request_id
                self._matcher(sampling[row]).fill_next_token_bitmask(bitmask, index)
                self._utf8.narrow(rows_np[index], self.tails[request_id])
            except (ValueError, RuntimeError, OSError) as error:
                errors[row] = f"structured output: {error}"
        return GrammarMasks(bitmask, rows, errors)

    def accept(
        self, sampling: list[ScheduledRequest], masks: GrammarMasks, token_ids: list[int]
    ) -> dict[int, str]:
        """Advance each matcher by its row's sampled token; rows whose token it refuses."""
        refused = {}
        for row in masks.rows:
            if row in masks.errors or token_ids[row] < 0:
                continue
            request_id = sampling[row].request_id
            if not self.matchers[request_id].accept_token(token_ids[row]):
                refused[row] = f"structured output: the grammar refused token {token_ids[row]}"
            self.tails[request_id] = self._utf8.after(self.tails[request_id], token_ids[row])
        return refused

    def free(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.matchers.pop(request_id, None)
            self.tails.pop(request_id, None)

    def _matcher(self, request: ScheduledRequest):
        matcher = self.matchers.get(request.request_id)
        if matcher is not None:
            return matcher
        import xgrammar

        compiled = self._compile(request.params.structured_output)
        matcher = xgrammar.GrammarMatcher(compiled)
        tail = CLOSED
        for token_id in request.grammar_token_ids or ():
            if not matcher.accept_token(token_id):
                raise ValueError(f"the tokens generated so far do not match (token {token_id})")
            tail = self._utf8.after(tail, token_id)
        self.matchers[request.request_id] = matcher
        self.tails[request.request_id] = tail
        return matcher

    def _compile(self, structured):
        if self._compiler is None:
            self._compiler = self._new_compiler()
        return structured.compile(self._compiler)

    def _new_compiler(self):
        """An xgrammar compiler over the checkpoint's tokenizer (its cache keeps each grammar
        compiled once per runner); the tokenizer's end-of-text ids join the model's."""
        if self.tokenizer_path is None:
            raise ValueError("this model has no tokenizer, which a grammar needs")
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        from rayinfer.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(self.tokenizer_path)
        self.eos_token_ids = sorted(set(self.eos_token_ids) | tokenizer.eos_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend),
            vocab_size=self.vocab_size,
            stop_token_ids=self.eos_token_ids,
        )
        self._utf8 = Utf8Tails(info.decoded_vocab, self.vocab_size)
        return xgrammar.GrammarCompiler(info)

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        words = -(-self.vocab_size // 32)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.empty(num_rows, words, dtype=torch.int32, pin_memory=self.pin)
        return self._bitmask[:num_rows]
