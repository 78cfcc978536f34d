//! The CPU backend: compiles plans with codegen's Cranelift backend (once per spec per process)
//! and runs them over rayon's thread pool.

pub(crate) mod decode;
pub use decode::{DecodeOptions, MlaQueries};
mod launch;
pub mod microkernels;
pub(crate) mod rope_table;
pub mod row_kernels;

use crate::error::RuntimeError;
use crate::tensor::Tensor;
use attn_dsl::{AttentionSpec, DType};
use codegen::KernelPlan;
use codegen::cpu::abi::Imports;
use codegen::cpu::{CpuKernel, compile};
use codegen::plan::PlanKind;
use launch::{Call, Rows};
use microkernels::Isa;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Attention outputs.
#[derive(Clone, Debug)]
pub struct Output {
    /// `[B, Hq, Sq, Dv]` in the spec's dtype.
    pub out: Tensor,
    /// `[B, Hq, Sq]` f32: natural log of the softmax denominator, `-inf` for empty rows.
    pub lse: Tensor,
}

/// The CPU backend for one instruction set of microkernels.
#[derive(Clone, Copy, Debug)]
pub struct CpuBackend {
    isa: Isa,
}

type Cache = Mutex<HashMap<(String, &'static str, PlanKind), Arc<CpuKernel>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// The backend with the best microkernels this CPU supports.
    pub fn new() -> Self {
        CpuBackend { isa: Isa::detect() }
    }

    /// The backend with the given microkernels; `None` if this CPU lacks the instructions.
    pub fn with_isa(isa: Isa) -> Option<Self> {
        let supported = match (isa, Isa::detect()) {
            (Isa::Portable, _) | (_, Isa::Avx512) => true,
            (Isa::Avx2, best) => best == Isa::Avx2,
            (Isa::Avx512, _) => false,
        };
        supported.then_some(CpuBackend { isa })
    }

    /// The microkernels in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The compiled forward kernel of a spec: compiled on first use, then cached for the
    /// process (a new shape never recompiles).
    pub fn kernel(&self, spec: &AttentionSpec) -> Result<Arc<CpuKernel>, RuntimeError> {
        self.kernel_of(spec, PlanKind::Forward)
    }

    /// The compiled kernel of a spec for a plan kind (forward or decode), cached like
    /// [`CpuBackend::kernel`].
    pub fn kernel_of(
        &self,
        spec: &AttentionSpec,
        kind: PlanKind,
    ) -> Result<Arc<CpuKernel>, RuntimeError> {
        crate::error::check_spec(spec)?;
        let key = (spec.to_string(), isa_name(self.isa), kind);
        if let Some(k) = cache().lock().expect("kernel cache lock").get(&key) {
            return Ok(Arc::clone(k));
        }
        let (qk_tile, pv_tile) = microkernels::addresses(self.isa);
        let (qk_rows, pv_rows) = row_kernels::addresses(self.isa, spec.dtype);
        let imports = Imports {
            qk_tile,
            pv_tile,
            qk_rows,
            pv_rows,
            logf: microkernels::logf as *const () as usize,
        };
        let plan = match kind {
            PlanKind::Forward => KernelPlan::forward(spec),
            PlanKind::Decode => KernelPlan::decode(spec),
        };
        let kernel = Arc::new(compile(&plan, &imports)?);
        cache()
            .lock()
            .expect("kernel cache lock")
            .insert(key, Arc::clone(&kernel));
        Ok(kernel)
    }

    /// Attention for a per-head spec: q `[B, Hq, Sq, D]`, k `[B, Hkv, Skv, D]`, v
    /// `[B, Hkv, Skv, Dv]` (any strides with contiguous rows are read in place; other layouts and
    /// dtypes are converted), keys at positions `position_offset + j`.
    pub fn forward(
        &self,
        spec: &AttentionSpec,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        if spec.mla().is_some() {
            return Err(RuntimeError::Spec(
                "this is an MLA spec: use forward_mla with q_nope, q_pe, c_kv, k_pe, w_kv_b".into(),
            ));
        }
        let kernel = self.kernel(spec)?;
        let (h, dv) = (spec.heads as usize, spec.v_head_dim as usize);
        let [b, sq, skv] = check_qkv(spec, q, k, v)?;
        let call = Call {
            batch: b,
            sq,
            skv,
            position_offset,
        };
        let (out, lse) = launch::run(&kernel, &Rows::of(q), &Rows::of(k), &Rows::of(v), &call)?;
        finish(spec.dtype, [b, h, sq, dv], out, lse)
    }
}

/// Inputs of MLA attention (DeepSeek layout; see `attn_dsl::reference::MlaInputs`).
#[derive(Clone, Copy, Debug)]
pub struct MlaTensors<'a> {
    /// `[B, H, Sq, head_dim]`.
    pub q_nope: &'a Tensor,
    /// `[B, H, Sq, rope_dim]`, before RoPE.
    pub q_pe: &'a Tensor,
    /// `[B, Skv, latent_rank]`, after the latent norm.
    pub c_kv: &'a Tensor,
    /// `[B, Skv, rope_dim]`, before RoPE.
    pub k_pe: &'a Tensor,
    /// `[H * (head_dim + v_head_dim), latent_rank]`.
    pub w_kv_b: &'a Tensor,
}

