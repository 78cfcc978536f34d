//! A host model's norms, activations, residual adds, embedding lookups and argmax as the GPU
//! IR kernels of `codegen::gpu::kernels::layers`, each call's rows uploaded to a [`Device`],
//! the kernel launched and the result read back ([`LayerOps`] on a device; `gpu-sim` takes it
//! on the interpreter).

use crate::device::{Device, DeviceBuffer, Scratch, f32_bytes, f32s};
use crate::error::RuntimeError;
use crate::ops::{LayerOps, MlpKind, NormKind, same_len, whole_rows};
use crate::tensor::Storage;
use codegen::gpu::ir::{Half, Kernel};
use codegen::gpu::kernels::layers::{
    self, Activation, ArgmaxArgs, ElementwiseArgs, EmbedArgs, NormArgs, THREADS,
};
use codegen::gpu::launch::LaunchRecord;
use codegen::gpu::verified;
use std::sync::Arc;

/// The layer kernels on a device.
#[derive(Clone)]
pub struct DeviceLayers {
    device: Arc<dyn Device>,
}

impl std::fmt::Debug for DeviceLayers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceLayers")
            .field("device", &self.device.name())
            .finish()
    }
}

impl DeviceLayers {
    /// The layer kernels on `device`.
    pub fn on(device: Arc<dyn Device>) -> Self {
        DeviceLayers { device }
    }

    /// Runs `kernel` (verified first) over `ctas` CTAs with `record`'s arguments.
    fn launch<R: LaunchRecord>(
        &self,
        kernel: Kernel,
        ctas: usize,
        record: &R,
    ) -> Result<(), RuntimeError> {
        let kernel = Arc::new(verified(kernel)?);
        let ctas = u32::try_from(ctas)
            .map_err(|_| RuntimeError::Data(format!("{ctas} CTAs are more than a grid holds")))?;
        crate::device::launch(self.device.as_ref(), &kernel, [ctas, 1, 1], record, &[])
    }

    /// `n` f32 values of a buffer.
    fn read(&self, addr: i64, n: usize) -> Result<Vec<f32>, RuntimeError> {
        Ok(f32s(
            &self.device.download(DeviceBuffer { addr, bytes: 4 * n })?,
        ))
    }
}

/// A row width as a kernel constant.
fn width_u32(width: usize) -> Result<u32, RuntimeError> {
    u32::try_from(width).map_err(|_| RuntimeError::Data(format!("rows of {width} values")))
}

/// An elementwise launch's grid.
fn blocks(count: usize) -> usize {
    count.div_ceil(THREADS as usize).max(1)
}

impl LayerOps for DeviceLayers {
    fn norm(
        &self,
        kind: NormKind,
        eps: f64,
        (weight, groups): (&[f32], usize),
        bias: Option<&[f32]>,
        x: &[f32],
    ) -> Result<Vec<f32>, RuntimeError> {
        // The kernel's rows are segments; its weight rows repeat every `groups` of them.
        let width = crate::ops::segment(weight.len(), groups)?;
        whole_rows(x.len(), weight.len())?;
        let rows = whole_rows(x.len(), width)?;
        if let Some(b) = bias {
            same_len(weight.len(), b.len(), "norm weight and bias")?;
        }
        if rows == 0 {
            return Ok(Vec::new());
        }
        let kind = match kind {
            NormKind::Rms => layers::RowNorm::Rms,
            NormKind::Layer => layers::RowNorm::Layer,
        };
        let mut s = Scratch::new(self.device.as_ref());
        let record = NormArgs {
            x: s.upload(&f32_bytes(x))?.addr,
            weight: s.upload(&f32_bytes(weight))?.addr,
            bias: s.upload(&f32_bytes(bias.unwrap_or(weight)))?.addr,
            out: s.f32s(x.len())?.addr,
        };
        let kernel = layers::norm(
            kind,
            width_u32(width)?,
            eps as f32,
            bias.is_some(),
            width_u32(groups)?,
        );
        self.launch(kernel, rows, &record)?;
        self.read(record.out, x.len())
    }

