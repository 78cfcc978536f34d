//! MLA's absorbed form around the kernels: queries `[W_uk^T q_nope | q_pe]` and keys
//! `[c_kv | k_pe]` over one shared latent head, and outputs expanded by `W_uv`.

use super::checks::{check_dtype, dims, expect, finish, head_dims, shape};
use super::gemm::gemm;
use super::ragged::Layout;
use crate::calls::{MlaQueries, MlaTensors, Output};
use crate::error::RuntimeError;
use crate::tensor::Tensor;
use attn_dsl::AttentionSpec;

/// An MLA forward call's inputs, checked and absorbed: queries `[W_uk^T q_nope | q_pe]`
/// (`[B, heads, Sq, latent_rank + rope_dim]`) and keys `[c_kv | k_pe]` (`[B, Skv, latent_rank +
/// rope_dim]`, whose latent part is also the values), for a kernel over one shared latent head.
pub(crate) struct AbsorbedForward {
    absorption: Absorption,
    w: Vec<f32>,
    /// Absorbed queries.
    pub q: Vec<f32>,
    /// Keys (values: their first `latent_rank` values).
    pub k: Vec<f32>,
    /// Batch, queries and keys per sequence.
    pub b: usize,
    /// See `b`.
    pub sq: usize,
    /// See `b`.
    pub skv: usize,
}

impl AbsorbedForward {
    /// Checks the tensors against the spec and absorbs them.
    pub fn of(spec: &AttentionSpec, x: &MlaTensors) -> Result<Self, RuntimeError> {
        let Some(mla) = spec.mla() else {
            return Err(RuntimeError::Spec(
                "this spec has per-head KV: its forward takes Inputs::Heads (q, k, v)".into(),
            ));
        };
        let (h, dn, dv) = (
            spec.heads as usize,
            spec.head_dim as usize,
            spec.v_head_dim as usize,
        );
        let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
        let [b, _, sq, _] = dims("q_nope", x.q_nope, "[B, heads, Sq, head_dim]")?;
        expect(
            "q_nope",
            x.q_nope,
            &[b, h, sq, dn],
            "[B, heads, Sq, head_dim]",
        )?;
        expect("q_pe", x.q_pe, &[b, h, sq, dr], "[B, heads, Sq, rope_dim]")?;
        let [_, skv, _] = dims(
            "c_kv",
            x.c_kv,
            &format!("[{b}, Skv, {r}] = [B, Skv, latent_rank]"),
        )?;
        expect("c_kv", x.c_kv, &[b, skv, r], "[B, Skv, latent_rank]")?;
        expect("k_pe", x.k_pe, &[b, skv, dr], "[B, Skv, rope_dim]")?;
        expect(
            "w_kv_b",
            x.w_kv_b,
            &[h * (dn + dv), r],
            "[heads * (head_dim + v_head_dim), latent_rank]",
        )?;
        for (name, t) in [
            ("q_nope", x.q_nope),
            ("q_pe", x.q_pe),
            ("c_kv", x.c_kv),
            ("k_pe", x.k_pe),
            ("w_kv_b", x.w_kv_b),
        ] {
            check_dtype(name, t, spec.dtype)?;
        }
        let (q_nope, q_pe, c_kv, k_pe, w) = (
            x.q_nope.to_f32_vec(),
            x.q_pe.to_f32_vec(),
            x.c_kv.to_f32_vec(),
            x.k_pe.to_f32_vec(),
            x.w_kv_b.to_f32_vec(),
        );
        let wq = r + dr;
        let absorption = Absorption { h, dn, dv, r, dr };
        let q = absorption.queries(&q_nope, &q_pe, &w, b * h, sq);
        // k' = [c_kv | k_pe].
        let mut k = vec![0f32; b * skv * wq];
        for j in 0..b * skv {
            k[j * wq..j * wq + r].copy_from_slice(&c_kv[j * r..(j + 1) * r]);
            k[j * wq + r..(j + 1) * wq].copy_from_slice(&k_pe[j * dr..(j + 1) * dr]);
        }
        Ok(AbsorbedForward {
            absorption,
            w,
            q,
            k,
            b,
            sq,
            skv,
        })
    }

