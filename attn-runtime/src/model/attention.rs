//! One layer's attention inside a model: the projections, the backend's attention over all the
//! tokens at once (a forward pass) or over each sequence's KV cache (a session step), and the
//! output projection. Per-head (MHA, GQA, MQA) and MLA weights.

use super::differential::DifferentialWeights;
use super::sublayers::{Linear, Norm};
use super::{AttentionWeights, Keys, Model, Step};
use crate::cache::{KvCache, SeqId};
use crate::calls::{DecodeOptions, Inputs, MlaQueries, MlaTensors, Queries};
use crate::error::RuntimeError;
use crate::learned::Learned;
use crate::tensor::Tensor;
use crate::variant::Variant;
use std::sync::Arc;

impl Model {
    /// One layer's attention over `n` rows of normed hidden states: `[n, hidden]`.
    pub(super) fn attention(
        &self,
        variant: &Arc<Variant>,
        weights: &AttentionWeights,
        h: &[f32],
        n: usize,
        keys: Keys,
    ) -> Result<Vec<f32>, RuntimeError> {
        match weights {
            AttentionWeights::Heads {
                q,
                k,
                v,
                o,
                qk_norm,
                learned,
                differential,
            } => {
                let [mut qs, mut ks, mut vs] = Linear::apply_all([q, k, v], h, n);
                let dv = variant.spec().v_head_dim as usize;
                if differential.is_some() {
                    vs = DifferentialWeights::values_per_component(&vs, dv);
                }
                // Norms on q and k (per head: rows of head_dim; whole: rows of the projection)
                // come before RoPE, which the kernels apply.
                if let Some([q_norm, k_norm]) = qk_norm {
                    qs = q_norm.apply(self.layer_ops(), &qs)?;
                    ks = k_norm.apply(self.layer_ops(), &ks)?;
                }
                let learned: Vec<(&str, &Tensor)> =
                    learned.iter().map(|(n, t)| (n.as_str(), t)).collect();
                let learned = Learned::new(&learned);
                let out = match keys {
                    Keys::Full => self.heads_over_all(variant, qs, ks, vs, n, learned)?,
                    Keys::Cached(step) => {
                        self.heads_over_caches(variant, [&qs, &ks, &vs], n, step, learned)?
                    }
                };
                let out = match differential {
                    Some(d) => d.pair(self.layer_ops(), &out, dv)?,
                    None => out,
                };
                Ok(o.apply(&out, n))
            }
            AttentionWeights::Mla {
                q,
                q_b,
                kv_a,
                kv_norm,
                w_kv_b,
                o,
            } => {
                let rows = self.mla_rows(variant, [q, kv_a], q_b.as_ref(), kv_norm, h, n)?;
                let out = match keys {
                    Keys::Full => self.mla_over_all(variant, &rows, w_kv_b, n)?,
                    Keys::Cached(step) => self.mla_over_caches(variant, &rows, w_kv_b, n, step)?,
                };
                Ok(o.apply(&out, n))
            }
        }
    }

    /// `[rows, heads, dim]` data as a `[1, heads, rows, dim]` view in the spec's dtype.
    fn by_head(
        &self,
        variant: &Arc<Variant>,
        data: Vec<f32>,
        [rows, heads, dim]: [usize; 3],
    ) -> Result<Tensor, RuntimeError> {
        let dtype = variant.spec().dtype;
        Tensor::from_f32_as(dtype, &[1, rows, heads, dim], data)?.permute(&[0, 2, 1, 3])
    }

