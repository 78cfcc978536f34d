//! KV caches for decoding, derived from the spec: what they store per token
//! ([`CacheLayout`]: per-head keys and values, or MLA's latent and shared RoPE key), in the spec's
//! dtype, with keys rotated as they are appended (positions come from the cache's length; YaRN's
//! attention factor is in the rotation, applied once).
//!
//! - [`ContiguousCache`]: each sequence in one growing allocation;
//! - [`PagedCache`]: a pool of fixed-size blocks, per-sequence block tables, a free list, and
//!   copy-free forks that share a prefix's blocks (copy on write of a shared last block).
//!
//! Decode kernels read either through [`KvCache::runs`], the stretches of consecutive keys
//! that lie contiguously (a page, or a whole sequence): no gather copy.

mod changes;
mod contiguous;
mod layout;
mod paged;
mod store;

pub use contiguous::ContiguousCache;
pub use layout::CacheLayout;
pub use paged::{MAX_BLOCK_SIZE, PagedCache};

use crate::error::RuntimeError;
use crate::tensor::Tensor;
use attn_dsl::AttentionSpec;
use store::NewTokens;

/// A sequence in a cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeqId(pub(crate) usize);

/// Consecutive keys stored contiguously: rows of the cache's dtype.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    /// Key row of the first key.
    pub k: *const u8,
    /// Value row of the first key.
    pub v: *const u8,
    /// Index (= position) of the first key.
    pub first: usize,
    /// Number of keys.
    pub len: usize,
}

/// What decode kernels need from a cache.
pub trait KvCache {
    /// What the cache stores.
    fn layout(&self) -> &CacheLayout;
    /// Tokens cached for `seq`.
    fn seq_len(&self, seq: SeqId) -> Result<usize, RuntimeError>;
    /// The runs covering keys `start..end` of `seq` for kv head `head`, in order. Pointers stay
    /// valid while the cache is borrowed.
    fn runs(
        &self,
        seq: SeqId,
        head: usize,
        start: usize,
        end: usize,
    ) -> Result<Vec<Run>, RuntimeError>;
    /// The memory the cached rows live in, regions every run lies inside (a paged cache's
    /// block pool; a contiguous cache's per-sequence buffers): what a device mirror of the
    /// cache uploads.
    fn memory(&self) -> Vec<&[u8]>;
    /// [`KvCache::memory`] as `(start, bytes)` ranges, for addresses that outlive the borrow
    /// (a launch translates run pointers inside them).
    fn regions(&self) -> Vec<(*const u8, usize)> {
        self.memory()
            .iter()
            .map(|m| (m.as_ptr(), m.len()))
            .collect()
    }
    /// A counter every change to the cache moves forward, so that a copy of its regions can
    /// tell that it is out of date.
    fn generation(&self) -> u64;
    /// The bytes of [`KvCache::memory`] written since the cache was at `generation`, so that a
    /// mirror taken then can be brought up to date by copying those alone; `None` when the
    /// cache cannot say (its regions moved or were reallocated since, or its log of writes
    /// no longer reaches back): copy everything.
    fn changes_since(&self, generation: u64) -> Option<Vec<RegionWrite>> {
        let _ = generation;
        None
    }
    /// Where the cache keeps rows, when it is a block table over one region (a paged cache):
    /// kernels then find rows from the sequences' [`KvCache::blocks`] on the device. `None`
    /// otherwise.
    fn page_geometry(&self) -> Option<PageGeometry> {
        None
    }
    /// The blocks of `seq`, in order, for a cache with a [`KvCache::page_geometry`] (empty
    /// otherwise).
    fn blocks(&self, seq: SeqId) -> Result<&[usize], RuntimeError> {
        self.seq_len(seq).map(|_| &[][..])
    }
}

/// How a block-table cache lays out rows: key `slot` of block `b` for kv head `h` starts at
/// element `b * block_len + h * head_stride + k_offset + slot * k_row` of region `region` of
/// [`KvCache::memory`]; its value row likewise from `v_offset`, `v_row` apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageGeometry {
    /// The region of [`KvCache::memory`] holding every block.
    pub region: usize,
    /// Keys per block.
    pub block_size: usize,
    /// Elements per block.
    pub block_len: usize,
    /// Elements between kv heads inside a block.
    pub head_stride: usize,
    /// Element offset of a kv head's first key row, and of its first value row.
    pub k_offset: usize,
    /// See `k_offset`.
    pub v_offset: usize,
    /// Elements between key rows, and between value rows.
    pub k_row: usize,
    /// See `k_row`.
    pub v_row: usize,
}

