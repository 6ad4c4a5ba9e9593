"""vLLM's `bad_words`: each word's token sequences, and the tokens a step may not sample for them.

A word (its leading spaces stripped) is banned as the tokens it encodes to alone, and also as
those of " " + word when that starts with another token but has as many (the word after a space,
for tokenizers that fold the space into the word's first token). A one-token sequence can never
be sampled; a longer one's last token is masked whenever the generated tokens end with the ones
before it. Only generated tokens count, not the prompt's, as in vLLM.

The engine computes the masked tokens of each step from the request's output (so preemption and
the prefill -> decode hand-off need nothing more) and sends them with min_tokens' suppressed ones.
"""

from __future__ import annotations

from dataclasses import replace

from rayinfer.engine.sampling_params import InvalidRequestError, SamplingParams

MAX_BAD_WORD_SEQUENCES = 128  # token sequences per request, as vLLM's VLLM_MAX_NUM_BAD_WORDS


def tokenize_bad_words(words: tuple[str, ...], tokenizer) -> tuple[tuple[int, ...], ...]:
    """The token sequences that ban `words` (tokenizer: engine/tokenizer.py's)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise InvalidRequestError("bad_words", f"{word!r} encodes to no token")
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORD_SEQUENCES:
            raise InvalidRequestError(
                "bad_words",
                f"more than {MAX_BAD_WORD_SEQUENCES} token sequences (each word gives one or "
                "two); send fewer words",
            )
    return tuple(sequences)


def with_bad_words_tokenized(params: SamplingParams, tokenizer) -> SamplingParams:
    """params with bad_words_token_ids filled, unless it has no bad_words or already has them."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    if tokenizer is None:
        raise InvalidRequestError(
            "bad_words", "this model has no tokenizer to turn the words into tokens"
        )
    return replace(params, bad_words_token_ids=tokenize_bad_words(params.bad_words, tokenizer))


def completing_tokens(
    sequences: tuple[tuple[int, ...], ...], output_token_ids: list[int]
) -> tuple[int, ...]:
    """The last token of every sequence whose other tokens the output ends with."""
    num_output = len(output_token_ids)
    masked = []
    for sequence in sequences:
        prefix = len(sequence) - 1
        if prefix == 0 or (
            prefix <= num_output and tuple(output_token_ids[num_output - prefix :]) == sequence[:-1]
        ):
            masked.append(sequence[-1])
    return tuple(masked)
