//! Research models: TOML configs, seeded random weights, and incremental decoding equal to the
//! full forward for every attention family and block kind.

use attn_runtime::model::research::{config_from_toml, default_intermediate};
use attn_runtime::model::{MlpKind, Model, NormKind};

fn config(attention: &str, extra: &str) -> attn_runtime::model::ModelConfig {
    config_from_toml(&format!(
        "vocab = 97\nhidden = 48\nlayers = 2\nattention = \"{attention}\"\n{extra}"
    ))
    .unwrap()
}

#[test]
fn toml_configs_and_their_errors() {
    let c = config("heads = 4, kv_heads = 2, head_dim = 12, mask = causal", "");
    assert_eq!((c.vocab, c.hidden, c.layers), (97, 48, 2));
    assert_eq!((c.norm, c.mlp), (NormKind::Rms, MlpKind::SwiGlu));
    assert_eq!(c.intermediate, 128, "8 * 48 / 3 = 128, a multiple of 64");
    assert_eq!(default_intermediate(MlpKind::Gelu, 48), 192);
    assert!(c.tie_embeddings);
    for (text, needle) in [
        (
            "vocab = 10\nhidden = 8\nlayers = 1\nattention = \"heads = 2, head_dim = 4\"\nwidth = 3",
            "unknown key `width`",
        ),
        (
            "vocab = 10\nlayers = 1\nattention = \"heads = 2, head_dim = 4\"",
            "`hidden` is missing",
        ),
        (
            "vocab = 10\nhidden = 8\nlayers = 1\nattention = \"heads = 2, head_dim = 4\"\nnorm = \"batch\"",
            "allowed: rms, layer",
        ),
        (
            "vocab = 10\nhidden = -8\nlayers = 1\nattention = \"heads = 2, head_dim = 4\"",
            "positive integer",
        ),
        (
            "vocab = 10\nhidden = 8\nlayers = 1\nattention = \"heads = 3, kv_heads = 2, head_dim = 4\"",
            "`attention`",
        ),
        (
            "vocab = 10\nhidden = 8\nlayers = 1\nattention = ",
            "model config",
        ),
    ] {
        let err = config_from_toml(text).unwrap_err().to_string();
        assert!(err.contains(needle), "{text}: {err}");
    }
}

#[test]
fn random_models_decode_incrementally_as_their_full_forward() {
    for (attention, extra) in [
        (
            "heads = 4, head_dim = 12, mask = causal, position = rope",
            "",
        ),
        (
            "heads = 6, kv_heads = 2, head_dim = 8, mask = sliding_window(9), position = rope(scaling = yarn(factor = 4.0, original_max_position = 16))",
            "qkv_bias = true\ntie_embeddings = false",
        ),
        (
            "heads = 4, kv_heads = 1, head_dim = 16, mask = causal, position = alibi",
            "norm = \"layer\"\nmlp = \"gelu\"",
        ),
        (
            "heads = 4, head_dim = 8, v_head_dim = 12, mla(latent_rank = 16, rope_dim = 4), mask = causal, position = rope(layout = interleaved)",
            "",
        ),
        (
            "heads = 4, kv_heads = 2, head_dim = 12, mask = causal, dtype = bf16",
            "",
        ),
        (
            "heads = 4, kv_heads = 2, head_dim = 12, v_head_dim = 24, mask = causal, \
             position = rope, differential = lambda(init = 0.4)",
            "",
        ),
    ] {
        let c = config(attention, extra);
        let model = Model::random(&c, 5).unwrap();
        let tokens: Vec<u32> = (0..37).map(|i| (i * 31 + 7) % 97).collect();
        let full = model.forward(&tokens).unwrap();
        let mut session = model.session(40, 8).unwrap();
        let mut inc = session.step(&tokens[..11]).unwrap();
        for t in 11..tokens.len() {
            inc.extend(session.step(&tokens[t..t + 1]).unwrap());
        }
        let tol = if attention.contains("bf16") {
            2e-2
        } else {
            1e-4
        };
        let err = full
            .iter()
            .zip(&inc)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < tol, "{attention}: incremental vs full {err}");
        let scale = full.iter().map(|x| x.abs()).fold(0f32, f32::max);
        assert!(
            scale > 1e-3,
            "{attention}: logits are not all zero ({scale})"
        );
    }
}

