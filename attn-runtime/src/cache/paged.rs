//! The paged cache: a pool of blocks of `block_size` tokens, per-sequence block tables.

use super::changes::ChangeLog;
use super::store::{Buffer, Slots};
use super::{CacheLayout, KvCache, Run, SeqId, layout_of, new_tokens, unknown};
use crate::error::RuntimeError;
use crate::tensor::Tensor;
use attn_dsl::AttentionSpec;

/// A paged KV cache (vLLM's PagedAttention layout): a fixed pool of blocks, a free list, and a
/// block table per sequence. A sequence wastes less than one block. [`PagedCache::fork`] shares
/// every block of a sequence with a new one (reference counts, no copy); appending to a shared,
/// partly filled last block copies that block first.
#[derive(Debug)]
pub struct PagedCache {
    layout: CacheLayout,
    block_size: usize,
    pool: Buffer,
    /// Sequences holding each block.
    refs: Vec<u32>,
    free: Vec<usize>,
    seqs: Vec<Option<Sequence>>,
    /// Moves forward on every change (`KvCache::generation`).
    generation: u64,
    /// Writes to the pool (`KvCache::changes_since`).
    changes: ChangeLog,
}

#[derive(Clone, Debug, Default)]
struct Sequence {
    blocks: Vec<usize>,
    len: usize,
}

/// Most tokens a block of a [`PagedCache`] may hold.
pub const MAX_BLOCK_SIZE: usize = 1 << 16;

