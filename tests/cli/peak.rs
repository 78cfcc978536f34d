//! `attnc peak`: the machine's read ceiling.

use crate::{attnc, stderr, stdout};

#[test]
fn peak_memory_reports_the_read_ceiling() {
    let o = attnc(&["peak", "--memory", "--seconds", "0.05"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    // "memory reads: X GB/s on 1 thread, Y GB/s on N"
    let rates: Vec<f64> = text
        .split_whitespace()
        .filter_map(|w| w.parse::<f64>().ok())
        .collect();
    assert!(text.starts_with("memory reads:"), "{text}");
    assert!(
        rates.len() >= 2 && rates[0] > 0.0 && rates[1] > 0.0,
        "{text}"
    );
}

/// `ATTN_CPU_ISA` picks the CPU kernels' instruction set; a name that is not one, or one this
/// CPU lacks, is refused before any work (exit 2, naming what this CPU runs).
#[test]
fn the_instruction_set_is_chosen_by_name() {
    let run = |isa: &str, args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_attnc"))
            .args(args)
            .env("ATTN_CPU_ISA", isa)
            .env("ATTN_CACHE_DIR", crate::test_cache())
            .output()
            .expect("attnc runs")
    };
    let o = run("portable", &["peak", "--seconds", "0.05"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with("Portable microkernel:"),
        "{}",
        stdout(&o)
    );
    // Every set the refusal lists as running here is taken; avx512_bf16 times avx512's f32
    // microkernel.
    let refusal = stderr(&run("avx3", &["check", "heads = 2, head_dim = 32"]));
    let (_, here) = refusal
        .trim()
        .split_once("this CPU runs: ")
        .expect("the sets listed");
    for isa in here.split(", ") {
        let o = run(isa, &["peak", "--seconds", "0.05"]);
        assert_eq!(o.status.code(), Some(0), "{isa}: {}", stderr(&o));
        let label = if isa == "avx512_bf16" { "avx512" } else { isa };
        let out = stdout(&o).to_lowercase();
        assert!(out.starts_with(&format!("{label} microkernel:")), "{out}");
    }
    // No kernel uses AMX: refused, with the reason, on any CPU.
    let o = run("amx", &["check", "heads = 2, head_dim = 32"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("AMX"), "{}", stderr(&o));
    for bad in ["avx3", "", "AVX512 "] {
        let o = run(bad, &["check", "heads = 2, head_dim = 32"]);
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("ATTN_CPU_ISA") && e.contains("portable"), "{e}");
        assert!(stdout(&o).is_empty());
    }
}
