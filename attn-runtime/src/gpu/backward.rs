//! The backward pass on the GPU kernels (`codegen::gpu::kernels::backward_tc` on tensor cores for bf16
//! and f16 specs it supports, `codegen::gpu::kernels::backward` SIMT otherwise): a call prepared on the
//! host (inputs in the kernels' formats, tile codes, RoPE tables as the forward builds them),
//! then the delta, dq and dk/dv kernels in that order, on a device ([`BackwardCall::run_on`]).

use super::CallTables;
use super::device_bytes;
use crate::calls::{HeadGradients, HeadsBackward};
use crate::device::{Device, DeviceBuffer, Scratch, f32s, launch};
use crate::error::RuntimeError;
use crate::host::checks::check_backward;
use crate::tensor::Tensor;
use crate::variant::Variant;
use attn_dsl::DType;
use codegen::gpu::BackwardKernels;
use codegen::gpu::ir::Kernel;
use codegen::gpu::launch::{BackwardArgs, BackwardTcArgs};
use std::sync::Arc;

/// Device addresses of a call's buffers, in the order the launch records take them.
pub(crate) struct Buffers {
    /// q, k, v, out, lse, dout.
    pub inputs: [i64; 6],
    /// delta (one f32 per query row), dq, dk, dv.
    pub outputs: [i64; 4],
    /// The dq and dk/dv tile codes (tensor cores only; 0 otherwise).
    pub codes: [i64; 2],
    /// RoPE tables: cosines and sines of the queries, then of the keys.
    pub rope: [i64; 4],
    /// The parameters, their gradients' per-thread partial sums and their gradients (0 each
    /// without parameters).
    pub params: [i64; 3],
    /// Stick-breaking's row state at each block of keys (0 for other specs).
    pub stick_state: i64,
}

/// A backward call ready to launch: its kernels and grids, its inputs as the bytes the kernels
/// read (q, k, v, out, lse, dout), its tile codes and its RoPE tables.
pub(crate) struct BackwardCall {
    pub kernels: Arc<BackwardKernels>,
    /// One per kernel, in launch order.
    pub grids: Vec<[u32; 3]>,
    /// On tensor cores q, k, v and dout in the spec's 16-bit format, out and lse f32; SIMT:
    /// all f32.
    pub inputs: [Vec<u8>; 6],
    /// Tensor cores: the dq and dk/dv kernels' tile codes as i32 bytes (empty for SIMT).
    pub codes: [Vec<u8>; 2],
    /// The RoPE tables of the call's positions.
    pub rope: CallTables,
    /// `[batch, Sq, Skv]`.
    pub dims: [usize; 3],
    pub p0: i64,
    /// The shapes of dq, dk and dv, and their dtype.
    pub shapes: [Vec<usize>; 3],
    pub dtype: DType,
    /// The spec's parameters (laid out as `codegen::plan::ParamLayout`; empty without).
    pub params: Vec<f32>,
    /// Copies of the parameters' gradients the dq kernel's threads keep
    /// (`codegen::gpu::kernels::backward::param_copies`; 0 without parameters).
    pub param_copies: usize,
    /// Floats of stick-breaking's row state (`stick_state`; 0 for other specs).
    pub stick_state_len: usize,
}

/// A prepared backward call, or the gradients of one with nothing to compute.
pub(crate) enum Prepared {
    /// Kernels to launch.
    Launch(Box<BackwardCall>),
    /// No query or no key: the gradients are zeros.
    Empty(Box<HeadGradients>),
}

fn i32_bytes(codes: &[i32]) -> Vec<u8> {
    codes.iter().flat_map(|c| c.to_le_bytes()).collect()
}

