//! A model's norms, activations, residual adds, embedding lookups and argmax as the GPU IR
//! kernels of `codegen::gpu::kernels::layers`, run on the interpreter with the launches a device would
//! get (the GPU-interpreter backend's [`LayerOps`]).

use crate::error::RuntimeError;
use crate::ops::{LayerOps, MlpKind, NormKind, same_len, whole_rows};
use crate::tensor::Storage;
use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::ir::{Half, Kernel};
use codegen::gpu::kernels::layers::{
    self, Activation, ArgmaxArgs, ElementwiseArgs, EmbedArgs, NormArgs, THREADS,
};
use codegen::gpu::launch::{LaunchRecord, bind};
use codegen::gpu::verified;

/// The layer kernels on the GPU IR interpreter.
#[derive(Clone, Copy, Debug, Default)]
pub struct SimLayers;

/// Runs a verified kernel over `ctas` CTAs with `record`'s arguments.
fn launch<R: LaunchRecord>(
    kernel: Kernel,
    ctas: usize,
    record: &R,
    mem: &mut Memory,
) -> Result<(), RuntimeError> {
    let kernel = verified(kernel)?;
    let ctas = u32::try_from(ctas)
        .map_err(|_| RuntimeError::Data(format!("{ctas} CTAs are more than a grid holds")))?;
    let args: Vec<Val> = bind(&kernel, record)
        .map_err(RuntimeError::Data)?
        .into_iter()
        .map(Val::I64)
        .collect();
    run(&kernel, [ctas, 1, 1], &args, mem).map_err(RuntimeError::Data)
}

/// A row width as a kernel constant.
fn width_u32(width: usize) -> Result<u32, RuntimeError> {
    u32::try_from(width).map_err(|_| RuntimeError::Data(format!("rows of {width} values")))
}

/// An elementwise launch's grid.
fn blocks(count: usize) -> usize {
    count.div_ceil(THREADS as usize).max(1)
}

fn read(mem: &Memory, addr: i64, n: usize) -> Result<Vec<f32>, RuntimeError> {
    mem.read_f32(addr, n).map_err(RuntimeError::Data)
}

impl LayerOps for SimLayers {
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
        let mut mem = Memory::default();
        let record = NormArgs {
            x: mem.alloc_f32(x),
            weight: mem.alloc_f32(weight),
            bias: mem.alloc_f32(bias.unwrap_or(weight)),
            out: mem.alloc_f32(&vec![0.0; x.len()]),
        };
        let kernel = layers::norm(
            kind,
            width_u32(width)?,
            eps as f32,
            bias.is_some(),
            width_u32(groups)?,
        );
        launch(kernel, rows, &record, &mut mem)?;
        read(&mem, record.out, x.len())
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
        let mut mem = Memory::default();
        let other = mem.alloc_f32(other);
        let record = ElementwiseArgs {
            x: mem.alloc_f32(up),
            other,
            count: up.len() as i64,
        };
        launch(
            layers::activation(activation),
            blocks(up.len()),
            &record,
            &mut mem,
        )?;
        up.copy_from_slice(&read(&mem, record.x, up.len())?);
        Ok(())
    }

    fn add(&self, x: &mut [f32], y: &[f32]) -> Result<(), RuntimeError> {
        same_len(x.len(), y.len(), "a residual add")?;
        let mut mem = Memory::default();
        let record = ElementwiseArgs {
            x: mem.alloc_f32(x),
            other: mem.alloc_f32(y),
            count: x.len() as i64,
        };
        launch(layers::residual_add(), blocks(x.len()), &record, &mut mem)?;
        x.copy_from_slice(&read(&mem, record.x, x.len())?);
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
        let mut mem = Memory::default();
        let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let record = EmbedArgs {
            tokens: mem.alloc_bytes(ids),
            table: mem.alloc_bytes(bytes),
            out: mem.alloc_f32(&vec![0.0; tokens.len() * width]),
        };
        launch(
            layers::embed(width_u32(width)?, half),
            tokens.len(),
            &record,
            &mut mem,
        )?;
        read(&mem, record.out, tokens.len() * width)
    }

    fn argmax(&self, rows: &[f32], width: usize) -> Result<Vec<u32>, RuntimeError> {
        let n = whole_rows(rows.len(), width)?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut mem = Memory::default();
        let record = ArgmaxArgs {
            x: mem.alloc_f32(rows),
            out: mem.alloc_bytes(vec![0; 4 * n]),
        };
        launch(layers::argmax(width_u32(width)?), n, &record, &mut mem)?;
        // The kernel writes i32 indices; read them back as their bits.
        Ok(read(&mem, record.out, n)?
            .iter()
            .map(|v| v.to_bits())
            .collect())
    }
}
