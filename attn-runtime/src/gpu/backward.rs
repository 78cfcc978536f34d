//! The backward pass on the GPU kernels (`codegen::gpu::backward`): a call prepared on the host
//! (inputs as contiguous f32, RoPE tables as the forward builds them), then `backward_delta`,
//! `backward_dq` and `backward_dkdv` in that order, on the GPU IR interpreter
//! ([`BackwardCall::run_emulated`]) or on a CUDA device (`CudaBackend::backward`).

use crate::backend::{BackwardInputs, Gradients};
use crate::error::RuntimeError;
use crate::host::checks::check_backward;
use crate::host::rope_table::RopeTables;
use crate::tensor::Tensor;
use crate::variant::{KernelKey, Variant};
use attn_dsl::DType;
use codegen::gpu::backward::grids;
use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::ir::Kernel;
use codegen::gpu::launch::{BackwardArgs, bind};
use codegen::plan::PlanKind;
use std::sync::Arc;

/// The backward kernels of a variant (delta, dq, dk and dv), lowered once per variant.
fn lowered_backward(variant: &Variant) -> Result<Arc<[Arc<Kernel>; 3]>, RuntimeError> {
    let key = KernelKey {
        backend: "gpu",
        kind: PlanKind::Backward,
        detail: "simt",
    };
    variant.kernel(key, |v| {
        Ok(codegen::gpu::backward_kernels(v.backward_plan()?)?.map(Arc::new))
    })
}

/// A backward call ready to launch: its kernels and grids, its inputs as f32 on the host (q, k,
/// v, out, lse, dout, in [`BackwardArgs`] order), and its RoPE tables.
pub(crate) struct BackwardCall {
    pub kernels: Arc<[Arc<Kernel>; 3]>,
    pub grids: [[u32; 3]; 3],
    pub inputs: [Vec<f32>; 6],
    pub rope_cos: Vec<f32>,
    pub rope_sin: Vec<f32>,
    pub rope_pos0: i64,
    /// `[batch, Sq, Skv]`.
    pub dims: [usize; 3],
    pub p0: i64,
    /// The shapes of dq, dk and dv, and their dtype.
    pub shapes: [Vec<usize>; 3],
    pub dtype: DType,
}

/// A prepared backward call, or the gradients of one with nothing to compute.
pub(crate) enum Prepared {
    /// Kernels to launch.
    Launch(Box<BackwardCall>),
    /// No query or no key: the gradients are zeros.
    Empty(Gradients),
}

impl BackwardCall {
    /// Checks a backward call's tensors and prepares it.
    pub fn prepare(variant: &Variant, x: &BackwardInputs) -> Result<Prepared, RuntimeError> {
        let spec = variant.spec();
        let [b, sq, skv] = check_backward(spec, x)?;
        let p0 = x.position_offset;
        attn_dsl::reference::check_positions(sq, skv, p0)
            .map_err(|e| RuntimeError::Data(e.to_string()))?;
        let shapes = [x.q, x.k, x.v].map(|t| t.shape().to_vec());
        if b * sq == 0 || skv == 0 {
            let zeros = |shape: &[usize]| {
                Tensor::from_f32_as(spec.dtype, shape, vec![0.0; shape.iter().product()])
            };
            return Ok(Prepared::Empty(Gradients {
                dq: zeros(&shapes[0])?,
                dk: zeros(&shapes[1])?,
                dv: zeros(&shapes[2])?,
            }));
        }
        let plan = variant.backward_plan()?;
        let first_pos = p0 + (skv as i64 - sq as i64).min(0);
        let total_len = (skv as i64 + p0).max(0) as u64;
        let (rope_cos, rope_sin, rope_pos0) = match &plan.rope {
            Some(r) => {
                let t = RopeTables::new(r, first_pos, p0 + skv as i64, total_len);
                (t.cos, t.sin, t.pos0)
            }
            None => (Vec::new(), Vec::new(), 0),
        };
        Ok(Prepared::Launch(Box::new(BackwardCall {
            kernels: lowered_backward(variant)?,
            grids: grids(plan, [b, sq, skv]),
            inputs: [x.q, x.k, x.v, x.out, x.lse, x.dout].map(|t| t.to_f32_vec()),
            rope_cos,
            rope_sin,
            rope_pos0,
            dims: [b, sq, skv],
            p0,
            shapes,
            dtype: spec.dtype,
        })))
    }

    /// Values in dq, dk and dv.
    pub fn output_lens(&self) -> [usize; 3] {
        [0, 1, 2].map(|i| self.shapes[i].iter().product())
    }

    /// The launch record for buffers at these addresses: the six inputs, `delta` (one f32 per
    /// query row), dq, dk, dv, and the RoPE tables.
    pub fn record(
        &self,
        [q, k, v, out, lse, dout]: [i64; 6],
        outputs: [i64; 4],
        rope: [i64; 2],
    ) -> BackwardArgs {
        let [delta, dq, dk, dv] = outputs;
        let [b, sq, skv] = self.dims;
        BackwardArgs {
            q,
            k,
            v,
            out,
            lse,
            dout,
            delta,
            dq,
            dk,
            dv,
            batch: b as i64,
            sq: sq as i64,
            skv: skv as i64,
            p0: self.p0,
            rope_cos: rope[0],
            rope_sin: rope[1],
            rope_pos0: self.rope_pos0,
        }
    }

    /// The gradients from their f32 values.
    pub fn finish(&self, [dq, dk, dv]: [Vec<f32>; 3]) -> Result<Gradients, RuntimeError> {
        Ok(Gradients {
            dq: Tensor::from_f32_as(self.dtype, &self.shapes[0], dq)?,
            dk: Tensor::from_f32_as(self.dtype, &self.shapes[1], dk)?,
            dv: Tensor::from_f32_as(self.dtype, &self.shapes[2], dv)?,
        })
    }

    /// Runs the call on the GPU IR interpreter.
    pub fn run_emulated(&self) -> Result<Gradients, RuntimeError> {
        let mut mem = Memory::default();
        let inputs = [0, 1, 2, 3, 4, 5].map(|i| mem.alloc_f32(&self.inputs[i]));
        let lens = self.output_lens();
        let rows = self.inputs[4].len();
        let outputs = [rows, lens[0], lens[1], lens[2]].map(|n| mem.alloc_f32(&vec![0.0; n]));
        let table = |mem: &mut Memory, v: &[f32]| if v.is_empty() { 0 } else { mem.alloc_f32(v) };
        let rope = [
            table(&mut mem, &self.rope_cos),
            table(&mut mem, &self.rope_sin),
        ];
        let record = self.record(inputs, outputs, rope);
        for (kernel, grid) in self.kernels.iter().zip(self.grids) {
            let args: Vec<Val> = bind(kernel, &record)
                .map_err(RuntimeError::Data)?
                .into_iter()
                .map(Val::I64)
                .collect();
            run(kernel, grid, &args, &mut mem).map_err(RuntimeError::Data)?;
        }
        let read = |i: usize| {
            mem.read_f32(outputs[i + 1], lens[i])
                .map_err(RuntimeError::Data)
        };
        self.finish([read(0)?, read(1)?, read(2)?])
    }
}

/// `CpuBackend::backward`'s call on the GPU backward kernels, run on the interpreter.
pub(crate) fn backward_emulated(
    variant: &Variant,
    x: &BackwardInputs,
) -> Result<Gradients, RuntimeError> {
    match BackwardCall::prepare(variant, x)? {
        Prepared::Launch(call) => call.run_emulated(),
        Prepared::Empty(zeros) => Ok(zeros),
    }
}