#[test]
fn seeds_and_parameter_counts() {
    let c = config(
        "heads = 4, kv_heads = 2, head_dim = 12, mask = causal",
        "tie_embeddings = false",
    );
    let (a, b, other) = (
        Model::random(&c, 1).unwrap(),
        Model::random(&c, 1).unwrap(),
        Model::random(&c, 2).unwrap(),
    );
    let tokens = [1, 2, 3];
    assert_eq!(a.forward(&tokens).unwrap(), b.forward(&tokens).unwrap());
    assert_ne!(a.forward(&tokens).unwrap(), other.forward(&tokens).unwrap());
    let parts: std::collections::HashMap<_, _> = a.parameters().into_iter().collect();
    // q 48x48, k and v 24x48, o 48x48 per layer; SwiGLU 3 x 48 x 128; norms 2 x 48 + final 48.
    assert_eq!(parts["attention"], 2 * (48 * 48 + 2 * 24 * 48 + 48 * 48));
    assert_eq!(parts["mlp"], 2 * 3 * 48 * 128);
    assert_eq!(parts["norms"], 2 * 2 * 48 + 48);
    assert_eq!(parts["embedding"], 97 * 48);
    assert_eq!(parts["lm_head"], 97 * 48);

    // Differential heads: v 24x48 (one value head of 24 per pair of key heads), o 48x48 (two
    // output heads of 24), lambda's four vectors of 12 and the per-head norm of 24.
    let c = config(
        "heads = 4, kv_heads = 2, head_dim = 12, v_head_dim = 24, mask = causal, \
         differential = lambda",
        "",
    );
    let parts: std::collections::HashMap<_, _> = Model::random(&c, 1)
        .unwrap()
        .parameters()
        .into_iter()
        .collect();
    assert_eq!(
        parts["attention"],
        2 * (48 * 48 + 24 * 48 + 24 * 48 + 48 * 48 + 4 * 12 + 24)
    );
    assert_eq!(c.weight_count(), Some(parts.values().sum::<u64>()));
}

#[test]
fn a_config_written_as_toml_reads_back_equal() {
    use attn_runtime::model::research::config_to_toml;
    for extra in [
        "",
        "norm = \"layer\"\nmlp = \"gelu\"\ntie_embeddings = false\nqkv_bias = true\nnorm_eps = 1e-6",
    ] {
        let c = config(
            "heads = 4, kv_heads = 2, head_dim = 12, mask = sliding_window(8), position = alibi",
            extra,
        );
        let text = config_to_toml(&c, Some("model.safetensors"));
        assert_eq!(config_from_toml(&text).unwrap(), c, "{text}");
        assert!(text.contains("weights = \"model.safetensors\""), "{text}");
    }
}

