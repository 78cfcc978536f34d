//! What a variant costs (from the accounting) and how fast attn's CPU runtime runs it (timed on
//! the trained model's own shape).

use attn::dsl::accounting::{forward_flops, kv_cache_bytes_per_token};
use attn::runtime::model::Model;
use std::time::Instant;

/// A model's size and costs per token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    /// Every stored parameter (a tied LM head counted once).
    pub params: u64,
    /// KV-cache bytes one token takes, over all layers.
    pub kv_bytes_per_token: u64,
    /// KV-cache bytes of a context of `seq` tokens, over all layers: a sliding-window layer
    /// holds at most its window.
    pub kv_cache_bytes: u64,
    /// Forward FLOPs per token at a context of `seq` tokens: two per weight of every matrix
    /// (the LM head included, tied or not) plus the attention core's average per token.
    pub flops_per_token: u64,
}

/// The costs of `model` at a context of `seq` tokens; `None` when a count passes 64 bits.
pub fn cost(model: &Model, seq: u64) -> Option<Cost> {
    let c = &model.config;
    let parts = model.parameters();
    let part = |name: &str| parts.iter().find(|(n, _)| *n == name).map_or(0, |p| p.1);
    let params = parts
        .iter()
        .try_fold(0u64, |sum, (_, n)| sum.checked_add(*n))?;
    let head = (c.vocab as u64).checked_mul(c.hidden as u64)?;
    let matrices = part("attention")
        .checked_add(part("mlp"))?
        .checked_add(head)?;
    let (mut core, mut kv_bytes_per_token, mut kv_cache_bytes) = (0u64, 0u64, 0u64);
    for i in 0..c.layers {
        let spec = c.layer_attention(i);
        core = core.checked_add(forward_flops(spec, 1, seq, seq)?.with_skipping / seq.max(1))?;
        let row = kv_cache_bytes_per_token(spec);
        kv_bytes_per_token = kv_bytes_per_token.checked_add(row)?;
        let held = match spec.mask {
            attn::Mask::SlidingWindow { window } => window.min(seq),
            _ => seq,
        };
        kv_cache_bytes = kv_cache_bytes.checked_add(row.checked_mul(held)?)?;
    }
    Some(Cost {
        params,
        kv_bytes_per_token,
        kv_cache_bytes,
        flops_per_token: matrices.checked_mul(2)?.checked_add(core)?,
    })
}

/// Measured speed of attn's CPU runtime on a model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Speed {
    /// A forward over `seq` tokens: `flops_per_token * seq` over its median time.
    pub prefill_gflops: f64,
    /// One token at a time after a prompt, through the paged KV cache: one over the median
    /// step time.
    pub decode_tokens_per_s: f64,
}

/// Fewest timed prefills, and decode sessions; more run until [`MIN_SECONDS`] have passed.
const MIN_RUNS: usize = 3;
/// Most timed prefills, and decode sessions.
const MAX_RUNS: usize = 50;
/// Time spent on each of prefill and decode before the runs stop, once [`MIN_RUNS`] are in.
const MIN_SECONDS: f64 = 0.5;
/// Decode steps timed per session (fewer when `seq` is short).
const DECODE_STEPS: usize = 32;

