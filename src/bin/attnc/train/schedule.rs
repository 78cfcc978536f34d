//! The learning-rate schedule: linear warmup, then a cosine down to a tenth of the peak.

use std::f64::consts::PI;

/// The learning rate of step `step` (1 to `steps`): `peak * step / warmup` during the warmup,
/// then `floor + (peak - floor) (1 + cos(pi t)) / 2` with `t` from 0 to 1 over the remaining
/// steps and `floor = peak / 10`.
pub fn learning_rate(step: u64, steps: u64, warmup: u64, peak: f64) -> f64 {
    if step <= warmup {
        return peak * step as f64 / warmup as f64;
    }
    let floor = peak / 10.0;
    let span = steps.saturating_sub(warmup).max(1);
    let t = ((step - warmup) as f64 / span as f64).min(1.0);
    floor + (peak - floor) * (1.0 + (PI * t).cos()) / 2.0
}

#[cfg(test)]
mod tests {
    use super::learning_rate;

    #[test]
    fn warmup_rises_linearly_then_the_cosine_ends_at_a_tenth() {
        let lr = |s| learning_rate(s, 100, 10, 1.0);
        assert!((lr(1) - 0.1).abs() < 1e-12);
        assert!((lr(5) - 0.5).abs() < 1e-12);
        assert!((lr(10) - 1.0).abs() < 1e-12);
        assert!((lr(55) - 0.55).abs() < 1e-12, "halfway down: {}", lr(55));
        assert!((lr(100) - 0.1).abs() < 1e-12);
        assert!((1..100).all(|s| lr(s + 1) <= lr(s) || s < 10));
        // No warmup, one step, and steps past the end stay at the floor.
        assert!((learning_rate(1, 1, 0, 2.0) - 0.2).abs() < 1e-12);
        assert!((learning_rate(150, 100, 10, 1.0) - 0.1).abs() < 1e-12);
    }
}
