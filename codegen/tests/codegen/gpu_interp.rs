//! The GPU forward kernels (SIMT f32, tensor cores with bf16 inputs, and sm_90a with TMA and
//! `wgmma`), run by the GPU IR interpreter, against `attn_dsl::reference`: every kind of
//! variant, lengths that break the tiles, RoPE. With `llvm`, the sm_90a kernel's PTX holds
//! `wgmma.mma_async`, `cp.async.bulk.tensor` and `setmaxnreg`, and ptxas assembles it with no
//! spills, no serialized `wgmma` and no ignored `setmaxnreg`.

use attn_dsl::AttentionSpec;
use attn_dsl::inputs::values;
use attn_dsl::reference::{self, Array, Inputs, rope};
use codegen::KernelPlan;
use codegen::gpu::choice::{Call, ForwardChoice, Target, choose};
use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::kernels::forward::{ROWS, key_tile, lower};
use codegen::gpu::kernels::{forward_tc, forward_wgmma};
use codegen::gpu::{ForwardKernel, forward_kernel};
use codegen::plan::Frequencies;

/// bf16 rounding (to nearest even).
fn bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    f32::from_bits((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
}

/// Runs the kernel of `text` on the interpreter and checks it against the reference.
fn check(text: &str, batch: usize, sq: usize, skv: usize, p0: i64) {
    let spec: AttentionSpec = text.parse().unwrap();
    let plan = KernelPlan::forward(&spec);
    let simt = ForwardKernel {
        kernel: std::sync::Arc::new(lower(&plan)),
        key_tile: key_tile(&plan),
        rows: ROWS,
        inputs: attn_dsl::DType::F32,
        tensor_maps: false,
    };
    check_kernel(text, &simt, (1e-5, 1e-4), batch, sq, skv, p0);
}

/// The same through the tensor-core kernel (a bf16 spec: inputs are bf16 values; P is rounded
/// to bf16 before `P V`, as FlashAttention-2 does, hence the wider tolerance).
fn check_tc(text: &str, batch: usize, sq: usize, skv: usize, p0: i64) {
    let spec: AttentionSpec = text.parse().unwrap();
    let plan = KernelPlan::forward(&spec);
    assert!(forward_tc::supports(&plan), "{text}");
    check_kernel(
        text,
        &forward_kernel(&plan).unwrap(),
        (1e-2, 2e-2),
        batch,
        sq,
        skv,
        p0,
    );
}

/// The same through the sm_90a kernel (TMA producer, `wgmma` consumers; 16-bit inputs, P
/// rounded to 16 bits before `P V`).
fn check_wgmma(text: &str, batch: usize, sq: usize, skv: usize, p0: i64) {
    let spec: AttentionSpec = text.parse().unwrap();
    let chosen = ForwardChoice::Wgmma
        .lower(&KernelPlan::forward(&spec))
        .unwrap_or_else(|e| panic!("not an sm_90a spec: {text}: {e}"));
    check_kernel(text, &chosen, (1e-2, 2e-2), batch, sq, skv, p0);
}

#[allow(clippy::too_many_arguments)]
fn check_kernel(
    text: &str,
    chosen: &ForwardKernel,
    (abs, rel): (f64, f64),
    batch: usize,
    sq: usize,
    skv: usize,
    p0: i64,
) {
    let spec: AttentionSpec = text.parse().unwrap();
    let plan = KernelPlan::forward(&spec);
    let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let round = |v: Vec<f32>| -> Vec<f32> {
        match spec.dtype {
            attn_dsl::DType::Bf16 => v.into_iter().map(bf16).collect(),
            attn_dsl::DType::F16 => v
                .into_iter()
                .map(|x| half::f16::from_f32(x).to_f32())
                .collect(),
            attn_dsl::DType::F32 => v,
        }
    };
    let q = round(values(batch * h * sq * d, 1));
    let k = round(values(batch * hkv * skv * d, 2));
    let v = round(values(batch * hkv * skv * dv, 3));
    let mut mem = Memory::default();
    // The tensor-core kernel reads the spec's 16-bit format (the values are exact in it); the
    // SIMT kernel f32.
    let mut input = |values: &[f32]| {
        if chosen.inputs == attn_dsl::DType::F32 {
            return mem.alloc_f32(values);
        }
        let bits = |x: &f32| match spec.dtype {
            attn_dsl::DType::F16 => half::f16::from_f32(*x).to_bits(),
            _ => (x.to_bits() >> 16) as u16,
        };
        mem.alloc_bytes(values.iter().flat_map(|x| bits(x).to_le_bytes()).collect())
    };
    let (qa, ka, va) = (input(&q), input(&k), input(&v));
    let out = mem.alloc_f32(&vec![f32::NAN; batch * h * sq * dv]);
    let lse = mem.alloc_f32(&vec![f32::NAN; batch * h * sq]);
    let codes: Vec<u8> = chosen
        .tile_codes(&plan, [batch, sq, skv], p0, None)
        .iter()
        .flat_map(|c| c.to_le_bytes())
        .collect();
    let qblocks = sq.div_ceil(chosen.rows as usize);
    let codes = mem.alloc_bytes(codes);
    // RoPE tables for every position the call touches.
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
        qa, ka, va, out, lse, codes, sq as i64, skv as i64, p0, cos, sin, cos, sin, first, 0,
    ]
    .into_iter()
    .map(Val::I64)
    .collect();
    if chosen.tensor_maps {
        for map in forward_wgmma::tensor_maps(&plan, [batch, sq, skv], [qa, ka, va]) {
            args.push(Val::I64(mem.alloc_tensor_map(map).unwrap()));
        }
    }
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
    for (i, (g, w)) in mem
        .read_f32(out, batch * h * sq * dv)
        .unwrap()
        .iter()
        .zip(want.out.data())
        .enumerate()
    {
        let g = f64::from(*g);
        assert!(
            (g - w).abs() <= abs + rel * w.abs(),
            "{what} out[{i}]: {g} vs {w}"
        );
    }
    for (i, (g, w)) in mem
        .read_f32(lse, batch * h * sq)
        .unwrap()
        .iter()
        .zip(want.lse.data())
        .enumerate()
    {
        let g = f64::from(*g);
        if w.is_infinite() {
            assert_eq!(g, *w, "{what} lse[{i}]");
        } else {
            assert!(
                (g - w).abs() <= abs.max(1e-4) + 1e-5 * w.abs(),
                "{what} lse[{i}]: {g} vs {w}"
            );
        }
    }
}

