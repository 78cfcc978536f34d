//! Typed storage shared by the caches, the slot arithmetic of a block of tokens, and the
//! rotation of keys as they are appended.

use super::layout::CacheLayout;
use crate::RuntimeError;
use crate::host::rope_table::{RopeTables, Side, check_decay};
use attn_dsl::DType;
use half::{bf16, f16};

/// Values in the cache's dtype.
#[derive(Clone, Debug)]
pub(crate) enum Buffer {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Buffer {
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => Buffer::F32(vec![0.0; len]),
            DType::Bf16 => Buffer::Bf16(vec![bf16::ZERO; len]),
            DType::F16 => Buffer::F16(vec![f16::ZERO; len]),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(v) => v.len(),
            Buffer::Bf16(v) => v.len(),
            Buffer::F16(v) => v.len(),
        }
    }

    /// Bytes of the stored values.
    pub fn bytes(&self) -> u64 {
        (self.len() * self.value_bytes()) as u64
    }

    /// Stores `values` (rounded to the dtype) from element `at`.
    pub fn write(&mut self, at: usize, values: &[f32]) {
        let range = at..at + values.len();
        match self {
            Buffer::F32(v) => v[range].copy_from_slice(values),
            Buffer::Bf16(v) => {
                for (d, s) in v[range].iter_mut().zip(values) {
                    *d = bf16::from_f32(*s);
                }
            }
            Buffer::F16(v) => {
                for (d, s) in v[range].iter_mut().zip(values) {
                    *d = f16::from_f32(*s);
                }
            }
        }
    }

    /// Copies `len` elements from `src` (in `from`) to `dst` here.
    pub fn copy_from(&mut self, dst: usize, from: &Buffer, src: usize, len: usize) {
        match (self, from) {
            (Buffer::F32(d), Buffer::F32(s)) => {
                d[dst..dst + len].copy_from_slice(&s[src..src + len])
            }
            (Buffer::Bf16(d), Buffer::Bf16(s)) => {
                d[dst..dst + len].copy_from_slice(&s[src..src + len])
            }
            (Buffer::F16(d), Buffer::F16(s)) => {
                d[dst..dst + len].copy_from_slice(&s[src..src + len])
            }
            _ => unreachable!("buffers of one cache share its dtype"),
        }
    }

    /// Copies `len` elements from `src` to `dst` within this buffer.
    pub fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        match self {
            Buffer::F32(v) => v.copy_within(src..src + len, dst),
            Buffer::Bf16(v) => v.copy_within(src..src + len, dst),
            Buffer::F16(v) => v.copy_within(src..src + len, dst),
        }
    }

    /// The stored values' bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Buffer::F32(v) => bytemuck::cast_slice(v),
            Buffer::Bf16(v) => bytemuck::cast_slice(v),
            Buffer::F16(v) => bytemuck::cast_slice(v),
        }
    }

    /// Bytes per value.
    pub fn value_bytes(&self) -> usize {
        match self {
            Buffer::F32(_) => 4,
            Buffer::Bf16(_) | Buffer::F16(_) => 2,
        }
    }

    /// The address of element `at`.
    pub fn ptr(&self, at: usize) -> *const u8 {
        match self {
            Buffer::F32(v) => v[at..].as_ptr().cast(),
            Buffer::Bf16(v) => v[at..].as_ptr().cast(),
            Buffer::F16(v) => v[at..].as_ptr().cast(),
        }
    }
}

/// Where the rows of a block of `size` tokens lie: per kv head, `size` key rows, then (unless the
/// values are inside the keys, as for MLA) `size` value rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slots<'a> {
    pub layout: &'a CacheLayout,
    pub size: usize,
}

impl Slots<'_> {
    /// Elements of one block.
    pub fn block_len(&self) -> usize {
        self.layout.kv_heads * self.size * self.layout.values_per_head()
    }

    /// Element offset of the key row of `slot` for kv head `head`.
    pub fn k(&self, head: usize, slot: usize) -> usize {
        head * self.size * self.layout.values_per_head() + slot * self.layout.k_dim
    }

    /// Element offset of the value row of `slot` for kv head `head`.
    pub fn v(&self, head: usize, slot: usize) -> usize {
        if self.layout.values_in_keys {
            self.k(head, slot)
        } else {
            head * self.size * self.layout.values_per_head()
                + self.size * self.layout.k_dim
                + slot * self.layout.v_dim
        }
    }
}

/// Token rows to append, as f32: `rows(head, t)` is the key row (already assembled: for MLA the
/// latent followed by the RoPE key) and the value row (empty for MLA).
pub(crate) struct NewTokens {
    pub n: usize,
    /// `[kv_heads][n][k_dim]`.
    pub k: Vec<f32>,
    /// `[kv_heads][n][v_dim]`, empty when values are inside the keys.
    pub v: Vec<f32>,
}

impl NewTokens {
    /// Rotates the keys in place for positions `pos0..pos0 + n` (the rows a cache stores);
    /// xPos factors are measured from position 0, so every step's keys share them with the
    /// queries decoded later. Refuses (changing nothing) positions past the factors' range.
    pub fn rotate(&mut self, layout: &CacheLayout, pos0: usize) -> Result<(), RuntimeError> {
        let Some(rope) = &layout.rope else {
            return Ok(());
        };
        let (first, end) = (pos0 as i64, (pos0 + self.n) as i64);
        check_decay(rope, first, end, 0)?;
        let tables = RopeTables::new(rope, first, end, end as u64, Side::Key, 0);
        let half = (rope.rope.dim / 2) as usize;
        let base = rope.first_dim as usize;
        let pairing = rope.rope.layout.pairing(rope.rope.dim);
        for (i, row) in self.k.chunks_exact_mut(layout.k_dim).enumerate() {
            let t = i % self.n;
            let (cos, sin) = (
                &tables.cos[t * half..(t + 1) * half],
                &tables.sin[t * half..(t + 1) * half],
            );
            for j in 0..half {
                let (a, b) = pairing.pair(j);
                let (a, b) = (base + a, base + b);
                let (xa, xb) = (row[a], row[b]);
                // The generated kernels' order of operations, so cached keys equal packed ones.
                row[a] = xa * cos[j] - xb * sin[j];
                row[b] = xb * cos[j] + xa * sin[j];
            }
        }
        Ok(())
    }
}
