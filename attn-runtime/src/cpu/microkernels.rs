//! The dense tile products generated kernels call: `S = Q Kt` and `acc += P V` on tiles of
//! [`K_TILE`] keys. Native code, chosen once per process by the CPU's features: AVX-512, AVX2 with
//! FMA, or portable Rust.
//!
//! Contract (see `codegen::cpu::abi::Imports`): `qk_tile(q, q_stride, rows, dim, kt, s, row_max)`
//! writes `s[r*K + j] = sum_d q[r*q_stride + d] * kt[d*K + j]` for `r < rows`, `j < K`, and
//! `row_max[r] = max_j s[r*K + j]` (unless `row_max` is null: the backward needs no maxima);
//! `pv_tile(p, rows, cols, v, v_stride, acc, dv)` adds `sum_{j < cols} p[r*K + j] *
//! v[j*v_stride + c]` to `acc[r*dv + c]` for `r < rows`, `c < dv`. The backward also uses
//! `pv_tile` on a transposed `p` (`p[j*K + r]`): [`transposed_pv`], and both forms with the
//! key range of each row where its weights may be nonzero: [`spanned_pv`].

use codegen::plan::K_TILE;

const K: usize = K_TILE as usize;

/// Instruction sets the CPU kernels can use, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 with the bf16 dot products of `avx512_bf16` (`vdpbf16ps`), which a prompt's
    /// products with bf16 weights and a bf16 forward's `P V` use; every other kernel is
    /// [`Isa::Avx512`]'s.
    Avx512Bf16,
    /// AVX-512F (16 f32 lanes).
    Avx512,
    /// AVX2 with FMA (8 lanes).
    Avx2,
    /// Plain Rust.
    Portable,
}

impl Isa {
    /// Every set, best first.
    pub const ALL: [Isa; 4] = [Isa::Avx512Bf16, Isa::Avx512, Isa::Avx2, Isa::Portable];

    /// The best set this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512bf16")
            {
                return Isa::Avx512Bf16;
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Its name, as [`ISA_VARIABLE`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Bf16 => "avx512_bf16",
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }

    /// Whether this CPU has the instructions (each set's instructions include those of the
    /// sets after it).
    pub fn runs_here(self) -> bool {
        self as u8 >= Isa::detect() as u8
    }

    /// The set of its f32 vector kernels: [`Isa::Avx512`] for [`Isa::Avx512Bf16`], which
    /// differs only in its bf16 products; otherwise itself.
    pub fn vectors(self) -> Isa {
        match self {
            Isa::Avx512Bf16 => Isa::Avx512,
            isa => isa,
        }
    }

    /// The set [`ISA_VARIABLE`] names, when set (an unknown name, or one this CPU lacks, is an
    /// error that says what is allowed); else the best this CPU supports.
    pub fn from_env() -> Result<Isa, String> {
        let Some(name) = codegen::settings::cpu_isa() else {
            return Ok(Isa::detect());
        };
        let here: Vec<&str> = Isa::ALL
            .iter()
            .filter(|i| i.runs_here())
            .map(|i| i.name())
            .collect();
        let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
        let why = match Isa::ALL.iter().find(|i| i.name() == name.trim()) {
            Some(isa) if isa.runs_here() => return Ok(*isa),
            Some(_) => "this CPU lacks those instructions".to_string(),
            None if name.trim() == "amx" && amx_here() => {
                "no kernel uses the AMX tiles yet (bf16 products use avx512_bf16)".to_string()
            }
            None if name.trim() == "amx" => "this CPU lacks AMX-BF16".to_string(),
            None => format!("no such instruction set ({})", names.join(", ")),
        };
        Err(format!(
            "{ISA_VARIABLE}={name:?}: {why}; this CPU runs: {}",
            here.join(", ")
        ))
    }

    /// [`Isa::from_env`], read once per process. A bad value warns on stderr, once, and the
    /// best set is used (attnc refuses it before any work).
    pub fn chosen() -> Isa {
        static CHOSEN: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            Isa::from_env().unwrap_or_else(|e| {
                eprintln!("warning: {e}; using {}", Isa::detect().name());
                Isa::detect()
            })
        })
    }
}