    /// Values per absorbed query or key row (`latent_rank + rope_dim`).
    pub fn width(&self) -> usize {
        self.absorption.r + self.absorption.dr
    }

    /// The values: the latent part of each key row, `[B, Skv, latent_rank]`.
    pub fn values(&self) -> Vec<f32> {
        let (r, wq) = (self.absorption.r, self.width());
        self.k
            .chunks(wq)
            .flat_map(|row| row[..r].to_vec())
            .collect()
    }

    /// `out = W_uv out_latent` per head, in the spec's dtype, and the latent output itself
    /// (`[B, heads, Sq, latent_rank]` f32), which the backward takes.
    pub fn finish(
        &self,
        spec: &AttentionSpec,
        latent: Vec<f32>,
        lse: Vec<f32>,
    ) -> Result<Output, RuntimeError> {
        let output = self
            .absorption
            .finish(spec, &self.w, &latent, lse, self.b, self.sq)?;
        let shape = [self.b, self.absorption.h, self.sq, self.absorption.r];
        Ok(Output {
            latent: Some(Tensor::from_f32(&shape, latent)?),
            ..output
        })
    }
}

/// The gradients of MLA's inputs from the absorbed backward kernel's, by the chain rule through
/// the absorption (`q_latent = W_uk^T q_nope`, keys `[c_kv | k_pe]`, values `c_kv`,
/// `out = W_uv out_latent`), as f32 values.
pub(crate) struct MlaChain {
    /// `[B, H, Sq, head_dim]`.
    pub dq_nope: Vec<f32>,
    /// `[B, H, Sq, rope_dim]`.
    pub dq_pe: Vec<f32>,
    /// `[B, Skv, latent_rank]`.
    pub dc_kv: Vec<f32>,
    /// `[B, Skv, rope_dim]`.
    pub dk_pe: Vec<f32>,
    /// `[H * (head_dim + v_head_dim), latent_rank]`.
    pub dw_kv_b: Vec<f32>,
}

impl AbsorbedForward {
    /// `dL/dout_latent = W_uv^T dout` per head: `[B, H, Sq, v_head_dim]` to `[B, H, Sq,
    /// latent_rank]`.
    pub fn latent_dout(&self, dout: &[f32]) -> Vec<f32> {
        let Absorption { h, dn, dv, r, .. } = self.absorption;
        let n = self.sq;
        let mut out = vec![0f32; self.b * h * n * r];
        for pair in 0..self.b * h {
            let w_uv = &self.w[((pair % h) * (dn + dv) + dn) * r..];
            gemm(
                n,
                dv,
                r,
                &dout[pair * n * dv..],
                (dv, 1),
                w_uv,
                (r, 1),
                &mut out[pair * n * r..],
                r,
            );
        }
        out
    }

