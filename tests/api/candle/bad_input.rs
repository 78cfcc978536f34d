//! Bad input to `attn::candle`: errors that name the tensor, what was expected and what was
//! found; defined results for NaN and empty sequences; no panic anywhere, and the op works
//! after every error.

use super::{tensor, var};
use attn::candle::core::{DType, Device, Tensor};

const SPEC: &str = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, position = rope";

fn variant() -> std::sync::Arc<attn::Variant> {
    attn::Variant::parse(SPEC).unwrap()
}

fn qkv(sq: usize, skv: usize) -> (Tensor, Tensor, Tensor) {
    (
        tensor(&[1, 4, sq, 16], 1),
        tensor(&[1, 2, skv, 16], 2),
        tensor(&[1, 2, skv, 16], 3),
    )
}

fn refused(q: &Tensor, k: &Tensor, v: &Tensor) -> String {
    attn::candle::attention(&variant(), q, k, v)
        .unwrap_err()
        .to_string()
}

#[test]
fn a_tensor_that_disagrees_with_the_spec_is_an_error_naming_it() {
    let (q, k, v) = qkv(8, 8);
    let said = refused(&q.to_dtype(DType::BF16).unwrap(), &k, &v);
    assert!(said.contains("`q` is BF16, expected F32"), "{said}");
    let said = refused(&q, &k, &v.to_dtype(DType::F64).unwrap());
    assert!(said.contains("`v` is F64, expected F32"), "{said}");
    let said = refused(&q.flatten_to(1).unwrap(), &k, &v);
    assert!(
        said.contains("`q` has shape [4, 8, 16], expected rank 4"),
        "{said}"
    );
    let said = refused(&tensor(&[1, 3, 8, 16], 1), &k, &v);
    assert!(
        said.contains(
            "`q` has shape [1, 3, 8, 16], expected [B, heads, Sq, head_dim] = [1, 4, _, 16]"
        ),
        "{said}"
    );
    let said = refused(&q, &tensor(&[1, 2, 8, 8], 2), &v);
    assert!(said.contains("`k` has shape [1, 2, 8, 8]"), "{said}");
    let said = refused(&q, &k, &tensor(&[2, 2, 8, 16], 3));
    assert!(
        said.contains(
            "`v` has shape [2, 2, 8, 16], expected [B, kv_heads, Skv, v_head_dim] = [1, 2, 8, 16]"
        ),
        "{said}"
    );
    let said = refused(&q, &k, &tensor(&[1, 2, 9, 16], 3));
    assert!(said.contains("`v` has shape [1, 2, 9, 16]"), "{said}");
    assert!(
        said.contains(variant().text()),
        "the error names the spec: {said}"
    );
    let ints = Tensor::zeros((1, 2, 8, 16), DType::U32, &Device::Cpu).unwrap();
    let said = refused(&q, &ints, &v);
    assert!(said.contains("`k` is U32"), "{said}");
    // The op still works.
    assert!(attn::candle::attention(&variant(), &q, &k, &v).is_ok());
}

#[test]
fn positions_beyond_the_supported_range_are_an_error() {
    let (q, k, v) = qkv(8, 8);
    for offset in [i64::MAX, i64::MIN, 1 << 40] {
        let err = attn::candle::attention_at(&variant(), &q, &k, &v, offset);
        assert!(err.is_err(), "offset {offset}");
    }
    assert!(attn::candle::attention_at(&variant(), &q, &k, &v, 1 << 20).is_ok());
}

#[test]
fn nan_inputs_propagate_to_the_rows_that_read_them() {
    let (q, k, v) = qkv(6, 6);
    let mut kv = k.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    kv[3 * 16] = f32::NAN; // kv head 0, key 3
    let k = Tensor::from_vec(kv, k.dims(), &Device::Cpu).unwrap();
    let out = attn::candle::attention(&variant(), &q, &k, &v).unwrap();
    let rows = out.squeeze(0).unwrap().to_vec3::<f32>().unwrap();
    for (h, head) in rows.iter().enumerate() {
        for (i, row) in head.iter().enumerate() {
            // Query i sees keys 0..=i; heads 0 and 1 read kv head 0.
            let reads_nan = h < 2 && i >= 3;
            assert_eq!(
                row.iter().any(|x| x.is_nan()),
                reads_nan,
                "head {h} row {i}"
            );
        }
    }
}

