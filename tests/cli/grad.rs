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

/// `attnc grad` and `attnc run` on a golden case packed as a variable-length batch (its two
/// batch rows as two sequences, `cu_seqlens_q` and `cu_seqlens_k` in the input): the gradients,
/// `out` and `lse` come back packed and equal PyTorch's (the forward on the interpreter too).
#[test]
fn grad_and_run_take_a_variable_length_batch_from_cu_seqlens() {
    let golden = format!(
        "{}/tests/fixtures/gradients/gqa_rope_offset_f32.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let spec = "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope";
    let (q, kv) = ([2, 8, 33, 64], [2, 2, 70, 64]);
    let input = temp("varlen-grad-in.safetensors");
    let names = [("q", q), ("k", kv), ("v", kv), ("dout", q)];
    let tensors = write_packed(&golden, &input, &names, [33, 70], &[]);
    let offsets =
        |n: i32| -> Vec<u8> { [0, n, 2 * n].iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (cu_q, cu_k) = (offsets(33), offsets(70));
    // The interpreter's backward is slow: gpu-sim runs the forward here, and the runtime's
    // tests take its varlen backward.
    for (command, backend) in [("grad", "cpu"), ("run", "cpu"), ("run", "gpu-sim")] {
        let out = temp(&format!("varlen-{command}-{backend}.safetensors"));
        let o = attnc(&[
            command,
            "--spec",
            spec,
            "--input",
            input.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--position-offset",
            "5",
            "--backend",
            backend,
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let names: &[(&str, [usize; 4])] = match command {
            "grad" => &[
                ("dq", q),
                ("dk", kv),
                ("dv", kv),
                ("out", q),
                ("lse", [2, 8, 33, 1]),
            ],
            _ => &[("out", q), ("lse", [2, 8, 33, 1])],
        };
        for &(name, shape) in names {
            let want = pack(tensor_values(&golden, name), shape);
            let got = tensor_values(&out, name);
            assert_eq!(got.len(), want.len(), "{command} {backend} {name}");
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-4 + 1e-3 * w.abs(),
                    "{command} on {backend}, {name}: {g} vs {w}"
                );
            }
        }
    }
    // Offsets without their partner, or not i32, are refused with exit code 2.
    let write = |name: &str, extra: &[(&str, safetensors::Dtype, &Vec<u8>)]| {
        let path = temp(name);
        let views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|(n, shape, bytes)| (*n, safetensors::Dtype::F32, shape.clone(), bytes))
            .chain(
                extra
                    .iter()
                    .map(|(n, dtype, bytes)| (*n, *dtype, vec![3], *bytes)),
            )
            .map(|(n, dtype, shape, bytes)| {
                (
                    n,
                    safetensors::tensor::TensorView::new(dtype, shape, bytes).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
        path
    };
    let float_offsets: Vec<u8> = [0f32, 33.0, 66.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let i32 = safetensors::Dtype::I32;
    for (file, extra, words) in [
        (
            "varlen-lonely.safetensors",
            vec![("cu_seqlens_q", i32, &cu_q)],
            "cu_seqlens_q but not cu_seqlens_k",
        ),
        (
            "varlen-float.safetensors",
            vec![
                ("cu_seqlens_q", safetensors::Dtype::F32, &float_offsets),
                ("cu_seqlens_k", i32, &cu_k),
            ],
            "tensor `cu_seqlens_q` is F32 of shape [3]; expected I32 of one dimension",
        ),
    ] {
        let input = write(file, &extra);
        let out = temp("varlen-refused-out.safetensors");
        let o = attnc(&[
            "run",
            "--spec",
            spec,
            "--input",
            input.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains(words), "{}", stderr(&o));
    }
}

/// `attnc run` on a differential golden case writes PyTorch's output (`heads / 2` heads), and a
/// file without lambda's vectors is refused naming the one missing.
#[test]
fn run_computes_differential_heads_and_names_a_missing_lambda_vector() {
    let golden = format!(
        "{}/tests/fixtures/gradients/differential_causal_gqa_rope_f32.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let spec = "heads = 8, kv_heads = 4, head_dim = 32, v_head_dim = 64, mask = causal, \
                position = rope, differential = lambda";
    let out = temp("run-differential.safetensors");
    let o = attnc(&[
        "run",
        "--spec",
        spec,
        "--input",
        &golden,
        "--output",
        out.to_str().unwrap(),
        "--position-offset",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let (g, w) = (tensor_values(&out, "out"), tensor_values(&golden, "out"));
    assert_eq!(g.len(), 2 * 4 * 48 * 64);
    assert_eq!(g.len(), w.len());
    for (g, w) in g.iter().zip(&w) {
        assert!((g - w).abs() <= 1e-5 + 1e-4 * w.abs(), "out: {g} vs {w}");
    }
    // A plain attention fixture has no lambda vectors.
    let o = attnc(&[
        "run",
        "--spec",
        "heads = 4, head_dim = 64, mask = causal, differential = lambda",
        "--input",
        &fixture("mha_causal_f32.safetensors"),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("`v`") || stderr(&o).contains("lambda_q1"),
        "{}",
        stderr(&o)
    );
}

/// `[B, H, S, W]` values as `[B * S, H, W]`: each batch row a sequence of a packed batch.
fn pack(values: Vec<f64>, [_, h, s, w]: [usize; 4]) -> Vec<f64> {
    let mut out = vec![0.0; values.len()];
    for (i, v) in values.into_iter().enumerate() {
        let (bi, hi, si, wi) = (i / (h * s * w), i / (s * w) % h, i / w % s, i % w);
        out[((bi * s + si) * h + hi) * w + wi] = v;
    }
    out
}

/// Writes `input`: `golden`'s tensors `names` (two batch rows each) packed as f32 `[2 S, H,
/// W]`, `extra` as they are (f32, of the shapes given), and `cu_seqlens_q` and `cu_seqlens_k`
/// for two sequences of `[queries, keys]`. Returns the packed tensors: name, shape, bytes.
fn write_packed(
    golden: &str,
    input: &std::path::Path,
    names: &[(&'static str, [usize; 4])],
    [sq, skv]: [i32; 2],
    extra: &[(&'static str, Vec<usize>)],
) -> Vec<(&'static str, Vec<usize>, Vec<u8>)> {
    let f32_bytes = |values: Vec<f64>| -> Vec<u8> {
        values
            .iter()
            .flat_map(|&x| (x as f32).to_le_bytes())
            .collect()
    };
    let tensors: Vec<(&str, Vec<usize>, Vec<u8>)> = names
        .iter()
        .map(|&(name, [b, h, s, w])| {
            let packed = pack(tensor_values(golden, name), [b, h, s, w]);
            (name, vec![b * s, h, w], f32_bytes(packed))
        })
        .collect();
    let extra: Vec<(&str, Vec<usize>, Vec<u8>)> = extra
        .iter()
        .map(|(name, shape)| (*name, shape.clone(), f32_bytes(tensor_values(golden, name))))
        .collect();
    let offsets =
        |n: i32| -> Vec<u8> { [0, n, 2 * n].iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (cu_q, cu_k) = (offsets(sq), offsets(skv));
    let mut views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
        .iter()
        .chain(&extra)
        .map(|(n, shape, bytes)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes);
            (*n, view.unwrap())
        })
        .collect();
    for (name, bytes) in [("cu_seqlens_q", &cu_q), ("cu_seqlens_k", &cu_k)] {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![3], bytes);
        views.push((name, view.unwrap()));
    }
    safetensors::serialize_to_file(views, None, input).unwrap();
    tensors
}

/// `attnc grad` on the differential golden case packed as two sequences: the output, every
/// gradient (packed) and lambda's vectors' gradients equal PyTorch's.
#[test]
fn grad_takes_differential_heads_over_a_packed_batch() {
    let golden = format!(
        "{}/tests/fixtures/gradients/differential_causal_gqa_rope_f32.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let spec = "heads = 8, kv_heads = 4, head_dim = 32, v_head_dim = 64, mask = causal, \
                position = rope, differential = lambda";
    let (q, k, v, out) = (
        [2, 8, 48, 32],
        [2, 4, 60, 32],
        [2, 2, 60, 64],
        [2, 4, 48, 64],
    );
    let names = [("q", q), ("k", k), ("v", v), ("dout", out)];
    let lambda = ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"].map(|n| (n, vec![32]));
    let input = temp("varlen-differential-in.safetensors");
    write_packed(&golden, &input, &names, [48, 60], &lambda);
    let output = temp("varlen-differential-out.safetensors");
    let o = attnc(&[
        "grad",
        "--spec",
        spec,
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
        "--position-offset",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for (name, shape) in [("out", out), ("dq", q), ("dk", k), ("dv", v)] {
        let (got, want) = (
            tensor_values(&output, name),
            pack(tensor_values(&golden, name), shape),
        );
        assert_eq!(got.len(), want.len(), "{name}");
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-4 + 1e-3 * w.abs(), "{name}: {g} vs {w}");
        }
    }
    for (name, _) in lambda {
        let name = format!("d{name}");
        let (got, want) = (tensor_values(&output, &name), tensor_values(&golden, &name));
        assert_eq!(got.len(), 32, "{name}");
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-3 + 1e-3 * w.abs(), "{name}: {g} vs {w}");
        }
    }
}
