//! Variable-length batches in FlashAttention's layout: the tokens of every sequence packed one
//! after another, `q [total_q, heads, head_dim]`, `k [total_k, kv_heads, head_dim]`,
//! `v [total_k, kv_heads, v_head_dim]`, and the cumulative offsets `cu_seqlens_q` and
//! `cu_seqlens_k` (`B + 1` each, from 0 to the totals): sequence `i` is rows
//! `cu_seqlens_q[i]..cu_seqlens_q[i + 1]` of q against rows `cu_seqlens_k[i]..cu_seqlens_k[i + 1]`
//! of k and v. Each sequence's positions start at the call's position offset, its queries
//! aligned bottom-right within it, as a forward over that sequence alone places them.
//!
//! Each sequence runs as a call of its own (`Backend::forward_varlen` and
//! `Backend::backward_varlen` make them `Backend::forward_learned` and
//! `Backend::backward_learned` calls), with every variant those run; outputs and gradients come
//! back in the packed layout. A sequence of length 0 (equal offsets) has no rows and no keys.

use crate::calls::{BackwardInputs, Gradients, HeadGradients, HeadsBackward, Inputs, Output};
use crate::error::RuntimeError;
use crate::learned::{DataValues, Learned, data_views};
use crate::tensor::Tensor;
use crate::variant::Variant;
use crate::varlen_data;
use attn_dsl::DType;
use std::ops::Range;

/// A variable-length batch (see the module's documentation).
#[derive(Clone, Copy, Debug)]
pub struct Varlen<'a> {
    /// `[total_q, heads, head_dim]`, before RoPE.
    pub q: &'a Tensor,
    /// `[total_k, kv_heads, head_dim]`, before RoPE.
    pub k: &'a Tensor,
    /// `[total_k, kv_heads, v_head_dim]`.
    pub v: &'a Tensor,
    /// `B + 1` offsets into q's rows, from 0 to `total_q`, never decreasing.
    pub cu_seqlens_q: &'a [i32],
    /// `B + 1` offsets into k's and v's rows, from 0 to `total_k`, never decreasing.
    pub cu_seqlens_k: &'a [i32],
}

/// What the backward of a variable-length batch takes besides the batch.
#[derive(Clone, Copy, Debug)]
pub struct VarlenSaved<'a> {
    /// The forward's output, `[total_q, heads, v_head_dim]`.
    pub out: &'a Tensor,
    /// The forward's log-sum-exp, `[total_q, heads]`.
    pub lse: &'a Tensor,
    /// `dL/dout`, `[total_q, heads, v_head_dim]`.
    pub dout: &'a Tensor,
}

/// A sequence's query rows and key rows in the packed tensors.
pub type SequenceRows = (Range<usize>, Range<usize>);

/// Rows and widths of a checked batch.
struct Layout {
    /// Each sequence's query rows and key rows.
    sequences: Vec<SequenceRows>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    v_head_dim: usize,
    total_q: usize,
    total_k: usize,
}

/// The forward of a variable-length batch, each sequence's call made by `run` (a backend's
/// forward over one sequence): `out [total_q, heads, v_head_dim]` in the spec's dtype and
/// `lse [total_q, heads]` f32.
pub(crate) fn forward(
    variant: &Variant,
    x: Varlen,
    learned: Learned,
    mut run: impl FnMut(Inputs, Learned) -> Result<Output, RuntimeError>,
) -> Result<Output, RuntimeError> {
    let l = Layout::check(variant, &x)?;
    let spec = variant.spec();
    varlen_data::check(spec, learned.data(), l.sequences.len(), l.total_k)?;
    let [q, k, v] = [x.q, x.k, x.v].map(Tensor::to_f32_vec);
    let mut out = vec![0f32; l.total_q * l.heads * l.v_head_dim];
    let mut lse = vec![f32::NEG_INFINITY; l.total_q * l.heads];
    for (i, (rows_q, rows_k)) in l.sequences.iter().enumerate() {
        if rows_q.is_empty() {
            continue;
        }
        let [seq_q, seq_k, seq_v] = l.sequence_inputs(&x, [&q, &k, &v], rows_q, rows_k)?;
        let inputs = Inputs::heads(&seq_q, &seq_k, &seq_v);
        let data = varlen_data::for_sequence(spec, learned.data(), i, rows_k);
        let views = data_views(&data);
        let o = run(inputs, learned.with_data(&views)).map_err(|e| in_sequence(i, e))?;
        pack(&mut out, &o.out.to_f32_vec(), rows_q, l.heads, l.v_head_dim);
        pack(&mut lse, &o.lse.to_f32_vec(), rows_q, l.heads, 1);
    }
    Ok(Output {
        out: Tensor::from_f32_as(
            variant.spec().dtype,
            &[l.total_q, l.heads, l.v_head_dim],
            out,
        )?,
        lse: Tensor::from_f32(&[l.total_q, l.heads], lse)?,
        latent: None,
    })
}

