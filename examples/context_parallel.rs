//! Context-parallel attention: one attention call over a sequence split across ranks, forward
//! and backward, timed, with the bytes each rank sent; with `--check`, compared with the single
//! call on the whole sequence.
//!
//! Ranks as threads of one process:
//!   cargo run --release --example context_parallel -- --ranks 2 --seq 4096
//! Ranks as MPI processes (the system's Open MPI):
//!   cargo build --release --features mpi --example context_parallel
//!   mpirun -n 2 target/release/examples/context_parallel --seq 4096
//!
//! `--fail wrong-size` or `--fail exit` makes rank 1 fail (a buffer of another size, or an exit
//! before the call): every rank must then stop with an error instead of waiting.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use attn::distributed::threads::group_with_timeout;
use attn::distributed::{CommError, Communicator, ContextParallel, Scheme, run_ranks_with};
use attn::{Backend, CpuBackend, HeadsBackward, Inputs, Learned, RuntimeError, Tensor, Variant};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Context-parallel attention, forward and backward, over threads or MPI")]
struct Args {
    /// The attention specs to run, each in turn [default: a causal GQA spec with RoPE].
    #[arg(long = "spec", value_name = "SPEC")]
    specs: Vec<String>,
    /// ulysses or ring; `both` runs each spec with each.
    #[arg(long, default_value = "ring")]
    scheme: String,
    /// The whole sequence's length (tokens).
    #[arg(long, default_value_t = 4096)]
    seq: usize,
    /// Batch items.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Ranks as threads of this process (without MPI).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Compare every rank's part with the single call on the whole sequence.
    #[arg(long)]
    check: bool,
    /// Run the single call on the whole sequence instead (the baseline; one rank).
    #[arg(long)]
    single: bool,
    /// Timed repetitions (the median is printed).
    #[arg(long, default_value_t = 1)]
    reps: usize,
    /// Make rank 1 fail: `wrong-size` or `exit`.
    #[arg(long)]
    fail: Option<String>,
    /// Seconds a rank waits for another before it gives up.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Free attn's pool of reused buffers every millisecond, so that the peak RSS printed is
    /// what the call holds rather than up to 1 GiB of buffers kept for reuse.
    #[arg(long)]
    no_pool: bool,
}

const DEFAULT_SPEC: &str = "heads = 16, kv_heads = 4, head_dim = 128, mask = causal, \
                            position = rope";

fn main() {
    let args = Args::parse();
    if args.no_pool {
        std::thread::spawn(|| {
            loop {
                attn::runtime::memory::release_pooled();
                std::thread::sleep(Duration::from_millis(1));
            }
        });
    }
    let timeout = Duration::from_secs(args.timeout);
    let failed = match mpi_world(timeout) {
        Some(comm) => {
            let comm = comm.unwrap_or_else(|e| exit_with(&e.to_string()));
            let result = run(&args, &comm);
            if let Err(e) = &result {
                eprintln!("rank {}: error: {e}", comm.rank());
                // The other ranks may wait in a collective: end the job.
                comm_abort(&comm);
            }
            result.is_err()
        }
        None => {
            let results = run_ranks_with(group_with_timeout(args.ranks, timeout), |comm| {
                run(&args, comm).map_err(|e| format!("rank {}: error: {e}", comm.rank()))
            });
            results
                .iter()
                .filter_map(|r| r.as_ref().err())
                .inspect(|e| eprintln!("{e}"))
                .count()
                > 0
        }
    };
    if failed {
        std::process::exit(1);
    }
}

fn exit_with(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(2)
}

/// MPI's world when this program runs under `mpirun` with the `mpi` feature.
#[cfg(feature = "mpi")]
fn mpi_world(timeout: Duration) -> Option<Result<attn::distributed::MpiComm, CommError>> {
    let launched = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    launched.then(|| attn::distributed::MpiComm::init_with_timeout(timeout))
}

#[cfg(not(feature = "mpi"))]
fn mpi_world(_: Duration) -> Option<Result<attn::distributed::ThreadComm, CommError>> {
    None
}

#[cfg(feature = "mpi")]
fn comm_abort(comm: &attn::distributed::MpiComm) {
    comm.abort(1);
}

#[cfg(not(feature = "mpi"))]
fn comm_abort(_: &attn::distributed::ThreadComm) {}

/// Counts the bytes a rank hands its engine for other ranks.
struct Counting<'a> {
    inner: &'a dyn Communicator,
    sent: AtomicU64,
}

impl Counting<'_> {
    fn add(&self, values: usize) {
        self.sent.fetch_add(4 * values as u64, Ordering::Relaxed);
    }
}

