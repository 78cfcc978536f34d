//! The pieces of a decoder layer on f32 rows: linear maps over weights kept in their
//! checkpoint's dtype (matrix-vector products for a few rows, a GEMM for more), norms and MLPs.

use super::config::{MlpKind, NormKind, Router};
use crate::cpu::microkernels::Isa;
use crate::cpu::{bf16_gemm, f32_gemm, gemv};
use crate::error::RuntimeError;
use crate::host::gemm::gemm;
use crate::ops::LayerOps;
use crate::tensor::Storage;

/// Weight values a 16-bit matrix converts to f32 at a time for a GEMM (16 MiB as f32): a block
/// of its rows, multiplied with every thread before the next is converted. Smaller blocks make
/// skinny products that repack the inputs each time: on the 2-core Zen 4 VM, 64 Ki values
/// prefilled 512 tokens of a 168M bf16 llama at 285 tokens/s, 4 Mi at 350.
const BLOCK_VALUES: usize = 1 << 22;

/// A weight matrix `[rows, cols]`, row-major, in the dtype its checkpoint stored (f32, bf16 or
/// f16): 16-bit weights stay 16-bit in memory, and products convert them a block of rows at a
/// time.
#[derive(Debug)]
pub(crate) struct Matrix {
    pub rows: usize,
    pub cols: usize,
    data: Storage,
    /// Whether products with bf16 weights round their inputs to bf16 (as PyTorch's bf16
    /// products do); false for weights that are bf16 only as a way to hold exact values
    /// (dequantized MXFP4).
    round_inputs: bool,
}

impl Matrix {
    /// A matrix over `data` (`rows * cols` values).
    pub fn new(rows: usize, cols: usize, data: Storage) -> Matrix {
        debug_assert_eq!(rows * cols, data.len());
        Matrix {
            rows,
            cols,
            data,
            round_inputs: true,
        }
    }

    /// Products multiply the inputs as they are, even with bf16 weights: for weights whose
    /// values bf16 holds exactly and whose reference multiplies them in f32 (dequantized
    /// MXFP4).
    pub fn keep_inputs_exact(&mut self) {
        self.round_inputs = false;
    }

    /// Values stored.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Bytes stored.
    pub fn bytes(&self) -> u64 {
        let size = match &self.data {
            Storage::F32(_) => 4,
            Storage::F16(_) | Storage::Bf16(_) => 2,
        };
        (self.len() * size) as u64
    }

    /// The values, in the checkpoint's dtype.
    pub fn storage(&self) -> &Storage {
        &self.data
    }

    /// `n x rows` outputs `x W^T` for `n x cols` inputs `x`. A few rows (decoding) take the
    /// matrix-vector products, which read the weights once in their stored dtype. More go to
    /// a GEMM: `vdpbf16ps` for bf16 weights where the CPU has it; else, on AVX-512, f32 FMAs
    /// over panels of weights widened once each (`cpu::f32_gemm`); else the gemm crate, f32
    /// weights as they are and 16-bit ones in blocks of rows ([`BLOCK_VALUES`]), each
    /// converted and then multiplied on every thread. Products with bf16 weights take their
    /// inputs rounded to bf16 on every path (`gemv::round_to_bf16`), unless
    /// [`Matrix::keep_inputs_exact`].
    pub fn matmul_t(&self, x: &[f32], n: usize) -> Vec<f32> {
        self.matmul_t_on(Isa::chosen(), x, n)
    }

