//! The elements behind a [`Storage`](crate::Storage): a vector the runtime owns, or memory
//! another runtime owns (a torch tensor's), read in place and kept alive by a handle on its
//! owner, so a foreign tensor reaches the kernels without a copy.

use std::any::Any;
use std::ops::Deref;
use std::ptr::NonNull;

/// A storage's elements.
pub enum Buffer<T> {
    /// A vector of the runtime's.
    Owned(Vec<T>),
    /// Memory of another runtime's, read only.
    Foreign(Foreign<T>),
}

/// `len` elements at `ptr` that `owner` keeps alive and unwritten for as long as it lives.
pub struct Foreign<T> {
    ptr: NonNull<T>,
    len: usize,
    /// Dropped after the last read of the elements.
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: a `Foreign` only ever reads its elements (`&[T]`), which its contract keeps valid and
// unwritten while the owner lives; sharing or sending it is sharing `&[T]`, sound for `T: Sync`.
unsafe impl<T: Sync> Send for Foreign<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for Foreign<T> {}

impl<T> Foreign<T> {
    /// The `len` elements at `ptr`, alive while `owner` is.
    ///
    /// # Safety
    /// `ptr` is non-null, aligned for `T`, and points to `len` initialized elements that stay
    /// valid, and that nothing writes, until `owner` is dropped; `len * size_of::<T>()` is at
    /// most `isize::MAX`.
    pub unsafe fn new(ptr: *const T, len: usize, owner: Box<dyn Any + Send + Sync>) -> Self {
        Foreign {
            // A dangling but aligned pointer for no elements, as `slice::from_raw_parts` wants.
            ptr: NonNull::new(ptr.cast_mut()).unwrap_or(NonNull::dangling()),
            len,
            _owner: owner,
        }
    }
}

impl<T> Deref for Buffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Buffer::Owned(v) => v,
            // SAFETY: `Foreign::new`'s contract: `len` initialized elements at `ptr`, valid and
            // unwritten while the owner, which `self` holds, lives.
            Buffer::Foreign(f) => unsafe { std::slice::from_raw_parts(f.ptr.as_ptr(), f.len) },
        }
    }
}

impl<T> Default for Buffer<T> {
    fn default() -> Self {
        Buffer::Owned(Vec::new())
    }
}

impl<T> From<Vec<T>> for Buffer<T> {
    fn from(v: Vec<T>) -> Self {
        Buffer::Owned(v)
    }
}

impl<T> FromIterator<T> for Buffer<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        Buffer::Owned(iter.into_iter().collect())
    }
}

impl<T: Clone> Buffer<T> {
    /// The elements as a vector: the owned one, or a copy of foreign ones.
    pub fn into_vec(self) -> Vec<T> {
        match self {
            Buffer::Owned(v) => v,
            Buffer::Foreign(f) => Buffer::Foreign(f).to_vec(),
        }
    }
}

impl<T> std::fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Buffer::Owned(v) => write!(f, "Owned({} elements)", v.len()),
            Buffer::Foreign(x) => write!(f, "Foreign({} elements at {:p})", x.len, x.ptr),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn foreign_elements_are_read_in_place_while_the_owner_lives() {
        let owner = Arc::new(vec![1.0f32, 2.0, 3.0]);
        let ptr = owner.as_ptr();
        // SAFETY: the Arc's vector is never written and lives as long as the buffer's clone.
        let buffer = Buffer::Foreign(unsafe { Foreign::new(ptr, 3, Box::new(Arc::clone(&owner))) });
        assert_eq!(buffer.as_ptr(), ptr, "no copy");
        assert_eq!(&buffer[..], &[1.0, 2.0, 3.0]);
        assert_eq!(Arc::strong_count(&owner), 2);
        assert_eq!(buffer.into_vec(), vec![1.0, 2.0, 3.0]);
        assert_eq!(
            Arc::strong_count(&owner),
            1,
            "the handle went with the buffer"
        );
    }

    #[test]
    fn an_empty_foreign_buffer_may_have_a_null_pointer() {
        // SAFETY: no elements are read.
        let buffer: Buffer<f32> =
            Buffer::Foreign(unsafe { Foreign::new(std::ptr::null(), 0, Box::new(())) });
        assert!(buffer.is_empty());
    }
}
