//! The backward on the device: inputs uploaded, the delta, dq and dk/dv kernels launched, the
//! gradients read back.

use super::{CudaBackend, device};
use crate::calls::{HeadGradients, HeadsBackward};
use crate::error::RuntimeError;
use crate::gpu::backward::{BackwardCall, Prepared};
use crate::variant::Variant;
use codegen::gpu::ir::target::dynamic_shared_bytes;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

impl CudaBackend {
    /// Gradients through the GPU backward kernels (delta, dq, dk and dv: on tensor cores for
    /// the bf16 and f16 specs `codegen::gpu::kernels::backward_tc` supports, else SIMT): inputs uploaded,
    /// three launches, gradients downloaded.
    pub(super) fn backward_heads(
        &self,
        variant: &Variant,
        x: &HeadsBackward,
        params: &[f32],
    ) -> Result<(HeadGradients, Vec<f32>), RuntimeError> {
        let call = match BackwardCall::prepare(variant, x, params)? {
            Prepared::Launch(call) => call,
            Prepared::Empty(zeros) => return Ok((*zeros, vec![0.0; params.len()])),
        };
        let mut buffers = self.upload_backward(&call)?;
        self.launch_backward(&call, &mut buffers)?;
        let s = &self.stream;
        let mut grads = Vec::with_capacity(3);
        for (buffer, n) in buffers.outputs[1..].iter().zip(call.output_lens()) {
            let mut values = s.clone_dtoh(buffer).map_err(device)?;
            values.truncate(n);
            grads.push(values);
        }
        let mut dparams = s.clone_dtoh(&buffers.params[2]).map_err(device)?;
        dparams.truncate(call.params.len());
        s.synchronize().map_err(device)?;
        let [dq, dk, dv]: [Vec<f32>; 3] = grads
            .try_into()
            .map_err(|_| device("internal: three gradients expected"))?;
        Ok((call.finish([dq, dk, dv])?, dparams))
    }

    /// Times the backward kernels of a call on the device: inputs uploaded and kernels loaded
    /// once, one pass warms up, then each of `reps` passes (delta, dq, dk and dv) is timed to
    /// its completion. Returns the per-pass ms, and whether the kernels ran on tensor cores;
    /// `None` for a call with nothing to compute.
    pub fn time_backward(
        &self,
        variant: &Variant,
        x: &HeadsBackward,
        reps: usize,
    ) -> Result<Option<(Vec<f64>, bool)>, RuntimeError> {
        let call = match BackwardCall::prepare(variant, x, &[])? {
            Prepared::Launch(call) => call,
            Prepared::Empty(_) => return Ok(None),
        };
        let mut buffers = self.upload_backward(&call)?;
        self.launch_backward(&call, &mut buffers)?;
        self.stream.synchronize().map_err(device)?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let start = std::time::Instant::now();
            self.launch_backward(&call, &mut buffers)?;
            self.stream.synchronize().map_err(device)?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        Ok(Some((times, call.kernels.tensor_cores)))
    }

    fn upload_backward(&self, call: &BackwardCall) -> Result<BackwardBuffers, RuntimeError> {
        let s = &self.stream;
        let upload = |v: &[u8]| {
            s.clone_htod(if v.is_empty() { &[0u8; 4][..] } else { v })
                .map_err(device)
        };
        let mut inputs = Vec::with_capacity(10);
        for bytes in call.inputs.iter().chain(&call.codes) {
            inputs.push(upload(bytes)?);
        }
        for table in [&call.rope_cos, &call.rope_sin] {
            let bytes: Vec<u8> = table.iter().flat_map(|x| x.to_le_bytes()).collect();
            inputs.push(upload(&bytes)?);
        }
        let lens = call.output_lens();
        let mut outputs = Vec::with_capacity(4);
        for n in [call.rows(), lens[0], lens[1], lens[2]] {
            outputs.push(s.alloc_zeros::<f32>(n.max(1)).map_err(device)?);
        }
        let params = [
            s.clone_htod(if call.params.is_empty() {
                &[0.0f32][..]
            } else {
                &call.params
            })
            .map_err(device)?,
            s.alloc_zeros::<f32>(call.partials_len().max(1))
                .map_err(device)?,
            s.alloc_zeros::<f32>(call.params.len().max(1))
                .map_err(device)?,
        ];
        Ok(BackwardBuffers {
            inputs,
            outputs,
            params,
        })
    }

    fn launch_backward(
        &self,
        call: &BackwardCall,
        x: &mut BackwardBuffers,
    ) -> Result<(), RuntimeError> {
        let s = &self.stream;
        let read: Vec<_> = x.inputs.iter().map(|b| b.device_ptr(s)).collect();
        let written: Vec<_> = x.outputs.iter_mut().map(|b| b.device_ptr_mut(s)).collect();
        let [params, partials, dparams] = &mut x.params;
        let params = params.device_ptr(s);
        let [partials, dparams] = [partials, dparams].map(|b| b.device_ptr_mut(s));
        let address = |i: usize| read[i].0 as i64;
        let at = crate::gpu::backward::Buffers {
            inputs: [0, 1, 2, 3, 4, 5].map(address),
            outputs: [0, 1, 2, 3].map(|i| written[i].0 as i64),
            codes: if call.kernels.tensor_cores {
                [address(6), address(7)]
            } else {
                [0, 0]
            },
            rope: [address(8), address(9)],
            params: [params.0, partials.0, dparams.0].map(|a| a as i64),
        };
        for (kernel, &grid) in call.kernels.kernels.iter().zip(&call.grids) {
            let f = self.load(kernel)?;
            let config = LaunchConfig {
                grid_dim: (grid[0], grid[1], grid[2]),
                block_dim: (kernel.threads, 1, 1),
                shared_mem_bytes: dynamic_shared_bytes(kernel),
            };
            let values = call.args(kernel, &at)?;
            let mut launch = s.launch_builder(&f);
            for value in &values {
                launch.arg(value);
            }
            // SAFETY: `args` bound the kernel's parameters to its launch record's fields, in
            // order, all 64-bit: device addresses of the buffers above, each of the size the
            // kernel indexes (the call's tensors in the kernels' formats, the tile codes, one
            // delta per query row, the f32 gradients, the RoPE tables, the parameters, their
            // `param_copies` partial sums and their gradients), held by the guards in `read`,
            // `written`, `params`, `partials` and `dparams` until the launches are queued, and
            // i64 scalars; the grid and CTA size are the ones the kernel was lowered for.
            unsafe { launch.launch(config) }.map_err(device)?;
        }
        Ok(())
    }
}

/// The device buffers of a backward call: q, k, v, out, lse, dout, the two tile-code arrays
/// and the RoPE tables (as bytes), then delta, dq, dk and dv (f32).
struct BackwardBuffers {
    inputs: Vec<CudaSlice<u8>>,
    outputs: Vec<CudaSlice<f32>>,
    /// The parameters, their gradients' partial sums, their gradients.
    params: [CudaSlice<f32>; 3],
}
