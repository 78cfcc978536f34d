//! Generation: every prompt prefilled in one ragged step, then one token per sequence per step
//! against the paged caches, greedy or sampled (temperature, top-k, top-p; seeded), until a stop
//! token or the token budget.

use super::Model;
use crate::error::RuntimeError;
use crate::ops::LayerOps;
use std::time::{Duration, Instant};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 for greedy (the most likely token); else logits are divided by it.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`.
    pub top_p: Option<f32>,
    /// Seed of the sampler (the same seed and inputs give the same tokens).
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }
}

/// One prompt to continue.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The prompt's tokens (at least one).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// Tokens that end the generation (included in the output).
    pub stop: Vec<u32>,
}

/// Where a generation stands, for progress output.
#[derive(Clone, Debug)]
pub struct Progress {
    /// Tokens generated so far, over all requests.
    pub generated: usize,
    /// Requests still running.
    pub running: usize,
    /// Time since the first decode step (after the prefill).
    pub decoding: Duration,
    /// Time the prefill took.
    pub prefill: Duration,
    /// The tokens this step chose: `(request index, token)`.
    pub new_tokens: Vec<(usize, u32)>,
}

/// A small seeded generator (xorshift64*), enough for sampling.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in [0, 1).
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The next token from one row of logits (greedy choice on `ops`).
pub(crate) fn choose(
    ops: &dyn LayerOps,
    logits: &[f32],
    sampling: &Sampling,
    rng: &mut Rng,
) -> Result<u32, RuntimeError> {
    if let Some(i) = logits.iter().position(|l| l.is_nan()) {
        return Err(RuntimeError::Data(format!(
            "the model's logits hold NaN (token {i}'s among them): its weights or the prompt \
             make values that are not finite, so no token is chosen from them"
        )));
    }
    if sampling.temperature <= 0.0 {
        return ops
            .argmax(logits, logits.len())?
            .first()
            .copied()
            .filter(|&id| id != crate::ops::NO_CHOICE)
            .ok_or_else(|| RuntimeError::Data("no logit above -inf to choose from".into()));
    }
    let t = f64::from(sampling.temperature);
    let mut ranked: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &v)| (i, f64::from(v) / t))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    if let Some(k) = sampling.top_k {
        ranked.truncate(k.max(1));
    }
    let max = ranked[0].1;
    let mut probs: Vec<f64> = ranked.iter().map(|&(_, v)| (v - max).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(top_p) = sampling.top_p {
        let mut mass = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                mass += p;
                mass >= f64::from(top_p)
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    let mut u = rng.next();
    for (p, &(i, _)) in probs.iter().zip(&ranked) {
        if u < *p {
            return Ok(i as u32);
        }
        u -= p;
    }
    Ok(ranked[probs.len() - 1].0 as u32)
}

impl Model {
    /// Continues every request (batched: all prompts in one prefill step, then one token per
    /// running request per step); returns the generated tokens of each. `progress` is called
    /// after every step.
    pub fn generate(
        &self,
        requests: &[Request],
        sampling: Sampling,
        mut progress: impl FnMut(Progress),
    ) -> Result<Vec<Vec<u32>>, RuntimeError> {
        if let Some(i) = requests.iter().position(|r| r.prompt.is_empty()) {
            return Err(RuntimeError::Data(format!(
                "request {i} has an empty prompt"
            )));
        }
        let capacity = requests
            .iter()
            .try_fold(0usize, |sum, r| {
                sum.checked_add(r.prompt.len())?
                    .checked_add(r.max_new_tokens)?
                    .checked_add(16)
            })
            .ok_or_else(|| {
                RuntimeError::Data(
                    "the requests' prompts and new tokens add up to more than 2^64 tokens".into(),
                )
            })?;
        let mut batch = self.batch(capacity, 16)?;
        let ids: Vec<usize> = requests.iter().map(|_| batch.add_sequence()).collect();
        let mut rng = Rng::new(sampling.seed);
        let ops = self.layer_ops();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
        let vocab = self.config.vocab;
        let start = Instant::now();
        let inputs: Vec<(usize, &[u32])> = requests
            .iter()
            .zip(&ids)
            .filter(|(r, _)| r.max_new_tokens > 0)
            .map(|(r, &s)| (s, r.prompt.as_slice()))
            .collect();
        let logits = batch.step(&inputs)?;
        let prefill = start.elapsed();
        let mut next: Vec<(usize, u32)> = Vec::new();
        for (&(s, prompt), l) in inputs.iter().zip(&logits) {
            let last = &l[(prompt.len() - 1) * vocab..];
            next.push((s, choose(ops, last, &sampling, &mut rng)?));
        }
        let decode_start = Instant::now();
        let mut generated = 0;
        loop {
            // Record the chosen tokens; keep the requests that go on.
            let mut running = Vec::new();
            for &(s, token) in &next {
                out[s].push(token);
                generated += 1;
                let r = &requests[s];
                if !r.stop.contains(&token) && out[s].len() < r.max_new_tokens {
                    running.push((s, token));
                }
            }
            progress(Progress {
                generated,
                running: running.len(),
                decoding: decode_start.elapsed(),
                prefill,
                new_tokens: next.clone(),
            });
            if running.is_empty() {
                break;
            }
            let tokens: Vec<[u32; 1]> = running.iter().map(|&(_, t)| [t]).collect();
            let inputs: Vec<(usize, &[u32])> = running
                .iter()
                .zip(&tokens)
                .map(|(&(s, _), t)| (s, t.as_slice()))
                .collect();
            let logits = batch.step(&inputs)?;
            next = running
                .iter()
                .zip(&logits)
                .map(|(&(s, _), l)| Ok((s, choose(ops, l, &sampling, &mut rng)?)))
                .collect::<Result<_, RuntimeError>>()?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::CpuLayers;

    #[test]
    fn greedy_takes_the_largest_logit() {
        let mut rng = Rng::new(1);
        assert_eq!(
            choose(
                &CpuLayers,
                &[0.1, 3.0, -1.0, 2.9],
                &Sampling::greedy(),
                &mut rng
            )
            .unwrap(),
            1
        );
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let logits = [5.0, 4.0, 0.0, -3.0];
        for seed in 0..200 {
            let mut rng = Rng::new(seed);
            let k = Sampling {
                temperature: 1.0,
                top_k: Some(2),
                top_p: None,
                seed,
            };
            assert!(choose(&CpuLayers, &logits, &k, &mut rng).unwrap() < 2);
            // p(0) = 0.72 of all: top-p 0.5 keeps only token 0.
            let p = Sampling {
                top_k: None,
                top_p: Some(0.5),
                ..k
            };
            assert_eq!(choose(&CpuLayers, &logits, &p, &mut rng).unwrap(), 0);
        }
    }

    #[test]
    fn sampling_follows_the_softmax() {
        // Two tokens with probabilities 1/(1+e) and e/(1+e) at temperature 1.
        let logits = [0.0, 1.0];
        let s = Sampling {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed: 7,
        };
        let mut rng = Rng::new(7);
        let n = 20_000;
        let ones = (0..n)
            .filter(|_| choose(&CpuLayers, &logits, &s, &mut rng).unwrap() == 1)
            .count();
        let want = std::f64::consts::E / (1.0 + std::f64::consts::E);
        let got = ones as f64 / n as f64;
        assert!((got - want).abs() < 0.015, "{got} vs {want}");
    }
}