    /// [`Matrix::matmul_t`] with the kernels of `isa` (one this CPU runs).
    fn matmul_t_on(&self, isa: Isa, x: &[f32], n: usize) -> Vec<f32> {
        let (out, inp) = (self.rows, self.cols);
        if n <= gemv::MAX_ROWS {
            return gemv::matmul_t(isa, &self.data, out, inp, x, n, self.round_inputs);
        }
        // As every product with bf16 weights: the inputs rounded to bf16.
        let round = self.round_inputs && matches!(self.data, Storage::Bf16(_));
        if let (Storage::Bf16(w), true) = (&self.data, round)
            && let Some(y) = bf16_gemm::matmul_t(isa, w, out, inp, x, n)
        {
            return y;
        }
        if let Some(y) = f32_gemm::matmul_t(isa, &self.data, out, inp, x, n, round) {
            return y;
        }
        match &self.data {
            Storage::F32(w) => {
                let mut y = vec![0f32; n * out];
                gemm(n, inp, out, x, (inp, 1), w, (1, inp), &mut y, out);
                y
            }
            _ if round => {
                let rounded: Vec<f32> = x.iter().map(|&v| gemv::round_to_bf16(v)).collect();
                self.widened_product(&rounded, n)
            }
            _ => self.widened_product(x, n),
        }
    }

    /// The GEMM over 16-bit weights widened a block of rows at a time.
    fn widened_product(&self, x: &[f32], n: usize) -> Vec<f32> {
        let (out, inp) = (self.rows, self.cols);
        let mut y = vec![0f32; n * out];
        let block = (BLOCK_VALUES / inp.max(1)).clamp(1, out.max(1));
        let mut w = Vec::with_capacity(block * inp);
        for first in (0..out).step_by(block) {
            let count = block.min(out - first);
            self.data
                .widen_to(first * inp..(first + count) * inp, &mut w);
            // Columns first..first + count of every output row.
            gemm(
                n,
                inp,
                count,
                x,
                (inp, 1),
                &w,
                (1, inp),
                &mut y[first..],
                out,
            );
        }
        y
    }
}

/// `y = x W^T (+ b)` with `W [out, in]` row-major (the PyTorch / safetensors layout).
#[derive(Debug)]
pub(crate) struct Linear {
    pub w: Matrix,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// Output features.
    pub fn out(&self) -> usize {
        self.w.rows
    }

    /// `rows x out` outputs for `rows x inp` inputs.
    pub fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let y = self.w.matmul_t(x, rows);
        self.biased(y)
    }

    /// [`Linear::apply`] of each of `maps` (which share their input width) to the same
    /// inputs: for a few rows, one matrix-vector pass over all of them.
    pub fn apply_all<const N: usize>(maps: [&Linear; N], x: &[f32], rows: usize) -> [Vec<f32>; N] {
        let (cols, round) = (maps[0].w.cols, maps[0].w.round_inputs);
        let alike = maps
            .iter()
            .all(|m| m.w.cols == cols && m.w.round_inputs == round);
        if rows > gemv::MAX_ROWS || !alike {
            return maps.map(|m| m.apply(x, rows));
        }
        let mats: Vec<(&Storage, usize)> = maps.iter().map(|m| (&m.w.data, m.w.rows)).collect();
        let mut ys = gemv::matmul_t_many(Isa::chosen(), &mats, cols, x, rows, round).into_iter();
        maps.map(|m| m.biased(ys.next().expect("one output per map")))
    }

    /// `y` with the bias added to each row.
    fn biased(&self, mut y: Vec<f32>) -> Vec<f32> {
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.out()) {
                for (v, b) in row.iter_mut().zip(b) {
                    *v += b;
                }
            }
        }
        y
    }
}

/// A norm over rows of `weight.len()` values, each row normalized in `groups` equal segments.
#[derive(Clone, Debug)]
pub(crate) struct Norm {
    pub kind: NormKind,
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub eps: f64,
    /// Segments per row with their own statistics: 1, or the heads of cohere's q/k norms
    /// (each head normalized alone, with its own weights).
    pub groups: usize,
}

impl Norm {
    /// The normalized rows, on `ops`.
    pub fn apply(&self, ops: &dyn LayerOps, x: &[f32]) -> Result<Vec<f32>, RuntimeError> {
        let weight = (self.weight.as_slice(), self.groups);
        ops.norm(self.kind, self.eps, weight, self.bias.as_deref(), x)
    }
}

