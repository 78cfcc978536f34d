//! Hopper's asynchronous operations in GPU IR: a warp-specialized product `C = A B^T` whose
//! producer warpgroup brings K-chunks of A and B into a two-stage shared ring by TMA (128-byte
//! swizzle), guarded by full and empty mbarriers, and whose consumer warpgroup multiplies them
//! with `wgmma` (both operands K-major through matrix descriptors); and `C = P V` with P in
//! registers and V N-major (the attention forward's second product). On the interpreter they
//! must equal plain products of the rounded inputs, and each synchronization left out must be
//! an error. With `llvm`, they compile to `wgmma.mma_async`, `cp.async.bulk.tensor`,
//! `mbarrier.try_wait.parity` and `setmaxnreg` for sm_90a, and ptxas assembles them without
//! spills or serialized `wgmma`.

use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::ir::build::*;
use codegen::gpu::ir::tma::{Swizzle, TensorMap};
use codegen::gpu::ir::{Bin, Expr, Half, Kernel, Reg, Space, Special, Stmt, Ty, Wgmma, WgmmaA};

/// Registers of a kernel under construction.
#[derive(Default)]
struct Regs(Vec<(String, Ty)>);

impl Regs {
    fn add(&mut self, name: &str, ty: Ty) -> Reg {
        self.0.push((name.to_string(), ty));
        Reg(self.0.len() as u32 - 1)
    }
}

fn tid() -> Expr {
    cast(Expr::Special(Special::Tid), Ty::I64)
}

fn lane() -> Expr {
    cast(Expr::Special(Special::Lane), Ty::I64)
}

fn i32c(x: i64) -> Expr {
    Expr::Int(x, Ty::I32)
}

fn when(c: Expr, then: Vec<Stmt>) -> Stmt {
    Stmt::If(c, then, vec![])
}

/// A 128-byte-swizzled K-major descriptor of the tile at shared offset `at` (rows of 128
/// bytes, 8-row groups 1024 bytes apart).
fn k_major(at: Expr) -> Expr {
    let start = bin(
        Bin::Div,
        bin(Bin::And, Expr::SharedAddress(Box::new(at)), i64(0x3ffff)),
        i64(16),
    );
    bin(Bin::Or, start, i64((1 << 16) | (64 << 32) | (1 << 62)))
}

/// A 128-byte-swizzled N-major descriptor of the tile at `at`: 64-column blocks `block` bytes
/// apart, rows of 128 bytes, 8-row groups 1024 bytes apart.
fn n_major(at: Expr, block: i64) -> Expr {
    let start = bin(
        Bin::Div,
        bin(Bin::And, Expr::SharedAddress(Box::new(at)), i64(0x3ffff)),
        i64(16),
    );
    bin(
        Bin::Or,
        start,
        i64(((block >> 4) << 16) | (64 << 32) | (1 << 62)),
    )
}

/// Stores a warpgroup's accumulator (`n` columns) row-major into f32 `out` (param `param`).
fn store_accumulator(r: &mut Regs, d: &[Reg], n: usize, param: u32) -> Vec<Stmt> {
    let (warp, g, q) = (
        r.add("warp", Ty::I64),
        r.add("g", Ty::I64),
        r.add("q", Ty::I64),
    );
    let mut out = vec![
        Stmt::Set(warp, bin(Bin::Div, bin(Bin::Rem, tid(), i64(128)), i64(32))),
        Stmt::Set(g, bin(Bin::Div, lane(), i64(4))),
        Stmt::Set(q, bin(Bin::Rem, lane(), i64(4))),
    ];
    for (i, reg_i) in d.iter().enumerate() {
        let (j, e) = (i as i64 / 4, i as i64 % 4);
        let row = add(add(mul(reg(warp), i64(16)), reg(g)), i64(8 * (e / 2)));
        let col = add(add(i64(8 * j), mul(reg(q), i64(2))), i64(e % 2));
        out.push(Stmt::Store(
            Space::Global,
            at(Expr::Param(param), add(mul(row, i64(n as i64)), col), 4),
            reg(*reg_i),
        ));
    }
    out
}