#[test]
fn the_simt_kernel_matches_the_reference() {
    for (text, b, sq, skv, p0) in [
        ("heads = 2, head_dim = 16", 1, 7, 40, 0),
        (
            "heads = 4, kv_heads = 2, head_dim = 16, mask = causal",
            2,
            70,
            70,
            0,
        ),
        (
            "heads = 2, kv_heads = 1, head_dim = 16, v_head_dim = 8, mask = causal(top_left)",
            1,
            9,
            37,
            0,
        ),
        (
            "heads = 3, head_dim = 8, mask = sliding_window(11), position = alibi",
            1,
            40,
            45,
            3,
        ),
        (
            "heads = 2, head_dim = 24, mask = causal, softcap = 2.0, scale = 0.5",
            1,
            33,
            33,
            0,
        ),
        (
            "heads = 2, head_dim = 16, mask = causal, position = rope(base = 500.0)",
            1,
            20,
            50,
            7,
        ),
        (
            "heads = 2, head_dim = 12, position = rope(dim = 8, layout = interleaved, scaling = \
             yarn(factor = 4.0, original_max_position = 16))",
            1,
            5,
            30,
            0,
        ),
        (
            "heads = 2, head_dim = 8, score_mod = |s, b, h, q, k| if k % 3 == 0 { s.tanh() } \
             else { (s * 0.5).exp().ln() + ((k - q) as f32).abs().sqrt().min(2.0) }, \
             mask_mod = |b, h, q, k| k % 5 != 1 && (b + h + q - k) / (k - 7) != 3",
            2,
            12,
            20,
            0,
        ),
        ("heads = 2, head_dim = 8, mask = causal", 1, 1, 1, 0),
        ("heads = 2, head_dim = 8, mask = causal", 1, 5, 3, 0),
    ] {
        check(text, b, sq, skv, p0);
    }
}