/// Whether the CPU has AMX-BF16 tiles (which no kernel uses yet; `amx` as [`ISA_VARIABLE`] is
/// refused either way, with the reason).
fn amx_here() -> bool {
    // CPUID leaf 7, EDX bit 22: AMX-BF16 (std's detection of it is not stable yet).
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__cpuid_count, __get_cpuid_max};
        if __get_cpuid_max(0).0 >= 7 && __cpuid_count(7, 0).edx >> 22 & 1 == 1 {
            return true;
        }
    }
    false
}

/// The environment variable that picks the CPU kernels' instruction set: `avx512_bf16`,
/// `avx512`, `avx2` or `portable` (default: the best this CPU has).
pub const ISA_VARIABLE: &str = codegen::settings::CPU_ISA;

/// `qk_tile` and `pv_tile` for an instruction set, as C-ABI function addresses.
pub fn addresses(isa: Isa) -> (usize, usize) {
    type Qk = unsafe extern "C" fn(*const f32, i64, i64, i64, *const f32, *mut f32, *mut f32);
    let (qk, pv): (Qk, Pv) = match isa.vectors() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => (x86::qk_avx512, x86::pv_avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => (x86::qk_avx2, x86::pv_avx2),
        _ => (qk_portable, pv_portable),
    };
    (qk as usize, pv as usize)
}

/// Portable `qk_tile`.
///
/// # Safety
/// The pointers must address the ranges in the module contract, valid for the access.
pub unsafe extern "C" fn qk_portable(
    q: *const f32,
    q_stride: i64,
    rows: i64,
    dim: i64,
    kt: *const f32,
    s: *mut f32,
    row_max: *mut f32,
) {
    let (rows, dim, q_stride) = (rows as usize, dim as usize, q_stride as usize);
    // SAFETY: the caller passes rows of `q_stride` values, `dim * K` packed keys, `rows * K`
    // scores and `rows` maxima (the module contract).
    let (q, kt, s, row_max) = unsafe {
        (
            std::slice::from_raw_parts(q, (rows.max(1) - 1) * q_stride + dim),
            std::slice::from_raw_parts(kt, dim * K),
            std::slice::from_raw_parts_mut(s, rows * K),
            match row_max.is_null() {
                true => &mut [][..],
                false => std::slice::from_raw_parts_mut(row_max, rows),
            },
        )
    };
    for r in 0..rows {
        let out = &mut s[r * K..(r + 1) * K];
        out.fill(0.0);
        for d in 0..dim {
            let x = q[r * q_stride + d];
            for (o, k) in out.iter_mut().zip(&kt[d * K..(d + 1) * K]) {
                *o += x * k;
            }
        }
        if let Some(m) = row_max.get_mut(r) {
            *m = out.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        }
    }
}

/// The signature of `pv_tile` and of its transposed form.
type Pv = unsafe extern "C" fn(*const f32, i64, i64, *const f32, i64, *mut f32, i64);

/// `pv_tile` with `p` transposed, as a C-ABI function address: `acc[r*dv + c] += sum_{j < cols}
/// p[j*K + r] * v[j*v_stride + c]` (so `p` holds `cols` rows of `K` values, and `rows <= K`).
/// The backward uses it for `dV += P^T dO` and `dK += dS^T Q` without transposing tiles.
pub fn transposed_pv(isa: Isa) -> usize {
    let pt: Pv = match isa.vectors() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::pt_avx512,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::pt_avx2,
        _ => pt_portable,
    };
    pt as usize
}

