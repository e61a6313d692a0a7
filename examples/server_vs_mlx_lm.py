"""Time clp-mlx's server against mlx_lm.server on the same prompts, with the
openai client: streamed greedy chat, requests interleaved, tokens/s from the
first streamed token to the last. Start both servers first, e.g.:

    python -m clp_mlx.server --model FOLDER --port 8765
    python -c "import clp_mlx, sys; sys.argv[1:] = ['--model', 'FOLDER', '--port', '8766']; \\
        from mlx_lm.server import main; main()"      # mlx-lm with the same BLAS
    python examples/server_vs_mlx_lm.py --repeats 2
"""

import argparse
import json
import statistics
import time

import openai


def run(client, model, prompt, max_tokens):
    first, text, n = None, "", 0
    for ch in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
    ):  # fmt: skip
        if ch.choices and ch.choices[0].delta.content:
            first = first or time.perf_counter()
            text += ch.choices[0].delta.content
        if ch.usage:
            n = ch.usage.completion_tokens
    return text, n / (time.perf_counter() - first)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ours", default="http://127.0.0.1:8765/v1")
    p.add_argument("--theirs", default="http://127.0.0.1:8766/v1")
    p.add_argument("--prompts", nargs="+", default=["examples/code_edits.jsonl", "examples/instructions.jsonl"])
    p.add_argument("--per-file", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    prompts = []
    for path in args.prompts:
        rows = [json.loads(line) for line in open(path)]
        prompts += [r["prompt"] for r in rows if "prompt" in r][: args.per_file]
    servers = {"clp-mlx": (args.ours, "default"), "mlx_lm.server": (args.theirs, "default_model")}
    clients = {k: (openai.OpenAI(base_url=u, api_key="-", max_retries=0, timeout=600), m)
               for k, (u, m) in servers.items()}  # fmt: skip
    for client, model in clients.values():
        run(client, model, "hello", 8)  # warm-up
    rates, texts = {k: [] for k in clients}, {}
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for name, (client, model) in clients.items():
                text, rate = run(client, model, prompt, args.max_tokens)
                rates[name].append(rate)
                texts.setdefault(i, {})[name] = text
    for name, v in rates.items():
        print(f"{name}: median {statistics.median(v):.2f} tokens/s (min {min(v):.2f}, max {max(v):.2f})")
    ratios = [a / b for a, b in zip(rates["clp-mlx"], rates["mlx_lm.server"])]
    same = sum(len(set(t.values())) == 1 for t in texts.values())
    print(f"per-request ratio: median {statistics.median(ratios):.3f}x "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); identical texts {same}/{len(texts)}")  # fmt: skip


if __name__ == "__main__":
    main()
