//! The CPU backend: compiles plans with codegen's Cranelift backend (once per spec per process)
//! and runs them over rayon's thread pool.

mod backward;
mod backward_tiles;
mod backward_units;
pub mod bandwidth;
pub(crate) mod bf16_gemm;
pub mod bf16_tiles;
mod decode;
pub(crate) mod f32_gemm;
pub(crate) mod gemv;
mod launch;
pub mod microkernels;
pub(crate) mod panels;
pub mod row_kernels;
pub mod softmax_tiles;
pub mod spans;
mod stick_tiles;

use crate::backend::Backend;
use crate::backend::{bind_placed, ensure_forward_fits, not_placed_mla, placed_gradients};
use crate::cache::{KvCache, SeqId};
use crate::calls::{
    BackwardInputs, DecodeOptions, Gradients, HeadGradients, HeadsBackward, Inputs, MlaBackward,
    MlaGradients, MlaTensors, Output, Queries,
};
use crate::error::RuntimeError;
use crate::host::checks::{check_placed_backward, check_placed_qkv, ensure_call_fits, per_head};
use crate::host::mla::AbsorbedForward;
use crate::learned::Learned;
use crate::placement::{Piece, Placement};
use crate::tensor::Tensor;
use crate::variant::Variant;
use attn_dsl::Normalize;
use attn_dsl::{AttentionSpec, DType};
use codegen::cpu::abi::Imports;
use codegen::cpu::{CpuKernel, compile};
use codegen::plan::PlanKind;
use launch::{Call, Rows};
use microkernels::Isa;
use std::sync::Arc;

/// Threads the CPU work runs on (rayon's pool: `RAYON_NUM_THREADS`, else one per core).
pub fn threads() -> usize {
    rayon::current_num_threads()
}

/// The CPU backend for one instruction set of microkernels.
#[derive(Clone, Copy, Debug)]
pub struct CpuBackend {
    isa: Isa,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// The backend with the microkernels `ATTN_CPU_ISA` names, else the best this CPU
    /// supports ([`Isa::chosen`]).
    pub fn new() -> Self {
        CpuBackend { isa: Isa::chosen() }
    }

    /// The backend with the given microkernels; `None` if this CPU lacks the instructions.
    pub fn with_isa(isa: Isa) -> Option<Self> {
        isa.runs_here().then_some(CpuBackend { isa })
    }

    /// The microkernels in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The compiled forward kernel of a spec: compiled on first use, then kept by the
    /// process's variant of the spec ([`Variant::shared`]; a new shape never recompiles).
    pub fn forward_kernel(&self, spec: &AttentionSpec) -> Result<Arc<CpuKernel>, RuntimeError> {
        self.kernel(&*Variant::shared(spec)?, PlanKind::Forward)
    }

    /// The compiled kernel of a variant for a plan kind: compiled on first use for this
    /// backend's instruction set, then kept by the variant.
    pub fn kernel(
        &self,
        variant: &Variant,
        kind: PlanKind,
    ) -> Result<Arc<CpuKernel>, RuntimeError> {
        variant.cpu_kernel(kind, self.isa, |variant| {
            let plan = variant.plan(kind)?;
            Ok(compile(
                plan,
                &imports(self.isa, plan, variant.spec().dtype),
            )?)
        })
    }
}

/// The microkernels a plan's kernel calls, with `isa`'s instructions.
fn imports(isa: Isa, plan: &codegen::plan::KernelPlan, dtype: DType) -> Imports {
    let (qk_tile, pv_tile, scores_after_qk) = tile_products(isa, plan);
    let (qk_rows, pv_rows) = row_kernels::addresses(isa, dtype);
    let (exp_tile, ds_tile) = match plan.spec.normalize {
        Normalize::Softmax => softmax_tiles::addresses(isa),
        Normalize::Sigmoid(_) => softmax_tiles::sigmoid_addresses(isa),
        Normalize::StickBreaking => stick_tiles::addresses(isa),
    };
    Imports {
        qk_tile,
        pv_tile,
        qk_rows,
        pv_rows,
        logf: microkernels::logf as *const () as usize,
        exp_tile,
        ds_tile,
        scores_after_qk,
    }
}

