//! OpenAI's MXFP4 expert weights, as gpt-oss checkpoints store them: each run of 32 values of a
//! row is 16 bytes of 4-bit codes (FP4 e2m1, the low nibble first) and one byte of shared
//! exponent `2^(scale - 127)`. Dequantized at load as transformers' `convert_moe_packed_tensors`
//! does, into bf16, which holds every such value exactly.

use crate::error::RuntimeError;
use crate::io::RawTensor;
use crate::tensor::Tensor;
use safetensors::Dtype;

/// The values of the 16 FP4 codes.
const FP4: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The stacked expert weight `name` (`[experts, cols, rows]`, the `x W` form) from its blocks
/// `[experts, rows, cols / 32, 16]` and scales `[experts, rows, cols / 32]`, both `U8`.
pub(crate) fn dequantize(
    name: &str,
    blocks: &RawTensor,
    scales: &RawTensor,
    [experts, cols, rows]: [usize; 3],
) -> Result<Tensor, RuntimeError> {
    // The shape, then the dtype: an error names what differs.
    let check = |which: &str, t: &RawTensor, expected: Vec<usize>| {
        let packing = format!("MXFP4 for a [{experts}, {cols}, {rows}] weight");
        if t.shape != expected {
            return Err(RuntimeError::Shape {
                tensor: format!("{name}_{which}"),
                found: t.shape.clone(),
                expected: format!("{expected:?}, u8 ({packing})"),
            });
        }
        if t.dtype != Dtype::U8 {
            return Err(RuntimeError::Data(format!(
                "`{name}_{which}` holds {:?} values; expected U8 ({packing})",
                t.dtype
            )));
        }
        Ok(())
    };
    if !cols.is_multiple_of(32) {
        return Err(RuntimeError::Data(format!(
            "`{name}` has rows of {cols} values; MXFP4 packs them in runs of 32"
        )));
    }
    let groups = cols / 32;
    check("blocks", blocks, vec![experts, rows, groups, 16])?;
    check("scales", scales, vec![experts, rows, groups])?;
    let mut out = vec![half::bf16::ZERO; experts * cols * rows];
    for e in 0..experts {
        for r in 0..rows {
            for g in 0..groups {
                let at = (e * rows + r) * groups + g;
                let scale = 2f32.powi(i32::from(scales.data[at]) - 127);
                let bytes = &blocks.data[at * 16..(at + 1) * 16];
                for (b, &byte) in bytes.iter().enumerate() {
                    for (half, code) in [(0, byte & 0x0f), (1, byte >> 4)] {
                        let c = g * 32 + 2 * b + half;
                        // Transposed: value (r, c) of the packed rows is (c, r) of the weight.
                        out[(e * cols + c) * rows + r] =
                            half::bf16::from_f32(FP4[usize::from(code)] * scale);
                    }
                }
            }
        }
    }
    Tensor::from_bf16(&[experts, cols, rows], out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(shape: &[usize], data: Vec<u8>) -> RawTensor {
        RawTensor {
            dtype: Dtype::U8,
            shape: shape.to_vec(),
            data,
        }
    }

    /// Codes read low nibble first, scaled by their run's exponent, landing transposed.
    #[test]
    fn codes_scale_by_their_exponent_and_land_transposed() {
        // One expert, 2 rows of 32 values: row 0 all code 0x1 / 0x2 (0.5, 1.0) at 2^1, row 1
        // codes 0xf / 0x9 (-6, -0.5) at 2^-3.
        let blocks = raw(&[1, 2, 1, 16], [vec![0x21; 16], vec![0x9f; 16]].concat());
        let scales = raw(&[1, 2, 1], vec![128, 124]);
        let t = dequantize("w", &blocks, &scales, [1, 32, 2]).unwrap();
        let v = t.to_f32_vec();
        assert_eq!(t.shape(), &[1, 32, 2]);
        for c in 0..32 {
            let (row0, row1) = if c % 2 == 0 {
                (1.0, -0.75)
            } else {
                (2.0, -0.0625)
            };
            assert_eq!((v[c * 2], v[c * 2 + 1]), (row0, row1), "column {c}");
        }
        // Shapes and dtypes other than the weight's packing are errors naming the tensor.
        let e = dequantize("w", &blocks, &raw(&[1, 2], vec![0; 2]), [1, 32, 2]).unwrap_err();
        assert!(e.to_string().contains("w_scales"), "{e}");
        let e = dequantize("w", &blocks, &scales, [1, 64, 2]).unwrap_err();
        assert!(e.to_string().contains("w_blocks"), "{e}");
        let e = dequantize("w", &blocks, &scales, [1, 31, 2]).unwrap_err();
        assert!(e.to_string().contains("runs of 32"), "{e}");
        // The right shape in another dtype says so, not that the shapes differ.
        let wide = RawTensor {
            dtype: Dtype::F32,
            ..raw(&[1, 2, 1], vec![0; 8])
        };
        let e = dequantize("w", &blocks, &wide, [1, 32, 2])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`w_scales` holds F32 values; expected U8"),
            "{e}"
        );
    }
}