/// The backward of a variable-length batch, each sequence's call made by `run` (a backend's
/// backward over one sequence, at `position_offset`): dq, dk and dv in the batch's packed
/// layouts (for q and k before RoPE), and each learnable tensor's gradient summed over the
/// sequences in order.
pub(crate) fn backward(
    variant: &Variant,
    x: Varlen,
    saved: VarlenSaved,
    (position_offset, learned): (i64, Learned),
    mut run: impl FnMut(&BackwardInputs, Learned) -> Result<Gradients, RuntimeError>,
) -> Result<HeadGradients, RuntimeError> {
    let l = Layout::check(variant, &x)?;
    let spec = variant.spec();
    varlen_data::check(spec, learned.data(), l.sequences.len(), l.total_k)?;
    // The gradients of f32 data, packed as the data: each sequence's placed where its slice
    // was taken.
    let mut data_grads: Vec<(String, Vec<usize>, Vec<f32>)> = learned
        .data()
        .iter()
        .filter(|(_, d)| matches!(d.values, DataValues::F32(_)))
        .map(|(n, d)| {
            (
                format!("d{n}"),
                d.shape.to_vec(),
                vec![0f32; d.values_len()],
            )
        })
        .collect();
    let rows_of = |name: &str, t: &Tensor, width: &[usize]| {
        let mut shape = vec![l.total_q, l.heads];
        shape.extend_from_slice(width);
        expect_shape(name, t, &shape, "[total_q, heads(, v_head_dim)]")
    };
    rows_of("out", saved.out, &[l.v_head_dim])?;
    rows_of("dout", saved.dout, &[l.v_head_dim])?;
    rows_of("lse", saved.lse, &[])?;
    let [q, k, v] = [x.q, x.k, x.v].map(Tensor::to_f32_vec);
    let [out, dout, lse] = [saved.out, saved.dout, saved.lse].map(Tensor::to_f32_vec);
    let mut dq = vec![0f32; q.len()];
    let (mut dk, mut dv) = (vec![0f32; k.len()], vec![0f32; v.len()]);
    let mut sums: Vec<(String, Tensor, Vec<f32>)> = Vec::new();
    for (i, (rows_q, rows_k)) in l.sequences.iter().enumerate() {
        if rows_q.is_empty() {
            continue;
        }
        let [seq_q, seq_k, seq_v] = l.sequence_inputs(&x, [&q, &k, &v], rows_q, rows_k)?;
        let seq_out = unpack(&out, saved.out.dtype(), rows_q, l.heads, l.v_head_dim)?;
        let seq_dout = unpack(&dout, saved.dout.dtype(), rows_q, l.heads, l.v_head_dim)?;
        let seq_lse = unpack(&lse, DType::F32, rows_q, l.heads, 1)?;
        let seq_lse = Tensor::from_f32(&[1, l.heads, rows_q.len()], seq_lse.to_f32_vec())?;
        let inputs = BackwardInputs::Heads(HeadsBackward {
            q: &seq_q,
            k: &seq_k,
            v: &seq_v,
            out: &seq_out,
            lse: &seq_lse,
            dout: &seq_dout,
            position_offset,
        });
        let data = varlen_data::for_sequence(spec, learned.data(), i, rows_k);
        let views = data_views(&data);
        let g = match run(&inputs, learned.with_data(&views)) {
            Ok(Gradients::Heads(g)) => g,
            Ok(Gradients::Mla(_)) => {
                return Err(RuntimeError::Data(
                    "internal: a per-head backward returned MLA gradients".into(),
                ));
            }
            Err(e) => return Err(in_sequence(i, e)),
        };
        pack(&mut dq, &g.dq.to_f32_vec(), rows_q, l.heads, l.head_dim);
        pack(&mut dk, &g.dk.to_f32_vec(), rows_k, l.kv_heads, l.head_dim);
        pack(
            &mut dv,
            &g.dv.to_f32_vec(),
            rows_k,
            l.kv_heads,
            l.v_head_dim,
        );
        for (name, grad) in g.learned {
            if let Some((_, shape, full)) = data_grads.iter_mut().find(|(n, _, _)| *n == name) {
                let decl = spec
                    .data_decl(&name[1..])
                    .expect("a data tensor's gradient");
                varlen_data::place_gradient(decl, shape, i, rows_k, &grad, full);
                continue;
            }
            match sums.iter_mut().find(|(n, _, _)| *n == name) {
                Some((_, _, sum)) => {
                    for (s, g) in sum.iter_mut().zip(grad.to_f32_vec()) {
                        *s += g;
                    }
                }
                None => {
                    let values = grad.to_f32_vec();
                    sums.push((name, grad, values));
                }
            }
        }
    }
    let mut learned = sums
        .into_iter()
        .map(|(name, like, sum)| Ok((name, Tensor::from_f32(like.shape(), sum)?)))
        .collect::<Result<Vec<_>, RuntimeError>>()?;
    for (name, shape, full) in data_grads {
        learned.push((name, Tensor::from_f32(&shape, full)?));
    }
    let dtype = variant.spec().dtype;
    Ok(HeadGradients {
        dq: Tensor::from_f32_as(dtype, x.q.shape(), dq)?,
        dk: Tensor::from_f32_as(dtype, x.k.shape(), dk)?,
        dv: Tensor::from_f32_as(dtype, x.v.shape(), dv)?,
        learned: with_declared(variant, learned, &l)?,
    })
}