/// What the product kernel leaves out, to check that each omission is an error.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Omit {
    Nothing,
    /// The consumer's wait for a full stage.
    FullWait,
    /// The producer's wait for an empty stage.
    EmptyWait,
    /// The accumulators in `wgmma.wait_group`.
    WaitOperands,
    /// The wait itself (the accumulators are read in flight).
    Wait,
    /// The consumer's release of a stage (the producer then waits forever).
    Release,
}

const STAGE_A: i64 = 64 * 128;

/// `C[64][n] = A[64][K] B[n][K]^T`, K in `chunks` chunks of 64, `n` 64 or 128. Params: the
/// maps of A (box 64 x 64) and B (box 64 x n), and C (f32).
fn product_kernel(n: usize, chunks: i64, omit: Omit) -> Kernel {
    let stage = STAGE_A + 128 * n as i64;
    let full = |s: i64| i64(2 * stage + 8 * s);
    let empty = |s: i64| i64(2 * stage + 16 + 8 * s);
    let tile_bytes = i32c(stage);
    let mut r = Regs::default();
    let d: Vec<Reg> = (0..n / 2)
        .map(|i| r.add(&format!("d{i}"), Ty::F32))
        .collect();
    let c = r.add("c", Ty::I64);
    let s = r.add("s", Ty::I64);
    let is_producer = bin(Bin::Eq, tid(), i64(128));
    // Chunk `k` into stage `k % 2`.
    let issue = |k: Expr, s: Expr| {
        let base = mul(s.clone(), i64(stage));
        let bar = add(i64(2 * stage), mul(s, i64(8)));
        let x = cast(mul(k, i64(64)), Ty::I32);
        vec![
            Stmt::MbarArrive {
                bar: bar.clone(),
                tx: Some(tile_bytes.clone()),
            },
            Stmt::TmaLoad {
                dst: base.clone(),
                map: 0,
                coords: vec![x.clone(), i32c(0)],
                bar: bar.clone(),
            },
            Stmt::TmaLoad {
                dst: add(base, i64(STAGE_A)),
                map: 1,
                coords: vec![x, i32c(0)],
                bar,
            },
        ]
    };
    let parity = |k: Expr| cast(bin(Bin::Rem, bin(Bin::Div, k, i64(2)), i64(2)), Ty::I32);
    let mut body = vec![
        when(
            bin(Bin::Eq, tid(), i64(0)),
            vec![
                Stmt::MbarInit {
                    bar: full(0),
                    count: 1,
                },
                Stmt::MbarInit {
                    bar: full(1),
                    count: 1,
                },
                Stmt::MbarInit {
                    bar: empty(0),
                    count: 4,
                },
                Stmt::MbarInit {
                    bar: empty(1),
                    count: 4,
                },
            ],
        ),
        Stmt::Barrier,
    ];
    // The consumer's step on chunk c.
    let base = mul(reg(s), i64(stage));
    let mut steps = Vec::new();
    for kk in 0..4 {
        steps.push((
            WgmmaA::Shared(k_major(add(base.clone(), i64(32 * kk)))),
            k_major(add(add(base.clone(), i64(STAGE_A)), i64(32 * kk))),
        ));
    }
    let mut consume = vec![Stmt::Set(s, bin(Bin::Rem, reg(c), i64(2)))];
    if omit != Omit::FullWait {
        consume.push(Stmt::MbarWait {
            bar: add(i64(2 * stage), mul(reg(s), i64(8))),
            parity: parity(reg(c)),
        });
    }
    consume.push(Stmt::Wgmma(Box::new(Wgmma {
        half: Half::Bf16,
        n: n as u32,
        d: d.clone(),
        accumulate: bin(Bin::Gt, reg(c), i64(0)),
        steps,
        b_n_major: false,
    })));
    match omit {
        Omit::Wait => {}
        Omit::WaitOperands => consume.push(Stmt::WgmmaWait {
            groups: 0,
            regs: Vec::new(),
        }),
        _ => consume.push(Stmt::WgmmaWait {
            groups: 0,
            regs: d.clone(),
        }),
    }
    if omit == Omit::Wait {
        // Reads an accumulator the product still writes.
        consume.push(Stmt::Set(d[0], add(reg(d[0]), f32(0.0))));
    }
    if omit != Omit::Release {
        consume.push(when(
            bin(Bin::Eq, lane(), i64(0)),
            vec![Stmt::MbarArrive {
                bar: add(i64(2 * stage + 16), mul(reg(s), i64(8))),
                tx: None,
            }],
        ));
    }
    // The producer waits for chunk c - 2's release (a fresh barrier's phase of parity 1
    // counts as complete, so chunks 0 and 1 pass).
    let mut produce = vec![Stmt::Set(s, bin(Bin::Rem, reg(c), i64(2)))];
    if omit != Omit::EmptyWait {
        produce.push(Stmt::MbarWait {
            bar: add(i64(2 * stage + 16), mul(reg(s), i64(8))),
            parity: cast(
                bin(Bin::Rem, add(bin(Bin::Div, reg(c), i64(2)), i64(1)), i64(2)),
                Ty::I32,
            ),
        });
    }
    produce.extend(issue(reg(c), reg(s)));
    let chunk_loop = |body: Vec<Stmt>| Stmt::For {
        reg: c,
        start: i64(0),
        end: i64(chunks),
        step: 1,
        body,
    };
    let mut consumer = vec![
        Stmt::SetMaxNReg {
            inc: true,
            regs: 232,
        },
        chunk_loop(consume),
    ];
    if omit == Omit::Wait {
        consumer.push(Stmt::WgmmaWait {
            groups: 0,
            regs: d.clone(),
        });
    } else {
        consumer.extend(store_accumulator(&mut r, &d, n, 2));
    }
    // The producer's side first, as the interpreter runs `then` sides first: it runs ahead to
    // the first stage it must wait for, so a consumer that does not wait reads its copies.
    body.push(Stmt::If(
        bin(Bin::Ge, tid(), i64(128)),
        vec![
            Stmt::SetMaxNReg {
                inc: false,
                regs: 40,
            },
            when(is_producer, vec![chunk_loop(produce)]),
        ],
        consumer,
    ));
    Kernel {
        name: "wgmma_product".into(),
        params: vec![
            ("a".into(), Ty::TensorMap),
            ("b".into(), Ty::TensorMap),
            ("c".into(), Ty::I64),
        ],
        regs: r.0,
        shared_bytes: (2 * stage + 32) as u32,
        threads: 256,
        ctas_per_sm: 1,
        body,
    }
}