#[test]
fn the_kernel_prints_as_gpu_ir() {
    let spec: AttentionSpec = "heads = 2, head_dim = 4, mask = causal".parse().unwrap();
    let text = lower(&KernelPlan::forward(&spec)).to_string();
    assert!(
        text.starts_with("kernel attention_forward($q: i64"),
        "{text}"
    );
    for needle in [
        "bar.sync",
        "ex2.ftz(",
        "ld.shared.f32",
        "st.global",
        "for %tile in",
    ] {
        assert!(text.contains(needle), "{needle} missing in\n{text}");
    }
}

#[test]
fn gpu_ir_snapshots() {
    for (name, text) in [
        ("gpu_causal_d4", "heads = 2, head_dim = 4, mask = causal"),
        (
            "gpu_alibi_softcap_window_d4",
            "heads = 2, head_dim = 4, mask = sliding_window(8), position = alibi, softcap = 20.0",
        ),
        (
            "gpu_rope_custom_mask_d4",
            "heads = 2, head_dim = 4, position = rope, mask_mod = |b, h, q, k| (q / 4) == (k / 4)",
        ),
        // The tensor-core kernel: Q staging, the copy schedule, ldmatrix and mma, the masked
        // and full tile paths.
        (
            "gpu_tc_causal_d16",
            "heads = 1, head_dim = 16, mask = causal, dtype = bf16",
        ),
    ] {
        let spec: AttentionSpec = text.parse().unwrap();
        let kernel = forward_kernel(&KernelPlan::forward(&spec)).unwrap().kernel;
        insta::assert_snapshot!(name, kernel.to_string());
    }
}

#[test]
fn the_tensor_core_kernel_matches_the_reference() {
    for (text, b, sq, skv, p0) in [
        ("heads = 2, head_dim = 16, dtype = bf16", 1, 7, 40, 0),
        (
            "heads = 4, kv_heads = 2, head_dim = 32, mask = causal, dtype = bf16",
            1,
            70,
            70,
            0,
        ),
        (
            "heads = 2, head_dim = 16, v_head_dim = 8, mask = sliding_window(11), position = alibi, \
             softcap = 5.0, dtype = bf16",
            2,
            20,
            45,
            3,
        ),
        (
            "heads = 2, head_dim = 32, mask = causal, position = rope(base = 500.0), dtype = bf16",
            1,
            20,
            50,
            7,
        ),
        (
            "heads = 2, head_dim = 16, position = rope(layout = interleaved), mask_mod = \
             |b, h, q, k| (q / 4) == (k / 4) || k == 0, dtype = bf16",
            1,
            12,
            12,
            0,
        ),
        (
            "heads = 2, head_dim = 16, mask = causal, dtype = bf16",
            1,
            5,
            3,
            0,
        ),
        // f16 storage: f16 fragments and mma.
        (
            "heads = 2, kv_heads = 1, head_dim = 64, mask = causal, position = rope, dtype = f16",
            1,
            70,
            90,
            5,
        ),
        // Many key tiles, those before the window skipped: copies issued for a tile, prefetched
        // for the next, or neither (the interpreter rejects any read of a copy in flight).
        (
            "heads = 2, head_dim = 32, mask = sliding_window(40), dtype = bf16",
            1,
            300,
            300,
            0,
        ),
        (
            "heads = 1, head_dim = 128, mask = causal, position = alibi, dtype = bf16",
            1,
            150,
            200,
            0,
        ),
        // Three k-steps and three value blocks (an ldmatrix.x4 and an .x2 each), and RoPE
        // pairs that straddle lane columns (each key staged by one thread).
        (
            "heads = 2, head_dim = 48, v_head_dim = 24, mask = causal, position = rope(dim = 12), \
             dtype = bf16",
            1,
            33,
            40,
            2,
        ),
        // Two row blocks, 32-key tiles, RoPE rotated in shared memory with each tile's cos and
        // sin rows copied beside K (llama3 scaling), over two CTAs and five tiles, GQA.
        (
            "heads = 4, kv_heads = 1, head_dim = 128, mask = causal, dtype = bf16, \
             position = rope(base = 500000.0, scaling = llama3(factor = 8.0, \
             low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position = 64))",
            1,
            140,
            150,
            3,
        ),
        // Past head dim 128: one row block per warp, 16-key tiles.
        (
            "heads = 1, head_dim = 144, mask = causal, position = rope(dim = 32), dtype = bf16",
            1,
            70,
            75,
            1,
        ),
    ] {
        check_tc(text, b, sq, skv, p0);
    }
}

