//! Progress lines on stderr, each written whole.
//!
//! Rust's stderr is unbuffered, so `eprintln!` writes a formatted line piece by piece. Under
//! `mpirun` the ranks share one stderr, and their pieces interleave in the middle of lines.
//! `say!` formats the line first and hands it to the system in one write (a pipe takes a write
//! of up to 4 KiB whole).

/// `eprintln!` with the whole line, its newline included, in one write.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::say::line(format!($($arg)*))
    };
}

/// Writes `text` and a newline to stderr in one call. A closed stderr is not an error worth
/// stopping a run for: a failed write is dropped (where `eprintln!` would panic).
pub(crate) fn line(mut text: String) {
    use std::io::Write;
    text.push('\n');
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}