fn bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    f32::from_bits((bits + 0x7fff + lsb) & 0xffff_0000)
}

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|v| ((bf16(*v).to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

fn values(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| bf16((((i * 37 + seed * 11) % 101) as f32 - 50.0) / 23.0))
        .collect()
}

/// A, B and C of a product.
type Product = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Runs the product kernel; the result or the interpreter's error.
fn run_product(n: usize, chunks: i64, omit: Omit) -> Result<Product, String> {
    let k = 64 * chunks as usize;
    let (a, b) = (values(64 * k, 1), values(n * k, 2));
    let mut mem = Memory::default();
    let (pa, pb) = (
        mem.alloc_bytes(bf16_bytes(&a)),
        mem.alloc_bytes(bf16_bytes(&b)),
    );
    let map = |global: i64, rows: u64, box_rows: u32| TensorMap {
        elem_bytes: 2,
        global,
        dims: vec![k as u64, rows],
        strides: vec![2 * k as u64],
        boxes: vec![64, box_rows],
        swizzle: Swizzle::B128,
    };
    let ma = mem.alloc_tensor_map(map(pa, 64, 64))?;
    let mb = mem.alloc_tensor_map(map(pb, n as u64, n as u32))?;
    let pc = mem.alloc_f32(&vec![f32::NAN; 64 * n]);
    run(
        &product_kernel(n, chunks, omit),
        [1, 1, 1],
        &[Val::I64(ma), Val::I64(mb), Val::I64(pc)],
        &mut mem,
    )?;
    Ok((a, b, mem.read_f32(pc, 64 * n)?))
}

#[test]
fn a_warp_specialized_tma_and_wgmma_product_equals_the_plain_one() {
    for (n, chunks) in [(64, 1), (64, 4), (128, 3)] {
        let (a, b, c) = run_product(n, chunks, Omit::Nothing).unwrap();
        let k = 64 * chunks as usize;
        for row in 0..64 {
            for col in 0..n {
                let want: f64 = (0..k)
                    .map(|i| f64::from(a[row * k + i]) * f64::from(b[col * k + i]))
                    .sum();
                let got = f64::from(c[row * n + col]);
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "n {n} chunks {chunks}: C[{row}][{col}] = {got}, want {want}"
                );
            }
        }
    }
}

