//! The GPU IR interpreter as a [`Device`]: kernels run on it as they would on a GPU, and GEMMs
//! run on the host over the same memory (the stand-in for cuBLAS).

use super::{Device, DeviceBuffer, f32_bytes, f32s};
use crate::error::RuntimeError;
use crate::host::gemm::gemm;
use attn_dsl::DType;
use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::ir::Kernel;
use codegen::gpu::ir::tma::TensorMap;
use codegen::gpu::launch::Param;
use std::sync::{Arc, Mutex};

/// The interpreter's memory and launches.
#[derive(Debug, Default)]
pub struct SimDevice {
    memory: Mutex<Memory>,
}

impl SimDevice {
    /// A device with empty memory.
    pub fn new() -> Self {
        Self::default()
    }

    fn memory(&self) -> Result<std::sync::MutexGuard<'_, Memory>, RuntimeError> {
        self.memory
            .lock()
            .map_err(|_| RuntimeError::Device("the interpreter's memory lock is poisoned".into()))
    }
}

impl Device for SimDevice {
    fn name(&self) -> &'static str {
        "gpu-sim"
    }

    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer, RuntimeError> {
        let addr = self.memory()?.alloc_bytes(bytes.to_vec());
        Ok(DeviceBuffer {
            addr,
            bytes: bytes.len(),
        })
    }

    fn zeros(&self, bytes: usize) -> Result<DeviceBuffer, RuntimeError> {
        crate::memory::ensure_fits("a device buffer", Some(bytes as u64))?;
        let addr = self.memory()?.alloc_bytes(vec![0; bytes]);
        Ok(DeviceBuffer { addr, bytes })
    }

    fn download(&self, buffer: DeviceBuffer) -> Result<Vec<u8>, RuntimeError> {
        self.memory()?
            .read_bytes(buffer.addr, buffer.bytes)
            .map_err(RuntimeError::Device)
    }

    fn write(&self, buffer: DeviceBuffer, offset: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        if offset
            .checked_add(bytes.len())
            .is_none_or(|end| end > buffer.bytes)
        {
            return Err(RuntimeError::Device(format!(
                "{} bytes at offset {offset} run past a {}-byte buffer",
                bytes.len(),
                buffer.bytes
            )));
        }
        self.memory()?
            .write_bytes(buffer.addr + offset as i64, bytes)
            .map_err(RuntimeError::Device)
    }

    fn free(&self, buffer: DeviceBuffer) {
        if let Ok(mut m) = self.memory() {
            m.free(buffer.addr);
        }
    }

    fn launch(
        &self,
        kernel: &Arc<Kernel>,
        grid: [u32; 3],
        fields: &[Param],
        args: &[i64],
        maps: &[TensorMap],
    ) -> Result<(), RuntimeError> {
        // The interpreter checks every access against its buffers as it runs.
        if fields.len() != args.len() {
            return Err(RuntimeError::Device(format!(
                "{} arguments for {} fields",
                args.len(),
                fields.len()
            )));
        }
        let mut memory = self.memory()?;
        let mut values: Vec<Val> = args.iter().map(|a| Val::I64(*a)).collect();
        for map in maps {
            let handle = memory
                .alloc_tensor_map(map.clone())
                .map_err(RuntimeError::Device)?;
            values.push(Val::I64(handle));
        }
        run(kernel, grid, &values, &mut memory).map_err(RuntimeError::Device)
    }

    fn check_cost(&self, what: &str, seconds: &dyn Fn() -> f64) -> Result<(), RuntimeError> {
        crate::gpu::sim_cost::check(what, seconds())
    }

    fn gemm_t(
        &self,
        x: DeviceBuffer,
        w: DeviceBuffer,
        dtype: DType,
        y: DeviceBuffer,
        n: usize,
        inp: usize,
        out: usize,
    ) -> Result<(), RuntimeError> {
        let mut memory = self.memory()?;
        let read = |m: &Memory, b: DeviceBuffer, bytes: usize| {
            if bytes > b.bytes {
                return Err(RuntimeError::Device(format!(
                    "a GEMM reads {bytes} bytes of a {}-byte buffer",
                    b.bytes
                )));
            }
            m.read_bytes(b.addr, bytes).map_err(RuntimeError::Device)
        };
        let xs = f32s(&read(&memory, x, 4 * n * inp)?);
        let size = dtype.size_bytes() as usize;
        let raw = read(&memory, w, size * out * inp)?;
        let ws: Vec<f32> = match dtype {
            DType::F32 => f32s(&raw),
            DType::Bf16 => raw
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::F16 => raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        };
        if 4 * n * out > y.bytes {
            return Err(RuntimeError::Device(format!(
                "a GEMM writes {} bytes to a {}-byte buffer",
                4 * n * out,
                y.bytes
            )));
        }
        let mut ys = vec![0f32; n * out];
        gemm(n, inp, out, &xs, (inp, 1), &ws, (1, inp), &mut ys, out);
        memory
            .write_bytes(y.addr, &f32_bytes(&ys))
            .map_err(RuntimeError::Device)
    }
}
