//! `attnc grad`: gradients on the CPU and the GPU interpreter, and refusals of bad inputs.

use crate::{attnc, fixture, stderr, temp, tensor_values};

#[test]
fn grad_rejects_bad_inputs_with_exit_code_2() {
    let out = temp("grad-unused.safetensors");
    let out = out.to_str().unwrap();
    // A forward fixture has q, k and v but no dout.
    let o = attnc(&[
        "grad",
        "--spec",
        "heads = 4, head_dim = 64, mask = causal",
        "--input",
        &fixture("mha_causal_f32.safetensors"),
        "--output",
        out,
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("dout"), "{}", stderr(&o));
    // The spec's head count disagrees with the tensors.
    let golden = format!(
        "{}/tests/fixtures/gradients/mha_causal_f32.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let o = attnc(&[
        "grad",
        "--spec",
        "heads = 2, head_dim = 64",
        "--input",
        &golden,
        "--output",
        out,
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("`q`") || stderr(&o).contains("q"),
        "{}",
        stderr(&o)
    );
    // An MLA spec reads MLA's tensors, and says which one the file lacks.
    let o = attnc(&[
        "grad",
        "--spec",
        "heads = 2, head_dim = 16, mla(latent_rank = 32, rope_dim = 16)",
        "--input",
        &golden,
        "--output",
        out,
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no tensor `q_nope`"), "{}", stderr(&o));
}

#[test]
fn grad_runs_on_the_gpu_interpreter() {
    let golden = format!(
        "{}/tests/fixtures/gradients/top_left_sq_gt_skv_f32.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = temp("grad-gpu-sim.safetensors");
    let o = attnc(&[
        "grad",
        "--spec",
        "heads = 2, head_dim = 16, mask = causal(top_left)",
        "--input",
        &golden,
        "--output",
        out.to_str().unwrap(),
        "--backend",
        "gpu-sim",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for name in ["dq", "dk", "dv"] {
        let (g, w) = (tensor_values(&out, name), tensor_values(&golden, name));
        assert_eq!(g.len(), w.len());
        for (g, w) in g.iter().zip(&w) {
            assert!((g - w).abs() <= 1e-4 + 1e-3 * w.abs(), "{name}: {g} vs {w}");
        }
    }
}