impl Communicator for Counting<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn engine(&self) -> &'static str {
        self.inner.engine()
    }
    fn send_recv(&self, s: &[f32], to: usize, r: &mut [f32], from: usize) -> Result<(), CommError> {
        self.add(s.len());
        self.inner.send_recv(s, to, r, from)
    }
    fn all_to_all(&self, s: &[f32], r: &mut [f32]) -> Result<(), CommError> {
        self.add(s.len() - s.len() / self.size());
        self.inner.all_to_all(s, r)
    }
    fn all_reduce_sum(&self, v: &mut [f32]) -> Result<(), CommError> {
        self.add(v.len());
        self.inner.all_reduce_sum(v)
    }
    fn all_gather(&self, s: &[f32], r: &mut [f32]) -> Result<(), CommError> {
        self.add(s.len() * (self.size() - 1));
        self.inner.all_gather(s, r)
    }
}

fn run(args: &Args, comm: &dyn Communicator) -> Result<(), RuntimeError> {
    let me = comm.rank();
    match args.fail.as_deref() {
        Some("exit") if me == 1 => std::process::exit(3),
        Some("wrong-size") => {
            let mut values = vec![1.0; if me == 1 { 5 } else { 4 }];
            comm.all_reduce_sum(&mut values)?;
        }
        Some(other) if other != "exit" => {
            exit_with(&format!("--fail {other}: allowed: wrong-size, exit"))
        }
        _ => {}
    }
    let specs = if args.specs.is_empty() {
        vec![DEFAULT_SPEC.to_string()]
    } else {
        args.specs.clone()
    };
    let schemes: Vec<Scheme> = match args.scheme.as_str() {
        "both" => vec![Scheme::Ulysses, Scheme::Ring],
        one => vec![one.parse().map_err(RuntimeError::Spec)?],
    };
    for text in &specs {
        let spec: attn::AttentionSpec = text
            .parse()
            .map_err(|e| RuntimeError::Spec(format!("{e}")))?;
        let variant = Variant::shared(&spec)?;
        for &scheme in &schemes {
            let divides = |heads: u32| (heads as usize).is_multiple_of(comm.size());
            if scheme == Scheme::Ulysses && !(divides(spec.heads) && divides(spec.kv_heads())) {
                if me == 0 {
                    println!(
                        "{text}: Ulysses skipped (heads not divisible by {} ranks)",
                        comm.size()
                    );
                }
                continue;
            }
            let counting = Counting {
                inner: comm,
                sent: AtomicU64::new(0),
            };
            let report = if args.single {
                let all: Vec<usize> = (0..args.seq).collect();
                Whole::at(&spec, args.batch, &all)?.single(&variant, args.reps)?
            } else {
                parallel(&variant, &counting, scheme, args)?
            };
            let sent = counting.sent.load(Ordering::Relaxed) as f64 / args.reps.max(1) as f64;
            println!(
                "rank {me} of {}: {text} {}: forward {:.1} ms, backward {:.1} ms (medians of {}), \
                 sent {:.2} MiB per step, peak RSS {:.0} MiB{}",
                comm.size(),
                if args.single {
                    "single call".to_string()
                } else {
                    format!("{scheme:?}")
                },
                report.forward_ms,
                report.backward_ms,
                args.reps,
                sent / 1048576.0,
                peak_rss_mib(),
                report.checked.as_deref().unwrap_or("")
            );
        }
    }
    Ok(())
}

/// A call's tensors over some positions of the sequence: q, k, v and dout. Each row's values
/// come from its own seed (batch item, head, position), so a rank makes its part without the
/// whole sequence, and the whole holds the same rows.
struct Whole {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    learned: Vec<(String, Tensor)>,
}

