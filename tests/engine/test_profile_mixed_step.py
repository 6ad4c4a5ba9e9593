"""benchmarks/profile_mixed_step.py: the steps it times each carry a chunk of the new prompt beside
every decode, so its figures are those of mixed steps."""

import rayinfer
from tests.benchmark_scripts import load_benchmark


def test_the_timed_steps_mix_every_decode_with_a_chunk_of_the_prompt():
    script = load_benchmark("profile_mixed_step")
    llm = rayinfer.LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=32,
                       enable_prefix_caching=False)  # fmt: skip
    script.start_decodes(llm, decodes=3, context=40, tokens=64)
    decoding = list(llm.engine.scheduler.running)
    before = [len(s.output_token_ids) for s in decoding]
    walls = script.mixed_steps(llm, "new", prompt=100, run=lambda step: step())
    assert len(walls) == -(-100 // (32 - 3))  # 29 prompt tokens a step beside 3 decodes
    assert [len(s.output_token_ids) for s in decoding] == [n + len(walls) for n in before]