/// An MLP block.
#[derive(Debug)]
pub(crate) struct Mlp {
    pub kind: MlpKind,
    /// SwiGLU's gate projection.
    pub gate: Option<Linear>,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    /// `down(act(up(x)))`, the activation on `ops`.
    pub fn apply(
        &self,
        ops: &dyn LayerOps,
        x: &[f32],
        rows: usize,
    ) -> Result<Vec<f32>, RuntimeError> {
        let (mut h, gate) = match &self.gate {
            Some(g) => {
                let [h, gate] = Linear::apply_all([&self.up, g], x, rows);
                (h, Some(gate))
            }
            None => (self.up.apply(x, rows), None),
        };
        ops.activate(self.kind, &mut h, gate.as_deref())?;
        Ok(self.down.apply(&h, rows))
    }
}

/// The softmax of `row`, in f32.
fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = row.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// A layer's MLP: dense, or a mixture of experts.
#[derive(Debug)]
pub(crate) enum LayerMlp {
    Dense(Box<Mlp>),
    Moe(Box<MoeMlp>),
}

impl LayerMlp {
    /// The MLP's output for `rows` rows of `x`.
    pub fn apply(
        &self,
        ops: &dyn LayerOps,
        x: &[f32],
        rows: usize,
    ) -> Result<Vec<f32>, RuntimeError> {
        match self {
            LayerMlp::Dense(mlp) => mlp.apply(ops, x, rows),
            LayerMlp::Moe(moe) => moe.apply(ops, x, rows),
        }
    }

    /// Weights it holds: its linear maps', and a router's correction bias.
    pub fn weight_count(&self) -> u64 {
        let lin = |l: &Linear| (l.w.len() + l.bias.as_ref().map_or(0, Vec::len)) as u64;
        let correction = match self {
            LayerMlp::Moe(moe) => moe.correction.len() as u64,
            LayerMlp::Dense(_) => 0,
        };
        self.linears().into_iter().map(lin).sum::<u64>() + correction
    }

    /// Its linear maps: every expert's and the router's for MoE.
    pub fn linears(&self) -> Vec<&Linear> {
        fn dense(m: &Mlp) -> Vec<&Linear> {
            let mut all: Vec<&Linear> = m.gate.iter().collect();
            all.extend([&m.up, &m.down]);
            all
        }
        match self {
            LayerMlp::Dense(mlp) => dense(mlp),
            LayerMlp::Moe(moe) => std::iter::once(&moe.router)
                .chain(moe.experts.iter().flat_map(dense))
                .chain(
                    moe.shared
                        .iter()
                        .flat_map(|(e, gate)| dense(e).into_iter().chain(gate)),
                )
                .collect(),
        }
    }
}

/// A mixture-of-experts MLP (`ModelConfig::moe`).
#[derive(Debug)]
pub(crate) struct MoeMlp {
    /// `[experts, hidden]`: the router's logits.
    pub router: Linear,
    pub experts: Vec<Mlp>,
    pub top_k: usize,
    pub normalize: bool,
    pub router_kind: Router,
    /// DeepSeek-V3's `e_score_correction_bias`, one per expert (`Router::SigmoidGroups`).
    pub correction: Vec<f32>,
    pub scale: f32,
    /// A shared expert every token runs, and where it is gated the `[1, hidden]` map whose
    /// sigmoid scales it.
    pub shared: Option<(Mlp, Option<Linear>)>,
}

