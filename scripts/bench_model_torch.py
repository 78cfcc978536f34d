#!/usr/bin/env python3
"""Times a Hugging Face checkpoint in transformers on the CPU, the way `attnc bench-model` times
it in attn: prefill tokens/s for prompts of each length (one forward over the prompt, median of
--reps), and decode tokens/s after a prompt of each context length (the median of --steps single
token steps, each reusing the KV cache). Weights in their stored dtype, SDPA attention. Prints
one JSON object: {"prefill": [{"tokens", "tokens_per_s"}], "decode": [{"context",
"tokens_per_s"}]}.

`attnc bench-model --against-torch` runs this file with a Python that has torch and
transformers (scripts/setup-torch.sh installs torch; pip install transformers).

usage: bench_model_torch.py --model DIR [--prefill 128,512,2048] [--contexts 128,2048]
                            [--steps 16] [--reps 3] [--threads 2]
"""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def token_ids(count, vocab):
    # The same deterministic ids attnc uses: a multiplicative hash of the position.
    return torch.tensor([[(i * 2654435761 + 12345) % vocab for i in range(count)]])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prefill", default="128,512,2048")
    p.add_argument("--contexts", default="128,2048")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype="auto", attn_implementation="sdpa")
    model.eval()
    vocab = model.config.vocab_size
    out = {"prefill": [], "decode": []}
    with torch.inference_mode():
        for n in [int(x) for x in a.prefill.split(",") if x]:
            ids = token_ids(n, vocab)
            model(ids[:, : min(n, 16)])  # warm-up
            times = []
            for _ in range(a.reps):
                start = time.perf_counter()
                model(ids, use_cache=False)
                times.append(time.perf_counter() - start)
            out["prefill"].append({"tokens": n, "tokens_per_s": n / statistics.median(times)})
        for context in [int(x) for x in a.contexts.split(",") if x]:
            ids = token_ids(context + a.steps + 2, vocab)
            result = model(ids[:, :context], use_cache=True)
            cache = result.past_key_values
            times = []
            for i in range(a.steps + 2):
                step = ids[:, context + i : context + i + 1]
                start = time.perf_counter()
                result = model(step, past_key_values=cache, use_cache=True)
                elapsed = time.perf_counter() - start
                cache = result.past_key_values
                if i >= 2:  # two warm-up steps, as attnc takes
                    times.append(elapsed)
            out["decode"].append(
                {"context": context, "tokens_per_s": 1 / statistics.median(times)}
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
