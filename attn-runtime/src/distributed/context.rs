//! Context-parallel attention: one self-attention call whose sequence is split over the ranks
//! of a group, each rank holding its part of q, k and v ([`SeqSplit`]), run as Ulysses or as a
//! ring, equal to the single call on the whole sequence.

use std::str::FromStr;

use super::comm::Communicator;
use super::layout::SeqSplit;
use super::ring::Ring;
use super::ulysses::{heads_to_seq, seq_to_heads};
use crate::backend::Backend;
use crate::calls::{HeadGradients, HeadsBackward, Inputs, Output};
use crate::error::RuntimeError;
use crate::learned::{Bound, Learned};
use crate::placement::Placement;
use crate::tensor::Tensor;
use crate::variant::Variant;
use attn_dsl::spec::CausalAlign;
use attn_dsl::{Mask, Position, RopeScaling, SINKS_NAME, Sinks};

/// How a context-parallel call splits the work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// All-to-all over heads: each rank runs the whole sequence for `heads / ranks` heads.
    /// Needs heads and kv_heads divisible by the ranks.
    Ulysses,
    /// Keys and values around a ring; the zigzag split under causal and sliding-window masks,
    /// the contiguous one otherwise.
    Ring,
}

impl Scheme {
    /// How this scheme splits a sequence of `seq` positions of `variant` over `ranks`: which
    /// positions each rank's tensors hold (zigzag for the ring under causal and sliding-window
    /// masks, contiguous otherwise).
    pub fn split(
        self,
        variant: &Variant,
        ranks: usize,
        seq: usize,
    ) -> Result<SeqSplit, RuntimeError> {
        let zigzag = self == Scheme::Ring
            && matches!(
                variant.spec().mask,
                Mask::Causal(_) | Mask::SlidingWindow { .. }
            );
        SeqSplit::new(ranks, seq, zigzag)
    }
}

impl FromStr for Scheme {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ulysses" => Ok(Scheme::Ulysses),
            "ring" => Ok(Scheme::Ring),
            other => Err(format!(
                "unknown context-parallel scheme `{other}`; allowed: ulysses, ring"
            )),
        }
    }
}

/// Attention over a sequence split across the ranks of `comm`, on `backend` (which must run
/// placed calls: the CPU backend). Every rank calls the same methods with its own part:
///
/// ```
/// use attn_runtime::cpu::CpuBackend;
/// use attn_runtime::distributed::{ContextParallel, Scheme, run_ranks};
/// use attn_runtime::{Learned, RuntimeError, Tensor, Variant};
///
/// let variant = Variant::parse("heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope")?;
/// let cpu = CpuBackend::new();
/// // Two ranks as threads (with the `mpi` feature, `MpiComm::init()` under mpirun instead).
/// let outs = run_ranks(2, |comm| {
///     let cp = ContextParallel::new(comm, &cpu, Scheme::Ring);
///     let split = cp.split(&variant, 4096)?; // which positions this rank holds
///     let l = split.local_len();
///     let q = attn_runtime::inputs::tensor(attn_dsl::DType::F32, &[1, 8, l, 64], 1)?;
///     let k = attn_runtime::inputs::tensor(attn_dsl::DType::F32, &[1, 2, l, 64], 2)?;
///     let out = cp.forward(&variant, [&q, &k, &k], 0, Learned::none())?;
///     Ok::<Tensor, RuntimeError>(out.out) // this rank's rows of the whole call
/// });
/// assert!(outs.iter().all(Result::is_ok));
/// # Ok::<(), RuntimeError>(())
/// ```
pub struct ContextParallel<'a> {
    comm: &'a dyn Communicator,
    backend: &'a dyn Backend,
    scheme: Scheme,
}

