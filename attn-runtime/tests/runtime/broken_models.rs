//! Broken checkpoints and research configs, one per class of fault: each must be refused at load
//! with an error that names what is wrong, never a panic, an abort or a model that runs with
//! wrong logits.

use attn_runtime::io::{read_safetensors, write_safetensors};
use attn_runtime::model::research::config_from_toml;
use attn_runtime::model::{Model, hf};
use attn_runtime::{RuntimeError, Tensor};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/hf-tiny"
    ))
    .join(name)
}

/// A scratch copy of a fixture checkpoint, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn of(name: &str, case: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("attn-broken-{}-{name}-{case}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture(name).join(file), dir.join(file)).unwrap();
        }
        Scratch(dir)
    }

    /// Sets `key` of config.json to the JSON `value`.
    fn config(self, key: &str, value: &str) -> Scratch {
        let path = self.0.join("config.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        json[key] = serde_json::from_str(value).unwrap();
        std::fs::write(&path, json.to_string()).unwrap();
        self
    }

    /// Replaces (or adds) tensor `name` with zeros of `shape`.
    fn tensor(self, name: &str, shape: &[usize]) -> Scratch {
        let path = self.0.join("model.safetensors");
        let names = tensor_names(&path);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut tensors: Vec<(String, Tensor)> = names
            .iter()
            .cloned()
            .zip(read_safetensors(&path, &refs).unwrap())
            .filter(|(n, _)| n != name)
            .collect();
        let n = shape.iter().product();
        tensors.push((
            name.to_string(),
            Tensor::from_f32(shape, vec![0.0; n]).unwrap(),
        ));
        let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        write_safetensors(&path, &refs).unwrap();
        self
    }

    fn load(&self) -> Result<Model, RuntimeError> {
        hf::load(&self.0)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tensor_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.tensors().keys().cloned().collect()
}

fn refused(result: Result<Model, RuntimeError>, needles: &[&str], case: &str) {
    let message = match result {
        Ok(_) => panic!("{case}: loaded; expected an error naming {needles:?}"),
        Err(e) => e.to_string(),
    };
    for needle in needles {
        assert!(
            message.contains(needle),
            "{case}: the error `{message}` does not name `{needle}`"
        );
    }
}

#[test]
fn configs_with_values_out_of_range_are_refused() {
    for (key, value, needle) in [
        ("num_attention_heads", "0", "num_attention_heads"),
        ("rms_norm_eps", "-1", "norm_eps"),
        ("rms_norm_eps", "0", "norm_eps"),
        ("hidden_size", "0", "hidden"),
        ("num_hidden_layers", "0", "layers"),
        ("num_hidden_layers", "1000000000", "layers"),
        ("vocab_size", "0", "vocab"),
        ("vocab_size", "100000000000", "vocab"),
        ("intermediate_size", "0", "intermediate"),
        ("num_key_value_heads", "3", "kv_heads"),
        ("head_dim", "100000", "head_dim"),
    ] {
        let case = format!("{key} = {value}");
        refused(
            Scratch::of("llama_gqa", &case.replace(' ', ""))
                .config(key, value)
                .load(),
            &[needle],
            &case,
        );
    }
    refused(
        Scratch::of("deepseek_v2_lite_mla", "lora")
            .config("q_lora_rank", "0")
            .load(),
        &["q_lora_rank"],
        "q_lora_rank = 0",
    );
    // A clamp to a negative limit (f32::clamp panics on it), and settings that are finite but
    // multiply the activations or scores past f32's range.
    refused(
        Scratch::of("gpt_oss", "limit")
            .config("swiglu_limit", "-1.0")
            .load(),
        &[
            "swiglu_limit = -1",
            "allowed: a finite alpha and a finite limit above 0",
        ],
        "swiglu_limit = -1",
    );
    refused(
        Scratch::of("deepseek_v3_moe", "routed")
            .config("routed_scaling_factor", "1e300")
            .load(),
        &["routed scaling factor of 1e300", "that f32 holds"],
        "routed_scaling_factor = 1e300",
    );
    let phi3: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("phi3_longrope").join("config.json")).unwrap(),
    )
    .unwrap();
    let mut rope = phi3["rope_parameters"].clone();
    rope["attention_factor"] = serde_json::json!(1e30);
    refused(
        Scratch::of("phi3_longrope", "factor")
            .config("rope_parameters", &rope.to_string())
            .load(),
        &["attention factor 1.000e30", "past f32's range"],
        "attention_factor = 1e30",
    );
}

