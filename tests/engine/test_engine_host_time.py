"""benchmarks/engine_host_time.py: the stubbed executor keeps the engine decoding (every running
sequence gets a token per step), so the timed steps are decode steps."""

from tests.benchmark_scripts import load_benchmark


def test_the_harness_engine_decodes_every_sequence_each_step():
    engine = load_benchmark("engine_host_time").decoding_engine(batch=4, steps=3)
    before = [len(s.output_token_ids) for s in engine.scheduler.running]
    outputs = engine.step()
    assert len(engine.scheduler.running) == 4 and len(outputs) == 4
    assert [len(s.output_token_ids) for s in engine.scheduler.running] == [n + 1 for n in before]
