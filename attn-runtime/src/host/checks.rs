//! Checks of a call's tensors against its spec, and the outputs in the spec's dtype.

use crate::cache::KvCache;
use crate::calls::{HeadsBackward, Output};
use crate::error::RuntimeError;
use crate::placement::Piece;
use crate::tensor::Tensor;
use crate::variant::Variant;
use attn_dsl::{AttentionSpec, DType};

pub(crate) fn check_dtype(name: &str, t: &Tensor, dtype: DType) -> Result<(), RuntimeError> {
    if t.dtype() == dtype {
        Ok(())
    } else {
        Err(RuntimeError::DType {
            tensor: name.into(),
            found: t.dtype().name().into(),
            expected: dtype.name().into(),
        })
    }
}

/// Refuses a call whose working memory would exceed the memory available: each of `tensors`
/// at its logical size, widened to f32, `copies` times over (a converted input, an output or a
/// gradient of its size), plus `extra` f32 values. Input tensors hold at least their storage,
/// but a view can describe far more elements than that (a broadcast axis has stride 0), and
/// the outputs and working copies follow the logical sizes.
pub(crate) fn ensure_call_fits(
    what: &str,
    tensors: &[&Tensor],
    extra: u64,
    copies: u64,
) -> Result<(), RuntimeError> {
    let values = tensors.iter().try_fold(extra, |sum, t| {
        let dims: Vec<u64> = t.shape().iter().map(|&n| n as u64).collect();
        sum.checked_add(crate::memory::checked_product(&dims)?)
    });
    let bytes = values.and_then(|v| v.checked_mul(copies)?.checked_mul(4));
    crate::memory::ensure_fits(what, bytes)
}

