//! TMA tensor maps as kernels use them: what the host encodes with `cuTensorMapEncodeTiled`
//! (tiled mode, no interleave, out-of-bounds elements read as zero) and what the interpreter
//! copies by, with the checks the driver makes, and the shared-memory swizzles that TMA copies
//! and `wgmma` matrix descriptors share.

/// A shared-memory swizzle: within each group of 8 rows of `bytes` bytes, the 16-byte chunk
/// `c` of row `r` is stored at chunk `c ^ (r % (bytes / 16))` (address bits 4.. XORed with
/// bits 7..). TMA writes boxes in it and `wgmma` reads operands in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Swizzle {
    /// Rows as they are.
    None,
    /// 32-byte rows.
    B32,
    /// 64-byte rows.
    B64,
    /// 128-byte rows (the one whose 8 rows of 16-byte chunks use every shared-memory bank).
    B128,
}

impl Swizzle {
    /// The bytes of a swizzled row (16 without a swizzle: one chunk).
    pub fn row_bytes(self) -> u32 {
        match self {
            Swizzle::None => 16,
            Swizzle::B32 => 32,
            Swizzle::B64 => 64,
            Swizzle::B128 => 128,
        }
    }

    /// The shared address a byte at `addr` is stored at: address bits 4.. XORed with bits 7..
    /// (`log2(row_bytes / 16)` of them). Patterns start at multiples of `8 * row_bytes`.
    pub fn apply(self, addr: usize) -> usize {
        let mask = (self.row_bytes() as usize / 16) - 1;
        addr ^ (((addr >> 7) & mask) << 4)
    }

    /// The alignment a swizzled buffer starts at (its pattern's size; 128 without a swizzle, as
    /// TMA needs).
    pub fn alignment(self) -> usize {
        match self {
            Swizzle::None => 128,
            s => 8 * s.row_bytes() as usize,
        }
    }

    /// The code of a `wgmma` matrix descriptor's bits 62-63.
    pub fn descriptor_code(self) -> u64 {
        match self {
            Swizzle::None => 0,
            Swizzle::B128 => 1,
            Swizzle::B64 => 2,
            Swizzle::B32 => 3,
        }
    }

    /// The swizzle of a descriptor code.
    pub fn from_descriptor_code(code: u64) -> Swizzle {
        match code & 3 {
            0 => Swizzle::None,
            1 => Swizzle::B128,
            2 => Swizzle::B64,
            _ => Swizzle::B32,
        }
    }
}

/// A tiled tensor map: a tensor of up to five dimensions in global memory and the box a copy
/// moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMap {
    /// Bytes per element (2 for bf16 and f16, 4 for f32).
    pub elem_bytes: u32,
    /// The tensor's first byte (16-aligned).
    pub global: i64,
    /// Elements per dimension, innermost first.
    pub dims: Vec<u64>,
    /// Bytes between consecutive indices of dimensions 1.. (multiples of 16).
    pub strides: Vec<u64>,
    /// The box's extent per dimension (1 to 256 each; the innermost a multiple of 16 bytes).
    pub boxes: Vec<u32>,
    /// How the box is laid out in shared memory.
    pub swizzle: Swizzle,
}

impl TensorMap {
    /// What `cuTensorMapEncodeTiled` would refuse, as an error.
    pub fn check(&self) -> Result<(), String> {
        let rank = self.dims.len();
        if !(1..=5).contains(&rank) {
            return Err(format!("a tensor map of rank {rank} (1 to 5)"));
        }
        if self.strides.len() + 1 != rank || self.boxes.len() != rank {
            return Err(format!(
                "a rank-{rank} tensor map needs {} strides and {rank} box extents, found {} and {}",
                rank - 1,
                self.strides.len(),
                self.boxes.len()
            ));
        }
        if ![1, 2, 4, 8].contains(&self.elem_bytes) {
            return Err(format!("{}-byte elements", self.elem_bytes));
        }
        if self.global % 16 != 0 {
            return Err(format!(
                "a tensor at {:#x}, not 16-byte aligned",
                self.global
            ));
        }
        if let Some(d) = self.dims.iter().find(|&&d| d == 0 || d > 1 << 32) {
            return Err(format!("a dimension of {d} elements (1 to 2^32)"));
        }
        if let Some(s) = self.strides.iter().find(|&&s| s % 16 != 0 || s >= 1 << 40) {
            return Err(format!(
                "a stride of {s} bytes (a multiple of 16 below 2^40)"
            ));
        }
        if let Some(b) = self.boxes.iter().find(|&&b| b == 0 || b > 256) {
            return Err(format!("a box extent of {b} (1 to 256)"));
        }
        let inner = u64::from(self.boxes[0]) * u64::from(self.elem_bytes);
        if inner % 16 != 0 {
            return Err(format!(
                "an innermost box of {inner} bytes (a multiple of 16)"
            ));
        }
        if self.swizzle != Swizzle::None && inner > u64::from(self.swizzle.row_bytes()) {
            return Err(format!(
                "an innermost box of {inner} bytes under a {}-byte swizzle (at most its row)",
                self.swizzle.row_bytes()
            ));
        }
        Ok(())
    }

    /// The bytes one copy moves (the whole box, out-of-bounds elements included).
    pub fn box_bytes(&self) -> u64 {
        self.boxes.iter().map(|&b| u64::from(b)).product::<u64>() * u64::from(self.elem_bytes)
    }

    /// Where box element `index` (innermost first) lands: its byte offset from the box's start
    /// before the swizzle (boxes are stored densely, innermost fastest; under a swizzle each
    /// innermost row takes the swizzle's row bytes).
    pub fn box_offset(&self, index: &[u32]) -> usize {
        let row = match self.swizzle {
            Swizzle::None => self.boxes[0] as usize * self.elem_bytes as usize,
            s => s.row_bytes() as usize,
        };
        let mut offset = index[0] as usize * self.elem_bytes as usize;
        let mut stride = row;
        for (&i, &b) in index.iter().zip(&self.boxes).skip(1) {
            offset += i as usize * stride;
            stride *= b as usize;
        }
        offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swizzles_permute_chunks_within_rows_and_maps_are_checked() {
        // Row 3 of a 128-byte swizzle: chunk 0 moves to chunk 3, chunk 5 to chunk 6.
        assert_eq!(Swizzle::B128.apply(3 * 128), 3 * 128 + 3 * 16);
        assert_eq!(
            Swizzle::B128.apply(3 * 128 + 5 * 16 + 2),
            3 * 128 + 6 * 16 + 2
        );
        // Row 9 repeats row 1's pattern.
        assert_eq!(Swizzle::B128.apply(9 * 128), 9 * 128 + 16);
        assert_eq!(Swizzle::B64.apply(3 * 128 + 16), (3 * 128 + 16) ^ 48);
        assert_eq!(Swizzle::None.apply(1234), 1234);
        let map = TensorMap {
            elem_bytes: 2,
            global: 1 << 40,
            dims: vec![128, 1000],
            strides: vec![256],
            boxes: vec![64, 128],
            swizzle: Swizzle::B128,
        };
        map.check().unwrap();
        assert_eq!(map.box_bytes(), 64 * 128 * 2);
        assert_eq!(map.box_offset(&[3, 2]), 2 * 128 + 6);
        let wide = TensorMap {
            boxes: vec![128, 128],
            ..map.clone()
        };
        assert!(wide.check().unwrap_err().contains("128-byte swizzle"));
        let odd = TensorMap {
            strides: vec![200],
            ..map
        };
        assert!(odd.check().unwrap_err().contains("stride of 200"));
    }
}