/// `pv_tile` and its transposed form with one more argument, `spans`: null, or per row `r` of
/// `acc` the range `spans[2r]..spans[2r + 1]` of `j` outside which the row's weights are zero
/// (from [`super::spans::nonzero_spans`]). The sums skip those keys, which changes nothing but the time: on
/// a causal diagonal, half the tile. Only the AVX-512 kernels use the spans; the others run
/// every key. Returns the addresses of `(pv, pt)`.
pub fn spanned_pv(isa: Isa) -> (usize, usize) {
    let (pv, pt): (SpannedPv, SpannedPv) = match isa.vectors() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => (x86::spanned_avx512::<false>, x86::spanned_avx512::<true>),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => (
            every_key::<{ Isa::Avx2 as u8 }, false>,
            every_key::<{ Isa::Avx2 as u8 }, true>,
        ),
        _ => (
            every_key::<{ Isa::Portable as u8 }, false>,
            every_key::<{ Isa::Portable as u8 }, true>,
        ),
    };
    (pv as usize, pt as usize)
}

/// The signature of [`spanned_pv`]'s functions.
type SpannedPv =
    unsafe extern "C" fn(*const f32, i64, i64, *const f32, i64, *mut f32, i64, *const u32);

/// A spanned `pv_tile` (transposed when `T`) that ignores the spans: the `pv_tile` of `ISA`.
///
/// # Safety
/// The contract of [`spanned_pv`], on a CPU with `ISA`.
unsafe extern "C" fn every_key<const ISA: u8, const T: bool>(
    p: *const f32,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
    _spans: *const u32,
) {
    let isa = if ISA == Isa::Avx2 as u8 {
        Isa::Avx2
    } else {
        Isa::Portable
    };
    let f = if T {
        transposed_pv(isa)
    } else {
        addresses(isa).1
    };
    // SAFETY: `transposed_pv` and `addresses` give `pv_tile` functions of this signature (less
    // the spans), for an instruction set the caller's CPU has.
    unsafe { std::mem::transmute::<usize, Pv>(f)(p, rows, cols, v, v_stride, acc, dv) }
}

/// Where `pv_tile` reads its weights: `p[r * K + j]` for row `r` and key `j`, or `p[j * K + r]`
/// when `TRANSPOSED`. The layout is a constant so the microkernels address weights by constant
/// offsets.
#[derive(Clone, Copy)]
struct Weights<const TRANSPOSED: bool> {
    p: *const f32,
}

impl<const TRANSPOSED: bool> Weights<TRANSPOSED> {
    /// Row `r`, key `j`.
    ///
    /// # Safety
    /// `(r, j)` must lie in the range the caller's contract gives `p`.
    unsafe fn at(self, r: usize, j: usize) -> f32 {
        let offset = if TRANSPOSED { j * K + r } else { r * K + j };
        // SAFETY: the caller's contract.
        unsafe { *self.p.add(offset) }
    }
}

/// Portable `pv_tile`.
///
/// # Safety
/// The pointers must address the ranges in the module contract, valid for the access.
pub unsafe extern "C" fn pv_portable(
    p: *const f32,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
) {
    // SAFETY: the module contract.
    unsafe { pv_portable_with(Weights::<false> { p }, rows, cols, v, v_stride, acc, dv) }
}

/// Portable transposed `pv_tile` ([`transposed_pv`]).
///
/// # Safety
/// The pointers must address the ranges in [`transposed_pv`]'s contract.
pub unsafe extern "C" fn pt_portable(
    p: *const f32,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
) {
    // SAFETY: the contract of `transposed_pv`.
    unsafe { pv_portable_with(Weights::<true> { p }, rows, cols, v, v_stride, acc, dv) }
}