/// The `qk_tile` and `pv_tile` a plan's kernel imports: the forward of a bf16 spec takes its
/// `pv_tile` on `vdpbf16ps` where `isa` has it ([`bf16_tiles`]), and its `qk_tile` too where
/// the kernel multiplies the queries and keys as given ([`codegen::cpu::scales_scores`]);
/// everything else the f32 microkernels. The flag: whether the `qk_tile` is the bf16 one, so
/// that the kernel scales the scores after it (`Imports::scores_after_qk`).
fn tile_products(isa: Isa, plan: &codegen::plan::KernelPlan) -> (usize, usize, bool) {
    let (qk, pv) = microkernels::addresses(isa);
    if plan.kind != PlanKind::Forward {
        return (qk, pv, false);
    }
    let bf16_qk = bf16_tiles::qk_address(isa, plan.dtype, plan.shape.qk_dim as usize)
        .filter(|_| codegen::cpu::scales_scores(plan));
    (
        bf16_qk.unwrap_or(qk),
        bf16_tiles::pv_address(isa, plan.dtype).unwrap_or(pv),
        bf16_qk.is_some(),
    )
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn forward_bound(
        &self,
        variant: &Variant,
        inputs: Inputs,
        position_offset: i64,
        params: &[f32],
    ) -> Result<Output, RuntimeError> {
        match inputs {
            Inputs::Heads { q, k, v } => {
                let piece = Piece::whole(variant.spec());
                self.forward_heads(variant, [q, k, v], position_offset, params, piece)
            }
            Inputs::Mla(x) => self.forward_mla(variant, &x, position_offset),
        }
    }

    fn attend_cached_bound(
        &self,
        variant: &Variant,
        queries: Queries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
        params: &[f32],
    ) -> Result<Output, RuntimeError> {
        let call = decode::Cached {
            cache,
            seqs,
            options,
            params,
        };
        match queries {
            Queries::Uniform(q) => self.decode_uniform(variant, q, &call),
            Queries::Ragged { q, offsets } => self.decode_ragged(variant, q, offsets, &call),
            Queries::Mla(queries) => self.decode_mla(variant, queries, &call),
        }
    }

    fn backward_bound(
        &self,
        variant: &Variant,
        x: &BackwardInputs,
        params: &[f32],
    ) -> Result<(Gradients, Vec<f32>), RuntimeError> {
        match x {
            BackwardInputs::Heads(x) => self
                .backward_heads(variant, x, params, Piece::whole(variant.spec()))
                .map(|(g, d)| (Gradients::Heads(g), d)),
            BackwardInputs::Mla(x) => self
                .backward_mla(variant, x)
                .map(|g| (Gradients::Mla(g), Vec::new())),
        }
    }

    fn forward_placed(
        &self,
        variant: &Variant,
        inputs: Inputs,
        position_offset: i64,
        learned: Learned,
        placement: Placement,
    ) -> Result<Output, RuntimeError> {
        let spec = variant.spec();
        let piece = placement.piece(spec)?;
        ensure_forward_fits(variant, &inputs)?;
        let Inputs::Heads { q, k, v } = inputs else {
            return Err(not_placed_mla(self.name()));
        };
        let bound = bind_placed(spec, q, k, position_offset, learned, placement)?;
        self.forward_heads(variant, [q, k, v], position_offset, &bound.params, piece)
    }

    fn backward_placed(
        &self,
        variant: &Variant,
        x: &HeadsBackward,
        learned: Learned,
        placement: Placement,
    ) -> Result<HeadGradients, RuntimeError> {
        let spec = variant.spec();
        let piece = placement.piece(spec)?;
        let tensors = [x.q, x.k, x.v, x.out, x.lse, x.dout];
        ensure_call_fits("this backward call", &tensors, 0, 2)?;
        let bound = bind_placed(spec, x.q, x.k, x.position_offset, learned, placement)?;
        let (gradients, dparams) = self.backward_heads(variant, x, &bound.params, piece)?;
        placed_gradients(spec, &bound, Gradients::Heads(gradients), dparams, x)
    }
}

impl CpuBackend {
    /// A per-head forward: any strides with contiguous rows are read in place; other layouts
    /// and dtypes are converted.
    fn forward_heads(
        &self,
        variant: &Variant,
        [q, k, v]: [&Tensor; 3],
        position_offset: i64,
        params: &[f32],
        piece: Piece,
    ) -> Result<Output, RuntimeError> {
        let spec = variant.spec();
        per_head(spec, q)?;
        let kernel = self.kernel(variant, PlanKind::Forward)?;
        let (h, dv) = (piece.hq, spec.v_head_dim as usize);
        let [b, sq, skv] = check_placed_qkv(spec, &piece, q, k, v)?;
        let call = Call {
            batch: b,
            sq,
            skv,
            position_offset,
            piece,
            params,
        };
        // Queries and keys are read once per block or packing task, values by every block.
        let (q, k, v) = (Rows::by_slab(q), Rows::by_slab(k), Rows::of_values(v)?);
        let (out, lse) = launch::run_as(&kernel, [&q, &k, &v], &call, spec.dtype)?;
        Ok(Output {
            out: Tensor::new(&[b, h, sq, dv], out)?,
            lse: Tensor::from_f32(&[b, h, sq], lse)?,
            latent: None,
        })
    }

