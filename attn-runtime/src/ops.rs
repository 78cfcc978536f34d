//! The decoder's operations other than attention and the projections: row norms, MLP
//! activations, residual adds, embedding lookups and greedy choice, behind [`LayerOps`]. They
//! run on the CPU here ([`CpuLayers`]), or as the GPU IR kernels of
//! `codegen::gpu::kernels::layers` on a device (`gpu::layer_ops::DeviceLayers`; `gpu-sim` on
//! the interpreter); a model takes them apart from its attention's backend
//! (`Model::set_layer_ops`), and [`crate::backends::layer_ops`] gives the ones a backend name
//! goes with.

use crate::error::RuntimeError;
use crate::tensor::Storage;
pub use codegen::gpu::kernels::layers::NO_CHOICE;
use rayon::prelude::*;

/// Normalization layers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormKind {
    /// `x / sqrt(mean(x^2) + eps) * w` (Llama and most current families).
    Rms,
    /// `(x - mean) / sqrt(var + eps) * w + b` (older families).
    Layer,
}

/// MLP blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MlpKind {
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu,
    /// `down(gelu(up(x)))` (tanh approximation).
    Gelu,
    /// `down(gelu(up(x)))`, GELU exactly: `0.5 x (1 + erf(x / sqrt 2))` (gpt_neox).
    GeluExact,
    /// `down(gelu(gate(x)) * up(x))`, GELU in its tanh approximation (gemma).
    GeGlu,
    /// gpt-oss's SwiGLU: `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
    /// `down((u + 1) g sigmoid(alpha g))`.
    ClampedSwiGlu {
        /// The sigmoid's slope.
        alpha: f32,
        /// The clamp.
        limit: f32,
    },
}

impl MlpKind {
    /// Whether the MLP has a gate projection (the GLU kinds).
    pub fn gated(self) -> bool {
        !matches!(self, MlpKind::Gelu | MlpKind::GeluExact)
    }
}

/// Norms, activations, adds, lookups and argmax over f32 rows.
pub trait LayerOps: Send + Sync {
    /// Rows of `w.len()` values (`weight = (w, groups)`) normalized (`kind`, `eps`) in `groups`
    /// equal segments with their own statistics (1: the whole row; cohere's q/k norms: one per
    /// head), scaled by `w`, plus `bias` where given.
    fn norm(
        &self,
        kind: NormKind,
        eps: f64,
        weight: (&[f32], usize),
        bias: Option<&[f32]>,
        x: &[f32],
    ) -> Result<Vec<f32>, RuntimeError>;

    /// The MLP's activation in place on `up`: `silu(gate) * up` (SwiGLU, with its gate) or
    /// `gelu(up)`.
    fn activate(
        &self,
        kind: MlpKind,
        up: &mut [f32],
        gate: Option<&[f32]>,
    ) -> Result<(), RuntimeError>;

    /// `x += y`.
    fn add(&self, x: &mut [f32], y: &[f32]) -> Result<(), RuntimeError>;

    /// Rows `tokens` of a `[vocab, width]` table (already checked against the vocabulary), as
    /// f32.
    fn embed(
        &self,
        table: &Storage,
        width: usize,
        tokens: &[u32],
    ) -> Result<Vec<f32>, RuntimeError>;

    /// The index of each row's largest value (rows of `width`), the first of equal ones; NaN
    /// is never chosen over a number, and a row with no value above `-inf` (NaN throughout)
    /// gives [`NO_CHOICE`].
    fn argmax(&self, rows: &[f32], width: usize) -> Result<Vec<u32>, RuntimeError>;
}