/// # Safety
/// As `pv_portable` or `pt_portable`, by `w`'s layout.
unsafe fn pv_portable_with<const T: bool>(
    w: Weights<T>,
    rows: i64,
    cols: i64,
    v: *const f32,
    v_stride: i64,
    acc: *mut f32,
    dv: i64,
) {
    let (rows, cols, v_stride, dv) = (rows as usize, cols as usize, v_stride as usize, dv as usize);
    if cols == 0 {
        return;
    }
    // SAFETY: the module contract: `cols` rows of V, `rows * dv` acc.
    let (v, acc) = unsafe {
        (
            std::slice::from_raw_parts(v, (cols - 1) * v_stride + dv),
            std::slice::from_raw_parts_mut(acc, rows * dv),
        )
    };
    for r in 0..rows {
        let out = &mut acc[r * dv..(r + 1) * dv];
        for j in 0..cols {
            // SAFETY: r < rows, j < cols: inside `w`'s range.
            let w = unsafe { w.at(r, j) };
            for (o, x) in out.iter_mut().zip(&v[j * v_stride..j * v_stride + dv]) {
                *o += w * x;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
// Index loops mirror the register blocking (rows x vectors) and keep the accumulators in
// registers; iterator chains over two arrays would obscure that.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use super::{K, Weights};
    use std::arch::x86_64::*;
    use std::ptr::null;

    /// AVX-512 `qk_tile`: six rows by 64 keys (24 accumulators) per step.
    ///
    /// # Safety
    /// The module contract, on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe extern "C" fn qk_avx512(
        q: *const f32,
        q_stride: i64,
        rows: i64,
        dim: i64,
        kt: *const f32,
        s: *mut f32,
        row_max: *mut f32,
    ) {
        let (rows, dim, qs) = (rows as usize, dim as usize, q_stride as usize);
        let mut r = 0;
        // SAFETY: rows r..r+R < `rows`; the callee stays within d < `dim` and K key lanes.
        unsafe {
            while r + 6 <= rows {
                qk_rows::<6>(q, qs, dim, kt, s, row_max, r);
                r += 6;
            }
            while r + 2 <= rows {
                qk_rows::<2>(q, qs, dim, kt, s, row_max, r);
                r += 2;
            }
            while r < rows {
                qk_rows::<1>(q, qs, dim, kt, s, row_max, r);
                r += 1;
            }
        }
    }

    /// Rows `r..r+R` of `qk_tile`; `R` is a constant so the `4R` accumulators stay in registers.
    ///
    /// # Safety
    /// As [`qk_avx512`], with `r + R <= rows`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn qk_rows<const R: usize>(
        q: *const f32,
        qs: usize,
        dim: usize,
        kt: *const f32,
        s: *mut f32,
        row_max: *mut f32,
        r: usize,
    ) {
        // SAFETY: rows r..r+R, d < dim, key lanes < K (the module contract).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            for d in 0..dim {
                let kd = kt.add(d * K);
                let k = [0, 16, 32, 48].map(|o| _mm512_loadu_ps(kd.add(o)));
                for i in 0..R {
                    let x = _mm512_set1_ps(*q.add((r + i) * qs + d));
                    for j in 0..4 {
                        acc[i][j] = _mm512_fmadd_ps(x, k[j], acc[i][j]);
                    }
                }
            }
            for i in 0..R {
                for j in 0..4 {
                    _mm512_storeu_ps(s.add((r + i) * K + 16 * j), acc[i][j]);
                }
                if !row_max.is_null() {
                    let m01 = _mm512_max_ps(acc[i][0], acc[i][1]);
                    let m23 = _mm512_max_ps(acc[i][2], acc[i][3]);
                    *row_max.add(r + i) = _mm512_reduce_max_ps(_mm512_max_ps(m01, m23));
                }
            }
        }
    }

    /// AVX-512 `pv_tile`: six rows by up to 64 value dims per step, masked at the dim edge.
    ///
    /// # Safety
    /// The module contract, on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe extern "C" fn pv_avx512(
        p: *const f32,
        rows: i64,
        cols: i64,
        v: *const f32,
        v_stride: i64,
        acc: *mut f32,
        dv: i64,
    ) {
        // SAFETY: the module contract, on a CPU with AVX-512F.
        unsafe {
            pv_avx512_with(
                Weights::<false> { p },
                rows,
                cols,
                v,
                v_stride,
                acc,
                dv,
                null(),
            )
        }
    }

    /// AVX-512 transposed `pv_tile` (`super::transposed_pv`).
    ///
    /// # Safety
    /// The contract of `transposed_pv`, on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe extern "C" fn pt_avx512(
        p: *const f32,
        rows: i64,
        cols: i64,
        v: *const f32,
        v_stride: i64,
        acc: *mut f32,
        dv: i64,
    ) {
        // SAFETY: the contract of `transposed_pv`, on a CPU with AVX-512F.
        unsafe {
            pv_avx512_with(
                Weights::<true> { p },
                rows,
                cols,
                v,
                v_stride,
                acc,
                dv,
                null(),
            )
        }
    }

    /// AVX-512 spanned `pv_tile`, transposed when `T` (`super::spanned_pv`).
    ///
    /// # Safety
    /// The contract of `spanned_pv`, on a CPU with AVX-512F.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe extern "C" fn spanned_avx512<const T: bool>(
        p: *const f32,
        rows: i64,
        cols: i64,
        v: *const f32,
        v_stride: i64,
        acc: *mut f32,
        dv: i64,
        spans: *const u32,
    ) {
        let w = Weights::<T> { p };
        // SAFETY: the contract of `spanned_pv`, on a CPU with AVX-512F.
        unsafe { pv_avx512_with(w, rows, cols, v, v_stride, acc, dv, spans) }
    }

    /// # Safety
    /// As `pv_avx512` or `pt_avx512`, by `w`'s layout; `spans` null or as `spanned_pv` says.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn pv_avx512_with<const T: bool>(
        w: Weights<T>,
        rows: i64,
        cols: i64,
        v: *const f32,
        v_stride: i64,
        acc: *mut f32,
        dv: i64,
        spans: *const u32,
    ) {
        let (rows, dv) = (rows as usize, dv as usize);
        let mut c0 = 0;
        while c0 < dv {
            let width = (dv - c0).min(64);
            let masks: [__mmask16; 4] = [0, 1, 2, 3].map(|k| {
                let lanes = width.saturating_sub(16 * k).min(16);
                ((1u32 << lanes) - 1) as __mmask16
            });
            let panel = Panel {
                w,
                cols: cols as usize,
                spans,
                v: v.wrapping_add(c0),
                v_stride: v_stride as usize,
                acc: acc.wrapping_add(c0),
                dv,
                masks,
            };
            // SAFETY: the panel addresses the contract's ranges.
            unsafe {
                if width == 64 {
                    pv_panel::<false, T>(&panel, rows);
                } else {
                    pv_panel::<true, T>(&panel, rows);
                }
            }
            c0 += 64;
        }
    }

    /// One 64-dim panel of `pv_tile`: value columns `c0..c0+64` (masked past `dv`).
    struct Panel<const T: bool> {
        w: Weights<T>,
        cols: usize,
        /// Null, or per row the range of keys outside which its weights are zero.
        spans: *const u32,
        v: *const f32,
        v_stride: usize,
        acc: *mut f32,
        dv: usize,
        masks: [__mmask16; 4],
    }

    impl<const T: bool> Panel<T> {
        /// The keys rows `r..r + n` sum over: every key, or the union of their spans.
        ///
        /// # Safety
        /// `spans` is null or holds the spans of rows `r..r + n`.
        unsafe fn keys(&self, r: usize, n: usize) -> std::ops::Range<usize> {
            if self.spans.is_null() {
                return 0..self.cols;
            }
            // SAFETY: the caller's contract.
            let spans = unsafe { std::slice::from_raw_parts(self.spans.add(2 * r), 2 * n) };
            let live = || spans.chunks_exact(2).filter(|s| s[0] < s[1]);
            let lo = live().map(|s| s[0]).min().unwrap_or(0) as usize;
            let hi = live().map(|s| s[1]).max().unwrap_or(0) as usize;
            lo.min(hi)..hi.min(self.cols)
        }
    }

    /// All `rows` of a panel, six at a time. `MASKED` panels are narrower than 64 dims; full ones
    /// load without masks, since a masked load costs an extra vector uop, on the ports the FMAs
    /// need.
    ///
    /// # Safety
    /// As [`pv_avx512`]; a panel that is not `MASKED` is 64 dims wide.
    #[target_feature(enable = "avx512f")]
    unsafe fn pv_panel<const MASKED: bool, const T: bool>(panel: &Panel<T>, rows: usize) {
        let mut r = 0;
        // SAFETY: rows r..r+R < `rows` and the panel addresses the contract's ranges.
        unsafe {
            while r + 6 <= rows {
                pv_rows::<6, MASKED, T>(panel, r);
                r += 6;
            }
            while r + 2 <= rows {
                pv_rows::<2, MASKED, T>(panel, r);
                r += 2;
            }
            while r < rows {
                pv_rows::<1, MASKED, T>(panel, r);
                r += 1;
            }
        }
    }

    /// Rows `r..r+R` of a panel; `R` is a constant so the `4R` accumulators stay in registers.
    ///
    /// # Safety
    /// As [`pv_panel`], with `r + R <= rows`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn pv_rows<const R: usize, const MASKED: bool, const T: bool>(x: &Panel<T>, r: usize) {
        // SAFETY: rows r..r+R, keys j < cols, value lanes masked to the panel's width.
        unsafe {
            let load = |at: *const f32, k: usize| {
                if MASKED {
                    _mm512_maskz_loadu_ps(x.masks[k], at)
                } else {
                    _mm512_loadu_ps(at)
                }
            };
            let mut a = [[_mm512_setzero_ps(); 4]; R];
            for i in 0..R {
                for k in 0..4 {
                    a[i][k] = load(x.acc.add((r + i) * x.dv + 16 * k), k);
                }
            }
            for j in x.keys(r, R) {
                let vj = x.v.add(j * x.v_stride);
                let vals = [0, 1, 2, 3].map(|k| load(vj.add(16 * k), k));
                for i in 0..R {
                    let w = _mm512_set1_ps(x.w.at(r + i, j));
                    for k in 0..4 {
                        a[i][k] = _mm512_fmadd_ps(w, vals[k], a[i][k]);
                    }
                }
            }
            for i in 0..R {
                for k in 0..4 {
                    let at = x.acc.add((r + i) * x.dv + 16 * k);
                    if MASKED {
                        _mm512_mask_storeu_ps(at, x.masks[k], a[i][k]);
                    } else {
                        _mm512_storeu_ps(at, a[i][k]);
                    }
                }
            }
        }
    }

    /// AVX2 `qk_tile`: two rows by 32 keys (8 accumulators) per step, two halves per tile.
    ///
    /// # Safety
    /// The module contract, on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe extern "C" fn qk_avx2(
        q: *const f32,
        q_stride: i64,
        rows: i64,
        dim: i64,
        kt: *const f32,
        s: *mut f32,
        row_max: *mut f32,
    ) {
        let (rows, dim, qs) = (rows as usize, dim as usize, q_stride as usize);
        // SAFETY: rows r..r+R < `rows`; the callee stays within d < `dim` and K key lanes.
        unsafe {
            for half in [0, 32] {
                let mut r = 0;
                while r + 2 <= rows {
                    qk_rows_avx2::<2>(q, qs, dim, kt, s, r, half);
                    r += 2;
                }
                if r < rows {
                    qk_rows_avx2::<1>(q, qs, dim, kt, s, r, half);
                }
            }
            if !row_max.is_null() {
                for r in 0..rows {
                    let row = std::slice::from_raw_parts(s.add(r * K), K);
                    *row_max.add(r) = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                }
            }
        }
    }

    /// Rows `r..r+R`, keys `half..half+32` of the AVX2 `qk_tile`.
    ///
    /// # Safety
    /// As [`qk_avx2`], with `r + R <= rows` and `half` 0 or 32.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn qk_rows_avx2<const R: usize>(
        q: *const f32,
        qs: usize,
        dim: usize,
        kt: *const f32,
        s: *mut f32,
        r: usize,
        half: usize,
    ) {
        // SAFETY: rows r..r+R, d < dim, key lanes half..half+32 < K.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 4]; R];
            for d in 0..dim {
                let kd = kt.add(d * K + half);
                let k = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(kd.add(o)));
                for i in 0..R {
                    let x = _mm256_set1_ps(*q.add((r + i) * qs + d));
                    for j in 0..4 {
                        acc[i][j] = _mm256_fmadd_ps(x, k[j], acc[i][j]);
                    }
                }
            }
            for i in 0..R {
                for j in 0..4 {
                    _mm256_storeu_ps(s.add((r + i) * K + half + 8 * j), acc[i][j]);
                }
            }
        }
    }

    /// AVX2 `pv_tile`: two rows by 32 value dims per step; the dim tail in scalar code.
    ///
    /// # Safety
    /// The module contract, on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe extern "C" fn pv_avx2(
        p: *const f32,
        rows: i64,
        cols: i64,
        v: *const f32,
        v_stride: i64,
        acc: *mut f32,
        dv: i64,
    ) {
        // SAFETY: the module contract, on a CPU with AVX2 and FMA.
        unsafe { pv_avx2_with(Weights::<false> { p }, rows, cols, v, v_stride, acc, dv) }
    }

    /// AVX2 transposed `pv_tile` (`super::transposed_pv`).
    ///
    /// # Safety
    /// The contract of `transposed_pv`, on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe extern "C" fn pt_avx2(
        p: *const f32,
        rows: i64,
        cols: i64,
        v: *const f32,
        v_stride: i64,
        acc: *mut f32,
        dv: i64,
    ) {
        // SAFETY: the contract of `transposed_pv`, on a CPU with AVX2 and FMA.
        unsafe { pv_avx2_with(Weights::<true> { p }, rows, cols, v, v_stride, acc, dv) }
    }

    /// # Safety
    /// As `pv_avx2` or `pt_avx2`, by `w`'s layout.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pv_avx2_with<const T: bool>(
        p: Weights<T>,
        rows: i64,
        cols: i64,
        v: *const f32,
        v_stride: i64,
        acc: *mut f32,
        dv: i64,
    ) {
        let (rows, cols, vs, dv) = (rows as usize, cols as usize, v_stride as usize, dv as usize);
        let vec_dims = dv / 32 * 32;
        // SAFETY: rows r..r+R < `rows`, keys j < `cols`, dims < `dv` (the module contract).
        unsafe {
            for c0 in (0..vec_dims).step_by(32) {
                let mut r = 0;
                while r + 2 <= rows {
                    pv_rows_avx2::<2, T>(p, cols, v.add(c0), vs, acc.add(c0), dv, r);
                    r += 2;
                }
                if r < rows {
                    pv_rows_avx2::<1, T>(p, cols, v.add(c0), vs, acc.add(c0), dv, r);
                }
            }
            for r in 0..rows {
                for j in 0..cols {
                    let w = p.at(r, j);
                    for c in vec_dims..dv {
                        *acc.add(r * dv + c) += w * *v.add(j * vs + c);
                    }
                }
            }
        }
    }

    /// Rows `r..r+R` of a 32-dim panel of the AVX2 `pv_tile`.
    ///
    /// # Safety
    /// As [`pv_avx2`], with `r + R <= rows` and 32 dims from `v` and `acc`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn pv_rows_avx2<const R: usize, const T: bool>(
        p: Weights<T>,
        cols: usize,
        v: *const f32,
        vs: usize,
        acc: *mut f32,
        dv: usize,
        r: usize,
    ) {
        // SAFETY: rows r..r+R, keys j < cols, 32 dims of the panel.
        unsafe {
            let mut a = [[_mm256_setzero_ps(); 4]; R];
            for i in 0..R {
                for k in 0..4 {
                    a[i][k] = _mm256_loadu_ps(acc.add((r + i) * dv + 8 * k));
                }
            }
            for j in 0..cols {
                let vj = v.add(j * vs);
                let x = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(vj.add(o)));
                for i in 0..R {
                    let w = _mm256_set1_ps(p.at(r + i, j));
                    for k in 0..4 {
                        a[i][k] = _mm256_fmadd_ps(w, x[k], a[i][k]);
                    }
                }
            }
            for i in 0..R {
                for k in 0..4 {
                    _mm256_storeu_ps(acc.add((r + i) * dv + 8 * k), a[i][k]);
                }
            }
        }
    }
}