impl<'a> ContextParallel<'a> {
    /// Context parallelism over `comm`'s ranks.
    pub fn new(
        comm: &'a dyn Communicator,
        backend: &'a dyn Backend,
        scheme: Scheme,
    ) -> ContextParallel<'a> {
        ContextParallel {
            comm,
            backend,
            scheme,
        }
    }

    /// The scheme.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// How this scheme splits a sequence of `seq` positions for `variant`: which positions
    /// each rank's tensors hold.
    pub fn split(&self, variant: &Variant, seq: usize) -> Result<SeqSplit, RuntimeError> {
        self.scheme.split(variant, self.comm.size(), seq)
    }

    /// This rank's part of the attention: q `[B, H, L, D]`, k `[B, KV, L, D]`, v `[B, KV, L,
    /// Dv]` hold the positions [`ContextParallel::split`] gives this rank of a sequence of
    /// `ranks * L` starting at `position_offset`; the result holds the same rows of the whole
    /// call's `out` and `lse` (sinks included). Learnable tensors are whole on every rank, and
    /// so are data tensors: the whole call's (along `seq`, the whole sequence's).
    pub fn forward(
        &self,
        variant: &Variant,
        [q, k, v]: [&Tensor; 3],
        position_offset: i64,
        learned: Learned,
    ) -> Result<Output, RuntimeError> {
        let spec = variant.spec();
        let split = self.check(variant, [q, k, v])?;
        let (b, l) = (q.shape()[0], split.local_len());
        let (h, dv) = (spec.heads as usize, spec.v_head_dim as usize);
        let (out, lse) = match self.scheme {
            Scheme::Ring => self
                .ring(variant, split, position_offset, learned)
                .forward([q, k, v])?,
            Scheme::Ulysses => {
                self.ulysses_forward(variant, [q, k, v], position_offset, learned)?
            }
        };
        let mut out = Tensor::from_f32(&[b, h, l, dv], out)?;
        let mut lse = Tensor::from_f32(&[b, h, l], lse)?;
        if let Some(bound) = sinks(variant, &learned)? {
            bound.apply_sinks(&mut out, &mut lse, h)?;
        }
        if spec.dtype != attn_dsl::DType::F32 {
            out = Tensor::from_f32_as(spec.dtype, &[b, h, l, dv], out.to_f32_vec())?;
        }
        Ok(Output {
            out,
            lse,
            latent: None,
        })
    }

    /// The gradients of [`ContextParallel::forward`] for this rank's `dL/dout` (`x` holds the
    /// rank's q, k, v, out, lse and dout): dq, dk, dv of the rank's parts, and every learnable
    /// tensor's whole gradient (summed over the ranks, the same on each).
    pub fn backward(
        &self,
        variant: &Variant,
        x: &HeadsBackward,
        learned: Learned,
    ) -> Result<HeadGradients, RuntimeError> {
        let mut g = self.backward_shares(variant, x, learned)?;
        self.sum_learned(&mut g.learned)?;
        Ok(g)
    }

    /// [`ContextParallel::backward`] with each learnable tensor's gradient left as this rank's
    /// share, for a caller that sums (or averages) every gradient over the ranks itself, as
    /// data-parallel training does with its weights'.
    pub fn backward_shares(
        &self,
        variant: &Variant,
        x: &HeadsBackward,
        learned: Learned,
    ) -> Result<HeadGradients, RuntimeError> {
        let spec = variant.spec();
        let split = self.check(variant, [x.q, x.k, x.v])?;
        let (b, l) = (x.q.shape()[0], split.local_len());
        let (h, dv) = (spec.heads as usize, spec.v_head_dim as usize);
        for (name, t, want) in [
            ("out", x.out, vec![b, h, l, dv]),
            ("dout", x.dout, vec![b, h, l, dv]),
            ("lse", x.lse, vec![b, h, l]),
        ] {
            if t.shape() != want.as_slice() {
                return Err(RuntimeError::Shape {
                    tensor: name.into(),
                    found: t.shape().to_vec(),
                    expected: format!("{want:?} (this rank's part)"),
                });
            }
        }
        let mut g = match self.scheme {
            Scheme::Ring => {
                let r = self
                    .ring(variant, split, x.position_offset, learned)
                    .backward(x)?;
                let as_dtype = |t: &Tensor, v| Tensor::from_f32_as(spec.dtype, t.shape(), v);
                let learned = r
                    .learned
                    .into_iter()
                    .map(|(name, shape, values)| Ok((name, Tensor::from_f32(&shape, values)?)))
                    .collect::<Result<_, RuntimeError>>()?;
                HeadGradients {
                    dq: as_dtype(x.q, r.dq)?,
                    dk: as_dtype(x.k, r.dk)?,
                    dv: as_dtype(x.v, r.dv)?,
                    learned,
                }
            }
            Scheme::Ulysses => self.ulysses_backward(variant, x, learned)?,
        };
        if let Some(bound) = sinks(variant, &learned)? {
            let d = bound.sink_gradient(x.out, x.lse, x.dout, h)?;
            if let Some(d) = d {
                g.learned
                    .push((format!("d{SINKS_NAME}"), Tensor::from_f32(&[h], d)?));
            }
        }
        Ok(g)
    }

    fn ring<'b>(
        &'b self,
        variant: &'b Variant,
        split: SeqSplit,
        position_offset: i64,
        learned: Learned<'b>,
    ) -> Ring<'b> {
        Ring {
            comm: self.comm,
            backend: self.backend,
            variant,
            split,
            position_offset,
            learned,
        }
    }

    /// Checks the spec and this rank's tensors; returns the split.
    fn check(&self, variant: &Variant, [q, k, v]: [&Tensor; 3]) -> Result<SeqSplit, RuntimeError> {
        let spec = variant.spec();
        let n = self.comm.size();
        let refuse = |why: String| Err(RuntimeError::Spec(why));
        if spec.mla().is_some() {
            return refuse("context parallelism takes per-head specs, not MLA".into());
        }
        if spec.mask == Mask::Causal(CausalAlign::TopLeft) {
            return refuse(
                "context parallelism takes bottom-right causal masks (the same mask for \
                 self-attention), not top-left ones, which read indices within a call"
                    .into(),
            );
        }
        match self.scheme {
            Scheme::Ulysses => {
                let (h, kv) = (spec.heads as usize, spec.kv_heads() as usize);
                if !h.is_multiple_of(n) || !kv.is_multiple_of(n) {
                    return refuse(format!(
                        "Ulysses splits heads over ranks: {h} query heads and {kv} kv heads \
                         over {n} ranks; allowed: both divisible by the ranks (or use the ring)"
                    ));
                }
            }
            Scheme::Ring => {
                if let Position::Rope(r) = &spec.position
                    && matches!(r.scaling, RopeScaling::Dynamic { .. })
                {
                    return refuse(
                        "dynamic NTK scaling picks its base from the whole call's length, \
                         which a ring step does not see; use Ulysses"
                            .into(),
                    );
                }
                if spec.normalize == attn_dsl::Normalize::StickBreaking {
                    return refuse(
                        "stick-breaking weights each key by every nearer one, so the ring's \
                         pieces do not merge by their sums; use Ulysses"
                            .into(),
                    );
                }
            }
        }
        let (h, kv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let [b, _, l, _] = rank4("q", q)?;
        for (name, t, want) in [
            ("q", q, [b, h, l, d]),
            ("k", k, [b, kv, l, d]),
            ("v", v, [b, kv, l, dv]),
        ] {
            if t.shape() != want {
                return Err(RuntimeError::Shape {
                    tensor: name.into(),
                    found: t.shape().to_vec(),
                    expected: format!("{want:?} (this rank's part: q's batch and length)"),
                });
            }
            if t.dtype() != spec.dtype {
                return Err(RuntimeError::DType {
                    tensor: name.into(),
                    found: t.dtype().name().into(),
                    expected: spec.dtype.name().into(),
                });
            }
        }
        let seq = l.checked_mul(n).ok_or_else(|| {
            RuntimeError::Data(format!("{l} positions per rank over {n} ranks overflow"))
        })?;
        self.split(variant, seq)
    }

    fn ulysses_forward(
        &self,
        variant: &Variant,
        [q, k, v]: [&Tensor; 3],
        position_offset: i64,
        learned: Learned,
    ) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
        let spec = variant.spec();
        let (n, me) = (self.comm.size(), self.comm.rank());
        let (h, kv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let [b, _, l, _] = rank4("q", q)?;
        let heads = |t: &Tensor, hh: usize, w: usize| -> Result<Tensor, RuntimeError> {
            let x = seq_to_heads(self.comm, &t.to_f32_vec(), [b, hh, l, w])?;
            Tensor::from_f32_as(spec.dtype, &[b, hh / n, n * l, w], x)
        };
        let (qh, kh, vh) = (heads(q, h, d)?, heads(k, kv, d)?, heads(v, kv, dv)?);
        let part = self.backend.forward_placed(
            variant,
            Inputs::heads(&qh, &kh, &vh),
            position_offset,
            learned,
            Placement::heads(me * (h / n), h / n),
        )?;
        let out = heads_to_seq(self.comm, &part.out.to_f32_vec(), [b, h, l, dv])?;
        let lse = heads_to_seq(self.comm, &part.lse.to_f32_vec(), [b, h, l, 1])?;
        Ok((out, lse))
    }

    fn ulysses_backward(
        &self,
        variant: &Variant,
        x: &HeadsBackward,
        learned: Learned,
    ) -> Result<HeadGradients, RuntimeError> {
        let spec = variant.spec();
        let (n, me) = (self.comm.size(), self.comm.rank());
        let (h, kv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let [b, _, l, _] = rank4("q", x.q)?;
        let heads = |t: &Tensor, hh: usize, w: usize, dtype| -> Result<Tensor, RuntimeError> {
            let y = seq_to_heads(self.comm, &t.to_f32_vec(), [b, hh, l, w])?;
            let shape = [b, hh / n, n * l, w];
            Tensor::from_f32_as(
                dtype,
                if t.shape().len() == 3 {
                    &shape[..3]
                } else {
                    &shape
                },
                y,
            )
        };
        let f32 = attn_dsl::DType::F32;
        let (q, k, v) = (
            heads(x.q, h, d, spec.dtype)?,
            heads(x.k, kv, d, spec.dtype)?,
            heads(x.v, kv, dv, spec.dtype)?,
        );
        let (out, dout) = (heads(x.out, h, dv, f32)?, heads(x.dout, h, dv, f32)?);
        let lse = heads(x.lse, h, 1, f32)?;
        let piece = HeadsBackward {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            lse: &lse,
            dout: &dout,
            position_offset: x.position_offset,
        };
        let placement = Placement::heads(me * (h / n), h / n);
        let g = self
            .backend
            .backward_placed(variant, &piece, learned, placement)?;
        let back =
            |t: &Tensor, hh: usize, w: usize, like: &Tensor| -> Result<Tensor, RuntimeError> {
                let y = heads_to_seq(self.comm, &t.to_f32_vec(), [b, hh, l, w])?;
                Tensor::from_f32_as(spec.dtype, like.shape(), y)
            };
        Ok(HeadGradients {
            dq: back(&g.dq, h, d, x.q)?,
            dk: back(&g.dk, kv, d, x.k)?,
            dv: back(&g.dv, kv, dv, x.v)?,
            learned: g.learned,
        })
    }

    /// Sums each learnable tensor's gradient over the ranks, in one all-reduce.
    fn sum_learned(&self, learned: &mut [(String, Tensor)]) -> Result<(), RuntimeError> {
        let mut all: Vec<f32> = learned.iter().flat_map(|(_, t)| t.to_f32_vec()).collect();
        self.comm.all_reduce_sum(&mut all)?;
        let mut at = 0;
        for (_, t) in learned.iter_mut() {
            let n = t.shape().iter().product::<usize>();
            *t = Tensor::from_f32(t.shape(), all[at..at + n].to_vec())?;
            at += n;
        }
        Ok(())
    }
}

/// The `[B, H, S, D]` dims of a rank-4 tensor.
fn rank4(name: &str, t: &Tensor) -> Result<[usize; 4], RuntimeError> {
    t.shape().try_into().map_err(|_| RuntimeError::Shape {
        tensor: name.into(),
        found: t.shape().to_vec(),
        expected: "[B, heads, L, head_dim]".into(),
    })
}

/// The spec's learned sinks, as a [`Bound`] that adds them (`None` without learned sinks).
fn sinks(variant: &Variant, learned: &Learned) -> Result<Option<Bound>, RuntimeError> {
    let spec = variant.spec();
    if spec.sinks != Sinks::Learned {
        return Ok(None);
    }
    let h = spec.heads as usize;
    let sinks = learned
        .tensor(SINKS_NAME)
        .filter(|t| t.shape() == [h])
        .ok_or_else(|| {
            RuntimeError::Spec(format!(
                "the spec has learned sinks: the call takes `{SINKS_NAME}` of shape [{h}]"
            ))
        })?;
    Ok(Some(Bound {
        sinks: Some(sinks.to_f32_vec()),
        ..Bound::default()
    }))
}
