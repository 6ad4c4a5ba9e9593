"""`python -m rayinfer.bench long_context --config DIR`: one long prompt's prefill and many long
contexts' decode, for a model of random weights (`load_format="dummy"`), against the same model
with dense MLA in the same run.

    python -m rayinfer.bench long_context --config benchmarks/configs/glm-5-4layer \\
        --lengths 32768 131072 --dense-lengths 32768 131072 --decode-batch 16 \\
        --decode-context 131072 --json out.json

For a DSA checkpoint (DeepSeek-V3.2, GLM-5) the dense twin is the same config as
DeepseekV3ForCausalLM: the same MLA and experts without the indexer, every query attending to
its whole context. Each prompt is a fresh random one (no prefix cache); prefill seconds run from
adding the request to its first token; decode is the median engine step once every sequence
decodes (ms per token for the batch, and tokens/s).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rayinfer import LLM, SamplingParams
from rayinfer.config import DSA_ARCHITECTURES

INDEXER_KEYS = ("index_head_dim", "index_n_heads", "index_topk", "indexer_types")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench long_context")
    parser.add_argument("--config", required=True, help="a folder with config.json")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument(
        "--dense-lengths", type=int, nargs="*", default=None,
        help="prompt lengths for the dense-MLA twin (default: --lengths; none: no twin)",
    )  # fmt: skip
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--decode-context", type=int, default=131072)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument(
        "--decode-after-longest", type=int, default=8,
        help="tokens decoded after the longest prompt (ms per token at that context; 0: none)",
    )  # fmt: skip
    parser.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--fp8-weights", action="store_true",
                        help="dense projections and experts in FP8 with 128x128 block scales "
                        "(random weights quantized at load)")  # fmt: skip
    parser.add_argument("--json", default=None, help="write the results to this file")
    return parser.parse_args(argv)


def dense_twin(config_dir: Path, folder: Path) -> Path:
    """config.json of the same model as DeepseekV3ForCausalLM (no indexer) in `folder`."""
    hf = json.loads((config_dir / "config.json").read_text())
    for key in INDEXER_KEYS:
        hf.pop(key, None)
    hf.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    return folder


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def synchronize(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def run_requests(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """Prefill seconds (until every request has its first token) and each later step's
    seconds (every request decoding)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    produced: dict[str, int] = {}
    prefill_s, decode_steps = None, []
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        synchronize(llm)
        now = time.perf_counter()
        for output in outputs:
            produced[output.request_id] = len(output.token_ids)
        if prefill_s is None:
            if len(produced) == len(prompts) and min(produced.values()) >= 1:
                prefill_s = now - start
        else:
            decode_steps.append(now - step_start)
    return {"prefill_s": prefill_s, "decode_step_s": decode_steps}


def measure(llm: LLM, args, lengths: list[int]) -> dict:
    vocab = llm.model_config.vocab_size
    run_requests(llm, [random_prompt(min(args.chunk, 4096), vocab, 0)], 4)  # warm-up
    prefill = []
    for i, length in enumerate(lengths):
        tokens = args.decode_after_longest + 1 if length == max(lengths) else 1
        result = run_requests(llm, [random_prompt(length, vocab, 10 + i)], tokens)
        entry = {"tokens": length, "seconds": result["prefill_s"]}
        entry["input_tokens_per_s"] = length / result["prefill_s"]
        if result["decode_step_s"]:
            entry["decode_ms_per_token"] = 1e3 * statistics.median(result["decode_step_s"])
        prefill.append(entry)
        print(f"  prefill {length:>8} tokens: {entry['seconds']:8.2f} s "
              f"{entry['input_tokens_per_s']:10.0f} tok/s"
              + (f"   decode {entry['decode_ms_per_token']:.2f} ms/token"
                 if "decode_ms_per_token" in entry else ""), flush=True)  # fmt: skip
    decode = None
    if args.decode_batch:
        prompts = [
            random_prompt(args.decode_context, vocab, 100 + i) for i in range(args.decode_batch)
        ]
        result = run_requests(llm, prompts, args.decode_tokens + 1)
        step = statistics.median(result["decode_step_s"])
        decode = {
            "batch": args.decode_batch,
            "context": args.decode_context,
            "ms_per_step": 1e3 * step,
            "output_tokens_per_s": args.decode_batch / step,
        }
        print(f"  decode batch {args.decode_batch} at {args.decode_context} tokens: "
              f"{decode['ms_per_step']:.2f} ms/step {decode['output_tokens_per_s']:.0f} tok/s",
              flush=True)  # fmt: skip
    return {"prefill": prefill, "decode": decode}