    /// The inputs' gradients from the kernel's on the absorbed inputs (`dq [B, H, Sq, r + dr]`,
    /// `dk [B, Skv, r + dr]`, `dv [B, Skv, r]`, q_pe and k_pe already rotated back), given the
    /// forward's `q_nope`, `dout` and `out_latent`.
    pub fn chain(
        &self,
        [dq, dk, dv]: [&[f32]; 3],
        q_nope: &[f32],
        dout: &[f32],
        out_latent: &[f32],
    ) -> MlaChain {
        let Absorption {
            h,
            dn,
            dv: dvh,
            r,
            dr,
        } = self.absorption;
        let (n, wq) = (self.sq, r + dr);
        let mut dq_nope = vec![0f32; self.b * h * n * dn];
        let mut dq_pe = vec![0f32; self.b * h * n * dr];
        let mut dw_kv_b = vec![0f32; h * (dn + dvh) * r];
        let mut part = vec![0f32; dn.max(dvh) * r];
        for pair in 0..self.b * h {
            let head = pair % h;
            let w_uk = &self.w[head * (dn + dvh) * r..];
            let dq_rows = &dq[pair * n * wq..];
            // dq_nope = dq_latent W_uk^T (W_uk is `head_dim x latent_rank`).
            gemm(
                n,
                r,
                dn,
                dq_rows,
                (wq, 1),
                w_uk,
                (1, r),
                &mut dq_nope[pair * n * dn..],
                dn,
            );
            for i in 0..n {
                dq_pe[(pair * n + i) * dr..(pair * n + i + 1) * dr]
                    .copy_from_slice(&dq_rows[i * wq + r..(i + 1) * wq]);
            }
            // dW_uk += q_nope^T dq_latent, dW_uv += dout^T out_latent, over this pair's queries.
            let rows = &mut dw_kv_b[head * (dn + dvh) * r..(head + 1) * (dn + dvh) * r];
            gemm(
                dn,
                n,
                r,
                &q_nope[pair * n * dn..],
                (1, dn),
                dq_rows,
                (wq, 1),
                &mut part,
                r,
            );
            add(&mut rows[..dn * r], &part[..dn * r]);
            let (src, lat) = (&dout[pair * n * dvh..], &out_latent[pair * n * r..]);
            gemm(dvh, n, r, src, (1, dvh), lat, (r, 1), &mut part, r);
            add(&mut rows[dn * r..], &part[..dvh * r]);
        }
        // The latent is both the keys' first part and the values.
        let keys = self.b * self.skv;
        let mut dc_kv = vec![0f32; keys * r];
        let mut dk_pe = vec![0f32; keys * dr];
        for j in 0..keys {
            let (score, value) = (&dk[j * wq..(j + 1) * wq], &dv[j * r..(j + 1) * r]);
            for ((c, s), v) in dc_kv[j * r..(j + 1) * r].iter_mut().zip(score).zip(value) {
                *c = s + v;
            }
            dk_pe[j * dr..(j + 1) * dr].copy_from_slice(&score[r..]);
        }
        MlaChain {
            dq_nope,
            dq_pe,
            dc_kv,
            dk_pe,
            dw_kv_b,
        }
    }
}

/// `acc += x`, element by element.
fn add(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, x)| *a += x);
}

/// MLA's absorbed form around the kernel (DeepSeek's `w_kv_b` layout: per head, `head_dim` rows
/// of `W_uk` then `v_head_dim` rows of `W_uv`, each of `latent_rank` values).
pub(crate) struct Absorption {
    h: usize,
    dn: usize,
    dv: usize,
    r: usize,
    dr: usize,
}

impl Absorption {
    /// `q' = [W_uk^T q_nope | q_pe]` for `bh` (batch, head) pairs of `n` queries each (head =
    /// pair % heads): `[bh, n, latent_rank + rope_dim]`.
    fn queries(&self, q_nope: &[f32], q_pe: &[f32], w: &[f32], bh: usize, n: usize) -> Vec<f32> {
        let Absorption { h, dn, dv, r, dr } = *self;
        let wq = r + dr;
        let mut q = vec![0f32; bh * n * wq];
        for pair in 0..bh {
            let head = pair % h;
            let w_uk = &w[head * (dn + dv) * r..];
            let dst = &mut q[pair * n * wq..];
            gemm(
                n,
                dn,
                r,
                &q_nope[pair * n * dn..],
                (dn, 1),
                w_uk,
                (r, 1),
                dst,
                wq,
            );
            for i in 0..n {
                let pe = &q_pe[(pair * n + i) * dr..(pair * n + i + 1) * dr];
                dst[i * wq + r..(i + 1) * wq].copy_from_slice(pe);
            }
        }
        q
    }

    /// `out = W_uv out_latent` for `b` sequences of `n` queries, as the output in the spec's
    /// dtype (`[b, heads, n, v_head_dim]`) with its lse.
    fn finish(
        &self,
        spec: &AttentionSpec,
        w: &[f32],
        latent: &[f32],
        lse: Vec<f32>,
        b: usize,
        n: usize,
    ) -> Result<Output, RuntimeError> {
        let out = self.outputs(latent, w, b * self.h, n);
        finish(spec.dtype, [b, self.h, n, self.dv], out, lse)
    }

