#!/usr/bin/env python3
"""Models resident on a device, checked and timed by scripts/gpu-check.sh:

1. logits of the tiny Hugging Face fixtures (tests/fixtures/hf-tiny) on the device against the
   CPU backend, a full forward and a prefill followed by single-token steps;
2. greedy generation from the tokenizer fixture's prompts against transformers' continuations;
3. decode tokens/s and a 2k-token prefill of a llama-shaped research model (about 1B
   parameters, random weights), next to transformers' `generate` on the same GPU when the
   transformers package is installed (else the comparison is reported as not run).

Needs numpy and safetensors (PyTorch's environment has both). Exit status 1 when a check fails.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf-tiny")


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def logits(attnc, model, tokens, backend, incremental=None):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "logits.safetensors")
        cmd = [attnc, "logits", "--model", model, "--tokens", tokens, "--backend", backend,
               "--output", out]
        if incremental:
            cmd += ["--incremental", str(incremental)]
        run(cmd)
        return load_file(out)["logits"]


def check_logits(attnc, backend):
    ok = True
    tokens = ",".join(str((i * 7 + 3) % 200) for i in range(40))
    for name in ["llama_gqa", "llama_tokenizer"]:
        model = os.path.join(FIXTURES, name)
        for incremental in [None, 24]:
            cpu = logits(attnc, model, tokens, "cpu", incremental)
            dev = logits(attnc, model, tokens, backend, incremental)
            err = float(np.max(np.abs(dev - cpu) / (1 + np.abs(cpu))))
            good = err < 2e-3
            ok &= good
            what = "full" if incremental is None else f"prefill {incremental} + steps"
            print(f"  {'ok  ' if good else 'FAIL'} {name} {what}: max rel diff {err:.2e}")
    return ok


def check_generation(attnc, backend):
    model = os.path.join(FIXTURES, "llama_tokenizer")
    with open(os.path.join(model, "golden_generate.json")) as f:
        golden = json.load(f)["generate"]
    ok = True
    for g in golden:
        p = run([attnc, "generate", "--model", model, "--prompt", g["prompt"],
                 "--max-new-tokens", str(len(g["new_ids"])), "--backend", backend])
        good = p.stdout == g["new_text"] + "\n"
        ok &= good
        print(f"  {'ok  ' if good else 'FAIL'} generate {g['prompt']!r}")
    return ok


LLAMA_1B = """vocab = 32000
hidden = 2048
layers = 16
intermediate = 8192
attention = "heads = 32, kv_heads = 8, head_dim = 64, mask = causal, position = rope(base = 500000.0), dtype = bf16"
"""


def time_attnc(attnc, backend, model, prompt_len, new_tokens):
    tokens = ",".join(str((i * 13 + 1) % 32000) for i in range(prompt_len))
    start = time.time()
    p = run([attnc, "generate", "--model", model, "--tokens", tokens, "--max-new-tokens",
             str(new_tokens), "--backend", backend])
    wall = time.time() - start
    return p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "", wall


def time_transformers(prompt_len, new_tokens):
    try:
        import torch
        import transformers
    except ImportError as e:
        return f"not run ({e})"
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
        attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (1, prompt_len), device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        torch.cuda.synchronize()
        start = time.time()
        model(ids)
        torch.cuda.synchronize()
        prefill = time.time() - start
        start = time.time()
        model.generate(ids[:, :16], max_new_tokens=new_tokens, do_sample=False,
                       min_new_tokens=new_tokens)
        torch.cuda.synchronize()
        decode = new_tokens / (time.time() - start)
    return f"prefill {prompt_len}: {prefill * 1e3:.1f} ms; decode batch 1: {decode:.1f} tokens/s"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attnc", required=True)
    p.add_argument("--backend", default="cuda", choices=["cuda", "gpu-sim"])
    p.add_argument("--skip-timing", action="store_true")
    a = p.parse_args()
    ok = True
    print(f"== models resident on {a.backend}: logits against the CPU backend")
    ok &= check_logits(a.attnc, a.backend)
    print(f"== greedy generation on {a.backend} against transformers' continuations")
    ok &= check_generation(a.attnc, a.backend)
    if not a.skip_timing:
        print("== llama-shaped 1B model (random weights): attnc vs transformers generate")
        with tempfile.TemporaryDirectory() as d:
            model = os.path.join(d, "llama-1b.toml")
            with open(model, "w") as f:
                f.write(LLAMA_1B)
            for prompt_len, new in [(16, 128), (2048, 1)]:
                line, wall = time_attnc(a.attnc, a.backend, model, prompt_len, new)
                print(f"  attnc prompt {prompt_len}, {new} new: {line} (wall {wall:.1f} s)")
        print(f"  transformers: {time_transformers(2048, 128)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
