//! `data(...)`: what parses and prints back, the types reads take, where each error points, the
//! checks a call's shapes make of the reads along `batch` and `seq`, and the reference reading
//! `seq` entries relative to the call's position offset.

use crate::support::rejects;
use attn_dsl::data::{CallDims, check_reads, reads_at_offset};
use attn_dsl::modifier::typecheck::typecheck;
use attn_dsl::modifier::{ParamValues, Ty};
use attn_dsl::reference::{self, Array, Inputs};
use attn_dsl::{DataDim, DataType, parse_str};

const DOCS: &str = "heads = 2, head_dim = 8, mask = causal, data(doc: [batch, seq] i32, \
                    gate: [batch, heads, seq] f32), \
                    mask_mod = |b, h, q, k| doc[b, q] == doc[b, k], \
                    score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k]";

fn call(batch: usize, sq: usize, skv: usize, position_offset: i64) -> CallDims {
    CallDims::new(batch, sq, skv, position_offset)
}

#[test]
fn declarations_parse_print_back_and_type_their_reads() {
    let spec = parse_str(DOCS).unwrap();
    assert_eq!(spec.data.len(), 2);
    assert_eq!(spec.data[0].dims, vec![DataDim::Batch, DataDim::Seq]);
    assert_eq!(spec.data[0].dtype, DataType::I32);
    assert_eq!(
        spec.data_shape(&spec.data[1], 3, 100),
        vec![3, 2, 100],
        "batch and seq come from the call"
    );
    let printed = spec.to_string();
    assert!(
        printed.contains("data(doc: [batch, seq] i32, gate: [batch, heads, seq] f32)"),
        "{printed}"
    );
    assert_eq!(parse_str(&printed).unwrap(), spec, "{printed}");
    // An i32 read is an i64 value, an f32 read an f32 one.
    let mask = &spec.mask_mod.as_ref().unwrap().body;
    let reads = mask.param_reads();
    assert_eq!(reads[0].ty, Ty::I64);
    assert_eq!(
        typecheck(&attn_dsl::modifier::Expr::Param(reads[0].clone())),
        Ok(Ty::I64)
    );
    let score = &spec.score_mod.as_ref().unwrap().body;
    assert_eq!(score.param_reads()[0].ty, Ty::F32);
}

#[test]
fn each_bad_declaration_or_read_is_a_spanned_error() {
    let base = "heads = 4, head_dim = 16, ";
    rejects(
        &format!("{base}data(doc: [batch, seq] i64), mask_mod = |b, h, q, k| doc[b, k] == 0"),
        "`i64` is not a data type; allowed: i32 or f32",
        "seq] ",
        "i64",
    );
    rejects(
        &format!("{base}data(doc: [batch, tokens] i32)"),
        "not a dimension; allowed: an integer, `heads`, `kv_heads`, `batch` or `seq`",
        "batch, ",
        "tokens",
    );
    rejects(
        &format!("{base}params(rel: [seq]), score_mod = |s, b, h, q, k| s"),
        "not a dimension; allowed: an integer, `heads` or `kv_heads`",
        "[",
        "seq",
    );
    rejects(
        &format!("{base}data(doc: [batch, seq])"),
        "expected the element type of `doc` after its shape",
        "data(",
        "doc",
    );
    rejects(
        &format!("{base}data(lse: [seq] i32)"),
        "`lse` is reserved",
        "data(",
        "lse",
    );
    rejects(
        &format!("{base}params(w: [heads]), data(w: [seq] f32), score_mod = |s, b, h, q, k| s"),
        "`w` is declared both in params(...) and in data(...)",
        "data(",
        "w",
    );
    // Integer dimensions are proved at spec time, as for parameters.
    rejects(
        &format!("{base}data(t: [heads, 4] f32), score_mod = |s, b, h, q, k| s + t[h, q]"),
        "index 1 of `t` (`q`) may be anywhere",
        "s + ",
        "t[h, q]",
    );
    // A mask may read data but not a parameter.
    rejects(
        &format!("{base}params(w: [heads]), mask_mod = |b, h, q, k| w[h] > 0.0"),
        "mask_mod reads a parameter",
        "mask_mod = ",
        "|b",
    );
    assert!(
        parse_str(&format!(
            "{base}data(g: [heads] f32), mask_mod = |b, h, q, k| g[h] > 0.0"
        ))
        .is_ok()
    );
}

#[test]
fn reads_along_batch_and_seq_are_checked_against_the_call() {
    let spec = parse_str(DOCS).unwrap();
    assert_eq!(check_reads(&spec, &call(2, 16, 16, 0)), Ok(()));
    // From position 100: q and k are 100.., entries 0..
    assert_eq!(check_reads(&spec, &call(2, 4, 16, 100)), Ok(()));
    let past = DOCS.replace("doc[b, k]", "doc[b, k + 2]");
    let spec = parse_str(&past).unwrap();
    let e = check_reads(&spec, &call(1, 8, 8, 0)).unwrap_err();
    assert!(
        e.contains("mask_mod reads `doc` at index 1 `k + 2`") && e.contains("[2, 9]"),
        "{e}"
    );
    let by_batch = DOCS.replace("doc[b, q]", "doc[b + 1, q]");
    let spec = parse_str(&by_batch).unwrap();
    let e = check_reads(&spec, &call(3, 8, 8, 0)).unwrap_err();
    assert!(e.contains("index 0 `b + 1`") && e.contains("0 to 2"), "{e}");
    // No point, nothing read.
    assert_eq!(check_reads(&spec, &call(0, 8, 8, 0)), Ok(()));
}

#[test]
fn the_reference_reads_seq_entries_from_the_position_offset() {
    // One head; key j's score is `bias[j]`; at offset 40 key j is at position 40 + j and must
    // still read entry j.
    let spec = parse_str(
        "heads = 1, head_dim = 1, data(bias: [seq] f32), \
         score_mod = |s, b, h, q, k| s + bias[k]",
    )
    .unwrap();
    let moved = reads_at_offset(&spec, 40);
    assert!(moved.to_string().contains("bias[k - 40]"), "{moved}");
    let zeros = |shape: &[usize]| Array::from_vec(shape, vec![0.0; shape.iter().product()]);
    let (q, k) = (zeros(&[1, 1, 1, 1]).unwrap(), zeros(&[1, 1, 3, 1]).unwrap());
    let v = Array::from_vec(&[1, 1, 3, 1], vec![1.0, 2.0, 3.0]).unwrap();
    let bias = ParamValues {
        name: "bias".into(),
        shape: vec![3],
        values: vec![0.0, 0.0, 3.0f64.ln() + 10.0],
    };
    for offset in [0, 40] {
        let out = reference::attention_learned(
            &spec,
            &Inputs {
                q: &q,
                k: &k,
                v: &v,
                position_offset: offset,
            },
            std::slice::from_ref(&bias),
        )
        .unwrap();
        // Softmax weights (1, 1, 3 e^10) over values 1, 2, 3.
        let e = 3.0 * 10f64.exp();
        let want = (1.0 + 2.0 + 3.0 * e) / (2.0 + e);
        assert!((out.out.data()[0] - want).abs() < 1e-12, "offset {offset}");
    }
}
