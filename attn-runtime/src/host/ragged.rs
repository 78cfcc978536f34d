//! Where the query rows of a cached call are, and where its output rows go: uniform batches and
//! ragged ones (each sequence with its own number of new queries).

use super::checks::{finish, head_dims, per_head, shape};
use crate::calls::Output;
use crate::error::RuntimeError;
use crate::tensor::Tensor;
use attn_dsl::AttentionSpec;

/// Queries and outputs of a call, addressed by (sequence, query, head).
pub(crate) struct Layout<'a> {
    /// Queries per sequence.
    pub q_lens: &'a [usize],
    /// Element offset of query `i` of sequence `b`, head `h` (`qk_dim` f32 values).
    pub q_at: &'a (dyn Fn(usize, usize, usize) -> usize + Sync),
    /// Row of the output for (sequence, query, head).
    pub out_row: &'a (dyn Fn(usize, usize, usize) -> usize + Sync),
    pub out_rows: usize,
}

/// A uniform batch's queries, checked: `q [B, heads, q_len, head_dim]`, the last `q_len` tokens
/// of each of the call's `B` sequences (see `CpuBackend::decode`).
pub(crate) struct Uniform {
    q_lens: Vec<usize>,
    h: usize,
    d: usize,
}

impl Uniform {
    /// Checks `q` against the spec and `seqs` sequences.
    pub fn of(spec: &AttentionSpec, q: &Tensor, seqs: usize) -> Result<Self, RuntimeError> {
        per_head(spec, q)?;
        let (h, d, _) = head_dims(spec);
        match q.shape() {
            [b, hh, n, dd] if *hh == h && *dd == d && *b == seqs => Ok(Uniform {
                q_lens: vec![*n; *b],
                h,
                d,
            }),
            _ => Err(shape(
                "q",
                q,
                &format!("[{seqs}, {h}, q_len, {d}] (one row per sequence)"),
            )),
        }
    }

    /// Calls `f` with where the batch's query rows are and where its output rows go.
    pub fn with_layout<R>(&self, f: impl FnOnce(&Layout) -> R) -> R {
        let (h, d) = (self.h, self.d);
        let (b, n) = (self.q_lens.len(), self.q_lens.first().copied().unwrap_or(0));
        f(&Layout {
            q_lens: &self.q_lens,
            q_at: &|s, i, head| ((s * h + head) * n + i) * d,
            out_row: &|s, i, head| (s * h + head) * n + i,
            out_rows: b * h * n,
        })
    }

    /// `out [B, heads, q_len, v_head_dim]` (the spec's dtype) and `lse [B, heads, q_len]`.
    pub fn finish(
        &self,
        spec: &AttentionSpec,
        out: Vec<f32>,
        lse: Vec<f32>,
    ) -> Result<Output, RuntimeError> {
        let (_, _, dv) = head_dims(spec);
        let (b, n) = (self.q_lens.len(), self.q_lens.first().copied().unwrap_or(0));
        finish(spec.dtype, [b, self.h, n, dv], out, lse)
    }
}

/// A ragged batch's queries, checked: `q [tokens, heads, head_dim]` with cumulative
/// `q_offsets` per sequence (see `CpuBackend::attend_ragged`).
pub(crate) struct Ragged<'a> {
    q_offsets: &'a [usize],
    q_lens: Vec<usize>,
    tokens: usize,
    h: usize,
    d: usize,
}

impl<'a> Ragged<'a> {
    /// Checks `q` and `q_offsets` against the spec and `seqs` sequences.
    pub fn of(
        spec: &AttentionSpec,
        q: &Tensor,
        q_offsets: &'a [usize],
        seqs: usize,
    ) -> Result<Self, RuntimeError> {
        per_head(spec, q)?;
        let (h, d, _) = head_dims(spec);
        let tokens = match q.shape() {
            [t, hh, dd] if *hh == h && *dd == d => *t,
            _ => return Err(shape("q", q, &format!("[tokens, {h}, {d}]"))),
        };
        let valid = q_offsets.len() == seqs + 1
            && q_offsets.first() == Some(&0)
            && q_offsets.last() == Some(&tokens)
            && q_offsets.windows(2).all(|w| w[0] <= w[1]);
        if !valid {
            return Err(RuntimeError::Data(format!(
                "q_offsets must be {} non-decreasing offsets from 0 to {tokens} (one more than \
                 the sequences), got {q_offsets:?}",
                seqs + 1
            )));
        }
        Ok(Ragged {
            q_offsets,
            q_lens: q_offsets.windows(2).map(|w| w[1] - w[0]).collect(),
            tokens,
            h,
            d,
        })
    }

    /// Calls `f` with where the batch's query rows are and where its output rows go.
    pub fn with_layout<R>(&self, f: impl FnOnce(&Layout) -> R) -> R {
        let (h, d, q_offsets) = (self.h, self.d, self.q_offsets);
        let q_at = move |s: usize, i: usize, head: usize| ((q_offsets[s] + i) * h + head) * d;
        let out_row = move |s: usize, i: usize, head: usize| (q_offsets[s] + i) * h + head;
        f(&Layout {
            q_lens: &self.q_lens,
            q_at: &q_at,
            out_row: &out_row,
            out_rows: self.tokens * h,
        })
    }

    /// `out [tokens, heads, v_head_dim]` (the spec's dtype) and `lse [tokens, heads]`.
    pub fn finish(
        &self,
        spec: &AttentionSpec,
        out: Vec<f32>,
        lse: Vec<f32>,
    ) -> Result<Output, RuntimeError> {
        let (_, _, dv) = head_dims(spec);
        let (mut out, mut lse) = (out, lse);
        super::checks::overflowed_rows_are_nan(&mut out, &mut lse, dv);
        let out = Tensor::from_f32_as(spec.dtype, &[self.tokens, self.h, dv], out)?;
        let lse = Tensor::from_f32(&[self.tokens, self.h], lse)?;
        Ok(Output {
            out,
            lse,
            latent: None,
        })
    }
}
