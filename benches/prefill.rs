//! Prefill forward on the CPU backend: causal, ALiBi, sliding window and softcap; head dims 64 and
//! 128; 512 to 4096 tokens; f32 and bf16. Throughput is reported as elements (query-key pairs
//! x heads), and `attnc bench` prints GFLOP/s for a single configuration.
//!
//! `cargo bench --bench prefill` (all), or filter: `cargo bench --bench prefill -- causal/d128`.

use attn::prelude::*;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

fn inputs(spec: &AttentionSpec, n: usize) -> [Tensor; 3] {
    let (h, d) = (spec.heads as usize, spec.head_dim as usize);
    [1, 2, 3].map(|seed| attn::inputs::tensor(spec.dtype, &[1, h, n, d], seed).unwrap())
}

fn prefill(c: &mut Criterion) {
    let backend = CpuBackend::new();
    let variants = [
        ("causal", "mask = causal"),
        ("alibi", "mask = causal, position = alibi"),
        ("sliding_window_1024", "mask = sliding_window(1024)"),
        ("softcap_30", "mask = causal, softcap = 30.0"),
    ];
    for (name, body) in variants {
        for d in [64, 128] {
            for dtype in ["f32", "bf16"] {
                let text = format!("heads = 16, head_dim = {d}, {body}, dtype = {dtype}");
                let spec: AttentionSpec = text.parse().unwrap();
                backend.forward_kernel(&spec).unwrap();
                let variant = Variant::shared(&spec).unwrap();
                let mut group = c.benchmark_group(format!("{name}/d{d}/{dtype}"));
                group.sample_size(10);
                for n in [512, 1024, 2048, 4096] {
                    let [q, k, v] = inputs(&spec, n);
                    group.throughput(Throughput::Elements((16 * n * n / 2) as u64));
                    group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
                        b.iter(|| {
                            let inputs = Inputs::heads(&q, &k, &v);
                            backend.forward(&variant, inputs, 0).unwrap()
                        })
                    });
                }
                group.finish();
            }
        }
    }
}

criterion_group!(benches, prefill);
criterion_main!(benches);
