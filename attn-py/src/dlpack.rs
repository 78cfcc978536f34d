//! attn's outputs handed to torch without a copy: a DLPack capsule (`"dltensor"`, DLPack's
//! unversioned ABI, which `torch.from_dlpack` takes) over the storage the kernels wrote. torch
//! owns it from then on and calls the deleter when its tensor dies; a capsule torch never took
//! frees the storage itself.

use attn::runtime::Storage;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{CStr, c_void};

/// The capsule's name before a consumer takes it (the consumer renames it `used_dltensor`).
const NAME: &CStr = c"dltensor";

/// `DLDevice`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// `DLManagedTensor`.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// A managed tensor and what it points into, in one allocation (the managed tensor first, so a
/// pointer to one is a pointer to the other).
#[repr(C)]
struct Exported {
    managed: DlManagedTensor,
    storage: Storage,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

/// `kDLCPU`.
const CPU: i32 = 1;

/// Frees an [`Exported`] (DLPack's deleter).
///
/// # Safety
/// `managed` came from [`capsule`]'s `Box::into_raw` and is freed once.
unsafe extern "C" fn delete(managed: *mut DlManagedTensor) {
    // SAFETY: the caller's contract; `Exported` is `repr(C)` with the managed tensor first.
    drop(unsafe { Box::from_raw(managed.cast::<Exported>()) });
}

/// The capsule's destructor: frees the tensor unless a consumer took it (and renamed the
/// capsule).
///
/// # Safety
/// Called by Python with a capsule [`capsule`] made, with the GIL held.
unsafe extern "C" fn destroy_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule; IsValid only compares its name and pointer.
    if unsafe { ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) } == 1 {
        // SAFETY: a valid, untaken "dltensor" capsule holds the pointer `capsule` stored.
        let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()) };
        // SAFETY: nobody took the tensor, so this is its only free.
        unsafe { delete(managed.cast()) };
    }
}

/// A contiguous `shape` tensor over `storage` as a DLPack capsule, for `torch.from_dlpack`.
pub fn capsule(py: Python<'_>, storage: Storage, shape: &[usize]) -> PyResult<Py<PyAny>> {
    let (code, bits, data) = match &storage {
        Storage::F32(v) => (2, 32, v.as_ptr().cast::<c_void>()),
        Storage::F16(v) => (2, 16, v.as_ptr().cast()),
        Storage::Bf16(v) => (4, 16, v.as_ptr().cast()),
    };
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1] as i64;
    }
    let mut exported = Box::new(Exported {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data: data.cast_mut(),
                device: DlDevice {
                    device_type: CPU,
                    device_id: 0,
                },
                ndim: shape.len() as i32,
                dtype: DlDataType {
                    code,
                    bits,
                    lanes: 1,
                },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete),
        },
        storage,
        shape: shape.iter().map(|&n| n as i64).collect(),
        strides,
    });
    // The vectors' buffers stay where they are when the box moves.
    exported.managed.dl_tensor.shape = exported.shape.as_mut_ptr();
    exported.managed.dl_tensor.strides = exported.strides.as_mut_ptr();
    let managed = Box::into_raw(exported).cast::<c_void>();
    // SAFETY: `managed` is a live `Exported`, freed by `destroy_capsule` or by the consumer
    // through the deleter, never both (the consumer renames the capsule); NAME is 'static.
    let raw = unsafe { ffi::PyCapsule_New(managed, NAME.as_ptr(), Some(destroy_capsule)) };
    if raw.is_null() {
        // SAFETY: the capsule was not made, so nothing else frees the tensor.
        unsafe { delete(managed.cast()) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `raw` is a new, owned reference.
    Ok(unsafe { Bound::from_owned_ptr(py, raw) }.unbind())
}