impl CpuBackend {
    /// MLA attention in the absorbed form: `q_latent = W_uk^T q_nope` per head, the kernel over
    /// one shared head `[c_kv | k_pe]` with values `c_kv`, then `out = W_uv out_latent`.
    pub fn forward_mla(
        &self,
        spec: &AttentionSpec,
        x: &MlaTensors,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        let a = AbsorbedForward::of(spec, x)?;
        let kernel = self.kernel(spec)?;
        let (wq, h, sq, skv) = (a.width(), spec.heads as usize, a.sq, a.skv);
        let call = Call {
            batch: a.b,
            sq,
            skv,
            position_offset,
        };
        let q_rows = Rows::borrowed(&a.q, [h * sq * wq, sq * wq, wq]);
        // Keys and values share storage: v is the latent part of each key row.
        let k_rows = Rows::borrowed(&a.k, [skv * wq, skv * wq, wq]);
        let v_rows = Rows::borrowed(&a.k, [skv * wq, skv * wq, wq]);
        let (latent, lse) = launch::run(&kernel, &q_rows, &k_rows, &v_rows, &call)?;
        a.finish(spec, &latent, lse)
    }
}

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
                "this spec has per-head KV: use forward with q, k, v".into(),
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
        let skv = match x.c_kv.shape() {
            [_, skv, _] => *skv,
            _ => 0,
        };
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

    /// `out = W_uv out_latent` per head, in the spec's dtype.
    pub fn finish(
        &self,
        spec: &AttentionSpec,
        latent: &[f32],
        lse: Vec<f32>,
    ) -> Result<Output, RuntimeError> {
        self.absorption
            .finish(spec, &self.w, latent, lse, self.b, self.sq)
    }
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

/// `c[m x n] = a[m x k] b[k x n]`, with `(row, column)` strides for a and b and row stride `ldc`
/// for c (the `gemm` crate).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    c: &mut [f32],
    ldc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(k == 0 || (last(m, k, rsa, csa) < a.len() && last(k, n, rsb, csb) < b.len()));
    assert!(last(m, n, ldc, 1) < c.len());
    if k == 0 {
        for row in c.chunks_mut(ldc).take(m) {
            row[..n].fill(0.0);
        }
        return;
    }
    // Small products stay on the calling thread; large ones (and decoding's matrix-vector
    // products over whole weight matrices) use rayon's threads.
    let parallelism = if m * n * k < 1 << 16 {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    };
    // SAFETY: the asserts above keep every element the product reads or writes inside the
    // slices; c is not read (read_dst = false).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            false,
            a.as_ptr(),
            csa as isize,
            rsa as isize,
            b.as_ptr(),
            csb as isize,
            rsb as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

pub(crate) fn check_dtype(name: &str, t: &Tensor, dtype: DType) -> Result<(), RuntimeError> {
    if t.dtype() == dtype {
        Ok(())
    } else {
        Err(RuntimeError::DType {
            tensor: name.into(),
            found: t.dtype().name().into(),
            expected: dtype.name().into(),
        })
    }
}

/// Checks per-head inputs against the spec: q `[B, heads, Sq, head_dim]`, k `[B, kv_heads, Skv,
/// head_dim]`, v `[B, kv_heads, Skv, v_head_dim]`, all in the spec's dtype. Returns B, Sq, Skv.
pub(crate) fn check_qkv(
    spec: &AttentionSpec,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<[usize; 3], RuntimeError> {
    let (h, hkv) = (spec.heads as usize, spec.kv_heads() as usize);
    let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
    let [b, _, sq, _] = dims("q", q, "[B, heads, Sq, head_dim]")?;
    expect("q", q, &[b, h, sq, d], "[B, heads, Sq, head_dim]")?;
    let [_, _, skv, _] = dims("k", k, "[B, kv_heads, Skv, head_dim]")?;
    expect("k", k, &[b, hkv, skv, d], "[B, kv_heads, Skv, head_dim]")?;
    expect("v", v, &[b, hkv, skv, dv], "[B, kv_heads, Skv, v_head_dim]")?;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        check_dtype(name, t, spec.dtype)?;
    }
    Ok([b, sq, skv])
}

pub(crate) fn finish(
    dtype: DType,
    shape: [usize; 4],
    out: Vec<f32>,
    lse: Vec<f32>,
) -> Result<Output, RuntimeError> {
    Ok(Output {
        out: Tensor::from_f32_as(dtype, &shape, out)?,
        lse: Tensor::from_f32(&shape[..3], lse)?,
    })
}

fn isa_name(isa: Isa) -> &'static str {
    match isa {
        Isa::Avx512 => "avx512",
        Isa::Avx2 => "avx2",
        Isa::Portable => "portable",
    }
}

pub(crate) fn dims(name: &str, t: &Tensor, expected: &str) -> Result<[usize; 4], RuntimeError> {
    t.shape().try_into().map_err(|_| RuntimeError::Shape {
        tensor: name.into(),
        found: t.shape().to_vec(),
        expected: expected.into(),
    })
}

pub(crate) fn expect(
    name: &str,
    t: &Tensor,
    shape: &[usize],
    what: &str,
) -> Result<(), RuntimeError> {
    if t.shape() == shape {
        Ok(())
    } else {
        Err(RuntimeError::Shape {
            tensor: name.into(),
            found: t.shape().to_vec(),
            expected: format!("{shape:?} = {what}"),
        })
    }
}
