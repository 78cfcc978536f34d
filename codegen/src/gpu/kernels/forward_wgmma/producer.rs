//! The producer warpgroup of the sm_90a forward: the CTA's mbarriers, Q once and each running
//! tile's K and V by TMA into the two-stage ring, rotated by RoPE in place when the spec has it.

use super::*;
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Reg, Space, Special, Stmt, Ty};
use crate::gpu::kernels::RopeWords;
use crate::gpu::kernels::forward_tc::qk_half;
use crate::gpu::kernels::half_of;
use crate::gpu::kernels::{Regs, Side, param, rotate_pair, special64, table_names};
use crate::plan::KernelPlan;

impl<'a> Cta<'a> {
    /// The barriers, initialized by thread 0.
    pub(super) fn init_barriers(&self) -> Vec<Stmt> {
        let lay = &self.lay;
        let mut init = vec![Stmt::MbarInit {
            bar: lay.q_full(),
            count: 1,
        }];
        if self.rope() {
            init.push(Stmt::MbarInit {
                bar: lay.q_ready(),
                count: 128,
            });
        }
        for s in 0..STAGES {
            for which in 0..if self.rope() { 5 } else { 4 } {
                // Full barriers complete on the producer's arrival and its copies; empty ones
                // on one arrival per consumer warp; ready ones on every producer thread's.
                let count = [1, 1, 8, 8, 128][which as usize];
                init.push(Stmt::MbarInit {
                    bar: lay.bar(which, i64(s)),
                    count,
                });
            }
        }
        init
    }

    /// Thread 0's copies of Q (both consumers' rows), by TMA.
    fn load_q(&self) -> Vec<Stmt> {
        let lay = &self.lay;
        let q_slice = cast(
            add(mul(reg(self.batch), i64(self.hq)), reg(self.head)),
            Ty::I32,
        );
        let mut load_q = vec![Stmt::MbarArrive {
            bar: lay.q_full(),
            tx: Some(i32c(2 * lay.q_per_consumer)),
        }];
        for c in 0..2 {
            for blk in 0..self.d / BLOCK_COLS {
                load_q.push(Stmt::TmaLoad {
                    dst: i64(c * lay.q_per_consumer + (blk * 64 * 128) as i64),
                    map: map_param("q_map"),
                    coords: vec![
                        i32c((BLOCK_COLS * blk) as i64),
                        cast(add(self.first_row(), i64(64 * c)), Ty::I32),
                        q_slice.clone(),
                    ],
                    bar: lay.q_full(),
                });
            }
        }
        load_q
    }

    /// Thread 0's copies of a running tile's K and V into its stage, each once the stage's
    /// previous use released it.
    fn load_kv(&self) -> Vec<Stmt> {
        let (lay, stage, bc) = (&self.lay, self.stage, self.bc);
        let kv_slice = cast(
            add(mul(reg(self.batch), i64(self.hkv)), reg(self.kvh)),
            Ty::I32,
        );
        let key0 = cast(mul(reg(self.tile), i64(bc as i64)), Ty::I32);
        let mut produce = Vec::new();
        for (which, map, cols, offset, bytes) in [
            (0, "k_map", self.d, 0, lay.k_bytes),
            (1, "v_map", self.dv, lay.k_bytes, lay.v_bytes),
        ] {
            produce.push(Stmt::MbarWait {
                bar: lay.bar(which + 2, reg(stage)),
                parity: self.release_parity(),
            });
            produce.push(Stmt::MbarArrive {
                bar: lay.bar(which, reg(stage)),
                tx: Some(i32c(bytes)),
            });
            for blk in 0..cols / BLOCK_COLS {
                produce.push(Stmt::TmaLoad {
                    dst: add(lay.stage(reg(stage)), i64(offset + (blk * bc * 128) as i64)),
                    map: map_param(map),
                    coords: vec![
                        i32c((BLOCK_COLS * blk) as i64),
                        key0.clone(),
                        kv_slice.clone(),
                    ],
                    bar: lay.bar(which, reg(stage)),
                });
            }
        }
        produce
    }

