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

#[test]
fn grad_names_a_missing_or_misshapen_learnable_tensor() {
    let golden = format!(
        "{}/tests/fixtures/gradients/learned_slopes_gqa_f32.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = temp("grad-learned.safetensors");
    let run = |spec: &str| {
        attnc(&[
            "grad",
            "--spec",
            spec,
            "--input",
            &golden,
            "--output",
            out.to_str().unwrap(),
            "--position-offset",
            "2",
        ])
    };
    let base = "heads = 4, kv_heads = 2, head_dim = 32, mask = causal";
    let o = run(&format!(
        "{base}, params(slopes: [heads], extra: [2]), \
         score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32 + extra[0]"
    ));
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no tensor `extra`"), "{}", stderr(&o));
    let o = run(&format!(
        "{base}, params(slopes: [2]), score_mod = |s, b, h, q, k| s + slopes[h / 2]"
    ));
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("`slopes` has shape [4], expected [2]"),
        "{}",
        stderr(&o)
    );
    // The right spec writes the gradient of the slopes beside dq, dk and dv.
    let o = run(&format!(
        "{base}, params(slopes: [heads]), score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32"
    ));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let (got, want) = (
        tensor_values(&out, "dslopes"),
        tensor_values(&golden, "dslopes"),
    );
    assert_eq!(got.len(), 4);
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() <= 1e-4 + 2e-4 * w.abs(),
            "dslopes: {g} vs {w}"
        );
    }
}