    /// A per-head backward (FlashAttention-2 recomputation), f32 accumulation.
    fn backward_heads(
        &self,
        variant: &Variant,
        x: &HeadsBackward,
        params: &[f32],
        piece: Piece,
    ) -> Result<(HeadGradients, Vec<f32>), RuntimeError> {
        let spec = variant.spec();
        let [b, sq, skv] = check_placed_backward(spec, &piece, x)?;
        let kernel = self.kernel(variant, PlanKind::Backward)?;
        let (q, k, v) = (x.q.f32_values(), x.k.f32_values(), x.v.f32_values());
        let (out, lse, dout) = (x.out.f32_values(), x.lse.f32_values(), x.dout.f32_values());
        let problem = backward::Problem {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            lse: &lse,
            dout: &dout,
            bf16_dout_and_v: spec.dtype == DType::Bf16 && x.dout.dtype() == DType::Bf16,
            batch: b,
            sq,
            skv,
            position_offset: x.position_offset,
            piece,
            params,
        };
        let ((dq, dk, dv), dparams) = backward::run(&kernel, self.isa, &problem)?;
        // Converted copies go back to the pool, for the next step's inputs.
        for values in [q, k, v, out, lse, dout] {
            if let std::borrow::Cow::Owned(buffer) = values {
                crate::memory::recycle(buffer);
            }
        }
        let dtype = spec.dtype;
        let gradients = HeadGradients {
            dq: Tensor::from_f32_as(dtype, x.q.shape(), dq)?,
            dk: Tensor::from_f32_as(dtype, x.k.shape(), dk)?,
            dv: Tensor::from_f32_as(dtype, x.v.shape(), dv)?,
            learned: Vec::new(),
        };
        Ok((gradients, dparams))
    }

    /// MLA's backward in the absorbed form: the backward kernel runs over the one shared latent
    /// head (`dL/dout_latent = W_uv^T dout`); the chain rule through the absorption is host
    /// GEMMs.
    fn backward_mla(
        &self,
        variant: &Variant,
        x: &MlaBackward,
    ) -> Result<MlaGradients, RuntimeError> {
        let spec = variant.spec();
        let a = AbsorbedForward::of(spec, &x.x)?;
        let (h, dv) = (spec.heads as usize, spec.v_head_dim as usize);
        let r = spec.mla().map_or(0, |m| m.latent_rank as usize);
        for (name, t, want) in [
            ("latent", x.latent, vec![a.b, h, a.sq, r]),
            ("lse", x.lse, vec![a.b, h, a.sq]),
            ("dout", x.dout, vec![a.b, h, a.sq, dv]),
        ] {
            if t.shape() != want.as_slice() {
                return Err(crate::host::checks::shape(name, t, &format!("{want:?}")));
            }
        }
        let kernel = self.kernel(variant, PlanKind::Backward)?;
        let (out_latent, lse, dout) = (
            x.latent.f32_values(),
            x.lse.f32_values(),
            x.dout.f32_values(),
        );
        let dout_latent = a.latent_dout(&dout);
        let values = a.values();
        let problem = backward::Problem {
            q: &a.q,
            k: &a.k,
            v: &values,
            out: &out_latent,
            lse: &lse,
            dout: &dout_latent,
            bf16_dout_and_v: false,
            batch: a.b,
            sq: a.sq,
            skv: a.skv,
            position_offset: x.position_offset,
            piece: Piece::all(
                kernel.plan.shape.heads as usize,
                kernel.plan.shape.kv_heads as usize,
            ),
            params: &[],
        };
        let ((dq, dk, dvv), _) = backward::run(&kernel, self.isa, &problem)?;
        let g = a.chain(
            [&dq, &dk, &dvv],
            &x.x.q_nope.f32_values(),
            &dout,
            &out_latent,
        );
        let dtype = spec.dtype;
        let as_dtype = |t: &Tensor, values| Tensor::from_f32_as(dtype, t.shape(), values);
        Ok(MlaGradients {
            dq_nope: as_dtype(x.x.q_nope, g.dq_nope)?,
            dq_pe: as_dtype(x.x.q_pe, g.dq_pe)?,
            dc_kv: as_dtype(x.x.c_kv, g.dc_kv)?,
            dk_pe: as_dtype(x.x.k_pe, g.dk_pe)?,
            dw_kv_b: as_dtype(x.x.w_kv_b, g.dw_kv_b)?,
        })
    }

    /// MLA attention in the absorbed form: `q_latent = W_uk^T q_nope` per head, the kernel over
    /// one shared head `[c_kv | k_pe]` with values `c_kv`, then `out = W_uv out_latent`.
    fn forward_mla(
        &self,
        variant: &Variant,
        x: &MlaTensors,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        let spec = variant.spec();
        let a = AbsorbedForward::of(spec, x)?;
        let (latent, lse) = self.absorbed_latent(variant, &a, position_offset)?;
        a.finish(spec, latent, lse)
    }

