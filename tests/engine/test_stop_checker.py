"""Stop strings: where they cut, and how much text is held back while streaming."""

from rayinfer.engine.stop_checker import find_stop, find_stop_string, streamable_length


def test_finds_the_earliest_stop_string_across_the_search_boundary():
    assert find_stop_string("hello world", ("wor", "lo"), search_from=4) == 3
    assert find_stop_string("hello world", ("xyz",), search_from=0) is None


def test_holds_back_a_possible_stop_prefix():
    assert streamable_length("abc</s", ("</stop>",)) == 3
    assert streamable_length("abc", ("</stop>",)) == 3
    assert streamable_length("abc<", ("<|end|>", "\n\n")) == 3


def test_find_stop_gives_the_earliest_match_with_its_end():
    assert find_stop("hello world", ("wor", "lo"), search_from=4) == (3, 5)
    assert find_stop("abcd", ("bcd", "bc"), search_from=0) == (1, 4)  # equal starts: first listed
    assert find_stop("abc", ("x",), search_from=0) is None