/// GELU in its tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
fn gelu_tanh(x: f32) -> f32 {
    let inner = 0.797_884_6 * (x + 0.044_715 * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

/// Values per task of the CPU's elementwise operations and norms: a decoding step's few rows
/// stay on one thread, a prefill's spread over all.
const CHUNK: usize = 1 << 14;

/// `up[i] = f(up[i], gate[i])` for all `i`, over rayon's threads (equal lengths).
fn with_gate(up: &mut [f32], gate: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    up.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .for_each(|(up, gate)| {
            for (h, &g) in up.iter_mut().zip(gate) {
                *h = f(*h, g);
            }
        });
}

/// `up[i] = f(up[i])` for all `i`, over rayon's threads.
fn each(up: &mut [f32], f: impl Fn(f32) -> f32 + Sync) {
    up.par_chunks_mut(CHUNK)
        .for_each(|up| up.iter_mut().for_each(|h| *h = f(*h)));
}

/// Checks that `b` has as many values as `a` (`what` names them in the error).
pub(crate) fn same_len(a: usize, b: usize, what: &str) -> Result<(), RuntimeError> {
    if a == b {
        Ok(())
    } else {
        Err(RuntimeError::Data(format!("{what}: {a} and {b} values")))
    }
}

/// The width of each of `groups` equal segments of a `width`-value row; an error unless they
/// divide it.
pub(crate) fn segment(width: usize, groups: usize) -> Result<usize, RuntimeError> {
    match width.checked_div(groups) {
        Some(n) if n > 0 && n * groups == width => Ok(n),
        _ => Err(RuntimeError::Data(format!(
            "a norm of {width} weights in {groups} segments; allowed: segments that divide it"
        ))),
    }
}

/// Checks that `x` holds whole rows of `width` values.
pub(crate) fn whole_rows(x: usize, width: usize) -> Result<usize, RuntimeError> {
    if width > 0 && x.is_multiple_of(width) {
        Ok(x / width)
    } else {
        Err(RuntimeError::Data(format!(
            "{x} values are not rows of {width}"
        )))
    }
}

/// The operations on the CPU (norm statistics in f64).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuLayers;

impl LayerOps for CpuLayers {
    fn norm(
        &self,
        kind: NormKind,
        eps: f64,
        (weight, groups): (&[f32], usize),
        bias: Option<&[f32]>,
        x: &[f32],
    ) -> Result<Vec<f32>, RuntimeError> {
        let n = segment(weight.len(), groups)?;
        whole_rows(x.len(), weight.len())?;
        if let Some(b) = bias {
            same_len(weight.len(), b.len(), "norm weight and bias")?;
        }
        let mut y = vec![0f32; x.len()];
        let segments = x.par_chunks_exact(n).zip(y.par_chunks_exact_mut(n));
        let segments = segments.enumerate().with_min_len(CHUNK / n.max(1));
        segments.for_each(|(j, (src, dst))| {
            // Segment `j` of the input takes segment `j % groups` of the weights.
            let weight = &weight[(j % groups) * n..][..n];
            let bias = bias.map(|b| &b[(j % groups) * n..][..n]);
            let mean = match kind {
                NormKind::Rms => 0.0,
                NormKind::Layer => src.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64,
            };
            let var = src
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / n as f64;
            let inv = 1.0 / (var + eps).sqrt();
            for (i, (d, &s)) in dst.iter_mut().zip(src).enumerate() {
                let b = bias.map_or(0.0, |b| f64::from(b[i]));
                *d = ((f64::from(s) - mean) * inv * f64::from(weight[i]) + b) as f32;
            }
        });
        Ok(y)
    }

    fn activate(
        &self,
        kind: MlpKind,
        up: &mut [f32],
        gate: Option<&[f32]>,
    ) -> Result<(), RuntimeError> {
        match (kind, gate) {
            (MlpKind::SwiGlu, Some(gate)) => {
                same_len(up.len(), gate.len(), "SwiGLU's up and gate")?;
                with_gate(up, gate, |h, g| h * (g / (1.0 + (-g).exp())));
            }
            (MlpKind::GeGlu, Some(gate)) => {
                same_len(up.len(), gate.len(), "GeGLU's up and gate")?;
                with_gate(up, gate, |h, g| h * gelu_tanh(g));
            }
            (MlpKind::ClampedSwiGlu { alpha, limit }, Some(gate)) => {
                same_len(up.len(), gate.len(), "the clamped SwiGLU's up and gate")?;
                with_gate(up, gate, |h, g| {
                    let g = g.min(limit);
                    let u = h.clamp(-limit, limit);
                    (u + 1.0) * g / (1.0 + (-alpha * g).exp())
                });
            }
            (MlpKind::SwiGlu | MlpKind::GeGlu | MlpKind::ClampedSwiGlu { .. }, None) => {
                return Err(RuntimeError::Data(format!("{kind:?} needs its gate")));
            }
            (MlpKind::Gelu, _) => each(up, gelu_tanh),
            (MlpKind::GeluExact, _) => each(up, |h| {
                0.5 * h * (1.0 + libm::erff(h * std::f32::consts::FRAC_1_SQRT_2))
            }),
        }
        Ok(())
    }

    fn add(&self, x: &mut [f32], y: &[f32]) -> Result<(), RuntimeError> {
        same_len(x.len(), y.len(), "a residual add")?;
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
        Ok(())
    }

    fn embed(
        &self,
        table: &Storage,
        width: usize,
        tokens: &[u32],
    ) -> Result<Vec<f32>, RuntimeError> {
        let mut x = Vec::with_capacity(tokens.len() * width);
        let outside = |t: u32| RuntimeError::Data(format!("token {t} is outside the table"));
        for &t in tokens {
            let range = t as usize * width..(t as usize + 1) * width;
            match table {
                Storage::F32(v) => x.extend_from_slice(v.get(range).ok_or_else(|| outside(t))?),
                Storage::F16(v) => x.extend(
                    v.get(range)
                        .ok_or_else(|| outside(t))?
                        .iter()
                        .map(|x| x.to_f32()),
                ),
                Storage::Bf16(v) => x.extend(
                    v.get(range)
                        .ok_or_else(|| outside(t))?
                        .iter()
                        .map(|x| x.to_f32()),
                ),
            }
        }
        Ok(x)
    }

    fn argmax(&self, rows: &[f32], width: usize) -> Result<Vec<u32>, RuntimeError> {
        whole_rows(rows.len(), width)?;
        Ok(rows
            .chunks(width.max(1))
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold(
                        (NO_CHOICE as usize, f32::NEG_INFINITY),
                        |(bi, bv), (i, &v)| {
                            if v > bv { (i, v) } else { (bi, bv) }
                        },
                    )
                    .0 as u32
            })
            .collect())
    }
}
