//! The sm_90a forward kernel (warp-specialized: TMA producer, `wgmma` consumers), run by the
//! GPU IR interpreter against `attn_dsl::reference`: masks with skipped and masked tiles, ALiBi,
//! softcap, custom modifiers, GQA, Sq != Skv, several CTAs, head dims 64 to 256. With `llvm`,
//! its PTX for sm_90a holds `wgmma.mma_async`, `cp.async.bulk.tensor` and `setmaxnreg`, and
//! ptxas assembles it with no spills, no serialized `wgmma` and no ignored `setmaxnreg`.

use attn_dsl::AttentionSpec;
use attn_dsl::reference::{self, Array, Inputs, rope};
use codegen::KernelPlan;
use codegen::gpu::forward_wgmma::{self, ROWS, key_tile, lower, supports, tensor_maps};
use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::{ForwardKernel, forward_tc};
use codegen::plan::Frequencies;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Rounds to the spec's 16-bit format; the values and their bits.
fn sixteen_bit(spec: &AttentionSpec, v: Vec<f32>) -> (Vec<f32>, Vec<u8>) {
    let bits: Vec<u16> = v
        .iter()
        .map(|&x| match spec.dtype {
            attn_dsl::DType::F16 => half::f16::from_f32(x).to_bits(),
            _ => {
                let b = x.to_bits();
                ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
            }
        })
        .collect();
    let values = bits
        .iter()
        .map(|&b| match spec.dtype {
            attn_dsl::DType::F16 => half::f16::from_bits(b).to_f32(),
            _ => f32::from_bits(u32::from(b) << 16),
        })
        .collect();
    (values, bits.iter().flat_map(|b| b.to_le_bytes()).collect())
}

fn check(text: &str, batch: usize, sq: usize, skv: usize, p0: i64) {
    let spec: AttentionSpec = text.parse().unwrap();
    let plan = KernelPlan::forward(&spec);
    assert!(supports(&plan), "{text}");
    let chosen = ForwardKernel {
        kernel: std::sync::Arc::new(lower(&plan)),
        key_tile: key_tile(&plan),
        rows: ROWS,
        inputs: spec.dtype,
        tensor_maps: true,
    };
    codegen::gpu::verify::verify(&chosen.kernel).unwrap();
    let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let (q, qb) = sixteen_bit(&spec, values(batch * h * sq * d, 1));
    let (k, kb) = sixteen_bit(&spec, values(batch * hkv * skv * d, 2));
    let (v, vb) = sixteen_bit(&spec, values(batch * hkv * skv * dv, 3));
    let mut mem = Memory::default();
    let (qa, ka, va) = (
        mem.alloc_bytes(qb),
        mem.alloc_bytes(kb),
        mem.alloc_bytes(vb),
    );
    let out = mem.alloc_f32(&vec![f32::NAN; batch * h * sq * dv]);
    let lse = mem.alloc_f32(&vec![f32::NAN; batch * h * sq]);
    let codes: Vec<u8> = chosen
        .tile_codes(&plan, [batch, sq, skv], p0)
        .iter()
        .flat_map(|c| c.to_le_bytes())
        .collect();
    let codes = mem.alloc_bytes(codes);
    // RoPE tables for every position the call touches (cos and sin times the attention factor).
    let first = p0.min(p0 + skv as i64 - sq as i64);
    let end = p0 + skv as i64;
    let (cos, sin) = match &plan.rope {
        Some(r) => {
            let freqs = match &r.frequencies {
                Frequencies::Static(f) => f.clone(),
                Frequencies::PerLaunch => rope::inv_freq(&r.rope, end as u64),
            };
            let (mut c, mut s) = (Vec::new(), Vec::new());
            for pos in first..end {
                for f in &freqs {
                    let (sn, cs) = (pos as f64 * f).sin_cos();
                    c.push((cs * r.attention_factor) as f32);
                    s.push((sn * r.attention_factor) as f32);
                }
            }
            (mem.alloc_f32(&c), mem.alloc_f32(&s))
        }
        None => (0, 0),
    };
    let mut args: Vec<Val> = [
        qa, ka, va, out, lse, codes, sq as i64, skv as i64, p0, cos, sin, first,
    ]
    .into_iter()
    .map(Val::I64)
    .collect();
    for map in tensor_maps(&plan, [batch, sq, skv], [qa, ka, va]) {
        args.push(Val::I64(mem.alloc_tensor_map(map).unwrap()));
    }
    let qblocks = sq.div_ceil(ROWS as usize);
    run(
        &chosen.kernel,
        [qblocks as u32, h as u32, batch as u32],
        &args,
        &mut mem,
    )
    .unwrap_or_else(|e| panic!("{text}: {e}"));
    let arr = |shape: &[usize], v: &[f32]| {
        Array::from_vec(shape, v.iter().map(|x| f64::from(*x)).collect()).unwrap()
    };
    let want = reference::attention(
        &spec,
        &Inputs {
            q: &arr(&[batch, h, sq, d], &q),
            k: &arr(&[batch, hkv, skv, d], &k),
            v: &arr(&[batch, hkv, skv, dv], &v),
            position_offset: p0,
        },
    )
    .unwrap();
    let what = format!("{text} [B {batch}, Sq {sq}, Skv {skv}, p0 {p0}]");
    // P is rounded to 16 bits before P V, as FlashAttention does.
    let (abs, rel) = (1e-2, 2e-2);
    let got = mem.read_f32(out, batch * h * sq * dv).unwrap();
    for (i, (g, w)) in got.iter().zip(want.out.data()).enumerate() {
        let g = f64::from(*g);
        assert!(
            (g - w).abs() <= abs + rel * w.abs(),
            "{what} out[{i}]: {g} vs {w}"
        );
    }
    let got = mem.read_f32(lse, batch * h * sq).unwrap();
    for (i, (g, w)) in got.iter().zip(want.lse.data()).enumerate() {
        let g = f64::from(*g);
        if w.is_infinite() {
            assert_eq!(g, *w, "{what} lse[{i}]");
        } else {
            assert!(
                (g - w).abs() <= 1e-2 + 1e-5 * w.abs(),
                "{what} lse[{i}]: {g} vs {w}"
            );
        }
    }
}

