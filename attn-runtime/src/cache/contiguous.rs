//! The contiguous cache: each sequence's tokens in one allocation.

use super::changes::ChangeLog;
use super::store::{Buffer, Slots};
use super::{CacheLayout, KvCache, Run, SeqId, layout_of, new_tokens, unknown};
use crate::error::RuntimeError;
use crate::tensor::Tensor;
use attn_dsl::AttentionSpec;

/// A KV cache holding each sequence in one allocation (per kv head: key rows, then value rows),
/// which doubles its capacity when full (the cached tokens are copied over; nothing is lost).
#[derive(Debug)]
pub struct ContiguousCache {
    layout: CacheLayout,
    seqs: Vec<Option<Sequence>>,
    /// Moves forward on every change (`KvCache::generation`).
    generation: u64,
    /// Writes to the sequences' buffers (`KvCache::changes_since`); reset when the buffers
    /// change (a sequence added, freed or reallocated).
    changes: ChangeLog,
}

#[derive(Debug)]
struct Sequence {
    data: Buffer,
    capacity: usize,
    len: usize,
}

impl ContiguousCache {
    /// An empty cache for `spec`.
    pub fn new(spec: &AttentionSpec) -> Result<Self, RuntimeError> {
        Ok(ContiguousCache {
            layout: layout_of(spec)?,
            seqs: Vec::new(),
            generation: 0,
            changes: ChangeLog::default(),
        })
    }

    /// Starts a sequence with room for `capacity` tokens before its first reallocation.
    pub fn add_sequence(&mut self, capacity: usize) -> SeqId {
        self.generation += 1;
        self.changes.reset(self.generation);
        let slots = Slots {
            layout: &self.layout,
            size: capacity,
        };
        self.seqs.push(Some(Sequence {
            data: Buffer::zeros(self.layout.dtype, slots.block_len()),
            capacity,
            len: 0,
        }));
        SeqId(self.seqs.len() - 1)
    }

    fn seq(&self, seq: SeqId) -> Result<&Sequence, RuntimeError> {
        self.seqs
            .get(seq.0)
            .and_then(Option::as_ref)
            .ok_or_else(|| unknown(seq))
    }

    /// Bytes of the cached tokens of every sequence (capacity not yet filled excluded).
    pub fn bytes_in_use(&self) -> u64 {
        self.seqs
            .iter()
            .flatten()
            .map(|s| {
                let per_token = s.data.bytes() / s.capacity.max(1) as u64;
                per_token * s.len as u64
            })
            .sum()
    }

    /// Appends tokens to `seq`, as [`super::PagedCache::append`].
    pub fn append(&mut self, seq: SeqId, k: &Tensor, v: &Tensor) -> Result<(), RuntimeError> {
        self.generation += 1;
        let mut tokens = new_tokens(&self.layout, k, v)?;
        let len = self.seq(seq)?.len;
        tokens.rotate(&self.layout, len)?;
        // The sequence's region among the live ones (KvCache::memory's order).
        let region = self.seqs[..seq.0].iter().flatten().count();
        let layout = &self.layout;
        let s = self.seqs[seq.0].as_mut().expect("checked");
        if s.len + tokens.n > s.capacity {
            self.changes.reset(self.generation);
            let capacity = (s.len + tokens.n).max(2 * s.capacity);
            let (old, new) = (
                Slots {
                    layout,
                    size: s.capacity,
                },
                Slots {
                    layout,
                    size: capacity,
                },
            );
            let mut data = Buffer::zeros(layout.dtype, new.block_len());
            for h in 0..layout.kv_heads {
                data.copy_from(new.k(h, 0), &s.data, old.k(h, 0), s.len * layout.k_dim);
                if !layout.values_in_keys {
                    data.copy_from(new.v(h, 0), &s.data, old.v(h, 0), s.len * layout.v_dim);
                }
            }
            s.data = data;
            s.capacity = capacity;
        }
        let slots = Slots {
            layout,
            size: s.capacity,
        };
        let (dk, dv) = (layout.k_dim, layout.v_dim);
        let size = s.data.value_bytes();
        for h in 0..layout.kv_heads {
            for t in 0..tokens.n {
                let row = (h * tokens.n + t) * dk;
                let at = slots.k(h, s.len + t);
                s.data.write(at, &tokens.k[row..row + dk]);
                self.changes
                    .record(self.generation, region, at * size, dk * size);
                if !layout.values_in_keys {
                    let row = (h * tokens.n + t) * dv;
                    let at = slots.v(h, s.len + t);
                    s.data.write(at, &tokens.v[row..row + dv]);
                    self.changes
                        .record(self.generation, region, at * size, dv * size);
                }
            }
        }
        s.len += tokens.n;
        Ok(())
    }

    /// Drops `seq` and its memory.
    pub fn free(&mut self, seq: SeqId) -> Result<(), RuntimeError> {
        self.generation += 1;
        self.seq(seq)?;
        self.changes.reset(self.generation);
        self.seqs[seq.0] = None;
        Ok(())
    }
}

impl KvCache for ContiguousCache {
    fn layout(&self) -> &CacheLayout {
        &self.layout
    }

    fn seq_len(&self, seq: SeqId) -> Result<usize, RuntimeError> {
        Ok(self.seq(seq)?.len)
    }

    fn memory(&self) -> Vec<&[u8]> {
        self.seqs
            .iter()
            .flatten()
            .map(|s| s.data.as_bytes())
            .collect()
    }

    fn generation(&self) -> u64 {
        self.generation
    }

    fn changes_since(&self, generation: u64) -> Option<Vec<super::RegionWrite>> {
        self.changes.since(generation)
    }

    fn runs(
        &self,
        seq: SeqId,
        head: usize,
        start: usize,
        end: usize,
    ) -> Result<Vec<Run>, RuntimeError> {
        let s = self.seq(seq)?;
        let end = end.min(s.len);
        if start >= end {
            return Ok(Vec::new());
        }
        let slots = Slots {
            layout: &self.layout,
            size: s.capacity,
        };
        Ok(vec![Run {
            k: s.data.ptr(slots.k(head, start)),
            v: s.data.ptr(slots.v(head, start)),
            first: start,
            len: end - start,
        }])
    }
}
