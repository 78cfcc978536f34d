//! A minimal CPU tensor: dtype, shape, strides over shared storage. Views (`permute`) share the
//! storage, so a BSHD tensor is read as BHSD without a copy.

use crate::buffer::Buffer;
use crate::error::RuntimeError;
use attn_dsl::DType;
use half::{bf16, f16};
use std::sync::Arc;

/// Element storage.
#[derive(Debug)]
pub enum Storage {
    /// f32 values.
    F32(Buffer<f32>),
    /// f16 values.
    F16(Buffer<f16>),
    /// bf16 values.
    Bf16(Buffer<bf16>),
}

/// Large f32 storage goes back to the runtime's buffer pool ([`crate::memory::recycle`]), so
/// the outputs of one call become the outputs of the next without fresh page faults.
impl Drop for Storage {
    fn drop(&mut self) {
        if let Storage::F32(Buffer::Owned(values)) = self {
            crate::memory::recycle(std::mem::take(values));
        }
    }
}

impl Storage {
    pub(crate) fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::F16(v) => v.len(),
            Storage::Bf16(v) => v.len(),
        }
    }

    /// The values in `ranges`, one after another, in their dtype.
    pub(crate) fn gather(&self, ranges: &[std::ops::Range<usize>]) -> Storage {
        fn take<T: Copy>(v: &[T], ranges: &[std::ops::Range<usize>]) -> Vec<T> {
            let mut out = Vec::with_capacity(ranges.iter().map(|r| r.len()).sum());
            for r in ranges {
                out.extend_from_slice(&v[r.clone()]);
            }
            out
        }
        match self {
            Storage::F32(v) => Storage::F32(take(v, ranges).into()),
            Storage::F16(v) => Storage::F16(take(v, ranges).into()),
            Storage::Bf16(v) => Storage::Bf16(take(v, ranges).into()),
        }
    }

    /// Values `range` as f32 in `out` (emptied first), widened in pieces on rayon's threads
    /// straight into its spare capacity: no pass zeroes it first.
    pub(crate) fn widen_to(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        match self {
            Storage::F32(v) => convert_into(&v[range], out, |x| x),
            Storage::F16(v) => convert_into(&v[range], out, |x| x.to_f32()),
            Storage::Bf16(v) => convert_into(&v[range], out, |x| x.to_f32()),
        }
    }

    /// Values `start..start + out.len()` as f32 into `out`, on this thread.
    pub(crate) fn widen_into(&self, start: usize, out: &mut [f32]) {
        let range = start..start + out.len();
        match self {
            Storage::F32(v) => out.copy_from_slice(&v[range]),
            Storage::F16(v) => out
                .iter_mut()
                .zip(&v[range])
                .for_each(|(o, x)| *o = x.to_f32()),
            Storage::Bf16(v) => out
                .iter_mut()
                .zip(&v[range])
                .for_each(|(o, x)| *o = x.to_f32()),
        }
    }

    /// `values` in `dtype`, rounded to nearest even, narrowed in pieces on rayon's threads.
    pub(crate) fn narrowed(dtype: DType, values: Vec<f32>) -> Storage {
        let storage = match dtype {
            DType::F32 => return Storage::F32(values.into()),
            DType::F16 => {
                let mut out = Vec::new();
                convert_into(&values, &mut out, f16::from_f32);
                Storage::F16(out.into())
            }
            DType::Bf16 => {
                let mut out = Vec::new();
                convert_into(&values, &mut out, |x| bf16::from_bits(bf16_bits(x)));
                Storage::Bf16(out.into())
            }
        };
        crate::memory::recycle(values);
        storage
    }

    /// The values at `indices`, in order, in their dtype.
    pub(crate) fn pick(&self, indices: impl Iterator<Item = usize>) -> Storage {
        match self {
            Storage::F32(v) => Storage::F32(indices.map(|i| v[i]).collect::<Vec<_>>().into()),
            Storage::F16(v) => Storage::F16(indices.map(|i| v[i]).collect::<Vec<_>>().into()),
            Storage::Bf16(v) => Storage::Bf16(indices.map(|i| v[i]).collect::<Vec<_>>().into()),
        }
    }
}