    /// `out = W_uv out_latent` per head: `[bh, n, latent_rank]` to `[bh, n, v_head_dim]`.
    fn outputs(&self, latent: &[f32], w: &[f32], bh: usize, n: usize) -> Vec<f32> {
        let Absorption { h, dn, dv, r, .. } = *self;
        let mut out = vec![0f32; bh * n * dv];
        for pair in 0..bh {
            let head = pair % h;
            let w_uv = &w[(head * (dn + dv) + dn) * r..];
            let src = &latent[pair * n * r..];
            gemm(
                n,
                r,
                dv,
                src,
                (r, 1),
                w_uv,
                (1, r),
                &mut out[pair * n * dv..],
                dv,
            );
        }
        out
    }
}

/// An MLA decode call's queries, checked and absorbed (`[W_uk^T q_nope | q_pe]`, rows of
/// `latent_rank + rope_dim`), for a decode kernel over the latent cache.
pub(crate) struct AbsorbedQueries {
    absorption: Absorption,
    w: Vec<f32>,
    /// The absorbed query rows, `[b, heads, n, latent_rank + rope_dim]`.
    pub q: Vec<f32>,
    /// Sequences.
    pub b: usize,
    /// Queries per sequence.
    pub n: usize,
}

impl AbsorbedQueries {
    /// Checks `queries` against the spec (for `seqs` sequences) and absorbs them.
    pub fn of(
        spec: &AttentionSpec,
        queries: MlaQueries,
        seqs: usize,
    ) -> Result<Self, RuntimeError> {
        let Some(mla) = spec.mla() else {
            return Err(RuntimeError::Spec(
                "this spec has per-head KV: its cached calls take Queries::Uniform or Queries::Ragged".into(),
            ));
        };
        let MlaQueries {
            q_nope,
            q_pe,
            w_kv_b,
        } = queries;
        let (h, dn, dv) = head_dims(spec);
        let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
        let [b, n] = match q_nope.shape() {
            [b, hh, n, d] if *hh == h && *d == dn && *b == seqs => [*b, *n],
            _ => {
                return Err(shape(
                    "q_nope",
                    q_nope,
                    &format!("[{seqs}, {h}, q_len, {dn}] (one row per sequence)"),
                ));
            }
        };
        if q_pe.shape() != [b, h, n, dr] {
            return Err(shape("q_pe", q_pe, &format!("[{b}, {h}, {n}, {dr}]")));
        }
        if w_kv_b.shape() != [h * (dn + dv), r] {
            return Err(shape(
                "w_kv_b",
                w_kv_b,
                &format!(
                    "[{}, {r}] (heads * (head_dim + v_head_dim), latent_rank)",
                    h * (dn + dv)
                ),
            ));
        }
        for (name, t) in [("q_nope", q_nope), ("q_pe", q_pe), ("w_kv_b", w_kv_b)] {
            check_dtype(name, t, spec.dtype)?;
        }
        let w = w_kv_b.to_f32_vec();
        let absorption = Absorption { h, dn, dv, r, dr };
        let q = absorption.queries(&q_nope.to_f32_vec(), &q_pe.to_f32_vec(), &w, b * h, n);
        Ok(AbsorbedQueries {
            absorption,
            w,
            q,
            b,
            n,
        })
    }

    /// Calls `f` with where the call's query rows are and where its output rows go.
    pub fn with_layout<R>(&self, f: impl FnOnce(&Layout) -> R) -> R {
        let (h, n) = (self.absorption.h, self.n);
        let wq = self.absorption.r + self.absorption.dr;
        let q_lens = vec![n; self.b];
        let q_at = move |s: usize, i: usize, head: usize| ((s * h + head) * n + i) * wq;
        let out_row = move |s: usize, i: usize, head: usize| (s * h + head) * n + i;
        f(&Layout {
            q_lens: &q_lens,
            q_at: &q_at,
            out_row: &out_row,
            out_rows: self.b * h * n,
        })
    }

    /// `out = W_uv out_latent` per head, and the output in the spec's dtype.
    pub fn finish(
        &self,
        spec: &AttentionSpec,
        latent: &[f32],
        lse: Vec<f32>,
    ) -> Result<Output, RuntimeError> {
        self.absorption
            .finish(spec, &self.w, latent, lse, self.b, self.n)
    }
}
