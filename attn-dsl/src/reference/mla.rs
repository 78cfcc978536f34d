//! Multi-head latent attention (DeepSeek-V2/V3 layout) in its expanded and absorbed forms.

use super::rope::Side;
use super::{Array, Learned, Output, Positions, attend, check_spec, dims4, expect, rope};
use crate::error::ReferenceError;
use crate::modifier::ScoreProgram;
use crate::spec::{AttentionSpec, Mla, Position};

/// Inputs of MLA attention.
#[derive(Clone, Copy, Debug)]
pub struct MlaInputs<'a> {
    /// Non-rotary query part `[B, H, Sq, head_dim]`.
    pub q_nope: &'a Array,
    /// Rotary query part `[B, H, Sq, rope_dim]` (rotated here when the spec has RoPE).
    pub q_pe: &'a Array,
    /// The latent after its norm, `[B, Skv, latent_rank]`.
    pub c_kv: &'a Array,
    /// The shared rotary key `[B, Skv, rope_dim]` (rotated here when the spec has RoPE).
    pub k_pe: &'a Array,
    /// `kv_b_proj.weight`, `[H * (head_dim + v_head_dim), latent_rank]`: per head, `head_dim` rows
    /// that make k_nope, then `v_head_dim` rows that make v.
    pub w_kv_b: &'a Array,
    /// Position of key 0.
    pub position_offset: i64,
}

/// Outputs of the absorbed form, with its intermediates.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaAbsorbed {
    /// `out [B, H, Sq, v_head_dim]` and `lse [B, H, Sq]`.
    pub output: Output,
    /// `W_uk^T q_nope`, `[B, H, Sq, latent_rank]`.
    pub q_latent: Array,
    /// `softmax @ c_kv`, `[B, H, Sq, latent_rank]`.
    pub out_latent: Array,
}

/// Checked shapes of MLA inputs.
struct Shapes {
    b: usize,
    h: usize,
    sq: usize,
    skv: usize,
    dn: usize,
    dv: usize,
    mla: Mla,
}

fn check(spec: &AttentionSpec, x: &MlaInputs) -> Result<Shapes, ReferenceError> {
    check_spec(spec)?;
    let Some(mla) = spec.mla() else {
        return Err(ReferenceError::WrongEntryPoint(
            "this spec has per-head KV: use reference::attention",
        ));
    };
    let (h, dn, dv) = (
        spec.heads as usize,
        spec.head_dim as usize,
        spec.v_head_dim as usize,
    );
    let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
    let [b, _, sq, _] = dims4("q_nope", x.q_nope)?;
    expect("q_nope", x.q_nope, &[b, h, sq, dn])?;
    expect("q_pe", x.q_pe, &[b, h, sq, dr])?;
    let skv = match x.c_kv.shape() {
        [_, skv, _] => *skv,
        other => {
            return Err(ReferenceError::Shape {
                name: "c_kv",
                found: other.to_vec(),
                expected: format!("[B, Skv, {r}]"),
            });
        }
    };
    expect("c_kv", x.c_kv, &[b, skv, r])?;
    expect("k_pe", x.k_pe, &[b, skv, dr])?;
    expect("w_kv_b", x.w_kv_b, &[h * (dn + dv), r])?;
    Ok(Shapes {
        b,
        h,
        sq,
        skv,
        dn,
        dv,
        mla,
    })
}

/// The rotary parts, rotated when the spec has RoPE: q_pe `[B, H, Sq, dr]`, k_pe `[B, 1, Skv, dr]`.
fn rotary_parts(
    spec: &AttentionSpec,
    x: &MlaInputs,
    s: &Shapes,
    pos: &Positions,
) -> (Array, Array) {
    let dr = s.mla.rope_dim as usize;
    let k_pe =
        Array::from_vec(&[s.b, 1, s.skv, dr], x.k_pe.data().to_vec()).expect("same element count");
    match &spec.position {
        Position::Rope(r) => (
            rope::apply(r, x.q_pe, &pos.queries(), pos.total_len(), Side::Query),
            rope::apply(r, &k_pe, &pos.keys(), pos.total_len(), Side::Key),
        ),
        _ => (x.q_pe.clone(), k_pe),
    }
}

/// Row `row` of `w_kv_b` for head `h`: rows `0..dn` are W_uk[h], rows `dn..dn+dv` are W_uv[h].
fn w_row<'a>(x: &MlaInputs<'a>, s: &Shapes, h: usize, row: usize) -> &'a [f64] {
    x.w_kv_b.row(&[h * (s.dn + s.dv) + row])
}