#[test]
fn a_weights_key_names_a_file_beside_the_toml_or_is_an_error() {
    use attn_runtime::model::research::{load, weights_file};
    let base = "vocab = 10\nhidden = 8\nlayers = 1\nattention = \"heads = 2, head_dim = 4\"\n";
    assert_eq!(weights_file(base).unwrap(), None);
    let named = format!("{base}weights = \"w.safetensors\"");
    assert_eq!(
        weights_file(&named).unwrap().as_deref(),
        Some("w.safetensors")
    );
    for bad in [
        "\"../w.safetensors\"",
        "\"/etc/passwd\"",
        "\"a/b.safetensors\"",
        "\"\"",
        "3",
    ] {
        let text = format!("{base}weights = {bad}");
        let said = weights_file(&text).unwrap_err().to_string();
        assert!(said.contains("`weights`"), "{bad}: {said}");
    }
    // A named file that is not there: an error naming it, not random weights.
    let dir = std::env::temp_dir().join(format!("attn-research-weights-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("m.toml"), &named).unwrap();
    let said = load(&dir.join("m.toml"), 0).err().unwrap().to_string();
    assert!(said.contains("w.safetensors"), "{said}");
    std::fs::write(dir.join("w.safetensors"), b"not safetensors").unwrap();
    assert!(load(&dir.join("m.toml"), 0).is_err());
    std::fs::remove_dir_all(&dir).ok();
}

/// Layers that differ: named attention kinds and a repeating pattern, q/k norms; the pattern's
/// errors name what is wrong.
#[test]
fn layer_patterns_in_toml_and_their_errors() {
    let base = "vocab = 97\nhidden = 48\nlayers = 5\nqk_norm = \"per_head\"\n";
    let kinds = "[attention]\n\
                 local = \"heads = 4, head_dim = 12, mask = sliding_window(4), position = rope\"\n\
                 global = \"heads = 4, kv_heads = 2, head_dim = 12, mask = causal\"\n";
    let text = format!("{base}pattern = [\"local\", \"local\", \"global\"]\n{kinds}");
    let c = config_from_toml(&text).unwrap();
    assert_eq!(c.attention.len(), 2);
    assert_eq!(
        c.attention[0].mask,
        attn_dsl::Mask::SlidingWindow { window: 4 }
    );
    assert_eq!(c.pattern, [0, 0, 1]);
    assert_eq!(
        (0..5).map(|i| c.kind_of(i)).collect::<Vec<_>>(),
        [0, 0, 1, 0, 0]
    );
    // Written back and read again, the same config.
    let again = attn_runtime::model::research::config_to_toml(&c, None);
    assert_eq!(config_from_toml(&again).unwrap(), c, "{again}");
    // A random model of it decodes as its full forward does.
    let model = Model::random(&c, 3).unwrap();
    assert_eq!(model.variants().len(), 2);
    let err = incremental_error(&model, 12, 5);
    assert!(err < 1e-4, "incremental against full: {err}");
    let parts: std::collections::HashMap<_, _> = model.parameters().into_iter().collect();
    assert_eq!(
        parts.values().sum::<u64>(),
        c.weight_count().unwrap(),
        "the config counts what the model holds, q/k norms included"
    );
    // A step after 10 tokens reads the 11 rows of every global layer's 2 kv heads and the
    // last 4 of each local layer's 4 heads: keys and values of 12 f32 values.
    let row = 2 * 12 * 4;
    assert_eq!(
        model.step_cache_bytes(10),
        (4 * 4 * 4 * row + 11 * 2 * row) as u64
    );
    assert_eq!(
        model.step_cache_bytes(1),
        (4 * 2 * 4 * row + 2 * 2 * row) as u64
    );
    for (text, needle) in [
        (format!("{base}{kinds}"), "`pattern` must list each layer's kind"),
        (
            format!("{base}pattern = []\n{kinds}"),
            "`pattern` must be a list of 1 to",
        ),
        (
            format!("{base}pattern = [\"local\", \"middle\"]\n{kinds}"),
            "`pattern[1]` is `middle`, which is not a kind of `[attention]`; its kinds: global, local",
        ),
        (
            format!("{base}pattern = [\"local\"]\n{kinds}"),
            "attention kind `global` is in no layer of `pattern`",
        ),
        (
            format!("{base}pattern = [\"local\", 3]\n{kinds}"),
            "`pattern[1]` must be a kind name",
        ),
        (
            format!("{base}pattern = [\"local\"]\nattention = \"heads = 2, head_dim = 4\""),
            "`pattern` needs `attention` to be a table",
        ),
        (
            format!("{base}pattern = [\"a\"]\n[attention]\na = \"heads = 3, kv_heads = 2, head_dim = 4\""),
            "`attention.a`",
        ),
        (
            "vocab = 9\nhidden = 8\nlayers = 1\nqk_norm = \"all\"\nattention = \"heads = 2, head_dim = 4\"".to_string(),
            "allowed: \"per_head\", \"whole\"",
        ),
    ] {
        let err = config_from_toml(&text).unwrap_err().to_string();
        assert!(err.contains(needle), "{text}: {err}");
    }
}

/// Built in code, a config's kinds and pattern are checked too.
#[test]
fn kinds_and_patterns_built_in_code_are_checked() {
    let mut c = config("heads = 4, head_dim = 12, mask = causal", "");
    for (pattern, kinds, needle) in [
        (vec![], 1, "a layer pattern of 0 entries"),
        (
            vec![0, 1],
            1,
            "layer pattern entry 1 is kind 1; there are 1 kinds",
        ),
        (vec![0, 0], 2, "attention kind 1"),
        (vec![0], 0, "0 attention kinds"),
    ] {
        c.pattern = pattern;
        c.attention = vec![
            c.attention
                .first()
                .cloned()
                .unwrap_or_else(|| { "heads = 4, head_dim = 12".parse().unwrap() });
            kinds
        ];
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains(needle), "{err}");
        assert!(Model::random(&c, 0).is_err());
    }
}

/// Each norm placement, GeGLU and both q/k norms: incremental decoding equals the full forward,
/// and the config counts the weights the model holds.
#[test]
fn norm_placements_geglu_and_qk_norms_decode_as_their_full_forward() {
    for extra in [
        "norm_placement = \"sandwich\"\nmlp = \"geglu\"\nqk_norm = \"per_head\"",
        "norm_placement = \"post\"\nqk_norm = \"whole\"\nnorm = \"layer\"",
    ] {
        let c = config(
            "heads = 4, kv_heads = 2, head_dim = 12, mask = causal, position = rope",
            extra,
        );
        let model = Model::random(&c, 5).unwrap();
        let parts: u64 = model.parameters().iter().map(|(_, n)| n).sum();
        assert_eq!(parts, c.weight_count().unwrap(), "{extra}");
        assert_eq!(model.parameters(), c.parameters().unwrap(), "{extra}");
        let err = incremental_error(&model, 9, 4);
        assert!(err < 1e-4, "{extra}: incremental against full: {err}");
        let back = attn_runtime::model::research::config_to_toml(&c, None);
        assert_eq!(config_from_toml(&back).unwrap(), c, "{back}");
    }
}

/// A `[moe]` table: experts every `every`-th layer, a shared expert; the model decodes as its
/// full forward, counts its parameters, and its TOML reads back equal. Bad tables are errors
/// naming the key.
#[test]
fn mixture_of_experts_in_toml_and_its_errors() {
    let c = config(
        "heads = 4, kv_heads = 2, head_dim = 12, mask = causal, position = rope",
        "[moe]\nexperts = 4\ntop_k = 2\nintermediate = 32\nshared = 16\nevery = 2",
    );
    let moe = c.moe.as_ref().unwrap();
    assert_eq!((moe.experts, moe.top_k, moe.intermediate), (4, 2, 32));
    assert_eq!(moe.sparse, [false, true]);
    let model = Model::random(&c, 5).unwrap();
    let parts: u64 = model.parameters().iter().map(|(_, n)| n).sum();
    assert_eq!(parts, c.weight_count().unwrap());
    assert_eq!(model.parameters(), c.parameters().unwrap());
    assert_eq!(model.expert_weights(), c.expert_weights());
    let err = incremental_error(&model, 9, 4);
    assert!(err < 1e-4, "incremental against full: {err}");
    let back = attn_runtime::model::research::config_to_toml(&c, None);
    assert_eq!(config_from_toml(&back).unwrap(), c, "{back}");
    let base = "vocab = 10\nhidden = 8\nlayers = 2\nattention = \"heads = 2, head_dim = 4\"\n";
    for (moe, needle) in [
        ("moe = 3", "`moe` must be a table"),
        ("[moe]\nexperts = 4", "`moe.top_k` is missing"),
        (
            "[moe]\nexperts = 0\ntop_k = 1",
            "`moe.experts` must be a positive integer",
        ),
        ("[moe]\nexperts = 4\ntop_k = 5", "top-k"),
        (
            "[moe]\nexperts = 4\ntop_k = 2\nevery = 3",
            "`moe.every` = 3 leaves no MoE layer",
        ),
        (
            "[moe]\nexperts = 4\ntop_k = 2\nrouter = \"sigmoid\"",
            "unknown key `moe.router`",
        ),
        (
            "[moe]\nexperts = 4\ntop_k = 2\nnormalize = 1",
            "`moe.normalize` must be true or false",
        ),
        ("[moe]\nexperts = 100000\ntop_k = 2", "expert count"),
    ] {
        let text = format!("{base}{moe}");
        let err = config_from_toml(&text).unwrap_err().to_string();
        assert!(err.contains(needle), "{text}: {err}");
    }
    // A layer count past the limit is refused before anything per layer is made.
    let err = config_from_toml(
        "vocab = 10\nhidden = 8\nlayers = 100000000000\nattention = \"heads = 2, head_dim = 4\"\n\
         [moe]\nexperts = 4\ntop_k = 2",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("`layers` = 100000000000 is out of range"),
        "{err}"
    );
}

/// The README's per-layer TOML example is a valid config.
#[test]
fn the_readmes_layer_pattern_example_reads() {
    let readme = include_str!("../../../README.md");
    let block = readme
        .split("```toml\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .find(|b| b.contains("pattern = ["))
        .expect("the README shows a TOML with a layer pattern");
    let c = config_from_toml(block).unwrap();
    assert_eq!((c.attention.len(), c.pattern.len(), c.layers), (2, 3, 12));
}

/// The largest difference between `model`'s logits over `n` tokens in one forward pass and in
/// a session (a prefill of `prefill` tokens, then one token at a time).
fn incremental_error(model: &Model, n: usize, prefill: usize) -> f32 {
    let tokens: Vec<u32> = (0..n).map(|i| (i * 7 % 97) as u32).collect();
    let full = model.forward(&tokens).unwrap();
    let mut session = model.session(16, 4).unwrap();
    let mut steps = session.step(&tokens[..prefill]).unwrap();
    for t in prefill..n {
        steps.extend(session.step(&tokens[t..t + 1]).unwrap());
    }
    full.iter()
        .zip(&steps)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

/// A pattern naming more layers than the model has is refused, not cut.
#[test]
fn a_pattern_longer_than_the_layers_is_refused() {
    let text = "vocab = 16\nhidden = 8\nlayers = 2\npattern = [\"a\", \"a\", \"b\"]\n\
                [attention]\na = \"heads = 2, head_dim = 4\"\nb = \"heads = 2, head_dim = 4, \
                mask = causal\"\n";
    let e = config_from_toml(text).unwrap_err().to_string();
    assert!(
        e.contains("`pattern` names 3 layers' kinds for 2 layers; allowed: at most 2"),
        "{e}"
    );
}
