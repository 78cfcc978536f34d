//! Transformers composed at run time: a [`ModelConfig`] (from a Hugging Face checkpoint with
//! [`hf::load`]) and its weights, run with the generated attention kernels.
//!
//! Layers are pre-norm: `x += attn(norm(x))`, `x += mlp(norm(x))`; then a final norm and the LM
//! head (the embedding when tied). Attention is any per-head spec (q, k, v, o projections) or MLA
//! (DeepSeek's low-rank KV with its absorbed kernels). [`Model::forward`] runs a whole sequence;
//! a [`Session`] runs one incrementally against paged KV caches (one per layer), for decoding.

mod config;
pub mod hf;
mod layers;

pub use config::{MlpKind, ModelConfig, NormKind};

use crate::cache::{PagedCache, SeqId};
use crate::cpu::{CpuBackend, DecodeOptions, MlaQueries, MlaTensors};
use crate::error::RuntimeError;
use crate::tensor::Tensor;
use layers::{Linear, Mlp, Norm};

/// The attention weights of a layer.
#[derive(Clone, Debug)]
pub(crate) enum AttentionWeights {
    /// Per-head projections.
    Heads {
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
    },
    /// DeepSeek MLA: queries (directly, or through a low-rank `q_a` / norm / `q_b`), the joint
    /// `[latent | rope key]` projection, the latent norm, `w_kv_b` and the output projection.
    Mla {
        q: Linear,
        q_b: Option<(Norm, Linear)>,
        kv_a: Linear,
        kv_norm: Norm,
        w_kv_b: Tensor,
        o: Linear,
    },
}

/// One decoder layer.
#[derive(Clone, Debug)]
pub(crate) struct Layer {
    pub attn_norm: Norm,
    pub attn: AttentionWeights,
    pub mlp_norm: Norm,
    pub mlp: Mlp,
}

/// A model ready to run on the CPU.
#[derive(Debug)]
pub struct Model {
    /// What it is.
    pub config: ModelConfig,
    /// `[vocab, hidden]`.
    pub(crate) embed: Vec<f32>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) final_norm: Norm,
    /// `[vocab, hidden]`, absent when tied to the embedding.
    pub(crate) lm_head: Option<Linear>,
    backend: CpuBackend,
}

/// Where a layer's attention gets its keys: the call's own tokens, or a cache.
enum Keys<'a> {
    Full,
    Cached {
        cache: &'a mut PagedCache,
        seq: SeqId,
    },
}

impl Model {
    pub(crate) fn new(
        config: ModelConfig,
        embed: Vec<f32>,
        layers: Vec<Layer>,
        final_norm: Norm,
        lm_head: Option<Linear>,
    ) -> Self {
        Model {
            config,
            embed,
            layers,
            final_norm,
            lm_head,
            backend: CpuBackend::new(),
        }
    }

    /// Logits `[tokens, vocab]` of a whole sequence (causal; positions from 0).
    pub fn forward(&self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        self.run(tokens, |_| Keys::Full)
    }