/// The twelve-warp tiling (one row block per warp, three CTAs per SM) on specs whose default
/// takes two row blocks, and on one that takes one: the same results as the reference.
#[test]
fn the_twelve_warp_tiling_matches_the_reference() {
    for (text, b, sq, skv, p0) in [
        (
            "heads = 4, kv_heads = 2, head_dim = 64, mask = causal, dtype = bf16",
            1,
            150,
            150,
            0,
        ),
        ("heads = 2, head_dim = 128, dtype = f16", 2, 70, 90, 0),
        (
            "heads = 2, head_dim = 64, mask = causal, position = rope, dtype = bf16",
            1,
            40,
            100,
            9,
        ),
        (
            "heads = 2, head_dim = 32, position = alibi, softcap = 20.0, dtype = bf16",
            1,
            33,
            65,
            0,
        ),
    ] {
        let plan = KernelPlan::forward(&text.parse::<AttentionSpec>().unwrap());
        let target = Target {
            twelve_warps: true,
            ..Target::default()
        };
        let choice = choose(Call::Forward { wide: false }, &plan, target);
        let kernel = choice.forward().unwrap().lower(&plan).unwrap();
        assert_eq!((kernel.rows, kernel.kernel.ctas_per_sm), (64, 3), "{text}");
        check_kernel(text, &kernel, (1e-2, 2e-2), b, sq, skv, p0);
    }
}

/// `ex2.ftz` flushes what `ex2` keeps: a subnormal result (2^-130) becomes 0, and a subnormal
/// input counts as 0; normal values agree with `ex2`.
#[test]
fn ex2_ftz_flushes_subnormals() {
    use codegen::gpu::ir::build::{add, f32, i64, un};
    use codegen::gpu::ir::{Expr, Kernel, Space, Stmt, Ty, Un};
    let inputs = [-130.0, -10.0, 0.5, f32::from_bits(1), f32::NEG_INFINITY];
    let mut body = Vec::new();
    for (i, &x) in inputs.iter().enumerate() {
        for (j, op) in [Un::Ex2, Un::Ex2Ftz].into_iter().enumerate() {
            let at = add(Expr::Param(0), i64(4 * (2 * i + j) as i64));
            body.push(Stmt::Store(Space::Global, at, un(op, f32(x))));
        }
    }
    let kernel = Kernel {
        name: "ex2_test".into(),
        params: vec![("out".into(), Ty::I64)],
        regs: Vec::new(),
        shared_bytes: 0,
        threads: 1,
        ctas_per_sm: 1,
        body,
    };
    let mut mem = Memory::default();
    let out = mem.alloc_f32(&[f32::NAN; 10]);
    run(&kernel, [1, 1, 1], &[Val::I64(out)], &mut mem).unwrap();
    let got = mem.read_f32(out, 10).unwrap();
    // 2^-130: the subnormal with bit 149 - 130 set.
    assert_eq!(
        got[0],
        f32::from_bits(1 << 19),
        "ex2(-130) is subnormal, kept"
    );
    assert!(got[0] > 0.0 && got[0].is_subnormal());
    assert_eq!(got[1], 0.0, "ex2.ftz(-130) flushes");
    assert_eq!((got[2], got[3]), (2f32.powi(-10), 2f32.powi(-10)));
    assert_eq!(got[4], got[5]);
    assert!((got[4] - std::f32::consts::SQRT_2).abs() < 1e-6);
    assert_eq!(got[7], 1.0, "a subnormal input counts as 0");
    assert_eq!((got[8], got[9]), (0.0, 0.0));
}

