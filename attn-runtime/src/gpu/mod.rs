//! Running the GPU kernels: a call prepared on the host (inputs in the kernel's formats, tile
//! codes from the plan's classification, RoPE tables), then run on a [`Device`]
//! ([`GpuCall::run_on`]): a CUDA device (feature `cuda`) or codegen's GPU IR interpreter, which
//! executes exactly the kernel a device would and so tests this runtime path without a GPU.
//! [`backend::GpuBackend`] is the `Backend` over either.

pub mod backend;
pub(crate) mod backward;
#[cfg(feature = "cuda")]
pub mod cuda;
mod decode;
pub mod disk_cache;
pub mod layer_ops;
mod pages;
mod tables;
pub use tables::CallTables;
pub mod ptx;
pub mod sim_cost;

pub mod sim;

use crate::calls::{MlaTensors, Output};
use crate::device::{Device, DeviceBuffer, Scratch, SimDevice, f32s};
use crate::error::RuntimeError;
use crate::host::checks::{check_qkv, finish};
use crate::host::mla::AbsorbedForward;
use crate::tensor::{Storage, Tensor};
use crate::variant::Variant;
use attn_dsl::AttentionSpec;
use codegen::KernelPlan;
use codegen::gpu::choice::{Call, ForwardChoice, Target, choose};
use codegen::gpu::ir::Half;
use codegen::gpu::ir::Kernel;
use codegen::gpu::ir::tma::TensorMap;
use codegen::gpu::kernels::forward_tc;
use codegen::gpu::kernels::forward_wgmma;
use codegen::gpu::launch::ForwardArgs;
use codegen::gpu::{BackwardKernels, ForwardKernel};
use std::sync::Arc;

/// A forward call ready to launch: the kernel, its grid, and its inputs on the host.
#[derive(Clone, Debug)]
pub struct GpuCall {
    /// The GPU IR kernel (the same for every shape of a spec; lowered once per process and
    /// shared).
    pub kernel: Arc<Kernel>,
    /// CTAs: (query blocks, heads, batch).
    pub grid: [u32; 3],
    /// `[B, Hq, Sq, D]`, `[B, Hkv, Skv, D]`, `[B, Hkv, Skv, Dv]`, contiguous, as the bytes of
    /// the kernel's input type (`inputs`).
    pub q: Vec<u8>,
    /// See `q`.
    pub k: Vec<u8>,
    /// See `q`.
    pub v: Vec<u8>,
    /// The element type of `q`, `k` and `v`: f32, or the spec's bf16 or f16 for the tensor-core
    /// kernel.
    pub inputs: attn_dsl::DType,
    /// One tile code per (head, query block, key tile): 0 skip, 1 every key kept (the tile
    /// inside Skv: no mask, no bound), 2 masked (the mask and the Skv bound apply).
    pub codes: Vec<i32>,
    /// The RoPE tables of the call's positions (empty without RoPE).
    pub rope: CallTables,
    /// Scalars: Sq, Skv, the position of key 0.
    pub sq: i64,
    /// See `sq`.
    pub skv: i64,
    /// See `sq`.
    pub p0: i64,
    /// `[B, Hq, Sq, Dv]`: the output's shape.
    pub out_shape: [usize; 4],
    /// The spec's dtype (of `out`).
    pub dtype: attn_dsl::DType,
    /// The TMA maps of q, k and v the kernel takes after its launch record, their addresses
    /// left 0 (set where the inputs land); empty for kernels without them.
    pub tensor_maps: Vec<TensorMap>,
    /// The spec's parameters and the call's data, laid out as the plan's `ParamLayout` (empty
    /// without).
    pub params: Vec<f32>,
    /// Where the kernel reads its parameters and data headers in `params`.
    pub layout: codegen::plan::ParamLayout,
}

/// What a forward launch needs besides q, k and v: its grid, tile codes and RoPE tables.
pub(crate) struct ForwardTables {
    /// CTAs: (query blocks, heads, batch).
    pub grid: [u32; 3],
    /// One [`codegen::plan::TileCode`] per (head, query block, key tile).
    pub codes: Vec<i32>,
    /// The RoPE tables of the call's positions (empty without RoPE).
    pub rope: CallTables,
}

