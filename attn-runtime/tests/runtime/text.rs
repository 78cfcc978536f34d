//! Text in and out against transformers (`tests/fixtures/hf-tiny/llama_tokenizer`, whose
//! golden_generate.json holds each prompt's ids, the greedy continuation's ids and its decoded
//! text): the tokenizer, the streaming decoder, and greedy generation from text.

use attn_runtime::model::{Request, Sampling, TextTokenizer, hf};
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/hf-tiny/llama_tokenizer"
    ))
}

struct Golden {
    prompt: String,
    prompt_ids: Vec<u32>,
    new_ids: Vec<u32>,
    new_text: String,
}

fn goldens() -> Vec<Golden> {
    let text = std::fs::read_to_string(dir().join("golden_generate.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    json["generate"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| Golden {
            prompt: g["prompt"].as_str().unwrap().to_string(),
            prompt_ids: ids(&g["prompt_ids"]),
            new_ids: ids(&g["new_ids"]),
            new_text: g["new_text"].as_str().unwrap().to_string(),
        })
        .collect()
}

#[test]
fn prompts_encode_and_continuations_decode_as_transformers_does() {
    let tokenizer = TextTokenizer::from_dir(&dir()).unwrap();
    for g in goldens() {
        assert_eq!(
            tokenizer.encode(&g.prompt).unwrap(),
            g.prompt_ids,
            "{}",
            g.prompt
        );
        assert_eq!(tokenizer.decode(&g.new_ids).unwrap(), g.new_text);
        // Streamed token by token, the pieces add up to the same text.
        let mut stream = tokenizer.stream();
        let mut text = String::new();
        for &id in &g.new_ids {
            text += &stream.push(id).unwrap();
        }
        text += &stream.finish().unwrap();
        assert_eq!(text, g.new_text, "{}", g.prompt);
    }
}

#[test]
fn greedy_generation_from_text_continues_as_transformers_does() {
    generate_on(None);
}

/// The whole decoder on the GPU kernels (run on the GPU IR interpreter): attention, and the
/// norms, SwiGLU, residual adds, embedding lookups and the argmax of greedy decoding as the
/// generated layer kernels.
#[test]
fn greedy_generation_on_the_gpu_kernels_continues_as_transformers_does() {
    generate_on(Some(std::sync::Arc::new(
        attn_runtime::gpu::sim::GpuSim::new(),
    )));
}

fn generate_on(backend: Option<std::sync::Arc<dyn attn_runtime::Backend>>) {
    let tokenizer = TextTokenizer::from_dir(&dir()).unwrap();
    let mut model = hf::load(&dir()).unwrap();
    if let Some(b) = backend {
        model.set_backend(b);
    }
    for g in goldens() {
        let request = Request {
            prompt: tokenizer.encode(&g.prompt).unwrap(),
            max_new_tokens: g.new_ids.len(),
            stop: Vec::new(),
        };
        let out = model
            .generate(&[request], Sampling::greedy(), |_| {})
            .unwrap();
        assert_eq!(out[0], g.new_ids, "{}", g.prompt);
    }
}

#[test]
fn a_character_split_across_tokens_is_held_back_until_it_is_whole() {
    let tokenizer = TextTokenizer::from_dir(&dir()).unwrap();
    let text = "héllo wörld, 注意";
    let ids = tokenizer.encode(text).unwrap();
    let mut stream = tokenizer.stream();
    let mut pieces = Vec::new();
    for &id in &ids {
        pieces.push(stream.push(id).unwrap());
    }
    pieces.push(stream.finish().unwrap());
    assert!(
        pieces.iter().all(|p| !p.contains('\u{fffd}')),
        "a partial character was given out: {pieces:?}"
    );
    assert_eq!(pieces.concat(), text);
    // The byte-level vocabulary splits these characters: some token gave out nothing at once.
    assert!(
        pieces[..ids.len()].iter().any(String::is_empty),
        "{pieces:?}"
    );
}

