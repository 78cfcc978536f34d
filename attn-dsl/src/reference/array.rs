//! A plain dense f64 array in row-major order: the reference's only data structure.

/// A dense row-major f64 array.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    shape: Vec<usize>,
    data: Vec<f64>,
}

impl Array {
    /// An array of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Array {
            shape: shape.to_vec(),
            data: vec![0.0; shape.iter().product()],
        }
    }

    /// An array from its shape and row-major data; `None` when the lengths disagree.
    pub fn from_vec(shape: &[usize], data: Vec<f64>) -> Option<Self> {
        (shape.iter().product::<usize>() == data.len()).then(|| Array {
            shape: shape.to_vec(),
            data,
        })
    }

    /// An array whose element at each index is `f(index)`.
    pub fn from_fn(shape: &[usize], mut f: impl FnMut(&[usize]) -> f64) -> Self {
        let mut a = Array::zeros(shape);
        let mut index = vec![0; shape.len()];
        for flat in 0..a.data.len() {
            let mut rest = flat;
            for (axis, dim) in shape.iter().enumerate().rev() {
                index[axis] = rest % dim;
                rest /= dim;
            }
            a.data[flat] = f(&index);
        }
        a
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The elements in row-major order.
    pub fn data(&self) -> &[f64] {
        &self.data
    }

    /// The contiguous innermost row at the given leading index (all axes but the last).
    pub fn row(&self, lead: &[usize]) -> &[f64] {
        let start = self.offset(lead);
        let n = *self.shape.last().unwrap_or(&1);
        &self.data[start..start + n]
    }

    /// Mutable access to the innermost row at the given leading index.
    pub fn row_mut(&mut self, lead: &[usize]) -> &mut [f64] {
        let start = self.offset(lead);
        let n = *self.shape.last().unwrap_or(&1);
        &mut self.data[start..start + n]
    }

    /// The element at a full index.
    pub fn get(&self, index: &[usize]) -> f64 {
        self.data[self.offset(index)]
    }

    /// Sets the element at a full index.
    pub fn set(&mut self, index: &[usize], value: f64) {
        let i = self.offset(index);
        self.data[i] = value;
    }

    /// Row-major offset of a (possibly leading-only) index.
    fn offset(&self, index: &[usize]) -> usize {
        let mut offset = 0;
        for (axis, dim) in self.shape.iter().enumerate() {
            let i = index.get(axis).copied().unwrap_or(0);
            debug_assert!(i < *dim || index.len() <= axis, "index out of bounds");
            offset = offset * dim + i;
        }
        offset
    }
}
