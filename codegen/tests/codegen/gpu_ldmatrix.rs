//! `ldmatrix` in GPU IR: a one-warp kernel copies four 8x8 matrices of 16-bit values (rows 48
//! bytes apart, as a padded shared-memory tile would be) from global to shared memory, loads
//! them with `ldmatrix`, and stores every lane's registers. The layouts expected here are written
//! out from the PTX ISA, independently of the interpreter. With `cuda`, the kernel compiles to
//! the `ldmatrix` instruction and ptxas assembles it.

use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::ir::build::*;
use codegen::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty};

/// Bytes between the rows of a matrix in the test's shared tile.
const ROW_STRIDE: i64 = 48;
/// Bytes of one matrix (8 rows).
const MATRIX_BYTES: i64 = 8 * ROW_STRIDE;
/// 32-bit words in the shared tile of four matrices.
const WORDS: i64 = 4 * MATRIX_BYTES / 4;

/// The kernel: shared tile <- `src` (param 0); `count` matrices through `ldmatrix`; lane `t`'s
/// register `i` to word `4 t + i` of `out` (param 1). `misalign` shifts every row address.
fn ldmatrix_kernel(count: usize, trans: bool, misalign: i64) -> Kernel {
    let (w, lane_reg) = (Reg(0), Reg(1));
    let dst: Vec<Reg> = (0..count as u32).map(|i| Reg(2 + i)).collect();
    let lane = cast(Expr::Special(Special::Lane), Ty::I64);
    let per_thread = WORDS / 32;
    let copy = vec![Stmt::Store(
        Space::Shared,
        mul(reg(w), i64(4)),
        load(Space::Global, Ty::I32, at(Expr::Param(0), reg(w), 4)),
    )];
    let mut body = vec![
        Stmt::Set(lane_reg, lane),
        Stmt::For {
            reg: w,
            start: mul(reg(lane_reg), i64(per_thread)),
            end: add(mul(reg(lane_reg), i64(per_thread)), i64(per_thread)),
            step: 1,
            body: copy,
        },
        Stmt::Barrier,
        // Lane t addresses row t % 8 of matrix t / 8.
        Stmt::LdMatrix {
            dst: dst.clone(),
            addr: add(
                add(
                    mul(bin(Bin::Div, reg(lane_reg), i64(8)), i64(MATRIX_BYTES)),
                    mul(bin(Bin::Rem, reg(lane_reg), i64(8)), i64(ROW_STRIDE)),
                ),
                i64(misalign),
            ),
            trans,
        },
    ];
    for (i, &r) in dst.iter().enumerate() {
        let word = add(mul(reg(lane_reg), i64(4)), i64(i as i64));
        body.push(Stmt::Store(
            Space::Global,
            at(Expr::Param(1), word, 4),
            reg(r),
        ));
    }
    let mut regs = vec![("w".to_string(), Ty::I64), ("lane".to_string(), Ty::I64)];
    regs.extend((0..count).map(|i| (format!("m{i}"), Ty::I32)));
    Kernel {
        name: "ldmatrix_test".into(),
        params: vec![("src".into(), Ty::I64), ("out".into(), Ty::I64)],
        regs,
        shared_bytes: (4 * MATRIX_BYTES) as u32,
        threads: 32,
        ctas_per_sm: 1,
        body,
    }
}

/// The value the test stores at element (row, col) of matrix m.
fn value(m: usize, row: usize, col: usize) -> u16 {
    (1000 * m + 10 * row + col) as u16
}

/// The shared tile's bytes: 16-bit values little-endian, padding 0xee.
fn tile() -> Vec<u8> {
    let mut bytes = vec![0xee; (4 * MATRIX_BYTES) as usize];
    for m in 0..4 {
        for row in 0..8 {
            for col in 0..8 {
                let at = m * MATRIX_BYTES as usize + row * ROW_STRIDE as usize + 2 * col;
                bytes[at..at + 2].copy_from_slice(&value(m, row, col).to_le_bytes());
            }
        }
    }
    bytes
}

fn run_kernel(kernel: &Kernel) -> Result<Vec<u32>, String> {
    let mut mem = Memory::default();
    let src = mem.alloc_bytes(tile());
    let out = mem.alloc_bytes(vec![0; 4 * 4 * 32]);
    run(kernel, [1, 1, 1], &[Val::I64(src), Val::I64(out)], &mut mem)?;
    let words = mem.read_f32(out, 4 * 32)?;
    Ok(words.into_iter().map(f32::to_bits).collect())
}

#[test]
fn lanes_receive_the_ptx_fragment_layout() {
    for count in [1, 2, 4] {
        for trans in [false, true] {
            let got = run_kernel(&ldmatrix_kernel(count, trans, 0)).unwrap();
            for t in 0..32 {
                let (g, q) = (t / 4, t % 4);
                for m in 0..count {
                    // PTX ISA, "Warp-level matrix load instruction: ldmatrix": thread t holds
                    // row t / 4, columns 2 (t % 4) and 2 (t % 4) + 1; transposed, the same of
                    // the transpose.
                    let (lo, hi) = if trans {
                        (value(m, 2 * q, g), value(m, 2 * q + 1, g))
                    } else {
                        (value(m, g, 2 * q), value(m, g, 2 * q + 1))
                    };
                    let want = (u32::from(hi) << 16) | u32::from(lo);
                    assert_eq!(
                        got[4 * t + m],
                        want,
                        "x{count} trans {trans}: lane {t} matrix {m}"
                    );
                }
            }
        }
    }
}

#[test]
fn misaligned_rows_and_partial_warps_are_errors() {
    let e = run_kernel(&ldmatrix_kernel(4, false, 4)).unwrap_err();
    assert!(e.contains("16-byte aligned"), "{e}");
    let mut k = ldmatrix_kernel(2, true, 0);
    let lane = cast(Expr::Special(Special::Lane), Ty::I64);
    let ld = k.body.remove(3);
    k.body
        .insert(3, Stmt::If(bin(Bin::Lt, lane, i64(16)), vec![ld], vec![]));
    let e = run_kernel(&k).unwrap_err();
    assert!(e.contains("all 32 lanes"), "{e}");
}

#[cfg(feature = "llvm")]
use crate::support;

#[cfg(feature = "llvm")]
#[test]
fn ldmatrix_compiles_to_the_instruction() {
    use codegen::gpu::llvm::{Arch, emit};
    for (count, trans) in [(1, false), (2, true), (4, false), (4, true)] {
        let out = emit(&ldmatrix_kernel(count, trans, 0), Arch::Sm90).unwrap();
        let name = format!(
            "ldmatrix.sync.aligned.m8n8.x{count}{}.shared.b16",
            if trans { ".trans" } else { "" }
        );
        assert!(out.ptx.contains(&name), "{name} not in\n{}", out.ptx);
        support::assemble(&out.ptx, Arch::Sm90, &format!("ldmatrix-x{count}-{trans}"));
    }
}