def build(folder: Path, args, lengths: list[int]) -> LLM:
    longest = max([*lengths, args.decode_context if args.decode_batch else 0])
    max_model_len = longest + max(args.decode_tokens, args.decode_after_longest) + 16
    tokens = max(max_model_len, args.decode_batch * (args.decode_context + args.decode_tokens + 16))
    return LLM(
        str(folder),
        device=args.device,
        dtype=args.dtype,
        load_format="dummy",
        max_model_len=max_model_len,
        max_num_batched_tokens=args.chunk,
        max_num_seqs=max(args.decode_batch, 1),
        block_size=args.block_size,
        num_kv_blocks=-(-tokens // args.block_size) + args.decode_batch + 2,
        enable_prefix_caching=False,
        fp8_weights=args.fp8_weights,
    )


def allocated_cache_bytes(llm: LLM) -> dict | None:
    """The KV cache as allocated (in-process engines): bytes per token of the paged cache (every
    layer's rows over all its slots) and the window pool's total bytes (DeepSeek-V4)."""
    runner = getattr(llm.engine.executor, "runner", None)
    if runner is None or runner.kv_cache is None:
        return None
    cache = runner.kv_cache
    slots = cache.layers[0].shape[0] * cache.block_size
    return {
        "paged_bytes_per_token": sum(t.nbytes for t in cache.layers) // slots,
        "window_pool_bytes": sum(t.nbytes for t in cache.window_layers),
    }


def release(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    config_dir = Path(args.config)
    results = {"config": str(config_dir), "machine": platform.node(), "args": vars(args)}
    llm = build(config_dir, args, args.lengths)
    name = llm.model_config.architecture
    print(f"{name} ({config_dir}) on {llm.device}", flush=True)
    cache = allocated_cache_bytes(llm)
    if cache:
        print(f"  KV cache as allocated: {cache['paged_bytes_per_token']} B/token paged, window "
              f"pool {cache['window_pool_bytes'] / 2**20:.1f} MiB", flush=True)  # fmt: skip
    results["model"] = {"architecture": name, "kv_cache": cache,
                        **measure(llm, args, args.lengths)}  # fmt: skip
    if torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name()
    release(llm)
    dense_lengths = args.lengths if args.dense_lengths is None else args.dense_lengths
    if name in DSA_ARCHITECTURES and (dense_lengths or args.decode_batch):
        with tempfile.TemporaryDirectory() as folder:
            twin = build(dense_twin(config_dir, Path(folder)), args, dense_lengths or [4096])
            print("dense MLA twin (DeepseekV3ForCausalLM)", flush=True)
            results["dense"] = measure(twin, args, dense_lengths or [4096])
            release(twin)
        results["ratios"] = ratios(results["model"], results["dense"])
        for key, value in results["ratios"].items():
            print(f"  DSA / dense {key}: {value:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def ratios(sparse: dict, dense: dict) -> dict:
    """Prefill speed-ups at each length both ran, and the decode speed-up."""
    out = {}
    dense_by_length = {entry["tokens"]: entry for entry in dense["prefill"]}
    for entry in sparse["prefill"]:
        other = dense_by_length.get(entry["tokens"])
        if other:
            out[f"prefill {entry['tokens']}"] = other["seconds"] / entry["seconds"]
    if sparse["decode"] and dense["decode"]:
        out["decode tok/s"] = (
            sparse["decode"]["output_tokens_per_s"] / dense["decode"]["output_tokens_per_s"]
        )
    return out
