"""A running request's output holds a view of its generated tokens, not a copy per step: it reads
as the tokens at the time of the output even after more are generated, compares equal to lists,
and pickles as a plain list; a finished request's output holds a list."""

import pickle

from rayinfer.engine.outputs import GeneratedTokens
from rayinfer.engine.request_state import RequestState
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine.sequence import Sequence


def test_view_keeps_the_prefix_of_the_growing_list():
    generated = [5, 6, 7]
    view = GeneratedTokens(generated, 2)
    generated.append(8)
    assert len(view) == 2 and list(view) == [5, 6] and view[-1] == 6 and view[0:1] == [5]
    assert view == [5, 6] and [5, 6] == view and view != [5, 6, 7] and view == (5, 6)
    assert repr(view) == "[5, 6]" and 7 not in view
    assert pickle.loads(pickle.dumps(view)) == [5, 6]
    assert type(pickle.loads(pickle.dumps(view))) is list
    tokens = [1]
    tokens += view
    assert tokens == [1, 5, 6]


def test_running_outputs_view_and_finished_outputs_copy():
    state = RequestState(Sequence("r", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert state.append_token(10, set(), 100) is None
    running = state.take_output()
    assert isinstance(running.token_ids, GeneratedTokens) and running.new_token_ids == [10]
    assert state.append_token(11, set(), 100) is None
    assert running.token_ids == [10]  # still the tokens of its step
    assert state.append_token(12, set(), 100) == "length"
    state.finish("length")
    final = state.take_output()
    assert type(final.token_ids) is list and final.token_ids == [10, 11, 12]
    assert final.new_token_ids == [11, 12]
