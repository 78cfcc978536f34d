//! Checks on the files attnc writes: never into a FIFO, device or directory, and never over one
//! of the command's own inputs.

use std::path::Path;

/// Refuses `output` (given by the option `flag`) when it exists and is not a regular file, or
/// when it is the same file as one of `inputs` (the same path, a link to it, or a hard link).
pub fn check(output: &Path, inputs: &[&Path], flag: &str) -> Result<(), String> {
    attn::runtime::files::ensure_writable_target(output).map_err(|e| format!("error: {e}"))?;
    for input in inputs {
        if same_file(output, input) {
            return Err(format!(
                "error: {flag} {} is the input {}: writing it would overwrite what is read; \
                 allowed: another file",
                output.display(),
                input.display()
            ));
        }
    }
    Ok(())
}

/// Whether `a` and `b` both exist and are one file.
fn same_file(a: &Path, b: &Path) -> bool {
    let (Ok(ma), Ok(mb)) = (std::fs::metadata(a), std::fs::metadata(b)) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        (ma.dev(), ma.ino()) == (mb.dev(), mb.ino())
    }
    #[cfg(not(unix))]
    {
        let _ = (ma, mb);
        matches!(
            (a.canonicalize(), b.canonicalize()),
            (Ok(x), Ok(y)) if x == y
        )
    }
}