#[test]
fn each_synchronization_left_out_is_an_error() {
    for (omit, needle) in [
        (
            Omit::FullWait,
            "which a TMA copy completing on the mbarrier",
        ),
        // The producer refills stages nobody consumed: the full barriers complete phases
        // ahead of the consumer's parities, which then never match.
        (Omit::EmptyWait, "deadlock: thread 0 waits"),
        (Omit::WaitOperands, "does not list"),
        (Omit::Wait, "while a wgmma that uses it is in flight"),
        (Omit::Release, "deadlock: thread 0 waits at the mbarrier"),
    ] {
        let e = run_product(64, 4, omit).unwrap_err();
        assert!(e.contains(needle), "{omit:?}: {e}");
    }
}

/// `C[64][n] = P[64][64] V[64][n]`: P from global into A fragments (registers), V by TMA in
/// 64-column boxes, N-major.
fn pv_kernel(n: usize, fence: bool, generic_v: bool) -> Kernel {
    let block = 64 * 128;
    let bar = i64((n / 64 * block) as i64);
    let mut r = Regs::default();
    let d: Vec<Reg> = (0..n / 2)
        .map(|i| r.add(&format!("d{i}"), Ty::F32))
        .collect();
    let a: Vec<[Reg; 4]> = (0..4)
        .map(|kk| std::array::from_fn(|i| r.add(&format!("p{kk}_{i}"), Ty::I32)))
        .collect();
    let (warp, g, q) = (
        r.add("p_warp", Ty::I64),
        r.add("p_g", Ty::I64),
        r.add("p_q", Ty::I64),
    );
    let mut body = vec![
        Stmt::Set(warp, bin(Bin::Div, tid(), i64(32))),
        Stmt::Set(g, bin(Bin::Div, lane(), i64(4))),
        Stmt::Set(q, bin(Bin::Rem, lane(), i64(4))),
    ];
    for (kk, frag) in a.iter().enumerate() {
        for (i, &ri) in frag.iter().enumerate() {
            let row = add(
                add(mul(reg(warp), i64(16)), reg(g)),
                i64(8 * (i as i64 % 2)),
            );
            let col = add(
                mul(reg(q), i64(2)),
                i64(8 * (i as i64 / 2) + 16 * kk as i64),
            );
            let p = |c: Expr| {
                load(
                    Space::Global,
                    Ty::F32,
                    at(Expr::Param(0), add(mul(row.clone(), i64(64)), c), 4),
                )
            };
            body.push(Stmt::Set(
                ri,
                Expr::PackHalf(
                    Half::Bf16,
                    Box::new(p(col.clone())),
                    Box::new(p(add(col, i64(1)))),
                ),
            ));
        }
    }
    let thread0 = bin(Bin::Eq, tid(), i64(0));
    let mut fill = vec![Stmt::MbarInit {
        bar: bar.clone(),
        count: 1,
    }];
    if generic_v {
        // V stored by ordinary stores (column 0 of row 0 only, enough to need the fence).
        fill.push(Stmt::Store(Space::Shared, i64(0), Expr::Int(0, Ty::I32)));
        if fence {
            fill.push(Stmt::FenceProxyAsync);
        }
        fill.push(Stmt::MbarArrive {
            bar: bar.clone(),
            tx: None,
        });
    } else {
        fill.push(Stmt::MbarArrive {
            bar: bar.clone(),
            tx: Some(i32c((n / 64 * block) as i64)),
        });
        for blk in 0..n / 64 {
            fill.push(Stmt::TmaLoad {
                dst: i64((blk * block) as i64),
                map: 1,
                coords: vec![i32c(64 * blk as i64), i32c(0)],
                bar: bar.clone(),
            });
        }
    }
    body.push(when(thread0, fill));
    body.push(Stmt::Barrier);
    body.push(Stmt::MbarWait {
        bar,
        parity: i32c(0),
    });
    let steps = (0..4)
        .map(|kk| {
            (
                WgmmaA::Regs(a[kk]),
                n_major(i64(16 * 128 * kk as i64), block as i64),
            )
        })
        .collect();
    body.push(Stmt::Wgmma(Box::new(Wgmma {
        half: Half::Bf16,
        n: n as u32,
        d: d.clone(),
        accumulate: Expr::Pred(false),
        steps,
        b_n_major: true,
    })));
    body.push(Stmt::WgmmaWait {
        groups: 0,
        regs: d.clone(),
    });
    body.extend(store_accumulator(&mut r, &d, n, 2));
    Kernel {
        name: "wgmma_pv".into(),
        params: vec![
            ("p".into(), Ty::I64),
            ("v".into(), Ty::TensorMap),
            ("c".into(), Ty::I64),
        ],
        regs: r.0,
        shared_bytes: (n / 64 * block + 8) as u32,
        threads: 128,
        ctas_per_sm: 1,
        body,
    }
}