#[test]
fn empty_sequences_give_empty_or_zero_outputs_and_gradients() {
    // No queries: an empty output.
    let (q, k, v) = qkv(0, 5);
    let out = attn::candle::attention(&variant(), &q, &k, &v).unwrap();
    assert_eq!(out.dims(), &[1, 4, 0, 16]);
    // No keys: every row sees nothing, so it is 0 and its lse is -inf.
    let q = var(&[1, 4, 3, 16], 1);
    let (_, k, v) = qkv(0, 0);
    let (out, lse) = attn::candle::attention_with_lse(&variant(), &q, &k, &v, 0).unwrap();
    assert_eq!(out.dims(), &[1, 4, 3, 16]);
    assert!(
        out.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|&x| x == 0.0)
    );
    assert!(
        lse.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|&x| x == f32::NEG_INFINITY)
    );
    let grads = out.sum_all().unwrap().backward().unwrap();
    let dq = grads
        .get(&q)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(dq.iter().all(|&x| x == 0.0));
}

/// Every combination of small, empty and mismatched dims, dtypes and offsets: a result or an
/// error, never a panic.
#[test]
fn no_combination_of_shapes_dtypes_and_offsets_panics() {
    let dims = [0usize, 1, 2, 4, 16, 17];
    let dtypes = [DType::F32, DType::F16, DType::BF16, DType::F64, DType::U8];
    let variant = variant();
    let mut cases = 0;
    for (n, seed) in (0..400u64).map(|n| (n, n.wrapping_mul(0x9E37_79B9_7F4A_7C15))) {
        let pick = |shift: u32, len: usize| (seed.rotate_right(shift) as usize) % len;
        let shape = |s: u32| {
            [
                [1, dims[pick(s, 3)]][pick(s + 2, 2)],
                dims[pick(s + 4, dims.len())],
                dims[pick(s + 8, dims.len())],
                [16, dims[pick(s + 12, dims.len())]][pick(s + 16, 2)],
            ]
        };
        let dtype = dtypes[pick(20, dtypes.len())];
        let make = |s: u32| Tensor::zeros(&shape(s)[..], dtype, &Device::Cpu).unwrap();
        let q = attn::candle::core::Var::from_tensor(&make(24)).unwrap();
        let (k, v) = (make(36), make(48));
        let offset = [0, -7, 5, i64::MAX, i64::MIN][pick(60, 5)];
        let result = attn::candle::attention_with_lse(&variant, &q, &k, &v, offset);
        if let Ok((out, _)) = result {
            let grads = out
                .to_dtype(DType::F32)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward();
            assert!(grads.is_ok(), "case {n}");
        }
        cases += 1;
    }
    assert_eq!(cases, 400);
    let (q, k, v) = qkv(8, 8);
    assert!(attn::candle::attention(&variant, &q, &k, &v).is_ok());
}

#[test]
fn learnable_tensors_are_checked_by_name_shape_and_dtype() {
    let variant = attn::Variant::parse(
        "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, sinks = learned, \
         params(slopes: [heads]), score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32",
    )
    .unwrap();
    let (q, k, v) = qkv(8, 8);
    let slopes = tensor(&[4], 7);
    let sinks = tensor(&[4], 8);
    let refused = |learned: &[(&str, &Tensor)]| {
        attn::candle::attention_learned(&variant, &q, &k, &v, learned, 0)
            .unwrap_err()
            .to_string()
    };
    let said = refused(&[("slopes", &slopes)]);
    assert!(
        said.contains("`sinks` of shape [4], which is missing"),
        "{said}"
    );
    let said = refused(&[("slopes", &tensor(&[2, 2], 7)), ("sinks", &sinks)]);
    assert!(
        said.contains("`slopes` has shape [2, 2]; the spec gives it shape [4]"),
        "{said}"
    );
    let said = refused(&[
        ("slopes", &slopes),
        ("sinks", &sinks.to_dtype(DType::BF16).unwrap()),
    ]);
    assert!(
        said.contains("`sinks` is BF16") && said.contains("expected f32"),
        "{said}"
    );
    let said = refused(&[("slopes", &slopes), ("sinks", &sinks), ("bias", &sinks)]);
    assert!(
        said.contains("`bias` [4] is not a learnable or data tensor")
            && said.contains("slopes [4], sinks [4]"),
        "{said}"
    );
    // The op without learnable tensors names what the spec needs.
    let said = attn::candle::attention(&variant, &q, &k, &v)
        .unwrap_err()
        .to_string();
    assert!(
        said.contains("`slopes` of shape [4], which is missing"),
        "{said}"
    );
    let ok = attn::candle::attention_learned(
        &variant,
        &q,
        &k,
        &v,
        &[("sinks", &sinks), ("slopes", &slopes)],
        0,
    );
    assert!(ok.is_ok());
}
