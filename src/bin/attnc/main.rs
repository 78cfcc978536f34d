//! `attnc`: the attn command-line front end. Each command is a module of its own: its
//! arguments (`Args`) and what it does (`command`).
//!
//! Exit codes: 0 on success, 2 on bad input (an invalid spec, an unreadable file, bad flags),
//! with a message on stderr that says what was wrong and where.

#![forbid(unsafe_code)]

// The commands that run under mpirun (train, sweep) write their progress with `say!`.
#[cfg(feature = "candle")]
#[macro_use]
mod say;

mod backend_arg;
mod bench;
mod bench_decode;
mod bench_documents;
mod bench_model;
mod cache;
mod call_data;
mod check;
mod check_device;
mod differential;
mod emit;
mod explain;
mod generate;
mod grad;
mod input_file;
mod ir;
mod logits;
mod mask_svg;
mod model_load;
mod outputs;
mod params;
mod peak;
mod run;
mod spec_arg;
mod sweep;
mod train;

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
    Check(check::Args),
    /// Print the modifier IR (as lowered and folded) and the forward kernel plan.
    Ir(ir::Args),
    /// Run attention: read q, k, v (MLA: q_nope, q_pe, c_kv, k_pe, w_kv_b) from a safetensors
    /// file, write `out` and `lse` to another (on the CPU, or the GPU kernels with --backend).
    Run(run::Files),
    /// Gradients of attention: read q, k, v and dout (the gradient of the loss with respect to
    /// the output) from a safetensors file; run the forward (which saves out and lse) and the
    /// backward; write dq, dk, dv (input dtype), out and lse to another, and the gradient
    /// `d<name>` of each learnable tensor and f32 data tensor. For MLA specs: q_nope,
    /// q_pe, c_kv, k_pe, w_kv_b and dout in; dq_nope, dq_pe, dc_kv, dk_pe, dw_kv_b, out and lse
    /// out (cpu backend).
    Grad(run::Files),
    /// Time the forward kernel of a spec on random inputs: median ms, GFLOP/s (4 B Hq Sq Skv D,
    /// halved for causal masks) and the kernel's compile time (on cuda: PTX emitted and loaded).
    Bench(bench::Args),
    /// Time decoding steps against a paged KV cache: median time per step and the effective
    /// GB/s of K and V read (every cached token of every sequence, in the cache's dtype).
    BenchDecode(bench_decode::Args),
    /// Time a whole model on the CPU: prefill tokens/s at each prompt length and decode
    /// tokens/s after each context length (the median step), against the roofline of reading
    /// the weights, and the weights and the KV cache, at `peak --memory`'s rate; with
    /// --against-torch, transformers on the same checkpoint side by side.
    BenchModel(bench_model::Args),
    /// Logits of a token sequence from a model (a Hugging Face checkpoint folder or a research
    /// model's TOML file): one full forward, or a prefill
    /// then one token at a time (`--incremental P`). Writes `logits` [1, T, vocab] (f32).
    Logits(logits::Args),
    /// Continue a prompt with a model (a Hugging Face checkpoint folder or a research model's
    /// TOML file; greedy unless --temperature). With
    /// --prompt, streams the new text (the checkpoint's tokenizer.json reads and writes it); with
    /// --tokens, prints the new token ids. Progress and tokens/s go to stderr.
    Generate(generate::Args),
    /// Parameters per part of a model (a Hugging Face checkpoint folder or a research model's
    /// TOML file), and its KV-cache bytes.
    Params(params::Args),
    /// Write a spec's GPU kernels as GPU IR, LLVM IR or PTX: its forward kernel to a file or
    /// standard output, or with --out-dir every kernel for every --target and a manifest of
    /// launch records (manifest.json). PTX comes from the kernel disk cache or is compiled
    /// (and cached); stderr says which.
    Emit(emit::Args),
    /// List or clear the disk cache of compiled kernels: the folder attn-kernels under
    /// ATTN_CACHE_DIR, else under the platform's cache directory's attn/ (~/.cache/attn on
    /// Linux). Only files it wrote are listed or removed.
    Cache(cache::Args),
    /// Check the GPU backend on CUDA device 0 (or the GPU IR interpreter) against the CPU
    /// backend: decode (cache uploaded per call and resident), ragged batches, MLA decode and
    /// prefill. Exit 1 when a case disagrees, 2 without a GPU or the `cuda` feature.
    CheckDevice(check_device::Args),
    /// Measure the FMA ceiling of this machine: the score microkernel on L1-resident tiles, per
    /// thread and on all threads; with --memory, the memory read ceiling instead.
    Peak(peak::Args),
    /// Print what a spec costs: KV-cache bytes, cache size, parameters and FLOPs.
    Explain(explain::Args),
    /// Train a research model (its TOML) on a text file through candle, with its attention on
    /// attn's kernels: metrics, checkpoints `attnc generate` loads, and a loss plot (needs the
    /// `candle` feature).
    Train(train::Args),
    /// Train every combination of a grid of model and attention settings over several seeds,
    /// and compare them by validation loss, cost and measured speed (table and plots).
    Sweep(sweep::Args),
}

fn main() -> ExitCode {
    let command = Cli::parse().command;
    // The CPU kernels' instruction set, refused before any work when ATTN_CPU_ISA is bad.
    if let Err(e) = attn::runtime::cpu::microkernels::Isa::from_env() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let result = match command {
        Command::Check(args) => check::command(args),
        Command::Ir(args) => ir::command(args),
        Command::Run(args) => run::command(args),
        Command::Grad(args) => grad::command(args),
        Command::Bench(args) => bench::command(args),
        Command::BenchDecode(args) => bench_decode::command(args),
        Command::BenchModel(args) => bench_model::command(args),
        Command::Logits(args) => logits::command(args),
        Command::Generate(args) => generate::command(args),
        Command::Params(args) => params::command(args),
        Command::Emit(args) => emit::command(args),
        Command::Cache(args) => cache::command(args),
        Command::CheckDevice(args) => match check_device::command(args) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::from(1),
            Err(e) => Err(e),
        },
        Command::Peak(args) => peak::command(args),
        Command::Explain(args) => explain::command(args),
        Command::Train(args) => train::command(args),
        Command::Sweep(args) => sweep::command(args),
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