impl BackwardCall {
    /// Checks a backward call's tensors and parameters (laid out as
    /// `codegen::plan::ParamLayout`) and prepares it.
    pub fn prepare(
        variant: &Variant,
        x: &HeadsBackward,
        params: &[f32],
    ) -> Result<Prepared, RuntimeError> {
        let spec = variant.spec();
        let [b, sq, skv] = check_backward(spec, x)?;
        codegen::plan::ParamLayout::of(spec)
            .check_buffer(params)
            .map_err(RuntimeError::Data)?;
        let p0 = x.position_offset;
        attn_dsl::reference::check_positions(sq, skv, p0)
            .map_err(|e| RuntimeError::Data(e.to_string()))?;
        let shapes = [x.q, x.k, x.v].map(|t| t.shape().to_vec());
        if b * sq == 0 || skv == 0 {
            let zeros = |shape: &[usize]| {
                Tensor::from_f32_as(spec.dtype, shape, vec![0.0; shape.iter().product()])
            };
            return Ok(Prepared::Empty(Box::new(HeadGradients {
                learned: Vec::new(),
                dq: zeros(&shapes[0])?,
                dk: zeros(&shapes[1])?,
                dv: zeros(&shapes[2])?,
            })));
        }
        let plan = variant.backward_plan()?;
        let stick_state_len = stick_state_len(plan, x.q.shape()[1], [b, sq, skv])?;
        let param_copies =
            codegen::gpu::kernels::backward::param_copies(plan, [b, sq, skv], params.len());
        let first_pos = p0 + (skv as i64 - sq as i64).min(0);
        let total_len = (skv as i64 + p0).max(0) as u64;
        let rope = CallTables::of(plan, (first_pos, p0 + skv as i64), total_len)?;
        // Inputs the tensor cores' f16 `Q K^T` operands cannot hold run on the SIMT kernels, as
        // in the forward.
        let kernels =
            super::backward_kernels(variant, super::qk_wide(variant.forward_plan(), x.q, x.k))?;
        let dims = [b, sq, skv];
        let (inputs, codes) = if kernels.tensor_cores {
            let half = |t: &Tensor| device_bytes(t, spec.dtype);
            let single = |t: &Tensor| device_bytes(t, DType::F32);
            let [dq, dkdv] = codegen::gpu::kernels::backward_tc::tile_codes(plan, dims, p0);
            (
                [
                    half(x.q),
                    half(x.k),
                    half(x.v),
                    single(x.out),
                    single(x.lse),
                    half(x.dout),
                ],
                [i32_bytes(&dq), i32_bytes(&dkdv)],
            )
        } else {
            let single = |t: &Tensor| device_bytes(t, DType::F32);
            (
                [x.q, x.k, x.v, x.out, x.lse, x.dout].map(single),
                [Vec::new(), Vec::new()],
            )
        };
        Ok(Prepared::Launch(Box::new(BackwardCall {
            grids: kernels.grids(plan, dims, params.len()),
            kernels,
            inputs,
            codes,
            rope,
            dims,
            p0,
            shapes,
            dtype: spec.dtype,
            params: params.to_vec(),
            param_copies,
            stick_state_len,
        })))
    }

    /// Values in dq, dk and dv.
    pub fn output_lens(&self) -> [usize; 3] {
        [0, 1, 2].map(|i| self.shapes[i].iter().product())
    }

    /// Launches one of the call's kernels over `grid` CTAs, its record over the buffers `at`.
    fn launch_kernel(
        &self,
        device: &dyn Device,
        kernel: &Arc<Kernel>,
        grid: [u32; 3],
        at: &Buffers,
    ) -> Result<(), RuntimeError> {
        let [q, k, v, out, lse, dout] = at.inputs;
        let [delta, dq, dk, dv] = at.outputs;
        let [b, sq, skv] = self.dims.map(|n| n as i64);
        let [rope_cos, rope_sin, rope_key_cos, rope_key_sin] = at.rope;
        if self.kernels.tensor_cores {
            let [dq_codes, dkdv_codes] = at.codes;
            launch(
                device,
                kernel,
                grid,
                &BackwardTcArgs {
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
                    dq_codes,
                    dkdv_codes,
                    batch: b,
                    sq,
                    skv,
                    p0: self.p0,
                    rope_cos,
                    rope_sin,
                    rope_key_cos,
                    rope_key_sin,
                    rope_pos0: self.rope.pos0,
                },
                &[],
            )
        } else {
            launch(
                device,
                kernel,
                grid,
                &BackwardArgs {
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
                    batch: b,
                    sq,
                    skv,
                    p0: self.p0,
                    rope_cos,
                    rope_sin,
                    rope_key_cos,
                    rope_key_sin,
                    rope_pos0: self.rope.pos0,
                    params: at.params[0],
                    param_partials: at.params[1],
                    param_copies: self.param_copies as i64,
                    dparams: at.params[2],
                    param_len: self.params.len() as i64,
                    stick_state: at.stick_state,
                },
                &[],
            )
        }
    }

    /// Query rows of the call (one `delta` each).
    pub fn rows(&self) -> usize {
        self.dims[0] * self.shapes[0][1] * self.dims[1]
    }

    /// The gradients from their f32 values.
    pub fn finish(&self, [dq, dk, dv]: [Vec<f32>; 3]) -> Result<HeadGradients, RuntimeError> {
        Ok(HeadGradients {
            learned: Vec::new(),
            dq: Tensor::from_f32_as(self.dtype, &self.shapes[0], dq)?,
            dk: Tensor::from_f32_as(self.dtype, &self.shapes[1], dk)?,
            dv: Tensor::from_f32_as(self.dtype, &self.shapes[2], dv)?,
        })
    }

