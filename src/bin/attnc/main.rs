//! `attnc`: the attn command-line front end.
//!
//! Exit codes: 0 on success, 2 on bad input (an invalid spec, an unreadable file, bad flags),
//! with a message on stderr that says what was wrong and where.

#![forbid(unsafe_code)]

mod bench;
mod bench_decode;
mod check_device;
mod emit;
mod explain;
mod ir;
mod model_cmd;
mod outputs;
mod run;
mod spec_arg;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// A compiler for attention variants.
#[derive(Parser)]
#[command(name = "attnc", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a spec and print it in normalized form.
    Check {
        /// The spec, in the spec language, or @FILE to read it from a file.
        #[arg(allow_hyphen_values = true)]
        spec: String,
    },
    /// Print the modifier IR (as lowered and folded) and the forward kernel plan.
    Ir {
        /// The spec, in the spec language, or @FILE to read it from a file.
        #[arg(allow_hyphen_values = true)]
        spec: String,
        /// Also print the tile map for this many queries (`#` all kept, `.` skipped, `/` mixed;
        /// at most 16384, a map of 256 x 256 tiles).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=16_384))]
        seq: Option<u64>,
        /// Keys for the tile map (default: as many as queries; at most 16384).
        #[arg(long, value_name = "N", requires = "seq", value_parser = clap::value_parser!(u64).range(1..=16_384))]
        kv_len: Option<u64>,
        /// Also print the derivative of the score program (what the backward pass multiplies
        /// by), its range, notes where it is only piecewise, and the backward kernel plan.
        #[arg(long)]
        grad: bool,
    },
    /// Run attention on the CPU: read q, k, v (MLA: q_nope, q_pe, c_kv, k_pe, w_kv_b) from a
    /// safetensors file, write `out` and `lse` to another.
    Run {
        #[command(flatten)]
        files: TensorFiles,
    },
    /// Gradients of attention: read q, k, v and dout (the gradient of the loss with respect to
    /// the output) from a safetensors file; run the forward (which saves out and lse) and the
    /// backward; write dq, dk, dv (input dtype), out and lse to another. For MLA specs: q_nope,
    /// q_pe, c_kv, k_pe, w_kv_b and dout in; dq_nope, dq_pe, dc_kv, dk_pe, dw_kv_b, out and lse
    /// out (cpu backend).
    Grad {
        #[command(flatten)]
        files: TensorFiles,
    },
    /// Time the forward kernel of a spec on random inputs: median ms, GFLOP/s (4 B Hq Sq Skv D,
    /// halved for causal masks) and the kernel's compile time (on cuda: PTX emitted and loaded).
    Bench {
        /// The spec, in the spec language, or @FILE to read it from a file.
        #[arg(allow_hyphen_values = true)]
        spec: String,
        /// Queries per sequence.
        #[arg(long, value_name = "N", default_value_t = 2048, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
        seq: u64,
        /// Keys per sequence (default: as many as queries).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
        kv_len: Option<u64>,
        /// Sequences.
        #[arg(long, value_name = "B", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
        batch: u64,
        /// Timed runs (after two warm-up runs).
        #[arg(long, value_name = "R", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=10_000))]
        reps: u64,
        /// Print one JSON line {"median_ms", "gflops", "compile_ms"}.
        #[arg(long)]
        json: bool,
        /// Where to run: cpu, or cuda (device 0; needs the `cuda` feature and an NVIDIA GPU).
        #[arg(long, value_enum, default_value_t = run::Backend::Cpu)]
        backend: run::Backend,
        /// Time a forward that saves out and lse plus the backward (`median_ms` of the pair;
        /// GFLOP/s counted as 3.5 forwards). CPU only for now.
        #[arg(long)]
        backward: bool,
    },
    /// Time decoding steps against a paged KV cache: median time per step and the effective
    /// GB/s of K and V read (every cached token of every sequence, in the cache's dtype).
    BenchDecode {
        /// The spec, in the spec language, or @FILE to read it from a file.
        #[arg(allow_hyphen_values = true)]
        spec: String,
        /// Cached tokens per sequence.
        #[arg(long, value_name = "L", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
        kv_len: u64,
        /// Sequences.
        #[arg(long, value_name = "B", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
        batch: u64,
        /// New queries per sequence and step.
        #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
        q_len: u64,
        /// Tokens per cache block.
        #[arg(long, value_name = "T", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
        block_size: u64,
        /// Timed steps (after two warm-up steps).
        #[arg(long, value_name = "R", default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        reps: u64,
        /// Print one JSON line {"median_us", "gbps"}, plus "kernel_us" and "kernel_gbps" (the
        /// step's kernels alone) on cuda.
        #[arg(long)]
        json: bool,
        /// Where to run: cpu, or cuda (device 0, against a copy of the cache uploaded once; needs
        /// the `cuda` feature and an NVIDIA GPU).
        #[arg(long, value_enum, default_value_t = run::Backend::Cpu)]
        backend: run::Backend,
    },
    /// Logits of a token sequence from a Hugging Face checkpoint: one full forward, or a prefill
    /// then one token at a time (`--incremental P`). Writes `logits` [1, T, vocab] (f32).
    Logits {
        /// Checkpoint directory (config.json and *.safetensors), or a research model's TOML
        /// file (random weights).
        #[arg(long, value_name = "PATH")]
        model: std::path::PathBuf,
        /// Seed of a research model's random weights.
        #[arg(long, value_name = "S", default_value_t = 0)]
        init_seed: u64,
        /// Token ids, comma-separated.
        #[arg(long, value_name = "IDS")]
        tokens: String,
        /// Prefill this many tokens, then decode the rest one at a time with the KV cache.
        #[arg(long, value_name = "P")]
        incremental: Option<usize>,
        /// Output safetensors file.
        #[arg(long, value_name = "FILE")]
        output: std::path::PathBuf,
        /// Where the attention runs (projections, norms and MLPs run on the CPU).
        #[arg(long, value_enum, default_value_t = run::Backend::Cpu)]
        backend: run::Backend,
    },
    /// Continue a prompt with a Hugging Face checkpoint (greedy unless --temperature). With
    /// --prompt, streams the new text (the checkpoint's tokenizer.json reads and writes it); with
    /// --tokens, prints the new token ids. Progress and tokens/s go to stderr.
    Generate {
        /// Checkpoint directory (config.json and *.safetensors), or a research model's TOML
        /// file (random weights).
        #[arg(long, value_name = "PATH")]
        model: std::path::PathBuf,
        /// Seed of a research model's random weights.
        #[arg(long, value_name = "S", default_value_t = 0)]
        init_seed: u64,
        /// Prompt token ids, comma-separated.
        #[arg(
            long,
            value_name = "IDS",
            required_unless_present = "prompt",
            conflicts_with = "prompt"
        )]
        tokens: Option<String>,
        /// Prompt text, tokenized by the checkpoint's tokenizer.json.
        #[arg(long, value_name = "TEXT", allow_hyphen_values = true)]
        prompt: Option<String>,
        /// Most tokens to generate.
        #[arg(long, value_name = "N", default_value_t = 32)]
        max_new_tokens: usize,
        /// Sampling temperature (0: greedy).
        #[arg(long, value_name = "T", default_value_t = 0.0)]
        temperature: f32,
        /// Sample among the K most likely tokens.
        #[arg(long, value_name = "K")]
        top_k: Option<usize>,
        /// Sample among the most likely tokens that reach probability P.
        #[arg(long, value_name = "P")]
        top_p: Option<f32>,
        /// Sampler seed.
        #[arg(long, value_name = "S", default_value_t = 0)]
        seed: u64,
        /// Token ids that end the generation, comma-separated.
        #[arg(long, value_name = "IDS")]
        stop: Option<String>,
        /// Where the attention runs (projections, norms and MLPs run on the CPU).
        #[arg(long, value_enum, default_value_t = run::Backend::Cpu)]
        backend: run::Backend,
    },
    /// Parameters per part of a Hugging Face checkpoint, and its KV-cache bytes.
    Params {
        /// Checkpoint directory (config.json and *.safetensors), or a research model's TOML
        /// file (random weights).
        #[arg(long, value_name = "PATH")]
        model: std::path::PathBuf,
        /// Seed of a research model's random weights.
        #[arg(long, value_name = "S", default_value_t = 0)]
        init_seed: u64,
        /// Length for the cache size.
        #[arg(long, value_name = "N", default_value_t = 4096)]
        seq: u64,
    },
    /// Write a spec's GPU kernels as GPU IR, LLVM IR or PTX: its forward kernel to a file or
    /// standard output, or with --out-dir every kernel for every --target and a manifest of
    /// launch records (manifest.json). PTX comes from the kernel disk cache or is compiled
    /// (and cached); stderr says which.
    Emit {
        /// The spec, in the spec language, or @FILE to read it from a file.
        #[arg(allow_hyphen_values = true)]
        spec: String,
        /// GPU architecture; repeat it with --out-dir for several (default sm_90).
        #[arg(long, value_enum)]
        target: Vec<emit::Target>,
        /// What to write.
        #[arg(long, value_enum, default_value_t = emit::Emit::Ptx)]
        emit: emit::Emit,
        /// Output file (default: standard output).
        #[arg(short, long, value_name = "FILE", conflicts_with = "out_dir")]
        output: Option<std::path::PathBuf>,
        /// Write every kernel of the spec, for every target, and manifest.json here.
        #[arg(long, value_name = "DIR")]
        out_dir: Option<std::path::PathBuf>,
    },
    /// List or clear the disk cache of compiled kernels: the folder attn-kernels under
    /// ATTN_CACHE_DIR, else under the platform's cache directory's attn/ (~/.cache/attn on
    /// Linux). Only files it wrote are listed or removed.
    Cache {
        /// What to do.
        #[arg(value_enum)]
        action: emit::CacheAction,
    },
    /// Check the GPU backend on CUDA device 0 (or the GPU IR interpreter) against the CPU
    /// backend: decode (cache uploaded per call and resident), ragged batches, MLA decode and
    /// prefill. Exit 1 when a case disagrees, 2 without a GPU or the `cuda` feature.
    CheckDevice {
        /// Where to run: cuda (device 0), or gpu-sim (the interpreter; slow, no GPU needed).
        #[arg(long, value_enum, default_value_t = run::Backend::Cuda)]
        backend: run::Backend,
    },
    /// Measure the FMA ceiling of this machine: the score microkernel on L1-resident tiles, per
    /// thread and on all threads; with --memory, the memory read ceiling instead.
    Peak {
        /// Seconds per measurement (more than 0, at most 60).
        #[arg(long, default_value_t = 1.0, value_parser = seconds_in_range)]
        seconds: f64,
        /// Measure streaming reads from memory (GB/s, 256 MiB per thread), the ceiling decoding
        /// is measured against.
        #[arg(long)]
        memory: bool,
    },
    /// Print what a spec costs: KV-cache bytes, cache size, parameters and FLOPs.
    Explain {
        /// The spec, in the spec language, or @FILE to read it from a file.
        #[arg(allow_hyphen_values = true)]
        spec: String,
        /// Model width for the projection parameter count (default: heads * head_dim).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        model_dim: Option<u64>,
        /// Number of layers.
        #[arg(long, value_name = "L", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        layers: u64,
        /// Sequence length for the cache size and the prefill FLOPs.
        #[arg(long, value_name = "S", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
        seq: u64,
        /// Number of sequences.
        #[arg(long, value_name = "B", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        batch: u64,
    },
}