/// `f(x)` of every `src` value into `out` (emptied first), in pieces on rayon's threads,
/// straight into its spare capacity: no pass zeroes it first.
fn convert_into<S: Copy + Sync, T: Send>(src: &[S], out: &mut Vec<T>, f: impl Fn(S) -> T + Sync) {
    use rayon::prelude::*;
    use std::mem::MaybeUninit;
    /// Values per rayon task.
    const PIECE: usize = 1 << 14;
    let n = src.len();
    out.clear();
    out.reserve(n);
    let spare: &mut [MaybeUninit<T>] = &mut out.spare_capacity_mut()[..n];
    spare
        .par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(o, s)| {
            for (o, &s) in o.iter_mut().zip(s) {
                o.write(f(s));
            }
        });
    // SAFETY: the pieces wrote every one of the first n spare values.
    unsafe { out.set_len(n) };
}

/// `src` rounded to `dtype` (16-bit: f16 or bf16, to nearest even), as its bits into `dst`,
/// on this thread.
///
/// # Panics
/// If `dtype` is f32 or the lengths differ.
pub(crate) fn narrow_into(dtype: DType, src: &[f32], dst: &mut [std::mem::MaybeUninit<u16>]) {
    assert_eq!(src.len(), dst.len(), "narrowed rows");
    let pairs = dst.iter_mut().zip(src);
    match dtype {
        DType::Bf16 => pairs.for_each(|(d, &x)| {
            d.write(bf16_bits(x));
        }),
        DType::F16 => pairs.for_each(|(d, &x)| {
            d.write(f16::from_f32(x).to_bits());
        }),
        DType::F32 => panic!("f32 is not a 16-bit dtype"),
    }
}

/// The bf16 bits of `x` rounded to nearest even, NaNs kept quiet: bit for bit what
/// `half::bf16::from_f32` gives, without its branches, so a loop of it vectorizes.
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let high = bits >> 16;
    let rounded = bits.wrapping_add(0x7fff + (high & 1)) >> 16;
    let nan = bits & 0x7fff_ffff > 0x7f80_0000;
    (if nan { high | 0x40 } else { rounded }) as u16
}

/// A strided view of CPU storage.
#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    storage: Arc<Storage>,
}

fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

