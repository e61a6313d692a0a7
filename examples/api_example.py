"""Generate with the Python API, in mlx-lm's shape: greedy and sampled verify.

    python examples/api_example.py
    python examples/api_example.py --model path/to/model-folder --drafter path/to/heads

``load`` returns ``(model, tokenizer)`` as mlx-lm's does; the drafter made for
these weights (shipped for Qwen2.5-Coder-0.5B/1.5B-Instruct, or yours in
``~/.cache/clp_mlx/drafters``) rides on the model. Without one, verify drafts
from the context alone: the text is the backbone's own all the same (verify is
lossless), only fewer drafts are accepted per backbone pass.
"""

import argparse

from clp_mlx import generate, load, stream_generate
from clp_mlx.sample_utils import make_sampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: qwen2.5-coder-0.5b-instruct")
    p.add_argument("--drafter", default=None, help="a heads folder, 'init' or 'none'")
    args = p.parse_args()

    model, tokenizer = load(args.model, drafter=args.drafter)
    messages = [{"role": "user", "content": "Write a Python function that checks for palindromes."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    # Greedy: token for token what plain autoregressive decoding writes.
    # verbose streams the text, then prints tokens/s and tokens per backbone pass.
    generate(model, tokenizer, prompt, max_tokens=64, verbose=True)

    # Sampled: speculative sampling keeps the backbone's distribution exactly.
    # stream_generate hands out one response per token, with mlx-lm's fields.
    sampler = make_sampler(temp=0.7, top_p=0.9, seed=42)
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=64, sampler=sampler):
        print(last.text, end="", flush=True)
    s = last.stats
    print(
        f"\n{s.tokens_per_step:.2f} tokens per backbone pass; steps by drafts accepted: {s.accepted}"
    )


if __name__ == "__main__":
    main()