impl MoeMlp {
    /// Each expert's rows (`(row, weight)`, in row order) for the router's `logits` (`[rows,
    /// experts]`), as the router kind says (ties go to the lower index; NaN is never chosen
    /// over a number).
    pub fn route(&self, logits: &[f32]) -> Vec<Vec<(usize, f32)>> {
        let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.experts.len()];
        for (row, chosen) in self.choose(logits).into_iter().enumerate() {
            for (e, w) in chosen {
                routed[e].push((row, w));
            }
        }
        routed
    }

    /// Each row's chosen experts with their weights.
    fn choose(&self, logits: &[f32]) -> Vec<Vec<(usize, f32)>> {
        let n = self.experts.len();
        logits
            .chunks_exact(n.max(1))
            .map(|row| {
                let scores: Vec<f32> = match self.router_kind {
                    Router::Softmax | Router::SoftmaxGroups { .. } => softmax(row),
                    // Chosen by logit; the weights are the softmax of the chosen logits.
                    Router::TopKSoftmax => row.to_vec(),
                    Router::SigmoidGroups { .. } => {
                        row.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect()
                    }
                };
                let choice: Vec<f32> = match self.router_kind {
                    Router::SigmoidGroups { .. } => scores
                        .iter()
                        .zip(&self.correction)
                        .map(|(s, b)| s + b)
                        .collect(),
                    _ => scores.clone(),
                };
                let allowed = self.allowed(&choice);
                let mut order: Vec<usize> = (0..n).filter(|&e| allowed[e]).collect();
                // Best first, ties to the lower index: a total order, so selecting the top k
                // before sorting them gives what sorting all would.
                let best = |&a: &usize, &b: &usize| choice[b].total_cmp(&choice[a]).then(a.cmp(&b));
                if self.top_k < order.len() {
                    order.select_nth_unstable_by(self.top_k, best);
                    order.truncate(self.top_k);
                }
                order.sort_by(best);
                let mut chosen: Vec<(usize, f32)> = order
                    .into_iter()
                    .take(self.top_k)
                    .map(|e| (e, scores[e]))
                    .collect();
                if self.router_kind == Router::TopKSoftmax {
                    let logits: Vec<f32> = chosen.iter().map(|(_, l)| *l).collect();
                    for ((_, w), p) in chosen.iter_mut().zip(softmax(&logits)) {
                        *w = p;
                    }
                }
                let total: f32 = chosen.iter().map(|(_, w)| w).sum();
                let norm = if self.normalize { total } else { 1.0 };
                chosen
                    .into_iter()
                    .map(|(e, w)| (e, w / norm * self.scale))
                    .collect()
            })
            .collect()
    }

    /// Which experts a row may choose: all, or those of its best groups (by their best choice
    /// score, or the sum of their two best).
    fn allowed(&self, choice: &[f32]) -> Vec<bool> {
        let (groups, topk_group, top_two) = match self.router_kind {
            Router::Softmax | Router::TopKSoftmax => return vec![true; choice.len()],
            Router::SoftmaxGroups { groups, topk_group } => (groups, topk_group, false),
            Router::SigmoidGroups { groups, topk_group } => (groups, topk_group, true),
        };
        let per = choice.len() / groups.max(1);
        let group_score = |g: usize| {
            let mut best: Vec<f32> = choice[g * per..(g + 1) * per].to_vec();
            best.sort_by(|a, b| b.total_cmp(a));
            match top_two {
                true => best.iter().take(2).sum::<f32>(),
                false => best.first().copied().unwrap_or(f32::NEG_INFINITY),
            }
        };
        let scores: Vec<f32> = (0..groups).map(group_score).collect();
        let mut order: Vec<usize> = (0..groups).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        let mut allowed = vec![false; choice.len()];
        for &g in order.iter().take(topk_group) {
            allowed[g * per..(g + 1) * per].fill(true);
        }
        allowed
    }

    /// The weighted sum of the chosen experts' outputs per row, on top of the gated shared
    /// expert's where there is one. Each expert runs once, on the rows routed to it
    /// (gathered), and its outputs are added back in expert order.
    pub fn apply(
        &self,
        ops: &dyn LayerOps,
        x: &[f32],
        rows: usize,
    ) -> Result<Vec<f32>, RuntimeError> {
        let width = x.len() / rows.max(1);
        let routed = self.route(&self.router.apply(x, rows));
        let mut out = match &self.shared {
            Some((expert, gate)) => {
                let mut y = expert.apply(ops, x, rows)?;
                if let Some(gate) = gate {
                    let g = gate.apply(x, rows);
                    for (row, &g) in y.chunks_exact_mut(width.max(1)).zip(&g) {
                        let s = 1.0 / (1.0 + (-g).exp());
                        row.iter_mut().for_each(|v| *v *= s);
                    }
                }
                y
            }
            None => vec![0f32; x.len()],
        };
        for (expert, list) in self.experts.iter().zip(&routed) {
            if list.is_empty() {
                continue;
            }
            let gathered: Vec<f32> = list
                .iter()
                .flat_map(|&(row, _)| &x[row * width..(row + 1) * width])
                .copied()
                .collect();
            let y = expert.apply(ops, &gathered, list.len())?;
            for (&(row, w), part) in list.iter().zip(y.chunks_exact(width)) {
                for (o, v) in out[row * width..(row + 1) * width].iter_mut().zip(part) {
                    *o += w * v;
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Every dtype, through the matrix-vector products (up to `gemv::MAX_ROWS` rows) and the
    /// GEMM (more rows; a 16-bit matrix past one block of `BLOCK_VALUES`, so converted in
    /// two), gives the f64 product of the stored weights (and, for bf16, of the inputs rounded
    /// to bf16), with the kernels of every instruction set this CPU runs (the GEMM: `vdpbf16ps`
    /// for bf16 with avx512_bf16, f32 FMAs on widened panels with AVX-512, the gemm crate on
    /// widened blocks below).
    #[test]
    fn products_match_the_f64_product_in_every_dtype() {
        let value = |i: usize, seed: usize| {
            let h = (i.wrapping_mul(2654435761).wrapping_add(seed) >> 5) % 1999;
            h as f32 / 1000.0 - 1.0
        };
        let (out, inp) = (BLOCK_VALUES / 64 + 37, 64);
        let raw: Vec<f32> = (0..out * inp).map(|i| value(i, 1)).collect();
        let stores = [
            Storage::F32(raw.clone().into()),
            Storage::Bf16(raw.iter().map(|&v| bf16::from_f32(v)).collect()),
            Storage::F16(raw.iter().map(|&v| f16::from_f32(v)).collect()),
        ];
        for store in stores {
            let wide: Vec<f64> = match &store {
                Storage::F32(v) => v.iter().map(|&x| x as f64).collect(),
                Storage::Bf16(v) => v.iter().map(|x| x.to_f64()).collect(),
                Storage::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            };
            // bf16 weights multiply inputs rounded to bf16.
            let bf16_weights = matches!(store, Storage::Bf16(_));
            let input = |v: f32| match bf16_weights {
                true => gemv::round_to_bf16(v) as f64,
                false => v as f64,
            };
            let m = Matrix::new(out, inp, store);
            let isas = Isa::ALL.into_iter().filter(|isa| isa.runs_here());
            let runs =
                isas.flat_map(|isa| [1, gemv::MAX_ROWS, gemv::MAX_ROWS + 1].map(|n| (isa, n)));
            for (isa, n) in runs {
                let x: Vec<f32> = (0..n * inp).map(|i| value(i, 7)).collect();
                let y = m.matmul_t_on(isa, &x, n);
                assert_eq!(y.len(), n * out);
                // Every output of a few rows; a sample of the rest (both blocks).
                for o in (0..out).step_by(997).chain(out - 3..out) {
                    for t in 0..n {
                        let want: f64 = (0..inp)
                            .map(|i| wide[o * inp + i] * input(x[t * inp + i]))
                            .sum();
                        let got = y[t * out + o] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{isa:?} n={n} [{t}, {o}]: {got} against {want}"
                        );
                    }
                }
            }
        }
    }
}
