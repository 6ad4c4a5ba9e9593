"""The text of a stream resumed on another replica, as the first replica would have gone on.

A stream whose replica died goes on elsewhere from the tokens the client received: they join
the prompt there, so that replica's detokenizer and stop strings know nothing of them. Its own
text would drop what the first replica still held back at the cut (part of a character, or the
start of a possible stop string) and miss a stop string spanning the cut. So the ingress keeps
the request's text itself once resumed: a RequestState (engine/request_state.py, the engine's
own detokenization and stop rules) seeded with the original prompt and the received tokens, and
told how much of their text the client already has; every resumed token goes through it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rayinfer.deployments.types import Delta
from rayinfer.engine.request_state import RequestState
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine.sequence import Sequence


@dataclass(frozen=True)
class TextRules:
    """What the ingress needs to detokenize and stop a request as its engines do."""

    tokenizer: object
    eos_token_ids: frozenset[int]
    max_model_len: int


class ResumedText:
    def __init__(
        self,
        rules: TextRules,
        prompt_ids: list[int],
        params: SamplingParams,
        sent_ids: list[int],
        sent_text: str,
    ):
        """params: the request's own (max_tokens counting the sent tokens); sent_ids and
        sent_text: what the client has received."""
        self.rules = rules
        self.state = RequestState(Sequence("resumed", list(prompt_ids), params), rules.tokenizer)
        for token_id in sent_ids:
            self._append(token_id)
        self.state.mark_reported(min(len(sent_text), len(self.state.text)))

    def next(self, delta: Delta) -> Delta:
        """The resumed replica's delta with the text the first replica would have sent, and the
        finish where its rules end the request (a stop string across the cut: the tokens after
        the one completing it are dropped)."""
        reason = None
        used = 0
        for token_id in delta.token_ids:
            used += 1
            reason = self._append(token_id)
            if reason is not None:
                break
        if reason is None and delta.finish_reason is not None:
            reason = delta.finish_reason  # one the rules cannot see (the engine's own)
            self.state.stop_reason = delta.stop_reason
            if self.state.detokenizer is not None:
                self.state.text += self.state.detokenizer.flush()
        if reason is not None:
            self.state.finish(reason)
        output = self.state.take_output()
        logprobs = delta.logprobs[:used] if delta.logprobs is not None else None
        return replace(delta, text=output.new_text, token_ids=delta.token_ids[:used],
                       finish_reason=reason, logprobs=logprobs,
                       stop_reason=output.stop_reason)  # fmt: skip

    def _append(self, token_id: int) -> str | None:
        rules = self.rules
        return self.state.append_token(token_id, rules.eos_token_ids, rules.max_model_len)
