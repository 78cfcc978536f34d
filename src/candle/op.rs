//! The candle op: its checks, its forward on attn's CPU kernels, and its backward from the lse
//! the forward kept.

use super::convert::{candle_dtype, to_attn, to_candle};
use crate::distributed::ContextParallel;
use crate::runtime::Tensor as AttnTensor;
use crate::runtime::learned::{DataBuf, DataVec, data_views};
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

/// Data tensors by name, with their values.
type OwnedData = Vec<(String, DataBuf)>;

/// A call's checked data tensors: the i32 ones' values, and the f32 ones by name.
pub(super) type CheckedData<'t> = (OwnedData, Vec<(String, &'t Tensor)>);

/// A call's data tensors checked against the spec (each declared one given once, none other,
/// on the CPU; i32 ones as I32, U32 or I64 tensors whose values fit i32, f32 ones as F32): the
/// i32 ones' values, and the f32 ones in declaration order (they travel in the third input and
/// get gradients).
pub(super) fn check_data<'t>(
    variant: &Variant,
    data: &[(&str, &'t Tensor)],
) -> candle_core::Result<CheckedData<'t>> {
    let spec = variant.spec();
    let refuse = |what: String| {
        candle_core::Error::Msg(format!("attn::candle: {what} (spec `{}`)", variant.text()))
    };
    if let Some((name, _)) = data.iter().find(|(n, _)| spec.data_decl(n).is_none()) {
        return Err(refuse(format!(
            "`{name}` is not a data tensor of this spec"
        )));
    }
    let (mut fixed, mut floats) = (Vec::new(), Vec::new());
    for decl in &spec.data {
        let mut given = data.iter().filter(|(n, _)| *n == decl.name);
        let (Some((_, t)), None) = (given.next(), given.next()) else {
            return Err(refuse(format!(
                "data tensor `{}` must be given once",
                decl.name
            )));
        };
        if !t.device().is_cpu() {
            return Err(refuse(format!("`{}` is not on the CPU", decl.name)));
        }
        use candle_core::DType as C;
        match (decl.dtype, t.dtype()) {
            (attn_dsl::DataType::F32, C::F32) => floats.push((decl.name.clone(), *t)),
            (attn_dsl::DataType::I32, C::I32 | C::U32 | C::I64) => {
                let wide = t.to_dtype(C::I64)?.flatten_all()?.to_vec1::<i64>()?;
                let values = wide
                    .iter()
                    .map(|x| i32::try_from(*x))
                    .collect::<Result<Vec<i32>, _>>()
                    .map_err(|_| refuse(format!("`{}` holds a value outside i32", decl.name)))?;
                let shape = t.dims().to_vec();
                let values = DataVec::I32(values);
                fixed.push((decl.name.clone(), DataBuf { shape, values }));
            }
            (want, found) => {
                return Err(refuse(format!(
                    "data tensor `{}` is {found:?}; the spec declares it {}",
                    decl.name,
                    want.name()
                )));
            }
        }
    }
    Ok((fixed, floats))
}

/// How v and the learnable tensors travel as the op's third input: candle's custom ops take
/// three tensors, so with learnable tensors the third is one f32 vector, v's elements (in its
/// logical order, as f32) followed by each learnable tensor's. candle's `cat` makes it and its
/// backward splits the gradient back.
pub(super) struct Packing {
    /// v's shape, `[B, kv_heads, Skv, v_head_dim]`.
    pub v_dims: Vec<usize>,
    /// Each learnable tensor's name and shape, in the spec's order, then each f32 data
    /// tensor's.
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

/// The op's data tensors for a call: its i32 ones, and the f32 ones among `packed` (the
/// tensors the third input carried); the rest of `packed` are the learnable tensors.
fn split_data<'a>(
    variant: &Variant,
    fixed: &'a [(String, DataBuf)],
    packed: &'a [(String, AttnTensor)],
) -> (Vec<(&'a str, &'a AttnTensor)>, OwnedData) {
    let spec = variant.spec();
    let mut learned = Vec::new();
    let mut data: Vec<(String, DataBuf)> = fixed.to_vec();
    for (name, t) in packed {
        if spec.data_decl(name).is_some() {
            data.push((
                name.clone(),
                DataBuf {
                    shape: t.shape().to_vec(),
                    values: DataVec::F32(t.to_f32_vec()),
                },
            ));
        } else {
            learned.push((name.as_str(), t));
        }
    }
    (learned, data)
}

/// Attention as a candle op over (q, k, v), or (q, k, packed v and learnable tensors).
pub(super) struct AttentionOp {
    variant: Arc<Variant>,
    position_offset: i64,
    saved: Arc<Saved>,
    packing: Option<Packing>,
    /// The call's i32 data tensors (f32 ones travel in the packed third input).
    data: Vec<(String, DataBuf)>,
    /// The ranks this call's sequence is split over, when it is one rank's part.
    context: Option<super::Context>,
}

impl AttentionOp {
    pub(super) fn new(variant: &Arc<Variant>, position_offset: i64) -> Self {
        AttentionOp {
            variant: Arc::clone(variant),
            position_offset,
            saved: Arc::default(),
            packing: None,
            data: Vec::new(),
            context: None,
        }
    }

    /// The op as one rank's part of a context-parallel call.
    pub(super) fn in_context(self, context: &super::Context) -> Self {
        AttentionOp {
            context: Some(context.clone()),
            ..self
        }
    }

    /// The op over a packed third input, with the call's i32 data tensors.
    pub(super) fn packed(
        variant: &Arc<Variant>,
        position_offset: i64,
        packing: Packing,
        data: Vec<(String, DataBuf)>,
    ) -> Self {
        AttentionOp {
            packing: Some(packing),
            data,
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
        let (learned, data) = split_data(&self.variant, &self.data, &learned);
        let data = data_views(&data);
        let learned = Learned::new(&learned).with_data(&data);
        let cpu = CpuBackend::new();
        let output = match &self.context {
            None => cpu.forward_learned(
                &self.variant,
                Inputs::heads(&q, &k, &v),
                self.position_offset,
                learned,
            ),
            Some(c) => ContextParallel::new(c.comm.as_ref(), &cpu, c.scheme).forward(
                &self.variant,
                [&q, &k, &v],
                self.position_offset,
                learned,
            ),
        }
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
        let (plain, data) = split_data(&self.variant, &self.data, &learned);
        let data = data_views(&data);
        let learned_call = Learned::new(&plain).with_data(&data);
        let cpu = CpuBackend::new();
        let grads = match &self.context {
            None => cpu
                .backward_learned(&self.variant, &BackwardInputs::Heads(x), learned_call)
                .and_then(|g| g.heads()),
            // Each rank's share of the learnable tensors' gradients: the caller's reduction
            // over the ranks (as of every weight's gradient) sums them.
            Some(c) => ContextParallel::new(c.comm.as_ref(), &cpu, c.scheme).backward_shares(
                &self.variant,
                &x,
                learned_call,
            ),
        }
        .map_err(candle_core::Error::wrap)?;
        let device = Device::Cpu;
        let third = match &self.packing {
            None => candle_of(grads.dv, &device)?,
            Some(_) => {
                // The packed gradient: dv as f32, then each packed tensor's, in the packing's
                // order.
                let mut packed = grads.dv.to_f32_vec();
                for (name, _) in &learned {
                    let d = format!("d{name}");
                    let g = grads.learned.iter().find(|(n, _)| *n == d).ok_or_else(|| {
                        candle_core::Error::Msg(format!("attn::candle: no gradient `{d}`"))
                    })?;
                    packed.extend(g.1.to_f32_vec());
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
