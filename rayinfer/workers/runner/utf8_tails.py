"""Which tokens keep a byte-level output valid UTF-8, given the unfinished character it ends with.

A grammar constrains characters, yet a byte-level tokenizer's tokens are bytes, and a character
may span tokens. xgrammar 0.2's character classes accept the UTF-8 forms of the surrogates
U+D800..U+DFFF ("\\xed\\xa0\\x80"), which are not UTF-8: their text decodes to three U+FFFD, so a
random-weights model's 6-character name came out as " writ\\ufffd\\ufffd\\ufffd", 8 characters
against the schema's maxLength 6 (tests/workers/test_grammar_ranks.py). A grammar request's mask
is therefore also limited to the tokens that continue its output as valid UTF-8 (RFC 3629: no
surrogates, no overlong forms, nothing past U+10FFFF).

The output's tail is one of 8 states: no character open, or a character open that needs 1-3 more
continuation bytes, the next within a range that depends on the lead byte (E0: A0-BF, ED: 80-9F,
F0: 90-BF, F4: 80-8F, otherwise 80-BF).
"""

from __future__ import annotations

import numpy as np
import torch

Tail = tuple[int, int, int]  # (continuation bytes still needed, lowest next byte, highest)
CLOSED: Tail = (0, 0x80, 0xBF)

# lead byte -> the tail it opens; bytes neither ASCII nor here never start a character.
_LEADS: dict[int, Tail] = {
    **{b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)},
    0xE0: (2, 0xA0, 0xBF),
    **{b: (2, 0x80, 0xBF) for b in (*range(0xE1, 0xED), 0xEE, 0xEF)},
    0xED: (2, 0x80, 0x9F),
    0xF0: (3, 0x90, 0xBF),
    **{b: (3, 0x80, 0xBF) for b in range(0xF1, 0xF4)},
    0xF4: (3, 0x80, 0x8F),
}
TAILS: tuple[Tail, ...] = tuple(
    sorted({CLOSED, (1, 0x80, 0xBF), (2, 0x80, 0xBF), *_LEADS.values()})
)


def extend(tail: Tail, data: bytes) -> Tail | None:
    """The tail after `data` follows `tail`; None when the bytes are not valid UTF-8 there."""
    need, low, high = tail
    for byte in data:
        if need:
            if not low <= byte <= high:
                return None
            need, low, high = need - 1, 0x80, 0xBF
        elif byte >= 0x80:
            opened = _LEADS.get(byte)
            if opened is None:
                return None
            need, low, high = opened
    return (need, low, high)


class Utf8Tails:
    """Per tail, the int32 bitmask (bit j of word w: token 32 * w + j) of the tokens that may
    follow it; the tails of the requests are kept by their owner and advanced with `after`."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        """token_bytes: each token id's bytes as the grammar matches them (xgrammar's
        TokenizerInfo.decoded_vocab); vocab_size: the masks' width in tokens (ids past the
        tokenizer's are never allowed)."""
        self.token_bytes = token_bytes
        words = -(-vocab_size // 32)
        tokens = token_bytes[:vocab_size]
        allowed = np.zeros((len(TAILS), words * 32), dtype=bool)
        # An ASCII token only ever follows a closed tail.
        allowed[TAILS.index(CLOSED), : len(tokens)] = [data.isascii() for data in tokens]
        for token, data in enumerate(tokens):
            if not data.isascii():
                for index, tail in enumerate(TAILS):
                    allowed[index, token] = extend(tail, data) is not None
        packed = np.packbits(allowed, axis=1, bitorder="little").view("<i4")
        self.masks = torch.from_numpy(packed.astype(np.int32))  # [len(TAILS), words]
        # numpy on the host rows: torch's per-call overhead would cost more than the AND at
        # these sizes (benchmarks/grammar_backends.py, xgrammar+utf8)
        self._rows = {tail: row for tail, row in zip(TAILS, self.masks.numpy())}
        self._scratch = np.empty(words, dtype=np.int32)

    def mask(self, tail: Tail) -> torch.Tensor:
        """[words] int32: the tokens that may follow `tail`."""
        return self.masks[TAILS.index(tail)]

    def after(self, tail: Tail, token_id: int) -> Tail:
        """The tail once `token_id` follows; an invalid continuation (only where the mask was
        left wide, see `narrow`) restarts at CLOSED."""
        data = self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""
        return extend(tail, data) or CLOSED

    def narrow(self, row: np.ndarray, tail: Tail) -> None:
        """Limit one grammar bitmask row [words] int32 (a numpy view of the host bitmask) to the
        tokens that may follow `tail`, unless that would allow none (the grammar's own choice
        is then kept)."""
        np.bitwise_and(row, self._rows[tail], out=self._scratch)
        if np.count_nonzero(self._scratch):
            np.copyto(row, self._scratch)