/// The learnable tensors' gradients, each declared one present (zeros where every sequence was
/// empty, so that a caller always finds them).
fn with_declared(
    variant: &Variant,
    mut summed: Vec<(String, Tensor)>,
    l: &Layout,
) -> Result<Vec<(String, Tensor)>, RuntimeError> {
    if l.sequences.iter().any(|(q, _)| !q.is_empty()) {
        return Ok(summed);
    }
    for (name, shape) in variant.spec().learnable_tensors() {
        let name = format!("d{name}");
        if !summed.iter().any(|(n, _)| *n == name) {
            let count = shape.iter().product();
            summed.push((name, Tensor::from_f32(&shape, vec![0.0; count])?));
        }
    }
    Ok(summed)
}

impl Layout {
    /// One sequence's q, k and v (`values` of the batch's, as f32) as `[1, heads, len, width]`
    /// tensors in their dtypes.
    fn sequence_inputs(
        &self,
        x: &Varlen,
        [q, k, v]: [&[f32]; 3],
        rows_q: &Range<usize>,
        rows_k: &Range<usize>,
    ) -> Result<[Tensor; 3], RuntimeError> {
        Ok([
            unpack(q, x.q.dtype(), rows_q, self.heads, self.head_dim)?,
            unpack(k, x.k.dtype(), rows_k, self.kv_heads, self.head_dim)?,
            unpack(v, x.v.dtype(), rows_k, self.kv_heads, self.v_head_dim)?,
        ])
    }

    /// Checks a batch against the variant: ranks, widths, offsets.
    fn check(variant: &Variant, x: &Varlen) -> Result<Layout, RuntimeError> {
        let spec = variant.spec();
        if spec.mla().is_some() {
            return Err(RuntimeError::Spec(
                "variable-length batches take per-head specs; this one is MLA".into(),
            ));
        }
        let reads_batch = spec
            .score_mod
            .as_ref()
            .is_some_and(|m| varlen_data::reads_batch_index(spec, &m.body))
            || spec
                .mask_mod
                .as_ref()
                .is_some_and(|m| varlen_data::reads_batch_index(spec, &m.body));
        if reads_batch {
            return Err(RuntimeError::Spec(
                "a modifier of this spec reads the batch index `b` (other than as a data \
                 tensor's `batch` index), which variable-length batches (one call per sequence) \
                 do not give it yet"
                    .into(),
            ));
        }
        let (heads, kv_heads) = (spec.heads as usize, spec.kv_heads() as usize);
        let (head_dim, v_head_dim) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let total_q = rows("q", x.q)?;
        let total_k = rows("k", x.k)?;
        expect_shape(
            "q",
            x.q,
            &[total_q, heads, head_dim],
            "[total_q, heads, head_dim]",
        )?;
        expect_shape(
            "k",
            x.k,
            &[total_k, kv_heads, head_dim],
            "[total_k, kv_heads, head_dim]",
        )?;
        expect_shape(
            "v",
            x.v,
            &[total_k, kv_heads, v_head_dim],
            "[total_k, kv_heads, v_head_dim]",
        )?;
        Ok(Layout {
            sequences: sequences(x.cu_seqlens_q, x.cu_seqlens_k, total_q, total_k)?,
            heads,
            kv_heads,
            head_dim,
            v_head_dim,
            total_q,
            total_k,
        })
    }
}

