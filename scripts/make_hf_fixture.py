#!/usr/bin/env python3
"""Writes a tiny Hugging Face checkpoint of one model family with random weights, and the logits
transformers computes for it, as a test fixture (tests/fixtures/hf-tiny/NAME):

- config.json and model.safetensors (f32 weights, saved by save_pretrained);
- golden.safetensors: input_ids int64 [1, T]; logits f32 [1, T, V] (eager, one full forward);
  logits_incremental f32 [1, T, V] (the first PREFILL tokens with a cache, then one token at a
  time);
- an entry in tests/fixtures/hf-tiny/manifest.json (what was made, and how far the incremental
  logits are from the full forward's in transformers itself).

Weights are normal(0, 0.1), and every norm weight 1 + normal(0, 0.3) (so a norm read wrongly
shows in the logits). Needs PyTorch and transformers (scripts/setup-torch.sh, then
`pip install transformers`).

usage: make_hf_fixture.py NAME   (NAME one of the FIXTURES below)
"""

import json
import os
import sys

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "hf-tiny")
T, PREFILL, SEED = 40, 24, 7

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)

# name: (config class, model class, config keys beyond COMMON, notes)
FIXTURES = {
    "qwen3_sliding": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "qwen3: per-head RMSNorm on q and k; layer 0 full attention, layers 1-2 a window of 8",
    ),
    "smollm3_nope": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(num_hidden_layers=4, no_rope_layer_interval=2, pad_token_id=None, bos_token_id=None,
             eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "smollm3: layers 1 and 3 without RoPE (no_rope_layer_interval 2)",
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(num_hidden_layers=2, pad_token_id=0, bos_token_id=None, eos_token_id=None),
        "gemma: GeGLU (tanh GELU), norms of 1 + w, the embedding times sqrt(hidden)",
    ),
    "gemma2_softcap": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
             attn_logit_softcapping=5.0, final_logit_softcapping=3.0, pad_token_id=0,
             bos_token_id=None, eos_token_id=None),
        "gemma2: sandwich norms, attention softcap 5 and final softcap 3, scale 24^-1/2, "
        "layers 0 and 2 a window of 8",
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
             },
             pad_token_id=0, bos_token_id=None, eos_token_id=None),
        "gemma3 text: q/k norms of 1 + w, a RoPE per layer type (linear x2 base 1e5 for full "
        "layers, 1e4 for sliding ones), layers 0 and 1 a window of 8",
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(num_hidden_layers=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "olmo2: norms after attention and the MLP, q/k RMSNorm over the whole projection",
    ),
    "mixtral_moe": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "mixtral: 4 experts, top 2, weights renormalized",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
             norm_topk_prob=False, mlp_only_layers=[1],
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "qwen3_moe: 6 experts of width 48, top 3, weights not renormalized; layer 1 dense",
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(num_hidden_layers=2, embedding_multiplier=3.0, attention_multiplier=0.2,
             residual_multiplier=0.5, logits_scaling=4.0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "granite: embedding x3, attention scale 0.2, residual x0.5, logits / 4",
    ),
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        dict(num_hidden_layers=2, logit_scale=0.5, pad_token_id=0, bos_token_id=None,
             eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "cohere: attention and MLP in parallel on one LayerNorm (no bias), interleaved RoPE, "
        "logits x0.5",
    ),
    "cohere_qk_norm": (
        "CohereConfig",
        "CohereForCausalLM",
        dict(num_hidden_layers=2, logit_scale=0.5, use_qk_norm=True, pad_token_id=0,
             bos_token_id=None, eos_token_id=None,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "cohere with use_qk_norm: a bias-free LayerNorm on each head's q and k, weights per head",
    ),
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(num_hidden_layers=2, sliding_window=8, use_bias=True, pad_token_id=None,
             bos_token_id=None, eos_token_id=None,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "starcoder2: LayerNorms with biases, GELU MLP c_fc/c_proj with biases, biased "
        "attention projections, a window of 8",
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=80, norm_topk_prob=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "qwen2_moe: 4 experts of width 32, top 2 renormalized, a shared expert of width 80 "
        "gated by a sigmoid, q/k/v biases",
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(num_hidden_layers=2, sliding_window=8, pad_token_id=None, bos_token_id=None,
             eos_token_id=None,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.5}),
        "phi3: fused qkv_proj and gate_up_proj, RoPE on half of each head, a window of 8",
    ),
    "phi3_longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(num_hidden_layers=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
             original_max_position_embeddings=32, max_position_embeddings=256,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                              "partial_rotary_factor": 1.0,
                              "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                              "long_factor": [1.0, 1.5, 2.4, 3.9, 6.0, 9.5, 14.0, 21.0]}),
        "phi3 with longrope: short factors while the sequence fits 32 tokens, long ones past it "
        "(the full forward of 40 tokens uses the long ones throughout; the incremental pass "
        "switches at position 32 with the earlier keys cached as rotated), attention factor "
        "sqrt(1 + ln 8 / ln 32)",
    ),
    "deepseek_v2_moe": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(num_hidden_layers=2, num_key_value_heads=4, head_dim=None, kv_lora_rank=32,
             q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=1,
             topk_method="group_limited_greedy", routed_scaling_factor=1.5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "deepseek_v2: MLA; layer 1 a mixture of 8 experts in 4 groups, top 2 within the best "
        "group, weights x1.5, one shared expert",
    ),
    "deepseek_v3_moe": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(num_hidden_layers=2, num_key_value_heads=4, head_dim=8, kv_lora_rank=32,
             q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
             norm_topk_prob=True, routed_scaling_factor=2.5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "deepseek_v3: MLA with factored queries; layer 1 a mixture of 8 experts routed by "
        "sigmoid plus a correction bias within the best 2 of 4 groups, renormalized, x2.5, one "
        "shared expert",
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
             sliding_window=8, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
             eos_token_id=None),
        "gpt-oss: learned sinks, layer 0 a window of 8, 4 experts top 2 behind a biased router "
        "(softmax of the chosen logits), clamped SwiGLU, YaRN x32 with truncate = false",
    ),
    "gpt_oss_mxfp4": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(_mxfp4=True, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
             intermediate_size=32, sliding_window=8, tie_word_embeddings=False, pad_token_id=None,
             bos_token_id=None, eos_token_id=None),
        "gpt-oss with its experts stored as OpenAI's checkpoints store them: MXFP4 blocks and "
        "scales (random), the logits those dequantize to (transformers' "
        "convert_moe_packed_tensors)",
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(num_hidden_layers=2, num_key_value_heads=None, head_dim=None, use_parallel_residual=True,
             pad_token_id=None, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.25}),
        "gpt_neox: its own tensor names, q, k, v fused head by head, attention and MLP in "
        "parallel with a LayerNorm each, RoPE on a quarter of each head, the exact GELU",
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        # bloom's own keys only: COMMON's llama keys would land in its config.json unused.
        dict(_common=False, vocab_size=256, hidden_size=96, n_layer=2, n_head=6,
             layer_norm_epsilon=1e-5, pad_token_id=None, bos_token_id=None, eos_token_id=None),
        "bloom: ALiBi over 6 heads (not a power of 2), a LayerNorm on the embedding, q, k, v fused head by head, biases, "
        "the tanh GELU, tied embedding",
    ),
    "helium": (
        "HeliumConfig",
        "HeliumForCausalLM",
        dict(num_hidden_layers=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "helium: llama's layers with RoPE on interleaved pairs",
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_hidden_layers=2, sliding_window=8,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "mistral: a window of 8 on every layer",
    ),
    "deepseek_v3_halves": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(num_hidden_layers=2, num_key_value_heads=4, head_dim=8, kv_lora_rank=32,
             q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             first_k_dense_replace=2, rope_interleave=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "deepseek_v3 with rope_interleave false: the rotary dims rotate as halves (rotate_half), "
        "not as interleaved pairs; dense MLPs",
    ),
    "phi3_longrope_top": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(num_hidden_layers=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
             original_max_position_embeddings=32, max_position_embeddings=256,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                              "partial_rotary_factor": 1.0,
                              "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                              "long_factor": [1.0, 1.5, 2.4, 3.9, 6.0, 9.5, 14.0, 21.0]},
             _saved_config={("rope_parameters", "original_max_position_embeddings"): 64}),
        "phi3 with longrope whose config.json gives original_max_position_embeddings twice: 32 at "
        "the top, 64 in rope_parameters; transformers takes the top-level 32",
    ),
    "llama_yarn_top": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_hidden_layers=2, original_max_position_embeddings=16,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 16},
             _saved_config={("rope_parameters", "original_max_position_embeddings"): 64}),
        "llama with YaRN (factor 4) whose config.json gives original_max_position_embeddings "
        "twice: 16 at the top, 64 in rope_parameters; transformers takes the top-level 16",
    ),
    "qwen2_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "qwen2: q/k/v biases; layers 0-1 full attention, layer 2 a window of 8",
    ),
}


