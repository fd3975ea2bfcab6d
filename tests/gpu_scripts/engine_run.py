"""One engine start for tests/gpu_scripts/engine_check.sh: the engine with its default flags
(tensor-parallel size; MTP or eager where asked), greedy decoding of a fixed prompt set -- short
prompts and one of ~64k tokens -- and the facts the verdict needs, as JSON:

    {"engine": ..., "version": ..., "tokens": [[ids] per prompt], "acceptance": accepted / drafted
     (MTP runs; else null), "reserved_after_capture": [bytes per worker], "reserved_after": [...]}

The plugin is switched on or off by the caller's environment (DSV4_ATTN_VLLM / DSV4_ATTN_SGLANG).
GPU memory is read in each worker (vLLM: collective_rpc, which needs
VLLM_ALLOW_INSECURE_SERIALIZATION=1 to ship a function; set here) right after the engine started --
its CUDA graphs captured -- and after generating.
"""

from __future__ import annotations

import argparse
import json
import os

MAX_TOKENS = 64
SHORT_PROMPTS = [
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List the first ten prime numbers:",
    "Translate to German: The weather is nice today, so we will walk to the lake.",
    "def quicksort(xs):",
]


def long_prompt(approx_tokens: int = 64_000) -> str:
    """~``approx_tokens`` tokens of numbered facts and a question about one in the middle (the same
    text at every run: no randomness)."""
    lines, i = [], 0
    while len(lines) * 12 < approx_tokens:  # ~12 tokens per line
        lines.append(f"Fact {i}: the locker numbered {i} holds {(i * 7919) % 10007} marbles.")
        i += 1
    middle = i // 2
    return "\n".join(lines) + f"\nQuestion: how many marbles does locker {middle} hold? Answer:"


def prompts() -> list[str]:
    return SHORT_PROMPTS + [long_prompt()]


def run_vllm(args) -> dict:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import vllm
    from vllm import LLM, SamplingParams

    kwargs: dict = {"model": args.model, "tensor_parallel_size": args.tp}
    if args.eager:
        kwargs["enforce_eager"] = True
    if args.mtp:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.mtp}
    llm = LLM(**kwargs)

    def reserved(_worker=None) -> int:
        import torch

        return torch.cuda.memory_reserved()

    after_capture = llm.collective_rpc(reserved)
    outputs = llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    after = llm.collective_rpc(reserved)
    acceptance = None
    if args.mtp:
        counts = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        drafted = counts.get("vllm:spec_decode_num_draft_tokens") or 0
        acceptance = counts.get("vllm:spec_decode_num_accepted_tokens", 0) / drafted if drafted else None
    return {"engine": "vllm", "version": vllm.__version__, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "acceptance": acceptance, "reserved_after_capture": after_capture, "reserved_after": after}


def run_sglang(args) -> dict:
    import sglang
    from sglang.srt.entrypoints.engine import Engine

    kwargs: dict = {"model_path": args.model, "tp_size": args.tp}
    if args.eager:
        kwargs["disable_cuda_graph"] = True
    if args.mtp:
        kwargs.update(speculative_algorithm="EAGLE", speculative_num_steps=args.mtp,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=args.mtp + 1)
    engine = Engine(**kwargs)
    outputs = engine.generate(prompts(), {"temperature": 0.0, "max_new_tokens": MAX_TOKENS})
    acceptance = None
    if args.mtp:  # tokens per verify step: 1 + accepted drafts
        verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outputs)
        made = sum(o["meta_info"]["completion_tokens"] for o in outputs)
        acceptance = (made / verify - 1) / args.mtp if verify else None
    engine.shutdown()
    # SGLang exposes no per-worker allocator figure: the memory check uses the plugin's warning only
    return {"engine": "sglang", "version": sglang.__version__, "tokens": [o["output_ids"] for o in outputs],
            "acceptance": acceptance, "reserved_after_capture": None, "reserved_after": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--mtp", type=int, default=0, help="speculative tokens (0: no MTP)")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = (run_vllm if args.engine == "vllm" else run_sglang)(args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