#[test]
fn tensors_of_the_wrong_shape_are_refused_by_name() {
    let layer = "model.layers.0.";
    let cases: &[(&str, &[usize])] = &[
        ("self_attn.q_proj.weight", &[64, 63]),
        ("self_attn.k_proj.weight", &[32, 65]),
        ("self_attn.v_proj.weight", &[64, 64]),
        ("self_attn.o_proj.weight", &[64, 65]),
        ("mlp.up_proj.weight", &[64, 128]),
        ("mlp.gate_proj.weight", &[128]),
        ("mlp.down_proj.weight", &[64, 100]),
        ("input_layernorm.weight", &[8]),
        ("post_attention_layernorm.weight", &[10]),
    ];
    for (name, shape) in cases {
        let full = format!("{layer}{name}");
        refused(
            Scratch::of("llama_gqa", &name.replace('.', "_"))
                .tensor(&full, shape)
                .load(),
            &[&full, "expected"],
            &full,
        );
    }
    refused(
        Scratch::of("llama_gqa", "final_norm")
            .tensor("model.norm.weight", &[100])
            .load(),
        &["model.norm.weight", "[64]"],
        "final norm of 100",
    );
    refused(
        Scratch::of("llama_gqa", "embed")
            .tensor("model.embed_tokens.weight", &[256, 63])
            .load(),
        &["model.embed_tokens.weight", "[256, 64]"],
        "embedding",
    );
    refused(
        Scratch::of("llama_gqa", "lm_head")
            .config("tie_word_embeddings", "false")
            .tensor("lm_head.weight", &[255, 64])
            .load(),
        &["lm_head.weight", "[256, 64]"],
        "lm_head",
    );
    // This fixture's o_proj is square ([64, 4 heads x 16]); k_proj is not, so a transposed
    // matrix shows there.
    refused(
        Scratch::of("llama_gqa", "k_transposed")
            .tensor(&format!("{layer}self_attn.k_proj.weight"), &[64, 32])
            .load(),
        &["k_proj", "[32, 64]"],
        "k_proj transposed",
    );
}

#[test]
fn mla_tensors_of_the_wrong_shape_are_refused_by_name() {
    let layer = "model.layers.1.self_attn.";
    let cases: &[(&str, &[usize])] = &[
        ("q_proj.weight", &[96, 63]),
        ("kv_a_proj_with_mqa.weight", &[41, 64]),
        ("kv_a_layernorm.weight", &[31]),
        ("kv_b_proj.weight", &[128, 33]),
        ("o_proj.weight", &[64, 65]),
    ];
    for (name, shape) in cases {
        let full = format!("{layer}{name}");
        refused(
            Scratch::of("deepseek_v2_lite_mla", &name.replace('.', "_"))
                .tensor(&full, shape)
                .load(),
            &[&full, "expected"],
            &full,
        );
    }
}