impl PagedCache {
    /// A cache for `spec` with `num_blocks` blocks of `block_size` tokens (any size from 1).
    pub fn new(
        spec: &AttentionSpec,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, RuntimeError> {
        if !(1..=MAX_BLOCK_SIZE).contains(&block_size) {
            return Err(RuntimeError::Cache(format!(
                "block_size = {block_size} is out of range; allowed: 1 to {MAX_BLOCK_SIZE}"
            )));
        }
        let layout = layout_of(spec)?;
        let block_len = Slots {
            layout: &layout,
            size: block_size,
        }
        .block_len();
        let values = block_len.checked_mul(num_blocks);
        // The pool, and a reference count and a free-list entry per block.
        let bytes = values
            .and_then(|v| v.checked_mul(layout.dtype.size_bytes() as usize))
            .and_then(|b| b.checked_add(num_blocks.checked_mul(16)?))
            .map(|b| b as u64);
        crate::memory::ensure_fits(
            &format!("a paged cache of {num_blocks} blocks of {block_size} tokens"),
            bytes,
        )?;
        Ok(PagedCache {
            pool: Buffer::zeros(layout.dtype, values.unwrap_or(0)),
            layout,
            block_size,
            refs: vec![0; num_blocks],
            free: (0..num_blocks).rev().collect(),
            seqs: Vec::new(),
            generation: 0,
            changes: ChangeLog::default(),
        })
    }

    fn slots(&self) -> Slots<'_> {
        Slots {
            layout: &self.layout,
            size: self.block_size,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Starts an empty sequence.
    pub fn add_sequence(&mut self) -> SeqId {
        self.generation += 1;
        self.seqs.push(Some(Sequence::default()));
        SeqId(self.seqs.len() - 1)
    }

    fn seq(&self, seq: SeqId) -> Result<&Sequence, RuntimeError> {
        self.seqs
            .get(seq.0)
            .and_then(Option::as_ref)
            .ok_or_else(|| unknown(seq))
    }

    /// The blocks of `seq`, in order.
    pub fn block_table(&self, seq: SeqId) -> Result<&[usize], RuntimeError> {
        Ok(&self.seq(seq)?.blocks)
    }

    /// Blocks held by at least one sequence.
    pub fn blocks_in_use(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// Blocks on the free list.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Bytes of the blocks in use (each block once, however many sequences share it).
    pub fn bytes_in_use(&self) -> u64 {
        let block_bytes = self.pool.bytes() / self.refs.len().max(1) as u64;
        self.blocks_in_use() as u64 * block_bytes
    }

    fn take_block(&mut self) -> Result<usize, RuntimeError> {
        let block = self.free.pop().ok_or_else(|| {
            RuntimeError::Cache(format!(
                "the cache is full: all {} blocks of {} tokens are in use; free sequences or \
                 create the cache with more blocks",
                self.refs.len(),
                self.block_size
            ))
        })?;
        self.refs[block] = 1;
        Ok(block)
    }

    fn release(&mut self, block: usize) {
        self.refs[block] -= 1;
        if self.refs[block] == 0 {
            self.free.push(block);
        }
    }

    /// Appends tokens to `seq`: `k [kv_heads, n, head_dim]` and `v [kv_heads, n, v_head_dim]`
    /// in the spec's dtype (for MLA: `c_kv [n, latent_rank]` and `k_pe [n, rope_dim]`). Keys are
    /// rotated for positions `len..len + n`. On error (bad shapes, a full pool) nothing changes.
    pub fn append(&mut self, seq: SeqId, k: &Tensor, v: &Tensor) -> Result<(), RuntimeError> {
        self.generation += 1;
        let mut tokens = new_tokens(&self.layout, k, v)?;
        let (len, held) = {
            let s = self.seq(seq)?;
            (s.len, s.blocks.len())
        };
        tokens.rotate(&self.layout, len)?;
        let bs = self.block_size;
        let needed = (len + tokens.n).div_ceil(bs).saturating_sub(held);
        let shared_tail = len % bs != 0 && self.refs[self.seq(seq)?.blocks[held - 1]] > 1;
        if needed + usize::from(shared_tail) > self.free.len() {
            return Err(RuntimeError::Cache(format!(
                "the cache is full: {} more blocks needed, {} free of {}",
                needed + usize::from(shared_tail),
                self.free.len(),
                self.refs.len()
            )));
        }
        if shared_tail {
            // Copy on write: the last block is shared with a fork and about to change.
            let old = self.seq(seq)?.blocks[held - 1];
            let new = self.take_block()?;
            let block_len = self.slots().block_len();
            self.pool
                .copy_within(old * block_len, new * block_len, block_len);
            self.record(new * block_len, block_len);
            self.release(old);
            self.seqs[seq.0].as_mut().expect("checked").blocks[held - 1] = new;
        }
        for _ in 0..needed {
            let block = self.take_block()?;
            self.seqs[seq.0]
                .as_mut()
                .expect("checked")
                .blocks
                .push(block);
        }
        let layout = self.layout.clone();
        let slots = Slots {
            layout: &layout,
            size: bs,
        };
        let block_len = slots.block_len();
        let (dk, dv) = (layout.k_dim, layout.v_dim);
        let blocks = self.seqs[seq.0].as_ref().expect("checked").blocks.clone();
        for h in 0..layout.kv_heads {
            for t in 0..tokens.n {
                let pos = len + t;
                let (block, slot) = (blocks[pos / bs], pos % bs);
                let row = (h * tokens.n + t) * dk;
                let base = block * block_len;
                self.pool
                    .write(base + slots.k(h, slot), &tokens.k[row..row + dk]);
                self.record(base + slots.k(h, slot), dk);
                if !layout.values_in_keys {
                    let row = (h * tokens.n + t) * dv;
                    self.pool
                        .write(base + slots.v(h, slot), &tokens.v[row..row + dv]);
                    self.record(base + slots.v(h, slot), dv);
                }
            }
        }
        self.seqs[seq.0].as_mut().expect("checked").len = len + tokens.n;
        Ok(())
    }

    /// Logs a write of `len` values of the pool from value `at`.
    fn record(&mut self, at: usize, len: usize) {
        let size = self.pool.value_bytes();
        self.changes
            .record(self.generation, 0, at * size, len * size);
    }

    /// A new sequence sharing every cached token of `seq` (no copy): for beam search and
    /// parallel sampling.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId, RuntimeError> {
        self.generation += 1;
        let s = self.seq(seq)?.clone();
        for &b in &s.blocks {
            self.refs[b] += 1;
        }
        self.seqs.push(Some(s));
        Ok(SeqId(self.seqs.len() - 1))
    }

    /// Drops `seq`, returning the blocks no other sequence holds to the free list.
    pub fn free(&mut self, seq: SeqId) -> Result<(), RuntimeError> {
        self.generation += 1;
        self.seq(seq)?;
        let s = self.seqs[seq.0].take().expect("checked");
        for b in s.blocks {
            self.release(b);
        }
        Ok(())
    }
}

impl KvCache for PagedCache {
    fn layout(&self) -> &CacheLayout {
        &self.layout
    }

    fn seq_len(&self, seq: SeqId) -> Result<usize, RuntimeError> {
        Ok(self.seq(seq)?.len)
    }

    fn memory(&self) -> Vec<&[u8]> {
        vec![self.pool.as_bytes()]
    }

    fn generation(&self) -> u64 {
        self.generation
    }

    fn changes_since(&self, generation: u64) -> Option<Vec<super::RegionWrite>> {
        self.changes.since(generation)
    }

    fn page_geometry(&self) -> Option<super::PageGeometry> {
        let slots = self.slots();
        // Element offsets from the same arithmetic `runs` uses (kv head 1 of a one-head cache
        // is past its block, but the stride between heads is still the layout's).
        let (k0, v0) = (slots.k(0, 0), slots.v(0, 0));
        Some(super::PageGeometry {
            region: 0,
            block_size: self.block_size,
            block_len: slots.block_len(),
            head_stride: slots.k(1, 0) - k0,
            k_offset: k0,
            v_offset: v0,
            k_row: slots.k(0, 1) - k0,
            v_row: slots.v(0, 1) - v0,
        })
    }

    fn blocks(&self, seq: SeqId) -> Result<&[usize], RuntimeError> {
        Ok(&self.seq(seq)?.blocks)
    }

    fn runs(
        &self,
        seq: SeqId,
        head: usize,
        start: usize,
        end: usize,
    ) -> Result<Vec<Run>, RuntimeError> {
        let s = self.seq(seq)?;
        let (slots, bs) = (self.slots(), self.block_size);
        let block_len = slots.block_len();
        let mut runs = Vec::new();
        let mut key = start;
        while key < end.min(s.len) {
            let (block, slot) = (s.blocks[key / bs], key % bs);
            let len = (bs - slot).min(end - key);
            let base = block * block_len;
            runs.push(Run {
                k: self.pool.ptr(base + slots.k(head, slot)),
                v: self.pool.ptr(base + slots.v(head, slot)),
                first: key,
                len,
            });
            key += len;
        }
        Ok(runs)
    }
}