/// Concatenates `a [.., Da]` and `b [.., Db]` along the last axis; `b`'s head axis may be 1
/// (broadcast to `a`'s).
fn concat_last(a: &Array, b: &Array) -> Array {
    let sa = a.shape();
    let (da, db) = (sa[3], b.shape()[3]);
    let mut shape = sa.to_vec();
    shape[3] = da + db;
    Array::from_fn(&shape, |ix| {
        if ix[3] < da {
            a.get(ix)
        } else {
            let bh = if b.shape()[1] == 1 { 0 } else { ix[1] };
            b.get(&[ix[0], bh, ix[2], ix[3] - da])
        }
    })
}

/// MLA as the model defines it: k_nope and v are expanded per head from the latent, then ordinary
/// attention runs with `q = [q_nope | q_pe]` and `k = [k_nope | k_pe]`.
pub fn mla_expanded(spec: &AttentionSpec, x: &MlaInputs) -> Result<Output, ReferenceError> {
    let s = check(spec, x)?;
    super::check_positions(s.sq, s.skv, x.position_offset)?;
    let pos = Positions::new(s.sq, s.skv, x.position_offset);
    let [q, k, v] = expanded(spec, x, &s, &pos);
    Ok(attend(spec, &q, &k, &v, &pos, &Learned::default()))
}

/// The expanded form's per-head inputs: `q = [q_nope | q_pe]`, `k = [W_uk c_kv | k_pe]` and
/// `v = W_uv c_kv` (the rotary parts rotated when the spec has RoPE).
fn expanded(spec: &AttentionSpec, x: &MlaInputs, s: &Shapes, pos: &Positions) -> [Array; 3] {
    let (q_pe, k_pe) = rotary_parts(spec, x, s, pos);
    let project = |rows: std::ops::Range<usize>| {
        Array::from_fn(&[s.b, s.h, s.skv, rows.len()], |ix| {
            let w = w_row(x, s, ix[1], rows.start + ix[3]);
            super::dot(w, x.c_kv.row(&[ix[0], ix[2]]))
        })
    };
    [
        concat_last(x.q_nope, &q_pe),
        concat_last(&project(0..s.dn), &k_pe),
        project(s.dn..s.dn + s.dv),
    ]
}

/// MLA in the absorbed form kernels run: `q_latent = W_uk^T q_nope`, attention over the shared
/// head `[c_kv | k_pe]` with values `c_kv`, then `out = W_uv out_latent`. Equal to
/// [`mla_expanded`] up to rounding.
pub fn mla_absorbed(spec: &AttentionSpec, x: &MlaInputs) -> Result<MlaAbsorbed, ReferenceError> {
    let s = check(spec, x)?;
    super::check_positions(s.sq, s.skv, x.position_offset)?;
    let pos = Positions::new(s.sq, s.skv, x.position_offset);
    let (q_pe, k_pe) = rotary_parts(spec, x, &s, &pos);
    let r = s.mla.latent_rank as usize;
    let q_latent = Array::from_fn(&[s.b, s.h, s.sq, r], |ix| {
        let qn = x.q_nope.row(&[ix[0], ix[1], ix[2]]);
        (0..s.dn)
            .map(|d| w_row(x, &s, ix[1], d)[ix[3]] * qn[d])
            .sum()
    });
    let c_kv =
        Array::from_vec(&[s.b, 1, s.skv, r], x.c_kv.data().to_vec()).expect("same element count");
    let q = concat_last(&q_latent, &q_pe);
    let k = concat_last(&c_kv, &k_pe);
    let latent = attend(spec, &q, &k, &c_kv, &pos, &Learned::default());
    let out = Array::from_fn(&[s.b, s.h, s.sq, s.dv], |ix| {
        let w = w_row(x, &s, ix[1], s.dn + ix[3]);
        super::dot(w, latent.out.row(&[ix[0], ix[1], ix[2]]))
    });
    Ok(MlaAbsorbed {
        output: Output {
            out,
            lse: latent.lse,
        },
        q_latent,
        out_latent: latent.out,
    })
}