#[test]
fn toml_models_out_of_range_are_refused_before_allocating() {
    let base = |extra: &str, attention: &str| {
        format!("vocab = 97\nlayers = 2\nattention = \"{attention}\"\n{extra}")
    };
    let attn = "heads = 4, head_dim = 12";
    for (text, needle) in [
        (base("hidden = 4611686018427387904", attn), "hidden"),
        (base("hidden = 1000000000", attn), "hidden"),
        (
            base("hidden = 48\nintermediate = 4611686018427387904", attn),
            "intermediate",
        ),
        (
            "vocab = 4611686018427387904\nhidden = 48\nlayers = 1\nattention = \"heads = 4, \
             head_dim = 12\""
                .to_string(),
            "vocab",
        ),
        (
            "vocab = 97\nhidden = 48\nlayers = 1000000000\nattention = \"heads = 4, \
             head_dim = 12\""
                .to_string(),
            "layers",
        ),
        (base("hidden = 48\nnorm_eps = inf", attn), "norm_eps"),
        (base("hidden = 48\nnorm_eps = nan", attn), "norm_eps"),
        (base("hidden = 48\nnorm_eps = -1.0", attn), "norm_eps"),
        (base("hidden = -5", attn), "hidden"),
        (base("hidden = 48", "heads = 0, head_dim = 12"), "heads"),
    ] {
        let err = config_from_toml(&text).expect_err(&text).to_string();
        assert!(
            err.contains(needle),
            "`{text}`: `{err}` does not name {needle}"
        );
    }
    // Every field in range, but the weights need petabytes: refused before any allocation.
    let huge = config_from_toml(
        "vocab = 16777216\nhidden = 1048576\nlayers = 4096\nattention = \"heads = 1024, \
         head_dim = 1024\"",
    )
    .unwrap();
    let err = Model::random(&huge, 0).expect_err("too large").to_string();
    assert!(err.contains("GiB"), "{err}");
}

/// The hostile values every config key is set to: numbers at and past the limits, wrong types,
/// null.
const HOSTILE: [&str; 14] = [
    "0",
    "1",
    "-1",
    "3",
    "0.5",
    "1e30",
    "-1e30",
    "4294967296",
    "18446744073709551615",
    "\"text\"",
    "null",
    "[]",
    "{}",
    "true",
];

/// The RoPE parameters, set one at a time under each scaling.
const SCALINGS: [&str; 4] = [
    r#"{"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 32}"#,
    r#"{"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}"#,
    r#"{"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}"#,
    r#"{"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1, 1, 1, 1, 1, 1,
        1, 1], "long_factor": [1, 2, 3, 4, 5, 6, 7, 8], "factor": 4.0,
        "attention_factor": 1.2, "original_max_position_embeddings": 16}"#,
];

/// Every key of a fixture's config.json (and every RoPE parameter under each scaling) set to
/// every hostile value: each load ends in a model or an error, never a panic, and a model only
/// where the config still describes its weights, running to finite logits.
fn hostile_config_sweep(name: &str) {
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut edits: Vec<(Vec<String>, serde_json::Value)> = json
        .as_object()
        .unwrap()
        .keys()
        .map(|k| (vec![k.clone()], json.clone()))
        .collect();
    for scaling in SCALINGS {
        let mut base = json.clone();
        base["rope_parameters"] = serde_json::from_str(scaling).unwrap();
        for k in base["rope_parameters"].as_object().unwrap().keys() {
            edits.push((vec!["rope_parameters".into(), k.clone()], base.clone()));
        }
    }
    let scratch = Scratch::of(name, "hostile");
    let original = scratch.0.join("config.json");
    for (path, base) in &edits {
        let key = path.join(".");
        for value in HOSTILE {
            let mut edited = base.clone();
            let slot = path.iter().fold(&mut edited, |v, k| &mut v[k.as_str()]);
            *slot = serde_json::from_str(value).unwrap();
            std::fs::write(&original, edited.to_string()).unwrap();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let model = scratch.load()?;
                // Whatever loaded must run, to finite logits (the fixtures' weights are
                // small: a non-finite logit is a setting that should have been refused).
                let logits = model.forward(&[1, 2, 3]);
                Ok::<_, RuntimeError>((model.config, logits))
            }));
            match result {
                Err(_) => panic!("{name}: `{key}` = {value} panicked"),
                Ok(Ok((config, logits))) => {
                    let logits =
                        logits.unwrap_or_else(|e| panic!("{name}: `{key}` = {value}: {e}"));
                    assert!(
                        logits.iter().all(|l| l.is_finite()),
                        "{name}: `{key}` = {value}: logits that are not finite"
                    );
                    assert!(config.validate().is_ok());
                }
                Ok(Err(_)) => {}
            }
        }
    }
}

