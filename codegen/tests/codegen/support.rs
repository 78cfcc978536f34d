//! Helpers the GPU tests share (feature `llvm`): ptxas, when the toolchain has it.

use codegen::gpu::llvm::Arch;
use std::path::PathBuf;

/// ptxas from the toolchain folder the setup script fills, or from PATH.
fn ptxas() -> Option<PathBuf> {
    let local = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../.cuda-toolchain/bin/ptxas"
    ));
    if local.exists() {
        return Some(local);
    }
    std::process::Command::new("ptxas")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| PathBuf::from("ptxas"))
}

/// Registers, spill bytes and shared bytes from `ptxas -v`.
fn resources(report: &str) -> (u32, u32, u32) {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find(|part| part.contains(unit))
            .and_then(|part| part.split_whitespace().find_map(|w| w.parse().ok()))
            .unwrap_or(0)
    };
    let mut out = (0, 0, 0);
    for line in report.lines() {
        if line.contains("Used") && line.contains("registers") {
            out.0 = number_before(line, "registers");
            out.2 = number_before(line, "smem");
        }
        if line.contains("spill stores") {
            out.1 = number_before(line, "spill stores");
        }
    }
    out
}

/// Assembles PTX with ptxas (`-v`) when ptxas is available: asserts it succeeds, prints and
/// returns (registers, spill bytes, shared bytes).
#[allow(dead_code)]
pub fn assemble(ptx: &str, arch: Arch, label: &str) -> Option<(u32, u32, u32)> {
    let report = assemble_report(ptx, arch, label)?;
    let (regs, spills, smem) = resources(&report);
    assert!(regs > 0, "{label}: no resource report in\n{report}");
    eprintln!(
        "{label} {}: {regs} registers, {spills} bytes spilled, {smem} bytes smem",
        arch.name()
    );
    Some((regs, spills, smem))
}

/// Assembles PTX with ptxas (`-v`) when ptxas is available: asserts it succeeds and returns
/// its report (warnings and resources).
pub fn assemble_report(ptx: &str, arch: Arch, label: &str) -> Option<String> {
    let ptxas = ptxas()?;
    let safe: String = label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let file = std::env::temp_dir().join(format!(
        "attn-{safe}-{}-{}.ptx",
        arch.name(),
        std::process::id()
    ));
    std::fs::write(&file, ptx).unwrap();
    let run = std::process::Command::new(&ptxas)
        .args(["-arch", arch.name(), "-v", "-o", "/dev/null"])
        .arg(&file)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(
        run.status.success(),
        "{label} {arch:?}: ptxas failed:\n{report}"
    );
    eprintln!("{label} {}:\n{report}", arch.name());
    Some(report)
}
