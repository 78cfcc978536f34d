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
        attn_runtime::backend::GpuInterpreter,
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
