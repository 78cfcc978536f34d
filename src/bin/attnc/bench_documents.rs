//! `attnc bench --documents N`: the spec's mask restricted to N equal documents over the keys
//! (a data tensor `doc` of document ids, `mask_mod` ANDed with `doc[b, q] == doc[b, k]`), the
//! ids each call takes, and the pairs such a mask keeps.

use attn::AttentionSpec;
pub use attn::dsl::data::DOCUMENT_IDS as DOC;
use attn::dsl::data::with_document_mask;
use attn::dsl::{CausalAlign, Mask};
use attn::runtime::learned::{DataBuf, DataVec};

/// `spec` with the data tensor `doc` and its mask ANDed with `doc[b, q] == doc[b, k]`
/// ([`with_document_mask`]); an error for a spec that declares data tensors already.
pub fn masked_by_documents(spec: &AttentionSpec) -> Result<AttentionSpec, String> {
    if !spec.data.is_empty() {
        return Err(
            "error: --documents adds its own data tensor; this spec declares data(...) already"
                .to_string(),
        );
    }
    with_document_mask(spec).map_err(|e| format!("error: --documents: {e}"))
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
