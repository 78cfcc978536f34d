//! Deterministic pseudo-random inputs: one xorshift64 sequence per seed ([`XorShift`]), the
//! values every test, benchmark, example and `attnc bench` command draws (attn-runtime's
//! `inputs` makes tensors of them), and the stream research models' initial weights and
//! `attnc train`'s batches come from. Not for anything that needs statistical quality.

/// A xorshift64 generator (shifts 13, 7, 17): the same seed gives the same sequence on every
/// machine. Its state is one `u64`, which [`XorShift::state`] and [`XorShift::from_state`]
/// save and restore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XorShift(u64);

impl XorShift {
    /// The generator of `seed` (any value, 0 included).
    pub fn new(seed: u64) -> XorShift {
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// A generator that continues from a saved [`state`](XorShift::state); `None` for 0,
    /// which no generator reaches.
    pub fn from_state(state: u64) -> Option<XorShift> {
        (state != 0).then_some(XorShift(state))
    }

    /// Where the generator is: what [`from_state`](XorShift::from_state) continues from.
    pub fn state(self) -> u64 {
        self.0
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// The next value in [-1, 1), from 24 random bits.
    pub fn next_f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The next value in [-1, 1), from 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
}

/// `n` values in [-1, 1) from 24 random bits each; `seed` picks the sequence.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = XorShift::new(seed);
    (0..n).map(|_| rng.next_f32()).collect()
}

/// `n` values in [-1, 1) from 53 random bits each (for float64 reference arrays); `seed`
/// picks the sequence.
pub fn values_f64(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = XorShift::new(seed);
    (0..n).map(|_| rng.next_f64()).collect()
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