    /// The producer warpgroup: Q once, then K and V of each running tile into its stage; with
    /// RoPE, every producer thread rotates what thread 0's copies bring, in place, then fences
    /// its stores for `wgmma` and arrives at the ready barrier consumers wait for.
    pub(super) fn producer(&self, r: &mut Regs) -> Vec<Stmt> {
        let (plan, lay, bc64) = (self.plan, &self.lay, self.bc as i64);
        let (producer_regs, _) = budgets(plan);
        let mut producer = vec![Stmt::SetMaxNReg {
            inc: false,
            regs: producer_regs,
        }];
        if !self.rope() {
            producer.push(thread0(
                [self.load_q(), self.running_tiles(self.load_kv())].concat(),
            ));
            return producer;
        }
        let (qk, from) = (qk_half(plan), half_of(plan));
        let local = r.add("producer_thread", Ty::I64);
        producer.push(Stmt::Set(local, special64(Special::Tid)));
        producer.push(thread0(self.load_q()));
        producer.push(Stmt::MbarWait {
            bar: lay.q_full(),
            parity: i32c(0),
        });
        let last_row = sub(param("sq"), i64(1));
        for c in 0..2 {
            let row0 = add(self.first_row(), i64(64 * c));
            let pos = |j: Expr| {
                add(
                    add(param("p0"), sub(param("skv"), param("sq"))),
                    bin(Bin::Min, add(row0.clone(), j), last_row.clone()),
                )
            };
            let at = (i64(c * lay.q_per_consumer), 64);
            producer.extend(rotate_in_shared(
                plan,
                r,
                (at, Side::Query),
                &pos,
                [from, qk],
                local,
            ));
        }
        producer.push(Stmt::FenceProxyAsync);
        producer.push(Stmt::MbarArrive {
            bar: lay.q_ready(),
            tx: None,
        });
        let last_key = sub(param("skv"), i64(1));
        let key_pos = |j: Expr| {
            let key = add(mul(reg(self.tile), i64(bc64)), j);
            add(param("p0"), bin(Bin::Min, key, last_key.clone()))
        };
        let mut each = vec![
            thread0(self.load_kv()),
            Stmt::MbarWait {
                bar: lay.bar(0, reg(self.stage)),
                parity: self.use_parity(),
            },
        ];
        let at = (lay.stage(reg(self.stage)), self.bc);
        each.extend(rotate_in_shared(
            plan,
            r,
            (at, Side::Key),
            &key_pos,
            [from, qk],
            local,
        ));
        each.push(Stmt::FenceProxyAsync);
        each.push(Stmt::MbarArrive {
            bar: lay.bar(4, reg(self.stage)),
            tx: None,
        });
        producer.extend(self.running_tiles(each));
        producer
    }
}

/// RoPE in place on a tile of operand `side` in shared memory: `rows` rows of `cols` 16-bit
/// columns at `base` (64-column blocks of `rows` x 128 bytes, 128-byte swizzle), row `j` at
/// position `pos(j)`.
/// Values are read in the storage format `from` and written in the `Q K^T` operands' `to`.
/// The producer warpgroup's 128 threads (`thread` 0..128) share the work. Each item is a
/// 32-bit word: an interleaved pair, or two half-split pairs (columns `2 w, 2 w + 1` and
/// `half + 2 w, half + 2 w + 1`), all read before either word is written.
fn rotate_in_shared(
    plan: &KernelPlan,
    r: &mut Regs,
    ((base, rows), side): ((Expr, usize), Side),
    pos: &dyn Fn(Expr) -> Expr,
    [from, to]: [Half; 2],
    thread: Reg,
) -> Vec<Stmt> {
    let rope = plan.rope.as_ref().expect("a RoPE plan");
    let half = (rope.rope.dim / 2) as i64;
    let first = i64::from(rope.first_dim);
    let pairing = rope.rope.layout.pairing(rope.rope.dim);
    let per_row = if pairing.adjacent() { half } else { half / 2 };
    let (item, row, w, table) = (
        r.add("rope_item", Ty::I64),
        r.add("rope_row", Ty::I64),
        r.add("rope_word", Ty::I64),
        r.add("rope_entry", Ty::I64),
    );
    // The shared offset of column `col` (even) of the row: its block, then the 16-byte chunk
    // XOR the row's place in its group of 8 (a ^ b = (a | b) - (a & b)).
    let at = |col: Expr| {
        let (blk, inner) = (
            bin(Bin::Div, col.clone(), i64(64)),
            bin(Bin::Rem, col, i64(64)),
        );
        let (chunk, row8) = (
            bin(Bin::Div, inner.clone(), i64(8)),
            bin(Bin::Rem, reg(row), i64(8)),
        );
        let swizzled = sub(
            bin(Bin::Or, chunk.clone(), row8.clone()),
            bin(Bin::And, chunk, row8),
        );
        add(
            add(base.clone(), mul(blk, i64(rows as i64 * 128))),
            add(
                add(mul(reg(row), i64(128)), mul(swizzled, i64(16))),
                mul(bin(Bin::Rem, inner, i64(8)), i64(2)),
            ),
        )
    };
    let elem = |col: Expr| Expr::LoadHalf(Space::Shared, from, Box::new(at(col)));
    let table_at = |param_name: &str, f: Expr| {
        load(
            Space::Global,
            Ty::F32,
            add(param(param_name), mul(add(reg(table), f), i64(4))),
        )
    };
    let [cos, sin] = table_names(side);
    let rotated =
        |a: Expr, b: Expr, f: Expr| rotate_pair(a, b, table_at(cos, f.clone()), table_at(sin, f));
    let mut body = vec![
        Stmt::Set(row, bin(Bin::Div, reg(item), i64(per_row))),
        Stmt::Set(w, bin(Bin::Rem, reg(item), i64(per_row))),
        Stmt::Set(
            table,
            mul(sub(pos(reg(row)), param("rope_pos0")), i64(half)),
        ),
    ];
    let words = RopeWords {
        pairing,
        to,
        elem: &elem,
        word: &at,
        rotated: &rotated,
    };
    // Pair w (adjacent elements), or pairs 2 w and 2 w + 1 (split).
    let f0 = if pairing.adjacent() {
        reg(w)
    } else {
        mul(reg(w), i64(2))
    };
    body.extend(words.rotate(r, add(i64(first), mul(reg(w), i64(2))), f0));
    vec![Stmt::For {
        reg: item,
        start: reg(thread),
        end: i64(rows as i64 * per_row),
        step: 128,
        body,
    }]
}
