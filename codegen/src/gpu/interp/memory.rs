//! The interpreter's device memory: buffers addressed as `(buffer + 1) << 40 | byte offset`,
//! and tensor maps by handle.

use crate::gpu::ir::tma::TensorMap;

/// Device memory: buffers addressed as `(buffer + 1) << 40 | byte offset`.
#[derive(Clone, Debug, Default)]
pub struct Memory {
    buffers: Vec<Vec<u8>>,
    tensor_maps: Vec<TensorMap>,
}

const OFFSET_BITS: u32 = 40;

/// Tensor map handles: `TENSOR_MAPS | index`, outside every buffer's addresses.
const TENSOR_MAPS: i64 = 1 << 62;

impl Memory {
    /// A tensor map (checked as the driver checks it), as the value of a
    /// [`Ty::TensorMap`] parameter.
    pub fn alloc_tensor_map(&mut self, map: TensorMap) -> Result<i64, String> {
        map.check()?;
        self.tensor_maps.push(map);
        Ok(TENSOR_MAPS | (self.tensor_maps.len() as i64 - 1))
    }

    pub(super) fn tensor_map(&self, handle: i64) -> Result<&TensorMap, String> {
        usize::try_from(handle ^ TENSOR_MAPS)
            .ok()
            .filter(|_| handle & TENSOR_MAPS != 0)
            .and_then(|i| self.tensor_maps.get(i))
            .ok_or_else(|| format!("{handle:#x} is not a tensor map"))
    }

    /// A new buffer holding `values`; returns its address.
    pub fn alloc_f32(&mut self, values: &[f32]) -> i64 {
        self.alloc_bytes(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    /// A new buffer of bytes; returns its address.
    pub fn alloc_bytes(&mut self, bytes: Vec<u8>) -> i64 {
        self.buffers.push(bytes);
        (self.buffers.len() as i64) << OFFSET_BITS
    }

    /// `n` f32 values from an address.
    pub fn read_f32(&self, addr: i64, n: usize) -> Result<Vec<f32>, String> {
        (0..n)
            .map(|i| {
                let b = self.bytes(addr + 4 * i as i64, 4)?;
                Ok(f32::from_le_bytes(b.try_into().expect("4 bytes")))
            })
            .collect()
    }

    /// `len` bytes from an address.
    pub fn read_bytes(&self, addr: i64, len: usize) -> Result<Vec<u8>, String> {
        self.bytes(addr, len).map(<[u8]>::to_vec)
    }

    /// Writes bytes at an address (inside one buffer).
    pub fn write_bytes(&mut self, addr: i64, data: &[u8]) -> Result<(), String> {
        self.write(addr, data)
    }

    /// Releases the buffer at `addr` (its start); later accesses to it are errors.
    pub fn free(&mut self, addr: i64) {
        let id = (addr >> OFFSET_BITS) - 1;
        if let Some(b) = usize::try_from(id)
            .ok()
            .and_then(|i| self.buffers.get_mut(i))
        {
            *b = Vec::new();
        }
    }

    fn locate(&self, addr: i64, len: usize) -> Result<(usize, usize), String> {
        let id = (addr >> OFFSET_BITS) - 1;
        let off = (addr & ((1 << OFFSET_BITS) - 1)) as usize;
        match self.buffers.get(id.max(0) as usize) {
            Some(b) if id >= 0 && off + len <= b.len() => Ok((id as usize, off)),
            _ => Err(format!(
                "global access of {len} bytes at {addr:#x} is outside every buffer"
            )),
        }
    }

    pub(super) fn bytes(&self, addr: i64, len: usize) -> Result<&[u8], String> {
        let (id, off) = self.locate(addr, len)?;
        Ok(&self.buffers[id][off..off + len])
    }

    pub(super) fn write(&mut self, addr: i64, data: &[u8]) -> Result<(), String> {
        let (id, off) = self.locate(addr, data.len())?;
        self.buffers[id][off..off + data.len()].copy_from_slice(data);
        Ok(())
    }
}
