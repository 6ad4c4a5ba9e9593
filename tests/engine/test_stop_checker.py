"""Stop strings: where they cut, and how much text is held back while streaming; the stop
token's stop_reason."""

import numpy as np

from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine.sequence import Sequence
from rayinfer.engine.stop_checker import (
    find_stop,
    find_stop_string,
    stop_token_reason,
    streamable_length,
)


def test_finds_the_earliest_stop_string_across_the_search_boundary():
    assert find_stop_string("hello world", ("wor", "lo"), search_from=4) == 3
    assert find_stop_string("hello world", ("xyz",), search_from=0) is None


def test_holds_back_a_possible_stop_prefix():
    assert streamable_length("abc</s", ("</stop>",)) == 3
    assert streamable_length("abc", ("</stop>",)) == 3
    assert streamable_length("abc<", ("<|end|>", "\n\n")) == 3


def test_find_stop_gives_the_earliest_match_with_its_end_and_string():
    assert find_stop("hello world", ("wor", "lo"), search_from=4) == (3, 5, "lo")
    found = find_stop("abcd", ("bcd", "bc"), search_from=0)  # equal starts: first listed
    assert (found.start, found.end, found.stop) == (1, 4, "bcd")
    assert find_stop("abc", ("x",), search_from=0) is None


def test_a_listed_stop_token_is_the_stop_reason_and_another_none():
    seq = Sequence("r", [1, 2], SamplingParams(stop_token_ids=[7, 2]), output_token_ids=[5, 7])
    assert stop_token_reason(seq) == 7
    seq.output_token_ids.append(np.int64(2))  # a sampler's integer: a plain int, for JSON
    assert stop_token_reason(seq) == 2 and type(stop_token_reason(seq)) is int
    seq.output_token_ids.append(9)  # not listed: the request ended by EOS
    assert stop_token_reason(seq) is None