    fn activate(
        &self,
        kind: MlpKind,
        up: &mut [f32],
        gate: Option<&[f32]>,
    ) -> Result<(), RuntimeError> {
        let (activation, other) = match (kind, gate) {
            (MlpKind::SwiGlu, Some(g)) => {
                same_len(up.len(), g.len(), "SwiGLU's up and gate")?;
                (Activation::SwiGlu, g)
            }
            (MlpKind::GeGlu, Some(g)) => {
                same_len(up.len(), g.len(), "GeGLU's up and gate")?;
                (Activation::GeGlu, g)
            }
            (MlpKind::SwiGlu | MlpKind::GeGlu | MlpKind::ClampedSwiGlu { .. }, None) => {
                return Err(RuntimeError::Data(format!("{kind:?} needs its gate")));
            }
            (MlpKind::ClampedSwiGlu { alpha, limit }, Some(g)) => {
                same_len(up.len(), g.len(), "the clamped SwiGLU's up and gate")?;
                let (alpha, limit) = (alpha.to_bits(), limit.to_bits());
                (Activation::ClampedSwiGlu { alpha, limit }, g)
            }
            (MlpKind::Gelu, _) => (Activation::Gelu, &*up),
            (MlpKind::GeluExact, _) => (Activation::GeluExact, &*up),
        };
        let mut s = Scratch::new(self.device.as_ref());
        let other = s.upload(&f32_bytes(other))?.addr;
        let record = ElementwiseArgs {
            x: s.upload(&f32_bytes(up))?.addr,
            other,
            count: up.len() as i64,
        };
        self.launch(layers::activation(activation), blocks(up.len()), &record)?;
        up.copy_from_slice(&self.read(record.x, up.len())?);
        Ok(())
    }

    fn add(&self, x: &mut [f32], y: &[f32]) -> Result<(), RuntimeError> {
        same_len(x.len(), y.len(), "a residual add")?;
        let mut s = Scratch::new(self.device.as_ref());
        let record = ElementwiseArgs {
            x: s.upload(&f32_bytes(x))?.addr,
            other: s.upload(&f32_bytes(y))?.addr,
            count: x.len() as i64,
        };
        self.launch(layers::residual_add(), blocks(x.len()), &record)?;
        x.copy_from_slice(&self.read(record.x, x.len())?);
        Ok(())
    }

    fn embed(
        &self,
        table: &Storage,
        width: usize,
        tokens: &[u32],
    ) -> Result<Vec<f32>, RuntimeError> {
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let vocab = table.len() / width.max(1);
        if let Some(t) = tokens.iter().find(|t| **t as usize >= vocab) {
            return Err(RuntimeError::Data(format!(
                "token {t} is outside the vocabulary of {vocab}"
            )));
        }
        let (bytes, half): (Vec<u8>, Option<Half>) = match table {
            Storage::F32(v) => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), None),
            Storage::Bf16(v) => (
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Some(Half::Bf16),
            ),
            Storage::F16(v) => (
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Some(Half::F16),
            ),
        };
        let mut s = Scratch::new(self.device.as_ref());
        let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let record = EmbedArgs {
            tokens: s.upload(&ids)?.addr,
            table: s.upload(&bytes)?.addr,
            out: s.f32s(tokens.len() * width)?.addr,
        };
        let kernel = layers::embed(width_u32(width)?, half);
        self.launch(kernel, tokens.len(), &record)?;
        self.read(record.out, tokens.len() * width)
    }

    fn argmax(&self, rows: &[f32], width: usize) -> Result<Vec<u32>, RuntimeError> {
        let n = whole_rows(rows.len(), width)?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut s = Scratch::new(self.device.as_ref());
        let record = ArgmaxArgs {
            x: s.upload(&f32_bytes(rows))?.addr,
            out: s.zeros(4 * n)?.addr,
        };
        self.launch(layers::argmax(width_u32(width)?), n, &record)?;
        // The kernel writes i32 indices; read them back as their bits.
        Ok(self
            .read(record.out, n)?
            .iter()
            .map(|v| v.to_bits())
            .collect())
    }
}