    /// Per-head attention of `n` tokens over themselves (one sequence, no cache): `[n, heads
    /// * v_dim]`.
    fn heads_over_all(
        &self,
        variant: &Arc<Variant>,
        qs: Vec<f32>,
        ks: Vec<f32>,
        vs: Vec<f32>,
        n: usize,
        learned: Learned,
    ) -> Result<Vec<f32>, RuntimeError> {
        let spec = variant.spec();
        let (heads, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let q = self.by_head(variant, qs, [n, heads, d])?;
        let k = self.by_head(variant, ks, [n, hkv, d])?;
        let v = self.by_head(variant, vs, [n, hkv, dv])?;
        let out = self
            .backend
            .forward_learned(variant, Inputs::heads(&q, &k, &v), 0, learned)?
            .out;
        Ok(out.permute(&[0, 2, 1, 3])?.to_f32_vec())
    }

    /// Per-head attention of a step: each sequence's new keys and values appended to its cache;
    /// sequences with nothing cached yet attend only to their own tokens (the packed prefill
    /// kernel serves them), the rest read the cache in one ragged launch.
    fn heads_over_caches(
        &self,
        variant: &Arc<Variant>,
        [qs, ks, vs]: [&[f32]; 3],
        n: usize,
        step: Step,
        learned: Learned,
    ) -> Result<Vec<f32>, RuntimeError> {
        let spec = variant.spec();
        let (heads, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let Step {
            cache,
            seqs,
            offsets,
        } = step;
        let mut fresh = Vec::with_capacity(seqs.len());
        for &seq in seqs.iter() {
            fresh.push(cache.seq_len(seq)? == 0);
        }
        // Each sequence's new keys and values, as [kv_heads, tokens, dim].
        for (i, &seq) in seqs.iter().enumerate() {
            let rows = offsets[i]..offsets[i + 1];
            let part = |data: &[f32], dim: usize| {
                let rows = data[rows.start * hkv * dim..rows.end * hkv * dim].to_vec();
                Tensor::from_f32_as(spec.dtype, &[rows.len() / (hkv * dim), hkv, dim], rows)?
                    .permute(&[1, 0, 2])
            };
            cache.append(seq, &part(ks, d)?, &part(vs, dv)?)?;
        }
        let mut out = vec![0f32; n * heads * dv];
        let rows_of = |data: &[f32], width: usize, i: usize| {
            data[offsets[i] * width..offsets[i + 1] * width].to_vec()
        };
        let (mut rest_q, mut rest_offsets, mut rest_seqs) = (Vec::new(), vec![0], Vec::new());
        for (i, &seq) in seqs.iter().enumerate() {
            let len = offsets[i + 1] - offsets[i];
            if len == 0 {
                continue;
            }
            if fresh[i] {
                let q = self.by_head(variant, rows_of(qs, heads * d, i), [len, heads, d])?;
                let k = self.by_head(variant, rows_of(ks, hkv * d, i), [len, hkv, d])?;
                let v = self.by_head(variant, rows_of(vs, hkv * dv, i), [len, hkv, dv])?;
                let inputs = Inputs::heads(&q, &k, &v);
                let o = self
                    .backend
                    .forward_learned(variant, inputs, 0, learned)?
                    .out;
                let o = o.permute(&[0, 2, 1, 3])?.to_f32_vec();
                out[offsets[i] * heads * dv..offsets[i + 1] * heads * dv].copy_from_slice(&o);
            } else {
                rest_q.extend(rows_of(qs, heads * d, i));
                rest_offsets.push(rest_offsets.last().copied().unwrap_or(0) + len);
                rest_seqs.push((i, seq));
            }
        }
        if rest_seqs.is_empty() {
            return Ok(out);
        }
        let total = rest_q.len() / (heads * d);
        let q = Tensor::from_f32_as(spec.dtype, &[total, heads, d], rest_q)?;
        let ids: Vec<SeqId> = rest_seqs.iter().map(|&(_, s)| s).collect();
        let queries = Queries::Ragged {
            q: &q,
            offsets: &rest_offsets,
        };
        let options = DecodeOptions::default();
        let o = self
            .backend
            .attend_cached_learned(variant, queries, cache, &ids, options, learned)?
            .out
            .to_f32_vec();
        for (j, &(i, _)) in rest_seqs.iter().enumerate() {
            let width = heads * dv;
            let src = &o[rest_offsets[j] * width..rest_offsets[j + 1] * width];
            out[offsets[i] * width..offsets[i + 1] * width].copy_from_slice(src);
        }
        Ok(out)
    }

    /// MLA's projections of `n` rows: the queries' non-RoPE and RoPE parts (through the
    /// low-rank `q_b` where the model has it), and the normed latent and shared RoPE key.
    fn mla_rows(
        &self,
        variant: &Arc<Variant>,
        [q, kv_a]: [&Linear; 2],
        q_b: Option<&(Norm, Linear)>,
        kv_norm: &Norm,
        h: &[f32],
        n: usize,
    ) -> Result<MlaRows, RuntimeError> {
        let spec = variant.spec();
        let mla = spec.mla().expect("MLA weights come with an MLA spec");
        let (d, r, dr) = (
            spec.head_dim as usize,
            mla.latent_rank as usize,
            mla.rope_dim as usize,
        );
        let ops = self.ops.as_ref();
        let qs = match q_b {
            Some((norm, q_b)) => q_b.apply(&norm.apply(ops, &q.apply(h, n))?, n),
            None => q.apply(h, n),
        };
        let (mut nope, mut pe) = (Vec::new(), Vec::new());
        for row in qs.chunks_exact(d + dr) {
            nope.extend_from_slice(&row[..d]);
            pe.extend_from_slice(&row[d..]);
        }
        let kv = kv_a.apply(h, n);
        let (mut c_kv, mut k_pe) = (Vec::new(), Vec::new());
        for row in kv.chunks_exact(r + dr) {
            c_kv.extend_from_slice(&row[..r]);
            k_pe.extend_from_slice(&row[r..]);
        }
        let c_kv = kv_norm.apply(ops, &c_kv)?;
        Ok(MlaRows {
            nope,
            pe,
            c_kv,
            k_pe,
        })
    }

    /// Rows `a..b` of `[n, heads, dim]` data as a `[1, heads, b - a, dim]` view.
    fn mla_view(
        &self,
        variant: &Arc<Variant>,
        data: &[f32],
        dim: usize,
        a: usize,
        b: usize,
    ) -> Result<Tensor, RuntimeError> {
        let heads = variant.spec().heads as usize;
        let rows = data[a * heads * dim..b * heads * dim].to_vec();
        self.by_head(variant, rows, [b - a, heads, dim])
    }

    /// MLA attention of `n` tokens over themselves (one sequence, no cache).
    fn mla_over_all(
        &self,
        variant: &Arc<Variant>,
        rows: &MlaRows,
        w_kv_b: &Tensor,
        n: usize,
    ) -> Result<Vec<f32>, RuntimeError> {
        let spec = variant.spec();
        let mla = spec.mla().expect("MLA weights come with an MLA spec");
        let (d, r, dr) = (
            spec.head_dim as usize,
            mla.latent_rank as usize,
            mla.rope_dim as usize,
        );
        let c_kv = Tensor::from_f32_as(spec.dtype, &[1, n, r], rows.c_kv.clone())?;
        let k_pe = Tensor::from_f32_as(spec.dtype, &[1, n, dr], rows.k_pe.clone())?;
        let x = MlaTensors {
            q_nope: &self.mla_view(variant, &rows.nope, d, 0, n)?,
            q_pe: &self.mla_view(variant, &rows.pe, dr, 0, n)?,
            c_kv: &c_kv,
            k_pe: &k_pe,
            w_kv_b,
        };
        let out = self.backend.forward(variant, Inputs::Mla(x), 0)?.out;
        Ok(out.permute(&[0, 2, 1, 3])?.to_f32_vec())
    }

    /// MLA attention of a step: each sequence's latents appended to its cache, then one decode
    /// call per sequence (MLA has no ragged entry point yet).
    fn mla_over_caches(
        &self,
        variant: &Arc<Variant>,
        rows: &MlaRows,
        w_kv_b: &Tensor,
        n: usize,
        step: Step,
    ) -> Result<Vec<f32>, RuntimeError> {
        let spec = variant.spec();
        let mla = spec.mla().expect("MLA weights come with an MLA spec");
        let (heads, d, dv) = (
            spec.heads as usize,
            spec.head_dim as usize,
            spec.v_head_dim as usize,
        );
        let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
        let Step {
            cache,
            seqs,
            offsets,
        } = step;
        let mut out = Vec::with_capacity(n * heads * dv);
        for (i, &seq) in seqs.iter().enumerate() {
            let (a, b) = (offsets[i], offsets[i + 1]);
            if a == b {
                continue;
            }
            let latent = rows.c_kv[a * r..b * r].to_vec();
            let rope = rows.k_pe[a * dr..b * dr].to_vec();
            cache.append(
                seq,
                &Tensor::from_f32_as(spec.dtype, &[b - a, r], latent)?,
                &Tensor::from_f32_as(spec.dtype, &[b - a, dr], rope)?,
            )?;
            let queries = MlaQueries {
                q_nope: &self.mla_view(variant, &rows.nope, d, a, b)?,
                q_pe: &self.mla_view(variant, &rows.pe, dr, a, b)?,
                w_kv_b,
            };
            let options = DecodeOptions::default();
            let o = self.backend.attend_cached(
                variant,
                Queries::Mla(queries),
                cache,
                &[seq],
                options,
            )?;
            out.extend(o.out.permute(&[0, 2, 1, 3])?.to_f32_vec());
        }
        Ok(out)
    }
}

/// MLA's per-row projections: `[n, heads, dim]` query parts and `[n, dim]` latent and RoPE key.
struct MlaRows {
    nope: Vec<f32>,
    pe: Vec<f32>,
    c_kv: Vec<f32>,
    k_pe: Vec<f32>,
}
