//! Three models that differ only in their attention (MHA, GQA, MLA) at about the same size:
//! their parameter and KV-cache accounting side by side, then a few greedy tokens from each
//! (random weights, so the tokens only show that each model runs end to end).
//!
//! Run with `cargo run --release --example attention_variants`.

use attn::accounting::kv_cache_bytes_per_token;
use attn::research::config_from_toml;
use attn::{Model, Request, Sampling};

const VARIANTS: &[(&str, &str)] = &[
    (
        "MHA",
        "heads = 8, head_dim = 64, mask = causal, position = rope",
    ),
    (
        "GQA",
        "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope",
    ),
    (
        "MLA",
        "heads = 8, head_dim = 64, mla(latent_rank = 128, rope_dim = 32), mask = causal, \
         position = rope(layout = interleaved)",
    ),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "{:<5} {:>12} {:>12} {:>16} {:>18}",
        "", "parameters", "attention", "KV bytes/token", "KV at 32k tokens"
    );
    println!(
        "{:<5} {:>12} {:>12} {:>16} {:>18}",
        "", "(all)", "(params)", "(all layers)", "(one sequence)"
    );
    let mut models = Vec::new();
    for (name, attention) in VARIANTS {
        let config = config_from_toml(&format!(
            "vocab = 4096\nhidden = 512\nlayers = 4\nattention = \"{attention}\""
        ))?;
        let model = Model::random(&config, 42)?;
        let parts = model.parameters();
        let total: u64 = parts.iter().map(|(_, n)| n).sum();
        let attn = parts
            .iter()
            .find(|(p, _)| *p == "attention")
            .map_or(0, |p| p.1);
        let kv: u64 = (0..config.layers)
            .map(|i| kv_cache_bytes_per_token(config.layer_attention(i)))
            .sum();
        println!(
            "{name:<5} {total:>12} {attn:>12} {kv:>16} {:>15.1} MiB",
            (kv * 32_768) as f64 / (1 << 20) as f64
        );
        models.push((name, model));
    }
    let request = Request {
        prompt: vec![1, 2, 3, 4],
        max_new_tokens: 8,
        stop: Vec::new(),
    };
    println!(
        "\ngreedy continuations of the prompt {:?} (random weights: the ids only show that \
         each model runs end to end)",
        request.prompt
    );
    for (name, model) in &models {
        let tokens = model.generate(std::slice::from_ref(&request), Sampling::greedy(), |_| {})?;
        println!("{name:<5} new token ids {:?}", tokens[0]);
    }
    Ok(())
}