#[test]
fn register_a_and_n_major_b_multiply_like_p_v() {
    for n in [64, 128] {
        let (p, v) = (values(64 * 64, 3), values(64 * n, 4));
        let mut mem = Memory::default();
        let pp = mem.alloc_f32(&p);
        let pv = mem.alloc_bytes(bf16_bytes(&v));
        let mv = mem
            .alloc_tensor_map(TensorMap {
                elem_bytes: 2,
                global: pv,
                dims: vec![n as u64, 64],
                strides: vec![2 * n as u64],
                boxes: vec![64, 64],
                swizzle: Swizzle::B128,
            })
            .unwrap();
        let pc = mem.alloc_f32(&vec![f32::NAN; 64 * n]);
        run(
            &pv_kernel(n, true, false),
            [1, 1, 1],
            &[Val::I64(pp), Val::I64(mv), Val::I64(pc)],
            &mut mem,
        )
        .unwrap();
        let c = mem.read_f32(pc, 64 * n).unwrap();
        for row in 0..64 {
            for col in 0..n {
                let want: f64 = (0..64)
                    .map(|k| f64::from(p[row * 64 + k]) * f64::from(v[k * n + col]))
                    .sum();
                let got = f64::from(c[row * n + col]);
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "n {n}: C[{row}][{col}] = {got}, want {want}"
                );
            }
        }
    }
}

#[test]
fn ordinary_stores_read_by_wgmma_need_a_proxy_fence() {
    let run_pv = |fence: bool| {
        let mut mem = Memory::default();
        let pp = mem.alloc_f32(&[0.0; 64 * 64]);
        let pv = mem.alloc_bytes(vec![0; 64 * 64 * 2]);
        let mv = mem
            .alloc_tensor_map(TensorMap {
                elem_bytes: 2,
                global: pv,
                dims: vec![64, 64],
                strides: vec![128],
                boxes: vec![64, 64],
                swizzle: Swizzle::B128,
            })
            .unwrap();
        let pc = mem.alloc_f32(&[0.0; 64 * 64]);
        run(
            &pv_kernel(64, fence, true),
            [1, 1, 1],
            &[Val::I64(pp), Val::I64(mv), Val::I64(pc)],
            &mut mem,
        )
    };
    run_pv(true).unwrap();
    let e = run_pv(false).unwrap_err();
    assert!(e.contains("no fence.proxy.async"), "{e}");
}

#[test]
fn hopper_kernels_print_and_parse_back() {
    for k in [
        product_kernel(128, 3, Omit::Nothing),
        pv_kernel(128, true, false),
    ] {
        codegen::gpu::ir::verify::verify(&k).unwrap();
        let text = k.to_string();
        assert_eq!(codegen::gpu::ir::parse::parse(&text).unwrap(), k, "{text}");
    }
}

#[cfg(feature = "llvm")]
use crate::support;

