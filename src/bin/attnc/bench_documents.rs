//! `attnc bench --documents N`: the spec's mask restricted to N equal documents over the keys
//! (a data tensor `doc` of document ids, `mask_mod` ANDed with `doc[b, q] == doc[b, k]`), the
//! ids each call takes, and the pairs such a mask keeps.

use attn::AttentionSpec;
use attn::dsl::modifier::{BinOp, Expr, MaskMod, ParamRead, Ty, Var};
use attn::dsl::{CausalAlign, DataDecl, DataDim, DataType, Mask};
use attn::runtime::learned::{DataBuf, DataVec};

/// The name of the document-id tensor.
pub const DOC: &str = "doc";

/// `spec` with the data tensor `doc: [batch, seq] i32` and its mask ANDed with
/// `doc[b, q] == doc[b, k]`; an error for a spec that already declares data tensors, or MLA.
pub fn masked_by_documents(spec: &AttentionSpec) -> Result<AttentionSpec, String> {
    if !spec.data.is_empty() {
        return Err(
            "error: --documents adds its own data tensor; this spec declares data(...) already"
                .to_string(),
        );
    }
    if spec.param(DOC).is_some() {
        return Err(format!(
            "error: --documents adds a data tensor `{DOC}`; this spec has a parameter of that name"
        ));
    }
    let read = |at: Var| {
        Expr::Param(ParamRead {
            name: DOC.to_string(),
            indices: vec![Expr::Var(Var::Batch), Expr::Var(at)],
            ty: Ty::I64,
        })
    };
    let same_document = Expr::binary(BinOp::Eq, read(Var::Query), read(Var::Key));
    let mut out = spec.clone();
    out.data.push(DataDecl {
        name: DOC.to_string(),
        dims: vec![DataDim::Batch, DataDim::Seq],
        dtype: DataType::I32,
    });
    out.mask_mod = Some(match &spec.mask_mod {
        Some(m) => MaskMod {
            params: m.params.clone(),
            body: Expr::binary(BinOp::And, m.body.clone(), same_document),
        },
        None => MaskMod {
            params: ["b", "h", "q", "k"].map(String::from),
            body: same_document,
        },
    });
    out.validate()
        .map_err(|f| format!("error: the spec with --documents is invalid: {f:?}"))?;
    Ok(out)
}

/// The ids of `documents` equal documents over `kv_len` keys (key `j` in document
/// `j * documents / kv_len`), the same in each of `batch` items.
pub fn document_ids(batch: usize, kv_len: usize, documents: usize) -> DataBuf {
    let row = (0..kv_len).map(|j| (j * documents / kv_len) as i32);
    DataBuf {
        shape: vec![batch, kv_len],
        values: DataVec::I32(row.cycle().take(batch * kv_len).collect()),
    }
}

/// The (query, key) pairs per (batch item, head) that `spec` (before [`masked_by_documents`];
/// without a mask modifier of its own) keeps once restricted to the documents of
/// [`document_ids`], for a mask of none or causal over as many queries as keys; `None`
/// otherwise.
pub fn kept_pairs(
    spec: &AttentionSpec,
    seq: usize,
    kv_len: usize,
    documents: usize,
) -> Option<f64> {
    if seq != kv_len || spec.mask_mod.is_some() {
        return None;
    }
    let lengths = (0..documents).map(|d| {
        let start = (d * kv_len).div_ceil(documents);
        let end = ((d + 1) * kv_len).div_ceil(documents);
        (end - start) as f64
    });
    match spec.mask {
        Mask::None => Some(lengths.map(|l| l * l).sum()),
        Mask::Causal(CausalAlign::BottomRight) => Some(lengths.map(|l| l * (l + 1.0) / 2.0).sum()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_split_the_keys_evenly_and_count_their_pairs() {
        let DataBuf { shape, values } = document_ids(2, 10, 3);
        assert_eq!(shape, vec![2, 10]);
        let DataVec::I32(ids) = values else { panic!() };
        assert_eq!(&ids[..10], &[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]);
        assert_eq!(&ids[10..], &ids[..10]);
        let causal: AttentionSpec = "heads = 1, head_dim = 8, mask = causal".parse().unwrap();
        // Documents of 4, 3, 3 keys.
        assert_eq!(kept_pairs(&causal, 10, 10, 3), Some(10.0 + 6.0 + 6.0));
        let spec = masked_by_documents(&causal).unwrap();
        assert!(
            spec.to_string()
                .contains("mask_mod = |b, h, q, k| doc[b, q] == doc[b, k]"),
            "{spec}"
        );
    }
}