def randomize(model):
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name:
                p.copy_((1.0 + 0.3 * noise).to(p.dtype))
            elif name.endswith("sinks"):
                p.copy_(noise.to(p.dtype))
            else:
                p.copy_((0.1 * noise).to(p.dtype))
        # DeepSeek-V3's router correction bias is a saved buffer, not a parameter.
        for name, b in sorted(model.named_buffers()):
            if "e_score_correction_bias" in name:
                noise = torch.randn(b.shape, generator=g, dtype=torch.float64)
                b.copy_((0.1 * noise).to(b.dtype))


def pack_experts(model):
    """Random MXFP4 blocks and scales for every layer's experts, the model's expert weights set
    to what they dequantize to; returns the packed tensors by checkpoint name."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(SEED + 2)
    packed = {}
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for proj in ["gate_up_proj", "down_proj"]:
            weight = getattr(experts, proj)
            e, cols, rows = weight.shape  # x W form: [experts, in, out]
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            # Exponents around 2^-4: weights of about a tenth, as the other fixtures' are.
            scales = torch.randint(121, 126, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
            with torch.no_grad():
                weight.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            prefix = f"model.layers.{i}.mlp.experts.{proj}"
            packed[prefix + "_blocks"] = blocks
            packed[prefix + "_scales"] = scales
    return packed


def store_packed(out, packed):
    """Replaces the saved experts' weights by their MXFP4 blocks and scales, and says so in
    config.json as OpenAI's checkpoints do."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    for name in packed:
        tensors.pop(name.rsplit("_", 1)[0], None)
    tensors.update(packed)
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def edit_saved_config(out, edits):
    """Sets keys of the saved config.json, each given by its path: what a checkpoint written by
    other tools holds where transformers' own save would have made the values agree."""
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    for path, value in edits.items():
        node = config
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in FIXTURES:
        sys.exit(f"usage: make_hf_fixture.py NAME; NAME one of {', '.join(FIXTURES)}")
    name = sys.argv[1]
    config_class, model_class, keys, notes = FIXTURES[name]
    keys = dict(keys)
    base = COMMON if keys.pop("_common", True) else {}
    mxfp4 = keys.pop("_mxfp4", False)
    saved_config = keys.pop("_saved_config", {})
    config = getattr(transformers, config_class)(**{**base, **keys})
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = getattr(transformers, model_class)(config).eval()
    randomize(model)
    packed = pack_experts(model) if mxfp4 else None
    out = os.path.join(OUT, name)
    model.save_pretrained(out, safe_serialization=True)
    if packed is not None:
        store_packed(out, packed)
    if saved_config:
        edit_saved_config(out, saved_config)

    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, config.vocab_size, (1, T), generator=g)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        step = model(ids[:, :PREFILL], use_cache=True)
        parts, cache = [step.logits], step.past_key_values
        for t in range(PREFILL, T):
            step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            parts.append(step.logits)
            cache = step.past_key_values
        incremental = torch.cat(parts, dim=1)
    from safetensors.torch import save_file

    save_file(
        {
            "input_ids": ids.to(torch.int64).contiguous(),
            "logits": full.to(torch.float32).contiguous(),
            "logits_incremental": incremental.to(torch.float32).contiguous(),
        },
        os.path.join(out, "golden.safetensors"),
    )
    if saved_config:
        # transformers must read the edited file as the model it computed the logits of.
        reloaded = getattr(transformers, model_class).from_pretrained(out, attn_implementation="eager")
        with torch.no_grad():
            again = reloaded.eval()(ids, use_cache=False).logits
        assert (again - full).abs().max().item() < 1e-5, "the edited config.json reads differently"
    manifest_path = os.path.join(OUT, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest[name] = {
        "T": T,
        "prefill": PREFILL,
        "hf_class": model_class,
        "notes": notes,
        "made_by": "scripts/make_hf_fixture.py",
        "checks": {
            "logits_abs_max": full.abs().max().item(),
            "max_abs_incremental_vs_full_f32": (incremental - full).abs().max().item(),
        },
        "files": {
            "config": f"{name}/config.json",
            "golden": f"{name}/golden.safetensors",
            "weights": f"{name}/model.safetensors",
        },
    }
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(name, manifest[name]["checks"])


if __name__ == "__main__":
    main()
