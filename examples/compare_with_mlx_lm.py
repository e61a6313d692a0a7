"""Check that ar and verify print exactly what mlx_lm.generate prints (greedy).

    python examples/compare_with_mlx_lm.py --model qwen2.5-coder-0.5b-instruct --heads init
"""

import argparse

import clp_mlx  # loads OpenBLAS before mlx (Linux)

from mlx_lm import generate as mlx_lm_generate  # isort: skip

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Robert Boulter is an English film , television and theatre actor .",
    "import numpy as np\n\n# compute the mean of",
    "Once upon a time",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--heads", default="init")
    p.add_argument("-m", "--max-tokens", type=int, default=48)
    args = p.parse_args()
    model, tokenizer, heads = clp_mlx.load(args.model, args.heads)
    failures = 0
    for prompt in PROMPTS:
        ref = mlx_lm_generate(model, tokenizer, prompt, max_tokens=args.max_tokens)
        for mode in ("ar", "verify"):
            ours = clp_mlx.generate(model, tokenizer, prompt, heads, mode=mode, max_tokens=args.max_tokens)
            same = ours == ref
            failures += not same
            print(f"{mode:6} {'same' if same else 'DIFFERENT'}  {prompt[:40]!r} -> {ref[:50]!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