impl ForwardTables {
    /// The tables of a call of `chosen` (for `plan`) on `[batch, Sq, Skv]`, key 0 at `p0`;
    /// refuses positions past xPos's range.
    pub fn of(
        plan: &KernelPlan,
        chosen: &ForwardKernel,
        [b, sq, skv]: [usize; 3],
        p0: i64,
    ) -> Result<Self, RuntimeError> {
        let h = plan.shape.heads as usize;
        let codes = chosen.tile_codes(plan, [b, sq, skv], p0, None);
        let qblocks = sq.div_ceil(chosen.rows as usize);
        let first = p0.min(p0 + skv as i64 - sq as i64);
        let end = p0 + skv as i64;
        Ok(ForwardTables {
            grid: [qblocks as u32, h as u32, b as u32],
            codes,
            rope: CallTables::of(plan, (first, end), end.max(0) as u64)?,
        })
    }
}

/// Whether q or k go past the `Q K^T` operands of the plan's tensor-core kernel: where those
/// are f16 ([`forward_tc::qk_half`]), every rotated value must stay inside f16's range. Such
/// inputs run on the SIMT kernel, in f32 ([`Call::Forward`]'s `wide`).
fn qk_wide(plan: &KernelPlan, q: &Tensor, k: &Tensor) -> bool {
    if !forward_tc::supports(plan) || forward_tc::qk_half(plan) != Half::F16 {
        return false;
    }
    let factor = plan.rope.as_ref().map_or(1.0, |r| {
        // xPos scales by up to e^(its exponent at the farthest position from the middle of
        // the call's positions, which span max(Sq, Skv)).
        let [sq, skv] = [q, k].map(|t| t.shape().get(2).copied().unwrap_or(0));
        let reach = sq.max(skv) / 2 + 1;
        let xpos = attn_dsl::reference::rope::decay_exponent(&r.rope, reach as f64).exp();
        r.attention_factor.max(1.0) * xpos
    }) as f32;
    q.max_abs().max(k.max_abs()) * factor > forward_tc::QK_F16_LIMIT
}

/// The target the process's settings ask for (`ATTN_GPU_WGMMA`, `ATTN_GPU_MMA_WARPS`).
fn target() -> Result<Target, RuntimeError> {
    Target::from_settings().map_err(|e| match e {
        codegen::CodegenError::Setting(message) => RuntimeError::Setting(message),
        other => other.into(),
    })
}

/// The forward kernel a forward `call` of a variant runs ([`choose`] on the settings'
/// [`Target`]), lowered once per variant and shared by the interpreter and CUDA backends.
pub(crate) fn forward_kernel(
    variant: &Variant,
    call: Call,
) -> Result<Arc<ForwardKernel>, RuntimeError> {
    let choice = choose(call, variant.forward_plan(), target()?).forward()?;
    variant.gpu_forward(choice)
}

/// The backward kernels a backward call of a variant runs (delta, dq, dk and dv): the SIMT
/// ones where `wide`, else tensor cores where the plan runs on them. Lowered once per variant.
pub(crate) fn backward_kernels(
    variant: &Variant,
    wide: bool,
) -> Result<Arc<BackwardKernels>, RuntimeError> {
    let plan = variant.backward_plan()?;
    let choice = choose(Call::Backward { wide }, plan, target()?).backward()?;
    variant.gpu_backward(choice)
}

/// The positions of a call, checked as the CPU backend and the reference check them.
fn check_positions(sq: usize, skv: usize, p0: i64) -> Result<(), RuntimeError> {
    attn_dsl::reference::check_positions(sq, skv, p0).map_err(|e| RuntimeError::Data(e.to_string()))
}

impl GpuCall {
    /// Prepares `forward(q, k, v)` for a per-head spec (the shapes of
    /// [`crate::Backend::forward`] on [`crate::cpu::CpuBackend`]).
    pub fn forward(
        spec: &AttentionSpec,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        p0: i64,
    ) -> Result<GpuCall, RuntimeError> {
        Self::forward_in(&*Variant::shared(spec)?, q, k, v, p0, &[])
    }

    /// [`GpuCall::forward`] for a variant, with the call's parameters and data (laid out as the
    /// plan's `ParamLayout`; checked here): tiles are classified from the data a mask reads.
    pub(crate) fn forward_in(
        variant: &Variant,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        p0: i64,
        params: &[f32],
    ) -> Result<GpuCall, RuntimeError> {
        let spec = variant.spec();
        if spec.mla().is_some() {
            return Err(RuntimeError::Spec(
                "this is an MLA spec: its forward takes Inputs::Mla (q_nope, q_pe, c_kv, k_pe, w_kv_b)"
                    .into(),
            ));
        }
        let plan = variant.forward_plan();
        let [b, sq, skv] = check_qkv(spec, q, k, v)?;
        check_positions(sq, skv, p0)?;
        let wide = qk_wide(plan, q, k);
        let chosen = forward_kernel(variant, Call::Forward { wide })?;
        let inputs = chosen.inputs;
        let bytes = [q, k, v].map(|t| device_bytes(t, inputs));
        let call = Self::prepare(
            plan,
            Arc::clone(&chosen),
            [b, sq, skv],
            p0,
            bytes,
            spec.dtype,
        )?
        .with_params(params)?;
        Ok(match plan.mask_data_ranges(params) {
            Some(ranges) => GpuCall {
                codes: chosen.tile_codes(plan, [b, sq, skv], p0, Some(&ranges)),
                ..call
            },
            None => call,
        })
    }