/// Times `model` at `seq` tokens: prefill (after one untimed run) and decode steps that end at
/// `seq` tokens in the cache, each repeated until both a few runs and half a second are in, and
/// summarized by the median.
pub fn speed(model: &Model, seq: usize, flops_per_token: u64) -> Result<Speed, String> {
    let err = |e: attn::runtime::RuntimeError| format!("error: timing the model: {e}");
    let vocab = model.config.vocab as u32;
    let tokens: Vec<u32> = (0..seq as u32).map(|i| (i * 7 + 3) % vocab).collect();
    model.forward(&tokens).map_err(err)?;
    let mut prefill = repeat(|| {
        let start = Instant::now();
        model.forward(&tokens).map_err(err)?;
        Ok(vec![start.elapsed().as_secs_f64()])
    })?;
    let steps = DECODE_STEPS.min(seq / 2).max(1);
    let prompt = seq.saturating_sub(steps).max(1);
    let mut decode = repeat(|| {
        let mut session = model.session(prompt + steps, 16).map_err(err)?;
        session.step(&tokens[..prompt]).map_err(err)?;
        tokens[prompt..]
            .iter()
            .chain(std::iter::repeat(&0))
            .take(steps)
            .map(|&t| {
                let start = Instant::now();
                session.step(&[t]).map_err(err)?;
                Ok(start.elapsed().as_secs_f64())
            })
            .collect()
    })?;
    Ok(Speed {
        prefill_gflops: flops_per_token as f64 * seq as f64 / median(&mut prefill) / 1e9,
        decode_tokens_per_s: 1.0 / median(&mut decode),
    })
}

/// The times of `run`'s runs, from at least [`MIN_RUNS`] of them, more while less than
/// [`MIN_SECONDS`] are in and fewer than [`MAX_RUNS`] have run.
fn repeat(mut run: impl FnMut() -> Result<Vec<f64>, String>) -> Result<Vec<f64>, String> {
    let mut times = Vec::new();
    for i in 0..MAX_RUNS {
        if i >= MIN_RUNS && times.iter().sum::<f64>() >= MIN_SECONDS {
            break;
        }
        times.extend(run()?);
    }
    Ok(times)
}

fn median(times: &mut [f64]) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn::runtime::model::ModelConfig;

    fn model(spec: &str, tie: bool) -> Model {
        let text = format!(
            "vocab = 256\nhidden = 32\nlayers = 2\nintermediate = 64\ntie_embeddings = {tie}\n\
             attention = \"{spec}\"\n"
        );
        let config: ModelConfig = attn::research::config_from_toml(&text).unwrap();
        Model::random(&config, 0).unwrap()
    }

    #[test]
    fn costs_count_every_part_by_hand() {
        let m = model("heads = 4, kv_heads = 2, head_dim = 8, mask = none", true);
        let c = cost(&m, 16).unwrap();
        // Per layer: q 32x32, k and v 32x16 each, o 32x32; SwiGLU 3 x 32x64; two norms of 32.
        let attention = 32 * 32 * 2 + 32 * 16 * 2;
        let mlp = 3 * 32 * 64;
        let layer = attention + mlp + 2 * 32;
        assert_eq!(c.params, 256 * 32 + 2 * layer + 32);
        // kv_heads * (head_dim + v_head_dim) * 4 bytes, per layer.
        assert_eq!(c.kv_bytes_per_token, 2 * 2 * 16 * 4);
        // Dense attention over 16 keys: 2 * (8 + 8) per key and head, 4 heads.
        let core = 2 * 16 * 16 * 4;
        assert_eq!(
            c.flops_per_token,
            2 * (2 * (attention + mlp) + 256 * 32) + 2 * core
        );
        let untied = cost(
            &model("heads = 4, kv_heads = 2, head_dim = 8, mask = none", false),
            16,
        )
        .unwrap();
        assert_eq!(untied.params, c.params + 256 * 32);
        assert_eq!(untied.flops_per_token, c.flops_per_token);
    }

    #[test]
    fn speeds_are_positive_and_finite() {
        let m = model(
            "heads = 4, head_dim = 8, mask = causal, position = rope",
            true,
        );
        let flops = cost(&m, 8).unwrap().flops_per_token;
        for seq in [1, 2, 8] {
            let s = speed(&m, seq, flops).unwrap();
            assert!(
                s.prefill_gflops > 0.0 && s.prefill_gflops.is_finite(),
                "{s:?}"
            );
            assert!(s.decode_tokens_per_s > 0.0 && s.decode_tokens_per_s.is_finite());
        }
    }
}
