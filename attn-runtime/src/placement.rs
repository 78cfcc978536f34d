//! Where a call's tensors lie in a larger call. Context parallelism splits one attention call
//! into pieces, over heads (each rank's call holds a run of the spec's heads) or over the
//! sequence (a rank's queries meet another rank's keys, so its queries need not end at its last
//! key). A piece must see what the whole call sees: global head indices (ALiBi slopes, `h` in a
//! modifier, per-head parameters) and global positions (RoPE, masks, distances).

use attn_dsl::AttentionSpec;
use attn_dsl::reference::MAX_POSITION;

use crate::error::RuntimeError;

/// A call's place in a larger one: which of the spec's query heads its tensors hold, and where
/// its queries lie against its keys. [`Placement::default`] is a whole call: every head, and
/// queries aligned bottom-right (the last query at the last key, docs/semantics.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// The spec's index of the call's first query head.
    pub head0: usize,
    /// How many query heads the call's tensors hold (`None`: the spec's heads from `head0`
    /// on). Key and value heads follow in proportion (`kv_heads * heads / spec heads`).
    pub heads: Option<usize>,
    /// How far the queries' positions lie past bottom-right alignment: query `i` of a call of
    /// `Sq` queries against `Skv` keys at offset `p0` is at `p0 + Skv - Sq + query_shift + i`.
    pub query_shift: i64,
    /// Where the data tensors' `seq` dimension lies, its first position and its length, when
    /// the call is given the whole sequence's data (`None`: over the call's own keys).
    pub data_seq: Option<(i64, usize)>,
}

impl Placement {
    /// Heads `head0 .. head0 + heads` of the spec, queries aligned bottom-right.
    pub fn heads(head0: usize, heads: usize) -> Placement {
        Placement {
            head0,
            heads: Some(heads),
            ..Placement::default()
        }
    }

    /// Every head, queries at `p0 + Skv - Sq + query_shift + i`.
    pub fn shifted(query_shift: i64) -> Placement {
        Placement {
            query_shift,
            ..Placement::default()
        }
    }

    /// Whether this is a whole call.
    pub fn is_whole(&self) -> bool {
        *self == Placement::default()
    }

    /// The placement checked against `spec`: a run of whole GQA groups within the spec's heads.
    pub(crate) fn piece(&self, spec: &AttentionSpec) -> Result<Piece, RuntimeError> {
        let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
        let group = h / hkv.max(1);
        let hq = self.heads.unwrap_or(h.saturating_sub(self.head0));
        let fits = self.head0.checked_add(hq).is_some_and(|end| end <= h);
        if !fits || hq == 0 || !self.head0.is_multiple_of(group) || !hq.is_multiple_of(group) {
            return Err(RuntimeError::Spec(format!(
                "a call placed at heads {}..{} of a spec with {h} query heads in groups of \
                 {group}: allowed, a non-empty run of whole groups within the spec's heads",
                self.head0,
                self.head0.saturating_add(hq)
            )));
        }
        if self.query_shift.unsigned_abs() > 2 * MAX_POSITION as u64 {
            return Err(RuntimeError::Data(format!(
                "query shift {} puts positions outside ±{MAX_POSITION}",
                self.query_shift
            )));
        }
        Ok(Piece {
            hq,
            hkv: hq / group,
            head0: self.head0,
            query_shift: self.query_shift,
        })
    }
}

/// A [`Placement`] checked against its spec, as the CPU kernels' launches take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Query heads in the call's tensors.
    pub hq: usize,
    /// Key and value heads in the call's tensors.
    pub hkv: usize,
    /// The spec's index of the first query head.
    pub head0: usize,
    /// See [`Placement::query_shift`].
    pub query_shift: i64,
}

impl Piece {
    /// A whole call of `spec`.
    pub fn whole(spec: &AttentionSpec) -> Piece {
        Piece::all(spec.heads as usize, spec.kv_heads() as usize)
    }

    /// A whole call of a kernel over `hq` query and `hkv` key heads (MLA's absorbed kernel
    /// runs over other heads than its spec's).
    pub fn all(hq: usize, hkv: usize) -> Piece {
        Piece {
            hq,
            hkv,
            head0: 0,
            query_shift: 0,
        }
    }

    /// The position of query 0 of a call of `sq` queries against `skv` keys at `p0`.
    pub fn first_query(&self, p0: i64, sq: usize, skv: usize) -> i64 {
        p0 + skv as i64 - sq as i64 + self.query_shift
    }

    /// The positions the call's queries and keys take, `first..end` (keys `p0..p0 + skv`),
    /// checked against [`MAX_POSITION`].
    pub fn positions(&self, p0: i64, sq: usize, skv: usize) -> Result<(i64, i64), RuntimeError> {
        attn_dsl::reference::check_positions(sq, skv, p0)
            .map_err(|e| RuntimeError::Data(e.to_string()))?;
        let q0 = self.first_query(p0, sq, skv);
        let first = q0.min(p0);
        let end = (q0 + sq as i64).max(p0 + skv as i64);
        if first < -MAX_POSITION || end - 1 > MAX_POSITION {
            return Err(RuntimeError::Data(format!(
                "query shift {} puts the queries at positions {q0} to {}; allowed: positions \
                 from -{MAX_POSITION} to {MAX_POSITION}",
                self.query_shift,
                q0 + sq as i64 - 1
            )));
        }
        Ok((first, end))
    }
}