#[cfg(feature = "llvm")]
#[test]
fn hopper_kernels_compile_for_sm_90a_without_spills_or_serialized_wgmma() {
    use codegen::gpu::llvm::{Arch, emit};
    for k in [
        product_kernel(128, 3, Omit::Nothing),
        pv_kernel(128, true, false),
    ] {
        let out = emit(&k, Arch::Sm90a).unwrap();
        for needle in [
            ".target sm_90a",
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
            "wgmma.fence.sync.aligned",
            "wgmma.commit_group.sync.aligned",
            "wgmma.wait_group.sync.aligned 0",
            "mbarrier.try_wait.parity.shared::cta.b64",
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
        ] {
            assert!(
                out.ptx.contains(needle),
                "{}: {needle} not in\n{}",
                k.name,
                out.ptx
            );
        }
        // A tensor map is read in place, never copied to local memory.
        assert!(!out.ptx.contains(".local"), "{}:\n{}", k.name, out.ptx);
        if let Some(report) = support::assemble_report(&out.ptx, Arch::Sm90a, &k.name) {
            assert!(
                !report.contains("C7515"),
                "{}: serialized wgmma\n{report}",
                k.name
            );
            assert!(
                !report.contains("C7507"),
                "{}: setmaxnreg ignored\n{report}",
                k.name
            );
            assert!(
                report.contains("0 bytes spill stores"),
                "{}: spills\n{report}",
                k.name
            );
        }
    }
    let out = emit(&product_kernel(128, 3, Omit::Nothing), Arch::Sm90a).unwrap();
    assert!(out.ptx.contains("setmaxnreg.inc.sync.aligned.u32 232"));
    assert!(out.ptx.contains("setmaxnreg.dec.sync.aligned.u32 40"));
}

/// Two warpgroups take turns through named barriers (FlashAttention-3's ping-pong): each
/// waits at its own barrier, writes its index into a shared log at the shared cursor, and
/// hands the turn to the other. The log alternates, the cursor's accesses are ordered by the
/// barriers alone, and without warpgroup 1's first hand-over both wait forever.
fn ping_pong(rounds: i64, first_handover: bool) -> Result<Vec<f32>, String> {
    let mut r = Regs::default();
    let (group, round) = (r.add("group", Ty::I64), r.add("round", Ty::I64));
    let turn = |other: bool, wait: bool| Stmt::NamedBarrier {
        id: cast(
            if other {
                sub(i64(2), reg(group))
            } else {
                add(i64(1), reg(group))
            },
            Ty::I32,
        ),
        threads: 256,
        wait,
    };
    let leader = bin(Bin::Eq, bin(Bin::Rem, tid(), i64(128)), i64(0));
    let cursor = load(Space::Shared, Ty::I32, i64(0));
    let write = when(
        leader,
        vec![
            Stmt::Store(
                Space::Global,
                at(Expr::Param(0), cast(cursor.clone(), Ty::I64), 4),
                cast(reg(group), Ty::F32),
            ),
            Stmt::Store(Space::Shared, i64(0), add(cursor, i32c(1))),
        ],
    );
    let mut body = vec![
        Stmt::Set(group, bin(Bin::Div, tid(), i64(128))),
        when(
            bin(Bin::Eq, tid(), i64(0)),
            vec![Stmt::Store(Space::Shared, i64(0), i32c(0))],
        ),
        Stmt::Barrier,
    ];
    if first_handover {
        body.push(when(
            bin(Bin::Eq, reg(group), i64(1)),
            vec![turn(true, false)],
        ));
    }
    body.push(Stmt::For {
        reg: round,
        start: i64(0),
        end: i64(rounds),
        step: 1,
        body: vec![turn(false, true), write, turn(true, false)],
    });
    let k = Kernel {
        name: "ping_pong".into(),
        params: vec![("log".into(), Ty::I64)],
        regs: r.0,
        shared_bytes: 4,
        threads: 256,
        ctas_per_sm: 1,
        body,
    };
    codegen::gpu::ir::verify::verify(&k).map_err(|e| format!("{e:?}"))?;
    let mut mem = Memory::default();
    let log = mem.alloc_f32(&vec![-1.0; 2 * rounds as usize]);
    run(&k, [1, 1, 1], &[Val::I64(log)], &mut mem)?;
    mem.read_f32(log, 2 * rounds as usize)
}

#[test]
fn named_barriers_alternate_two_warpgroups() {
    assert_eq!(ping_pong(3, true).unwrap(), [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]);
    let e = ping_pong(3, false).unwrap_err();
    assert!(e.contains("deadlock"), "{e}");
}
