//! MLA on the device in its absorbed form: queries `[W_uk^T q_nope | q_pe]` and keys `[c_kv |
//! k_pe]` over one shared latent head, split and joined by the column-copy kernel, `W_uk` and
//! `W_uv` applied as one GEMM per head.

use super::{DeviceMatrix, DeviceMla, MlaDims, ResidentModel, blocks};
use crate::device::{DeviceBuffer, Scratch};
use crate::error::RuntimeError;
use attn_dsl::DType;
use codegen::gpu::kernels::layers;

/// `bytes` bytes of `b` from byte `offset` on.
fn sub(b: DeviceBuffer, offset: usize, bytes: usize) -> DeviceBuffer {
    DeviceBuffer {
        addr: b.addr + offset as i64,
        bytes,
    }
}

impl ResidentModel<'_> {
    /// `out[j, i, out_first..] = x[i, j, in_first..]` for `width` columns of `[a, b, in_width]`
    /// rows into `[b, a, out_width]` rows (`a = 1`: rows in order).
    pub(super) fn columns(
        &self,
        out: DeviceBuffer,
        x: DeviceBuffer,
        [a, b]: [usize; 2],
        [in_width, in_first]: [usize; 2],
        [out_width, out_first]: [usize; 2],
        width: usize,
    ) -> Result<(), RuntimeError> {
        self.launch(
            &self.kernels.columns,
            blocks(a * b * width)?,
            &layers::ColumnsArgs {
                x: x.addr,
                out: out.addr,
                a: a as i64,
                b: b as i64,
                in_width: in_width as i64,
                in_first: in_first as i64,
                out_width: out_width as i64,
                out_first: out_first as i64,
                width: width as i64,
            },
        )
    }

    /// MLA's rows of `n` normed tokens `h`: the queries `[n, heads, d + dr]`, the keys `[c_kv |
    /// k_pe]` `[n, r + dr]` (the latent normed) and the latent `c_kv` `[n, r]` (the values).
    pub(super) fn mla_rows(
        &self,
        s: &mut Scratch,
        m: &DeviceMla,
        x: MlaDims,
        h: DeviceBuffer,
        n: usize,
    ) -> Result<[DeviceBuffer; 3], RuntimeError> {
        let MlaDims { r, dr, .. } = x;
        let qs = self.linear(s, &m.q, h, n)?;
        let qs = match &m.q_b {
            Some((norm, q_b)) => {
                let normed = self.norm(s, norm, qs, n * m.q.w.rows)?;
                self.linear(s, q_b, normed, n)?
            }
            None => qs,
        };
        let kv = self.linear(s, &m.kv_a, h, n)?;
        let c_kv = s.f32s(n * r)?;
        self.columns(c_kv, kv, [1, n], [r + dr, 0], [r, 0], r)?;
        let c_kv = self.norm(s, &m.kv_norm, c_kv, n * r)?;
        let k = s.f32s(n * (r + dr))?;
        self.columns(k, c_kv, [1, n], [r, 0], [r + dr, 0], r)?;
        self.columns(k, kv, [1, n], [r + dr, r], [r + dr, r], dr)?;
        Ok([qs, k, c_kv])
    }

    /// MLA's absorbed queries `[W_uk^T q_nope | q_pe]` of `n` tokens from their query rows
    /// `qs` (`[n, heads, d + dr]`): `[heads, n, r + dr]` when `head_major`, else `[n, heads,
    /// r + dr]`.
    pub(super) fn mla_queries(
        &self,
        s: &mut Scratch,
        m: &DeviceMla,
        x: MlaDims,
        qs: DeviceBuffer,
        n: usize,
        head_major: bool,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let MlaDims {
            heads, d, r, dr, ..
        } = x;
        let q_nope = s.f32s(heads * n * d)?;
        self.columns(q_nope, qs, [n, heads], [d + dr, 0], [d, 0], d)?;
        let q_lat = s.f32s(heads * n * r)?;
        self.per_head_gemm(q_nope, m.w_uk_t, [r, d], q_lat, [heads, n])?;
        let q = s.f32s(heads * n * (r + dr))?;
        let w = r + dr;
        if head_major {
            self.columns(q, q_lat, [1, heads * n], [r, 0], [w, 0], r)?;
            self.columns(q, qs, [n, heads], [d + dr, d], [w, r], dr)?;
        } else {
            self.columns(q, q_lat, [heads, n], [r, 0], [w, 0], r)?;
            self.columns(q, qs, [1, n * heads], [d + dr, d], [w, r], dr)?;
        }
        Ok(q)
    }

    /// MLA's outputs `[n, heads * dv]` from the latent outputs `[heads, n, r]`: `W_uv` per head.
    pub(super) fn mla_outputs(
        &self,
        s: &mut Scratch,
        m: &DeviceMla,
        x: MlaDims,
        latent: DeviceBuffer,
        n: usize,
    ) -> Result<DeviceBuffer, RuntimeError> {
        let MlaDims { heads, dv, r, .. } = x;
        let out = s.f32s(heads * n * dv)?;
        self.per_head_gemm(latent, m.w_uv, [dv, r], out, [heads, n])?;
        self.swap(s, &self.kernels.from_heads, out, [heads, n, dv], 4)
    }

    /// `y[h] = x[h] W[h]^T` for each head `h`: `x` `[heads, n, cols]`, `w` `[heads, rows, cols]`
    /// f32, `y` `[heads, n, rows]`.
    pub(super) fn per_head_gemm(
        &self,
        x: DeviceBuffer,
        w: DeviceBuffer,
        [rows, cols]: [usize; 2],
        y: DeviceBuffer,
        [heads, n]: [usize; 2],
    ) -> Result<(), RuntimeError> {
        for head in 0..heads {
            let w_h = DeviceMatrix {
                buffer: sub(w, 4 * head * rows * cols, 4 * rows * cols),
                dtype: DType::F32,
                rows,
                cols,
            };
            let x_h = sub(x, 4 * head * n * cols, 4 * n * cols);
            self.gemm(x_h, &w_h, sub(y, 4 * head * n * rows, 4 * n * rows), n)?;
        }
        Ok(())
    }
}
