//! `attnc`: the attn command-line front end.
//!
//! Exit codes: 0 on success, 2 on bad input (an invalid spec, an unreadable file, bad flags),
//! with a message on stderr that says what was wrong and where.

mod explain;
mod ir;
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
        spec: String,
    },
    /// Print the modifier IR (as lowered and folded) and the forward kernel plan.
    Ir {
        /// The spec, in the spec language, or @FILE to read it from a file.
        spec: String,
        /// Also print the tile map for this many queries (`#` all kept, `.` skipped, `/` mixed).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
        seq: Option<u64>,
        /// Keys for the tile map (default: as many as queries).
        #[arg(long, value_name = "N", requires = "seq", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
        kv_len: Option<u64>,
    },
    /// Print what a spec costs: KV-cache bytes, cache size, parameters and FLOPs.
    Explain {
        /// The spec, in the spec language, or @FILE to read it from a file.
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check { spec } => spec_arg::load(&spec).map(|(spec, _)| println!("{spec}")),
        Command::Ir { spec, seq, kv_len } => spec_arg::load(&spec).map(|(spec, _)| {
            print!(
                "{}",
                ir::report(&spec, seq.map(|sq| (sq, kv_len.unwrap_or(sq))))
            );
        }),
        Command::Explain {
            spec,
            model_dim,
            layers,
            seq,
            batch,
        } => spec_arg::load(&spec).map(|(spec, _)| {
            let shape = explain::Shape {
                model_dim: model_dim.unwrap_or(u64::from(spec.heads) * u64::from(spec.head_dim)),
                layers,
                seq,
                batch,
            };
            print!("{}", explain::table(&spec, &shape));
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