/// One test per family, so that the sweep's families run side by side and each test is short.
macro_rules! hostile_config_sweeps {
    ($($family:ident),* $(,)?) => {
        mod every_config_key_with_hostile_values_loads_or_errs {
            $(
                #[test]
                fn $family() {
                    super::hostile_config_sweep(stringify!($family));
                }
            )*
        }
    };
}

hostile_config_sweeps!(
    llama_gqa,
    deepseek_v2_lite_mla,
    qwen3_sliding,
    smollm3_nope,
    gemma3_text,
    olmo2,
    qwen3_moe,
    bloom,
    phi3_longrope,
    cohere_qk_norm,
    gpt_oss,
    deepseek_v3_moe,
    granite,
    gemma2_softcap,
);

/// Every key of a research TOML config set to every hostile value: a config and a model that
/// runs, or an error, never a panic or an allocation the machine cannot hold.
#[test]
fn every_toml_key_with_hostile_values_loads_or_errs() {
    let keys = [
        ("vocab", "97"),
        ("hidden", "48"),
        ("layers", "2"),
        (
            "attention",
            "\"heads = 4, kv_heads = 2, head_dim = 12, mask = causal\"",
        ),
        ("norm", "\"rms\""),
        ("norm_eps", "1e-5"),
        ("mlp", "\"swiglu\""),
        ("intermediate", "64"),
        ("tie_embeddings", "true"),
        ("qkv_bias", "false"),
    ];
    let hostile = [
        "0",
        "-1",
        "1",
        "4611686018427387904",
        "1e30",
        "inf",
        "nan",
        "-0.0",
        "\"text\"",
        "\"heads = 0, head_dim = 12\"",
        "true",
        "[]",
    ];
    for (key, _) in keys {
        for value in hostile {
            let text: String = keys
                .iter()
                .map(|(k, v)| format!("{k} = {}\n", if *k == key { value } else { v }))
                .collect();
            let loaded = std::panic::catch_unwind(|| {
                let config = config_from_toml(&text)?;
                let model = Model::random(&config, 1)?;
                model.forward(&[1, 2, 3])
            });
            assert!(loaded.is_ok(), "`{key} = {value}` panicked");
        }
    }
}

#[test]
fn a_forward_pass_too_large_for_the_machine_is_refused_before_it_allocates() {
    // 4M-token vocabulary: the logits of 100,000 tokens alone would take 1.6 TB.
    let config = config_from_toml(
        "vocab = 4194304\nhidden = 4\nlayers = 1\nattention = \"heads = 1, head_dim = 4, \
         mask = causal\"",
    )
    .unwrap();
    let model = Model::random(&config, 0).unwrap();
    let tokens = vec![1u32; 100_000];
    let err = model.forward(&tokens).expect_err("too large").to_string();
    assert!(
        err.contains("100000 tokens") && err.contains("GiB"),
        "{err}"
    );
    assert_eq!(model.forward(&tokens[..3]).unwrap().len(), 3 * 4_194_304);
}