#[test]
fn the_sm_90a_kernel_matches_the_reference_causal_and_full() {
    check_wgmma(
        "heads = 2, head_dim = 64, dtype = bf16, mask = causal",
        1,
        200,
        200,
        0,
    );
    check_wgmma("heads = 1, head_dim = 64, dtype = f16", 1, 70, 300, 0);
}

/// `normalize = sigmoid` on the tensor-core forward kernels: each score's weight in place of
/// the online softmax, unnormalized outputs, `lse = ln l`. With a bias (scores in half base-2
/// units), GQA over several tiles, and with none (raw scores where the scale folds).
#[test]
fn the_tensor_core_kernels_take_sigmoid_weights() {
    check_tc(
        "heads = 4, kv_heads = 2, head_dim = 32, mask = causal, dtype = bf16, \
         normalize = sigmoid(bias = -3.0)",
        1,
        70,
        70,
        0,
    );
    check_tc(
        "heads = 2, head_dim = 16, dtype = f16, normalize = sigmoid(bias = 0.0)",
        2,
        20,
        45,
        3,
    );
    check_wgmma(
        "heads = 2, head_dim = 64, mask = causal, dtype = bf16, normalize = sigmoid(bias = -ln(64))",
        1,
        70,
        90,
        0,
    );
    // Stick-breaking's chain of keys stays on the SIMT kernels.
    let stick = "heads = 2, head_dim = 64, dtype = bf16, normalize = stick_breaking";
    let plan = KernelPlan::forward(&stick.parse::<AttentionSpec>().unwrap());
    assert!(!forward_tc::supports(&plan) && !forward_wgmma::supports(&plan));
}

#[test]
fn the_sm_90a_kernel_matches_the_reference_for_variants() {
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
        check_wgmma(text, b, sq, skv, p0);
    }
}

#[test]
fn the_sm_90a_kernel_matches_the_reference_under_rope() {
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
        check_wgmma(text, b, sq, skv, p0);
    }
}

#[test]
fn the_sm_90a_kernel_matches_the_reference_at_head_dims_128_and_256() {
    check_wgmma(
        "heads = 1, head_dim = 128, dtype = bf16, mask = causal",
        1,
        130,
        130,
        0,
    );
    check_wgmma("heads = 1, head_dim = 256, dtype = bf16", 1, 64, 100, 0);
}

#[test]
fn odd_head_dims_and_f32_stay_off_the_sm_90a_kernel() {
    for text in [
        "heads = 2, head_dim = 96, dtype = bf16",
        "heads = 2, head_dim = 64",
    ] {
        let plan = KernelPlan::forward(&text.parse().unwrap());
        assert!(!forward_wgmma::supports(&plan), "{text}");
        assert_eq!(forward_tc::supports(&plan), text.contains("bf16"), "{text}");
    }
}

#[cfg(feature = "llvm")]
use crate::support;

#[cfg(feature = "llvm")]
#[test]
fn the_sm_90a_kernel_compiles_without_spills() {
    use codegen::gpu::llvm::{Arch, emit};
    for text in [
        "heads = 8, head_dim = 64, dtype = bf16, mask = causal",
        "heads = 8, head_dim = 128, dtype = bf16, mask = causal",
        "heads = 8, head_dim = 256, dtype = bf16, mask = causal",
        "heads = 8, head_dim = 128, dtype = bf16, position = alibi, softcap = 30.0",
        "heads = 8, head_dim = 128, dtype = bf16, mask = causal, position = rope",
    ] {
        let plan = KernelPlan::forward(&text.parse().unwrap());
        let out = emit(&forward_wgmma::lower(&plan), Arch::Sm90a).unwrap();
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
        if let Some(report) = support::assemble_report(&out.ptx, Arch::Sm90a, text) {
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
