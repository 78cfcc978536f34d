//! Every golden gradient case (PyTorch float64 autograd, `scripts/make_grad_fixtures.py`) through
//! `attnc grad` on the CPU and on the GPU IR interpreter (`gpu-sim`: the SIMT kernels for f32,
//! the tensor-core ones for bf16 and f16): dq, dk and dv (MLA: the gradients of q_nope, q_pe,
//! c_kv, k_pe and w_kv_b, on the CPU) and each learnable tensor's `d<name>` within 2e-5 abs +
//! 2e-4 rel for f32 inputs, and for 16-bit inputs within 2x the error of PyTorch's own autograd
//! run in that dtype. `out` and `lse` as the forward cases. Parameters (`params(...)`) run on the
//! SIMT kernels, whose dq kernel also sums their gradients.

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gradients")
}

/// A tensor's values as f64, whatever its stored dtype.
pub(crate) fn values(st: &SafeTensors, name: &str) -> Vec<f64> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let bytes = t.data();
    match t.dtype() {
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        other => panic!("{name}: dtype {other:?}"),
    }
}

#[test]
fn every_golden_gradient_case_passes_through_attnc_grad() {
    golden_cases("cpu");
}

#[test]
fn every_golden_gradient_case_passes_on_the_gpu_kernels() {
    golden_cases("gpu-sim");
}

fn golden_cases(backend: &str) {
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).unwrap())
            .unwrap();
    let cases: Vec<(&String, &Value)> = manifest["cases"].as_object().unwrap().iter().collect();
    assert!(cases.len() >= 9);
    // Each case is an attnc process; they run side by side, a worker per core.
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                while let Some((name, case)) = cases.get(next.fetch_add(1, Ordering::Relaxed)) {
                    golden_case(backend, name, case);
                }
            });
        }
    });
}

/// One golden case through `attnc grad` on `backend`, against PyTorch's gradients.
fn golden_case(backend: &str, name: &str, case: &Value) {
    let mla = case.get("grads").is_some();
    let learned: Vec<&str> = case
        .get("learned")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let input = fixtures().join(case["file"].as_str().unwrap());
    let output = std::env::temp_dir().join(format!(
        "attn-grad-{backend}-{name}-{}.st",
        std::process::id()
    ));
    let o = Command::new(env!("CARGO_BIN_EXE_attnc"))
        .args(["grad", "--backend", backend])
        .args(["--spec", case["spec"].as_str().unwrap()])
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .args([
            "--position-offset",
            &case["position_offset"].as_i64().unwrap().to_string(),
        ])
        .output()
        .unwrap();
    if mla && backend != "cpu" {
        // MLA's backward runs on the CPU backend only: a clear error elsewhere.
        assert_eq!(o.status.code(), Some(2), "{backend} {name}");
        let said = String::from_utf8_lossy(&o.stderr);
        assert!(
            said.contains("does not run the MLA backward"),
            "{backend} {name}: {said}"
        );
        return;
    }
    assert_eq!(
        o.status.code(),
        Some(0),
        "{name}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let want_bytes = std::fs::read(&input).unwrap();
    let got_bytes = std::fs::read(&output).unwrap();
    std::fs::remove_file(&output).ok();
    let (want, got) = (
        SafeTensors::deserialize(&want_bytes).unwrap(),
        SafeTensors::deserialize(&got_bytes).unwrap(),
    );
    let low_precision = case["dtype"] != "f32";
    let names: Vec<&str> = match case.get("grads") {
        Some(names) => names
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap())
            .collect(),
        None => vec!["dq", "dk", "dv"],
    };
    let learned_grads: Vec<String> = learned.iter().map(|n| format!("d{n}")).collect();
    let names: Vec<&str> = names
        .into_iter()
        .chain(learned_grads.iter().map(String::as_str))
        .collect();
    for grad in names {
        assert_eq!(
            got.tensor(grad).unwrap().shape(),
            want.tensor(grad).unwrap().shape()
        );
        let (g, w) = (values(&got, grad), values(&want, grad));
        let max_err = g
            .iter()
            .zip(&w)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0, f64::max);
        eprintln!("{backend} {name} {grad}: max error {max_err:.2e}");
        if low_precision {
            let torch = case["torch_lowp_grad_max_abs_err"][grad].as_f64().unwrap();
            assert!(
                max_err <= 2.0 * torch,
                "{backend} {name} {grad}: max error {max_err}, PyTorch's own {torch}"
            );
        } else {
            for (i, (g, w)) in g.iter().zip(&w).enumerate() {
                assert!(
                    (g - w).abs() <= 2e-5 + 2e-4 * w.abs(),
                    "{backend} {name} {grad}[{i}]: got {g}, want {w}"
                );
            }
        }
    }
    // The tensor-core forward's lse of 16-bit inputs: `ex2.approx` and 16-bit `Q K^T`.
    let lse_tol = if backend != "cpu" && low_precision {
        2e-3
    } else {
        1e-4
    };
    let (lse, want_lse) = (values(&got, "lse"), values(&want, "lse"));
    for (g, w) in lse.iter().zip(&want_lse) {
        assert!(
            (w.is_infinite() && g == w) || (g - w).abs() <= lse_tol * (1.0 + w.abs()),
            "{backend} {name} lse: got {g}, want {w}"
        );
    }
}