struct Report {
    forward_ms: f64,
    backward_ms: f64,
    checked: Option<String>,
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

impl Whole {
    /// The tensors' rows at `positions` (of `b` batch items).
    fn at(
        spec: &attn::AttentionSpec,
        b: usize,
        positions: &[usize],
    ) -> Result<Whole, RuntimeError> {
        let (h, kv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let rows = |dtype, heads: usize, width: usize, seed: u64| {
            let mut values = Vec::with_capacity(b * heads * positions.len() * width);
            for row in 0..b * heads {
                for &p in positions {
                    let row_seed = seed << 56 ^ (row as u64) << 32 ^ p as u64;
                    values.extend(attn::inputs::values(width, row_seed));
                }
            }
            Tensor::from_f32_as(dtype, &[b, heads, positions.len(), width], values)
        };
        let learned = spec
            .learnable_tensors()
            .into_iter()
            .map(|(name, shape)| {
                let n = shape.iter().product();
                let values = attn::inputs::values(n, 40)
                    .iter()
                    .map(|x| 0.1 * x)
                    .collect();
                Ok((name, Tensor::from_f32(&shape, values)?))
            })
            .collect::<Result<_, RuntimeError>>()?;
        Ok(Whole {
            q: rows(spec.dtype, h, d, 1)?,
            k: rows(spec.dtype, kv, d, 2)?,
            v: rows(spec.dtype, kv, dv, 3)?,
            dout: rows(attn::DType::F32, h, dv, 4)?,
            learned,
        })
    }

    fn named(&self) -> Vec<(&str, &Tensor)> {
        self.learned.iter().map(|(n, t)| (n.as_str(), t)).collect()
    }

    fn single(&self, variant: &Variant, reps: usize) -> Result<Report, RuntimeError> {
        let cpu = CpuBackend::new();
        let named = self.named();
        let learned = Learned::new(&named);
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for _ in 0..reps.max(1) {
            let start = Instant::now();
            let out = cpu.forward_learned(
                variant,
                Inputs::heads(&self.q, &self.k, &self.v),
                0,
                learned,
            )?;
            fwd.push(start.elapsed().as_secs_f64() * 1e3);
            let start = Instant::now();
            let x = HeadsBackward {
                q: &self.q,
                k: &self.k,
                v: &self.v,
                out: &out.out,
                lse: &out.lse,
                dout: &self.dout,
                position_offset: 0,
            };
            cpu.backward_learned(variant, &attn::BackwardInputs::Heads(x), learned)?;
            bwd.push(start.elapsed().as_secs_f64() * 1e3);
        }
        Ok(Report {
            forward_ms: median(fwd),
            backward_ms: median(bwd),
            checked: None,
        })
    }

    /// Compares this rank's part with the single call's rows; an error past the tolerance.
    fn check(
        &self,
        variant: &Variant,
        split: &attn::distributed::SeqSplit,
        me: usize,
        out: &attn::Output,
        g: &attn::HeadGradients,
    ) -> Result<String, RuntimeError> {
        let cpu = CpuBackend::new();
        let named = self.named();
        let learned = Learned::new(&named);
        let want = cpu.forward_learned(
            variant,
            Inputs::heads(&self.q, &self.k, &self.v),
            0,
            learned,
        )?;
        let x = HeadsBackward {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            out: &want.out,
            lse: &want.lse,
            dout: &self.dout,
            position_offset: 0,
        };
        let wg = cpu
            .backward_learned(variant, &attn::BackwardInputs::Heads(x), learned)?
            .heads()?;
        let tol = if variant.spec().dtype == attn::DType::F32 {
            1e-5
        } else {
            2e-2
        };
        let mut worst = 0f32;
        let mut pairs = vec![
            ("out", out.out.clone(), split.take(&want.out, me)?),
            ("lse", out.lse.clone(), split.take(&want.lse, me)?),
            ("dq", g.dq.clone(), split.take(&wg.dq, me)?),
            ("dk", g.dk.clone(), split.take(&wg.dk, me)?),
            ("dv", g.dv.clone(), split.take(&wg.dv, me)?),
        ];
        for ((name, got), (_, want)) in g.learned.iter().zip(&wg.learned) {
            pairs.push((name.as_str(), got.clone(), want.clone()));
        }
        for (name, got, want) in pairs {
            let (a, b) = (got.to_f32_vec(), want.to_f32_vec());
            let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
            let err = a
                .iter()
                .zip(&b)
                .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() / scale })
                .fold(
                    0f32,
                    |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
                );
            if err > tol || a.len() != b.len() {
                return Err(RuntimeError::Data(format!(
                    "{name} differs from the single call's by {err:e} (relative), past {tol:e}"
                )));
            }
            worst = worst.max(err);
        }
        Ok(format!(
            ", equal to the single call (largest relative difference {worst:.1e})"
        ))
    }
}

fn parallel(
    variant: &Variant,
    comm: &dyn Communicator,
    scheme: Scheme,
    args: &Args,
) -> Result<Report, RuntimeError> {
    let cpu = CpuBackend::new();
    let cp = ContextParallel::new(comm, &cpu, scheme);
    let split = cp.split(variant, args.seq)?;
    let me = comm.rank();
    let mine: Vec<usize> = split.chunks(me).into_iter().flatten().collect();
    let part = Whole::at(variant.spec(), args.batch, &mine)?;
    let (q, k, v, dout) = (&part.q, &part.k, &part.v, &part.dout);
    let named = part.named();
    let learned = Learned::new(&named);
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    let mut last = None;
    for _ in 0..args.reps.max(1) {
        comm.barrier()?;
        let start = Instant::now();
        let out = cp.forward(variant, [q, k, v], 0, learned)?;
        fwd.push(start.elapsed().as_secs_f64() * 1e3);
        comm.barrier()?;
        let start = Instant::now();
        let x = HeadsBackward {
            q,
            k,
            v,
            out: &out.out,
            lse: &out.lse,
            dout,
            position_offset: 0,
        };
        let g = cp.backward(variant, &x, learned)?;
        bwd.push(start.elapsed().as_secs_f64() * 1e3);
        last = Some((out, g));
    }
    let checked = match (args.check, last) {
        (true, Some((out, g))) => {
            let all: Vec<usize> = (0..args.seq).collect();
            let whole = Whole::at(variant.spec(), args.batch, &all)?;
            Some(whole.check(variant, &split, me, &out, &g)?)
        }
        _ => None,
    };
    Ok(Report {
        forward_ms: median(fwd),
        backward_ms: median(bwd),
        checked,
    })
}

/// The process's peak resident memory, from /proc (0 where there is none).
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}
