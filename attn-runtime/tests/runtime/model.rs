//! Models loaded from Hugging Face checkpoints against the logits transformers computed: one full
//! forward, and prefill then one token at a time with paged caches.

use attn_runtime::model::hf;
use safetensors::SafeTensors;
use std::path::PathBuf;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/hf-tiny"
    ))
    .join(name)
}

struct Golden {
    tokens: Vec<u32>,
    logits: Vec<f32>,
    incremental: Vec<f32>,
}

fn golden(name: &str) -> Golden {
    let bytes = std::fs::read(dir(name).join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |n: &str| -> Vec<f32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let tokens = st
        .tensor("input_ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    Golden {
        tokens,
        logits: f32s("logits"),
        incremental: f32s("logits_incremental"),
    }
}

fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

fn check(name: &str, prefill: usize) {
    check_on(name, prefill, None);
}

/// [`check`] with the model's attention on `backend` (the CPU backend when `None`).
fn check_on(
    name: &str,
    prefill: usize,
    backend: Option<std::sync::Arc<dyn attn_runtime::backend::Backend>>,
) {
    let mut model = hf::load(&dir(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    if let Some(backend) = backend {
        model.set_backend(backend);
    }
    let g = golden(name);
    let full = model.forward(&g.tokens).unwrap();
    let err = max_diff(&full, &g.logits);
    assert!(err < 1e-4, "{name} full forward: max |diff| {err}");
    let mut session = model.session(g.tokens.len(), 16).unwrap();
    let mut logits = session.step(&g.tokens[..prefill]).unwrap();
    for t in prefill..g.tokens.len() {
        logits.extend(session.step(&g.tokens[t..t + 1]).unwrap());
    }
    let err = max_diff(&logits, &g.incremental);
    assert!(err < 1e-4, "{name} incremental: max |diff| {err}");
}

#[test]
fn llama_gqa_matches_transformers() {
    check("llama_gqa", 24);
}

#[test]
fn deepseek_v2_mla_matches_transformers() {
    check("deepseek_v2_lite_mla", 24);
}

/// qwen3: per-head RMSNorm on q and k before RoPE, and layers that differ (layer 0 full
/// attention, layers 1 and 2 a sliding window of 8 over 40 tokens): two attention kinds.
#[test]
fn qwen3_with_qk_norms_and_sliding_layers_matches_transformers() {
    let config = hf::config(&dir("qwen3_sliding")).unwrap();
    assert_eq!(config.attention.len(), 2);
    assert_eq!(config.pattern, [0, 1, 1]);
    check("qwen3_sliding", 24);
}

/// smollm3: every other layer without RoPE (`no_rope_layers`).
#[test]
fn smollm3_with_layers_without_rope_matches_transformers() {
    let config = hf::config(&dir("smollm3_nope")).unwrap();
    assert_eq!(config.pattern, [0, 1, 0, 1]);
    assert_eq!(config.attention[1].position, attn_dsl::Position::None);
    check("smollm3_nope", 24);
}

/// gemma: GeGLU, RMSNorm of `1 + w`, the embedding times `sqrt(hidden)`.
#[test]
fn gemma_matches_transformers() {
    let config = hf::config(&dir("gemma")).unwrap();
    assert_eq!(config.mlp, attn_runtime::model::MlpKind::GeGlu);
    check("gemma", 24);
}

/// gemma2: sandwich norms, the attention's softcap and scale from the config, a final logit
/// softcap, sliding and full layers alternating.
#[test]
fn gemma2_matches_transformers() {
    let config = hf::config(&dir("gemma2_softcap")).unwrap();
    assert_eq!(config.pattern, [0, 1, 0]);
    assert_eq!(config.attention[0].softcap, Some(5.0));
    assert_eq!(config.final_softcap, Some(3.0));
    check("gemma2_softcap", 24);
}

/// gemma3 (text): q/k norms of `1 + w` and a RoPE per layer type (linear scaling on full
/// layers only).
#[test]
fn gemma3_text_matches_transformers() {
    let config = hf::config(&dir("gemma3_text")).unwrap();
    assert_eq!(config.pattern, [0, 0, 1]);
    let base = |k: usize| config.attention[k].rope().unwrap().base;
    assert_eq!((base(0), base(1)), (10_000.0, 100_000.0));
    check("gemma3_text", 24);
}

/// olmo2: norms after each sublayer, q/k norms over the whole projection.
#[test]
fn olmo2_matches_transformers() {
    check("olmo2", 24);
}

/// mixtral: every layer a mixture of 4 experts, top 2, the chosen weights renormalized.
#[test]
fn mixtral_matches_transformers() {
    let config = hf::config(&dir("mixtral_moe")).unwrap();
    let moe = config.moe.as_ref().unwrap();
    assert_eq!((moe.experts, moe.top_k, moe.normalize), (4, 2, true));
    check("mixtral_moe", 24);
}

/// qwen3_moe: 6 experts, top 3, weights as the softmax gives them; layer 1 dense
/// (`mlp_only_layers`).
#[test]
fn qwen3_moe_matches_transformers() {
    let config = hf::config(&dir("qwen3_moe")).unwrap();
    let moe = config.moe.as_ref().unwrap();
    assert_eq!((moe.top_k, moe.normalize), (3, false));
    assert_eq!(moe.sparse, [true, false, true]);
    check("qwen3_moe", 24);
}

/// granite: embedding, attention, residual and logit multipliers.
#[test]
fn granite_matches_transformers() {
    let config = hf::config(&dir("granite")).unwrap();
    assert_eq!(config.attention[0].scale, Some(0.2));
    assert_eq!(config.logit_multiplier, Some(0.25));
    check("granite", 24);
}

/// cohere: attention and MLP in parallel on one bias-free LayerNorm, interleaved RoPE, a logit
/// scale.
#[test]
fn cohere_matches_transformers() {
    check("cohere", 24);
}

/// starcoder2: LayerNorms with biases, a biased GELU MLP named `c_fc`/`c_proj`, biased
/// attention projections, a sliding window.
#[test]
fn starcoder2_matches_transformers() {
    let config = hf::config(&dir("starcoder2")).unwrap();
    assert!(config.mlp_bias && config.o_bias && config.norm_bias);
    check("starcoder2", 24);
}

/// qwen2_moe: routed experts beside a shared expert gated by a sigmoid.
#[test]
fn qwen2_moe_matches_transformers() {
    let config = hf::config(&dir("qwen2_moe")).unwrap();
    let shared = config.moe.as_ref().unwrap().shared.unwrap();
    assert_eq!((shared.width, shared.gated), (80, true));
    check("qwen2_moe", 24);
}

/// phi3: fused `qkv_proj` and `gate_up_proj` split at load, RoPE on half of each head.
#[test]
fn phi3_matches_transformers() {
    let config = hf::config(&dir("phi3")).unwrap();
    assert_eq!(config.attention[0].rope().unwrap().dim, 8);
    check("phi3", 24);
}

/// deepseek_v2 with MoE: softmax routing within the best groups, a routed scaling factor, a
/// shared expert.
#[test]
fn deepseek_v2_moe_matches_transformers() {
    let config = hf::config(&dir("deepseek_v2_moe")).unwrap();
    let moe = config.moe.as_ref().unwrap();
    assert_eq!(moe.sparse, [false, true]);
    check("deepseek_v2_moe", 24);
}

/// deepseek_v3 with MoE: sigmoid routing with a correction bias within the best groups,
/// renormalized and scaled; factored queries.
#[test]
fn deepseek_v3_moe_matches_transformers() {
    check("deepseek_v3_moe", 24);
}

/// gpt-oss: learned sinks, experts in three-dimensional tensors behind a biased router, the
/// clamped SwiGLU, YaRN with `truncate = false`, sliding and full layers.
#[test]
fn gpt_oss_matches_transformers() {
    let config = hf::config(&dir("gpt_oss")).unwrap();
    assert_eq!(config.attention[0].sinks, attn_dsl::Sinks::Learned);
    check("gpt_oss", 24);
}

/// gpt-oss as OpenAI ships it: experts packed as MXFP4 blocks and scales, dequantized at load.
#[test]
fn gpt_oss_with_mxfp4_experts_matches_transformers() {
    check("gpt_oss_mxfp4", 24);
    // Another quantization is refused by name.
    let gptq = edited("gpt_oss_mxfp4", "gptq", |c| {
        c["quantization_config"]["quant_method"] = "gptq".into()
    });
    let err = hf::load(&gptq).unwrap_err().to_string();
    assert!(
        err.contains("`quantization_config.quant_method` = `gptq`"),
        "{err}"
    );
}

/// gpt_neox: its own tensor names, q, k and v fused head by head, attention and MLP in parallel
/// with a LayerNorm each, RoPE on a quarter of each head, the exact GELU.
#[test]
fn gpt_neox_matches_transformers() {
    let config = hf::config(&dir("gpt_neox")).unwrap();
    assert_eq!(config.attention[0].rope().unwrap().dim, 4);
    check("gpt_neox", 24);
}

/// bloom: ALiBi over 6 heads (the slopes of a head count that is not a power of two), a
/// LayerNorm on the embedding, q, k and v fused head by head, biases everywhere, tied.
#[test]
fn bloom_matches_transformers() {
    let config = hf::config(&dir("bloom")).unwrap();
    assert_eq!(config.attention[0].position, attn_dsl::Position::Alibi);
    assert!(config.embed_norm);
    assert_eq!(config.intermediate, 4 * config.hidden);
    check("bloom", 24);
}

/// A bloom checkpoint saved from the bare `BloomModel` names its tensors without the
/// `transformer.` prefix; it loads to the same logits.
#[test]
fn bloom_without_the_prefix_loads_alike() {
    use attn_runtime::io::{read_safetensors, tensor_names, write_safetensors};
    let file = dir("bloom").join("model.safetensors");
    let names = tensor_names(&file).unwrap();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let tensors = read_safetensors(&file, &refs).unwrap();
    let bare: Vec<String> = names
        .iter()
        .map(|n| n.strip_prefix("transformer.").unwrap().to_string())
        .collect();
    let out = edited("bloom", "bare", |_| ());
    let pairs: Vec<(&str, &attn_runtime::Tensor)> =
        bare.iter().map(String::as_str).zip(&tensors).collect();
    write_safetensors(&out.join("model.safetensors"), &pairs).unwrap();
    let g = golden("bloom");
    let logits = hf::load(&out).unwrap().forward(&g.tokens).unwrap();
    let err = max_diff(&logits, &g.logits);
    assert!(err < 1e-4, "unprefixed bloom: max |diff| {err}");
}

/// phi3 with LongRoPE: the full forward of 40 tokens past the original 32 rotates with the long
/// factors throughout; the incremental pass rotates with the short ones until the sequence
/// passes 32 tokens (keys cached as rotated then), as transformers does.
#[test]
fn phi3_longrope_matches_transformers() {
    let config = hf::config(&dir("phi3_longrope")).unwrap();
    let rope = config.attention[0].rope().unwrap();
    let attn_dsl::RopeScaling::LongRope(l) = &rope.scaling else {
        panic!("longrope, not {:?}", rope.scaling);
    };
    assert_eq!(l.original_max_position, 32);
    assert!((l.attention_factor - (1.0 + 8f64.ln() / 32f64.ln()).sqrt()).abs() < 1e-12);
    check("phi3_longrope", 24);
}

/// A top-level `original_max_position_embeddings` wins over the RoPE parameters' own, as in
/// transformers: phi3's LongRoPE switches factors past 32 (not 64) and its attention factor
/// counts from 32; llama's YaRN ramps from 16 (not 64).
#[test]
fn a_top_level_original_max_position_wins_for_longrope_and_yarn() {
    let rope = |name: &str| {
        hf::config(&dir(name)).unwrap().attention[0]
            .rope()
            .unwrap()
            .scaling
            .clone()
    };
    let attn_dsl::RopeScaling::LongRope(l) = rope("phi3_longrope_top") else {
        panic!("longrope");
    };
    assert_eq!(l.original_max_position, 32);
    assert!((l.attention_factor - (1.0 + 8f64.ln() / 32f64.ln()).sqrt()).abs() < 1e-12);
    check("phi3_longrope_top", 24);
    let attn_dsl::RopeScaling::Yarn(y) = rope("llama_yarn_top") else {
        panic!("yarn");
    };
    assert_eq!(y.original_max_position, 16);
    check("llama_yarn_top", 24);
}

/// DeepSeek-V3 with `rope_interleave: false` rotates its rotary dims as halves.
#[test]
fn deepseek_v3_without_rope_interleave_rotates_halves() {
    let config = hf::config(&dir("deepseek_v3_halves")).unwrap();
    assert_eq!(
        config.attention[0].rope().unwrap().layout,
        attn_dsl::RopeLayout::Half
    );
    check("deepseek_v3_halves", 24);
}

/// cohere with `use_qk_norm`: a bias-free LayerNorm over each head's q and k, each head with its
/// own weights.
#[test]
fn cohere_with_qk_norms_matches_transformers() {
    let config = hf::config(&dir("cohere_qk_norm")).unwrap();
    assert_eq!(
        config.qk_norm,
        Some(attn_runtime::model::QkNorm::PerHeadLayer)
    );
    check("cohere_qk_norm", 24);
}

/// mistral: a sliding window on every layer.
#[test]
fn mistral_matches_transformers() {
    check("mistral", 24);
}

/// helium: llama's layers with RoPE on interleaved pairs, q/k/v biases where `attention_bias`
/// says (none on the output projection).
#[test]
fn helium_matches_transformers() {
    let config = hf::config(&dir("helium")).unwrap();
    let rope = config.attention[0].rope().unwrap();
    assert_eq!(rope.layout, attn_dsl::RopeLayout::Interleaved);
    assert!(!config.o_bias);
    check("helium", 24);
}

/// qwen2: q/k/v biases, and the window only on the layers `layer_types` names (from
/// `max_window_layers` on), not on every layer.
#[test]
fn qwen2_with_sliding_layers_matches_transformers() {
    let config = hf::config(&dir("qwen2_sliding")).unwrap();
    assert_eq!(config.pattern, [0, 0, 1]);
    check("qwen2_sliding", 24);
}

/// The same checkpoints with their attention on the GPU kernels (run on the GPU IR
/// interpreter, through the `Backend` trait): forward, ragged prefill and decode steps, MLA.
#[test]
fn models_on_the_gpu_kernels_match_transformers() {
    for name in [
        "llama_gqa",
        "deepseek_v2_lite_mla",
        "qwen3_sliding",
        "smollm3_nope",
        "gemma2_softcap",
        "olmo2",
        "qwen3_moe",
    ] {
        let gpu = std::sync::Arc::new(attn_runtime::gpu::sim::GpuSim::new());
        check_on(name, 24, Some(gpu));
    }
}

/// A copy of a fixture checkpoint with its config edited, in a fresh directory.
fn edited(name: &str, tag: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let out = std::env::temp_dir().join(format!("attn-model-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir(name).join("config.json")).unwrap())
            .unwrap();
    edit(&mut config);
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        dir(name).join("model.safetensors"),
        out.join("model.safetensors"),
    )
    .unwrap();
    out
}

#[test]
fn bad_checkpoints_are_clear_errors() {
    let unknown = edited("llama_gqa", "family", |c| c["model_type"] = "rwkv".into());
    let err = hf::load(&unknown).unwrap_err().to_string();
    assert!(
        err.contains("`rwkv`") && err.contains("llama, helium, mistral"),
        "{err}"
    );
    // A known family with an activation it does not have.
    let act = edited("llama_gqa", "act", |c| c["model_type"] = "gpt_neox".into());
    let err = hf::load(&act).unwrap_err().to_string();
    assert!(
        err.contains("hidden_act `silu` is not supported for gpt_neox"),
        "{err}"
    );
    // A dense checkpoint whose config says layer 1 is MoE: the missing expert is named.
    let moe = edited("deepseek_v2_lite_mla", "moe", |c| {
        c["first_k_dense_replace"] = 1.into()
    });
    let err = hf::load(&moe).unwrap_err().to_string();
    assert!(err.contains("model.layers.1.mlp.experts.0"), "{err}");
    let untied = edited("llama_gqa", "untied", |c| {
        c["tie_word_embeddings"] = false.into()
    });
    let err = hf::load(&untied).unwrap_err().to_string();
    assert!(err.contains("lm_head.weight"), "{err}");
    let missing = std::env::temp_dir().join("attn-model-nothing-here");
    let err = hf::load(&missing).unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
    let model = hf::load(&dir("llama_gqa")).unwrap();
    let err = model.forward(&[1, 2, 999]).unwrap_err().to_string();
    assert!(err.contains("token 2 is 999"), "{err}");
}

#[test]
fn a_ragged_batch_equals_each_sequence_alone() {
    for name in ["llama_gqa", "deepseek_v2_lite_mla"] {
        let model = hf::load(&dir(name)).unwrap();
        let g = golden(name);
        let seqs = [g.tokens[..30].to_vec(), g.tokens[5..40].to_vec()];
        let full: Vec<Vec<f32>> = seqs.iter().map(|s| model.forward(s).unwrap()).collect();
        let mut batch = model.batch(80, 8).unwrap();
        let (a, b) = (batch.add_sequence(), batch.add_sequence());
        let vocab = model.config.vocab;
        let mut done = [0usize, 0];
        // Chunks of different sizes per step, one sequence sometimes idle.
        for (na, nb) in [(10, 3), (1, 17), (0, 1), (19, 14)] {
            let mut inputs = Vec::new();
            for (s, n) in [(a, na), (b, nb)] {
                if n > 0 {
                    inputs.push((s, &seqs[s][done[s]..done[s] + n]));
                }
            }
            let out = batch.step(&inputs).unwrap();
            for ((s, t), logits) in inputs.iter().zip(&out) {
                let want = &full[*s][done[*s] * vocab..(done[*s] + t.len()) * vocab];
                let err = max_diff(logits, want);
                assert!(err < 1e-4, "{name} seq {s} at {}: {err}", done[*s]);
            }
            for (s, t) in &inputs {
                done[*s] += t.len();
            }
        }
        assert_eq!(done, [30, 35]);
        assert!(batch.step(&[(a, &[1]), (a, &[2])]).is_err());
    }
}

#[test]
fn greedy_generation_follows_the_full_forward_and_batches_agree() {
    use attn_runtime::model::{Request, Sampling};
    let model = hf::load(&dir("llama_gqa")).unwrap();
    let g = golden("llama_gqa");
    let vocab = model.config.vocab;
    let prompts = [g.tokens[..24].to_vec(), g.tokens[30..33].to_vec()];
    let requests: Vec<Request> = prompts
        .iter()
        .map(|p| Request {
            prompt: p.clone(),
            max_new_tokens: 12,
            stop: Vec::new(),
        })
        .collect();
    let mut calls = 0;
    let together = model
        .generate(&requests, Sampling::greedy(), |_| calls += 1)
        .unwrap();
    assert_eq!(calls, 12, "one progress call per step");
    for (p, got) in prompts.iter().zip(&together) {
        // The argmax continuation, one full forward per token.
        let mut seq = p.clone();
        for _ in 0..12 {
            let logits = model.forward(&seq).unwrap();
            let last = &logits[(seq.len() - 1) * vocab..];
            let best = (0..vocab)
                .max_by(|&a, &b| last[a].total_cmp(&last[b]))
                .unwrap();
            seq.push(best as u32);
        }
        assert_eq!(got, &seq[p.len()..]);
    }
    // Alone, each request generates the same tokens; a stop token ends one early.
    let alone = model
        .generate(&requests[1..], Sampling::greedy(), |_| {})
        .unwrap();
    assert_eq!(alone[0], together[1]);
    let stop = together[0][3];
    let stopped = model
        .generate(
            &[Request {
                stop: vec![stop],
                ..requests[0].clone()
            }],
            Sampling::greedy(),
            |_| {},
        )
        .unwrap();
    let first = together[0].iter().position(|&t| t == stop).unwrap();
    assert_eq!(stopped[0], together[0][..=first]);
    // Seeded sampling repeats itself.
    let sampling = Sampling {
        temperature: 0.8,
        top_k: Some(40),
        top_p: Some(0.95),
        seed: 3,
    };
    let a = model.generate(&requests, sampling, |_| {}).unwrap();
    let b = model.generate(&requests, sampling, |_| {}).unwrap();
    assert_eq!(a, b);
}

#[test]
fn sharded_checkpoints_load_like_single_files() {
    use attn_runtime::io::{read_safetensors, write_safetensors};
    let src = dir("llama_gqa");
    let out = std::env::temp_dir().join(format!("attn-model-sharded-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(src.join("config.json"), out.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let names: Vec<String> = SafeTensors::deserialize(&bytes)
        .unwrap()
        .names()
        .into_iter()
        .map(String::from)
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let tensors = read_safetensors(&src.join("model.safetensors"), &refs).unwrap();
    // Alternate tensors between two shards, as the index says.
    let mut map = serde_json::Map::new();
    for shard in 0..2 {
        let file = format!("model-0000{}-of-00002.safetensors", shard + 1);
        let part: Vec<(&str, &attn_runtime::Tensor)> = refs
            .iter()
            .zip(&tensors)
            .enumerate()
            .filter(|(i, _)| i % 2 == shard)
            .map(|(_, (n, t))| (*n, t))
            .collect();
        for (n, _) in &part {
            map.insert(n.to_string(), file.clone().into());
        }
        write_safetensors(&out.join(&file), &part).unwrap();
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(out.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let sharded = hf::load(&out).unwrap();
    let single = hf::load(&src).unwrap();
    let tokens = [3, 1, 4, 1, 5, 9, 2, 6];
    assert_eq!(
        sharded.forward(&tokens).unwrap(),
        single.forward(&tokens).unwrap()
    );
}

#[test]
fn family_configs_map_to_specs() {
    let spec_of = |tag: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let d = edited("llama_gqa", tag, |c| edit(c));
        hf::config(&d).map(|c| c.attention_summary())
    };
    let mistral = spec_of("mistral", &|c| {
        c["model_type"] = "mistral".into();
        c["sliding_window"] = 8.into();
    })
    .unwrap();
    assert!(mistral.contains("mask = sliding_window(8)"), "{mistral}");
    let yarn = spec_of("yarn", &|c| {
        c["rope_parameters"] = serde_json::json!({
            "rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 16.0
        });
    })
    .unwrap();
    assert!(
        yarn.contains("base = 500000.0")
            && yarn.contains("yarn(factor = 4.0, original_max_position = 64, beta_fast = 16.0"),
        "{yarn}"
    );
    let old_keys = spec_of("oldkeys", &|c| {
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = 1e6.into();
        c["rope_scaling"] = serde_json::json!({
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128
        });
    })
    .unwrap();
    assert!(
        old_keys.contains("base = 1000000.0") && old_keys.contains("llama3(factor = 8.0"),
        "{old_keys}"
    );
    let err = spec_of("longrope", &|c| {
        c["rope_parameters"]["rope_type"] = "longrope".into()
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("`longrope`"), "{err}");
    // Qwen2 has q/k/v biases: the llama weights lack them, and the error names the tensor.
    let qwen = edited("llama_gqa", "qwen", |c| c["model_type"] = "qwen2".into());
    let err = hf::load(&qwen).unwrap_err().to_string();
    assert!(err.contains("q_proj.bias"), "{err}");
}

/// DeepSeek-V3's YaRN, as transformers' DeepseekV3Attention computes it: the softmax scale is
/// 1/sqrt(qk_head_dim) times mscale(factor, mscale_all_dim)^2, mscale(s, m) = 0.1 m ln s + 1,
/// and the rotation's attention factor is mscale(factor, mscale) / mscale(factor,
/// mscale_all_dim) (here 1).
#[test]
fn deepseek_v3_yarn_scales_the_softmax_by_mscale_squared() {
    let yarn = |tag: &str, mscale_all_dim: serde_json::Value| {
        edited("deepseek_v2_lite_mla", tag, |c| {
            c["model_type"] = "deepseek_v3".into();
            c["rope_interleave"] = true.into();
            c["rope_parameters"] = serde_json::json!({
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                "mscale_all_dim": mscale_all_dim, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0
            });
        })
    };
    let config = hf::config(&yarn("v3-yarn", 1.0.into())).unwrap();
    // 1/sqrt(16 + 8) = 0.20412414523193154; mscale(4, 1) = 1 + 0.1 ln 4 = 1.138629436111989.
    let want = 0.204_124_145_231_931_54 * 1.138_629_436_111_989 * 1.138_629_436_111_989;
    assert!((want - 0.264_642_257_964_226_75_f64).abs() < 1e-15);
    let scale = config.attention[0].scale.expect("an explicit scale");
    assert!((scale - want).abs() < 1e-12, "scale {scale}, want {want}");
    let rope = config.attention[0].rope().expect("rope");
    let factor = attn_dsl::reference::rope::attention_factor(rope);
    assert!((factor - 1.0).abs() < 1e-15, "attention factor {factor}");

    // Without mscale_all_dim the scale is the plain one, and the rotation carries mscale(4, 1).
    let config = hf::config(&yarn("v3-yarn-plain", serde_json::Value::Null)).unwrap();
    assert!((config.attention[0].scale.unwrap() - 0.204_124_145_231_931_54).abs() < 1e-12);
    let factor = attn_dsl::reference::rope::attention_factor(config.attention[0].rope().unwrap());
    assert!((factor - 1.138_629_436_111_989).abs() < 1e-12, "{factor}");

    // The model runs, and decoding token by token equals the full forward.
    let model = hf::load(&yarn("v3-yarn-run", 1.0.into())).unwrap();
    let tokens: Vec<u32> = (0..40).map(|t| (t * 37 % 256) as u32).collect();
    let full = model.forward(&tokens).unwrap();
    let mut session = model.session(tokens.len(), 16).unwrap();
    let mut steps = session.step(&tokens[..20]).unwrap();
    for t in 20..tokens.len() {
        steps.extend(session.step(&tokens[t..t + 1]).unwrap());
    }
    assert!(max_diff(&full, &steps) < 1e-4);
}