    /// [`GpuCall::forward`] on the sm_90a kernel ([`forward_wgmma`]; what `ATTN_GPU_WGMMA=1`
    /// selects): an error for a spec it does not run.
    pub fn forward_wgmma(
        spec: &AttentionSpec,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        p0: i64,
    ) -> Result<GpuCall, RuntimeError> {
        let variant = Variant::shared(spec)?;
        let plan = variant.forward_plan();
        if !forward_wgmma::supports(plan) {
            return Err(RuntimeError::Spec(
                "the sm_90a forward runs bf16 and f16 per-head specs whose head dims are \
                 multiples of 64 up to 256"
                    .into(),
            ));
        }
        let [b, sq, skv] = check_qkv(spec, q, k, v)?;
        check_positions(sq, skv, p0)?;
        let chosen = variant.gpu_forward(ForwardChoice::Wgmma)?;
        let bytes = [q, k, v].map(|t| device_bytes(t, chosen.inputs));
        Self::prepare(plan, chosen, [b, sq, skv], p0, bytes, spec.dtype)
    }

    /// Prepares `CpuBackend::forward_mla`'s call: the inputs absorbed on the host as the CPU
    /// backend does, the kernel over one shared latent head. The call's `out` is the f32 latent
    /// output; [`AbsorbedForward::finish`] expands it by `W_uv`.
    pub(crate) fn forward_mla(
        variant: &Variant,
        x: &MlaTensors,
        p0: i64,
    ) -> Result<(GpuCall, AbsorbedForward), RuntimeError> {
        let a = AbsorbedForward::of(variant.spec(), x)?;
        check_positions(a.sq, a.skv, p0)?;
        let chosen = forward_kernel(variant, Call::Forward { wide: false })?;
        let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let bytes = [f32_bytes(&a.q), f32_bytes(&a.k), f32_bytes(&a.values())];
        let call = Self::prepare(
            variant.forward_plan(),
            chosen,
            [a.b, a.sq, a.skv],
            p0,
            bytes,
            attn_dsl::DType::F32,
        )?;
        Ok((call, a))
    }

    /// A call of `kernel` (chosen for `plan`) on `[batch, Sq, Skv]` with its inputs' bytes: the
    /// tile codes and RoPE tables of the call. `dtype` is the output's.
    fn prepare(
        plan: &KernelPlan,
        chosen: Arc<ForwardKernel>,
        [b, sq, skv]: [usize; 3],
        p0: i64,
        [q, k, v]: [Vec<u8>; 3],
        dtype: attn_dsl::DType,
    ) -> Result<GpuCall, RuntimeError> {
        let h = plan.shape.heads as usize;
        let dv = plan.shape.v_dim as usize;
        let t = ForwardTables::of(plan, &chosen, [b, sq, skv], p0)?;
        let tensor_maps = if chosen.tensor_maps {
            forward_wgmma::tensor_maps(plan, [b, sq, skv], [0; 3]).to_vec()
        } else {
            Vec::new()
        };
        Ok(GpuCall {
            tensor_maps,
            kernel: Arc::clone(&chosen.kernel),
            grid: t.grid,
            q,
            k,
            v,
            inputs: chosen.inputs,
            codes: t.codes,
            rope: t.rope,
            sq: sq as i64,
            skv: skv as i64,
            p0,
            out_shape: [b, h, sq, dv],
            dtype,
            params: Vec::new(),
            layout: plan.params.clone(),
        })
    }

    /// An error unless the call holds the parameters its kernel reads (a call prepared without
    /// [`GpuCall::with_params`] for a spec that has some).
    pub(crate) fn check_params(&self) -> Result<(), RuntimeError> {
        self.layout
            .check_buffer(&self.params)
            .map_err(RuntimeError::Data)
    }