    /// Floats in the parameters' partial sums.
    pub fn partials_len(&self) -> usize {
        self.param_copies * self.params.len()
    }

    /// The call's inputs uploaded to `s`'s device (0 for an empty one), and zeroed outputs.
    pub fn upload(&self, s: &mut Scratch) -> Result<Buffers, RuntimeError> {
        let table = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let mut inputs = [0; 6];
        for (at, bytes) in inputs.iter_mut().zip(&self.inputs) {
            *at = s.upload_or_null(bytes)?;
        }
        let lens = self.output_lens();
        let mut outputs = [0; 4];
        for (at, n) in outputs
            .iter_mut()
            .zip([self.rows(), lens[0], lens[1], lens[2]])
        {
            *at = s.f32s_or_null(n)?;
        }
        Ok(Buffers {
            inputs,
            outputs,
            codes: [
                s.upload_or_null(&self.codes[0])?,
                s.upload_or_null(&self.codes[1])?,
            ],
            rope: self.rope.upload(s)?,
            params: [
                s.upload_or_null(&table(&self.params))?,
                s.f32s_or_null(self.partials_len())?,
                s.f32s_or_null(self.params.len())?,
            ],
            stick_state: s.f32s_or_null(self.stick_state_len)?,
        })
    }

    /// Queues the call's kernels (delta, dq, dk with dv, then any parameters' sum) over `at`.
    pub fn launch(&self, device: &dyn Device, at: &Buffers) -> Result<(), RuntimeError> {
        for (kernel, &grid) in self.kernels.kernels.iter().zip(&self.grids) {
            self.launch_kernel(device, kernel, grid, at)?;
        }
        Ok(())
    }

    /// Runs the call on `device`: the gradients and the parameters' gradients.
    pub fn run_on(&self, device: &dyn Device) -> Result<(HeadGradients, Vec<f32>), RuntimeError> {
        let mut s = Scratch::new(device);
        let at = self.upload(&mut s)?;
        self.launch(device, &at)?;
        let read = |addr: i64, n: usize| -> Result<Vec<f32>, RuntimeError> {
            if n == 0 {
                return Ok(Vec::new());
            }
            Ok(f32s(&device.download(DeviceBuffer { addr, bytes: 4 * n })?))
        };
        let lens = self.output_lens();
        let [dq, dk, dv] = [0, 1, 2].map(|i| read(at.outputs[i + 1], lens[i]));
        let dparams = read(at.params[2], self.params.len())?;
        Ok((self.finish([dq?, dk?, dv?])?, dparams))
    }
}

/// Bytes stick-breaking's row state may take in one backward call.
const STICK_STATE_BYTES: usize = 1 << 32;

/// Floats of the row state a stick-breaking backward of `[batch, Sq, Skv]` over `heads` query
/// heads keeps (two per query row and block of 64 keys; 0 for other specs), or an error past
/// [`STICK_STATE_BYTES`].
fn stick_state_len(
    plan: &codegen::plan::KernelPlan,
    heads: usize,
    [b, sq, skv]: [usize; 3],
) -> Result<usize, RuntimeError> {
    if !plan.stick_breaking() {
        return Ok(0);
    }
    let blocks = skv.div_ceil(codegen::gpu::kernels::backward::ROWS as usize);
    [b, heads, sq, blocks, 2]
        .into_iter()
        .try_fold(1usize, usize::checked_mul)
        .filter(|&n| n.saturating_mul(4) <= STICK_STATE_BYTES)
        .ok_or_else(|| {
            RuntimeError::Data(format!(
                "a stick-breaking backward of {b} x {heads} heads x {sq} queries x {skv} keys \
                 keeps two floats per query and block of 64 keys, past {} GiB on the device; \
                 split the call (fewer sequences or heads at a time)",
                STICK_STATE_BYTES >> 30
            ))
        })
}