/// Gradients with respect to the inputs of MLA attention ([`MlaInputs`]).
#[derive(Clone, Debug, PartialEq)]
pub struct MlaGradients {
    /// `dL/dq_nope`, `[B, H, Sq, head_dim]`.
    pub dq_nope: Array,
    /// `dL/dq_pe` (before RoPE), `[B, H, Sq, rope_dim]`.
    pub dq_pe: Array,
    /// `dL/dc_kv`, `[B, Skv, latent_rank]`.
    pub dc_kv: Array,
    /// `dL/dk_pe` (before RoPE), `[B, Skv, rope_dim]`.
    pub dk_pe: Array,
    /// `dL/dw_kv_b`, `[H * (head_dim + v_head_dim), latent_rank]`.
    pub dw_kv_b: Array,
}

/// The gradients of MLA attention for the output gradient `dout` (`[B, H, Sq, v_head_dim]`),
/// through the expanded form ([`mla_expanded`]): the per-head backward on `q = [q_nope | q_pe]`,
/// `k = [k_nope | k_pe]` and `v`, then the chain through the expansion (`k_nope = W_uk c_kv`,
/// `v = W_uv c_kv`: `dc_kv = sum_h W_uk^T dk_nope + W_uv^T dv`, `dW_uk = dk_nope c_kv^T`,
/// `dW_uv = dv c_kv^T`), the shared `k_pe` summed over heads, and RoPE undone on the rotary
/// parts.
pub fn backward_mla(
    spec: &AttentionSpec,
    x: &MlaInputs,
    dout: &Array,
) -> Result<MlaGradients, ReferenceError> {
    let s = check(spec, x)?;
    super::check_positions(s.sq, s.skv, x.position_offset)?;
    expect("dout", dout, &[s.b, s.h, s.sq, s.dv])?;
    let pos = Positions::new(s.sq, s.skv, x.position_offset);
    let [q, k, v] = expanded(spec, x, &s, &pos);
    let derivative = ScoreProgram::of(spec)
        .score_gradient()
        .map_err(|e| ReferenceError::Gradient(e.to_string()))?
        .expr;
    let (dq, dk, dv) = super::backward::rotated_gradients(
        spec,
        &q,
        &k,
        &v,
        dout,
        &pos,
        &derivative,
        &Learned::default(),
    )
    .0;
    let (dn, dr, r) = (s.dn, s.mla.rope_dim as usize, s.mla.latent_rank as usize);
    let dq_nope = Array::from_fn(&[s.b, s.h, s.sq, dn], |ix| dq.get(ix));
    let dq_pe = Array::from_fn(&[s.b, s.h, s.sq, dr], |ix| {
        dq.get(&[ix[0], ix[1], ix[2], dn + ix[3]])
    });
    // The shared rotary key gathers every head's gradient.
    let dk_pe = Array::from_fn(&[s.b, 1, s.skv, dr], |ix| {
        (0..s.h)
            .map(|h| dk.get(&[ix[0], h, ix[2], dn + ix[3]]))
            .sum()
    });
    let (dq_pe, dk_pe) = match &spec.position {
        Position::Rope(rope_spec) => {
            let len = pos.total_len();
            (
                rope::apply_transposed(rope_spec, &dq_pe, &pos.queries(), len, Side::Query),
                rope::apply_transposed(rope_spec, &dk_pe, &pos.keys(), len, Side::Key),
            )
        }
        _ => (dq_pe, dk_pe),
    };
    let dk_pe = Array::from_vec(&[s.b, s.skv, dr], dk_pe.data().to_vec()).expect("same count");
    // Through the expansion: row `row` of W for head h meets the gradient of its output.
    let grad_of = |h: usize, row: usize, b: usize, j: usize| {
        if row < dn {
            dk.get(&[b, h, j, row])
        } else {
            dv.get(&[b, h, j, row - dn])
        }
    };
    let rows = dn + s.dv;
    let dc_kv = Array::from_fn(&[s.b, s.skv, r], |ix| {
        let (b, j, c) = (ix[0], ix[1], ix[2]);
        (0..s.h)
            .flat_map(|h| (0..rows).map(move |row| (h, row)))
            .map(|(h, row)| grad_of(h, row, b, j) * w_row(x, &s, h, row)[c])
            .sum()
    });
    let dw_kv_b = Array::from_fn(&[s.h * rows, r], |ix| {
        let (h, row, c) = (ix[0] / rows, ix[0] % rows, ix[1]);
        (0..s.b)
            .flat_map(|b| (0..s.skv).map(move |j| (b, j)))
            .map(|(b, j)| grad_of(h, row, b, j) * x.c_kv.get(&[b, j, c]))
            .sum()
    });
    Ok(MlaGradients {
        dq_nope,
        dq_pe,
        dc_kv,
        dk_pe,
        dw_kv_b,
    })
}
