//! Segment records made on the device from page tables, so that a decode step's host work and
//! upload grow with its sequences' pages and tasks, not with its keys.
//!
//! The host describes each task's keys as pieces: runs of consecutive segments that share a tile
//! code (a causal or windowed row block has one to three per task). One CTA per piece writes its
//! segments' records (the [`super`] format) by looking each segment's block up in the
//! sequence's page table: row `slot` of block `b` for kv head `h` starts at element
//! `b * block_len + h * head_stride + k_offset + slot * k_row` (values likewise). A segment never
//! straddles blocks: the block size is a multiple of the segment's keys.

use super::SEGMENT_FIELDS;
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Kernel, Space, Special, Stmt, Ty};
use crate::gpu::kernels::Regs;
use crate::gpu::launch::LaunchRecord;

/// i64 fields of a piece: its first record (index into `records`), first key, end key
/// (exclusive), tile code, offset of its sequence's page table in `pages`, kv head.
pub const PIECE_FIELDS: usize = 6;

/// Threads per CTA.
pub const THREADS: u32 = 128;

crate::gpu::launch::launch_record! {
    /// Segment records from page tables: one CTA per piece.
    PagesArgs {
        /// Pieces, `PIECE_FIELDS` i64 each.
        pieces: Address,
        /// i32 block indices, each sequence's page table in order, concatenated.
        pages: Address,
        /// Records written, `decode::SEGMENT_FIELDS` i64 each.
        records: Address,
        /// Added to every row address: the cache region's device address, or 0 for records
        /// of offsets (which the decode launch's `k_base` and `v_base` complete).
        base: Scalar,
        /// Keys per block.
        block_size: Scalar,
        /// Elements per block.
        block_len: Scalar,
        /// Elements between kv heads inside a block.
        head_stride: Scalar,
        /// Element offset of a kv head's first key row in a block.
        k_offset: Scalar,
        /// Element offset of a kv head's first value row in a block.
        v_offset: Scalar,
        /// Elements between key rows.
        k_row: Scalar,
        /// Elements between value rows.
        v_row: Scalar,
        /// Bytes per element.
        elem_bytes: Scalar,
        /// Keys per segment.
        segment_keys: Scalar,
    }
}

fn p(name: &str) -> Expr {
    Expr::Param(PagesArgs::position(name))
}

/// The kernel: records of piece `ctaid.x`, thread `tid` taking segments `tid`,
/// `tid + THREADS`, ...
pub fn segments_from_pages() -> Kernel {
    let mut r = Regs { list: Vec::new() };
    let piece = r.add("piece", Ty::I64);
    let names = ["out0", "first", "end", "code", "table", "head"];
    let f: Vec<_> = names.iter().map(|n| r.add(*n, Ty::I64)).collect();
    let [out0, first, end, code, table, head] =
        <[_; PIECE_FIELDS]>::try_from(f.clone()).unwrap_or_else(|_| unreachable!("six fields"));
    let (j, key, block, slot, row, rec) = (
        r.add("j", Ty::I64),
        r.add("key", Ty::I64),
        r.add("block", Ty::I64),
        r.add("slot", Ty::I64),
        r.add("row_base", Ty::I64),
        r.add("record", Ty::I64),
    );
    let mut body = vec![Stmt::Set(
        piece,
        add(
            p("pieces"),
            mul(
                cast(Expr::Special(Special::Ctaid(0)), Ty::I64),
                i64(8 * PIECE_FIELDS as i64),
            ),
        ),
    )];
    for (i, &x) in f.iter().enumerate() {
        body.push(Stmt::Set(
            x,
            load(Space::Global, Ty::I64, add(reg(piece), i64(8 * i as i64))),
        ));
    }
    let seg = p("segment_keys");
    let count = bin(
        Bin::Div,
        add(sub(reg(end), reg(first)), sub(seg.clone(), i64(1))),
        seg.clone(),
    );
    let address = |offset: &str, row_stride: &str| {
        add(
            p("base"),
            mul(
                add(add(reg(row), p(offset)), mul(reg(slot), p(row_stride))),
                p("elem_bytes"),
            ),
        )
    };
    let fields = [
        address("k_offset", "k_row"),
        address("v_offset", "v_row"),
        reg(key),
        bin(Bin::Min, seg.clone(), sub(reg(end), reg(key))),
        reg(code),
        p("k_row"),
        p("v_row"),
    ];
    let mut per_segment = vec![
        Stmt::Set(key, add(reg(first), mul(reg(j), seg))),
        Stmt::Set(
            block,
            cast(
                load(
                    Space::Global,
                    Ty::I32,
                    add(
                        p("pages"),
                        mul(
                            add(reg(table), bin(Bin::Div, reg(key), p("block_size"))),
                            i64(4),
                        ),
                    ),
                ),
                Ty::I64,
            ),
        ),
        Stmt::Set(slot, bin(Bin::Rem, reg(key), p("block_size"))),
        Stmt::Set(
            row,
            add(
                mul(reg(block), p("block_len")),
                mul(reg(head), p("head_stride")),
            ),
        ),
        Stmt::Set(
            rec,
            add(
                p("records"),
                mul(add(reg(out0), reg(j)), i64(8 * SEGMENT_FIELDS as i64)),
            ),
        ),
    ];
    for (i, value) in fields.into_iter().enumerate() {
        per_segment.push(Stmt::Store(
            Space::Global,
            add(reg(rec), i64(8 * i as i64)),
            value,
        ));
    }
    body.push(Stmt::For {
        reg: j,
        start: cast(Expr::Special(Special::Tid), Ty::I64),
        end: count,
        step: i64::from(THREADS),
        body: per_segment,
    });
    Kernel {
        name: "segments_from_pages".into(),
        params: PagesArgs::params(),
        regs: r.list,
        shared_bytes: 0,
        threads: THREADS,
        ctas_per_sm: 4,
        body,
    }
}
