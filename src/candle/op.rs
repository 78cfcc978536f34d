//! The candle op: its checks, its forward on attn's CPU kernels, and its backward from the lse
//! the forward kept.

use super::convert::{candle_dtype, to_attn, to_candle};
use crate::runtime::Tensor as AttnTensor;
use crate::{Backend, BackwardInputs, CpuBackend, HeadsBackward, Inputs, Learned, Variant};
use attn_dsl::match_learned;
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

/// Checks a spec's learnable tensors (each by its name, f32, on the CPU, with the spec's shape)
/// and returns them in the spec's order.
pub(super) fn check_learned<'t>(
    variant: &Variant,
    learned: &[(&str, &'t Tensor)],
) -> candle_core::Result<Vec<&'t Tensor>> {
    let refuse = |what: String| {
        Err(candle_core::Error::Msg(format!(
            "attn::candle: {what} (spec `{}`)",
            variant.text()
        )))
    };
    let named: Vec<(&str, &[usize])> = learned.iter().map(|(n, t)| (*n, t.dims())).collect();
    let order = match match_learned(variant.spec(), &named) {
        Ok(order) => order,
        Err(e) => return refuse(e.to_string()),
    };
    let mut ordered = Vec::with_capacity(order.len());
    for i in order {
        let (name, t) = learned[i];
        if !t.device().is_cpu() || t.dtype() != candle_core::DType::F32 {
            return refuse(format!(
                "`{name}` is {:?} on {:?}; expected f32 on the CPU",
                t.dtype(),
                t.device().location()
            ));
        }
        ordered.push(t);
    }
    Ok(ordered)
}

/// How v and the learnable tensors travel as the op's third input: candle's custom ops take
/// three tensors, so with learnable tensors the third is one f32 vector, v's elements (in its
/// logical order, as f32) followed by each learnable tensor's. candle's `cat` makes it and its
/// backward splits the gradient back.
pub(super) struct Packing {
    /// v's shape, `[B, kv_heads, Skv, v_head_dim]`.
    pub v_dims: Vec<usize>,
    /// Each learnable tensor's name and shape, in the spec's order.
    pub tensors: Vec<(String, Vec<usize>)>,
}

impl Packing {
    /// v (in the spec's dtype) and the learnable tensors (f32) out of the packed values.
    fn unpack(
        &self,
        dtype: crate::DType,
        packed: &[f32],
    ) -> candle_core::Result<(AttnTensor, Vec<(String, AttnTensor)>)> {
        let n_v: usize = self.v_dims.iter().product();
        let total = n_v
            + self
                .tensors
                .iter()
                .map(|(_, s)| s.iter().product::<usize>())
                .sum::<usize>();
        if packed.len() != total {
            return Err(candle_core::Error::Msg(format!(
                "attn::candle: the packed v and learnable tensors hold {} values, expected {total}",
                packed.len()
            )));
        }
        let v = AttnTensor::from_f32_as(dtype, &self.v_dims, packed[..n_v].to_vec())
            .map_err(candle_core::Error::wrap)?;
        let mut at = n_v;
        let mut learned = Vec::with_capacity(self.tensors.len());
        for (name, shape) in &self.tensors {
            let n: usize = shape.iter().product();
            let t = AttnTensor::from_f32(shape, packed[at..at + n].to_vec())
                .map_err(candle_core::Error::wrap)?;
            learned.push((name.clone(), t));
            at += n;
        }
        Ok((v, learned))
    }
}

/// The values of a contiguous f32 vector.
fn packed_values(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<Vec<f32>> {
    let data = storage.as_slice::<f32>()?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(data[start..end].to_vec()),
        None => Err(candle_core::Error::Msg(
            "attn::candle: the packed v and learnable tensors are not contiguous".into(),
        )),
    }
}

fn named(learned: &[(String, AttnTensor)]) -> Vec<(&str, &AttnTensor)> {
    learned.iter().map(|(n, t)| (n.as_str(), t)).collect()
}

/// Attention as a candle op over (q, k, v), or (q, k, packed v and learnable tensors).
pub(super) struct AttentionOp {
    variant: Arc<Variant>,
    position_offset: i64,
    saved: Arc<Saved>,
    packing: Option<Packing>,
}

impl AttentionOp {
    pub(super) fn new(variant: &Arc<Variant>, position_offset: i64) -> Self {
        AttentionOp {
            variant: Arc::clone(variant),
            position_offset,
            saved: Arc::default(),
            packing: None,
        }
    }

    /// The op over a packed third input.
    pub(super) fn packed(variant: &Arc<Variant>, position_offset: i64, packing: Packing) -> Self {
        AttentionOp {
            packing: Some(packing),
            ..AttentionOp::new(variant, position_offset)
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
        let (q, k) = (to_attn(q, q_layout)?, to_attn(k, k_layout)?);
        let (v, learned) = match &self.packing {
            None => (to_attn(v, v_layout)?, Vec::new()),
            Some(p) => p.unpack(self.variant.spec().dtype, &packed_values(v, v_layout)?)?,
        };
        let output = CpuBackend::new()
            .forward_learned(
                &self.variant,
                Inputs::heads(&q, &k, &v),
                self.position_offset,
                Learned::new(&named(&learned)),
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
        let (q, k, out, dout) = (attn_of(q)?, attn_of(k)?, attn_of(out)?, attn_of(dout)?);
        let (v, learned) = match &self.packing {
            None => (attn_of(v)?, Vec::new()),
            Some(p) => {
                let (storage, layout) = v.storage_and_layout();
                let candle_core::Storage::Cpu(s) = &*storage else {
                    return Err(candle_core::Error::Msg(
                        "attn::candle runs CPU tensors".into(),
                    ));
                };
                p.unpack(self.variant.spec().dtype, &packed_values(s, layout)?)?
            }
        };
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
            .backward_learned(
                &self.variant,
                &BackwardInputs::Heads(x),
                Learned::new(&named(&learned)),
            )
            .and_then(|g| g.heads())
            .map_err(candle_core::Error::wrap)?;
        let device = Device::Cpu;
        let third = match &self.packing {
            None => candle_of(grads.dv, &device)?,
            Some(_) => {
                // The packed gradient: dv as f32, then each learnable tensor's, in order.
                let mut packed = grads.dv.to_f32_vec();
                for (_, g) in &grads.learned {
                    packed.extend(g.to_f32_vec());
                }
                let n = packed.len();
                Tensor::from_vec(packed, n, &device)?
            }
        };
        Ok((
            Some(candle_of(grads.dq, &device)?),
            Some(candle_of(grads.dk, &device)?),
            Some(third),
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
