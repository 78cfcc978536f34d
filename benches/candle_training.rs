//! One training step's attention through candle (feature `candle`): the forward, then the
//! backward of `sum(out * w)` into q, k and v, timed as a pair. Three paths side by side:
//! - `attn_candle`: `attn::candle::attention` and candle's `backward()`;
//! - `naive`: candle's own ops (matmul, causal mask, softmax, matmul), as a candle model
//!   would write attention without a fused kernel;
//! - `attn_kernels`: the same attn kernels without candle, as `attnc bench --backward` times
//!   them (a forward that saves out and lse, then the backward).
//!
//! Causal, 8 heads of 64 dims, one sequence of 512 to 2048 tokens, f32 and bf16. After the
//! timings, each configuration runs once more in a fresh process of this binary, which prints
//! the peak resident memory the step added (VmHWM after it less VmRSS before it).
//!
//! `RAYON_NUM_THREADS=2 cargo bench --features candle --bench candle_training`

use attn::candle::core::{D, DType, Device, Tensor, Var};
use attn::prelude::*;
use criterion::{BenchmarkId, Criterion, Throughput};
use std::sync::Arc;

const HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const LENGTHS: [usize; 3] = [512, 1024, 2048];
const DTYPES: [&str; 2] = ["f32", "bf16"];
const PATHS: [&str; 3] = ["attn_candle", "naive", "attn_kernels"];
/// Set in the child processes that measure peak memory: `PATH/DTYPE/N`.
const PEAK_ENV: &str = "ATTN_CANDLE_PEAK";

/// Inputs of one configuration, as candle variables and as attn tensors.
struct Step {
    variant: Arc<Variant>,
    q: Var,
    k: Var,
    v: Var,
    w: Tensor,
    attn: [attn::Tensor; 4],
}

impl Step {
    fn new(dtype: &str, n: usize) -> Step {
        let variant = Variant::parse(&format!(
            "heads = {HEADS}, head_dim = {HEAD_DIM}, mask = causal, dtype = {dtype}"
        ))
        .unwrap();
        let spec_dtype = variant.spec().dtype;
        let candle_dtype = if dtype == "f32" {
            DType::F32
        } else {
            DType::BF16
        };
        let dims = [1, HEADS, n, HEAD_DIM];
        let candle = |seed| {
            let values = attn::inputs::values(dims.iter().product(), seed);
            Tensor::from_vec(values, &dims[..], &Device::Cpu)
                .and_then(|t| t.to_dtype(candle_dtype))
                .unwrap()
        };
        let attn = [1, 2, 3, 4].map(|seed| attn::inputs::tensor(spec_dtype, &dims, seed).unwrap());
        Step {
            q: Var::from_tensor(&candle(1)).unwrap(),
            k: Var::from_tensor(&candle(2)).unwrap(),
            v: Var::from_tensor(&candle(3)).unwrap(),
            w: candle(4),
            variant,
            attn,
        }
    }

    /// One forward and backward on `path`.
    fn run(&self, path: &str) {
        match path {
            "attn_candle" | "naive" => {
                let out = if path == "naive" {
                    naive_causal(&self.q, &self.k, &self.v)
                } else {
                    attn::candle::attention(&self.variant, &self.q, &self.k, &self.v).unwrap()
                };
                let loss = out.mul(&self.w).unwrap().sum_all().unwrap();
                loss.backward().unwrap();
            }
            _ => {
                let backend = CpuBackend::new();
                let [q, k, v, dout] = &self.attn;
                let saved = backend
                    .forward(&self.variant, Inputs::heads(q, k, v), 0)
                    .unwrap();
                let x = BackwardInputs::Heads(HeadsBackward {
                    q,
                    k,
                    v,
                    out: &saved.out,
                    lse: &saved.lse,
                    dout,
                    position_offset: 0,
                });
                backend.backward(&self.variant, &x).unwrap();
            }
        }
    }
}

/// Causal attention in candle's ops: the `N x N` scores, masked, softmaxed and applied.
fn naive_causal(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let n = q.dim(2).unwrap();
    let scores = q
        .matmul(&k.t().unwrap())
        .unwrap()
        .affine(1.0 / (HEAD_DIM as f64).sqrt(), 0.0)
        .unwrap();
    let keep: Vec<u8> = (0..n)
        .flat_map(|i| (0..n).map(move |j| u8::from(j <= i)))
        .collect();
    let keep = Tensor::from_vec(keep, (n, n), &Device::Cpu)
        .unwrap()
        .broadcast_as(scores.shape())
        .unwrap();
    let masked = Tensor::full(f32::NEG_INFINITY, scores.shape(), &Device::Cpu)
        .unwrap()
        .to_dtype(scores.dtype())
        .unwrap();
    let scores = keep.where_cond(&scores, &masked).unwrap();
    let p = attn::candle::nn::ops::softmax(&scores, D::Minus1).unwrap();
    p.matmul(v).unwrap()
}

fn timings(c: &mut Criterion) {
    for dtype in DTYPES {
        let mut group = c.benchmark_group(format!("candle_step/{dtype}"));
        group.sample_size(10);
        for n in LENGTHS {
            let step = Step::new(dtype, n);
            group.throughput(Throughput::Elements((HEADS * n * n / 2) as u64));
            for path in PATHS {
                group.bench_with_input(BenchmarkId::new(path, n), &n, |b, _| {
                    b.iter(|| step.run(path))
                });
            }
        }
        group.finish();
    }
}

/// A line of `/proc/self/status` in KiB.
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// In a child: one step of the configuration, then the peak memory it added, in MiB.
fn measure_peak(config: &str) {
    let [path, dtype, n] = config.split('/').collect::<Vec<_>>()[..] else {
        panic!("{PEAK_ENV}={config}: expected PATH/DTYPE/N");
    };
    let step = Step::new(dtype, n.parse().unwrap());
    let before = status_kib("VmRSS:");
    step.run(path);
    println!("{:.1}", (status_kib("VmHWM:") - before) as f64 / 1024.0);
}

/// Peak memory of each configuration, each in a fresh process.
fn peaks() {
    println!("\npeak memory added by one step (MiB), causal, H{HEADS} D{HEAD_DIM}:");
    println!(
        "{:<6} {:>6} {:>12} {:>12} {:>12}",
        "dtype", "N", PATHS[0], PATHS[1], PATHS[2]
    );
    let exe = std::env::current_exe().unwrap();
    for dtype in DTYPES {
        for n in LENGTHS {
            let cells: Vec<String> = PATHS
                .iter()
                .map(|path| {
                    let out = std::process::Command::new(&exe)
                        .env(PEAK_ENV, format!("{path}/{dtype}/{n}"))
                        .output()
                        .unwrap();
                    String::from_utf8_lossy(&out.stdout).trim().to_string()
                })
                .collect();
            println!(
                "{dtype:<6} {n:>6} {:>12} {:>12} {:>12}",
                cells[0], cells[1], cells[2]
            );
        }
    }
}

fn main() {
    if let Ok(config) = std::env::var(PEAK_ENV) {
        measure_peak(&config);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    timings(&mut c);
    c.final_summary();
    // Not when cargo runs the bench as a test, or lists it.
    if !std::env::args().any(|a| a == "--test" || a == "--list") {
        peaks();
    }
}