/// Checks per-head inputs against the spec: q `[B, heads, Sq, head_dim]`, k `[B, kv_heads, Skv,
/// head_dim]`, v `[B, kv_heads, Skv, v_head_dim]`, all in the spec's dtype. Returns B, Sq, Skv.
pub(crate) fn check_qkv(
    spec: &AttentionSpec,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<[usize; 3], RuntimeError> {
    check_placed_qkv(spec, &Piece::whole(spec), q, k, v)
}

/// [`check_qkv`] for a call holding the heads of `piece`.
pub(crate) fn check_placed_qkv(
    spec: &AttentionSpec,
    piece: &Piece,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<[usize; 3], RuntimeError> {
    let (h, hkv) = (piece.hq, piece.hkv);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let [b, _, sq, _] = dims("q", q, "[B, heads, Sq, head_dim]")?;
    expect("q", q, &[b, h, sq, d], "[B, heads, Sq, head_dim]")?;
    let [_, _, skv, _] = dims("k", k, "[B, kv_heads, Skv, head_dim]")?;
    expect("k", k, &[b, hkv, skv, d], "[B, kv_heads, Skv, head_dim]")?;
    expect("v", v, &[b, hkv, skv, dv], "[B, kv_heads, Skv, v_head_dim]")?;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        check_dtype(name, t, spec.dtype)?;
    }
    Ok([b, sq, skv])
}

/// Checks the inputs of a backward call: q, k, v as [`check_qkv`]; `out` and `dout` `[B, heads,
/// Sq, v_head_dim]` and `lse` `[B, heads, Sq]`, in any dtype (the backward reads them as f32: a
/// gradient kept in f32 for a bf16 model is common). Refuses MLA specs, whose backward takes
/// other tensors (`backward_mla`). Returns B, Sq, Skv.
pub(crate) fn check_backward(
    spec: &AttentionSpec,
    x: &HeadsBackward,
) -> Result<[usize; 3], RuntimeError> {
    check_placed_backward(spec, &Piece::whole(spec), x)
}

/// [`check_backward`] for a call holding the heads of `piece`.
pub(crate) fn check_placed_backward(
    spec: &AttentionSpec,
    piece: &Piece,
    x: &HeadsBackward,
) -> Result<[usize; 3], RuntimeError> {
    if spec.mla().is_some() {
        return Err(RuntimeError::Spec(
            "this is an MLA spec: its backward takes BackwardInputs::Mla (the forward's MLA \
             inputs, its latent output and lse, and dout)"
                .into(),
        ));
    }
    let [b, sq, skv] = check_placed_qkv(spec, piece, x.q, x.k, x.v)?;
    let (h, dv) = (piece.hq, spec.v_head_dim as usize);
    for (name, t) in [("out", x.out), ("dout", x.dout)] {
        expect(name, t, &[b, h, sq, dv], "[B, heads, Sq, v_head_dim]")?;
    }
    expect("lse", x.lse, &[b, h, sq], "[B, heads, Sq]")?;
    Ok([b, sq, skv])
}

/// The output tensors of a call: `out` `[B, H, Sq, Dv]` in `dtype` and `lse` `[B, H, Sq]` in f32,
/// after [`overflowed_rows_are_nan`].
pub(crate) fn finish(
    dtype: DType,
    shape: [usize; 4],
    mut out: Vec<f32>,
    mut lse: Vec<f32>,
) -> Result<Output, RuntimeError> {
    overflowed_rows_are_nan(&mut out, &mut lse, shape[3]);
    Ok(Output {
        out: Tensor::from_f32_as(dtype, &shape, out)?,
        lse: Tensor::from_f32(&shape[..3], lse)?,
        latent: None,
    })
}

/// The `N` dims of `t`; a tensor of another rank is a shape error that says what was
/// `expected`.
pub(crate) fn dims<const N: usize>(
    name: &str,
    t: &Tensor,
    expected: &str,
) -> Result<[usize; N], RuntimeError> {
    t.shape().try_into().map_err(|_| RuntimeError::Shape {
        tensor: name.into(),
        found: t.shape().to_vec(),
        expected: expected.into(),
    })
}

pub(crate) fn expect(
    name: &str,
    t: &Tensor,
    shape: &[usize],
    what: &str,
) -> Result<(), RuntimeError> {
    if t.shape() == shape {
        Ok(())
    } else {
        Err(RuntimeError::Shape {
            tensor: name.into(),
            found: t.shape().to_vec(),
            expected: format!("{shape:?} = {what}"),
        })
    }
}

/// Refuses MLA specs in the per-head entry points.
pub(crate) fn per_head(spec: &AttentionSpec, q: &Tensor) -> Result<(), RuntimeError> {
    if spec.mla().is_some() {
        return Err(RuntimeError::Spec(
            "this is an MLA spec: its calls take MLA inputs (Inputs::Mla, Queries::Mla)".into(),
        ));
    }
    check_dtype("q", q, spec.dtype)
}

pub(crate) fn head_dims(spec: &AttentionSpec) -> (usize, usize, usize) {
    (
        spec.heads as usize,
        spec.head_dim as usize,
        spec.v_head_dim as usize,
    )
}

pub(crate) fn shape(name: &str, t: &Tensor, expected: &str) -> RuntimeError {
    RuntimeError::Shape {
        tensor: name.into(),
        found: t.shape().to_vec(),
        expected: expected.into(),
    }
}

/// Checks that `cache` was made for `variant`.
pub(crate) fn check_cache(variant: &Variant, cache: &dyn KvCache) -> Result<(), RuntimeError> {
    let (found, expected) = (cache.layout(), variant.cache_layout());
    if found == expected {
        return Ok(());
    }
    Err(RuntimeError::Cache(format!(
        "the cache was made for another spec: it stores {} kv heads of {}+{} {} values, \
         `{variant}` needs {} of {}+{} {}",
        found.kv_heads,
        found.k_dim,
        found.v_dim,
        found.dtype.name(),
        expected.kv_heads,
        expected.k_dim,
        expected.v_dim,
        expected.dtype.name()
    )))
}

/// Rows with a score past `f32::MAX` (a +inf score) are NaN in `out` and `lse` (docs/semantics.md,
/// "At the edges": `inf - inf` in the softmax, as in PyTorch's math path).
///
/// The kernels compute scores in scaled units (base 2, halved on the GPU) in which a score just
/// past `f32::MAX` is still finite, so their softmax weights stay defined; but such a row's
/// log-sum-exp, at least its largest score, comes out +inf, and only such a row's does (up to
/// rounding within one unit of `f32::MAX`). Every backend's output passes through here, so all
/// of them give the rule's NaN whatever units their kernels use.
pub(crate) fn overflowed_rows_are_nan(out: &mut [f32], lse: &mut [f32], dv: usize) {
    for (row, l) in lse.iter_mut().enumerate() {
        if *l == f32::INFINITY {
            *l = f32::NAN;
            if let Some(o) = out.get_mut(row * dv..(row + 1) * dv) {
                o.fill(f32::NAN);
            }
        }
    }
}
