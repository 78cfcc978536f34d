//! How context parallelism splits a sequence over ranks, and moving rows of `[B, H, S, ..]`
//! arrays along the sequence axis.

use std::ops::Range;

use crate::error::RuntimeError;
use crate::tensor::Tensor;

/// The positions each rank holds (relative to the call's position offset). Contiguous: rank
/// `r` holds `r * S/N .. (r + 1) * S/N`. Zigzag (ring attention under causal masks, so that
/// every rank has as many kept pairs): the sequence in `2N` chunks, rank `r` holding chunks `r`
/// and `2N - 1 - r`, in that order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSplit {
    /// Ranks.
    pub ranks: usize,
    /// The whole sequence's length.
    pub seq: usize,
    /// Whether the split is zigzag.
    pub zigzag: bool,
}

impl SeqSplit {
    /// A split of `seq` positions over `ranks`; the length must divide into `ranks` (zigzag:
    /// `2 * ranks`) equal chunks.
    pub fn new(ranks: usize, seq: usize, zigzag: bool) -> Result<SeqSplit, RuntimeError> {
        let chunks = if zigzag { 2 * ranks } else { ranks };
        if ranks == 0 || !seq.is_multiple_of(chunks) {
            return Err(RuntimeError::Data(format!(
                "a sequence of {seq} positions splits over {ranks} ranks in {chunks} equal \
                 chunks{}; allowed: a length divisible by {chunks}",
                if zigzag { " (zigzag)" } else { "" }
            )));
        }
        Ok(SeqSplit { ranks, seq, zigzag })
    }

    /// The positions rank `rank` holds, in the order its tensors hold them.
    pub fn chunks(&self, rank: usize) -> Vec<Range<usize>> {
        if self.zigzag {
            let c = self.seq / (2 * self.ranks);
            let far = 2 * self.ranks - 1 - rank;
            vec![rank * c..(rank + 1) * c, far * c..(far + 1) * c]
        } else {
            let c = self.seq / self.ranks;
            std::iter::once(rank * c..(rank + 1) * c).collect()
        }
    }

    /// Positions per rank.
    pub fn local_len(&self) -> usize {
        self.seq / self.ranks
    }

    /// Rank `rank`'s part of a whole tensor `[B, H, S, ..]` (sequence on axis 2).
    pub fn take(&self, whole: &Tensor, rank: usize) -> Result<Tensor, RuntimeError> {
        let dims = seq_dims(whole, self.seq)?;
        let values = whole.to_f32_vec();
        let local: Vec<Range<usize>> = self.chunks(rank);
        let taken = gather_rows(&values, dims, &local);
        let mut shape = whole.shape().to_vec();
        shape[2] = self.local_len();
        Tensor::from_f32_as(whole.dtype(), &shape, taken)
    }

    /// The whole tensor from every rank's part, in rank order (the inverse of
    /// [`SeqSplit::take`]).
    pub fn put(&self, parts: &[Tensor]) -> Result<Tensor, RuntimeError> {
        let first = parts
            .first()
            .filter(|_| parts.len() == self.ranks)
            .ok_or_else(|| {
                RuntimeError::Data(format!(
                    "{} parts for a split over {} ranks",
                    parts.len(),
                    self.ranks
                ))
            })?;
        let mut shape = first.shape().to_vec();
        let dims = seq_dims(first, self.local_len())?;
        shape[2] = self.seq;
        let mut whole = vec![0f32; dims.outer * self.seq * dims.width];
        for (rank, part) in parts.iter().enumerate() {
            if part.shape() != first.shape() {
                return Err(RuntimeError::Shape {
                    tensor: format!("part {rank}"),
                    found: part.shape().to_vec(),
                    expected: format!("{:?} (as part 0)", first.shape()),
                });
            }
            let values = part.to_f32_vec();
            let mut local = 0;
            for chunk in self.chunks(rank) {
                let n = chunk.len();
                copy_rows(
                    &values,
                    dims,
                    local..local + n,
                    &mut whole,
                    self.seq,
                    chunk.start,
                );
                local += n;
            }
        }
        Tensor::from_f32_as(first.dtype(), &shape, whole)
    }
}

/// A `[B, H, S, ..]` array as `outer = B * H` runs of `seq` rows of `width` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SeqDims {
    outer: usize,
    seq: usize,
    width: usize,
}

/// The [`SeqDims`] of `t`, whose axis 2 must hold `seq` positions.
fn seq_dims(t: &Tensor, seq: usize) -> Result<SeqDims, RuntimeError> {
    let shape = t.shape();
    if shape.len() < 3 || shape[2] != seq {
        return Err(RuntimeError::Shape {
            tensor: "a sequence tensor".into(),
            found: shape.to_vec(),
            expected: format!("[B, H, {seq}, ..]"),
        });
    }
    Ok(SeqDims {
        outer: shape[0] * shape[1],
        seq,
        width: shape[3..].iter().product(),
    })
}

/// The rows `ranges` (in order) of every run of `values`.
fn gather_rows(values: &[f32], d: SeqDims, ranges: &[Range<usize>]) -> Vec<f32> {
    let rows: usize = ranges.iter().map(|r| r.len()).sum();
    if d.seq * d.width == 0 {
        // No rows, or rows of no values: nothing to gather.
        return Vec::new();
    }
    let mut out = Vec::with_capacity(d.outer * rows * d.width);
    for run in values.chunks(d.seq * d.width).take(d.outer) {
        for r in ranges {
            out.extend_from_slice(&run[r.start * d.width..r.end * d.width]);
        }
    }
    out
}

/// Copies rows `rows` of every run of `src` (runs of `d.seq` rows) to rows from `at` of the
/// runs of `dst` (runs of `dst_seq` rows).
fn copy_rows(
    src: &[f32],
    d: SeqDims,
    rows: Range<usize>,
    dst: &mut [f32],
    dst_seq: usize,
    at: usize,
) {
    let w = d.width;
    for o in 0..d.outer {
        let from = &src[(o * d.seq + rows.start) * w..(o * d.seq + rows.end) * w];
        let to = (o * dst_seq + at) * w;
        dst[to..to + from.len()].copy_from_slice(from);
    }
}
