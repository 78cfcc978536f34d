//! torch tensors read in place: a tensor's dtype, shape, strides and data pointer, and attn
//! tensors over its memory (no copy), kept alive by a reference to the torch tensor.
//!
//! This module and [`crate::dlpack`] are where attn meets memory it does not own, the only
//! `unsafe` outside attn-runtime; each block says why it is sound.

use crate::error::refuse;
use attn::runtime::Storage;
use attn::runtime::buffer::{Buffer, Foreign};
use pyo3::prelude::*;

/// The element types the op reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Element {
    F32,
    F16,
    Bf16,
    I32,
    I64,
}

impl Element {
    fn of(torch_name: &str) -> Option<Element> {
        Some(match torch_name {
            "torch.float32" => Element::F32,
            "torch.float16" => Element::F16,
            "torch.bfloat16" => Element::Bf16,
            "torch.int32" => Element::I32,
            "torch.int64" => Element::I64,
            _ => return None,
        })
    }

    fn size(self) -> usize {
        match self {
            Element::F32 | Element::I32 => 4,
            Element::F16 | Element::Bf16 => 2,
            Element::I64 => 8,
        }
    }
}

/// What attn needs of a CPU torch tensor, checked.
pub struct TorchTensor {
    /// The argument's name, for messages.
    pub name: String,
    /// The element type (`None`: one attn does not read, named in `dtype_name`).
    pub element: Option<Element>,
    /// torch's name of the dtype (`torch.float64`).
    pub dtype_name: String,
    pub shape: Vec<usize>,
    /// In elements.
    pub strides: Vec<usize>,
    /// The address of element 0.
    address: usize,
    /// The tensor, kept alive while attn reads its memory.
    owner: Py<PyAny>,
}

/// `torch.Tensor`, looked up once per call.
fn tensor_type<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
    py.import("torch")?.getattr("Tensor")
}

impl TorchTensor {
    /// Reads `obj` (the argument called `name`): refused unless it is a strided torch tensor
    /// on the CPU.
    pub fn read(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<TorchTensor> {
        let py = obj.py();
        if !obj.is_instance(&tensor_type(py)?)? {
            let kind = obj.get_type().name()?;
            return Err(refuse(format!("`{name}` is a {kind}, not a torch.Tensor")));
        }
        let device: String = obj.getattr("device")?.str()?.extract()?;
        if device != "cpu" {
            return Err(refuse(format!(
                "`{name}` is on {device}; attn's torch op runs CPU tensors (its CUDA path is \
                 not built yet)"
            )));
        }
        let layout: String = obj.getattr("layout")?.str()?.extract()?;
        if layout != "torch.strided" {
            return Err(refuse(format!(
                "`{name}` has layout {layout}; attn reads dense (torch.strided) tensors"
            )));
        }
        let dtype_name: String = obj.getattr("dtype")?.str()?.extract()?;
        let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
        let strides: Vec<i64> = obj.call_method0("stride")?.extract()?;
        let strides = strides
            .iter()
            .map(|&s| usize::try_from(s))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| refuse(format!("`{name}` has a negative stride: {strides:?}")))?;
        let address: usize = obj.call_method0("data_ptr")?.extract()?;
        Ok(TorchTensor {
            name: name.to_string(),
            element: Element::of(&dtype_name),
            dtype_name,
            shape,
            strides,
            address,
            owner: obj.clone().unbind(),
        })
    }

    /// Elements from element 0 to the last one the view reaches (0 for an empty tensor).
    fn extent(&self) -> PyResult<usize> {
        if self.shape.contains(&0) {
            return Ok(0);
        }
        self.shape
            .iter()
            .zip(&self.strides)
            .try_fold(1usize, |at, (&n, &s)| {
                at.checked_add((n - 1).checked_mul(s)?)
            })
            .filter(|&n| {
                n.checked_mul(self.element.map_or(1, Element::size))
                    .is_some_and(|bytes| bytes <= isize::MAX as usize)
            })
            .ok_or_else(|| refuse(format!("`{}` reaches past the address space", self.name)))
    }

    /// The tensor's elements as a foreign buffer of `T` (no copy).
    fn buffer<T: Send + Sync + 'static>(&self, py: Python<'_>, len: usize) -> PyResult<Buffer<T>> {
        if !self.address.is_multiple_of(std::mem::align_of::<T>()) {
            return Err(refuse(format!(
                "`{}` starts at {:#x}, not aligned for its elements",
                self.name, self.address
            )));
        }
        let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(self.owner.clone_ref(py));
        // SAFETY: `address` is the data pointer of a live, strided CPU torch tensor of element
        // type `T` (checked by the callers against `element`), aligned (checked above); its
        // storage holds every element of the view, the last at `len - 1` (`extent`), and
        // stays allocated while `owner`, a reference to the tensor, lives. attn only reads it.
        let foreign = unsafe { Foreign::new(self.address as *const T, len, owner) };
        Ok(Buffer::Foreign(foreign))
    }

    /// An attn tensor over this tensor's memory, strides as they are: f32, f16 or bf16.
    pub fn attn_tensor(&self, py: Python<'_>) -> PyResult<attn::Tensor> {
        let len = self.extent()?;
        let storage = match self.element {
            Some(Element::F32) => Storage::F32(self.buffer(py, len)?),
            Some(Element::F16) => Storage::F16(self.buffer(py, len)?),
            Some(Element::Bf16) => Storage::Bf16(self.buffer(py, len)?),
            _ => {
                return Err(refuse(format!(
                    "`{}` is {}; attn reads float32, float16 and bfloat16 tensors",
                    self.name, self.dtype_name
                )));
            }
        };
        attn::Tensor::view(storage, &self.shape, &self.strides, 0)
            .map_err(|e| refuse(format!("`{}`: {e}", self.name)))
    }

    /// Whether the elements lie in row-major order with no gaps.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != expected {
                return false;
            }
            expected *= n;
        }
        true
    }

    /// The values of a contiguous integer tensor as i32: an int32 tensor's in place, an int64
    /// tensor's converted (refused if one lies outside i32).
    pub fn i32_values(&self, py: Python<'_>) -> PyResult<Buffer<i32>> {
        if self.element != Some(Element::I64) {
            return self.values(py, Element::I32);
        }
        let wide: Buffer<i64> = self.values(py, Element::I64)?;
        let narrow = wide
            .iter()
            .map(|&x| i32::try_from(x))
            .collect::<Result<Vec<i32>, _>>()
            .map_err(|_| refuse(format!("`{}` holds a value outside int32", self.name)))?;
        Ok(Buffer::Owned(narrow))
    }

    /// The elements of a contiguous tensor of `element` (whose elements are `T`s), row-major,
    /// as a foreign buffer.
    pub fn values<T: Send + Sync + 'static>(
        &self,
        py: Python<'_>,
        element: Element,
    ) -> PyResult<Buffer<T>> {
        if self.element != Some(element) || !self.is_contiguous() {
            return Err(refuse(format!(
                "`{}` must be a contiguous {} tensor (it is {}{})",
                self.name,
                match element {
                    Element::I32 => "torch.int32 (or torch.int64)",
                    Element::I64 => "torch.int64",
                    _ => "torch.float32",
                },
                self.dtype_name,
                if self.is_contiguous() {
                    ""
                } else {
                    ", strided"
                }
            )));
        }
        let len = self.extent()?;
        self.buffer(py, len)
    }
}