/// What `attnc run` and `attnc grad` read and write.
#[derive(clap::Args)]
struct TensorFiles {
    /// The spec, in the spec language, or @FILE to read it from a file.
    #[arg(long, allow_hyphen_values = true)]
    spec: String,
    /// Input safetensors file (BHSD tensors in the spec's dtype).
    #[arg(long, value_name = "FILE")]
    input: std::path::PathBuf,
    /// Output safetensors file.
    #[arg(long, value_name = "FILE")]
    output: std::path::PathBuf,
    /// Position of key 0.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    position_offset: i64,
    /// The backend.
    #[arg(long, value_enum, default_value_t = run::Backend::Cpu)]
    backend: run::Backend,
}

impl TensorFiles {
    /// Refuses an output that is not a regular file or that is one of the inputs.
    fn check_output(&self) -> Result<(), String> {
        let mut inputs = vec![self.input.as_path()];
        inputs.extend(spec_file(&self.spec));
        outputs::check(&self.output, &inputs)
    }
}

/// The file a SPEC argument names (`@FILE`), if any.
fn spec_file(spec: &str) -> Vec<&std::path::Path> {
    spec.strip_prefix('@')
        .map(std::path::Path::new)
        .into_iter()
        .collect()
}

/// A number of seconds for `attnc peak`: finite, more than 0 and at most a minute.
fn seconds_in_range(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s > 0.0 && s <= 60.0 => Ok(s),
        _ => Err(format!(
            "`{text}` is not a number of seconds; allowed: more than 0, at most 60"
        )),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check { spec } => spec_arg::load(&spec).map(|(spec, source)| {
            println!("{spec}");
            // What the backward pass will make of the score modifier, said at spec time, at
            // the tokens concerned.
            for note in attn::dsl::gradient_notes(&source) {
                eprint!("{}", note.render_as("note", &source));
            }
            let program = attn::dsl::modifier::ScoreProgram::of(&spec).folded();
            if let Err(e) = program.score_gradient() {
                eprintln!("note: backward: no gradient: {e}");
            }
        }),
        Command::Ir {
            spec,
            seq,
            kv_len,
            grad,
        } => spec_arg::load(&spec).map(|(spec, _)| {
            print!(
                "{}",
                ir::report(&spec, seq.map(|sq| (sq, kv_len.unwrap_or(sq))), grad)
            );
        }),
        Command::Run { files: f } => f
            .check_output()
            .and_then(|()| spec_arg::load(&f.spec))
            .and_then(|(spec, _)| {
                run::run(&spec, &f.input, &f.output, f.position_offset, f.backend)
                    .map(|summary| println!("{summary}"))
                    .map_err(|e| format!("error: {e}"))
            }),
        Command::Grad { files: f } => f
            .check_output()
            .and_then(|()| spec_arg::load(&f.spec))
            .and_then(|(spec, _)| {
                run::grad(&spec, &f.input, &f.output, f.position_offset, f.backend)
                    .map(|summary| println!("{summary}"))
                    .map_err(|e| format!("error: {e}"))
            }),
        Command::Bench {
            spec,
            seq,
            kv_len,
            batch,
            reps,
            json,
            backend,
            backward,
        } => spec_arg::load(&spec).and_then(|(spec, _)| {
            let shape = bench::Shape {
                batch: batch as usize,
                seq: seq as usize,
                kv_len: kv_len.unwrap_or(seq) as usize,
                reps: reps as usize,
            };
            if backend == run::Backend::GpuSim {
                return Err(
                    "error: --backend gpu-sim is not timed (the interpreter is no GPU); use cpu \
                     or cuda"
                        .to_string(),
                );
            }
            if !json {
                eprintln!(
                    "timing {spec}
  batch {}, Sq {}, Skv {}, {} runs",
                    shape.batch, shape.seq, shape.kv_len, shape.reps
                );
            }
            let t = match backend {
                run::Backend::Cuda if backward => bench::bench_backward_cuda(&spec, &shape),
                _ if backward => bench::bench_backward(&spec, &shape, !json),
                run::Backend::Cuda => bench::bench_cuda(&spec, &shape),
                _ => bench::bench(&spec, &shape, !json),
            }
            .map_err(|e| format!("error: {e}"))?;
            if json {
                println!(
                    "{{\"median_ms\": {:.4}, \"gflops\": {:.2}, \"compile_ms\": {:.3}}}",
                    t.median_ms, t.gflops, t.compile_ms
                );
            } else {
                println!(
                    "median {:.3} ms, {:.1} GFLOP/s, kernel compiled in {:.2} ms",
                    t.median_ms, t.gflops, t.compile_ms
                );
            }
            Ok(())
        }),
        Command::BenchDecode {
            spec,
            kv_len,
            batch,
            q_len,
            block_size,
            reps,
            json,
            backend,
        } => spec_arg::load(&spec).and_then(|(spec, _)| {
            let shape = bench_decode::Shape {
                batch: batch as usize,
                kv_len: kv_len as usize,
                q_len: q_len as usize,
                block_size: block_size as usize,
                reps: reps as usize,
            };
            if !json {
                eprintln!(
                    "timing decode steps of {spec}\n  batch {}, cache {} tokens in blocks of {}, \
                     {} queries per step, {} steps",
                    shape.batch, shape.kv_len, shape.block_size, shape.q_len, shape.reps
                );
            }
            let t = bench_decode::bench(&spec, &shape, backend, !json)
                .map_err(|e| format!("error: {e}"))?;
            if json {
                let kernel = t.kernel.map_or(String::new(), |(us, gbps)| {
                    format!(", \"kernel_us\": {us:.2}, \"kernel_gbps\": {gbps:.2}")
                });
                println!(
                    "{{\"median_us\": {:.2}, \"gbps\": {:.2}{kernel}}}",
                    t.median_us, t.gbps
                );
            } else {
                println!(
                    "median {:.1} us per step, {:.2} GB/s of K+V read, kernel compiled in {:.2} ms",
                    t.median_us, t.gbps, t.compile_ms
                );
                if let Some((us, gbps)) = t.kernel {
                    println!(
                        "  of which the kernels (decode and merge, CUDA events): {us:.1} us, \
                         {gbps:.2} GB/s; host and copies: {:.1} us",
                        t.median_us - us
                    );
                }
            }
            Ok(())
        }),
        Command::Logits {
            model,
            init_seed,
            tokens,
            incremental,
            output,
            backend,
        } => outputs::check(&output, &[&model])
            .and_then(|()| model_cmd::parse_tokens(&tokens))
            .and_then(|t| {
                let model = model_cmd::load_on(&model, init_seed, backend)?;
                model_cmd::logits(&model, &t, incremental, &output, backend)
            })
            .map(|summary| println!("{summary}")),
        Command::Generate {
            model,
            init_seed,
            tokens,
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            stop,
            backend,
        } => {
            let checked = if !(temperature >= 0.0 && temperature.is_finite()) {
                Err(format!(
                    "error: --temperature {temperature}: expected 0 or more"
                ))
            } else if top_k == Some(0) {
                Err("error: --top-k 0 keeps no token; expected at least 1".to_string())
            } else if top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
                Err("error: --top-p: expected a probability in (0, 1]".to_string())
            } else {
                Ok(())
            };
            checked
                .and_then(|()| {
                    let stop = match &stop {
                        Some(s) => model_cmd::parse_tokens(s)?,
                        None => Vec::new(),
                    };
                    let sampling = attn::runtime::model::Sampling {
                        temperature,
                        top_k,
                        top_p,
                        seed,
                    };
                    let prompt = match (&tokens, prompt) {
                        (Some(ids), _) => model_cmd::Prompt::Ids(model_cmd::parse_tokens(ids)?),
                        (None, Some(text)) => model_cmd::Prompt::Text(text),
                        (None, None) => unreachable!("clap requires --tokens or --prompt"),
                    };
                    let request = model_cmd::GenerateArgs {
                        max_new_tokens,
                        sampling,
                        stop,
                        backend,
                    };
                    model_cmd::generate(&model, init_seed, prompt, request)
                })
                .map(|out| println!("{out}"))
        }
        Command::Params {
            model,
            init_seed,
            seq,
        } => model_cmd::load(&model, init_seed)
            .and_then(|m| model_cmd::params(&m, seq))
            .map(|summary| println!("{summary}")),
        Command::Emit {
            spec,
            mut target,
            emit,
            output,
            out_dir,
        } => {
            if target.is_empty() {
                target.push(emit::Target::Sm90);
            }
            let spec_text = spec.clone();
            spec_arg::load(&spec).and_then(|(spec, _)| match &out_dir {
                Some(dir) => emit::emit_all(&spec, &target, emit, dir),
                None => emit::emit(&spec, &target, emit).and_then(|text| match &output {
                    Some(path) => outputs::check(path, &spec_file(&spec_text)).and_then(|()| {
                        std::fs::write(path, text)
                            .map_err(|e| format!("error: {}: {e}", path.display()))
                    }),
                    None => {
                        print!("{text}");
                        Ok(())
                    }
                }),
            })
        }
        Command::Cache { action } => emit::cache(action),
        Command::CheckDevice { backend } => match check_device::run(backend) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::from(1),
            Err(e) => Err(format!("error: {e}")),
        },
        Command::Peak {
            seconds,
            memory: true,
        } => {
            use attn::runtime::cpu::bandwidth::peak_read_gbps;
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            peak_read_gbps(1, seconds)
                .and_then(|one| Ok((one, peak_read_gbps(threads, seconds)?)))
                .map(|(one, all)| {
                    println!("memory reads: {one:.1} GB/s on 1 thread, {all:.1} GB/s on {threads}")
                })
                .map_err(|e| format!("error: {e}"))
        }
        Command::Peak {
            seconds,
            memory: false,
        } => {
            use attn::runtime::cpu::microkernels::{Isa, peak_gflops};
            let isa = Isa::detect();
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let one = peak_gflops(isa, 1, seconds);
            let all = peak_gflops(isa, threads, seconds);
            println!(
                "{isa:?} microkernel: {one:.1} GFLOP/s on 1 thread, {all:.1} GFLOP/s on {threads}"
            );
            Ok(())
        }
        Command::Explain {
            spec,
            model_dim,
            layers,
            seq,
            batch,
        } => spec_arg::load(&spec).and_then(|(spec, _)| {
            let shape = explain::Shape {
                model_dim: model_dim.unwrap_or(u64::from(spec.heads) * u64::from(spec.head_dim)),
                layers,
                seq,
                batch,
            };
            explain::table(&spec, &shape).map(|table| print!("{table}"))
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprint!("{message}");
            if !message.ends_with('\n') {
                eprintln!();
            }
            ExitCode::from(2)
        }
    }
}