/// The FMA throughput of the `qk_tile` microkernel on L1-resident tiles (64 rows, head dim 128),
/// in GFLOP/s summed over `threads` threads: the ceiling any kernel built on it can reach.
pub fn peak_gflops(isa: Isa, threads: usize, seconds: f64) -> f64 {
    const ROWS: usize = 64;
    const DIM: usize = 128;
    let (qk, _) = addresses(isa);
    // SAFETY: `addresses` returns a `qk_tile` with this signature.
    let qk: unsafe extern "C" fn(*const f32, i64, i64, i64, *const f32, *mut f32, *mut f32) =
        unsafe { std::mem::transmute::<usize, _>(qk) };
    let flops_per_call = (2 * ROWS * DIM * K) as f64;
    let per_thread: Vec<f64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(move || {
                    let q = vec![0.5f32; ROWS * DIM];
                    let kt = vec![0.25f32; DIM * K];
                    let mut s = vec![0f32; ROWS * K];
                    let mut row_max = vec![0f32; ROWS];
                    let start = std::time::Instant::now();
                    let mut calls = 0u64;
                    while start.elapsed().as_secs_f64() < seconds {
                        for _ in 0..64 {
                            // SAFETY: q holds ROWS rows of DIM, kt DIM x K, s ROWS x K values,
                            // row_max ROWS.
                            unsafe {
                                qk(
                                    q.as_ptr(),
                                    DIM as i64,
                                    ROWS as i64,
                                    DIM as i64,
                                    kt.as_ptr(),
                                    s.as_mut_ptr(),
                                    row_max.as_mut_ptr(),
                                )
                            };
                        }
                        calls += 64;
                    }
                    std::hint::black_box(&s);
                    calls as f64 * flops_per_call / start.elapsed().as_secs_f64() / 1e9
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("peak thread"))
            .collect()
    });
    per_thread.iter().sum()
}

