//! `attnc run` and `attnc grad` with data tensors in the input file: a document mask and
//! Forgetting-Transformer gates against the f64 reference (the gates' gradient `dgate`
//! included), and data missing or of the wrong type refused with exit code 2.

use super::{attnc, stderr, temp, tensor_values};
use attn::dsl::modifier::ParamValues;
use attn::dsl::reference::{self, Array, Inputs};
use safetensors::Dtype;

const SPEC: &str = "heads = 2, head_dim = 8, mask = causal, \
                    data(doc: [batch, seq] i32, gate: [batch, heads, seq] f32), \
                    mask_mod = |b, h, q, k| doc[b, q] == doc[b, k], \
                    score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k]";

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Writes `tensors` (name, dtype, shape, little-endian bytes) to a safetensors file.
fn write(name: &str, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> std::path::PathBuf {
    let path = temp(name);
    let views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, dtype, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes);
            (*n, view.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn run_and_grad_read_data_tensors_and_write_their_gradients() {
    let (b, h, s, d) = (2, 2, 40, 8);
    let [q, k, v, dout] = [1, 2, 3, 4].map(|seed| values(b * h * s * d, seed));
    // Two documents in item 0 (keys 0..25, 25..40), three in item 1.
    let doc: Vec<i32> = (0..b * s)
        .map(|i| {
            let j = (i % s) as i32;
            if i < s { i32::from(j >= 25) } else { j / 14 }
        })
        .collect();
    let gate: Vec<f32> = values(b * h * s, 5)
        .iter()
        .map(|x| -0.3 * (1.0 + x))
        .collect();
    let shape = vec![b, h, s, d];
    let mut tensors = vec![
        ("q", Dtype::F32, shape.clone(), f32_bytes(&q)),
        ("k", Dtype::F32, shape.clone(), f32_bytes(&k)),
        ("v", Dtype::F32, shape.clone(), f32_bytes(&v)),
        ("dout", Dtype::F32, shape.clone(), f32_bytes(&dout)),
        ("gate", Dtype::F32, vec![b, h, s], f32_bytes(&gate)),
    ];
    let with_doc = |dtype: Dtype, bytes: Vec<u8>| {
        let mut all = tensors.clone();
        all.push(("doc", dtype, vec![b, s], bytes));
        all
    };
    let doc_bytes: Vec<u8> = doc.iter().flat_map(|x| x.to_le_bytes()).collect();
    let input = write("data-in.safetensors", &with_doc(Dtype::I32, doc_bytes));

    let spec: attn::AttentionSpec = SPEC.parse().unwrap();
    let array =
        |v: &[f32]| Array::from_vec(&shape, v.iter().map(|x| f64::from(*x)).collect()).unwrap();
    let (qa, ka, va, da) = (array(&q), array(&k), array(&v), array(&dout));
    let x = Inputs {
        q: &qa,
        k: &ka,
        v: &va,
        position_offset: 0,
    };
    let data = [
        ParamValues {
            name: "doc".into(),
            shape: vec![b, s],
            values: doc.iter().map(|x| f64::from(*x)).collect(),
        },
        ParamValues {
            name: "gate".into(),
            shape: vec![b, h, s],
            values: gate.iter().map(|x| f64::from(*x)).collect(),
        },
    ];
    let forward = reference::attention_learned(&spec, &x, &data).unwrap();
    let backward = reference::backward_learned(&spec, &x, &da, &data).unwrap();
    assert_eq!(
        backward.learned.len(),
        1,
        "only the f32 tensor has a gradient"
    );
    let close = |what: &str, got: Vec<f64>, want: &[f64]| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    };
    for (command, backend) in [("grad", "cpu"), ("run", "gpu-sim")] {
        let out = temp(&format!("data-{command}-{backend}.safetensors"));
        let o = attnc(&[
            command,
            "--spec",
            SPEC,
            "--input",
            input.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--backend",
            backend,
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let what = |name: &str| format!("{command} on {backend}: {name}");
        close(&what("out"), tensor_values(&out, "out"), forward.out.data());
        close(&what("lse"), tensor_values(&out, "lse"), forward.lse.data());
        if command == "grad" {
            close(&what("dq"), tensor_values(&out, "dq"), backward.dq.data());
            close(&what("dk"), tensor_values(&out, "dk"), backward.dk.data());
            close(&what("dv"), tensor_values(&out, "dv"), backward.dv.data());
            close(
                &what("dgate"),
                tensor_values(&out, "dgate"),
                &backward.learned[0].values,
            );
        }
    }

    // `doc` stored as f32, or missing: exit code 2, naming it.
    let as_float = write(
        "data-float.safetensors",
        &with_doc(
            Dtype::F32,
            f32_bytes(&doc.iter().map(|x| *x as f32).collect::<Vec<_>>()),
        ),
    );
    tensors.truncate(5);
    let missing = write("data-missing.safetensors", &tensors);
    for (input, says) in [
        (
            as_float,
            "data tensor `doc` is stored as F32; the spec declares it i32",
        ),
        (missing, "doc"),
    ] {
        let out = temp("data-refused.safetensors");
        let o = attnc(&[
            "run",
            "--spec",
            SPEC,
            "--input",
            input.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains(says), "{}", stderr(&o));
    }
}

/// `attnc ir --seq N --data FILE`: the tile map and the mask picture of a document mask,
/// classified from the ids: tiles across documents skipped, none without the data.
#[test]
fn ir_draws_the_tiles_a_document_mask_keeps_from_its_data() {
    let spec = "heads = 2, head_dim = 16, mask = causal, data(doc: [batch, seq] i32), \
                mask_mod = |b, h, q, k| doc[b, q] == doc[b, k]";
    // Two documents of 256 keys: the tiles of the first's queries against the second's keys
    // are skipped.
    let ids: Vec<u8> = (0..512i32).flat_map(|j| (j / 256).to_le_bytes()).collect();
    let data = write(
        "ir-docs.safetensors",
        &[("doc", Dtype::I32, vec![1, 512], ids)],
    );
    let svg = temp("ir-docs.svg");
    let o = attnc(&[
        "ir",
        spec,
        "--seq",
        "512",
        "--data",
        data.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = super::stdout(&o);
    let heading = out.lines().find(|l| l.starts_with("-- tiles at")).unwrap();
    assert!(
        heading.contains("skipped") && !heading.contains(" 0 skipped"),
        "{out}"
    );
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(
        picture.starts_with("<svg") && picture.contains("skipped"),
        "{picture}"
    );
    // Without --data the map cannot be drawn: exit 2, saying what to give.
    let o = attnc(&["ir", spec, "--seq", "512"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--data FILE"), "{}", stderr(&o));
}
