//! A variable-length batch against the same sequences padded to the longest: forward and
//! backward on the CPU backend of 8 sequences of 64 to 4,096 tokens (causal, 8 heads, head dim
//! 64, f32), packed with `cu_seqlens` (`Backend::forward_varlen`, `backward_varlen`) against a
//! batch of 8 x 4,096 (the work padding does, whatever masks the padding).
//!
//! `cargo bench --bench varlen`.

use attn::prelude::*;
use attn::runtime::varlen::{Varlen, VarlenSaved};
use criterion::{Criterion, criterion_group, criterion_main};

const LENGTHS: [usize; 8] = [64, 128, 256, 512, 1024, 2048, 3072, 4096];

fn varlen(c: &mut Criterion) {
    let backend = CpuBackend::new();
    let spec: AttentionSpec = "heads = 8, head_dim = 64, mask = causal".parse().unwrap();
    let variant = Variant::shared(&spec).unwrap();
    let total: usize = LENGTHS.iter().sum();
    let packed = |seed| attn::inputs::tensor(spec.dtype, &[total, 8, 64], seed).unwrap();
    let (q, k, v, dout) = (packed(1), packed(2), packed(3), packed(4));
    let cu: Vec<i32> = std::iter::once(0)
        .chain(LENGTHS.iter().scan(0, |s, &l| {
            *s += l as i32;
            Some(*s)
        }))
        .collect();
    let x = Varlen {
        q: &q,
        k: &k,
        v: &v,
        cu_seqlens_q: &cu,
        cu_seqlens_k: &cu,
    };
    let longest = LENGTHS[LENGTHS.len() - 1];
    let padded = |seed| attn::inputs::tensor(spec.dtype, &[8, 8, longest, 64], seed).unwrap();
    let (pq, pk, pv, pdout) = (padded(1), padded(2), padded(3), padded(4));
    let mut group = c.benchmark_group("varlen_8_sequences_64_to_4096/causal/d64/f32");
    group.sample_size(10);
    group.bench_function("packed, forward and backward", |b| {
        b.iter(|| {
            let o = backend
                .forward_varlen(&variant, x, 0, Learned::none())
                .unwrap();
            let saved = VarlenSaved {
                out: &o.out,
                lse: &o.lse,
                dout: &dout,
            };
            backend
                .backward_varlen(&variant, x, saved, 0, Learned::none())
                .unwrap()
        })
    });
    group.bench_function("padded to 4096, forward and backward", |b| {
        b.iter(|| {
            let o = backend
                .forward(&variant, Inputs::heads(&pq, &pk, &pv), 0)
                .unwrap();
            let x = BackwardInputs::Heads(HeadsBackward {
                q: &pq,
                k: &pk,
                v: &pv,
                out: &o.out,
                lse: &o.lse,
                dout: &pdout,
                position_offset: 0,
            });
            backend.backward(&variant, &x).unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, varlen);
criterion_main!(benches);