/// `logf` for generated code.
pub extern "C" fn logf(x: f32) -> f32 {
    x.ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::spans::{banded, nonzero_spans};

    type Spanned =
        unsafe extern "C" fn(*const f32, i64, i64, *const f32, i64, *mut f32, i64, *const u32);

    /// Products that skip keys outside the spans equal the products over every key, NaN
    /// included, on every instruction set here, for both weight layouts.
    #[test]
    fn spanned_products_equal_the_full_ones() {
        let (rows, cols, dv) = (61, 50, 72);
        let tiles = banded(rows, cols, 0.71);
        let v: Vec<f32> = (0..K * dv).map(|i| (i as f32 * 0.013).cos()).collect();
        for isa in [Isa::detect(), Isa::Portable] {
            let (mut by_row, mut by_col) = ([0u32; 2 * K], [0u32; 2 * K]);
            let spanned = nonzero_spans(
                isa,
                [&tiles[0], &tiles[1]],
                rows,
                cols,
                &mut by_row,
                &mut by_col,
            );
            let (pv, pt) = spanned_pv(isa);
            // (function, rows of acc, keys, spans): `pt` sums over the tile's rows.
            let cases = [
                (pv, rows, cols, by_row.as_ptr()),
                (pt, cols, rows, by_col.as_ptr()),
            ];
            for (f, out_rows, keys, spans) in cases {
                // SAFETY: `spanned_pv` returns functions of this signature.
                let f: Spanned = unsafe { std::mem::transmute::<usize, Spanned>(f) };
                for tile in &tiles {
                    let run = |spans: *const u32| {
                        let mut acc: Vec<f32> = (0..out_rows * dv).map(|i| i as f32).collect();
                        // SAFETY: a tile of K x K weights, `keys` rows of v (`dv` wide), `out_rows`
                        // rows of acc, spans null or one pair per acc row.
                        unsafe {
                            f(
                                tile.as_ptr(),
                                out_rows as i64,
                                keys as i64,
                                v.as_ptr(),
                                dv as i64,
                                acc.as_mut_ptr(),
                                dv as i64,
                                spans,
                            )
                        };
                        acc
                    };
                    let (full, skipping) = (run(std::ptr::null()), run(spans));
                    assert!(spanned || isa.vectors() != Isa::Avx512);
                    for (i, (a, b)) in full.iter().zip(&skipping).enumerate() {
                        assert!(
                            a == b || (a.is_nan() && b.is_nan()),
                            "{isa:?} [{i}]: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
