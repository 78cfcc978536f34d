//! Two attention variants whose GPU kernels are compiled while this crate builds
//! (`targets = [..]` with attn's `aot` feature) and embedded in the binary, which carries no
//! compiler: attn here has the `cuda` feature (cudarc) and not `llvm`.
//!
//! It lists each variant's embedded kernels and, for each of its targets, where the runtime
//! takes each kernel's PTX from (embedded, disk cache, or compiled). On a machine with an NVIDIA GPU it then runs both
//! forwards on the device, compares them with the CPU backend, and says where every kernel the
//! device loaded came from; it exits 1 when they disagree.

use attn::gpu::{Arch, ptx_for, spec_kernels};
use attn::prelude::*;
use std::process::ExitCode;

#[attention(
    heads = 8, kv_heads = 2, head_dim = 128, mask = causal, position = rope, dtype = bf16,
    targets = [sm_80, sm_90]
)]
struct Gqa;

#[attention(
    heads = 4, head_dim = 64, mask = sliding_window(256), softcap = 30.0, dtype = bf16,
    targets = [sm_90]
)]
struct Windowed;

fn main() -> ExitCode {
    let mut ok = true;
    ok &= show::<Gqa>("Gqa");
    ok &= show::<Windowed>("Windowed");
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Lists a variant's kernels, then runs it on the GPU when there is one.
fn show<A: Attention>(name: &str) -> bool {
    println!("{name}: {}", A::SPEC_TEXT);
    for k in A::embedded_kernels() {
        println!(
            "  embedded  {:<16} {:<22} {}  {} bytes of PTX",
            k.role,
            k.name,
            k.target,
            k.ptx.len()
        );
    }
    // The variant registers its embedded kernels on first use.
    let _ = A::variant();
    let kernels = spec_kernels(A::spec()).expect("kernels lower");
    // Its targets, and for each, where the runtime takes every kernel's PTX from.
    let targets = Arch::ALL
        .into_iter()
        .filter(|a| A::embedded_kernels().iter().any(|k| k.target == a.name()));
    for arch in targets {
        for k in &kernels {
            let origin = match ptx_for(&k.kernel, arch, None) {
                Ok(ptx) => ptx.origin.to_string(),
                Err(_) => "not available (no compiler in this build)".to_string(),
            };
            println!("  {} {:<16} from: {origin}", arch.name(), k.role);
        }
    }
    run_on_device::<A>()
}

/// The forward on CUDA device 0 against the CPU backend; true without a device.
fn run_on_device<A: Attention>() -> bool {
    use attn::gpu::CudaBackend;
    let gpu = match CudaBackend::new(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("  no GPU run: {e}");
            return true;
        }
    };
    let (b, sq) = (2, 100);
    let spec = A::spec();
    let tensor = |heads: u32, width: u32, seed: u64| {
        let shape = [b, heads as usize, sq, width as usize];
        attn::inputs::tensor(spec.dtype, &shape, seed).expect("a tensor")
    };
    let q = tensor(A::HEADS, A::HEAD_DIM, 1);
    let k = tensor(A::KV_HEADS, A::HEAD_DIM, 2);
    let v = tensor(A::KV_HEADS, A::V_HEAD_DIM, 3);
    let cpu = A::forward_on(&CpuBackend::new(), &q, &k, &v, 0).expect("the CPU runs it");
    let dev = match A::forward_on(&gpu, &q, &k, &v, 0) {
        Ok(out) => out,
        Err(e) => {
            println!("  GPU run failed: {e}");
            return false;
        }
    };
    let err = cpu
        .out
        .to_f32_vec()
        .iter()
        .zip(dev.out.to_f32_vec())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    for (kernel, origin) in gpu.device().kernel_origins() {
        println!(
            "  loaded {kernel} on {}: {origin}",
            gpu.device().arch().name()
        );
    }
    let ok = err <= 2e-2;
    println!(
        "  GPU against CPU: max |out| error {err:.2e} ({})",
        if ok { "ok" } else { "FAIL" }
    );
    ok
}
