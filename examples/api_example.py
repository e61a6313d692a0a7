"""Generate with the Python API: lossless verify decoding, greedy and sampled.

    python examples/api_example.py
    python examples/api_example.py --model path/to/model-folder --heads path/to/heads

By default the heads shipped with the named model are used (trained ones
ship for Qwen2.5-Coder-0.5B-Instruct); for other models ``--heads init``
gives untrained heads: the text is the backbone's own all the same (verify is
lossless), only fewer drafts are accepted per backbone pass.
"""

import argparse

from clp_mlx import generate, load, stream_generate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: qwen2.5-coder-0.5b-instruct")
    p.add_argument("--heads", default=None, help="a heads folder, or 'init' (default: shipped)")
    args = p.parse_args()

    model, tokenizer, heads = load(args.model, heads=args.heads)
    if heads is None:  # no heads ship with this model
        model, tokenizer, heads = load(args.model, heads="init")
    messages = [{"role": "user", "content": "Write a Python function that checks for palindromes."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    # Greedy: token for token what plain autoregressive decoding writes.
    # verbose streams the text, then prints tokens/s and tokens per backbone pass.
    generate(model, tokenizer, prompt, heads, mode="verify", max_tokens=64, verbose=True)

    # Sampled: speculative sampling keeps the backbone's distribution exactly;
    # the seed fixes the text. stream_generate hands out one Response per token.
    last = None
    for last in stream_generate(
        model, tokenizer, prompt, heads, mode="verify", max_tokens=64, temp=0.7, top_p=0.9, seed=42
    ):
        print(last.text, end="", flush=True)
    s = last.stats
    print(
        f"\n{s.tokens_per_step:.2f} tokens per backbone pass; steps by drafts accepted: {s.accepted}"
    )


if __name__ == "__main__":
    main()
