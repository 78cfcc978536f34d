//! Where a spec's parameters and a call's data tensors lie in the one 32-bit buffer kernels
//! read them from ([`ParamLayout`]), the check that a call's buffer holds it, and the ranges of
//! the data a mask reads ([`DataRanges`]), from which tiles are classified.

use attn_dsl::modifier::interval::{Interval, Range, TensorRanges};
use attn_dsl::{AttentionSpec, DataType};

/// Where a spec's parameters and a call's data tensors lie in the one 32-bit buffer kernels
/// read them from: each parameter row-major, in declaration order, back to back; then a header
/// per data tensor ([`DataSlot`]), whose shape and place the call fills in; then the call's
/// data (i32 elements stored by their bits), placed by the headers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamLayout {
    /// One slot per declared parameter.
    pub slots: Vec<ParamSlot>,
    /// One slot per declared data tensor.
    pub data: Vec<DataSlot>,
}

/// One parameter's place in a [`ParamLayout`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSlot {
    /// The declared name.
    pub name: String,
    /// The resolved shape.
    pub shape: Vec<usize>,
    /// Index of its first element in the buffer.
    pub offset: usize,
}

/// One data tensor's header in a [`ParamLayout`]: `1 + 2 rank` i32 words at `header`, the
/// index of its first element in the buffer, then each dimension's length, then each
/// dimension's origin (the call's position offset along `seq`, else 0). A read at indices `i`
/// reads element `first + sum_d clamp(i_d - origin_d, 0, len_d - 1) stride_d`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataSlot {
    /// The declared name.
    pub name: String,
    /// Its number of dimensions.
    pub rank: usize,
    /// The element type.
    pub dtype: DataType,
    /// Index of the header's first word in the buffer.
    pub header: usize,
}

impl DataSlot {
    /// Words in the header.
    pub fn header_len(&self) -> usize {
        1 + 2 * self.rank
    }
}

impl ParamLayout {
    /// The layout of a valid spec's parameters (validation bounds the total to 2^24) and data
    /// headers.
    pub fn of(spec: &AttentionSpec) -> ParamLayout {
        let mut offset = 0;
        let slots = spec
            .params
            .iter()
            .map(|p| {
                let shape = spec.param_shape(p);
                let slot = ParamSlot {
                    name: p.name.clone(),
                    offset,
                    shape,
                };
                offset += slot.shape.iter().product::<usize>();
                slot
            })
            .collect();
        let data = spec
            .data
            .iter()
            .map(|d| {
                let slot = DataSlot {
                    name: d.name.clone(),
                    rank: d.dims.len(),
                    dtype: d.dtype,
                    header: offset,
                };
                offset += slot.header_len();
                slot
            })
            .collect();
        ParamLayout { slots, data }
    }

    /// Words before the call's data: the parameters and the data headers.
    pub fn len(&self) -> usize {
        let params = self
            .slots
            .last()
            .map_or(0, |s| s.offset + s.shape.iter().product::<usize>());
        self.data
            .last()
            .map_or(params, |d| d.header + d.header_len())
    }

    /// Whether the spec has neither parameters nor data tensors.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty() && self.data.is_empty()
    }

    /// The slot of the parameter `name`.
    pub fn slot(&self, name: &str) -> Option<&ParamSlot> {
        self.slots.iter().find(|s| s.name == name)
    }

    /// The slot of the data tensor `name`.
    pub fn data_slot(&self, name: &str) -> Option<&DataSlot> {
        self.data.iter().find(|s| s.name == name)
    }

    /// Checks that a call's buffer holds this layout and that every data header places its
    /// tensor inside the buffer (the element an empty tensor's reads clamp to included), so
    /// that kernels, which trust the headers, never read past it.
    pub fn check_buffer(&self, buffer: &[f32]) -> Result<(), String> {
        let fixed = self.len();
        if buffer.len() < fixed || (self.data.is_empty() && buffer.len() != fixed) {
            return Err(format!(
                "{} parameter values given; the spec's parameters and data headers hold {fixed}",
                buffer.len()
            ));
        }
        let word = |at: usize| i64::from(buffer[at].to_bits() as i32);
        for slot in &self.data {
            let first = word(slot.header);
            let mut elements: i64 = 1;
            for axis in 0..slot.rank {
                let len = word(slot.header + 1 + axis);
                elements = if len < 0 {
                    -1
                } else {
                    elements.saturating_mul(len)
                };
            }
            let end = first.saturating_add(elements.max(1));
            if first < fixed as i64 || elements < 0 || end > buffer.len() as i64 {
                return Err(format!(
                    "the header of data tensor `{}` places {elements} elements at {first}, \
                     outside the buffer of {} values",
                    slot.name,
                    buffer.len()
                ));
            }
        }
        Ok(())
    }
}

/// The ranges of a call's data tensors that its mask reads, over boxes of indices, for
/// classifying tiles from the data ([`TensorRanges`]): each tensor's values with the minimum and
/// maximum of every [`RANGE_BLOCK`] consecutive elements along its last dimension, so that a
/// range costs at most two partial blocks and the whole blocks between them. Built in time
/// linear in the data.
#[derive(Debug, PartialEq)]
pub struct DataRanges {
    tensors: Vec<TensorBlocks>,
}

