//! What a call on the GPU IR interpreter (`gpu-sim`) will take, estimated before it runs, so
//! that a size it would spend hours on is refused at once with the numbers, not run with no
//! word.
//!
//! The interpreter runs every thread of every CTA one after another, checking each access, on
//! one core. Its rates, measured on the 2-core Sapphire Rapids VM (f32 specs, head dim 64):
//! about 10 MFLOP/s of attention forward, 4 MFLOP/s of backward, and about 10^7 operations a
//! second through a resident model's layer kernels (norms, RoPE, SwiGLU, residual adds), each
//! token and channel costing about a hundred.

use crate::error::RuntimeError;
use attn_dsl::AttentionSpec;
use attn_dsl::accounting::forward_flops;

/// The longest call the interpreter takes on, in estimated seconds.
pub const MAX_SECONDS: f64 = 300.0;

/// Attention forward FLOPs the interpreter runs a second.
const FORWARD_FLOPS_PER_S: f64 = 1e7;

/// Attention backward FLOPs (counted as 2.5 forwards) the interpreter runs a second.
const BACKWARD_FLOPS_PER_S: f64 = 4e6;

/// Interpreted operations a second through a model's layer kernels.
const LAYER_OPS_PER_S: f64 = 1e7;

/// Interpreted operations per token and channel of a layer's elementwise kernels.
const OPS_PER_TOKEN_CHANNEL: f64 = 100.0;

/// Estimated seconds of attention over `batch` sequences of `sq` queries against `skv` keys,
/// forward only or (`backward`) forward and backward.
pub fn attention_seconds(
    spec: &AttentionSpec,
    batch: u64,
    sq: u64,
    skv: u64,
    backward: bool,
) -> f64 {
    let flops =
        forward_flops(spec, batch, sq, skv).map_or(f64::INFINITY, |f| f.with_skipping as f64);
    let forward = flops / FORWARD_FLOPS_PER_S;
    if backward {
        forward + 2.5 * flops / BACKWARD_FLOPS_PER_S
    } else {
        forward
    }
}

/// Estimated seconds of one pass of a resident model's layers (`layers` of width `hidden` and
/// MLP width `intermediate`) over `tokens` new tokens against `keys` keys each.
pub fn layers_seconds(
    spec: &AttentionSpec,
    layers: u64,
    hidden: u64,
    intermediate: u64,
    tokens: u64,
    keys: u64,
) -> f64 {
    let elementwise =
        OPS_PER_TOKEN_CHANNEL * tokens as f64 * (hidden + intermediate) as f64 / LAYER_OPS_PER_S;
    layers as f64 * (attention_seconds(spec, 1, tokens, keys, false) + elementwise)
}

/// Refuses `what` on the interpreter when it would take more than [`MAX_SECONDS`].
pub fn check(what: &str, seconds: f64) -> Result<(), RuntimeError> {
    if seconds <= MAX_SECONDS {
        return Ok(());
    }
    let took = if seconds.is_finite() {
        format!("about {}", duration(seconds))
    } else {
        "longer than can be counted".to_string()
    };
    Err(RuntimeError::Data(format!(
        "gpu-sim: {what} would take {took} on the GPU IR interpreter (one core, about 10 \
         MFLOP/s of attention); the most it takes on is {}. Use --backend cpu (the same \
         semantics, compiled), or smaller inputs",
        duration(MAX_SECONDS)
    )))
}

/// Seconds in words: `40 s`, `7 minutes`, `3.2 hours`, `5.0 days`.
pub fn duration(seconds: f64) -> String {
    match seconds {
        s if s < 120.0 => format!("{s:.0} s"),
        s if s < 7200.0 => format!("{:.0} minutes", s / 60.0),
        s if s < 172_800.0 => format!("{:.1} hours", s / 3600.0),
        s => format!("{:.1} days", s / 86_400.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> AttentionSpec {
        attn_dsl::parse_str(text).unwrap()
    }

    #[test]
    fn costs_grow_with_the_work_and_large_calls_are_refused() {
        let causal = spec("heads = 4, head_dim = 64, mask = causal");
        let small = attention_seconds(&causal, 1, 256, 256, false);
        // 4 heads x 256 x 257 / 2 pairs x 256 FLOPs: about 3.4 s.
        assert!((2.0..5.0).contains(&small), "{small}");
        assert!(attention_seconds(&causal, 1, 256, 256, true) > 3.0 * small);
        assert!(check("a forward", small).is_ok());
        let big = attention_seconds(&causal, 1, 32_768, 32_768, false);
        let e = check("a forward", big).unwrap_err().to_string();
        assert!(e.contains("hours") && e.contains("--backend cpu"), "{e}");
        assert!(
            check("x", f64::INFINITY)
                .unwrap_err()
                .to_string()
                .contains("longer than")
        );
        let model = layers_seconds(&causal, 2, 256, 512, 256, 256);
        assert!(model > 2.0 * small);
    }

    #[test]
    fn durations_read_in_their_unit() {
        assert_eq!(duration(40.0), "40 s");
        assert_eq!(duration(420.0), "7 minutes");
        assert_eq!(duration(3.0 * 3600.0), "3.0 hours");
        assert_eq!(duration(5.0 * 86_400.0), "5.0 days");
    }
}