    /// The call with the spec's parameters and data (laid out as the plan's `ParamLayout`;
    /// checked here, since the kernel reads as its layout and data headers say).
    pub(crate) fn with_params(mut self, params: &[f32]) -> Result<GpuCall, RuntimeError> {
        self.params = params.to_vec();
        self.check_params()?;
        Ok(self)
    }

    /// Runs the call on the GPU IR interpreter (every CTA, every thread; slow, exact), on a
    /// device of its own.
    pub fn run_on_sim(&self) -> Result<Output, RuntimeError> {
        self.run_on(&SimDevice::new())
    }

    /// Runs the call on `device`: inputs uploaded, the kernel launched, `out` and `lse` read
    /// back, every buffer freed.
    pub fn run_on(&self, device: &dyn Device) -> Result<Output, RuntimeError> {
        self.check_params()?;
        let [b, h, sq, _] = self.out_shape;
        if b * h * sq == 0 {
            return finish(self.dtype, self.out_shape, Vec::new(), Vec::new());
        }
        let mut scratch = Scratch::new(device);
        let buffers = self.upload(&mut scratch)?;
        self.launch(device, &buffers)?;
        let out = f32s(&device.download(buffers.out)?);
        let lse = f32s(&device.download(buffers.lse)?);
        finish(self.dtype, self.out_shape, out, lse)
    }

    /// The call's inputs uploaded to `scratch`'s device, and zeroed outputs.
    pub(crate) fn upload(&self, scratch: &mut Scratch) -> Result<ForwardBuffers, RuntimeError> {
        self.check_params()?;
        let [b, h, sq, dv] = self.out_shape;
        let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let codes: Vec<u8> = self.codes.iter().flat_map(|c| c.to_le_bytes()).collect();
        Ok(ForwardBuffers {
            q: scratch.upload_or_null(&self.q)?,
            k: scratch.upload_or_null(&self.k)?,
            v: scratch.upload_or_null(&self.v)?,
            codes: scratch.upload_or_null(&codes)?,
            rope: self.rope.upload(scratch)?,
            params: scratch.upload_or_null(&f32_bytes(&self.params))?,
            out: scratch.f32s(b * h * sq * dv)?,
            lse: scratch.f32s(b * h * sq)?,
        })
    }

    /// Queues the call's kernel over `buffers` on `device`.
    pub(crate) fn launch(
        &self,
        device: &dyn Device,
        buffers: &ForwardBuffers,
    ) -> Result<(), RuntimeError> {
        let x = buffers;
        let record = ForwardArgs {
            q: x.q,
            k: x.k,
            v: x.v,
            out: x.out.addr,
            lse: x.lse.addr,
            codes: x.codes,
            sq: self.sq,
            skv: self.skv,
            p0: self.p0,
            rope_cos: x.rope[0],
            rope_sin: x.rope[1],
            rope_key_cos: x.rope[2],
            rope_key_sin: x.rope[3],
            rope_pos0: self.rope.pos0,
            params: x.params,
        };
        let maps: Vec<TensorMap> = self
            .tensor_maps
            .iter()
            .zip([x.q, x.k, x.v])
            .map(|(map, global)| TensorMap {
                global,
                ..map.clone()
            })
            .collect();
        crate::device::launch(device, &self.kernel, self.grid, &record, &maps)
    }
}

/// A forward call's buffers on a device: the addresses of its inputs (0 for an empty one) and
/// its outputs.
pub(crate) struct ForwardBuffers {
    q: i64,
    k: i64,
    v: i64,
    codes: i64,
    /// RoPE tables: `[cos, sin, key cos, key sin]` ([`CallTables::upload`]).
    rope: [i64; 4],
    params: i64,
    /// `[B, Hq, Sq, Dv]` f32.
    pub out: DeviceBuffer,
    /// `[B, Hq, Sq]` f32.
    pub lse: DeviceBuffer,
}

/// A tensor's values in logical order as the bytes of `dtype` (f32, or bf16 or f16 rounded to
/// nearest even), little-endian: what a forward kernel reads from global memory.
pub(crate) fn device_bytes(t: &Tensor, dtype: attn_dsl::DType) -> Vec<u8> {
    let values = || t.to_f32_vec().into_iter();
    match (dtype, &t.contiguous_storage()) {
        (attn_dsl::DType::Bf16, Storage::Bf16(v)) => {
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        }
        (attn_dsl::DType::F16, Storage::F16(v)) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (attn_dsl::DType::Bf16, _) => values()
            .flat_map(|x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        (attn_dsl::DType::F16, _) => values()
            .flat_map(|x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        (attn_dsl::DType::F32, _) => values().flat_map(|x| x.to_le_bytes()).collect(),
    }
}