    /// A session that runs one sequence incrementally with a paged cache per layer of
    /// `capacity` tokens (blocks of `block_size`).
    pub fn session(&self, capacity: usize, block_size: usize) -> Result<Session<'_>, RuntimeError> {
        let mut caches = Vec::with_capacity(self.layers.len());
        let mut seqs = Vec::with_capacity(self.layers.len());
        for _ in &self.layers {
            let mut cache = PagedCache::new(
                &self.config.attention,
                block_size,
                capacity.div_ceil(block_size),
            )?;
            seqs.push(cache.add_sequence());
            caches.push(cache);
        }
        Ok(Session {
            model: self,
            caches,
            seqs,
            len: 0,
        })
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        let (vocab, d) = (self.config.vocab, self.config.hidden);
        let mut x = Vec::with_capacity(tokens.len() * d);
        for (i, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            if t >= vocab {
                return Err(RuntimeError::Data(format!(
                    "token {i} is {t}, outside the vocabulary of {vocab}"
                )));
            }
            x.extend_from_slice(&self.embed[t * d..(t + 1) * d]);
        }
        Ok(x)
    }

    fn run<'c>(
        &self,
        tokens: &[u32],
        mut keys: impl FnMut(usize) -> Keys<'c>,
    ) -> Result<Vec<f32>, RuntimeError> {
        let n = tokens.len();
        let mut x = self.embed(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.attn_norm.apply(&x);
            let a = self.attention(&layer.attn, &h, n, keys(i))?;
            add(&mut x, &a);
            let h = layer.mlp_norm.apply(&x);
            let m = layer.mlp.apply(&h, n);
            add(&mut x, &m);
        }
        let x = self.final_norm.apply(&x);
        Ok(match &self.lm_head {
            Some(head) => head.apply(&x, n),
            None => Linear {
                w: self.embed.clone(),
                bias: None,
                out: self.config.vocab,
                inp: self.config.hidden,
            }
            .apply(&x, n),
        })
    }

    /// One layer's attention over `n` rows of normed hidden states: `[n, hidden]`.
    fn attention(
        &self,
        weights: &AttentionWeights,
        h: &[f32],
        n: usize,
        keys: Keys,
    ) -> Result<Vec<f32>, RuntimeError> {
        let spec = &self.config.attention;
        let heads = spec.heads as usize;
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        // `[n, heads, dim]` rows as a `[1, heads, n, dim]` view.
        let by_head = |data: Vec<f32>, heads: usize, dim: usize| {
            Tensor::from_f32_as(spec.dtype, &[1, n, heads, dim], data)?.permute(&[0, 2, 1, 3])
        };
        let out = match weights {
            AttentionWeights::Heads { q, k, v, o } => {
                let hkv = spec.kv_heads() as usize;
                let (qs, ks, vs) = (q.apply(h, n), k.apply(h, n), v.apply(h, n));
                let q = by_head(qs, heads, d)?;
                let out = match keys {
                    Keys::Full => {
                        let (k, v) = (by_head(ks, hkv, d)?, by_head(vs, hkv, dv)?);
                        self.backend.forward(spec, &q, &k, &v, 0)?.out
                    }
                    Keys::Cached { cache, seq } => {
                        let per_kv = |data: Vec<f32>, dim: usize| {
                            Tensor::from_f32_as(spec.dtype, &[n, hkv, dim], data)?
                                .permute(&[1, 0, 2])
                        };
                        cache.append(seq, &per_kv(ks, d)?, &per_kv(vs, dv)?)?;
                        let options = DecodeOptions::default();
                        self.backend.decode(spec, &q, cache, &[seq], options)?.out
                    }
                };
                let out = out.permute(&[0, 2, 1, 3])?.to_f32_vec();
                o.apply(&out, n)
            }
            AttentionWeights::Mla {
                q,
                q_b,
                kv_a,
                kv_norm,
                w_kv_b,
                o,
            } => {
                let mla = spec.mla().expect("MLA weights come with an MLA spec");
                let (r, dr) = (mla.latent_rank as usize, mla.rope_dim as usize);
                let qs = match q_b {
                    Some((norm, q_b)) => q_b.apply(&norm.apply(&q.apply(h, n)), n),
                    None => q.apply(h, n),
                };
                let (mut nope, mut pe) = (Vec::new(), Vec::new());
                for row in qs.chunks_exact(d + dr) {
                    nope.extend_from_slice(&row[..d]);
                    pe.extend_from_slice(&row[d..]);
                }
                let (q_nope, q_pe) = (by_head(nope, heads, d)?, by_head(pe, heads, dr)?);
                let kv = kv_a.apply(h, n);
                let (mut c_kv, mut k_pe) = (Vec::new(), Vec::new());
                for row in kv.chunks_exact(r + dr) {
                    c_kv.extend_from_slice(&row[..r]);
                    k_pe.extend_from_slice(&row[r..]);
                }
                let c_kv = kv_norm.apply(&c_kv);
                let out = match keys {
                    Keys::Full => {
                        let c_kv = Tensor::from_f32_as(spec.dtype, &[1, n, r], c_kv)?;
                        let k_pe = Tensor::from_f32_as(spec.dtype, &[1, n, dr], k_pe)?;
                        let x = MlaTensors {
                            q_nope: &q_nope,
                            q_pe: &q_pe,
                            c_kv: &c_kv,
                            k_pe: &k_pe,
                            w_kv_b,
                        };
                        self.backend.forward_mla(spec, &x, 0)?.out
                    }
                    Keys::Cached { cache, seq } => {
                        let c_kv = Tensor::from_f32_as(spec.dtype, &[n, r], c_kv)?;
                        let k_pe = Tensor::from_f32_as(spec.dtype, &[n, dr], k_pe)?;
                        cache.append(seq, &c_kv, &k_pe)?;
                        let queries = MlaQueries {
                            q_nope: &q_nope,
                            q_pe: &q_pe,
                            w_kv_b,
                        };
                        let options = DecodeOptions::default();
                        self.backend
                            .decode_mla(spec, queries, cache, &[seq], options)?
                            .out
                    }
                };
                let out = out.permute(&[0, 2, 1, 3])?.to_f32_vec();
                o.apply(&out, n)
            }
        };
        Ok(out)
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// One sequence run incrementally: each call appends its tokens' keys and values to the layers'
/// caches and attends to everything cached (prefill, then decode one token at a time).
#[derive(Debug)]
pub struct Session<'m> {
    model: &'m Model,
    caches: Vec<PagedCache>,
    seqs: Vec<SeqId>,
    len: usize,
}

impl Session<'_> {
    /// Logits `[tokens, vocab]` of the next tokens of the sequence.
    pub fn step(&mut self, tokens: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        let Session {
            model,
            caches,
            seqs,
            len,
        } = self;
        let mut caches = caches.iter_mut();
        let logits = model.run(tokens, |i| Keys::Cached {
            cache: caches.next().expect("one cache per layer"),
            seq: seqs[i],
        })?;
        *len += tokens.len();
        Ok(logits)
    }

    /// Tokens run so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token has run yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