/// Most dimensions a data tensor has (validation's bound).
const MAX_RANK: usize = attn_dsl::learnable::MAX_PARAM_DIMS;

/// Elements per block of a [`DataRanges`] tensor.
pub const RANGE_BLOCK: usize = 32;

/// Most combinations of the outer indices one range query visits; past it the range is unknown
/// (classification stays sound: such a tile is mixed).
const MAX_OUTER_ROWS: i64 = 4096;

#[derive(Debug, PartialEq)]
struct TensorBlocks {
    name: String,
    dtype: DataType,
    dims: Vec<usize>,
    origins: Vec<i64>,
    values: Vec<f64>,
    /// Per row of the last dimension, per block: (min, max, any NaN).
    blocks: Vec<(f64, f64, bool)>,
}

impl DataRanges {
    /// The ranges of the data tensors named in `read` from a call's checked `buffer` (laid out
    /// as `layout`, headers filled in).
    pub fn of(layout: &ParamLayout, buffer: &[f32], read: &[&str]) -> DataRanges {
        let word = |at: usize| i64::from(buffer[at].to_bits() as i32);
        let tensors = layout
            .data
            .iter()
            .filter(|slot| read.contains(&slot.name.as_str()))
            .map(|slot| {
                let first = word(slot.header) as usize;
                let dims: Vec<usize> = (0..slot.rank)
                    .map(|a| word(slot.header + 1 + a) as usize)
                    .collect();
                let origins = (0..slot.rank)
                    .map(|a| word(slot.header + 1 + slot.rank + a))
                    .collect();
                let n: usize = dims.iter().product();
                let values: Vec<f64> = buffer[first..first + n]
                    .iter()
                    .map(|x| match slot.dtype {
                        DataType::I32 => f64::from(x.to_bits() as i32),
                        DataType::F32 => f64::from(*x),
                    })
                    .collect();
                let row = dims.last().copied().unwrap_or(1).max(1);
                let blocks = values
                    .chunks(row)
                    .flat_map(|r| r.chunks(RANGE_BLOCK).map(summary))
                    .collect();
                TensorBlocks {
                    name: slot.name.clone(),
                    dtype: slot.dtype,
                    dims,
                    origins,
                    values,
                    blocks,
                }
            })
            .collect();
        DataRanges { tensors }
    }
}

/// (min, max, any NaN) of some values.
fn summary(values: &[f64]) -> (f64, f64, bool) {
    values.iter().fold(
        (f64::INFINITY, f64::NEG_INFINITY, false),
        |(lo, hi, nan), x| (lo.min(*x), hi.max(*x), nan || x.is_nan()),
    )
}

impl TensorRanges for DataRanges {
    fn range(&self, name: &str, indices: &[Interval]) -> Option<Range> {
        let t = self.tensors.iter().find(|t| t.name == name)?;
        if indices.len() != t.dims.len() || indices.len() > MAX_RANK || t.dims.contains(&0) {
            return None;
        }
        // Each index less its origin, clamped as kernels clamp it.
        let mut clamped = [(0usize, 0usize); MAX_RANK];
        for (c, ((i, &len), &origin)) in clamped
            .iter_mut()
            .zip(indices.iter().zip(&t.dims).zip(&t.origins))
        {
            let last = len as i64 - 1;
            let at = |x: i64| x.saturating_sub(origin).clamp(0, last) as usize;
            *c = (at(i.lo), at(i.hi));
        }
        let (outer, inner) = clamped[..indices.len()].split_at(indices.len() - 1);
        let rows = outer
            .iter()
            .try_fold(1i64, |n, (lo, hi)| n.checked_mul((hi - lo + 1) as i64))
            .filter(|n| *n <= MAX_OUTER_ROWS)?;
        let row_len = *t.dims.last().expect("a tensor has a dimension");
        let blocks_per_row = row_len.div_ceil(RANGE_BLOCK);
        let (lo, hi) = inner[0];
        let mut acc = (f64::INFINITY, f64::NEG_INFINITY, false);
        let mut merge = |(a, b, n): (f64, f64, bool)| {
            acc = (acc.0.min(a), acc.1.max(b), acc.2 || n);
        };
        for r in 0..rows {
            // The r-th combination of the outer indices, row-major.
            let (mut row, mut rest) = (0usize, r as usize);
            for (axis, (olo, ohi)) in outer.iter().enumerate().rev() {
                let width = ohi - olo + 1;
                let index = olo + rest % width;
                rest /= width;
                let stride: usize = t.dims[axis + 1..t.dims.len() - 1].iter().product();
                row += index * stride;
            }
            let base = row * row_len;
            // Whole blocks from their summaries, the parts of blocks at the ends element by
            // element.
            let mut i = lo;
            while i <= hi {
                let block = i / RANGE_BLOCK;
                let (start, last) = (
                    block * RANGE_BLOCK,
                    ((block + 1) * RANGE_BLOCK).min(row_len) - 1,
                );
                if i == start && hi >= last {
                    merge(t.blocks[row * blocks_per_row + block]);
                } else {
                    merge(summary(&t.values[base + i..=base + hi.min(last)]));
                }
                i = last + 1;
            }
        }
        let (lo, hi, nan) = acc;
        Some(match t.dtype {
            DataType::I32 => Range::Int(Interval::new(lo as i64, hi as i64)),
            DataType::F32 => Range::Float { lo, hi, nan },
        })
    }
}