    /// The forward kernel over MLA's shared latent head: the latent output and the lse.
    fn absorbed_latent(
        &self,
        variant: &Variant,
        a: &AbsorbedForward,
        position_offset: i64,
    ) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
        let kernel = self.kernel(variant, PlanKind::Forward)?;
        let (wq, h, sq, skv) = (a.width(), variant.spec().heads as usize, a.sq, a.skv);
        let call = Call {
            batch: a.b,
            sq,
            skv,
            position_offset,
            piece: Piece::all(
                kernel.plan.shape.heads as usize,
                kernel.plan.shape.kv_heads as usize,
            ),
            params: &[],
        };
        let q_rows = Rows::borrowed(&a.q, [h * sq * wq, sq * wq, wq]);
        // Keys and values share storage: v is the latent part of each key row.
        let k_rows = Rows::borrowed(&a.k, [skv * wq, skv * wq, wq]);
        let v_rows = Rows::borrowed(&a.k, [skv * wq, skv * wq, wq]);
        launch::run(&kernel, &q_rows, &k_rows, &v_rows, &call)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_dsl::reference::{self, Array, Inputs};

    /// A bf16 tensor of `shape` and the exact values it holds.
    fn input(shape: &[usize], seed: usize) -> (Tensor, Array) {
        let n = shape.iter().product();
        let values = (0..n)
            .map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 7) % 2001) as f32)
            .map(|h| h / 1000.0 - 1.0)
            .collect();
        let t = Tensor::from_f32_as(DType::Bf16, shape, values).unwrap();
        let exact = t.to_f32_vec().iter().map(|&x| f64::from(x)).collect();
        (t, Array::from_vec(shape, exact).unwrap())
    }

    /// The bf16 forward that scales its scores after `qk_tile` (`Imports::scores_after_qk`,
    /// taken only with the `vdpbf16ps` products) meets the reference with the f32 tile
    /// products of every instruction set this CPU runs too, so that path is checked on CPUs
    /// without `avx512_bf16`: masks, ALiBi, soft-capping, an explicit scale and GQA.
    #[test]
    fn scores_scaled_after_the_products_meet_the_reference_on_every_isa() {
        for text in [
            "heads = 4, kv_heads = 2, head_dim = 72, mask = causal, dtype = bf16",
            "heads = 2, head_dim = 64, mask = causal, softcap = 2.0, scale = 0.5, dtype = bf16",
            "heads = 3, head_dim = 48, mask = sliding_window(37), position = alibi, dtype = bf16",
        ] {
            let spec: AttentionSpec = text.parse().unwrap();
            let variant = Variant::shared(&spec).unwrap();
            let plan = variant.plan(PlanKind::Forward).unwrap();
            assert!(codegen::cpu::scales_scores(plan), "{text}");
            let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
            let d = spec.head_dim as usize;
            let (sq, skv) = (70, 90);
            let (q, qa) = input(&[1, h, sq, d], 1);
            let (k, ka) = input(&[1, hkv, skv, d], 2);
            let (v, va) = input(&[1, hkv, skv, d], 3);
            let inputs = Inputs {
                q: &qa,
                k: &ka,
                v: &va,
                position_offset: 0,
            };
            let want = reference::attention(&spec, &inputs).unwrap();
            for isa in Isa::ALL.into_iter().filter(|isa| isa.runs_here()) {
                let mut imports = imports(isa, plan, DType::Bf16);
                (imports.qk_tile, imports.pv_tile) = microkernels::addresses(isa);
                imports.scores_after_qk = true;
                let kernel = compile(plan, &imports).unwrap();
                let call = Call {
                    batch: 1,
                    sq,
                    skv,
                    position_offset: 0,
                    piece: Piece::whole(&spec),
                    params: &[],
                };
                let (rows_q, rows_k, rows_v) = (Rows::of(&q), Rows::of(&k), Rows::of(&v));
                let (out, lse) = launch::run(&kernel, &rows_q, &rows_k, &rows_v, &call).unwrap();
                for (i, (got, want)) in out.iter().zip(want.out.data()).enumerate() {
                    let err = (f64::from(*got) - want).abs();
                    assert!(err <= 1e-3, "{text} {isa:?} out[{i}]: {got} against {want}");
                }
                for (i, (got, want)) in lse.iter().zip(want.lse.data()).enumerate() {
                    let err = (f64::from(*got) - want).abs();
                    assert!(err <= 1e-3, "{text} {isa:?} lse[{i}]: {got} against {want}");
                }
            }
        }
    }
}