#[test]
fn a_checkpoint_without_a_tokenizer_is_a_clear_error() {
    let llama = dir().join("../llama_gqa");
    let err = match TextTokenizer::from_dir(&llama) {
        Ok(_) => panic!("llama_gqa has no tokenizer.json"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("tokenizer.json"), "{err}");
}

/// A scratch copy of the tokenizer fixture whose tokenizer.json is edited by `edit`.
fn edited_tokenizer(case: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let scratch = std::env::temp_dir().join(format!("attn-tok-{case}-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let text = std::fs::read_to_string(dir().join("tokenizer.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut json);
    std::fs::write(scratch.join("tokenizer.json"), json.to_string()).unwrap();
    scratch
}

/// transformers' `tokenizer(text)` applies neither the file's truncation nor its padding: a
/// prompt encodes whole, whatever they say (and a padding of 10^9 allocates nothing).
#[test]
fn padding_and_truncation_in_tokenizer_json_do_not_change_prompts() {
    let hostile = [
        (
            "truncation",
            serde_json::json!({"direction": "Right", "max_length": 3, "strategy": "LongestFirst",
                               "stride": 0}),
        ),
        (
            "padding",
            serde_json::json!({"strategy": {"Fixed": 1_000_000_000u64}, "direction": "Right",
                               "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0,
                               "pad_token": "<s>"}),
        ),
    ];
    for (key, value) in hostile {
        let scratch = edited_tokenizer(key, |json| json[key] = value.clone());
        let tokenizer = TextTokenizer::from_dir(&scratch).unwrap();
        for g in goldens() {
            assert_eq!(
                tokenizer.encode(&g.prompt).unwrap(),
                g.prompt_ids,
                "{key}: {}",
                g.prompt
            );
        }
        std::fs::remove_dir_all(&scratch).ok();
    }
}

/// Hostile settings anywhere in tokenizer.json: each load and encode ends in ids or an error,
/// never a panic or an allocation past the machine.
#[test]
fn hostile_tokenizer_settings_load_and_encode_or_err() {
    let values = [
        serde_json::json!(null),
        serde_json::json!(-1),
        serde_json::json!(1e300),
        serde_json::json!(18_446_744_073_709_551_615u64),
        serde_json::json!("x"),
        serde_json::json!([]),
        serde_json::json!({}),
        serde_json::json!({"Fixed": 18_446_744_073_709_551_615u64}),
    ];
    let keys = [
        "padding",
        "truncation",
        "normalizer",
        "pre_tokenizer",
        "post_processor",
        "decoder",
        "added_tokens",
    ];
    for key in keys {
        for (i, value) in values.iter().enumerate() {
            let scratch = edited_tokenizer(&format!("{key}-{i}"), |json| json[key] = value.clone());
            let outcome = std::panic::catch_unwind(|| {
                TextTokenizer::from_dir(&scratch).and_then(|t| {
                    let ids = t.encode("hello there")?;
                    t.decode(&ids)
                })
            });
            assert!(outcome.is_ok(), "`{key}` = {value} panicked");
            std::fs::remove_dir_all(&scratch).ok();
        }
    }
}

#[test]
fn a_tokenizer_with_ids_past_the_models_vocabulary_is_refused() {
    let tokenizer = TextTokenizer::from_dir(&dir()).unwrap();
    let model = hf::load(&dir()).unwrap();
    assert_eq!(tokenizer.id_count(), model.config.vocab as u64);
    assert!(tokenizer.check_fits(model.config.vocab).is_ok());
    let e = tokenizer.check_fits(100).unwrap_err().to_string();
    assert!(e.contains("up to 299") && e.contains("100 ids"), "{e}");
}

/// A model larger than its tokenizer (a 100-token tokenizer on a 300-token model): a generated
/// id the tokenizer has no text for is an error, not empty text.
#[test]
fn a_generated_token_the_tokenizer_does_not_know_is_an_error() {
    let scratch = edited_tokenizer("small", |json| {
        let vocab = json["model"]["vocab"].as_object_mut().unwrap();
        vocab.retain(|_, id| id.as_u64().unwrap() < 100);
        json["model"]["merges"] = serde_json::json!([]);
    });
    let tokenizer = TextTokenizer::from_dir(&scratch).unwrap();
    assert_eq!(tokenizer.id_count(), 100);
    assert!(tokenizer.check_fits(300).is_ok(), "smaller is allowed");
    let mut stream = tokenizer.stream();
    stream.push(42).unwrap();
    let e = stream.push(250).unwrap_err().to_string();
    assert!(e.contains("token 250") && e.contains("below 100"), "{e}");
    std::fs::remove_dir_all(&scratch).ok();
}

#[cfg(unix)]
#[test]
fn a_tokenizer_json_that_is_a_device_or_fifo_is_refused_without_reading() {
    let scratch = std::env::temp_dir().join(format!("attn-tok-special-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let path = scratch.join("tokenizer.json");
    std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
    let e = TextTokenizer::from_dir(&scratch).err().unwrap().to_string();
    assert!(e.contains("character device"), "{e}");
    std::fs::remove_file(&path).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&path).status();
    if made.is_ok_and(|s| s.success()) {
        let e = TextTokenizer::from_dir(&scratch).err().unwrap().to_string();
        assert!(e.contains("FIFO"), "{e}");
    }
    std::fs::remove_dir_all(&scratch).ok();
}