impl Tensor {
    pub(crate) fn new(shape: &[usize], storage: Storage) -> Result<Self, RuntimeError> {
        let n = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if n != Some(storage.len()) {
            let n = n.map_or("more than 2^64".to_string(), |n| n.to_string());
            return Err(RuntimeError::Data(format!(
                "{} values do not fill shape {shape:?} ({n} values)",
                storage.len()
            )));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
            storage: Arc::new(storage),
        })
    }

    /// The view of `storage` with `shape`, `strides` (in elements) and element 0 at `offset`:
    /// how memory another runtime owns (a [`Buffer::Foreign`]) becomes a tensor without a
    /// copy. Refused when an element of the view lies outside the storage.
    pub fn view(
        storage: Storage,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Self, RuntimeError> {
        if strides.len() != shape.len() {
            return Err(RuntimeError::Data(format!(
                "a view of shape {shape:?} has {} strides",
                strides.len()
            )));
        }
        let last = shape.iter().zip(strides).try_fold(offset, |at, (&n, &s)| {
            at.checked_add(n.checked_sub(1)?.checked_mul(s)?)
        });
        let empty = shape.contains(&0);
        if !empty && last.is_none_or(|last| last >= storage.len()) {
            return Err(RuntimeError::Data(format!(
                "a view of shape {shape:?}, strides {strides:?} and offset {offset} reaches \
                 past its storage of {} elements",
                storage.len()
            )));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
            storage: Arc::new(storage),
        })
    }

    /// The view of `len` entries from `start` along `axis`, sharing this tensor's storage.
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Tensor, RuntimeError> {
        let fits = self
            .shape
            .get(axis)
            .is_some_and(|&n| start.checked_add(len).is_some_and(|end| end <= n));
        if !fits {
            return Err(RuntimeError::Data(format!(
                "entries {start}..{} of axis {axis} of a tensor of shape {:?}",
                start.saturating_add(len),
                self.shape
            )));
        }
        let mut shape = self.shape.clone();
        shape[axis] = len;
        Ok(Tensor {
            shape,
            strides: self.strides.clone(),
            offset: self.offset + start * self.strides[axis],
            storage: Arc::clone(&self.storage),
        })
    }

    /// A contiguous f32 tensor.
    pub fn from_f32(shape: &[usize], data: Vec<f32>) -> Result<Self, RuntimeError> {
        Tensor::new(shape, Storage::F32(data.into()))
    }

    /// A contiguous f16 tensor.
    pub fn from_f16(shape: &[usize], data: Vec<f16>) -> Result<Self, RuntimeError> {
        Tensor::new(shape, Storage::F16(data.into()))
    }

    /// A contiguous bf16 tensor.
    pub fn from_bf16(shape: &[usize], data: Vec<bf16>) -> Result<Self, RuntimeError> {
        Tensor::new(shape, Storage::Bf16(data.into()))
    }

    /// A contiguous tensor of `dtype` from f32 values (rounded to nearest even), narrowed on
    /// rayon's threads: a kernel's whole output passes through here.
    pub fn from_f32_as(
        dtype: DType,
        shape: &[usize],
        data: Vec<f32>,
    ) -> Result<Self, RuntimeError> {
        Tensor::new(shape, Storage::narrowed(dtype, data))
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match *self.storage {
            Storage::F32(_) => DType::F32,
            Storage::F16(_) => DType::F16,
            Storage::Bf16(_) => DType::Bf16,
        }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The view with axes reordered: axis `i` of the result is axis `dims[i]` of `self`.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor, RuntimeError> {
        let mut seen = vec![false; self.shape.len()];
        let valid = dims.len() == self.shape.len()
            && dims
                .iter()
                .all(|&d| d < seen.len() && !std::mem::replace(&mut seen[d], true));
        if !valid {
            return Err(RuntimeError::Data(format!(
                "permute({dims:?}) is not a permutation of {} axes",
                self.shape.len()
            )));
        }
        Ok(Tensor {
            shape: dims.iter().map(|&d| self.shape[d]).collect(),
            strides: dims.iter().map(|&d| self.strides[d]).collect(),
            offset: self.offset,
            storage: Arc::clone(&self.storage),
        })
    }

    /// The f32 storage and the offset of element 0, when the elements are f32 and each
    /// innermost row is contiguous (what kernels read without a copy).
    pub fn f32_rows(&self) -> Option<(&[f32], usize)> {
        match &*self.storage {
            Storage::F32(v) if self.strides.last().is_none_or(|s| *s == 1) => {
                Some((v, self.offset))
            }
            _ => None,
        }
    }

    /// 16-bit storage whose rows (the innermost axis) are contiguous, and the offset of
    /// element 0 in it.
    pub(crate) fn narrow_rows(&self) -> Option<(&Storage, usize)> {
        match &*self.storage {
            Storage::F16(_) | Storage::Bf16(_) if self.strides.last().is_none_or(|s| *s == 1) => {
                Some((&self.storage, self.offset))
            }
            _ => None,
        }
    }

    /// The values in logical (row-major) order as f32: borrowed when the tensor is contiguous
    /// f32, else converted into a buffer from the runtime's pool (which
    /// [`crate::memory::recycle`] takes back).
    pub fn f32_values(&self) -> std::borrow::Cow<'_, [f32]> {
        match &*self.storage {
            Storage::F32(v) if self.strides == contiguous_strides(&self.shape) => {
                let n: usize = self.shape.iter().product();
                std::borrow::Cow::Borrowed(&v[self.offset..self.offset + n])
            }
            _ => std::borrow::Cow::Owned(self.widened()),
        }
    }

    /// The elements in logical (row-major) order, in their own dtype.
    pub fn contiguous_storage(&self) -> Storage {
        let n: usize = self.shape.iter().product();
        if self.strides == contiguous_strides(&self.shape) {
            // Already in logical order: one copy of the range, no index walk.
            let range = self.offset..self.offset + n;
            return self.storage.gather(std::slice::from_ref(&range));
        }
        let (starts, len, step) = self.logical_rows();
        if step == 1 {
            let rows: Vec<_> = starts.iter().map(|&s| s..s + len).collect();
            return self.storage.gather(&rows);
        }
        self.storage.pick(
            starts
                .iter()
                .flat_map(|&s| (0..len).map(move |k| s + k * step)),
        )
    }

    /// The elements in logical order, in their own dtype, taking the storage without a copy
    /// when this tensor is its only, contiguous view.
    pub fn into_storage(self) -> Storage {
        let n: usize = self.shape.iter().product();
        if self.offset == 0
            && self.strides == contiguous_strides(&self.shape)
            && self.storage.len() == n
        {
            match Arc::try_unwrap(self.storage) {
                Ok(storage) => return storage,
                Err(shared) => {
                    return Tensor {
                        storage: shared,
                        ..self
                    }
                    .contiguous_storage();
                }
            }
        }
        self.contiguous_storage()
    }

    /// Where the elements lie, in logical order, as rows of the last axis: each row's first
    /// storage offset, the rows' length and their stride (no rows when the tensor is empty).
    fn logical_rows(&self) -> (Vec<usize>, usize, usize) {
        if self.shape.contains(&0) {
            return (Vec::new(), 0, 1);
        }
        let (len, step) = match (self.shape.last(), self.strides.last()) {
            (Some(&len), Some(&step)) => (len, step),
            _ => (1, 1),
        };
        let outer = &self.shape[..self.shape.len().saturating_sub(1)];
        let rows: usize = outer.iter().product();
        let mut starts = Vec::with_capacity(rows);
        let mut index = vec![0usize; outer.len()];
        for _ in 0..rows {
            starts.push(
                self.offset
                    + index
                        .iter()
                        .zip(&self.strides)
                        .map(|(i, s)| i * s)
                        .sum::<usize>(),
            );
            for axis in (0..index.len()).rev() {
                index[axis] += 1;
                if index[axis] < outer[axis] {
                    break;
                }
                index[axis] = 0;
            }
        }
        (starts, len, step)
    }

    /// The largest magnitude of the values (NaN passed over), without copying a contiguous
    /// tensor.
    pub fn max_abs(&self) -> f32 {
        let n: usize = self.shape.iter().product();
        if self.strides != contiguous_strides(&self.shape) {
            return self.to_f32_vec().iter().fold(0f32, |m, x| m.max(x.abs()));
        }
        let range = self.offset..self.offset + n;
        match &*self.storage {
            Storage::F32(v) => v[range].iter().fold(0f32, |m, x| m.max(x.abs())),
            Storage::F16(v) => v[range].iter().fold(0f32, |m, x| m.max(x.to_f32().abs())),
            Storage::Bf16(v) => v[range].iter().fold(0f32, |m, x| m.max(x.to_f32().abs())),
        }
    }

    /// [`Tensor::to_f32_vec`] into a buffer from the runtime's pool ([`crate::memory`]): the
    /// copy a kernel makes of its inputs touches no fresh pages when the same shapes come
    /// again.
    pub(crate) fn widened(&self) -> Vec<f32> {
        let n: usize = self.shape.iter().product();
        if self.strides != contiguous_strides(&self.shape) {
            return self.to_f32_vec();
        }
        let mut out = crate::memory::with_capacity(n);
        self.storage
            .widen_to(self.offset..self.offset + n, &mut out);
        out
    }

    /// The values in logical (row-major) order, as f32 (a contiguous tensor converted on
    /// rayon's threads).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        if self.strides == contiguous_strides(&self.shape) {
            let n: usize = self.shape.iter().product();
            let mut out = Vec::new();
            self.storage
                .widen_to(self.offset..self.offset + n, &mut out);
            return out;
        }
        match &mut self.contiguous_storage() {
            Storage::F32(v) => std::mem::take(v).into_vec(),
            Storage::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Storage::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A view reads its storage through its strides and refuses one that reaches past it.
    #[test]
    fn views_read_through_strides_and_stay_inside_their_storage() {
        let storage = || Storage::F32((0..12).map(|i| i as f32).collect());
        // The transpose of a 3x4 matrix, from element 0.
        let t = Tensor::view(storage(), &[4, 3], &[1, 4], 0).unwrap();
        assert_eq!(t.to_f32_vec()[..4], [0.0, 4.0, 8.0, 1.0]);
        // Broadcast rows (stride 0) and an offset.
        let t = Tensor::view(storage(), &[2, 2], &[0, 1], 10).unwrap();
        assert_eq!(t.to_f32_vec(), [10.0, 11.0, 10.0, 11.0]);
        for (shape, strides, offset) in [
            (&[4, 3][..], &[1, 4][..], 1),
            (&[13][..], &[1][..], 0),
            (&[2, 2][..], &[usize::MAX, 1][..], 0),
            (&[2][..], &[1, 1][..], 0),
        ] {
            assert!(Tensor::view(storage(), shape, strides, offset).is_err());
        }
        assert!(
            Tensor::view(storage(), &[0, 5], &[5, 1], 99).is_ok(),
            "no elements"
        );
    }

    /// The branch-free rounding agrees with `half` on every high half, each with the low
    /// halves around the rounding tie (NaNs, infinities, subnormals and carries included).
    #[test]
    fn bf16_bits_round_as_half_does() {
        for high in 0..=u16::MAX as u32 {
            for low in [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                let x = f32::from_bits(high << 16 | low);
                assert_eq!(
                    bf16_bits(x),
                    bf16::from_f32(x).to_bits(),
                    "{:#010x}",
                    x.to_bits()
                );
            }
        }
    }

    /// Narrowing in pieces on rayon's threads keeps every value in place, in each dtype,
    /// for lengths around the piece size.
    #[test]
    fn narrowed_storage_matches_each_value_rounded() {
        for n in [0, 1, 1 << 14, (1 << 15) + 3] {
            let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
            let (bf16s, f16s) = (
                Storage::narrowed(DType::Bf16, values.clone()),
                Storage::narrowed(DType::F16, values.clone()),
            );
            let (Storage::Bf16(b), Storage::F16(h)) = (&bf16s, &f16s) else {
                panic!("bf16 and f16 storage expected");
            };
            assert_eq!(b.len(), n);
            assert_eq!(h.len(), n);
            for (i, &v) in values.iter().enumerate() {
                assert_eq!(b[i], bf16::from_f32(v), "bf16 value {i} of {n}");
                assert_eq!(h[i], f16::from_f32(v), "f16 value {i} of {n}");
            }
        }
    }

    /// Every permutation of a 2 x 3 x 4 tensor, in each dtype, reads back in logical order:
    /// element `[i, j, k]` of the view is element `[..]` of the source at the permuted index.
    #[test]
    fn permuted_views_read_in_logical_order() {
        let shape = [2, 3, 4];
        let values: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let perms = [
            [0, 1, 2],
            [0, 2, 1],
            [1, 0, 2],
            [1, 2, 0],
            [2, 0, 1],
            [2, 1, 0],
        ];
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let t = Tensor::from_f32_as(dtype, &shape, values.clone()).unwrap();
            for perm in perms {
                let view = t.permute(&perm).unwrap();
                let dims = view.shape().to_vec();
                let mut want = Vec::new();
                for a in 0..dims[0] {
                    for b in 0..dims[1] {
                        for c in 0..dims[2] {
                            let mut source = [0; 3];
                            for (axis, i) in [a, b, c].into_iter().enumerate() {
                                source[perm[axis]] = i;
                            }
                            want.push((source[0] * 12 + source[1] * 4 + source[2]) as f32);
                        }
                    }
                }
                assert_eq!(view.to_f32_vec(), want, "{dtype:?} {perm:?}");
                let again = Tensor::new(&dims, view.contiguous_storage()).unwrap();
                assert_eq!(again.to_f32_vec(), want, "{dtype:?} {perm:?}, via storage");
            }
        }
    }

    /// A view with a zero-length axis reads as empty, however long its other axes.
    #[test]
    fn empty_views_read_as_empty() {
        let t = Tensor::from_f32(&[0, 3], Vec::new()).unwrap();
        assert!(t.permute(&[1, 0]).unwrap().to_f32_vec().is_empty());
        assert!(t.permute(&[1, 0]).unwrap().contiguous_storage().len() == 0);
    }
}