#[test]
fn causal_and_full_attention_match_the_reference() {
    check(
        "heads = 2, head_dim = 64, dtype = bf16, mask = causal",
        1,
        200,
        200,
        0,
    );
    check("heads = 1, head_dim = 64, dtype = f16", 1, 70, 300, 0);
}

#[test]
fn variants_match_the_reference() {
    for (text, b, sq, skv, p0) in [
        // GQA, ALiBi with a softcap, a window that skips whole tiles, two CTAs per head.
        (
            "heads = 4, kv_heads = 2, head_dim = 64, dtype = bf16, mask = sliding_window(150), \
             position = alibi, softcap = 30.0",
            1,
            260,
            400,
            0,
        ),
        // Top-left causal with Sq < Skv, a custom score and mask, batch 2.
        (
            "heads = 1, head_dim = 64, dtype = bf16, mask = causal(top_left), \
             score_mod = |s, b, h, q, k| s - ((q - k).abs() as f32) * 0.01",
            2,
            40,
            150,
            5,
        ),
    ] {
        check(text, b, sq, skv, p0);
    }
}

#[test]
fn rope_rotated_in_place_by_the_producer_matches_the_reference() {
    for (text, b, sq, skv, p0) in [
        // Every column rotated: f16 Q K^T operands for a bf16 spec.
        (
            "heads = 2, head_dim = 64, dtype = bf16, mask = causal, position = rope",
            1,
            150,
            150,
            0,
        ),
        // Interleaved, partial, YaRN, f16, a position offset, Sq < Skv, GQA.
        (
            "heads = 4, kv_heads = 2, head_dim = 128, dtype = f16, mask = causal, \
             position = rope(dim = 64, layout = interleaved, scaling = yarn(factor = 4.0, \
             original_max_position = 64))",
            1,
            60,
            200,
            17,
        ),
    ] {
        check(text, b, sq, skv, p0);
    }
}

#[test]
fn head_dims_128_and_256_match_the_reference() {
    check(
        "heads = 1, head_dim = 128, dtype = bf16, mask = causal",
        1,
        130,
        130,
        0,
    );
    check("heads = 1, head_dim = 256, dtype = bf16", 1, 64, 100, 0);
}

#[test]
fn odd_head_dims_and_f32_stay_on_the_other_kernels() {
    for text in [
        "heads = 2, head_dim = 96, dtype = bf16",
        "heads = 2, head_dim = 64",
    ] {
        let plan = KernelPlan::forward(&text.parse().unwrap());
        assert!(!supports(&plan), "{text}");
        assert_eq!(forward_tc::supports(&plan), text.contains("bf16"), "{text}");
    }
    let _ = forward_wgmma::params();
}

#[cfg(feature = "llvm")]
mod common;

#[cfg(feature = "llvm")]
#[test]
fn the_kernel_compiles_for_sm_90a_without_spills() {
    use codegen::gpu::llvm::{Arch, emit};
    for text in [
        "heads = 8, head_dim = 64, dtype = bf16, mask = causal",
        "heads = 8, head_dim = 128, dtype = bf16, mask = causal",
        "heads = 8, head_dim = 256, dtype = bf16, mask = causal",
        "heads = 8, head_dim = 128, dtype = bf16, position = alibi, softcap = 30.0",
        "heads = 8, head_dim = 128, dtype = bf16, mask = causal, position = rope",
    ] {
        let plan = KernelPlan::forward(&text.parse().unwrap());
        let out = emit(&lower(&plan), Arch::Sm90a).unwrap();
        let (dec, inc) = if text.contains("rope") {
            (40, 232)
        } else {
            (24, 240)
        };
        for needle in [
            "wgmma.mma_async.sync.aligned".to_string(),
            "cp.async.bulk.tensor.3d".to_string(),
            format!("setmaxnreg.inc.sync.aligned.u32 {inc}"),
            format!("setmaxnreg.dec.sync.aligned.u32 {dec}"),
        ] {
            assert!(out.ptx.contains(&needle), "{text}: {needle}");
        }
        if let Some(report) = common::assemble_report(&out.ptx, Arch::Sm90a, text) {
            for bad in ["C7515", "C7507"] {
                assert!(!report.contains(bad), "{text}: {bad}\n{report}");
            }
            assert!(
                report.contains(" 0 bytes spill stores"),
                "{text}: spills\n{report}"
            );
        }
    }
}
