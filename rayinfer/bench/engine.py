"""Offline engine throughput: prefill tokens/s (long prompts, nothing generated beyond the first
token) and decode tokens/s (many sequences generating together)."""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from rayinfer import LLM, SamplingParams


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench engine")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is shown")
    parser.add_argument(
        "--baseline",
        choices=["transformers", "none"],
        default="transformers",
        help="also time transformers on the same checkpoint and prompts (same run)",
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    return parser.parse_args(argv)


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(num)
    ]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def measure(llm: LLM, args) -> dict:
    vocab = llm.model_config.vocab_size
    first_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    llm.generate(random_prompts(2, 16, vocab, seed=0), first_token)  # warm-up
    prefill_times, decode_times = [], []
    for repeat in range(args.repeats):
        # Fresh prompts each run so the prefix cache cannot serve them.
        long_prompts = random_prompts(args.num_prompts, args.prompt_len, vocab, seed=100 + repeat)
        prefill_times.append(timed(lambda p=long_prompts: llm.generate(p, first_token)))
        short_prompts = random_prompts(args.decode_batch, 8, vocab, seed=200 + repeat)
        total = timed(lambda p=short_prompts: llm.generate(p, decode))
        prefill_of_short = timed(lambda p=short_prompts: llm.generate(p, first_token))
        decode_times.append(max(total - prefill_of_short, 1e-9))
    prefill_tokens = args.num_prompts * args.prompt_len
    decode_tokens = args.decode_batch * (args.decode_tokens - 1)
    return {
        "prefill_tokens_per_s": prefill_tokens / median(prefill_times),
        "decode_tokens_per_s": decode_tokens / median(decode_times),
        "prefill_seconds_median": median(prefill_times),
        "decode_seconds_median": median(decode_times),
    }


def measure_transformers(llm: LLM, args) -> dict:
    """transformers on the same weights: one batched forward for prefill, `generate` for decode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llm.model_config.path, dtype=llm.dtype)
    model = model.to(llm.device).eval()
    vocab = llm.model_config.vocab_size

    def ids(num, length, seed):
        return torch.tensor(random_prompts(num, length, vocab, seed), device=llm.device)

    prefill_times, decode_times = [], []
    with torch.inference_mode():
        for repeat in range(args.repeats):
            long_ids = ids(args.num_prompts, args.prompt_len, 100 + repeat)
            prefill_times.append(timed(lambda x=long_ids: model(x, logits_to_keep=1)))
            short = ids(args.decode_batch, 8, 200 + repeat)
            total = timed(
                lambda x=short, n=args.decode_tokens: model.generate(
                    x, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
                )
            )
            first = timed(lambda x=short: model(x, logits_to_keep=1))
            decode_times.append(max(total - first, 1e-9))
    return {
        "prefill_tokens_per_s": args.num_prompts * args.prompt_len / median(prefill_times),
        "decode_tokens_per_s": args.decode_batch * (args.decode_tokens - 1) / median(decode_times),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.prompt_len + 128)
    results = measure(llm, args)
    results.update(
        model=args.model,
        device=str(llm.device),
        dtype=str(llm.dtype).removeprefix("torch."),
        prompt_len=args.prompt_len,
        num_prompts=args.num_prompts,
        decode_batch=args.decode_batch,
        decode_tokens=args.decode_tokens,
        machine=platform.machine(),
        torch_threads=torch.get_num_threads(),
    )
    print(f"model {args.model} on {results['device']} ({results['dtype']})")
    print(
        f"prefill: {results['prefill_tokens_per_s']:10.1f} input tokens/s "
        f"({args.num_prompts} prompts x {args.prompt_len} tokens)"
    )
    print(
        f"decode:  {results['decode_tokens_per_s']:10.1f} output tokens/s "
        f"(batch {args.decode_batch}, {args.decode_tokens} tokens each)"
    )
    if args.baseline == "transformers":
        baseline = measure_transformers(llm, args)
        results["transformers"] = baseline
        for phase in ("prefill", "decode"):
            ours, theirs = results[f"{phase}_tokens_per_s"], baseline[f"{phase}_tokens_per_s"]
            print(
                f"transformers {phase}: {theirs:10.1f} tokens/s   rayinfer/transformers "
                f"{ours / theirs:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