/// Each sequence's query rows and key rows from the cumulative offsets, checked against the
/// packed tensors' `total_q` and `total_k` rows: each list starts at 0, never decreases and ends
/// at its total, and both hold the same number of sequences.
pub fn sequences(
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    total_q: usize,
    total_k: usize,
) -> Result<Vec<SequenceRows>, RuntimeError> {
    let seq_q = offsets("cu_seqlens_q", cu_seqlens_q, total_q)?;
    let seq_k = offsets("cu_seqlens_k", cu_seqlens_k, total_k)?;
    if seq_q.len() != seq_k.len() {
        return Err(RuntimeError::Data(format!(
            "cu_seqlens_q holds {} sequences and cu_seqlens_k {}; expected the same number",
            seq_q.len(),
            seq_k.len()
        )));
    }
    Ok(seq_q.into_iter().zip(seq_k).collect())
}

/// The rows of a rank-3 packed tensor.
fn rows(name: &str, t: &Tensor) -> Result<usize, RuntimeError> {
    match t.shape() {
        [rows, _, _] => Ok(*rows),
        found => Err(RuntimeError::Shape {
            tensor: name.into(),
            found: found.to_vec(),
            expected: "rank 3: [tokens, heads, width] (a variable-length batch)".into(),
        }),
    }
}

fn expect_shape(name: &str, t: &Tensor, shape: &[usize], words: &str) -> Result<(), RuntimeError> {
    if t.shape() == shape {
        return Ok(());
    }
    Err(RuntimeError::Shape {
        tensor: name.into(),
        found: t.shape().to_vec(),
        expected: format!("{shape:?} ({words})"),
    })
}

/// Each sequence's rows from its cumulative offsets.
fn offsets(name: &str, cu: &[i32], total: usize) -> Result<Vec<Range<usize>>, RuntimeError> {
    let bad = |what: String| RuntimeError::Data(format!("{name}: {what}"));
    match cu.first() {
        None => return Err(bad("empty; expected B + 1 offsets from 0".into())),
        Some(&first) if first != 0 => {
            return Err(bad(format!("starts at {first}; expected 0")));
        }
        Some(_) => {}
    }
    let last = *cu.last().unwrap_or(&0);
    if usize::try_from(last).ok() != Some(total) {
        return Err(bad(format!(
            "ends at {last}; expected the tensor's {total} rows"
        )));
    }
    cu.windows(2)
        .enumerate()
        .map(|(i, w)| {
            if w[1] < w[0] {
                return Err(bad(format!(
                    "offset {} is {} after {}; offsets never decrease",
                    i + 1,
                    w[1],
                    w[0]
                )));
            }
            // Non-negative: the first is 0 and none decreases.
            Ok(w[0] as usize..w[1] as usize)
        })
        .collect()
}

/// Rows `rows` of a packed `[tokens, heads, width]` tensor's values as `[1, heads, len, width]`
/// in `dtype` (the values came from that dtype, so the round trip through f32 is exact).
fn unpack(
    values: &[f32],
    dtype: DType,
    rows: &Range<usize>,
    heads: usize,
    width: usize,
) -> Result<Tensor, RuntimeError> {
    let len = rows.len();
    let mut out = vec![0f32; heads * len * width];
    for (i, t) in rows.clone().enumerate() {
        for h in 0..heads {
            let from = (t * heads + h) * width;
            let to = (h * len + i) * width;
            out[to..to + width].copy_from_slice(&values[from..from + width]);
        }
    }
    Tensor::from_f32_as(dtype, &[1, heads, len, width], out)
}

/// `[1, heads, len, width]` values into rows `rows` of a packed `[tokens, heads, width]` buffer.
fn pack(packed: &mut [f32], values: &[f32], rows: &Range<usize>, heads: usize, width: usize) {
    let len = rows.len();
    for (i, t) in rows.clone().enumerate() {
        for h in 0..heads {
            let from = (h * len + i) * width;
            let to = (t * heads + h) * width;
            packed[to..to + width].copy_from_slice(&values[from..from + width]);
        }
    }
}

/// An error of sequence `i`'s call, saying which sequence.
fn in_sequence(i: usize, e: RuntimeError) -> RuntimeError {
    match e {
        RuntimeError::Data(m) => RuntimeError::Data(format!("sequence {i}: {m}")),
        RuntimeError::Spec(m) => RuntimeError::Spec(format!("sequence {i}: {m}")),
        other => other,
    }
}