/// What bringing a mirror of a cache's memory up to date takes (a device copy, say).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MirrorSync {
    /// Nothing: the cache has not changed.
    UpToDate,
    /// Copying these bytes of the cache's regions over the mirror's.
    Writes(Vec<RegionWrite>),
    /// Copying all of the cache's memory (its regions moved, or it cannot say what changed).
    Full,
}

impl MirrorSync {
    /// The plan for a mirror of `cache` taken at `generation`, when its regions were
    /// `regions` (`(address, bytes)`, as [`KvCache::regions`] gave them then).
    pub fn plan(cache: &impl KvCache, regions: &[(usize, usize)], generation: u64) -> MirrorSync {
        if cache.generation() == generation {
            return MirrorSync::UpToDate;
        }
        let now: Vec<(usize, usize)> = cache
            .regions()
            .into_iter()
            .map(|(start, bytes)| (start as usize, bytes))
            .collect();
        match cache.changes_since(generation) {
            Some(writes) if now == regions => MirrorSync::Writes(writes),
            _ => MirrorSync::Full,
        }
    }

    /// Bytes the plan copies, for a cache whose memory is `total` bytes.
    pub fn bytes(&self, total: usize) -> usize {
        match self {
            MirrorSync::UpToDate => 0,
            MirrorSync::Writes(w) => w.iter().map(|w| w.len).sum(),
            MirrorSync::Full => total,
        }
    }
}

/// Bytes written to a region of a cache's memory: `len` bytes from byte `start` of region
/// `region` (an index into [`KvCache::memory`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionWrite {
    /// The region.
    pub region: usize,
    /// First byte written.
    pub start: usize,
    /// Bytes written.
    pub len: usize,
}

fn unknown(seq: SeqId) -> RuntimeError {
    RuntimeError::Cache(format!("sequence {} is not in this cache", seq.0))
}

/// Checks and converts the tensors of an append: per-head `k [kv_heads, n, head_dim]` and
/// `v [kv_heads, n, v_head_dim]`, or for MLA `c_kv [n, latent_rank]` and `k_pe [n, rope_dim]`
/// (the `k` and `v` arguments).
fn new_tokens(layout: &CacheLayout, k: &Tensor, v: &Tensor) -> Result<NewTokens, RuntimeError> {
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != layout.dtype {
            return Err(RuntimeError::DType {
                tensor: name.into(),
                found: t.dtype().name().into(),
                expected: layout.dtype.name().into(),
            });
        }
    }
    let shape_err = |name: &str, t: &Tensor, expected: String| RuntimeError::Shape {
        tensor: name.into(),
        found: t.shape().to_vec(),
        expected,
    };
    if layout.values_in_keys {
        let rank = layout.v_dim;
        let rope = layout.k_dim - rank;
        let n = match k.shape() {
            [n, r] if *r == rank => *n,
            _ => {
                return Err(shape_err(
                    "c_kv",
                    k,
                    format!("[n, {rank}] (tokens, latent_rank)"),
                ));
            }
        };
        if v.shape() != [n, rope] {
            return Err(shape_err(
                "k_pe",
                v,
                format!("[{n}, {rope}] (tokens, rope_dim)"),
            ));
        }
        let (c, pe) = (k.to_f32_vec(), v.to_f32_vec());
        let mut rows = Vec::with_capacity(n * layout.k_dim);
        for t in 0..n {
            rows.extend_from_slice(&c[t * rank..(t + 1) * rank]);
            rows.extend_from_slice(&pe[t * rope..(t + 1) * rope]);
        }
        return Ok(NewTokens {
            n,
            k: rows,
            v: Vec::new(),
        });
    }
    let (h, dk, dv) = (layout.kv_heads, layout.k_dim, layout.v_dim);
    let n = match k.shape() {
        [hh, n, d] if *hh == h && *d == dk => *n,
        _ => {
            return Err(shape_err(
                "k",
                k,
                format!("[{h}, n, {dk}] (kv_heads, tokens, head_dim)"),
            ));
        }
    };
    if v.shape() != [h, n, dv] {
        return Err(shape_err(
            "v",
            v,
            format!("[{h}, {n}, {dv}] (kv_heads, tokens, v_head_dim)"),
        ));
    }
    Ok(NewTokens {
        n,
        k: k.to_f32_vec(),
        v: v.to_f32_vec(),
    })
}

/// The layout of a spec's cache, checked.
fn layout_of(spec: &AttentionSpec) -> Result<CacheLayout, RuntimeError> {
    CacheLayout::of(spec)
}
