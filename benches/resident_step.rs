//! Host time of one greedy decode step of a model resident on a device, the device itself left
//! out: a device that only hands out addresses and returns zeros, so what is timed is what the
//! host does per step (work items, segment and task tables, RoPE rows, launch binding and
//! buffer bookkeeping). The shape is the 1B llama's (16 layers, 32 query heads over 8 kv heads
//! of 64) with a narrow residual stream, since widths cost the host nothing.

use attn::runtime::RuntimeError;
use attn::runtime::codegen::gpu::ir::Kernel;
use attn::runtime::codegen::gpu::ir::tma::TensorMap;
use attn::runtime::codegen::gpu::launch::Param;
use attn::runtime::device::{Device, DeviceBuffer};
use attn::runtime::model::research::config_from_toml;
use attn::runtime::model::{Model, ResidentModel};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// Addresses and nothing else.
#[derive(Default)]
struct NullDevice {
    next: AtomicI64,
}

impl Device for NullDevice {
    fn name(&self) -> &'static str {
        "null"
    }

    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer, RuntimeError> {
        self.zeros(bytes.len())
    }

    fn zeros(&self, bytes: usize) -> Result<DeviceBuffer, RuntimeError> {
        let addr = self.next.fetch_add(bytes as i64 + 256, Ordering::Relaxed) + 256;
        Ok(DeviceBuffer { addr, bytes })
    }

    fn download(&self, buffer: DeviceBuffer) -> Result<Vec<u8>, RuntimeError> {
        Ok(vec![0; buffer.bytes])
    }

    fn write(&self, _: DeviceBuffer, _: usize, _: &[u8]) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn free(&self, _: DeviceBuffer) {}

    fn launch(
        &self,
        _: &Arc<Kernel>,
        _: [u32; 3],
        _: &[Param],
        _: &[i64],
        _: &[TensorMap],
    ) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn gemm_t(
        &self,
        _: DeviceBuffer,
        _: DeviceBuffer,
        _: attn::DType,
        _: DeviceBuffer,
        _: usize,
        _: usize,
        _: usize,
    ) -> Result<(), RuntimeError> {
        Ok(())
    }
}

fn resident_step(c: &mut Criterion) {
    let config = config_from_toml(
        "vocab = 256\nhidden = 64\nlayers = 16\nintermediate = 128\nattention = \"heads = 32, \
         kv_heads = 8, head_dim = 64, mask = causal, position = rope(base = 500000.0), \
         dtype = bf16\"",
    )
    .unwrap();
    let model = Model::random(&config, 1).unwrap();
    let on_device = ResidentModel::new(&model, Arc::new(NullDevice::default())).unwrap();
    let mut group = c.benchmark_group("resident_step_host");
    group.sample_size(20);
    for cached in [128usize, 2048] {
        let mut session = on_device.session(cached + 4096).unwrap();
        let prompt: Vec<u32> = (0..cached as u32).map(|i| i % 256).collect();
        session.step_greedy(&prompt).unwrap();
        group.bench_with_input(BenchmarkId::from_parameter(cached), &cached, |b, _| {
            // Steps append at the same slots: the cache holds `cached` tokens throughout.
            b.iter(|| {
                let next = session.step_greedy(&[1]).unwrap();
                session.truncate(cached);
                next
            })
        });
    }
    group.finish();
}

criterion_group!(benches, resident_step);
criterion_main!(benches);
