//! Training step of attention on the CPU backend: a forward that saves out and lse, then the
//! backward (dq, dk, dv), timed as a pair. Causal, ALiBi and softcap; head dim 128; 512 to 2048
//! tokens; f32 and bf16. Throughput is query-key pairs x heads; `attnc bench SPEC --backward`
//! prints GFLOP/s (3.5 forwards) for one configuration.
//!
//! `cargo bench --bench backward` (all), or filter: `cargo bench --bench backward -- causal/f32`.

use attn::prelude::*;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

fn tensor(spec: &AttentionSpec, n: usize, seed: u64) -> Tensor {
    let (h, d) = (spec.heads as usize, spec.head_dim as usize);
    attn::inputs::tensor(spec.dtype, &[1, h, n, d], seed).unwrap()
}

fn backward(c: &mut Criterion) {
    let backend = CpuBackend::new();
    let variants = [
        ("causal", "mask = causal"),
        ("alibi", "mask = causal, position = alibi"),
        ("softcap_30", "mask = causal, softcap = 30.0"),
    ];
    for (name, body) in variants {
        for dtype in ["f32", "bf16"] {
            let text = format!("heads = 16, head_dim = 128, {body}, dtype = {dtype}");
            let spec: AttentionSpec = text.parse().unwrap();
            let variant = Variant::shared(&spec).unwrap();
            let mut group = c.benchmark_group(format!("{name}/{dtype}"));
            group.sample_size(10);
            for n in [512, 1024, 2048] {
                let [q, k, v, dout] = [1, 2, 3, 4].map(|seed| tensor(&spec, n, seed));
                group.throughput(Throughput::Elements((16 * n * n / 2) as u64));
                group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
                    b.iter(|| {
                        let inputs = Inputs::heads(&q, &k, &v);
                        let saved = backend.forward(&variant, inputs, 0).unwrap();
                        let x = BackwardInputs::Heads(HeadsBackward {
                            q: &q,
                            k: &k,
                            v: &v,
                            out: &saved.out,
                            lse: &saved.lse,
                            dout: &dout,
                            position_offset: 0,
                        });
                        backend.backward(&variant, &x).unwrap()
                    })
                });
            }
            group.finish();
        }
    }
}

criterion_group!(benches, backward);
criterion_main!(benches);
