//! A research model trained through candle and the same weights in attn's runtime: the
//! safetensors file candle's `VarMap` saves, named by `weights` in the model's TOML, loads
//! with `research::load` and gives the same logits, for each norm, MLP and head kind.

use attn::candle::CandleModel;
use attn::candle::core::{DType, Device, Tensor};
use attn::candle::nn::{VarBuilder, VarMap};
use attn::research;

fn same_logits(toml: &str) {
    let config = research::config_from_toml(toml).unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = CandleModel::new(&config, vb).unwrap();
    // Learnable attention tensors start at 0: give them values that matter.
    for (name, var) in varmap.data().lock().unwrap().iter() {
        if name
            .rsplit_once(".self_attn.")
            .is_some_and(|(_, rest)| !rest.contains('.'))
        {
            let n = var.elem_count();
            let values: Vec<f32> = (0..n).map(|i| 0.3 - 0.2 * i as f32).collect();
            var.set(&Tensor::from_vec(values, var.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    let tokens: Vec<u32> = (0..11u32)
        .map(|i| (i * 5 + 3) % config.vocab as u32)
        .collect();
    let ids = Tensor::from_vec(tokens.clone(), (1, tokens.len()), &Device::Cpu).unwrap();
    let ours = model
        .forward(&ids)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();

    // One folder per call: the tests of this file run in parallel in one process.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "attn-candle-model-{}-{}",
        std::process::id(),
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    varmap.save(dir.join("model.safetensors")).unwrap();
    let path = dir.join("model.toml");
    std::fs::write(
        &path,
        research::config_to_toml(&config, Some("model.safetensors")),
    )
    .unwrap();
    let runtime = research::load(&path, 0).unwrap();
    let theirs = runtime.forward(&tokens).unwrap();

    assert_eq!(ours.len(), theirs.len());
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 + 1e-4 * b.abs(),
            "{toml}\nlogit {i}: candle {a}, runtime {b}"
        );
    }
    // The weights were trained ones, not the runtime's seeded random ones.
    let random = research::load(
        &{
            let p = dir.join("random.toml");
            std::fs::write(&p, research::config_to_toml(&config, None)).unwrap();
            p
        },
        0,
    )
    .unwrap()
    .forward(&tokens)
    .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        random
            .iter()
            .zip(&theirs)
            .any(|(a, b)| (a - b).abs() > 1e-3)
    );
}

#[test]
fn an_rms_swiglu_gqa_rope_model_gives_the_runtimes_logits() {
    same_logits(
        "vocab = 40\nhidden = 64\nlayers = 2\n\
         attention = \"heads = 4, kv_heads = 2, head_dim = 16, mask = causal, position = rope\"",
    );
}

#[test]
fn a_layernorm_gelu_untied_biased_alibi_model_gives_the_runtimes_logits() {
    same_logits(
        "vocab = 33\nhidden = 32\nlayers = 2\nnorm = \"layer\"\nmlp = \"gelu\"\n\
         tie_embeddings = false\nqkv_bias = true\n\
         attention = \"heads = 2, head_dim = 16, mask = causal, position = alibi, softcap = 5.0\"",
    );
}

#[test]
fn a_bf16_sliding_window_model_gives_the_runtimes_logits() {
    same_logits(
        "vocab = 50\nhidden = 32\nlayers = 1\n\
         attention = \"heads = 2, head_dim = 16, mask = sliding_window(4), dtype = bf16\"",
    );
}

#[test]
fn a_model_with_learned_slopes_and_sinks_gives_the_runtimes_logits() {
    same_logits(
        "vocab = 40\nhidden = 32\nlayers = 2\nintermediate = 64\n\
         attention = \"heads = 4, kv_heads = 2, head_dim = 8, mask = causal, sinks = learned, \
         params(slopes: [heads]), score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32\"",
    );
}

#[test]
fn per_layer_kinds_sandwich_norms_geglu_and_qk_norms_give_the_runtimes_logits() {
    same_logits(
        "vocab = 41\nhidden = 32\nlayers = 3\nmlp = \"geglu\"\nnorm_placement = \"sandwich\"\n\
         qk_norm = \"per_head\"\npattern = [\"local\", \"global\"]\n[attention]\n\
         local = \"heads = 4, kv_heads = 2, head_dim = 8, mask = sliding_window(3), position = rope\"\n\
         global = \"heads = 2, head_dim = 16, mask = causal\"",
    );
}

#[test]
fn post_norms_and_whole_projection_qk_norms_give_the_runtimes_logits() {
    same_logits(
        "vocab = 43\nhidden = 32\nlayers = 2\nnorm_placement = \"post\"\nqk_norm = \"whole\"\n\
         attention = \"heads = 4, kv_heads = 2, head_dim = 8, mask = causal, position = rope\"",
    );
}

#[test]
fn parallel_attention_and_mlp_give_the_runtimes_logits() {
    same_logits(
        "vocab = 47\nhidden = 32\nlayers = 2\nnorm_placement = \"parallel\"\nnorm = \"layer\"\n\
         attention = \"heads = 4, head_dim = 8, mask = causal, position = rope\"",
    );
}

#[test]
fn a_token_past_the_vocabulary_is_an_error() {
    let config = research::config_from_toml(
        "vocab = 10\nhidden = 16\nlayers = 1\nattention = \"heads = 1, head_dim = 16, mask = causal\"",
    )
    .unwrap();
    let varmap = VarMap::new();
    let model = CandleModel::new(
        &config,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let ids = Tensor::from_vec(vec![1u32, 10], (1, 2), &Device::Cpu).unwrap();
    let said = model.forward(&ids).unwrap_err().to_string();
    assert!(said.contains("token id 10 is out of range"), "{said}");
}

/// A research model's `[moe]` (a shared expert, every other layer MoE) trains through candle:
/// the runtime gives the same logits from its saved weights, and the router and the chosen
/// experts get gradients.
#[test]
fn a_mixture_of_experts_gives_the_runtimes_logits_and_trains() {
    let toml = "vocab = 40\nhidden = 32\nlayers = 2\nintermediate = 48\n\
                attention = \"heads = 2, head_dim = 16, mask = causal, position = rope\"\n\
                [moe]\nexperts = 4\ntop_k = 2\nintermediate = 24\nshared = 16\nevery = 2\n";
    same_logits(toml);
    let config = research::config_from_toml(toml).unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = CandleModel::new(&config, vb).unwrap();
    let ids = Tensor::from_vec((0..9u32).collect::<Vec<_>>(), (1, 9), &Device::Cpu).unwrap();
    let loss = model
        .forward(&ids)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let vars = varmap.data().lock().unwrap();
    let grad_norm = |name: &str| {
        let var = vars
            .get(name)
            .unwrap_or_else(|| panic!("no variable {name}"));
        // A variable the loss did not reach has no gradient: an expert no token was routed
        // to (the weights are drawn afresh each run, so which experts those are varies).
        grads.get(var).map_or(0.0, |g| {
            g.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
    };
    // Layer 1 is the MoE layer (every = 2); layer 0 is dense.
    assert!(grad_norm("model.layers.1.mlp.gate.weight") > 0.0);
    assert!(grad_norm("model.layers.1.mlp.shared_experts.up_proj.weight") > 0.0);
    let experts_with_gradients = (0..4)
        .filter(|j| grad_norm(&format!("model.layers.1.mlp.experts.{j}.down_proj.weight")) > 0.0)
        .count();
    assert!(
        experts_with_gradients >= 2,
        "{experts_with_gradients} experts learn"
    );
    assert!(vars.contains_key("model.layers.0.mlp.up_proj.weight"));
}

/// The spec's initial values are where a model's learnable attention tensors start, the same
/// in every model built from the config, and they survive `seed_weights`.
#[test]
fn learnable_tensors_start_at_the_specs_initial_values() {
    let config = research::config_from_toml(
        "vocab = 20\nhidden = 16\nlayers = 2\nattention = \"heads = 4, head_dim = 4, \
         mask = causal, sinks = learned, params(slopes: [heads] = alibi, \
         w: [heads, 8] = normal(0.5), c: [1] = 0.25), \
         score_mod = |s, b, h, q, k| s * c[0] - slopes[h] * (q - k) as f32 + w[h, 0]\"",
    )
    .unwrap();
    let start = |seeded: bool| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        CandleModel::new(&config, vb).unwrap();
        if seeded {
            CandleModel::seed_weights(&varmap, 3).unwrap();
        }
        let vars = varmap.data().lock().unwrap();
        let get = |name: &str| {
            vars[name]
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        [0, 1].map(|layer| {
            let a = format!("model.layers.{layer}.self_attn");
            ["slopes", "w", "c", "sinks"].map(|t| get(&format!("{a}.{t}")))
        })
    };
    let layers = start(false);
    for [slopes, w, c, sinks] in &layers {
        assert_eq!(slopes, &[0.25, 0.0625, 0.015625, 0.00390625]);
        assert_eq!(c, &[0.25]);
        assert_eq!(sinks, &[0.0; 4]);
        assert_eq!(w.len(), 32);
        let std = (w.iter().map(|x| x * x).sum::<f32>() / 32.0).sqrt();
        assert!(
            (0.25..1.0).contains(&std),
            "w drawn from normal(0.5): rms {std}"
        );
    }
    assert_ne!(layers[0][1], layers[1][1], "each layer draws its own");
    assert_eq!(start(false), layers, "the same start every time");
    assert_eq!(start(true), layers, "seed_weights leaves them");
}

#[test]
fn a_model_with_differential_heads_gives_the_runtimes_logits() {
    same_logits(
        "vocab = 40\nhidden = 32\nlayers = 2\n\
         attention = \"heads = 4, kv_heads = 2, head_dim = 8, v_head_dim = 16, mask = causal, \
         position = rope, differential = lambda(init = 0.3)\"",
    );
}
