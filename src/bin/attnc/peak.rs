//! `attnc peak`: this machine's ceilings, measured: the FMA rate of the score microkernel on
//! L1-resident tiles, or streaming reads from memory.

use attn::runtime::cpu::bandwidth::peak_read_gbps;
use attn::runtime::cpu::microkernels::{Isa, peak_gflops};

/// `attnc peak`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Seconds per measurement (more than 0, at most 60).
    #[arg(long, default_value_t = 1.0, value_parser = seconds_in_range)]
    seconds: f64,
    /// Measure streaming reads from memory (GB/s, 256 MiB per thread), the ceiling decoding
    /// is measured against.
    #[arg(long)]
    memory: bool,
}

/// A number of seconds: finite, more than 0 and at most a minute.
fn seconds_in_range(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s > 0.0 && s <= 60.0 => Ok(s),
        _ => Err(format!(
            "`{text}` is not a number of seconds; allowed: more than 0, at most 60"
        )),
    }
}

/// `attnc peak`: one thread, then every thread.
pub fn command(args: Args) -> Result<(), String> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if args.memory {
        let err = |e| format!("error: {e}");
        let one = peak_read_gbps(1, args.seconds).map_err(err)?;
        let all = peak_read_gbps(threads, args.seconds).map_err(err)?;
        println!("memory reads: {one:.1} GB/s on 1 thread, {all:.1} GB/s on {threads}");
    } else {
        // The f32 microkernel (avx512_bf16's is avx512's).
        let isa = Isa::chosen().vectors();
        let one = peak_gflops(isa, 1, args.seconds);
        let all = peak_gflops(isa, threads, args.seconds);
        println!(
            "{isa:?} microkernel: {one:.1} GFLOP/s on 1 thread, {all:.1} GFLOP/s on {threads}"
        );
    }
    Ok(())
}
