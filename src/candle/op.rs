//! The candle op: its checks, its forward on attn's CPU kernels, and its backward from the lse
//! the forward kept.

use super::convert::{candle_dtype, to_attn, to_candle};
use crate::runtime::Tensor as AttnTensor;
use crate::{Backend, BackwardInputs, CpuBackend, HeadsBackward, Inputs, Variant};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// Checks q, k and v against the variant's spec and each other, naming the tensor that
/// disagrees, what was expected and what was found.
pub(super) fn check_inputs(
    variant: &Variant,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> candle_core::Result<()> {
    let spec = variant.spec();
    let refuse = |what: String| {
        Err(candle_core::Error::Msg(format!(
            "attn::candle: {what} (spec `{}`)",
            variant.text()
        )))
    };
    if spec.mla().is_some() {
        return refuse(
            "MLA variants do not run as a candle op (five inputs; candle's ops take three): \
             train the expanded form with a per-head variant"
                .into(),
        );
    }
    let dtype = candle_dtype(spec.dtype);
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if !t.device().is_cpu() {
            return refuse(format!(
                "`{name}` is on {:?}; attn::candle runs CPU tensors",
                t.device().location()
            ));
        }
        if t.dtype() != dtype {
            return refuse(format!(
                "`{name}` is {:?}, expected {dtype:?} as the spec says",
                t.dtype()
            ));
        }
        if t.rank() != 4 {
            return refuse(format!(
                "`{name}` has shape {:?}, expected rank 4 (BHSD)",
                t.dims()
            ));
        }
    }
    let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let (b, skv) = (q.dims()[0], k.dims()[2]);
    let expected = [
        (
            "q",
            q,
            [Some(b), Some(h), None, Some(d)],
            "[B, heads, Sq, head_dim]",
        ),
        (
            "k",
            k,
            [Some(b), Some(hkv), Some(skv), Some(d)],
            "[B, kv_heads, Skv, head_dim]",
        ),
        (
            "v",
            v,
            [Some(b), Some(hkv), Some(skv), Some(dv)],
            "[B, kv_heads, Skv, v_head_dim]",
        ),
    ];
    for (name, t, want, words) in expected {
        let fits = t
            .dims()
            .iter()
            .zip(want)
            .all(|(&n, w)| w.is_none_or(|w| w == n));
        if !fits {
            let want: Vec<String> = want
                .iter()
                .map(|w| w.map_or("_".to_string(), |w| w.to_string()))
                .collect();
            return refuse(format!(
                "`{name}` has shape {:?}, expected {words} = [{}]",
                t.dims(),
                want.join(", ")
            ));
        }
    }
    Ok(())
}

/// What the forward keeps for the backward: the lse, `[B, heads, Sq]` f32.
#[derive(Default)]
pub(super) struct Saved {
    lse: Mutex<Option<AttnTensor>>,
}

impl Saved {
    fn lse(&self) -> candle_core::Result<AttnTensor> {
        let lse = self.lse.lock().map_err(|_| lost())?;
        lse.clone().ok_or_else(lost)
    }

    /// The lse as a candle tensor on `device`, outside the graph.
    pub(super) fn lse_tensor(&self, device: &Device) -> candle_core::Result<Tensor> {
        let lse = self.lse()?;
        Tensor::from_vec(lse.to_f32_vec(), lse.shape(), device)
    }
}

fn lost() -> candle_core::Error {
    candle_core::Error::Msg("attn::candle: the forward's lse was not saved".into())
}

/// Attention as a candle op over (q, k, v).
pub(super) struct AttentionOp {
    variant: Arc<Variant>,
    position_offset: i64,
    saved: Arc<Saved>,
}

impl AttentionOp {
    pub(super) fn new(variant: &Arc<Variant>, position_offset: i64) -> Self {
        AttentionOp {
            variant: Arc::clone(variant),
            position_offset,
            saved: Arc::default(),
        }
    }

    /// The state the forward fills, shared with the caller.
    pub(super) fn saved(&self) -> Arc<Saved> {
        Arc::clone(&self.saved)
    }
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "attn-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_layout: &Layout,
        k: &CpuStorage,
        k_layout: &Layout,
        v: &CpuStorage,
        v_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q, k, v) = (
            to_attn(q, q_layout)?,
            to_attn(k, k_layout)?,
            to_attn(v, v_layout)?,
        );
        let output = CpuBackend::new()
            .forward(
                &self.variant,
                Inputs::heads(&q, &k, &v),
                self.position_offset,
            )
            .map_err(candle_core::Error::wrap)?;
        *self.saved.lse.lock().map_err(|_| lost())? = Some(output.lse);
        let shape = Shape::from(output.out.shape());
        Ok((to_candle(output.out), shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self.saved.lse()?;
        let (q, k, v, out, dout) = (
            attn_of(q)?,
            attn_of(k)?,
            attn_of(v)?,
            attn_of(out)?,
            attn_of(dout)?,
        );
        let x = HeadsBackward {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            lse: &lse,
            dout: &dout,
            position_offset: self.position_offset,
        };
        let grads = CpuBackend::new()
            .backward(&self.variant, &BackwardInputs::Heads(x))
            .and_then(|g| g.heads())
            .map_err(candle_core::Error::wrap)?;
        let device = Device::Cpu;
        Ok((
            Some(candle_of(grads.dq, &device)?),
            Some(candle_of(grads.dk, &device)?),
            Some(candle_of(grads.dv, &device)?),
        ))
    }
}

/// A CPU candle tensor as an attn tensor.
fn attn_of(t: &Tensor) -> candle_core::Result<AttnTensor> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => to_attn(s, layout),
        _ => Err(candle_core::Error::Msg(format!(
            "attn::candle runs CPU tensors; a backward input is on {:?}",
            t.device().location()
        ))),
    }
}

/// An attn tensor as a candle tensor on `device`.
fn candle_of(t: AttnTensor, device: &Device) -> candle_core::Result<Tensor> {
    let shape = t.shape().to_vec();
    match to_candle(t) {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, device),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, device),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, device),
        other => Err(candle_core::Error::Msg(format!(
            "attn::candle: a gradient of dtype {:?}",
            other.dtype()
        ))),
    }
}