/// A safetensors file cut short at every length, and with its header's bytes mangled one at a
/// time: each read is a tensor or an error, never a panic.
#[test]
fn damaged_safetensors_files_are_errors() {
    let dir = std::env::temp_dir().join(format!("attn-damaged-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.safetensors");
    let t = Tensor::from_f32(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let u = Tensor::from_f32_as(attn_dsl::DType::Bf16, &[4], vec![1.0; 4]).unwrap();
    write_safetensors(&path, &[("t", &t), ("u", &u)]).unwrap();
    let whole = std::fs::read(&path).unwrap();
    let read = |bytes: &[u8]| {
        std::fs::write(&path, bytes).unwrap();
        std::panic::catch_unwind(|| read_safetensors(&path, &["t", "u"]))
            .unwrap_or_else(|_| panic!("a damaged file of {} bytes panicked", bytes.len()))
    };
    assert_eq!(read(&whole).unwrap()[0].to_f32_vec(), t.to_f32_vec());
    for len in 0..whole.len() {
        assert!(read(&whole[..len]).is_err(), "cut at {len}");
    }
    let header_end = 8 + u64::from_le_bytes(whole[..8].try_into().unwrap()) as usize;
    for i in 0..header_end {
        for byte in [0u8, b'9', b'"', b'}', 0xff] {
            let mut bytes = whole.clone();
            bytes[i] = byte;
            let _ = read(&bytes);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every config.json key the loader reads, given a value of another JSON type: an error that
/// names the key and the type expected, never a default standing in for it (a string
/// `"rope_theta": "500000"` must not run as 10000).
#[test]
fn a_config_key_of_the_wrong_json_type_is_an_error_naming_it() {
    let uint = ["\"2\"", "0.5", "-1", "true", "[]", "{}"].as_slice();
    let float = ["\"1e-5\"", "true", "[]", "{}"].as_slice();
    let flag = ["\"true\"", "1", "[]"].as_slice();
    let text = ["5", "true", "[]"].as_slice();
    let object = ["\"{}\"", "[]", "5"].as_slice();
    let (uints, floats, flags) = (
        [
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "sliding_window",
        ],
        ["rms_norm_eps", "rope_theta"],
        [
            "tie_word_embeddings",
            "attention_bias",
            "use_sliding_window",
        ],
    );
    let mut cases: Vec<(&str, Vec<&str>, &[&str], &str)> = Vec::new();
    for key in uints {
        cases.push(("llama_gqa", vec![key], uint, "a whole number"));
    }
    for key in floats {
        cases.push(("llama_gqa", vec![key], float, "a number"));
    }
    for key in flags {
        cases.push(("llama_gqa", vec![key], flag, "true or false"));
    }
    for key in ["model_type", "hidden_act"] {
        cases.push(("llama_gqa", vec![key], text, "a string"));
    }
    for key in ["rope_parameters", "rope_scaling"] {
        cases.push(("llama_gqa", vec![key], object, "an object"));
    }
    for key in ["rope_type", "type"] {
        cases.push(("llama_gqa", vec!["rope_parameters", key], text, "a string"));
    }
    for key in [
        "rope_theta",
        "factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "low_freq_factor",
        "high_freq_factor",
    ] {
        cases.push(("llama_gqa", vec!["rope_parameters", key], float, "a number"));
    }
    cases.push((
        "llama_gqa",
        vec!["rope_parameters", "original_max_position_embeddings"],
        uint,
        "a whole number",
    ));
    for key in [
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "kv_lora_rank",
        "q_lora_rank",
        "n_routed_experts",
        "first_k_dense_replace",
    ] {
        cases.push(("deepseek_v2_lite_mla", vec![key], uint, "a whole number"));
    }
    for name in ["llama_gqa", "deepseek_v2_lite_mla"] {
        let scratch = Scratch::of(name, "typed");
        let path = scratch.0.join("config.json");
        let original: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (_, keys, values, expected) in cases.iter().filter(|c| c.0 == name) {
            for value in values.iter() {
                let mut json = original.clone();
                if keys.len() == 2 && !json[keys[0]].is_object() {
                    json[keys[0]] = serde_json::json!({"rope_type": "default"});
                }
                let slot = keys.iter().fold(&mut json, |v, k| &mut v[*k]);
                *slot = serde_json::from_str(value).unwrap();
                std::fs::write(&path, json.to_string()).unwrap();
                let key = keys.join(".");
                let case = format!("{name}: `{key}` = {value}");
                refused(scratch.load(), &[&format!("`{key}` is"), expected], &case);
            }
        }
    }
}

/// The silent wrong answers this check replaced, each by its logits: a `rope_theta` given as a
/// string ran as the default base.
#[test]
fn a_string_rope_theta_is_refused_not_read_as_the_default() {
    let scratch = Scratch::of("llama_gqa", "theta-string").config(
        "rope_parameters",
        r#"{"rope_type": "default", "rope_theta": "500000"}"#,
    );
    refused(
        scratch.load(),
        &["`rope_parameters.rope_theta` is a string (\"500000\"); expected a number"],
        "rope_theta as a string",
    );
}

/// A checkpoint that ties its LM head to the embedding but also holds an `lm_head.weight`:
/// transformers ties the head and ignores the tensor; so does the loader, and says so.
#[test]
fn a_tied_checkpoint_with_its_own_lm_head_warns_and_uses_the_embedding() {
    let plain = hf::load(&fixture("llama_gqa")).unwrap();
    assert!(plain.config.tie_embeddings && plain.warnings().is_empty());
    let scratch = Scratch::of("llama_gqa", "tied-head").tensor("lm_head.weight", &[256, 64]);
    let model = scratch.load().unwrap();
    let warnings = model.warnings().join("\n");
    assert!(
        warnings.contains("`lm_head.weight`") && warnings.contains("ignored"),
        "{warnings:?}"
    );
    // The zero head was not used: the logits are the tied model's.
    let tokens = [1, 2, 3];
    assert_eq!(
        model.forward(&tokens).unwrap(),
        plain.forward(&tokens).unwrap()
    );
}

/// Per-layer keys that do not fit the model, and the pieces qwen3 adds, are errors naming them.
#[test]
fn per_layer_keys_and_qk_norms_that_do_not_fit_are_refused() {
    for (key, value, needles) in [
        (
            "layer_types",
            r#"["full_attention", "sliding_attention"]"#,
            &["`layer_types` has 2 entries; expected one per layer, 3"][..],
        ),
        (
            "layer_types",
            r#"["full_attention", "chunked_attention", "full_attention"]"#,
            &[
                "`layer_types[1]`",
                "\"full_attention\" or \"sliding_attention\"",
            ][..],
        ),
        ("layer_types", "7", &["`layer_types`", "an array"][..]),
    ] {
        refused(
            Scratch::of("qwen3_sliding", key).config(key, value).load(),
            needles,
            &format!("{key} = {value}"),
        );
    }
    for (value, needle) in [
        (
            "[1, 0, 2, 1]",
            "`no_rope_layers[2]` is a number (2); expected 0 or 1",
        ),
        ("[1, 0]", "`no_rope_layers` has 2 entries"),
    ] {
        refused(
            Scratch::of("smollm3_nope", "no_rope")
                .config("no_rope_layers", value)
                .load(),
            &[needle],
            value,
        );
    }
    for (fixture, key, value, needle) in [
        (
            "gemma2_softcap",
            "hidden_activation",
            "\"relu\"",
            "hidden_activation `relu` is not supported for gemma2",
        ),
        (
            "gemma3_text",
            "use_bidirectional_attention",
            "true",
            "`use_bidirectional_attention`",
        ),
        (
            "gemma2_softcap",
            "final_logit_softcapping",
            "-3.0",
            "`final_softcap` = -3 is invalid",
        ),
        (
            "gemma3_text",
            "rope_parameters",
            r#"{"full_attention": {"rope_type": "longrope"}}"#,
            "rope type `longrope` needs `short_factor`",
        ),
        (
            "gemma3_text",
            "rope_parameters",
            r#"{"full_attention": {"rope_type": "cubic"}}"#,
            "rope type `cubic` is not supported",
        ),
        (
            "phi3_longrope",
            "rope_parameters",
            r#"{"rope_type": "longrope", "short_factor": [1, 1, 1, 1, 1, 1, 1, 1],
                "long_factor": [1, 2, 3]}"#,
            "`rope_parameters.long_factor` has 3 entries; expected one per rotated pair, 8",
        ),
        (
            "phi3_longrope",
            "rope_parameters",
            r#"{"rope_type": "longrope", "short_factor": [1, 1, 1, 1, 1, 1, 1, -1],
                "long_factor": [1, 1, 1, 1, 1, 1, 1, 1]}"#,
            "position.scaling.short holds -1",
        ),
    ] {
        refused(
            Scratch::of(fixture, key).config(key, value).load(),
            &[needle],
            &format!("{fixture}: {key} = {value}"),
        );
    }
    for (key, value, needle) in [
        ("num_local_experts", "0", "an expert count of 0"),
        (
            "num_experts_per_tok",
            "5",
            "5 experts per token (top-k) with 4 experts",
        ),
        ("num_experts_per_tok", "0", "0 experts per token"),
    ] {
        refused(
            Scratch::of("mixtral_moe", key).config(key, value).load(),
            &[needle],
            &format!("mixtral: {key} = {value}"),
        );
    }
    for (key, value, needle) in [
        ("n_group", "3", "3 expert groups for 8 experts"),
        ("topk_group", "0", "0 chosen groups"),
        (
            "topk_method",
            "\"noaux\"",
            "topk_method `noaux` is not supported",
        ),
        (
            "routed_scaling_factor",
            "-1.0",
            "a routed scaling factor of -1",
        ),
    ] {
        refused(
            Scratch::of("deepseek_v2_moe", key)
                .config(key, value)
                .load(),
            &[needle],
            &format!("deepseek_v2: {key} = {value}"),
        );
    }
    refused(
        Scratch::of("qwen3_moe", "sparse_step")
            .config("decoder_sparse_step", "0")
            .load(),
        &["`decoder_sparse_step` is 0"],
        "decoder_sparse_step = 0",
    );
    let name = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
    refused(
        Scratch::of("mixtral_moe", "w2")
            .tensor(name, &[64, 64])
            .load(),
        &[name, "[64, 128]"],
        "an expert's down projection of the wrong width",
    );
    let name = "model.layers.0.self_attn.q_norm.weight";
    refused(
        Scratch::of("olmo2", "q_norm").tensor(name, &[16]).load(),
        &[name, "[64]"],
        "an olmo2 q_norm per head",
    );
    let name = "model.layers.1.self_attn.k_norm.weight";
    refused(
        Scratch::of("qwen3_sliding", "k_norm")
            .tensor(name, &[64])
            .load(),
        &[name, "[16]"],
        "a k_norm over the whole projection",
    );
    // cohere's per-head norms hold a row of weights per head.
    let name = "model.layers.0.self_attn.q_norm.weight";
    refused(
        Scratch::of("cohere_qk_norm", "q_norm")
            .tensor(name, &[16])
            .load(),
        &[name, "[4, 16]"],
        "a cohere q_norm shared by the heads",
    );
}

/// A query rank belongs to MLA models: a config that pairs it with per-head attention, or a
/// rank of 0, is refused; DeepSeek-V3's own rank is carried from its config.json.
#[test]
fn a_query_rank_outside_mla_is_refused() {
    let v3 = hf::config(&fixture("deepseek_v3_moe")).unwrap();
    assert!(v3.q_lora_rank.is_some(), "the fixture factors its queries");
    assert!(v3.validate().is_ok());
    let mut zero = v3.clone();
    zero.q_lora_rank = Some(0);
    let e = zero.validate().unwrap_err().to_string();
    assert!(e.contains("`q_lora_rank` = 0"), "{e}");
    let mut llama = hf::config(&fixture("llama_gqa")).unwrap();
    assert_eq!(llama.q_lora_rank, None);
    llama.q_lora_rank = Some(8);
    let e = llama.validate().unwrap_err().to_string();
    assert!(e.contains("not MLA"), "{e}");
}
