//! `mma.sync.m16n8k16` (bf16 in, f32 accumulate) in GPU IR: a one-warp kernel that loads A and
//! B into fragments by the PTX ISA layout, multiplies, and stores D by the same layout. On the
//! interpreter it must equal a plain matrix product of the bf16-rounded inputs; with `cuda`, it
//! compiles to the `mma.sync` PTX instruction and ptxas assembles it. (That the layout matches
//! the hardware is checked on a device by scripts/gpu-check.sh.)

use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::ir::build::*;
use codegen::gpu::ir::{Bin, Expr, Half, Kernel, Reg, Space, Special, Stmt, Ty};

/// The kernel: `D[16][8] = A[16][16] B[16][8] + C` with C = `init` everywhere, A and B rounded
/// to `half`; matrices row-major f32 in global memory (params a, b, d).
fn mma_kernel(init: f32, half: Half) -> Kernel {
    let names = [
        "g", "q", "a0", "a1", "a2", "a3", "b0", "b1", "c0", "c1", "c2", "c3",
    ];
    let tys = [
        Ty::I64,
        Ty::I64,
        Ty::I32,
        Ty::I32,
        Ty::I32,
        Ty::I32,
        Ty::I32,
        Ty::I32,
        Ty::F32,
        Ty::F32,
        Ty::F32,
        Ty::F32,
    ];
    let r = |i: u32| Reg(i);
    let (g, q) = (r(0), r(1));
    let a = [r(2), r(3), r(4), r(5)];
    let b = [r(6), r(7)];
    let c = [r(8), r(9), r(10), r(11)];
    let lane = cast(Expr::Special(Special::Lane), Ty::I64);
    let elem = |param: u32, row: Expr, col: Expr, width: i64| {
        load(
            Space::Global,
            Ty::F32,
            at(Expr::Param(param), add(mul(row, i64(width)), col), 4),
        )
    };
    let mut body = vec![
        Stmt::Set(g, bin(Bin::Div, lane.clone(), i64(4))),
        Stmt::Set(q, bin(Bin::Rem, lane, i64(4))),
    ];
    for (i, &ai) in a.iter().enumerate() {
        let row = add(reg(g), i64(8 * (i as i64 % 2)));
        let col = add(mul(reg(q), i64(2)), i64(8 * (i as i64 / 2)));
        let lo = elem(0, row.clone(), col.clone(), 16);
        let hi = elem(0, row, add(col, i64(1)), 16);
        body.push(Stmt::Set(
            ai,
            Expr::PackHalf(half, Box::new(lo), Box::new(hi)),
        ));
    }
    for (i, &bi) in b.iter().enumerate() {
        let k = add(mul(reg(q), i64(2)), i64(8 * i as i64));
        let lo = elem(1, k.clone(), reg(g), 8);
        let hi = elem(1, add(k, i64(1)), reg(g), 8);
        body.push(Stmt::Set(
            bi,
            Expr::PackHalf(half, Box::new(lo), Box::new(hi)),
        ));
    }
    for &ci in &c {
        body.push(Stmt::Set(ci, f32(init)));
    }
    body.push(Stmt::Mma {
        half,
        d: c,
        a,
        b,
        c,
    });
    for (i, &ci) in c.iter().enumerate() {
        let row = add(reg(g), i64(8 * (i as i64 / 2)));
        let col = add(mul(reg(q), i64(2)), i64(i as i64 % 2));
        let addr = at(Expr::Param(2), add(mul(row, i64(8)), col), 4);
        body.push(Stmt::Store(Space::Global, addr, reg(ci)));
    }
    Kernel {
        name: "mma_test".into(),
        params: ["a", "b", "d"]
            .iter()
            .map(|n| (n.to_string(), Ty::I64))
            .collect(),
        regs: names
            .iter()
            .zip(tys)
            .map(|(n, t)| (n.to_string(), t))
            .collect(),
        shared_bytes: 0,
        threads: 32,
        ctas_per_sm: 1,
        body,
    }
}

/// bf16 rounding (to nearest even), independent of the interpreter's.
fn bf16(x: f32) -> f64 {
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    f64::from(f32::from_bits((bits + 0x7fff + lsb) & 0xffff_0000))
}

/// `x` rounded to the format (to nearest even), independently of the interpreter's rounding.
fn round(x: f32, half: Half) -> f64 {
    match half {
        Half::Bf16 => bf16(x),
        Half::F16 => f64::from(half::f16::from_f32(x).to_f32()),
    }
}

#[test]
fn mma_fragments_multiply_like_a_matrix_product() {
    let a: Vec<f32> = (0..256)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
        .collect();
    let b: Vec<f32> = (0..128)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0)
        .collect();
    let init = 0.25;
    for half in [Half::Bf16, Half::F16] {
        let mut mem = Memory::default();
        let (pa, pb) = (mem.alloc_f32(&a), mem.alloc_f32(&b));
        let pd = mem.alloc_f32(&[f32::NAN; 128]);
        run(
            &mma_kernel(init, half),
            [1, 1, 1],
            &[Val::I64(pa), Val::I64(pb), Val::I64(pd)],
            &mut mem,
        )
        .unwrap();
        let d = mem.read_f32(pd, 128).unwrap();
        for row in 0..16 {
            for col in 0..8 {
                let want: f64 = (0..16)
                    .map(|k| round(a[row * 16 + k], half) * round(b[k * 8 + col], half))
                    .sum::<f64>()
                    + f64::from(init);
                let got = f64::from(d[row * 8 + col]);
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "{half:?} D[{row}][{col}] = {got}, want {want}"
                );
            }
        }
    }
}

#[test]
fn mma_needs_the_whole_warp() {
    let mut k = mma_kernel(0.0, Half::Bf16);
    let body = std::mem::take(&mut k.body);
    let lane = cast(Expr::Special(Special::Lane), Ty::I64);
    k.body = vec![Stmt::If(bin(Bin::Lt, lane, i64(31)), body, vec![])];
    let mut mem = Memory::default();
    let (pa, pb) = (mem.alloc_f32(&[0.0; 256]), mem.alloc_f32(&[0.0; 128]));
    let pd = mem.alloc_f32(&[0.0; 128]);
    let e = run(
        &k,
        [1, 1, 1],
        &[Val::I64(pa), Val::I64(pb), Val::I64(pd)],
        &mut mem,
    )
    .unwrap_err();
    assert!(e.contains("all 32 lanes"), "{e}");
}

#[cfg(feature = "llvm")]
use crate::support;

#[cfg(feature = "llvm")]
#[test]
fn mma_compiles_to_the_tensor_core_instruction() {
    use codegen::gpu::llvm::{Arch, emit};
    for (arch, half) in [
        (Arch::Sm80, Half::Bf16),
        (Arch::Sm90, Half::Bf16),
        (Arch::Sm80, Half::F16),
        (Arch::Sm90, Half::F16),
    ] {
        let out = emit(&mma_kernel(0.0, half), arch).unwrap();
        let (mma, cvt) = match half {
            Half::Bf16 => (
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                "cvt.rn.bf16x2.f32",
            ),
            Half::F16 => (
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                "cvt.rn.f16x2.f32",
            ),
        };
        assert!(out.ptx.contains(mma), "{mma} not in\n{}", out.ptx);
        assert!(out.ptx.contains(cvt), "{cvt} not in\n{}", out.ptx);
        support::assemble(&out.ptx, arch, "mma");
    }
}
