#!/usr/bin/env python3
"""Writes a llama-shaped Hugging Face checkpoint with random bf16 weights (config.json and
model.safetensors) for memory and speed checks. Python's standard library only: the bf16 values
are random bytes whose high byte is remapped to a small exponent (magnitudes near 0.01, either
sign), so no weight is NaN, infinite or large.

usage: make_checkpoint.py DIR [--hidden 1024] [--layers 12] [--heads 16] [--kv-heads 4]
                              [--intermediate 2816] [--vocab 32000]
"""

import argparse
import json
import os
import struct


def bf16_random(count):
    data = bytearray(os.urandom(2 * count))
    # High byte: sign, then the top 7 exponent bits. 0x3c keeps the exponent at 120 or 121
    # (the low exponent bit is the low byte's top bit): |x| in [2^-7, 2^-5).
    table = bytes((b & 0x80) | 0x3C for b in range(256))
    data[1::2] = bytes(data[1::2]).translate(table)
    return bytes(data)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    a = p.parse_args()
    d, hd = a.hidden, a.hidden // a.heads
    shapes = [("model.embed_tokens.weight", [a.vocab, d]), ("model.norm.weight", [d])]
    for i in range(a.layers):
        pre = f"model.layers.{i}."
        shapes += [
            (pre + "input_layernorm.weight", [d]),
            (pre + "post_attention_layernorm.weight", [d]),
            (pre + "self_attn.q_proj.weight", [a.heads * hd, d]),
            (pre + "self_attn.k_proj.weight", [a.kv_heads * hd, d]),
            (pre + "self_attn.v_proj.weight", [a.kv_heads * hd, d]),
            (pre + "self_attn.o_proj.weight", [d, a.heads * hd]),
            (pre + "mlp.gate_proj.weight", [a.intermediate, d]),
            (pre + "mlp.up_proj.weight", [a.intermediate, d]),
            (pre + "mlp.down_proj.weight", [d, a.intermediate]),
        ]
    header, offset = {}, 0
    for name, shape in shapes:
        size = 2
        for s in shape:
            size *= s
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(a.dir, exist_ok=True)
    with open(os.path.join(a.dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in shapes:
            count = 1
            for s in shape:
                count *= s
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                f.write(struct.pack("<H", 0x3F80) * count)  # bf16 1.0
            else:
                f.write(bf16_random(count))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": d,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": hd,
        "intermediate_size": a.intermediate,
        "vocab_size": a.vocab,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(a.dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    params = offset // 2
    print(f"{a.dir}: {params / 1e6:.1f}M parameters, {offset / 2**20:.1f} MiB of bf16 weights")


if __name__ == "__main__":
    main()
