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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
mod x86;

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
