//! A decode call's keys described by page tables, for `codegen::gpu::kernels::decode::pages`' kernel to turn
//! into segment records on the device: per work item, runs of segments that share a tile code
//! (spans); per task, the pieces of those spans its partition takes; per sequence, its blocks.
//! The host's work then grows with items, tasks and pages, not with keys.

use crate::cache::{KvCache, PageGeometry, SeqId};
use crate::error::RuntimeError;
use crate::host::work::{Item, blocks, segment_codes};
use codegen::KernelPlan;
use codegen::gpu::ir::Kernel;
use codegen::gpu::kernels::decode::pages::{PIECE_FIELDS, PagesArgs};
use codegen::plan::TileCode;
use std::sync::Arc;

/// An item's segments (cut every `seg_keys` keys from key 0) as runs that share a tile code,
/// skipped ones left out.
pub(crate) struct ItemSpans {
    /// The item's kv head.
    kv_head: usize,
    /// `(first segment, segments, code)`, in key order.
    runs: Vec<(usize, usize, TileCode)>,
    /// Segments in all (those the kernel reads).
    pub count: usize,
}

impl ItemSpans {
    /// The pieces (`PIECE_FIELDS` i64 each, onto `out`) of the item's segments `range` (indices
    /// among the segments it reads), whose records start at record `first_record`. `len` is the
    /// sequence's keys, `table` the offset of its page table.
    pub fn pieces(
        &self,
        range: std::ops::Range<usize>,
        first_record: usize,
        [len, seg_keys, table]: [usize; 3],
        out: &mut Vec<i64>,
    ) {
        let mut index = 0;
        for &(first_seg, count, code) in &self.runs {
            let (lo, hi) = (range.start.max(index), range.end.min(index + count));
            if lo < hi {
                let first_key = (first_seg + lo - index) * seg_keys;
                let end_key = ((first_seg + hi - index) * seg_keys).min(len);
                out.extend([
                    (first_record + lo - range.start) as i64,
                    first_key as i64,
                    end_key as i64,
                    code as i64,
                    table as i64,
                    self.kv_head as i64,
                ]);
            }
            index += count;
        }
    }
}

/// The work items of a call (without host segments) and their spans.
pub(crate) fn span_items(
    plan: &KernelPlan,
    cache: &dyn KvCache,
    seqs: &[SeqId],
    q_lens: &[usize],
    max_rows: usize,
    seg_keys: usize,
) -> Result<(Vec<Item>, Vec<ItemSpans>), RuntimeError> {
    let mut items = Vec::new();
    let mut spans = Vec::new();
    for block in blocks(plan, cache, seqs, q_lens, max_rows)? {
        let codes = segment_codes(plan, block.rows(), block.call(), 0, block.len, seg_keys);
        let mut runs: Vec<(usize, usize, TileCode)> = Vec::new();
        for (i, &code) in codes.iter().enumerate() {
            match runs.last_mut() {
                Some((first, count, c)) if *c == code && *first + *count == i => *count += 1,
                _ => runs.push((i, 1, code)),
            }
        }
        runs.retain(|&(_, _, code)| code != TileCode::Skip);
        spans.push(ItemSpans {
            kv_head: block.g,
            count: runs.iter().map(|r| r.1).sum(),
            runs,
        });
        items.push(block.item(Vec::new()));
    }
    Ok((items, spans))
}

/// The call's page tables: every attending sequence's blocks covering its keys (i32, for the
/// device), concatenated, and where each sequence's start.
pub(crate) struct PageTables {
    pub pages: Vec<i32>,
    pub offsets: Vec<usize>,
}

impl PageTables {
    pub fn of(
        cache: &dyn KvCache,
        seqs: &[SeqId],
        q_lens: &[usize],
        geometry: PageGeometry,
    ) -> Result<PageTables, RuntimeError> {
        let mut t = PageTables {
            pages: Vec::new(),
            offsets: Vec::with_capacity(seqs.len()),
        };
        for (&seq, &n) in seqs.iter().zip(q_lens) {
            t.offsets.push(t.pages.len());
            if n == 0 {
                continue;
            }
            let used = cache.seq_len(seq)?.div_ceil(geometry.block_size);
            let blocks = cache.blocks(seq)?;
            let Some(blocks) = blocks.get(..used) else {
                return Err(RuntimeError::Cache(format!(
                    "the cache lists {} blocks for a sequence of {used} blocks",
                    blocks.len()
                )));
            };
            for &b in blocks {
                t.pages.push(i32::try_from(b).map_err(|_| {
                    RuntimeError::Cache(format!(
                        "block {b} is past what a device page table holds (i32)"
                    ))
                })?);
            }
        }
        Ok(t)
    }
}

/// What the device needs to make a launch's segment records from page tables.
pub(crate) struct PagedSegments {
    /// `codegen::gpu::kernels::decode::pages::segments_from_pages`, verified.
    pub kernel: Arc<Kernel>,
    /// Pieces, `PIECE_FIELDS` i64 each: one CTA each.
    pub pieces: Vec<i64>,
    /// The page tables.
    pub pages: Vec<i32>,
    /// Records the pieces make.
    pub records: usize,
    pub geometry: PageGeometry,
    pub elem_bytes: usize,
    pub segment_keys: usize,
}

impl PagedSegments {
    /// CTAs of the launch: one per piece.
    pub fn ctas(&self) -> Result<u32, RuntimeError> {
        u32::try_from(self.pieces.len() / PIECE_FIELDS)
            .map_err(|_| RuntimeError::Data("more pieces than a grid holds".into()))
    }

    /// The launch's record over buffers at these addresses; row addresses from `base` (the
    /// cache region's device address).
    pub fn args(&self, [pieces, pages, records, base]: [i64; 4]) -> PagesArgs {
        let g = &self.geometry;
        PagesArgs {
            pieces,
            pages,
            records,
            base,
            block_size: g.block_size as i64,
            block_len: g.block_len as i64,
            head_stride: g.head_stride as i64,
            k_offset: g.k_offset as i64,
            v_offset: g.v_offset as i64,
            k_row: g.k_row as i64,
            v_row: g.v_row as i64,
            elem_bytes: self.elem_bytes as i64,
            segment_keys: self.segment_keys as i64,
        }
    }
}

/// The segment-record kernel, lowered and verified once per process.
pub(crate) fn pages_kernel() -> Result<Arc<Kernel>, RuntimeError> {
    static KERNEL: std::sync::OnceLock<Arc<Kernel>> = std::sync::OnceLock::new();
    if let Some(k) = KERNEL.get() {
        return Ok(Arc::clone(k));
    }
    let made = Arc::new(codegen::gpu::verified(
        codegen::gpu::kernels::decode::pages::segments_from_pages(),
    )?);
    Ok(Arc::clone(KERNEL.get_or_init(|| made)))
}
