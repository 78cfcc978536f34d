//! `cp.async` in GPU IR: a one-warp kernel copies two groups of 16-byte chunks from global to
//! shared memory (the last chunks of the first group partly or wholly zero-filled), waits for
//! one group at a time, and writes what each thread reads (its neighbour's chunk, across a
//! barrier) back to global memory. The interpreter must land the bytes at the wait and reject
//! reads before it, misaligned copies and copies never waited for. With `cuda`, the kernel
//! compiles to the `cp.async` instructions and ptxas assembles it.

use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::ir::build::*;
use codegen::gpu::ir::{Bin, Expr, Kernel, Reg, Space, Special, Stmt, Ty};

/// How the test kernel departs from the correct one.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    None,
    ReadBeforeWait,
    Misaligned,
    NeverWaited,
}

/// Params: `src` (1024 bytes), `out` (1024 bytes), `valid` (bytes of the first group's 512 to
/// read; the rest zero-filled).
fn kernel(fault: Fault) -> Kernel {
    let t = Reg(0);
    let lane = cast(Expr::Special(Special::Lane), Ty::I64);
    let chunk = |group: i64| add(mul(reg(t), i64(16)), i64(512 * group));
    let src_offset = if fault == Fault::Misaligned { 4 } else { 0 };
    let copy = |group: i64, bytes: Expr| Stmt::CpAsync {
        dst: chunk(group),
        src: add(add(Expr::Param(0), chunk(group)), i64(src_offset)),
        src_bytes: bytes,
    };
    // Bytes of this thread's first-group chunk that are read: clamp(valid - 16 t, 0, 16).
    let first_bytes = cast(
        bin(
            Bin::Min,
            bin(Bin::Max, sub(Expr::Param(2), mul(reg(t), i64(16))), i64(0)),
            i64(16),
        ),
        Ty::I32,
    );
    // Thread t copies its neighbour's chunk of a group to out.
    let read_back = |group: i64| -> Vec<Stmt> {
        let from = add(
            mul(bin(Bin::Rem, add(reg(t), i64(1)), i64(32)), i64(16)),
            i64(512 * group),
        );
        (0..4)
            .map(|w| {
                Stmt::Store(
                    Space::Global,
                    add(add(Expr::Param(1), chunk(group)), i64(4 * w)),
                    load(Space::Shared, Ty::I32, add(from.clone(), i64(4 * w))),
                )
            })
            .collect()
    };
    let mut body = vec![
        Stmt::Set(t, lane),
        copy(0, first_bytes),
        Stmt::CpAsyncCommit,
        copy(1, Expr::Int(16, Ty::I32)),
        Stmt::CpAsyncCommit,
    ];
    if fault != Fault::NeverWaited {
        if fault != Fault::ReadBeforeWait {
            body.push(Stmt::CpAsyncWait(1));
        }
        body.push(Stmt::Barrier);
        body.extend(read_back(0));
        body.push(Stmt::CpAsyncWait(0));
        body.push(Stmt::Barrier);
        body.extend(read_back(1));
    }
    Kernel {
        name: "cp_async_test".into(),
        params: ["src", "out", "valid"]
            .iter()
            .map(|n| (n.to_string(), Ty::I64))
            .collect(),
        regs: vec![("t".into(), Ty::I64)],
        shared_bytes: 1024,
        threads: 32,
        ctas_per_sm: 1,
        body,
    }
}

fn run_kernel(fault: Fault, valid: i64) -> Result<Vec<u8>, String> {
    let mut mem = Memory::default();
    let src = mem.alloc_bytes((0..1024).map(|i| (i % 251 + 1) as u8).collect());
    let out = mem.alloc_bytes(vec![0xaa; 1024]);
    run(
        &kernel(fault),
        [1, 1, 1],
        &[Val::I64(src), Val::I64(out), Val::I64(valid)],
        &mut mem,
    )?;
    let words = mem.read_f32(out, 256)?;
    Ok(words
        .into_iter()
        .flat_map(|w| w.to_bits().to_le_bytes())
        .collect())
}

#[test]
fn copies_land_at_the_wait_with_zero_fill() {
    for valid in [512, 200, 0] {
        let got = run_kernel(Fault::None, valid).unwrap();
        for t in 0..32usize {
            let neighbour = (t + 1) % 32;
            for group in 0..2 {
                for b in 0..16 {
                    let source = 512 * group + 16 * neighbour + b;
                    let read = group == 1 || (source as i64) < valid;
                    let want = if read { (source % 251 + 1) as u8 } else { 0 };
                    assert_eq!(
                        got[512 * group + 16 * t + b],
                        want,
                        "valid {valid}: thread {t}, group {group}, byte {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn races_misalignment_and_forgotten_waits_are_errors() {
    let e = run_kernel(Fault::ReadBeforeWait, 512).unwrap_err();
    assert!(e.contains("races a cp.async"), "{e}");
    let e = run_kernel(Fault::Misaligned, 512).unwrap_err();
    assert!(e.contains("16-byte aligned"), "{e}");
    let e = run_kernel(Fault::NeverWaited, 512).unwrap_err();
    assert!(e.contains("never waited"), "{e}");
}

#[cfg(feature = "llvm")]
use crate::support;

#[cfg(feature = "llvm")]
#[test]
fn cp_async_compiles_to_the_instructions() {
    use codegen::gpu::llvm::{Arch, emit};
    for arch in [Arch::Sm80, Arch::Sm90] {
        let out = emit(&kernel(Fault::None), arch).unwrap();
        for instruction in [
            "cp.async.cg.shared.global",
            "cp.async.commit_group",
            "cp.async.wait_group 1",
        ] {
            assert!(
                out.ptx.contains(instruction),
                "{instruction} not in\n{}",
                out.ptx
            );
        }
        support::assemble(&out.ptx, arch, "cp_async");
    }
}
