//! The host's matrix product (the `gemm` crate), for MLA absorption and the models' projections.

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