/// A per-head backward on the GPU backward kernels, run on `device`: the gradients and the
/// parameters' gradients.
pub(crate) fn run_on(
    device: &dyn Device,
    variant: &Variant,
    x: &HeadsBackward,
    params: &[f32],
) -> Result<(HeadGradients, Vec<f32>), RuntimeError> {
    match BackwardCall::prepare(variant, x, params)? {
        Prepared::Launch(call) => call.run_on(device),
        Prepared::Empty(zeros) => Ok((*zeros, vec![0.0; params.len()])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;

    #[test]
    fn stick_breakings_row_state_is_sized_and_bounded() {
        let stick = Variant::parse("heads = 4, head_dim = 16, normalize = stick_breaking").unwrap();
        let plan = stick.backward_plan().unwrap();
        // Two floats per query row and block of 64 keys (130 keys: three blocks).
        assert_eq!(
            stick_state_len(plan, 4, [2, 10, 130]).unwrap(),
            2 * 4 * 10 * 3 * 2
        );
        let err = stick_state_len(plan, 64, [1, 1 << 20, 1 << 20]).unwrap_err();
        assert!(err.to_string().contains("split the call"), "{err}");
        let huge = stick_state_len(plan, usize::MAX, [usize::MAX, 2, 1 << 20]).unwrap_err();
        assert!(
            huge.to_string().contains("stick-breaking backward"),
            "{huge}"
        );
        let softmax = Variant::parse("heads = 4, head_dim = 16").unwrap();
        let plan = softmax.backward_plan().unwrap();
        assert_eq!(stick_state_len(plan, 4, [1, 1 << 20, 1 << 20]).unwrap(), 0);
    }

    #[test]
    fn inputs_past_f16_run_on_the_simt_kernels() {
        let text = "heads = 2, head_dim = 16, position = rope, dtype = bf16";
        let variant = Variant::parse(text).unwrap();
        let t = |shape: &[usize], value: f32| {
            Tensor::from_f32_as(DType::Bf16, shape, vec![value; shape.iter().product()]).unwrap()
        };
        let small = t(&[1, 2, 3, 16], 0.5);
        let lse = Tensor::from_f32(&[1, 2, 3], vec![0.0; 6]).unwrap();
        for (q_value, tensor_cores) in [(0.5, true), (40000.0, false)] {
            let q = t(&[1, 2, 3, 16], q_value);
            let x = HeadsBackward {
                q: &q,
                k: &small,
                v: &small,
                out: &small,
                lse: &lse,
                dout: &small,
                position_offset: 0,
            };
            let Prepared::Launch(call) = BackwardCall::prepare(&variant, &x, &[]).unwrap() else {
                panic!("a call with queries and keys launches");
            };
            assert_eq!(call.kernels.tensor_cores, tensor_cores, "q = {q_value}");
        }
    }

    #[test]
    fn one_cta_striding_over_every_block_sums_the_same_parameter_gradients() {
        let text = "heads = 3, head_dim = 8, mask = causal, params(rel: [heads, 4]), \
                    score_mod = |s, b, h, q, k| s + rel[h, max(min(q - k, 3), 0)]";
        let variant = Variant::parse(text).unwrap();
        let t = |shape: &[usize], seed: usize| {
            let n: usize = shape.iter().product();
            let values = (0..n).map(|i| ((i * 7 + seed * 13) % 17) as f32 / 17.0 - 0.5);
            Tensor::from_f32(shape, values.collect()).unwrap()
        };
        let (q, k, v, dout) = (
            t(&[2, 3, 70, 8], 1),
            t(&[2, 3, 70, 8], 2),
            t(&[2, 3, 70, 8], 3),
            t(&[2, 3, 70, 8], 4),
        );
        let params: Vec<f32> = (0..12).map(|i| i as f32 / 10.0 - 0.6).collect();
        let forward = crate::gpu::sim::GpuSim::new()
            .forward_bound(&variant, crate::Inputs::heads(&q, &k, &v), 0, &params)
            .unwrap();
        let x = HeadsBackward {
            q: &q,
            k: &k,
            v: &v,
            out: &forward.out,
            lse: &forward.lse,
            dout: &dout,
            position_offset: 0,
        };
        let Prepared::Launch(mut call) = BackwardCall::prepare(&variant, &x, &params).unwrap()
        else {
            panic!("a call with queries and keys launches");
        };
        // Twelve blocks of query rows (2 batches x 3 heads x 2), one CTA each.
        assert_eq!(call.param_copies, 12 * 64);
        let (spread, spread_dparams) = call.run_on(&crate::device::SimDevice::new()).unwrap();
        // One CTA walks all twelve blocks into one set of 64 copies.
        call.param_copies = 64;
        call.grids[1] = [1, 1, 1];
        let (strided, strided_dparams) = call.run_on(&crate::device::SimDevice::new()).unwrap();
        assert_eq!(spread.dq.to_f32_vec(), strided.dq.to_f32_vec());
        assert!(spread_dparams.iter().any(|x| *x != 0.0));
        for (a, b) in spread_dparams.iter().zip(&strided_dparams) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
        }
    }
}
