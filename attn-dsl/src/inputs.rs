//! Deterministic pseudo-random inputs: one xorshift64 sequence per seed, the values every test,
//! benchmark, example and `attnc bench` command draws (attn-runtime's `inputs` makes tensors of
//! them). Not for anything that needs statistical quality.

/// The xorshift64 state a seed starts from (never 0).
fn start(seed: u64) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

/// The next state of the sequence.
fn next(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// `n` values in [-1, 1) from 24 random bits each; `seed` picks the sequence.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = start(seed);
    (0..n)
        .map(|_| ((next(&mut s) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        .collect()
}

/// `n` values in [-1, 1) from 53 random bits each (for float64 reference arrays); `seed`
/// picks the sequence.
pub fn values_f64(n: usize, seed: u64) -> Vec<f64> {
    let mut s = start(seed);
    (0..n)
        .map(|_| (next(&mut s) >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_lie_in_the_unit_interval_and_differ_by_seed() {
        let a = values(10_000, 1);
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = a.iter().map(|&x| f64::from(x)).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert_ne!(a[..8], values(8, 2)[..]);
        assert_eq!(a[..8], values(8, 1)[..]);
        let b = values_f64(10_000, 1);
        assert!(b.iter().all(|x| (-1.0..1.0).contains(x)));
        // The f32 values are the same draws at 24 bits.
        assert!((f64::from(a[0]) - b[0]).abs() < 1e-6);
    }
}
